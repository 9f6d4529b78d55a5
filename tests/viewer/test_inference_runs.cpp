// test_inference_runs.cpp: the offload panel's data prepared from the recorded decoding runs
// (notebooks_data/runs/offload_switch_* and generate_*, H100, 2026-11-25), no window: the expert
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
  // The cells of chosen experts (prefetched and used, hit, miss) at each step and block must be as
  // many as the experts the event lists: two independent fields of the record agree.
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
            cells += cell == CacheCell::prefetched_used || cell == CacheCell::hit || cell == CacheCell::miss;
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

}  // namespace
}  // namespace moe::viewer
