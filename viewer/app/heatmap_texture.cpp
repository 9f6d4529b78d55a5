// heatmap_texture.cpp: prepared heatmap images as OpenGL textures (heatmap_texture.h).
#include "heatmap_texture.h"

#include <cstdint>
#include <utility>

#include <GL/gl.h>  // glGenTextures, glTexImage2D: OpenGL 1.1, no loader needed

namespace moe::viewer {

HeatmapTexture::HeatmapTexture(HeatmapTexture&& other) noexcept
    : key(std::move(other.key)), width(other.width), height(other.height), texture_(std::exchange(other.texture_, 0)) {}

HeatmapTexture& HeatmapTexture::operator=(HeatmapTexture&& other) noexcept {
  if (this != &other) {
    if (texture_) glDeleteTextures(1, &texture_);
    key = std::move(other.key);
    width = other.width;
    height = other.height;
    texture_ = std::exchange(other.texture_, 0);
  }
  return *this;
}

HeatmapTexture::~HeatmapTexture() {
  if (texture_) glDeleteTextures(1, &texture_);
}

void HeatmapTexture::upload(const Image& image, const std::string& new_key) {
  key = new_key;
  width = static_cast<int>(image.width);
  height = static_cast<int>(image.height);
  if (empty()) return;
  if (!texture_) glGenTextures(1, &texture_);
  glBindTexture(GL_TEXTURE_2D, texture_);
  glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_MIN_FILTER, GL_NEAREST);
  glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_MAG_FILTER, GL_NEAREST);
  glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_WRAP_S, GL_CLAMP_TO_EDGE);
  glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_WRAP_T, GL_CLAMP_TO_EDGE);
  glPixelStorei(GL_UNPACK_ALIGNMENT, 1);
  glTexImage2D(GL_TEXTURE_2D, 0, GL_RGBA, width, height, 0, GL_RGBA, GL_UNSIGNED_BYTE, image.rgba.data());
}

ImTextureID HeatmapTexture::id() const {
  return reinterpret_cast<ImTextureID>(static_cast<intptr_t>(texture_));
}

}  // namespace moe::viewer
