// test_trainer.cpp: the trainer (cuda/train/trainer.h) end to end on a GPU, at the "tiny" preset on
// a small generated text: it learns (validation bits per byte far below the unigram baseline), its
// run record holds what the viewer needs and is consistent with itself, a resumed run continues the
// very same loss curve (the steps after the last checkpoint that an interrupted run had already
// recorded are cut and run again), and bad resumes are refused with a clear error.
// Run: ctest --test-dir build -R '^Trainer[.]'   (skips without a GPU)
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <string>

#include "checkpoint.h"        // CheckpointError, latest_checkpoint
#include "core/device_buffer.h"  // set_device_buffer_fill
#include "core/device_info.h"  // gpu_available, why_no_gpu
#include "run_record.h"        // RunReader
#include "sample_text.h"       // moe::testing::write_sample_text
#include "temp_dir.h"          // moe::testing::TempDir
#include "train/trainer.h"
#include "model/model.h"       // gpu_config_of, parameter_layout
#include "expert_placement.h"  // ExpertPlacement

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

namespace {

namespace fs = std::filesystem;
using moe::train::TrainConfig;
using nlohmann::json;

TrainConfig tiny(const fs::path& dir, const std::string& run) {
  TrainConfig c = moe::train::preset("tiny");
  c.data = (dir / "text.txt").string();
  c.run_dir = (dir / run).string();
  c.steps = 60;
  c.learning_rate = 3e-3;
  return c;
}

// The "step" events' values of one metric, by step; fails the test if a step appears twice.
std::map<int64_t, double> metric_by_step(const moe::RunRecord& run, const std::string& metric) {
  std::map<int64_t, double> values;
  for (const json& event : run.events) {
    if (event["type"] == "step" && event.contains(metric) && event[metric].is_number()) {
      const int64_t step = event["step"];
      EXPECT_FALSE(values.count(step)) << metric << " of step " << step << " recorded twice";
      values[step] = event[metric];
    }
  }
  return values;
}

// A checkpoint's whole model from the ranks' parts (merge_ranks): any placement, replicas included,
// gives back every tensor; a replica whose values differ from its first copy is an error naming the
// tensor and both ranks. Host code only: runs without a GPU.
TEST(TrainerPlacement, MergeRanksGivesTheWholeModelAndCatchesReplicasThatDiffer) {
  const TrainConfig c = moe::train::preset("tiny");  // E = 4, two MoE blocks
  moe::cuda::ModelGpuConfig local = moe::cuda::gpu_config_of(c.model, c.batch / 2);
  local.ranks = 2;
  local.moe.tokens = c.batch * c.model.seq_len;
  // Block 0: experts 1 and 3 on both ranks; block 1: E / R in id order.
  local.expert_placements = {moe::dist::ExpertPlacement(4, {{0, 1, 3}, {1, 2, 3}}), moe::dist::contiguous_placement(4, 2)};
  moe::cuda::ModelGpuConfig one = moe::cuda::gpu_config_of(c.model, c.batch);
  const std::vector<moe::cuda::ParameterSpan> whole_layout = moe::cuda::parameter_layout(one);
  const int64_t whole_count = whole_layout.back().offset + whole_layout.back().rows * whole_layout.back().cols;
  std::vector<float> whole(static_cast<size_t>(whole_count));
  std::iota(whole.begin(), whole.end(), 0.5f);
  std::map<std::string, int64_t> offset;
  for (const auto& p : whole_layout) offset[p.name] = p.offset;

  std::vector<std::vector<float>> parts(2);
  for (int q = 0; q < 2; ++q) {
    local.rank = q;
    int64_t experts = 0;
    for (const moe::cuda::ParameterSpan& p : moe::cuda::parameter_layout(local)) {
      parts[size_t(q)].insert(parts[size_t(q)].end(), whole.begin() + offset.at(p.name),
                              whole.begin() + offset.at(p.name) + p.rows * p.cols);
      experts += p.is_expert() ? 1 : 0;
    }
    EXPECT_EQ(experts, 2 * (3 + 2)) << "rank " << q << ": W1 and W2 of 3 experts in block 0 and 2 in block 1";
  }
  EXPECT_EQ(moe::train::merge_ranks(local, parts), whole);

  std::vector<std::vector<float>> differ = parts;
  local.rank = 1;
  for (const moe::cuda::ParameterSpan& p : moe::cuda::parameter_layout(local)) {
    if (p.name == "blocks.0.moe.w1.3") differ[1][size_t(p.offset + 5)] += 1.0f;
  }
  try {
    moe::train::merge_ranks(local, differ);
    ADD_FAILURE() << "replicas that differ were merged";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("the replicas of expert tensor blocks.0.moe.w1.3 differ: rank 0 holds"), std::string::npos) << message;
    EXPECT_NE(message.find("and rank 1 holds"), std::string::npos) << message;
    EXPECT_NE(message.find("at entry 5"), std::string::npos) << message;
  }
  std::vector<std::vector<float>> short_part = parts;
  short_part[0].pop_back();
  EXPECT_THROW(moe::train::merge_ranks(local, short_part), std::invalid_argument);
}

// A checkpoint's expert placements are checked before any GPU is touched (check_inputs, as
// moe_train_distributed calls it on every rank): an expert on no rank, an id out of range, a rank
// without experts, the wrong number of ranks or of MoE blocks, and a malformed load window are each
// refused naming the block and the fault; a good placement passes, and one of another number of
// ranks is set aside (the run starts from E / R in id order). Host code only: runs without a GPU.
TEST(TrainerPlacement, CheckpointPlacementsAreCheckedBeforeTheGpu) {
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig c = tiny(dir.path(), "run");  // E = 4, two MoE blocks
  c.resume = true;
  c.placement = "eplb";
  const std::vector<moe::cuda::ParameterSpan> layout =
      moe::cuda::parameter_layout(moe::cuda::gpu_config_of(c.model, c.batch));
  const std::vector<float> zeros(static_cast<size_t>(layout.back().offset + layout.back().rows * layout.back().cols), 0.0f);
  const auto resume_with = [&](const json& extra) {
    moe::CheckpointHeader header;
    header.model_config = moe::train::model_json(c);
    header.step = 10;
    header.extra = extra;
    const fs::path checkpoints = fs::path(c.run_dir) / "checkpoints";
    fs::remove_all(checkpoints);
    fs::create_directories(checkpoints);
    moe::save_checkpoint(moe::checkpoint_path(checkpoints, 10), header,
                         {{"weights", zeros}, {"adam_m", zeros}, {"adam_v", zeros}});
    try {
      moe::train::check_inputs(c, 2);
      return std::string();
    } catch (const std::exception& error) {
      return std::string(error.what());
    }
  };
  const json good = json::array({json::array({0, 1, 3}), json::array({1, 2, 3})});
  const auto placements = [&](const json& block0, int ranks = 2) {
    return json{{"expert_placements", {{"ranks", ranks}, {"blocks", json::array({block0, good})}}}};
  };
  EXPECT_EQ(resume_with(placements(good)), "");
  EXPECT_EQ(resume_with(placements(json::array({json::array({0}), json::array({1}), json::array({2, 3})}), 3)), "")
      << "another number of ranks: set aside";
  const std::vector<std::pair<json, std::string>> bad = {
      {placements(json::array({json::array({0, 1}), json::array({1, 2})})), "MoE block 0: expert placement: expert 3 is on no rank"},
      {placements(json::array({json::array({0, 1, 9}), json::array({2, 3})})), "holds expert 9; expert ids are 0 .. E - 1 = 3"},
      {placements(json::array({json::array({0, 1, 2, 3}), json::array()})), "rank 1 holds no expert"},
      {placements(json::array({json::array({0, 1}), json::array({2}), json::array({3})})), "not a list of 2 ranks' experts"},
      {placements(json::array({json::array({0, "one"}), json::array({2, 3})})), "an expert id is not an integer: \"one\""},
      {json{{"expert_placements", {{"ranks", 2}, {"blocks", json::array({good})}}}}, "1 placements; the model has 2 MoE blocks"},
      {json{{"expert_placements", "E / R"}}, "not {\"ranks\": R, \"blocks\""},
      {[&] { json e = placements(good); e["expert_load_window"] = json::array({json::array({1, 2, 3, -4}), json::array({1, 2, 3, 4})}); return e; }(),
       "expert_load_window is not [MoE block][E] loads >= 0"},
  };
  for (const auto& [extra, expected] : bad) {
    const std::string message = resume_with(extra);
    EXPECT_NE(message.find(expected), std::string::npos) << extra.dump() << "\nmessage: " << message;
    EXPECT_NE(message.find("checkpoint_00000010.ckpt: expert_placements: "), std::string::npos) << message;
  }
}

TEST(Trainer, LearnsAndRecordsWhatTheViewerNeeds) {
  REQUIRE_GPU();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig c = tiny(dir.path(), "run");
  c.steps = 300;  // well under a second on an H100 / H200
  c.eval_every = 100;
  c.record_every = 50;
  std::ostringstream log;
  const moe::train::TrainResult result = moe::train::train(c, log);
  std::printf("%s", log.str().c_str());

  ASSERT_EQ(result.steps_done, 300);
  ASSERT_EQ(result.losses.size(), 300u);
  const double first = std::accumulate(result.losses.begin(), result.losses.begin() + 5, 0.0) / 5;
  const double last = std::accumulate(result.losses.end() - 5, result.losses.end(), 0.0) / 5;
  EXPECT_LT(last, 0.6 * first) << "the training loss should fall";
  EXPECT_LT(result.validation_bits_per_byte, result.unigram_bits_per_byte - 1.0)
      << "a trained model should beat byte frequencies by more than a bit per byte";

  const moe::RunRecord run = moe::RunReader::load(c.run_dir);
  EXPECT_EQ(run.info["kind"], "train");
  const std::map<int64_t, double> losses = metric_by_step(run, "loss");
  ASSERT_EQ(losses.size(), 300u);
  EXPECT_EQ(losses.begin()->first, 1);
  EXPECT_EQ(losses.rbegin()->first, 300);
  EXPECT_EQ(metric_by_step(run, "val_loss").size(), 3u);  // every 100 steps
  EXPECT_EQ(metric_by_step(run, "step_ms").size(), 300u);
  EXPECT_GE(metric_by_step(run, "tokens_per_s").size(), 300u / size_t(c.log_every));

  const int64_t T = c.batch * c.model.seq_len, K = c.model.top_k, B = c.model.block_size;
  int routing = 0, topology = 0, tokens = 0, spans = 0;
  for (const json& event : run.events) {
    if (event["type"] == "routing") {
      ++routing;
      const std::vector<int64_t> counts = event["tokens_per_expert"];
      EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), T * K);
      int64_t by_genre = 0;
      for (const auto& [genre, genre_counts] : event["tokens_per_expert_by_genre"].items()) {
        for (int64_t n : genre_counts) by_genre += n;
      }
      EXPECT_EQ(by_genre, T * K);
    } else if (event["type"] == "topology") {
      ++topology;
      int64_t rows = 0;
      for (int64_t r : event["rows_per_expert"]) {
        EXPECT_EQ(r % B, 0);
        rows += r;
      }
      EXPECT_EQ(rows, T * K + int64_t(event["padding_rows"]));
      EXPECT_EQ(event["nnz"], int64_t(event["block_rows"]) * int64_t(event["block_cols"]));
    } else if (event["type"] == "tokens") {
      ++tokens;
      EXPECT_EQ(event["text"].get<std::string>().size(), size_t(c.sample_bytes));
      EXPECT_EQ(event["experts"].size(), size_t(c.sample_bytes));
    } else if (event["type"] == "span") {
      ++spans;
      EXPECT_GE(event["duration_us"].get<double>(), 0.0);
    }
  }
  const int recorded_steps = 1 + 300 / int(c.record_every);  // step 1 and every record_every
  EXPECT_EQ(routing, recorded_steps * int(c.model.num_layers));
  EXPECT_EQ(topology, routing);
  EXPECT_EQ(tokens, routing);
  EXPECT_GT(spans, recorded_steps * 10);
  EXPECT_TRUE(moe::latest_checkpoint(fs::path(c.run_dir) / "checkpoints").has_value());
}

TEST(Trainer, DroppingRecordsWhatCapacityDropped) {
  REQUIRE_GPU();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig c = tiny(dir.path(), "dropping");
  c.steps = 20;
  c.model.formulation = moe::Formulation::dropping;
  c.model.capacity_factor = 1.0;
  std::ostringstream log;
  moe::train::train(c, log);
  const moe::RunRecord run = moe::RunReader::load(c.run_dir);
  const int64_t C = moe::capacity(moe::moe_layer_config(c.model, c.batch));
  int checked = 0;
  for (const json& event : run.events) {
    if (event["type"] != "routing") continue;
    ASSERT_EQ(event["capacity"], C);
    const std::vector<int64_t> counts = event["tokens_per_expert"], dropped = event["dropped_per_expert"];
    for (size_t e = 0; e < counts.size(); ++e) EXPECT_EQ(dropped[e], std::max<int64_t>(0, counts[e] - C));
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// Run A trains 40 steps straight. Run B is "interrupted": it stops at step 30, and its checkpoint of
// step 30 is lost, so its newest checkpoint is step 20 while its record already holds steps 21-30.
// Resumed, B must cut those steps, redo them, and continue: every loss of A, step for step.
TEST(Trainer, ResumeContinuesTheSameCurve) {
  REQUIRE_GPU();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig a = tiny(dir.path(), "straight");
  a.steps = 40;
  a.checkpoint_every = 10;
  a.keep_checkpoints = 5;
  std::ostringstream log;
  moe::train::train(a, log);

  TrainConfig b = a;
  b.run_dir = (dir.path() / "interrupted").string();
  b.stop_after = 30;
  moe::train::train(b, log);
  fs::remove(moe::checkpoint_path(fs::path(b.run_dir) / "checkpoints", 30));
  b.stop_after = 0;
  b.resume = true;
  const moe::train::TrainResult resumed = moe::train::train(b, log);
  EXPECT_EQ(resumed.first_step, 20);
  EXPECT_EQ(resumed.steps_done, 40);

  const std::map<int64_t, double> want = metric_by_step(moe::RunReader::load(a.run_dir), "loss");
  const std::map<int64_t, double> got = metric_by_step(moe::RunReader::load(b.run_dir), "loss");
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (const auto& [step, loss] : want) {
    ASSERT_TRUE(got.count(step)) << "step " << step << " missing from the resumed run";
    worst = std::max(worst, std::abs(got.at(step) - loss) / std::abs(loss));
  }
  std::printf("resumed run vs straight run: worst relative loss difference %.3g over %zu steps\n", worst, want.size());

  // Resuming a finished run is refused (it would append a second summary of nothing), and the
  // record is left as it was.
  const auto events_size = fs::file_size(fs::path(b.run_dir) / "events.jsonl");
  try {
    moe::train::train(b, log);
    ADD_FAILURE() << "a resume of a finished run was accepted";
  } catch (const moe::CheckpointError& error) {
    EXPECT_NE(std::string(error.what()).find("already reached step 40"), std::string::npos) << error.what();
  }
  EXPECT_EQ(fs::file_size(fs::path(b.run_dir) / "events.jsonl"), events_size);
  // The same kernels on the same inputs in the same order: identical up to fp32 rounding of the
  // loss read-back (nothing here is nondeterministic; 1e-6 leaves room for nothing else).
  EXPECT_LE(worst, 1e-6);
}

// --cuda-graph: the step's forward and backward captured once and replayed give, step for step, the
// losses of the kernels launched one by one (the same kernels on the same inputs in the same order),
// in every formulation and in a dense model. The recorded steps (every 7th here) and an evaluation
// run uncaptured in between, so replays also follow uncaptured work. Two launched runs first: the
// comparison means something only where the launched kernels repeat themselves bit for bit, and a
// variant whose launched runs differ fails on that, separately. One process per variant (CTest).
// The tiny model in one of the test variants: "dense", "dropless", "padded", "dropping" (capacity
// factor 1.0), "padded_swiglu"; 24 steps, every 7th recorded, an evaluation at 12.
TrainConfig variant_config(const fs::path& dir, const std::string& run, const std::string& variant) {
  TrainConfig c = tiny(dir, run);
  c.steps = 24;
  c.record_every = 7;
  c.eval_every = 12;
  if (variant == "dense") c.model.moe_layers = moe::MoeLayers::none;
  if (variant == "padded_swiglu") c.model.activation = moe::Activation::swiglu;
  if (variant == "dropless") c.model.formulation = moe::Formulation::dropless;
  if (variant != "dense" && variant != "dropless") {
    c.model.formulation = moe::parse_formulation(variant == "dropping" ? "dropping" : "padded");
    c.model.capacity_factor = 1.0;
  }
  return c;
}

// The first step from which two runs' losses differ, 0 when every step of `want` is in `got`, equal.
int64_t first_difference(const std::map<int64_t, double>& want, const std::map<int64_t, double>& got) {
  for (const auto& [step, loss] : want) {
    if (!got.count(step) || got.at(step) != loss) return step;
  }
  return 0;
}

class TrainerCudaGraph : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainerCudaGraph, StepsGiveTheSameLossesAsLaunchedKernels) {
  REQUIRE_GPU();
  const std::string variant = GetParam();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig launched = variant_config(dir.path(), "launched", variant);
  TrainConfig again = launched;
  again.run_dir = (dir.path() / "launched_again").string();
  TrainConfig graphed = launched;
  graphed.run_dir = (dir.path() / "graphed").string();
  graphed.cuda_graph = true;
  std::ostringstream log;
  for (const TrainConfig* c : {&launched, &again, &graphed}) moe::train::train(*c, log);
  const auto losses = [](const TrainConfig& c) { return metric_by_step(moe::RunReader::load(c.run_dir), "loss"); };
  const std::map<int64_t, double> want = losses(launched), repeat = losses(again), got = losses(graphed);
  ASSERT_EQ(want.size(), 24u);
  const int64_t launched_differ = first_difference(want, repeat);
  EXPECT_EQ(launched_differ, 0) << variant << ": two runs of the launched kernels differ from step " << launched_differ
                                << " (" << want.at(launched_differ) << " against "
                                << (repeat.count(launched_differ) ? repeat.at(launched_differ) : -1.0) << ")";
  const int64_t graph_differ = first_difference(want, got);
  EXPECT_EQ(graph_differ, 0) << variant << ": the graphed run differs from step " << graph_differ;
}

INSTANTIATE_TEST_SUITE_P(Variants, TrainerCudaGraph,
                         ::testing::Values("dropless", "padded", "dropping", "padded_swiglu", "dense"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// No step may read GPU memory it did not write first: a run whose every new buffer starts as zeros
// and a run whose every new buffer starts as 0x3F bytes (0.75 in fp32 and bf16, a large int) give
// the same losses bit for bit. A read before a write shows as the first step where they differ
// (fresh memory in a new process is zeros; a second model in the same process gets the first
// one's leftovers, so such a read makes runs disagree only sometimes).
class TrainerFreshMemory : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainerFreshMemory, LossesDoNotDependOnWhatNewBuffersHold) {
  REQUIRE_GPU();
  const std::string variant = GetParam();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  std::ostringstream log;
  std::map<int, std::map<int64_t, double>> losses;
  std::map<int, moe::RunRecord> runs;
  for (const int fill : {0x00, 0x3F}) {
    const TrainConfig c = variant_config(dir.path(), "fill_" + std::to_string(fill), variant);
    moe::cuda::set_device_buffer_fill(fill);
    try {
      moe::train::train(c, log);
    } catch (...) {
      moe::cuda::set_device_buffer_fill(-1);
      throw;
    }
    moe::cuda::set_device_buffer_fill(-1);
    runs[fill] = moe::RunReader::load(c.run_dir);
    losses[fill] = metric_by_step(runs[fill], "loss");
  }
  ASSERT_EQ(losses[0x00].size(), 24u);
  const int64_t differ = first_difference(losses[0x00], losses[0x3F]);
  std::ostringstream parts;  // which of the loss's parts moved: the language model's, aux or z
  for (const char* part : {"lm_loss", "aux_loss", "z_loss"}) {
    if (differ == 0) break;
    parts << " " << part << " " << metric_by_step(runs[0x00], part)[differ] << " against "
          << metric_by_step(runs[0x3F], part)[differ] << ";";
  }
  EXPECT_EQ(differ, 0) << variant << ": new buffers of zeros and of 0x3F bytes give different losses from step "
                       << differ << " (" << losses[0x00][differ] << " against " << losses[0x3F][differ] << ";"
                       << parts.str() << ")";
}

INSTANTIATE_TEST_SUITE_P(Variants, TrainerFreshMemory,
                         ::testing::Values("dropless", "padded", "dropping", "padded_swiglu", "dense"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// --micro-batches: the tiny preset's 8 sequences a step as 2 micro-batches of 4 train the same curve
// as one batch of 8 (the step's loss is the mean over the micro-batches; every gradient is added up,
// the experts' as one product over both micro-batches). The load-balancing loss is a statistic of
// the tokens routed together, so it is off in both runs. The runs differ in their sums' order and in
// cuBLAS's products' shapes: the losses agree within bf16 tolerance, step for step, over a few steps
// (AdamW then amplifies the differences), and the validation loss too. The record, the evaluation and
// the checkpoint run inside the micro-batched run.
TEST(Trainer, MicroBatchesTrainTheSameCurve) {
  REQUIRE_GPU();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig whole = tiny(dir.path(), "whole");
  whole.steps = 6;
  whole.warmup_steps = 2;
  whole.record_every = 3;
  whole.eval_every = 3;
  whole.checkpoint_every = 3;
  whole.model.aux_loss_coef = 0.0;
  ASSERT_EQ(whole.model.formulation, moe::Formulation::dropless);
  TrainConfig micro = whole;
  micro.run_dir = (dir.path() / "micro").string();
  micro.micro_batches = 2;
  std::ostringstream log;
  const moe::train::TrainResult want = moe::train::train(whole, log);
  const moe::train::TrainResult got = moe::train::train(micro, log);
  ASSERT_EQ(want.losses.size(), 6u);
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 2e-2 * want.losses[i]) << "step " << i + 1;
  }
  EXPECT_NEAR(got.validation_loss, want.validation_loss, 2e-2 * want.validation_loss);
  const moe::RunRecord run = moe::RunReader::load(micro.run_dir);
  EXPECT_EQ(metric_by_step(run, "loss").size(), 6u);
}

TEST(Trainer, BadResumesAndExistingRunsAreRefused) {
  REQUIRE_GPU();
  moe::testing::TempDir dir;
  moe::testing::write_sample_text(dir.path() / "text.txt");
  TrainConfig c = tiny(dir.path(), "run");
  c.steps = 10;
  c.warmup_steps = 2;
  c.checkpoint_every = 5;
  std::ostringstream log;
  moe::train::train(c, log);
  const std::string events_before = [&] {
    std::ifstream in(fs::path(c.run_dir) / "events.jsonl");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();

  // A second run into the same directory without --overwrite.
  EXPECT_THROW(moe::train::train(c, log), moe::train::TrainConfigError);  // names --overwrite and --resume

  // Resuming with another model.
  TrainConfig other = c;
  other.resume = true;
  other.model.top_k = 1;
  try {
    moe::train::train(other, log);
    ADD_FAILURE() << "a resume with another top_k was accepted";
  } catch (const moe::CheckpointError& error) {
    EXPECT_NE(std::string(error.what()).find("top_k (checkpoint 2, now 1)"), std::string::npos) << error.what();
  }

  // A corrupted checkpoint: one flipped byte in the middle.
  const fs::path latest = *moe::latest_checkpoint(fs::path(c.run_dir) / "checkpoints");
  {
    std::fstream file(latest, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(0, std::ios::end);
    const auto size = file.tellg();
    file.seekp(size / 2);
    char byte = 0;
    file.seekg(size / 2);
    file.read(&byte, 1);
    byte = char(byte ^ 0x40);
    file.seekp(size / 2);
    file.write(&byte, 1);
  }
  TrainConfig resume = c;
  resume.resume = true;
  resume.steps = 20;
  EXPECT_THROW(moe::train::train(resume, log), moe::CheckpointError);

  // None of the refusals touched the record.
  std::ifstream in(fs::path(c.run_dir) / "events.jsonl");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), events_before);

  // No checkpoint at all.
  TrainConfig fresh = tiny(dir.path(), "never_ran");
  fresh.resume = true;
  EXPECT_THROW(moe::train::train(fresh, log), moe::CheckpointError);
}

}  // namespace
