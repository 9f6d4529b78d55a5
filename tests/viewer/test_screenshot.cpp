// test_screenshot.cpp: runs moe_viewer headless (--screenshot under xvfb-run, Mesa's llvmpipe)
// on synthetic runs with known routing and checks the pictures' colours where the viewer says its
// heatmaps are (--regions): with every token on expert 3, expert 3's row of the step x expert
// heatmap is the top colour of the scale and every other row the bottom one. Also: a corrupt run
// gives a picture and a message, not a crash; two runs are drawn side by side; on the recorded runs,
// the offload panel's expert cache and the all-to-all panel's byte matrix of one layer.
// Skips, saying so, only where xvfb-run is missing.   ctest --test-dir build -R ViewerScreenshot
#include <gtest/gtest.h>

#include <sys/wait.h>  // WEXITSTATUS

#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>
#include <stb_image.h>  // stbi_load; the implementation is in Debian's libstb

#include "colormap.h"
#include "inference_view.h"  // cache_cell_color
#include "synthetic_run.h"
#include "viewer_test_support.h"

namespace moe::viewer {
namespace {

using testing::TempDir;

bool HaveXvfb() { return std::system("command -v xvfb-run >/dev/null 2>&1") == 0; }

struct Picture {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  nlohmann::json regions;
  Rgba at(float x, float y) const {
    const int ix = static_cast<int>(x), iy = static_cast<int>(y);
    const size_t i = (static_cast<size_t>(iy) * static_cast<size_t>(width) + static_cast<size_t>(ix)) * 3;
    return {rgb[i], rgb[i + 1], rgb[i + 2], 255};
  }
};

// Runs the viewer; returns its exit status and fills `picture` and `log` (stdout + stderr).
int RunViewer(const TempDir& dir, const std::string& args, Picture& picture, std::string& log) {
  const auto png = dir.path() / "shot.png", regions = dir.path() / "shot.json", out = dir.path() / "log.txt";
  std::filesystem::remove(png);
  const std::string command = "xvfb-run -a " + std::string(MOE_VIEWER_PATH) + " " + args + " --screenshot " + png.string() +
                              " --regions " + regions.string() + " --width 1200 --height 900 > " + out.string() + " 2>&1";
  const int status = std::system(command.c_str());
  log = testing::read_text(out);
  int channels = 0;
  if (unsigned char* data = stbi_load(png.string().c_str(), &picture.width, &picture.height, &channels, 3)) {
    picture.rgb.assign(data, data + static_cast<size_t>(picture.width) * static_cast<size_t>(picture.height) * 3);
    stbi_image_free(data);
  }
  if (std::filesystem::exists(regions)) picture.regions = nlohmann::json::parse(testing::read_text(regions))["regions"];
  return status;
}

::testing::AssertionResult Near(const Rgba& got, const Rgba& want, int tolerance = 3) {
  if (std::abs(got.r - want.r) <= tolerance && std::abs(got.g - want.g) <= tolerance && std::abs(got.b - want.b) <= tolerance)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "pixel (" << int(got.r) << "," << int(got.g) << "," << int(got.b) << ") want ("
                                       << int(want.r) << "," << int(want.g) << "," << int(want.b) << ")";
}

class ViewerScreenshot : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveXvfb()) GTEST_SKIP() << "xvfb-run is not installed (Debian package xvfb; ./moe deps installs it)";
  }
  TempDir dir;
};

TEST_F(ViewerScreenshot, HotExpertRowIsTheTopColour) {
  const auto run = dir.path() / "hot";
  write_synthetic_run(run, {.steps = 40, .experts = 8, .layers = 2, .ranks = 2, .top_k = 1, .capacity_factor = 0,
                            .hot_expert = 3});
  Picture p;
  std::string log;
  ASSERT_EQ(RunViewer(dir, run.string() + " --panel routing --step 20", p, log), 0) << log;
  ASSERT_EQ(p.width, 1200) << log;
  ASSERT_EQ(p.height, 900);
  ASSERT_TRUE(p.regions.contains("routing_heatmap")) << p.regions.dump();
  const auto r = p.regions["routing_heatmap"];
  const float x0 = r[0], y0 = r[1], x1 = r[2], y1 = r[3];
  ASSERT_GT(x1 - x0, 100);
  ASSERT_GT(y1 - y0, 32);
  const float row_height = (y1 - y0) / 8;
  int checked = 0;
  for (int e = 0; e < 8; ++e)
    for (float fx : {0.05f, 0.3f, 0.6f, 0.95f}) {
      const Rgba want = e == 3 ? load_color(1.0f) : load_color(0.0f);  // load 8x the fair share saturates
      EXPECT_TRUE(Near(p.at(x0 + fx * (x1 - x0), y0 + (static_cast<float>(e) + 0.5f) * row_height), want))
          << "expert " << e << " at " << fx;
      ++checked;
    }
  EXPECT_EQ(checked, 32);
  // The layer x expert heatmap at the step: column 3 bright in both layers.
  const auto l = p.regions["layer_heatmap"];
  const float lx0 = l[0], ly0 = l[1], lx1 = l[2], ly1 = l[3];
  for (int layer = 0; layer < 2; ++layer)
    for (int e = 0; e < 8; ++e)
      EXPECT_TRUE(Near(p.at(lx0 + (static_cast<float>(e) + 0.5f) * (lx1 - lx0) / 8, ly0 + (static_cast<float>(layer) + 0.5f) * (ly1 - ly0) / 2),
                       e == 3 ? load_color(1.0f) : load_color(0.0f)))
          << "layer " << layer << " expert " << e;
}

TEST_F(ViewerScreenshot, TokensAreOnTheirExpertsColour) {
  const auto run = dir.path() / "hot";
  write_synthetic_run(run, {.steps = 10, .experts = 8, .layers = 1, .ranks = 1, .top_k = 1, .capacity_factor = 0,
                            .hot_expert = 3, .tokens_every = 5});
  Picture p;
  std::string log;
  ASSERT_EQ(RunViewer(dir, run.string() + " --panel tokens --step 5", p, log), 0) << log;
  ASSERT_TRUE(p.regions.contains("tokens_text")) << p.regions.dump();
  const auto r = p.regions["tokens_text"];
  // The top-left corner of the first byte's cell (the text itself is drawn inside the cell).
  EXPECT_TRUE(Near(p.at(static_cast<float>(r[0]) + 1, static_cast<float>(r[1]) + 1), expert_color(3)));
}

TEST_F(ViewerScreenshot, TwoRunsSideBySide) {
  write_synthetic_run(dir.path() / "hot", {.steps = 20, .experts = 4, .layers = 1, .ranks = 1, .top_k = 1, .hot_expert = 0});
  write_synthetic_run(dir.path() / "drift", {.steps = 20, .experts = 4, .layers = 1, .ranks = 1});
  Picture p;
  std::string log;
  ASSERT_EQ(RunViewer(dir, (dir.path() / "hot").string() + " " + (dir.path() / "drift").string() + " --panel routing", p, log), 0) << log;
  ASSERT_TRUE(p.regions.contains("routing_heatmap") && p.regions.contains("routing_heatmap#1")) << p.regions.dump();
  const float left = p.regions["routing_heatmap"][2], right = p.regions["routing_heatmap#1"][0];
  EXPECT_LT(left, right);  // the second run's heatmap is to the right of the first
  const auto r = p.regions["routing_heatmap"];
  EXPECT_TRUE(Near(p.at((static_cast<float>(r[0]) + static_cast<float>(r[2])) / 2, static_cast<float>(r[1]) + 2), load_color(1.0f)));
}

// The recorded runs of notebooks_data/runs (ctest runs from the repository root).
const std::string kRecorded = "notebooks_data/runs/";

TEST_F(ViewerScreenshot, OffloadCacheOfRecordedModes) {
  if (!std::filesystem::exists(kRecorded + "offload_switch_on_demand/events.jsonl"))
    GTEST_SKIP() << "notebooks_data/runs/offload_switch_* are not in this checkout";
  Picture p;
  std::string log;
  ASSERT_EQ(RunViewer(dir, kRecorded + "offload_switch_on_demand " + kRecorded + "offload_switch_pregated --panel offload --step 10", p, log), 0) << log;
  ASSERT_TRUE(p.regions.contains("offload_cache") && p.regions.contains("offload_cache#1")) << p.regions.dump();
  // The share of a region's sampled pixels that have a cell colour: 6 MoE blocks, one band each
  // (top-1, batch 1: one cell per block and step), sampled along each band's middle.
  auto share = [&](const char* region, CacheCell cell) {
    const auto r = p.regions[region];
    const float x0 = r[0], y0 = r[1], x1 = r[2], y1 = r[3];
    int hits = 0, samples = 0;
    for (int i = 0; i < 90; ++i)
      for (int band = 0; band < 6; ++band, ++samples)
        hits += Near(p.at(x0 + (static_cast<float>(i) + 0.5f) * (x1 - x0) / 90, y0 + (static_cast<float>(band) + 0.5f) * (y1 - y0) / 6),
                     cache_cell_color(cell));
    return static_cast<double>(hits) / samples;
  };
  // On demand, 88 of the 108 chosen experts are misses; pre-gated, 84 are copies made ahead and used.
  EXPECT_GT(share("offload_cache", CacheCell::miss), 0.6);
  EXPECT_LT(share("offload_cache", CacheCell::prefetched_used), 0.01);
  EXPECT_GT(share("offload_cache#1", CacheCell::prefetched_used), 0.6);
  EXPECT_LT(share("offload_cache#1", CacheCell::prefetched_wasted), 0.01);
}

TEST_F(ViewerScreenshot, ByteMatrixOfOneLayerOnTwoRanks) {
  if (!std::filesystem::exists(kRecorded + "train_expert_parallel_2gpu/events.jsonl"))
    GTEST_SKIP() << "notebooks_data/runs/train_expert_parallel_2gpu is not in this checkout";
  Picture p;
  std::string log;
  ASSERT_EQ(RunViewer(dir, kRecorded + "train_expert_parallel_2gpu --panel alltoall --step 100 --layer 3", p, log), 0) << log;
  ASSERT_TRUE(p.regions.contains("alltoall_bytes_dispatch") && p.regions.contains("alltoall_bytes_combine")) << p.regions.dump();
  // Layer 3's dispatch at step 100: bytes [[1511936, 2682368], [1495552, 2698752]], coloured
  // relative to the largest cell. Sampled near each cell's corner, away from its number.
  const auto r = p.regions["alltoall_bytes_dispatch"];
  const float x0 = r[0], y0 = r[1], cell = (static_cast<float>(r[2]) - x0) / 2;
  const double bytes[2][2] = {{1511936, 2682368}, {1495552, 2698752}};
  for (int s = 0; s < 2; ++s)
    for (int d = 0; d < 2; ++d)
      EXPECT_TRUE(Near(p.at(x0 + (static_cast<float>(d) + 0.1f) * cell, y0 + (static_cast<float>(s) + 0.1f) * cell),
                       load_color(static_cast<float>(bytes[s][d] / 2698752.0))))
          << "rank " << s << " -> rank " << d;
}

TEST_F(ViewerScreenshot, CorruptRunGivesAMessageNotACrash) {
  testing::write_text(dir.path() / "bad" / "run.json", testing::kRunJson);
  testing::write_text(dir.path() / "bad" / "events.jsonl", "{\"type\":\"step\",\"step\":1}\n\x01garbage\n{\"type\":\"step\",\"step\":2}\n");
  testing::write_text(dir.path() / "empty" / "run.json", "");
  for (const char* panel : {"summary", "routing", "topology", "alltoall"}) {
    Picture p;
    std::string log;
    EXPECT_EQ(RunViewer(dir, (dir.path() / "bad").string() + " " + (dir.path() / "empty").string() + " --panel " + panel,
                        p, log), 0) << log;
    EXPECT_EQ(p.width, 1200) << panel << ": " << log;
    EXPECT_NE(log.find("line 2"), std::string::npos) << log;  // the bad line, skipped and named
  }
}

// A run directory that is not there is bad usage, found before any window opens: exit 2 and the
// path named, no screenshot.
TEST_F(ViewerScreenshot, MissingRunDirectoryIsAnErrorNamingIt) {
  Picture p;
  std::string log;
  const std::string missing = (dir.path() / "missing").string();
  const int status = RunViewer(dir, missing + " --panel summary", p, log);  // std::system's wait status
  ASSERT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 2) << log;
  EXPECT_NE(log.find(missing + " does not exist"), std::string::npos) << log;
  EXPECT_EQ(p.width, 0) << log;
}

}  // namespace
}  // namespace moe::viewer
