// test_inference_runs.cpp: the offload panel's data prepared from the recorded decoding runs
// (notebooks_data/runs/offload_switch_* and generate_*, H100, 2026-11-25; slot_table_*, H200,
// 2026-11-29), no window: the expert
// cache over decode steps against the events' own lists of chosen experts, hit rate and prefetch
// accuracy per block, the modes of one model side by side, and the stalls on the timeline.
// ctest runs it from the repository root.   ctest --test-dir build -R ViewerInferenceRuns
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "comm_view.h"
#include "inference_view.h"
#include "run_model.h"

namespace moe::viewer {
namespace {

const std::filesystem::path kRuns = "notebooks_data/runs";
const char* kModes[] = {"gpu_only", "on_demand", "prefetch_all", "pregated", "speculative"};

class ViewerInferenceRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (const char* mode : kModes) {
      switch_[mode] = std::make_unique<RunModel>(RunModel::load(kRuns / (std::string("offload_switch_") + mode)));
      generate_[mode] = std::make_unique<RunModel>(RunModel::load(kRuns / (std::string("generate_pregated_") + mode)));
    }
    self_ = std::make_unique<RunModel>(RunModel::load(kRuns / "generate_self_speculative"));
  }
  static void TearDownTestSuite() {
    switch_.clear();
    generate_.clear();
    self_.reset();
  }
  void SetUp() override {
    if (!std::filesystem::exists(kRuns / "offload_switch_pregated" / "events.jsonl"))
      GTEST_SKIP() << "notebooks_data/runs/offload_switch_pregated is not in this checkout";
    for (const auto* runs : {&switch_, &generate_})
      for (const auto& [mode, run] : *runs) ASSERT_EQ(run->error, "") << mode;
    ASSERT_EQ(self_->error, "");
  }
  static std::map<std::string, std::unique_ptr<RunModel>> switch_, generate_;
  static std::unique_ptr<RunModel> self_;
};
std::map<std::string, std::unique_ptr<RunModel>> ViewerInferenceRuns::switch_, ViewerInferenceRuns::generate_;
std::unique_ptr<RunModel> ViewerInferenceRuns::self_;

TEST_F(ViewerInferenceRuns, ExpertBytesFromTheModel) {
  // Switch-like: D=768, H=3072, GeLU: (768*3072 + 3072*768) bf16 = 9 MiB; the trained model: D=256, H=512.
  EXPECT_EQ(offloaded_expert_bytes(*switch_["pregated"]), 9437184);
  EXPECT_EQ(offloaded_expert_bytes(*generate_["pregated"]), 524288);
}

TEST_F(ViewerInferenceRuns, CacheCellsMatchTheChosenExperts) {
  // The cells of chosen experts (prefetched and used, hit, miss, computed on the host) at each step
  // and block must be as many as the experts the event lists: two independent fields of the record
  // agree.
  for (const auto* runs : {&switch_, &generate_}) {
    for (const auto& [mode, run] : *runs) {
      const CacheTimeline c = build_cache_timeline(*run, 1);
      ASSERT_TRUE(c.wasted_known) << mode << ": " << c.note;
      ASSERT_TRUE(c.has_chosen_experts) << mode;
      ASSERT_FALSE(c.layers.empty()) << mode;
      EXPECT_EQ(c.steps.front(), 1) << mode;  // the prefill (step 0) left out
      std::map<std::pair<int64_t, int64_t>, size_t> chosen;
      for (const OffloadRecord& o : run->offloads)
        if (o.step >= 1) chosen[{o.step, o.layer}] = o.experts.size();
      for (size_t s = 0; s < c.steps.size(); ++s)
        for (size_t m = 0; m < c.layers.size(); ++m) {
          size_t cells = 0;
          for (int64_t r = 0; r < c.rows_per_block; ++r) {
            const CacheCell cell = c.at(m * static_cast<size_t>(c.rows_per_block) + static_cast<size_t>(r), s);
            cells += cell == CacheCell::prefetched_used || cell == CacheCell::hit || cell == CacheCell::miss ||
                     cell == CacheCell::on_host;
          }
          const size_t listed = chosen[std::make_pair(c.steps[s], c.layers[m])];
          EXPECT_EQ(cells, listed) << mode << " step " << c.steps[s] << " layer " << c.layers[m];
        }
    }
  }
}

TEST_F(ViewerInferenceRuns, SwitchModesSideBySide) {
  // 18 decode steps x 6 MoE blocks (layers 1, 3, ..., 11), batch 1, top-1: 108 chosen experts.
  const CacheTimeline gpu_only = build_cache_timeline(*switch_["gpu_only"], 1);
  EXPECT_EQ(gpu_only.steps.size(), 18u);
  EXPECT_EQ(gpu_only.layers, (std::vector<int64_t>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(gpu_only.total.chosen, 108);
  EXPECT_DOUBLE_EQ(gpu_only.total.hit_rate(), 1.0);  // every expert resident
  EXPECT_EQ(gpu_only.total.prefetch_copies, 0);
  EXPECT_TRUE(std::isnan(gpu_only.total.prefetch_accuracy()));

  const CacheTimeline on_demand = build_cache_timeline(*switch_["on_demand"], 1);
  EXPECT_EQ(on_demand.total.misses, 88);
  EXPECT_EQ(on_demand.total.prefetch_copies, 0);
  EXPECT_NEAR(on_demand.total.hit_rate(), 20.0 / 108.0, 1e-12);

  // Pre-gated: every block but the first has its experts copied during the block before; each of
  // those copies is used, and only the first block (layer 1) misses.
  const CacheTimeline pregated = build_cache_timeline(*switch_["pregated"], 1);
  EXPECT_EQ(pregated.total.prefetch_copies, 84);
  EXPECT_EQ(pregated.total.prefetched_used, 84);
  EXPECT_DOUBLE_EQ(pregated.total.prefetch_accuracy(), 1.0);
  EXPECT_EQ(pregated.per_block[0].misses, 14);
  for (size_t m = 1; m < pregated.layers.size(); ++m) {
    EXPECT_DOUBLE_EQ(pregated.per_block[m].hit_rate(), 1.0) << pregated.layers[m];
    EXPECT_DOUBLE_EQ(pregated.per_block[m].prefetch_accuracy(), 1.0) << pregated.layers[m];
  }

  // Speculative: the guess made from block i's input is right 49 times in 79 copies.
  const CacheTimeline speculative = build_cache_timeline(*switch_["speculative"], 1);
  EXPECT_EQ(speculative.total.prefetched_used, 49);
  EXPECT_EQ(speculative.total.prefetch_copies, 79);
  EXPECT_EQ(speculative.total.prefetched_wasted(), 30);
  EXPECT_EQ(speculative.rows_per_block, 2);  // one chosen expert + at most one wasted copy

  // Prefetch-all asks for all 64 experts of the next block into an 8-slot cache: nearly every copy
  // is evicted before use, and the block still misses.
  const CacheTimeline all = build_cache_timeline(*switch_["prefetch_all"], 1);
  EXPECT_EQ(all.total.prefetch_copies, 774);
  EXPECT_EQ(all.total.prefetched_used, 2);
  EXPECT_LT(all.total.prefetch_accuracy(), 0.01);
  EXPECT_EQ(all.total.misses, 106);

  // The rows for the side-by-side table: one model (the same key), five modes; pre-gated stalls
  // least of the offloaded modes and its median step is the closest to the GPU-only one.
  std::map<std::string, DecodeModeRow> rows;
  for (const auto& [mode, run] : switch_) rows[mode] = decode_mode_row(*run, 1);
  for (const auto& [mode, row] : rows) {
    EXPECT_EQ(row.mode, mode);
    EXPECT_EQ(row.model, rows["gpu_only"].model);
    EXPECT_EQ(row.decode_steps, 18);
    EXPECT_GT(row.median_step_us, 0);
  }
  EXPECT_EQ(rows["gpu_only"].model, "offload_bench switch D=768 H=3072 E=64 K=1");
  EXPECT_EQ(rows["pregated"].cache_slots, 8);
  EXPECT_DOUBLE_EQ(rows["gpu_only"].stall_us_per_step, 0.0);
  for (const char* mode : {"on_demand", "prefetch_all", "speculative"}) {
    EXPECT_LT(rows["pregated"].stall_us_per_step, rows[mode].stall_us_per_step) << mode;
    EXPECT_LT(rows["pregated"].median_step_us, rows[mode].median_step_us) << mode;
  }
  EXPECT_LT(rows["gpu_only"].median_step_us, rows["pregated"].median_step_us);
}

TEST_F(ViewerInferenceRuns, TrainedModelPerBlock) {
  // The model trained with pre-gating: block 0 is chosen on the spot (no block before it to
  // pre-gate from), blocks 1-3 always hit.
  const CacheTimeline pregated = build_cache_timeline(*generate_["pregated"], 1);
  EXPECT_EQ(pregated.layers, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(pregated.steps.size(), 63u);
  EXPECT_LT(pregated.per_block[0].hit_rate(), 0.7);
  for (size_t m = 1; m < 4; ++m) EXPECT_DOUBLE_EQ(pregated.per_block[m].hit_rate(), 1.0) << m;

  // The self-gated model's speculative guess: its prefetched_used counts a copy made at one step
  // and chosen at the next, so a step can use more copies than it made; over the run the used
  // copies stay within the copies, and the accuracy is below pre-gating's 1.
  const CacheTimeline self = build_cache_timeline(*self_, 1);
  ASSERT_TRUE(self.wasted_known) << self.note;
  EXPECT_EQ(self.total.prefetched_used, 181);
  EXPECT_EQ(self.total.prefetch_copies, 199);
  EXPECT_NEAR(self.total.prefetch_accuracy(), 181.0 / 199.0, 1e-12);
  // Not one model with the pre-gated runs: another checkpoint.
  EXPECT_NE(decode_model_key(*self_), decode_model_key(*generate_["pregated"]));
  EXPECT_EQ(decode_model_key(*generate_["on_demand"]), decode_model_key(*generate_["pregated"]));
}

TEST_F(ViewerInferenceRuns, StallsOnTheTimeline) {
  // On demand, a decode step's copies are waited for: the compute-waits lane holds wait_for_copy
  // spans, and they are what the offload timeline draws as stalls. GPU-only has none.
  const RunModel& on_demand = *switch_["on_demand"];
  const Timeline t = build_timeline(on_demand, 5, 5, true);
  double stall_us = 0;
  int64_t stalls = 0;
  for (const TimelineLane& lane : t.lanes)
    for (const TimelineSpan& s : lane.spans)
      if (is_stall_span(t.names[static_cast<size_t>(s.name)])) {
        stall_us += s.end_us - s.start_us;
        ++stalls;
      }
  EXPECT_EQ(stalls, 6);  // one per MoE block, every block misses at step 5
  // The wait spans cover the stall the offload events count; they are a little longer, since they
  // bracket the whole acquire (issuing the copies too), the stall only the waits: 1.0 to 1.3 x.
  double recorded_stall = 0;
  for (const OffloadRecord& o : on_demand.offloads)
    if (o.step == 5) recorded_stall += o.stall_us;
  EXPECT_GT(recorded_stall, 900.0);  // six copies of 9 MiB over PCIe
  EXPECT_GE(stall_us, recorded_stall);
  EXPECT_LE(stall_us, 1.3 * recorded_stall);
  const Timeline gpu_only = build_timeline(*switch_["gpu_only"], 5, 5, true);
  for (const TimelineLane& lane : gpu_only.lanes)
    for (const TimelineSpan& s : lane.spans) EXPECT_FALSE(is_stall_span(gpu_only.names[static_cast<size_t>(s.name)]));
}

// A decoding run of a model with D=4, H=8 (GeLU): one expert is (4*8 + 8*4) bf16 = 128 bytes.
const char* kSmallRun = R"({"schema_version":1,"kind":"infer","name":"small","start_time":"2026-11-22T00:00:00.000Z",
  "moe_config":{"tokens":4,"model_dim":4,"hidden_dim":8,"num_experts":4,"top_k":1,"formulation":"dropless",
                "activation":"gelu","block_size":4,"capacity_factor":1.0}})";

// The slot table on the GPU, recorded (moe_generate --slot-table device --run-dir), beside the host
// table's run of the same model and bytes: the viewer reads it as any other, its cells match the
// chosen experts, and the GPU's plan kernel took the same hits and misses as the host's cache.
TEST(ViewerSlotTableRuns, TheGpusSlotTableRecordedBesideTheHosts) {
  const std::filesystem::path host_dir = kRuns / "slot_table_host_pregated", device_dir = kRuns / "slot_table_device_pregated";
  if (!std::filesystem::exists(device_dir / "events.jsonl")) GTEST_SKIP() << device_dir.string() << " is not in this checkout";
  const RunModel host = RunModel::load(host_dir), device = RunModel::load(device_dir);
  ASSERT_EQ(host.error, "");
  ASSERT_EQ(device.error, "");
  const DecodeModeRow h = decode_mode_row(host, 1), d = decode_mode_row(device, 1);
  EXPECT_EQ(d.outcomes.resident_hits + d.outcomes.prefetched_used, h.outcomes.resident_hits + h.outcomes.prefetched_used);
  EXPECT_EQ(d.outcomes.misses, h.outcomes.misses);
  EXPECT_GT(d.outcomes.misses, 0);
  const CacheTimeline cache = build_cache_timeline(device, 1);
  EXPECT_TRUE(cache.wasted_known) << cache.note;
  int64_t chosen_cells = 0, chosen = 0;
  for (const CacheCell cell : cache.cells) {
    chosen_cells += cell == CacheCell::hit || cell == CacheCell::miss || cell == CacheCell::prefetched_used ? 1 : 0;
  }
  for (const OffloadRecord& o : device.offloads) {
    if (o.step >= 1) chosen += static_cast<int64_t>(o.experts.size());
  }
  EXPECT_EQ(chosen_cells, chosen);
}

TEST(ViewerInferenceView, RecordWithoutCopyCountsSaysSo) {
  // An offload event without prefetched_used / bytes (an older writer, the synthetic run): the
  // chosen experts still show, the wasted copies are not guessed, and the note names the writers.
  const RunModel run = RunModel::from_text(
      kSmallRun,
      R"({"type":"offload","step":1,"layer":0,"hits":1,"misses":1,"stall_us":3.0,"prefetched":[2]})"
      "\n");
  ASSERT_EQ(run.error, "");
  const CacheTimeline c = build_cache_timeline(run, 1);
  EXPECT_FALSE(c.wasted_known);
  EXPECT_NE(c.note.find("offload_bench"), std::string::npos) << c.note;
  EXPECT_EQ(c.total.prefetch_copies, -1);
  EXPECT_EQ(c.total.prefetched_wasted(), -1);
  EXPECT_TRUE(std::isnan(c.total.prefetch_accuracy()));
  EXPECT_EQ(c.rows_per_block, 2);
  EXPECT_EQ(c.at(0, 0), CacheCell::hit);
  EXPECT_EQ(c.at(1, 0), CacheCell::miss);
}

TEST(ViewerInferenceView, BytesNotWholeExpertsSaySo) {
  const RunModel run = RunModel::from_text(
      kSmallRun,
      R"({"type":"offload","step":1,"layer":0,"hits":0,"misses":1,"prefetched_used":0,"bytes":100})"
      "\n");
  ASSERT_EQ(run.error, "");
  const CacheTimeline c = build_cache_timeline(run, 1);
  EXPECT_EQ(offloaded_expert_bytes(run), 128);
  EXPECT_FALSE(c.wasted_known);
  EXPECT_NE(c.note.find("not a whole number of experts"), std::string::npos) << c.note;
}

// Two MoE blocks (layers 0 and 2) over two decode steps, one expert 128 bytes:
//   step 1, layer 0: 4 chosen: 1 hit, 1 miss (copied: 128 bytes), 2 computed on the host in 300 us
//   step 1, layer 2: 1 chosen, a hit owed to a prefetch copy (128 bytes)
//   step 2, layer 0: 2 chosen, both on the host (100 us): nothing copied, nothing computed on the GPU
//   step 2, layer 2: 1 chosen, a miss, and a prefetch copy not chosen (256 bytes)
const char* kHostEvents =
    R"({"type":"offload","step":1,"layer":0,"hits":1,"misses":1,"stall_us":5.0,"prefetched":[],"prefetched_used":0,"bytes":128,"experts":[0,1,2,3],"on_host":[2,3],"host_us":300.0})"
    "\n"
    R"({"type":"offload","step":1,"layer":2,"hits":1,"misses":0,"stall_us":0.0,"prefetched":[1],"prefetched_used":1,"bytes":128,"experts":[1],"on_host":[],"host_us":0})"
    "\n"
    R"({"type":"offload","step":2,"layer":0,"hits":0,"misses":0,"stall_us":0.0,"prefetched":[],"prefetched_used":0,"bytes":0,"experts":[0,3],"on_host":[0,3],"host_us":100})"
    "\n"
    R"({"type":"offload","step":2,"layer":2,"hits":0,"misses":1,"stall_us":7.0,"prefetched":[3],"prefetched_used":0,"bytes":256,"experts":[2],"on_host":[],"host_us":0})"
    "\n";

TEST(ViewerInferenceView, HostComputedExpertsAreAThirdOutcome) {
  const RunModel run = RunModel::from_text(kSmallRun, kHostEvents);
  ASSERT_EQ(run.error, "");
  ASSERT_EQ(run.events_skipped, 0) << (run.warnings.empty() ? "" : run.warnings[0]);
  const CacheTimeline c = build_cache_timeline(run, 1);
  ASSERT_TRUE(c.wasted_known) << c.note;
  EXPECT_TRUE(c.has_on_host);
  ASSERT_EQ(c.layers, (std::vector<int64_t>{0, 2}));
  ASSERT_EQ(c.steps, (std::vector<int64_t>{1, 2}));
  ASSERT_EQ(c.rows_per_block, 4);  // step 1, layer 0: hit, miss and two on the host
  // Block 0 (rows 0..3): the host's cells after the GPU's, in CacheCell order.
  EXPECT_EQ(c.at(0, 0), CacheCell::hit);
  EXPECT_EQ(c.at(1, 0), CacheCell::miss);
  EXPECT_EQ(c.at(2, 0), CacheCell::on_host);
  EXPECT_EQ(c.at(3, 0), CacheCell::on_host);
  EXPECT_EQ(c.at(0, 1), CacheCell::on_host);
  EXPECT_EQ(c.at(1, 1), CacheCell::on_host);
  EXPECT_EQ(c.at(2, 1), CacheCell::empty);
  // Block 1 (rows 4..7): no host cells; its wasted copy still derived from the bytes.
  EXPECT_EQ(c.at(4, 0), CacheCell::prefetched_used);
  EXPECT_EQ(c.at(5, 0), CacheCell::empty);
  EXPECT_EQ(c.at(4, 1), CacheCell::miss);
  EXPECT_EQ(c.at(5, 1), CacheCell::prefetched_wasted);

  // Block 0: 6 chosen, 4 of them on the host; the hit rate is over the 2 the GPU computed.
  const CacheOutcomes& b0 = c.per_block[0];
  EXPECT_EQ(b0.chosen, 6);
  EXPECT_EQ(b0.on_host, 4);
  EXPECT_EQ(b0.on_gpu(), 2);
  EXPECT_EQ(b0.resident_hits, 1);
  EXPECT_EQ(b0.misses, 1);
  EXPECT_DOUBLE_EQ(b0.host_us, 400.0);
  EXPECT_DOUBLE_EQ(b0.hit_rate(), 0.5);
  EXPECT_EQ(b0.prefetch_copies, 0);  // 128 bytes = the miss's copy: the host's experts were not copied
  EXPECT_EQ(c.per_block[1].on_host, 0);
  EXPECT_DOUBLE_EQ(c.per_block[1].host_us, 0.0);
  EXPECT_DOUBLE_EQ(c.per_block[1].hit_rate(), 0.5);
  EXPECT_EQ(c.total.chosen, 8);
  EXPECT_EQ(c.total.on_host, 4);
  EXPECT_DOUBLE_EQ(c.total.hit_rate(), 2.0 / 4.0);
  EXPECT_EQ(c.total.prefetched_wasted(), 1);

  // A block whose every expert went to the host has no hit rate: the GPU looked nothing up.
  const CacheTimeline step2 = build_cache_timeline(run, 2);
  EXPECT_EQ(step2.per_block[0].chosen, 2);
  EXPECT_TRUE(std::isnan(step2.per_block[0].hit_rate()));

  // The modes table's row and the scrubber's step carry the host's share too.
  const DecodeModeRow row = decode_mode_row(run, 1);
  EXPECT_EQ(row.outcomes.on_host, 4);
  EXPECT_DOUBLE_EQ(row.host_us_per_step, 200.0);  // 400 us over 2 decode steps
  const OffloadView v = offload_at(run, 1, -1);
  EXPECT_EQ(v.hits, 2);
  EXPECT_EQ(v.misses, 1);
  EXPECT_EQ(v.on_host, 2);
  EXPECT_DOUBLE_EQ(v.host_us, 300.0);
  EXPECT_DOUBLE_EQ(v.hit_rate, 2.0 / 3.0);  // the GPU's 3 lookups
  // Layer 0's hit rate per step: a gap at step 2, where the host computed every expert.
  const Series layer0 = offload_series(run, "hit_rate", 0);
  ASSERT_EQ(layer0.values.size(), 2u);
  EXPECT_DOUBLE_EQ(layer0.values[0], 0.5);
  EXPECT_TRUE(std::isnan(layer0.values[1]));

  // The third colour: named, and apart from every other cell's in the image.
  EXPECT_STREQ(cache_cell_name(CacheCell::on_host), "computed on the host");
  const Rgba host = cache_cell_color(CacheCell::on_host);
  for (CacheCell other : {CacheCell::empty, CacheCell::prefetched_used, CacheCell::hit, CacheCell::miss,
                          CacheCell::prefetched_wasted}) {
    const Rgba o = cache_cell_color(other);
    EXPECT_GT(std::abs(host.r - o.r) + std::abs(host.g - o.g) + std::abs(host.b - o.b), 90) << cache_cell_name(other);
  }
  const Image image = cache_image(c);
  const size_t pixel = (2 * static_cast<size_t>(image.width) + 0) * 4;  // row 2, column 0
  EXPECT_EQ(image.rgba[pixel], host.r);
  EXPECT_EQ(image.rgba[pixel + 1], host.g);
  EXPECT_EQ(image.rgba[pixel + 2], host.b);
}

TEST(ViewerInferenceView, RecordsWithoutHostFieldsAreUnchanged) {
  // The same events as a decoder that computes every expert on the GPU writes them: no on_host, no
  // host_us (the older records), or both empty. Both read as before the fields existed.
  const char* without =
      R"({"type":"offload","step":1,"layer":0,"hits":1,"misses":1,"stall_us":5.0,"prefetched":[],"prefetched_used":0,"bytes":128,"experts":[0,1]})"
      "\n";
  const char* empty =
      R"({"type":"offload","step":1,"layer":0,"hits":1,"misses":1,"stall_us":5.0,"prefetched":[],"prefetched_used":0,"bytes":128,"experts":[0,1],"on_host":[],"host_us":0})"
      "\n";
  for (const char* events : {without, empty}) {
    const RunModel run = RunModel::from_text(kSmallRun, events);
    ASSERT_EQ(run.error, "");
    ASSERT_EQ(run.offloads.size(), 1u);
    EXPECT_TRUE(run.offloads[0].on_host.empty());
    EXPECT_EQ(run.offloads[0].host_us, 0.0);
    const CacheTimeline c = build_cache_timeline(run, 1);
    EXPECT_FALSE(c.has_on_host);
    ASSERT_EQ(c.rows_per_block, 2);
    EXPECT_EQ(c.at(0, 0), CacheCell::hit);
    EXPECT_EQ(c.at(1, 0), CacheCell::miss);
    EXPECT_EQ(c.total.chosen, 2);
    EXPECT_EQ(c.total.on_host, 0);
    EXPECT_EQ(c.total.on_gpu(), 2);
    EXPECT_DOUBLE_EQ(c.total.host_us, 0.0);
    EXPECT_DOUBLE_EQ(c.total.hit_rate(), 0.5);
    EXPECT_EQ(decode_mode_row(run, 1).host_us_per_step, 0.0);
  }
}

}  // namespace
}  // namespace moe::viewer
