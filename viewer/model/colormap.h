// colormap.h: the viewer's colours as plain data, so tests can say which colour a pixel must have.
//
// Load colours map a value t in [0, 1] through five stops: 0 near-black navy (an idle expert),
// 0.5 teal (an expert at its fair share when the scale is 0..2x the mean), 1 pale yellow (twice
// its share or more). Expert colours are categorical: expert e gets a hue by the golden angle,
// so neighbours differ. NaN (no data) is a neutral grey.
//   moe::viewer::Rgba c = moe::viewer::load_color(0.5f);
// Built into moe_viewer_model; tested by tests/viewer/test_downsample.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "downsample.h"  // Matrix

namespace moe::viewer {

struct Rgba {
  uint8_t r = 0, g = 0, b = 0, a = 255;
  bool operator==(const Rgba&) const = default;
};

Rgba load_color(float t);        // t clamped to [0, 1]; NaN -> kNoDataColor
Rgba expert_color(int64_t expert);
inline constexpr Rgba kNoDataColor{70, 70, 70, 255};
inline constexpr Rgba kLoadStops[5] = {
    {18, 18, 40, 255}, {45, 80, 160, 255}, {35, 160, 150, 255}, {235, 150, 40, 255}, {255, 240, 130, 255}};

// An RGBA8 image, rows top to bottom, as glTexImage2D and stb_image_write take it.
struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgba;  // [height * width * 4]
};

// Colours each cell of `m` by load_color((v - lo) / (hi - lo)): matrix row r becomes image row r.
Image colorize(const Matrix& m, float lo, float hi);

}  // namespace moe::viewer
