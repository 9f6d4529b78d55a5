// screenshot.h: reads the frame just rendered back from OpenGL and writes it as a PNG, and writes
// the named regions of the frame as JSON (what the screenshot tests look at).
//   moe::viewer::write_screenshot("viewer/screenshots/routing.png", width, height);  // before swap
// PNG writing is stb_image_write, from Debian's libstb (its shared library holds the
// implementation, so STB_IMAGE_WRITE_IMPLEMENTATION is not defined here). Part of moe_viewer.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "viewer_state.h"  // Region

namespace moe::viewer {

// Reads the back buffer (width x height pixels), flips it top-down and writes an RGB PNG.
// Returns "" on success, else the reason.
std::string write_screenshot(const std::filesystem::path& file, int width, int height);

// {"width": W, "height": H, "regions": {"routing_heatmap": [x0, y0, x1, y1], ...}} in pixels
// from the top left of the PNG.
std::string write_regions(const std::filesystem::path& file, const std::vector<Region>& regions, int width, int height);

}  // namespace moe::viewer
