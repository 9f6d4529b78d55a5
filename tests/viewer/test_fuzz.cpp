// test_fuzz.cpp: the viewer's model never crashes on bad input. Mutates a small synthetic run
// byte by byte (flips, cuts, insertions, duplicated and swapped lines) and value by value (a
// field set to a huge, negative, fractional, string, null, array or object value), then loads each
// input and runs every panel's data preparation over it. Also: empty, binary, truncated, deeply
// nested, enormous (one line over the line limit) and future-version files on disk.
// Prints how many inputs were survived, rejected with a message, and loaded with skipped events.
//   ctest --test-dir build -R ViewerFuzz --output-on-failure
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <sstream>

#include "colormap.h"
#include "comm_view.h"
#include "downsample.h"
#include "routing_view.h"
#include "run_model.h"
#include "synthetic_run.h"
#include "topology_view.h"
#include "viewer_test_support.h"

namespace moe::viewer {
namespace {

using testing::TempDir;

struct Tally {
  int64_t inputs = 0, rejected = 0, loaded = 0, loaded_with_skips = 0;
};

// Every query a panel makes, over whatever the model holds.
void ExerciseViews(const RunModel& m) {
  const int64_t steps[] = {m.first_step, m.last_step, (m.first_step + m.last_step) / 2, -1, INT64_MAX / 2};
  for (const auto& [layer, lr] : m.routing) {
    Image image = colorize(step_expert_load(lr, 37), 0.0f, 2.0f);
    EXPECT_EQ(image.rgba.size(), static_cast<size_t>(image.width * image.height * 4));
    for (int64_t step : steps) {
      expert_bars(m, layer, step);
      genre_load(m, layer, step);
      capacity_for(m, lr.row_at_or_before(step));
    }
    for (const char* stat : {"max_over_mean", "coefficient_of_variation", "dropped_fraction", "routing_entropy"})
      downsample_min_max(m.routing_stat_series(layer, stat), static_cast<double>(m.first_step), static_cast<double>(m.last_step), 50);
  }
  for (int64_t step : steps) {
    colorize(layer_expert_load(m, step), 0.0f, 2.0f);
    alltoall_at(m, step, "");
    offload_at(m, step, -1);
    for (int64_t layer : {0, 1, 5}) {
      if (const TopologyRecord* t = m.topology_at(step, layer)) {
        const ExpertBars bars = expert_bars(m, layer, t->step);
        topology_picture(*t, bars.tokens, capacity_for(m, nullptr));
        topology_picture(*t, bars.tokens, int64_t{3});
      }
      m.tokens_at(step, layer);
    }
    Timeline t = build_timeline(m, step, step);
    for (const TimelineLane& lane : t.lanes) visible_spans(lane, t.t0, t.t1, (t.t1 - t.t0) / 100 + 1e-9);
  }
  for (const auto& [name, series] : m.step_metrics) downsample_min_max(series, -10, 1e6, 64);
  alltoall_bandwidth_series(m, "");
  offload_series(m, "hit_rate", -1);
}

void Feed(Tally& tally, const std::string& run_json, const std::string& events) {
  ++tally.inputs;
  RunModel m = RunModel::from_text(run_json, events, "fuzz");
  if (!m.error.empty()) {
    ++tally.rejected;
    EXPECT_NE(m.error.find("fuzz"), std::string::npos) << "a message must name the source: " << m.error;
  } else {
    ++tally.loaded;
    if (m.events_skipped) ++tally.loaded_with_skips;
  }
  ExerciseViews(m);  // a rejected run is an empty model: the panels still draw their notices
}

struct Seed {
  std::string run_json, events;
};

Seed MakeSeed() {
  TempDir dir;
  write_synthetic_run(dir.path() / "seed", {.steps = 6, .experts = 4, .layers = 2, .ranks = 2, .topology_every = 2, .tokens_every = 3});
  return {testing::read_text(dir.path() / "seed" / "run.json"), testing::read_text(dir.path() / "seed" / "events.jsonl")};
}

TEST(ViewerFuzz, ByteMutationsOfARun) {
  const Seed seed = MakeSeed();
  std::mt19937_64 rng(12345);
  Tally tally;
  const int kInputs = 6000;
  for (int i = 0; i < kInputs; ++i) {
    std::string events = seed.events, run_json = seed.run_json;
    std::string& target = (rng() % 8 == 0) ? run_json : events;
    const int mutations = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < mutations && !target.empty(); ++k) {
      const size_t at = rng() % target.size();
      switch (rng() % 6) {
        case 0: target[at] = static_cast<char>(target[at] ^ (1 << (rng() % 8))); break;  // bit flip
        case 1: target.resize(at); break;                                                   // truncation
        case 2: target.insert(at, 1, static_cast<char>(rng() % 256)); break;                // a stray byte
        case 3: target.erase(at, 1 + rng() % 16); break;                                    // a cut
        case 4: target.insert(at, target.substr(at, 1 + rng() % 200)); break;               // a repeat
        default: target.insert(at, std::vector<const char*>{"9999999999999999999999", "-1", "1e308", "null", "[]",
                                                            "{}", "\"x\"", "\n", "\xff\xfe", "[[[[[[["}[rng() % 10]);
      }
    }
    Feed(tally, run_json, events);
  }
  std::printf("byte fuzz: %lld inputs survived (%lld rejected with a message, %lld loaded, %lld of them with skipped events)\n",
              static_cast<long long>(tally.inputs), static_cast<long long>(tally.rejected),
              static_cast<long long>(tally.loaded), static_cast<long long>(tally.loaded_with_skips));
  EXPECT_EQ(tally.inputs, kInputs);
  EXPECT_GT(tally.rejected, 0);
  EXPECT_GT(tally.loaded, 0);
}

// Replaces one value somewhere in the JSON with a hostile one, keeping the line valid JSON.
void MutateValue(nlohmann::json& j, std::mt19937_64& rng, int depth = 0) {
  static const nlohmann::json hostile[] = {
      nlohmann::json(INT64_MAX), nlohmann::json(INT64_MIN), nlohmann::json(uint64_t{18446744073709551615ull}),
      nlohmann::json(-1), nlohmann::json(0), nlohmann::json(1e300), nlohmann::json(-0.5), nlohmann::json("str"),
      nlohmann::json(nullptr), nlohmann::json::array(), nlohmann::json::object(), nlohmann::json(true),
      nlohmann::json::array({1, -2, 3}), nlohmann::json(std::vector<int64_t>(5000, 7)),
      nlohmann::json(std::vector<int64_t>(3, INT64_MAX))};
  const size_t n = sizeof hostile / sizeof hostile[0];
  if ((j.is_object() || j.is_array()) && !j.empty() && depth < 4 && rng() % 4 != 0) {
    auto it = j.begin();
    std::advance(it, static_cast<long>(rng() % j.size()));
    MutateValue(*it, rng, depth + 1);
    return;
  }
  j = hostile[rng() % n];
}

TEST(ViewerFuzz, WrongTypesAndOutOfRangeValues) {
  const Seed seed = MakeSeed();
  std::vector<nlohmann::json> events;
  std::istringstream lines(seed.events);
  for (std::string line; std::getline(lines, line);) events.push_back(nlohmann::json::parse(line));
  const nlohmann::json info = nlohmann::json::parse(seed.run_json);
  std::mt19937_64 rng(777);
  Tally tally;
  const int kInputs = 4000;
  for (int i = 0; i < kInputs; ++i) {
    std::vector<nlohmann::json> mutated = events;
    nlohmann::json mutated_info = info;
    for (int k = 0; k < 1 + static_cast<int>(rng() % 3); ++k) {
      if (rng() % 10 == 0) MutateValue(mutated_info, rng);
      else MutateValue(mutated[rng() % mutated.size()], rng);
    }
    std::string text;
    for (const auto& e : mutated) text += e.dump() + "\n";
    Feed(tally, mutated_info.dump(), text);
  }
  std::printf("value fuzz: %lld inputs survived (%lld rejected with a message, %lld loaded, %lld of them with skipped events)\n",
              static_cast<long long>(tally.inputs), static_cast<long long>(tally.rejected),
              static_cast<long long>(tally.loaded), static_cast<long long>(tally.loaded_with_skips));
  EXPECT_EQ(tally.inputs, kInputs);
  EXPECT_GT(tally.loaded_with_skips, 0);
}

TEST(ViewerFuzz, BadFilesOnDisk) {
  TempDir dir;
  const Seed seed = MakeSeed();
  struct Case {
    const char* name;
    std::string run_json, events;
    bool loads;
    int64_t bad_lines = 0;  // lines skipped with a warning naming the file and line
  };
  std::string deep(100000, '[');
  const Case cases[] = {
      {"empty_both", "", "", false},
      {"empty_events", seed.run_json, "", true},
      {"binary", seed.run_json, std::string("\x00\x01\xff\xfe\n\x7f", 6) + "\n", true, 2},
      {"truncated_mid_line", seed.run_json, seed.events.substr(0, seed.events.size() / 2), true},
      {"deep_nesting", seed.run_json, "{\"type\":\"step\",\"step\":1,\"x\":" + deep + "\n{\"type\":\"step\",\"step\":2}\n", true, 1},
      {"future_version", "{\"schema_version\":2,\"kind\":\"train\",\"name\":\"x\",\"start_time\":\"t\"}", seed.events, false},
      {"not_an_object", "[1,2,3]", seed.events, false},
  };
  int survived = 0;
  for (const Case& c : cases) {
    testing::write_text(dir.path() / c.name / "run.json", c.run_json);
    testing::write_text(dir.path() / c.name / "events.jsonl", c.events);
    RunModel m = RunModel::load(dir.path() / c.name);
    EXPECT_EQ(m.error.empty(), c.loads) << c.name << ": " << m.error;
    if (!c.loads) {
      EXPECT_NE(m.error.find(c.name), std::string::npos) << "the message names the run's path: " << m.error;
    }
    EXPECT_EQ(m.bad_lines, c.bad_lines) << c.name;
    if (c.bad_lines > 0) {
      ASSERT_FALSE(m.warnings.empty()) << c.name;
      EXPECT_NE(m.warnings[0].find(std::string(c.name) + "/events.jsonl line 1"), std::string::npos) << m.warnings[0];
    }
    ExerciseViews(m);
    ++survived;
  }
  // Enormous: a sparse 1.5 GB events.jsonl of zero bytes, one line with no newline: refused once
  // the line passes the reader's limit (RunReader::kMaxLineBytes), without reading the rest.
  testing::write_text(dir.path() / "enormous" / "run.json", seed.run_json);
  testing::write_text(dir.path() / "enormous" / "events.jsonl", "");
  std::filesystem::resize_file(dir.path() / "enormous" / "events.jsonl", uint64_t{3} << 29);
  RunModel big = RunModel::load(dir.path() / "enormous");
  EXPECT_NE(big.error, "");
  std::printf("enormous file: %s\n", big.error.c_str());
  ++survived;
  std::printf("bad files on disk: %d of %zu survived, each with the expected verdict\n", survived, std::size(cases) + 1);
}

}  // namespace
}  // namespace moe::viewer
