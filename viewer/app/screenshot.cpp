// screenshot.cpp: frame read-back to PNG, regions to JSON (screenshot.h).
#include "screenshot.h"

#include <cstdint>
#include <fstream>
#include <vector>

#include <GL/gl.h>               // glReadPixels (OpenGL 1.1)
#include <nlohmann/json.hpp>
#include <stb_image_write.h>     // stbi_write_png, implemented in Debian's libstb

namespace moe::viewer {

std::string write_screenshot(const std::filesystem::path& file, int width, int height) {
  if (width <= 0 || height <= 0) return "empty frame";
  std::vector<uint8_t> pixels(static_cast<size_t>(width) * static_cast<size_t>(height) * 3);
  glPixelStorei(GL_PACK_ALIGNMENT, 1);
  glReadBuffer(GL_BACK);
  glReadPixels(0, 0, width, height, GL_RGB, GL_UNSIGNED_BYTE, pixels.data());
  if (glGetError() != GL_NO_ERROR) return "glReadPixels failed";
  // OpenGL's rows go bottom-up, PNG's top-down.
  const size_t stride = static_cast<size_t>(width) * 3;
  std::vector<uint8_t> flipped(pixels.size());
  for (int y = 0; y < height; ++y)
    std::copy_n(&pixels[static_cast<size_t>(height - 1 - y) * stride], stride, &flipped[static_cast<size_t>(y) * stride]);
  std::error_code ec;
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
  if (!stbi_write_png(file.string().c_str(), width, height, 3, flipped.data(), static_cast<int>(stride)))
    return "cannot write " + file.string();
  return "";
}

std::string write_regions(const std::filesystem::path& file, const std::vector<Region>& regions, int width, int height) {
  nlohmann::json out = {{"width", width}, {"height", height}, {"regions", nlohmann::json::object()}};
  for (const Region& r : regions) out["regions"][r.name] = {r.x0, r.y0, r.x1, r.y1};
  std::ofstream stream(file);
  stream << out.dump(1) << "\n";
  return stream ? "" : "cannot write " + file.string();
}

}  // namespace moe::viewer
