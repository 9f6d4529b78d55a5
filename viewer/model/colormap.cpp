// colormap.cpp: load and expert colours, matrices to images (colormap.h).
#include "colormap.h"

#include <algorithm>
#include <cmath>

namespace moe::viewer {

Rgba load_color(float t) {
  if (std::isnan(t)) return kNoDataColor;
  t = std::clamp(t, 0.0f, 1.0f);
  const float position = t * 4.0f;  // 4 intervals between the 5 stops
  const int i = std::min(3, static_cast<int>(position));
  const float f = position - static_cast<float>(i);
  const Rgba& a = kLoadStops[i];
  const Rgba& b = kLoadStops[i + 1];
  auto mix = [f](uint8_t x, uint8_t y) {
    return static_cast<uint8_t>(std::lround(x + (static_cast<float>(y) - x) * f));
  };
  return {mix(a.r, b.r), mix(a.g, b.g), mix(a.b, b.b), 255};
}

Rgba expert_color(int64_t expert) {
  // Hue by the golden angle; saturation and value fixed so text on it stays readable.
  const double hue = std::fmod(static_cast<double>(expert < 0 ? 0 : expert) * 137.50776, 360.0) / 60.0;
  const double s = 0.65, v = 0.95;
  const double c = v * s, x = c * (1 - std::fabs(std::fmod(hue, 2.0) - 1)), m = v - c;
  double r = 0, g = 0, b = 0;
  switch (static_cast<int>(hue)) {
    case 0: r = c; g = x; break;
    case 1: r = x; g = c; break;
    case 2: g = c; b = x; break;
    case 3: g = x; b = c; break;
    case 4: r = x; b = c; break;
    default: r = c; b = x; break;
  }
  auto to8 = [m](double u) { return static_cast<uint8_t>(std::lround((u + m) * 255)); };
  return {to8(r), to8(g), to8(b), 255};
}

Image colorize(const Matrix& m, float lo, float hi) {
  Image image;
  if (m.rows <= 0 || m.cols <= 0 || m.values.size() != static_cast<size_t>(m.rows * m.cols)) return image;
  image.width = m.cols;
  image.height = m.rows;
  image.rgba.resize(static_cast<size_t>(m.rows * m.cols * 4));
  const float span = hi > lo ? hi - lo : 1.0f;
  for (size_t i = 0; i < m.values.size(); ++i) {
    const float v = m.values[i];
    const Rgba c = load_color(std::isnan(v) ? v : (v - lo) / span);
    image.rgba[i * 4 + 0] = c.r;
    image.rgba[i * 4 + 1] = c.g;
    image.rgba[i * 4 + 2] = c.b;
    image.rgba[i * 4 + 3] = c.a;
  }
  return image;
}

}  // namespace moe::viewer
