// heatmap_texture.h: an OpenGL texture holding one prepared heatmap image, re-uploaded only when
// what it shows changes (its key), so a 10,000 x 64 heatmap costs one quad per frame.
//   HeatmapTexture& t = state.textures["routing/run0/layer0"];
//   if (t.key != key) t.upload(image, key);
//   ImGui::Image(t.id(), size);
// Needs a current OpenGL context. Part of moe_viewer.
#pragma once

#include <string>

#include <imgui.h>

#include "colormap.h"  // Image

namespace moe::viewer {

class HeatmapTexture {
 public:
  HeatmapTexture() = default;
  HeatmapTexture(const HeatmapTexture&) = delete;
  HeatmapTexture& operator=(const HeatmapTexture&) = delete;
  HeatmapTexture(HeatmapTexture&& other) noexcept;
  HeatmapTexture& operator=(HeatmapTexture&& other) noexcept;
  ~HeatmapTexture();

  // Uploads with nearest filtering: each cell stays a sharp block at any zoom.
  void upload(const Image& image, const std::string& new_key);
  ImTextureID id() const;
  bool empty() const { return width == 0 || height == 0; }

  std::string key;  // what the texture shows; compared by the caller to decide on re-upload
  int width = 0, height = 0;

 private:
  unsigned int texture_ = 0;  // GLuint
};

}  // namespace moe::viewer
