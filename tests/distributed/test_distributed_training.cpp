// test_distributed_training.cpp: the language model trained on R ranks (distributed/train/,
// cuda/train/trainer.h with ExpertParallelRanks) against the same model trained on one GPU on the
// same global batch, at the "tiny" preset on a small generated text:
//   - the loss curve is the one-GPU curve within bf16 tolerance (equal at R = 1; at R > 1 with
//     --overlap's default, two micro-batches overlapped wherever each rank's share splits evenly);
//   - a run stopped at a checkpoint and resumed continues its own curve, every step recorded once,
//     and its checkpoint (the whole model in the one-GPU layout) resumes on one GPU too;
//   - the run record holds every rank's spans and the dispatch / combine byte matrices (R x R);
//   - settings that the ranks cannot share end on every rank with a clear error, nothing written;
//   - with two micro-batches overlapped (--overlap on) the step's losses and gradients are the plain
//     step's within bf16 tolerance, and 20 steps follow its curve.
// Ranks share one GPU over MPI (staged through host memory); the _nccl build runs the same tests
// over NCCL with one GPU per rank. Every test skips on every rank, saying why, without a GPU.
//   mpirun -np 2 build/tests/distributed/test_distributed_training          (as root: --allow-run-as-root)
//   mpirun -np 2 build/tests/distributed/test_distributed_training_nccl     (two GPUs)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>  // getpid

#include "core/device_buffer.h"     // DeviceBuffer
#include "core/device_info.h"       // why_no_gpu
#include "model/model.h"            // ModelGpu, gpu_config_of
#include "model_config.h"           // moe_layer_config
#include "parameter_layout.h"       // initial_parameters
#include "expert_parallel_ranks.h"  // ExpertParallelRanks
#include "gpu_ranks_test_support.h"  // GpuRanksTest
#include "mpi_test_support.h"       // world
#include "checkpoint.h"             // load_checkpoint, save_checkpoint: a checkpoint rewritten with a bad placement
#include "run_record.h"             // RunReader
#include "sample_text.h"            // write_sample_text
#include "train/trainer.h"          // train
#if MOE_TEST_NCCL_BACKEND
#include "comm/nccl_communicator.h"
#endif

namespace moe::dist {
namespace {

namespace fs = std::filesystem;
using moe::dist::testing::world;
using moe::train::TrainConfig;
using nlohmann::json;

class DistributedTrainingTest : public testing::GpuRanksTest<DistributedTrainingTest> {
 protected:
  void SetUp() override {
    GpuRanksTest::SetUp();
    if (IsSkipped()) return;
    // One directory for every rank: rank 0 makes it and writes the text, the others learn its name.
    std::string name;
    if (world().rank() == 0) {
      const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
      const fs::path made = fs::temp_directory_path() /
                            ("moe_distributed_training_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
      fs::remove_all(made);
      fs::create_directories(made);
      moe::testing::write_sample_text(made / "text.txt");
      name = made.string();
    }
    int64_t length = static_cast<int64_t>(name.size());
    world().broadcast(&length, 1, DataType::int64, 0);
    name.resize(static_cast<size_t>(length));
    world().broadcast(name.data(), length, DataType::uint8, 0);
    dir_ = name;
    ranks_ = std::make_unique<ExpertParallelRanks>(world(), device_communicator());
  }
  void TearDown() override {
    if (skipped()) return;
    ranks_.reset();
    world().barrier();
    if (world().rank() == 0) fs::remove_all(dir_);
  }

  TrainConfig tiny(const std::string& run) const {
    TrainConfig c = moe::train::preset("tiny");
    c.data = (dir_ / "text.txt").string();
    c.run_dir = (dir_ / run).string();
    c.steps = 40;
    c.learning_rate = 3e-3;
    c.log_every = 5;
    c.eval_every = 20;
    c.checkpoint_every = 20;
    c.record_every = 20;
    return c;
  }

  fs::path dir_;
  std::unique_ptr<ExpertParallelRanks> ranks_;
};

// The "step" events' values of one metric, by step; fails the test if a step appears twice.
std::map<int64_t, double> metric_by_step(const fs::path& run_dir, const std::string& metric) {
  std::map<int64_t, double> values;
  for (const json& event : RunReader::load(run_dir).events) {
    if (event["type"] == "step" && event.contains(metric) && event[metric].is_number()) {
      const int64_t step = event["step"];
      EXPECT_FALSE(values.count(step)) << metric << " of step " << step << " recorded twice";
      values[step] = event[metric];
    }
  }
  return values;
}

// bf16 activations and another order of the gradient sums: the curves drift apart slowly. Each
// step's loss within 2% of the one-GPU loss, and the mean gap under 0.5%.
void expect_same_curve(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double gap = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 0.02 * std::abs(want[i])) << what << ": step " << i + 1;
    gap += std::abs(got[i] - want[i]) / std::abs(want[i]);
  }
  EXPECT_LT(gap / double(want.size()), 0.005) << what << ": the mean relative gap over " << want.size() << " steps";
}

TEST_F(DistributedTrainingTest, SameLossCurveAsOneGpuOnTheSameGlobalBatch) {
  std::ostringstream log;
  const TrainConfig c = tiny("ranks");
  const moe::train::TrainResult distributed = moe::train::train(c, log, ranks_.get());
  ASSERT_EQ(distributed.losses.size(), 40u);
  if (world().rank() == 0) {
    std::printf("%s", log.str().c_str());
    std::ostringstream one_log;
    const moe::train::TrainResult one = moe::train::train(tiny("one_gpu"), one_log);
    if (world().size() == 1) {
      EXPECT_EQ(distributed.losses, one.losses) << "one rank is the one-GPU model";
    } else {
      expect_same_curve(distributed.losses, one.losses, "R ranks against one GPU");
    }
    EXPECT_NEAR(distributed.validation_loss, one.validation_loss, 0.02 * one.validation_loss);
    EXPECT_LT(distributed.losses.back(), 0.8 * distributed.losses.front()) << "the model should learn";
  }
  world().barrier();
}

TEST_F(DistributedTrainingTest, ResumesItsOwnCurveAndItsCheckpointResumesOnOneGpu) {
  std::ostringstream log;
  const TrainConfig whole = tiny("whole");
  const moe::train::TrainResult uninterrupted = moe::train::train(whole, log, ranks_.get());

  TrainConfig first_half = tiny("halves");
  first_half.stop_after = 20;
  moe::train::train(first_half, log, ranks_.get());
  // The one-GPU run resumes from a copy of the checkpoint that the ranks wrote at step 20.
  if (world().rank() == 0) fs::copy(first_half.run_dir, dir_ / "one_gpu", fs::copy_options::recursive);
  world().barrier();

  TrainConfig second_half = tiny("halves");
  second_half.resume = true;
  const moe::train::TrainResult resumed = moe::train::train(second_half, log, ranks_.get());
  EXPECT_EQ(resumed.first_step, 20);
  const std::vector<double> tail(uninterrupted.losses.begin() + 20, uninterrupted.losses.end());
  ASSERT_EQ(resumed.losses.size(), tail.size());
  for (size_t i = 0; i < tail.size(); ++i) {
    EXPECT_NEAR(resumed.losses[i], tail[i], 1e-6 * std::abs(tail[i])) << "step " << 21 + i;
  }
  if (world().rank() == 0) {
    EXPECT_EQ(metric_by_step(second_half.run_dir, "loss").size(), 40u) << "every step once";
    TrainConfig on_one_gpu = tiny("one_gpu");
    on_one_gpu.resume = true;
    std::ostringstream one_log;
    const moe::train::TrainResult one = moe::train::train(on_one_gpu, one_log);
    EXPECT_EQ(one.first_step, 20);
    if (world().size() == 1) {
      EXPECT_EQ(one.losses, tail);
    } else {
      expect_same_curve(one.losses, tail, "the ranks' checkpoint resumed on one GPU");
    }
  }
  world().barrier();
}

TEST_F(DistributedTrainingTest, RecordsEveryRanksSpansAndTheAllToAllMatrices) {
  std::ostringstream log;
  const TrainConfig c = tiny("record");
  moe::train::train(c, log, ranks_.get());
  if (world().rank() == 0) {
    const int64_t R = world().size();
    const RunRecord run = RunReader::load(c.run_dir);
    EXPECT_EQ(run.info["world_size"], R);
    const int64_t T = c.batch * c.model.seq_len, K = c.model.top_k, D = c.model.model_dim;
    std::vector<bool> span_ranks(static_cast<size_t>(R), false);
    int dispatches = 0, pipelining_tables = 0;
    for (const json& event : run.events) {
      if (event["type"] == "span") span_ranks.at(event["rank"].get<size_t>()) = true;
      if (event["type"] == "table" && event["name"].get<std::string>().starts_with("pipelining degree")) {
        ++pipelining_tables;
        ASSERT_FALSE(event["rows"].empty());
        EXPECT_LE(event["rows"].size(), static_cast<size_t>(c.model.num_layers));
        for (const json& row : event["rows"]) {
          EXPECT_EQ(row[1], 1) << "d of every MoE block: the layers' default, pipeline_chunks = 1";
          EXPECT_EQ(row[2], "--pipeline-chunks");
        }
      }
      if (event["type"] == "alltoall" && event["name"] == "dispatch") {
        ++dispatches;
        const std::vector<std::vector<int64_t>> bytes = event["bytes"];
        ASSERT_EQ(static_cast<int64_t>(bytes.size()), R);
        int64_t total = 0;
        for (const std::vector<int64_t>& row : bytes) {
          ASSERT_EQ(static_cast<int64_t>(row.size()), R);
          total += std::accumulate(row.begin(), row.end(), int64_t{0});
        }
        EXPECT_EQ(total, T * K * D * 2) << "dropless: every slot's bf16 row travels once";
      }
    }
    for (int64_t q = 0; q < R; ++q) EXPECT_TRUE(span_ranks[static_cast<size_t>(q)]) << "spans of rank " << q;
    // One rank trains the one-GPU model (MoeLayerGpu blocks): no exchange, nothing to pipeline.
    EXPECT_EQ(pipelining_tables, R > 1 ? 1 : 0) << "each block's pipelining degree, written again only when it changes";
    if (R > 1) {
      EXPECT_GT(dispatches, 0) << "the recorded steps' dispatch matrices";
    } else {
      EXPECT_EQ(dispatches, 0) << "one rank exchanges nothing";
    }
  }
  world().barrier();
}

TEST_F(DistributedTrainingTest, RecordsThePipeliningDegreeEachBlockChoseByMeasurement) {
  if (world().size() == 1) GTEST_SKIP() << "one rank trains the one-GPU model: no exchange to pipeline";
  std::ostringstream log;
  TrainConfig c = tiny("adaptive");
  c.steps = 12;  // the trials: 2 steps for each of d = 1, 2, 4, 8, then the choice
  c.record_every = 1;
  ExpertParallelRanks adaptive(world(), device_communicator(), {.pipeline_chunks = kAdaptivePipelineChunks});
  moe::train::train(c, log, &adaptive);
  if (world().rank() == 0) {
    std::vector<json> tables;
    for (const json& event : RunReader::load(c.run_dir).events) {
      if (event["type"] == "table" && event["name"].get<std::string>().starts_with("pipelining degree")) {
        tables.push_back(event);
      }
    }
    ASSERT_GE(tables.size(), 2u) << "while the trials run, then the choice";
    EXPECT_EQ(tables.front()["rows"][0][2], "measurement (trials running)");
    for (const json& row : tables.back()["rows"]) {
      EXPECT_EQ(row[2], "measurement");
      const int d = row[1];
      EXPECT_TRUE(d == 1 || d == 2 || d == 4 || d == 8) << "a candidate degree, not " << d;
      const std::string trials = row[3];
      EXPECT_NE(trials.find("d=8 "), std::string::npos) << "every candidate's trial time: " << trials;
      EXPECT_EQ(trials.find(" -"), std::string::npos) << "all measured: " << trials;
    }
  }
  world().barrier();
}

TEST_F(DistributedTrainingTest, SettingsTheRanksCannotShareEndOnEveryRank) {
  std::ostringstream log;
  const int R = world().size();
  TrainConfig odd_batch = tiny("odd_batch");
  odd_batch.batch = 2 * R + 1;
  if (R > 1) {
    EXPECT_THROW(moe::train::train(odd_batch, log, ranks_.get()), moe::train::TrainConfigError);
    TrainConfig few_experts = tiny("few_experts");
    few_experts.model.num_experts = R - 1;  // a rank would hold no expert
    few_experts.model.top_k = 1;
    EXPECT_THROW(moe::train::train(few_experts, log, ranks_.get()), std::invalid_argument);
    TrainConfig too_many_spares = tiny("too_many_spares");
    too_many_spares.placement = "eplb";
    too_many_spares.redundant_slots = 4;  // E = 4: at most E - ceil(E / R) spare slots a rank
    EXPECT_THROW(moe::train::train(too_many_spares, log, ranks_.get()), std::invalid_argument);
    world().barrier();
    for (const TrainConfig* c : {&odd_batch, &few_experts, &too_many_spares}) {
      EXPECT_FALSE(fs::exists(fs::path(c->run_dir) / "run.json")) << c->run_dir;
      EXPECT_FALSE(fs::exists(fs::path(c->run_dir) / "checkpoints")) << c->run_dir;
    }
  }
  world().barrier();
}

TEST_F(DistributedTrainingTest, TheBackwardSumsEveryReplicatedGradientOverTheRanks) {
  // One forward + backward of the tiny model on R ranks against one GPU's on the same global batch.
  // The backward sums the replicated gradients over the ranks in per-block buckets under its own
  // work (model.h): every replicated tensor's gradient, on every rank, is the one-GPU gradient
  // within bf16 tolerance (a bucket left out would be one rank's share, about 1 / R of it), and the
  // ranks hold the same bits. The experts' gradients are each rank's own and are not compared here.
  const TrainConfig c = tiny("unused");
  const int R = world().size(), rank = world().rank();
  const int64_t N = 2 * R, S = c.model.seq_len, N_r = N / R;
  cuda::ModelGpuConfig one = cuda::gpu_config_of(c.model, N);
  cuda::ModelGpuConfig local = cuda::gpu_config_of(c.model, N_r);
  local.moe = moe_layer_config(c.model, N);  // the MoE layers see all ranks' tokens
  local.ranks = R;
  local.rank = rank;
  const std::vector<double> initial = initial_parameters(c.model, c.seed);
  const std::vector<float> whole(initial.begin(), initial.end());
  std::map<std::string, int64_t> whole_offset;
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(one)) whole_offset[p.name] = p.offset;
  std::vector<float> part;  // this rank's parameters in its own layout: the replicated ones and its experts
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(local)) {
    part.insert(part.end(), whole.begin() + whole_offset.at(p.name), whole.begin() + whole_offset.at(p.name) + p.rows * p.cols);
  }
  std::vector<int32_t> tokens(size_t(N * S)), targets(size_t(N * S));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 131 + 7) % 256);
    targets[i] = int32_t((i * 61 + 3) % 256);
  }
  auto on_device = [](const int32_t* first, int64_t count) {
    return cuda::DeviceBuffer<int32_t>(std::vector<int32_t>(first, first + count));
  };

  cuda::ModelGpu reference(one);
  reference.upload_weights(whole);
  const cuda::DeviceBuffer<int32_t> all_tokens = on_device(tokens.data(), N * S), all_targets = on_device(targets.data(), N * S);
  reference.forward(all_tokens.data(), all_targets.data());
  reference.backward();
  const std::vector<float> want = reference.download_gradients();

  cuda::ModelGpu model(local, {}, nullptr, ranks_.get());
  model.upload_weights(part);
  const cuda::DeviceBuffer<int32_t> my_tokens = on_device(tokens.data() + rank * N_r * S, N_r * S);
  const cuda::DeviceBuffer<int32_t> my_targets = on_device(targets.data() + rank * N_r * S, N_r * S);
  model.forward(my_tokens.data(), my_targets.data());
  model.backward();
  const std::vector<float> got = model.download_gradients();

  std::vector<float> replicated;  // every rank's replicated gradients, gathered to compare their bits
  int64_t tensors = 0;
  for (const cuda::ParameterSpan& p : model.layout()) {
    if (p.is_expert()) continue;
    ++tensors;
    double scale = 0, worst = 0;
    for (int64_t i = 0; i < p.rows * p.cols; ++i) scale = std::max(scale, std::abs(double(want[size_t(whole_offset.at(p.name) + i)])));
    for (int64_t i = 0; i < p.rows * p.cols; ++i) {
      const double difference = double(got[size_t(p.offset + i)]) - double(want[size_t(whole_offset.at(p.name) + i)]);
      worst = std::max(worst, std::abs(difference));
      replicated.push_back(got[size_t(p.offset + i)]);
    }
    EXPECT_LE(worst, 0.05 * scale + 1e-6) << p.name << " on rank " << rank << " (largest one-GPU gradient " << scale << ")";
  }
  EXPECT_GT(tensors, 4);
  const std::vector<float> everyone = all_gather(world(), std::span<const float>(replicated));
  for (int r = 1; r < R; ++r) {
    EXPECT_TRUE(std::equal(replicated.begin(), replicated.end(), everyone.begin() + ptrdiff_t(r) * ptrdiff_t(replicated.size())))
        << "rank " << r << "'s replicated gradients differ from rank " << rank << "'s";
  }
}

// One forward + backward of the tiny model on R ranks, plain and with two-micro-batch overlap
// (model.h), on the same weights and batch: the same tokens in another order of the sums, so every
// gradient, experts' included, within bf16 tolerance of the plain step's, and the cross-entropy
// within rounding. The router losses are each half's own statistics (model.h), so the total loss
// may differ by the load-balancing term's change, a small fraction of it.
TEST_F(DistributedTrainingTest, OverlapGivesThePlainStepsLossesAndGradients) {
  TrainConfig c = tiny("unused");
  const int R = world().size(), rank = world().rank();
  const int64_t N_r = 4, S = c.model.seq_len;
  cuda::ModelGpuConfig plain = cuda::gpu_config_of(c.model, N_r);
  plain.moe = moe_layer_config(c.model, N_r * R);
  plain.ranks = R;
  plain.rank = rank;
  cuda::ModelGpuConfig overlapped = plain;
  overlapped.overlap = true;
  const std::vector<double> initial = initial_parameters(c.model, c.seed);
  const std::vector<float> whole(initial.begin(), initial.end());
  std::map<std::string, int64_t> whole_offset;
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(cuda::gpu_config_of(c.model, N_r))) {
    whole_offset[p.name] = p.offset;
  }
  std::vector<float> part;
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(plain)) {
    part.insert(part.end(), whole.begin() + whole_offset.at(p.name), whole.begin() + whole_offset.at(p.name) + p.rows * p.cols);
  }
  std::vector<int32_t> tokens(size_t(N_r * S)), targets(size_t(N_r * S));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 131 + 7 + size_t(rank) * 17) % 256);
    targets[i] = int32_t((i * 61 + 3 + size_t(rank) * 5) % 256);
  }
  const cuda::DeviceBuffer<int32_t> device_tokens(tokens), device_targets(targets);
  auto run = [&](const cuda::ModelGpuConfig& config, std::vector<float>& losses) {
    cuda::ModelGpu model(config, {}, nullptr, ranks_.get());
    model.upload_weights(part);
    model.forward(device_tokens.data(), device_targets.data());
    model.backward();
    losses = model.losses().download();
    EXPECT_EQ(model.lanes(), config.overlap ? 2 : 1);
    return model.download_gradients();
  };
  std::vector<float> want_losses, got_losses;
  const std::vector<float> want = run(plain, want_losses);
  const std::vector<float> got = run(overlapped, got_losses);
  EXPECT_NEAR(got_losses[1], want_losses[1], 1e-5 * std::abs(want_losses[1])) << "the cross-entropy";
  EXPECT_NEAR(got_losses[0], want_losses[0], 0.01 * std::abs(want_losses[0])) << "the loss";
  ASSERT_EQ(got.size(), want.size());
  int64_t tensors = 0;
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(plain)) {
    ++tensors;
    double scale = 0, worst = 0;
    for (int64_t i = p.offset; i < p.offset + p.rows * p.cols; ++i) scale = std::max(scale, std::abs(double(want[size_t(i)])));
    for (int64_t i = p.offset; i < p.offset + p.rows * p.cols; ++i) {
      worst = std::max(worst, std::abs(double(got[size_t(i)]) - double(want[size_t(i)])));
    }
    EXPECT_LE(worst, 0.05 * scale + 1e-6) << p.name << " on rank " << rank << " (largest plain gradient " << scale << ")";
  }
  EXPECT_GT(tensors, 4);
  world().barrier();
}

// Twenty steps of training with overlap follow the plain run's curve; an odd batch per rank is a
// clear error on every rank, with nothing written.
TEST_F(DistributedTrainingTest, OverlapTrainsThePlainCurve) {
  const int R = world().size();
  std::ostringstream log;
  TrainConfig plain = tiny("plain");
  plain.batch = 4 * R;
  plain.steps = 20;
  TrainConfig overlapped = plain;
  overlapped.run_dir = (dir_ / "overlapped").string();
  overlapped.overlap = true;
  const moe::train::TrainResult a = moe::train::train(plain, log, ranks_.get());
  const moe::train::TrainResult b = moe::train::train(overlapped, log, ranks_.get());
  expect_same_curve(b.losses, a.losses, "overlap against the plain step");
  TrainConfig odd = overlapped;
  odd.run_dir = (dir_ / "odd").string();
  odd.batch = 3 * R;  // N / R = 3: no two equal halves
  EXPECT_THROW(moe::train::train(odd, log, ranks_.get()), moe::train::TrainConfigError);
  world().barrier();
  EXPECT_FALSE(fs::exists(fs::path(odd.run_dir) / "run.json"));
  world().barrier();
}

}  // namespace
}  // namespace moe::dist

namespace moe::dist {
namespace {

// E = 2R + 1 experts (not a multiple of R): contiguous_placement gives some ranks one more; the
// curve is the one-GPU curve.
TEST_F(DistributedTrainingTest, ExpertsThatDoNotDivideByTheRanksTrainTheOneGpuCurve) {
  if (world().size() == 1) GTEST_SKIP() << "one rank holds every expert";
  TrainConfig c = tiny("uneven");
  c.model.num_experts = 2 * world().size() + 1;
  c.steps = 20;
  std::ostringstream log;
  const moe::train::TrainResult ranks = moe::train::train(c, log, ranks_.get());
  if (world().rank() == 0) {
    TrainConfig one_gpu = c;
    one_gpu.run_dir = (dir_ / "uneven_one_gpu").string();
    std::ostringstream one_log;
    expect_same_curve(ranks.losses, moe::train::train(one_gpu, one_log).losses, "E = 2R + 1 on R ranks");
  }
  world().barrier();
}

// --placement eplb: every 10 steps each block's experts are placed again by the loads of those
// steps (one spare slot a rank: replicas of the hot experts), their weights and AdamW moments moved.
//   - A run stopped at step 20, just after a re-plan, and resumed (its model built over that
//     placement from the start) gives the uninterrupted run's losses: moving the experts between
//     two steps is the same as training with the new placement from there.
//   - A run stopped at step 15, between two plans, resumes with the loads counted so far and
//     gives the same losses again.
//   - The curve is the contiguous placement's within bf16 tolerance (replicas sum their gradients
//     in another order); the record has a placement table at steps 10, 20 and 30.
//   - A checkpoint whose placement leaves an expert on no rank, names an expert out of range or
//     lists the wrong number of ranks is refused on every rank before any step, naming the fault.
TEST_F(DistributedTrainingTest, RebalancingMidRunEqualsResumingWithThatPlacement) {
  if (world().size() == 1) GTEST_SKIP() << "one rank holds every expert: nothing to place";
  const auto eplb = [&](const std::string& run) {
    TrainConfig c = tiny(run);
    c.placement = "eplb";
    c.redundant_slots = 1;
    c.rebalance_every = 10;
    c.checkpoint_every = 40;
    return c;
  };
  std::ostringstream log;
  const moe::train::TrainResult whole = moe::train::train(eplb("whole"), log, ranks_.get());
  ASSERT_EQ(whole.losses.size(), 40u);
  for (int64_t stop : {20, 15}) {
    const std::string run = "stopped_" + std::to_string(stop);
    TrainConfig first = eplb(run);
    first.stop_after = stop;
    moe::train::train(first, log, ranks_.get());
    TrainConfig second = eplb(run);
    second.resume = true;
    const moe::train::TrainResult resumed = moe::train::train(second, log, ranks_.get());
    ASSERT_EQ(resumed.first_step, stop);
    ASSERT_EQ(resumed.losses.size(), size_t(40 - stop));
    for (size_t i = 0; i < resumed.losses.size(); ++i) {
      EXPECT_NEAR(resumed.losses[i], whole.losses[size_t(stop) + i], 1e-6 * std::abs(whole.losses[size_t(stop) + i]))
          << "stopped at " << stop << ", step " << stop + 1 + int64_t(i);
    }
  }
  const moe::train::TrainResult contiguous = moe::train::train(tiny("contiguous"), log, ranks_.get());
  expect_same_curve(whole.losses, contiguous.losses, "EPLB against E / R in id order");
  EXPECT_NE(whole.losses, contiguous.losses) << "the replicas should change the order of some sums";

  if (world().rank() == 0) {
    std::vector<int64_t> planned_at;
    for (const json& event : RunReader::load(eplb("whole").run_dir).events) {
      if (event["type"] != "table" || event["name"] != "placement") continue;
      for (const json& row : event["rows"]) {
        planned_at.push_back(row[0].get<int64_t>());
        EXPECT_EQ(row[4].get<int64_t>(), world().size()) << "one spare slot a rank: R replicas in all";
        EXPECT_GE(row[3].get<double>(), 1.0) << "the busiest rank carries at least the mean";
      }
    }
    EXPECT_EQ(planned_at, (std::vector<int64_t>{10, 10, 20, 20, 30, 30})) << "two MoE blocks, planned at 10, 20, 30";
    // The checkpoint at step 20 holds the placement planned at step 20, with its replicas.
    const moe::LoadedCheckpoint at_20 =
        moe::load_checkpoint(moe::checkpoint_path(fs::path(eplb("stopped_20").run_dir) / "checkpoints", 20));
    const json& saved = at_20.header.extra["expert_placements"];
    EXPECT_EQ(saved["ranks"], world().size());
    size_t slots = 0;
    for (const json& experts : saved["blocks"][0]) slots += experts.size();
    EXPECT_EQ(slots, size_t(4 + world().size())) << saved.dump();
  }
  world().barrier();

  // Bad placements in the run's latest checkpoint (rank 0 rewrites it; every rank then resumes).
  const std::vector<std::pair<json, std::string>> bad = {
      {json::array({json::array({0, 1}), json::array({1, 2})}), "expert 3"},
      {json::array({json::array({0, 1, 9}), json::array({2, 3})}), "9"},
      {json::array({json::array({0, 1}), json::array({2}), json::array({3})}), "not a list of 2 ranks' experts"},
  };
  for (const auto& [block, expected] : bad) {
    if (world().size() != 2) break;  // the cases are written for two ranks
    if (world().rank() == 0) {
      const fs::path file = *moe::latest_checkpoint(fs::path(eplb("stopped_20").run_dir) / "checkpoints");
      moe::LoadedCheckpoint checkpoint = moe::load_checkpoint(file);
      checkpoint.header.extra["expert_placements"]["blocks"][0] = block;
      std::vector<moe::CheckpointArrayView> arrays;
      for (const std::string& name : checkpoint.names) arrays.push_back({name, checkpoint.array(name)});
      moe::save_checkpoint(file, checkpoint.header, arrays);
    }
    world().barrier();
    TrainConfig again = eplb("stopped_20");
    again.resume = true;
    again.steps = 60;  // past the checkpoint's step 40: only the placement is wrong
    try {
      moe::train::train(again, log, ranks_.get());
      ADD_FAILURE() << "a checkpoint whose placement is " << block.dump() << " was resumed";
    } catch (const moe::CheckpointError& error) {
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find("expert_placements: MoE block 0"), std::string::npos) << error.what();
    }
    world().barrier();
  }
}

// No step reads GPU memory it did not write first, through the re-plans too (each rebuilds the
// model over buffers that may hold a freed model's data): with every new buffer filled with zero
// bytes, then with 0xFF bytes (NaN as floats), then as cudaMalloc leaves it, the same losses.
TEST_F(DistributedTrainingTest, LossesDoNotDependOnWhatNewBuffersHold) {
  if (world().size() == 1) GTEST_SKIP() << "one rank trains the one-GPU model (tests/train covers it)";
  for (const std::string placement : {"contiguous", "eplb"}) {
    std::vector<std::vector<double>> runs;
    for (int fill : {0x00, 0xFF, -1}) {
      TrainConfig c = tiny(placement + "_fill_" + std::to_string(fill));
      c.placement = placement;
      c.rebalance_every = 10;
      c.steps = 30;
      std::ostringstream log;
      moe::cuda::set_device_buffer_fill(fill);
      runs.push_back(moe::train::train(c, log, ranks_.get()).losses);
    }
    moe::cuda::set_device_buffer_fill(-1);
    for (size_t run = 1; run < runs.size(); ++run) {
      ASSERT_EQ(runs[run].size(), runs[0].size());
      for (size_t i = 0; i < runs[0].size(); ++i) {
        if (runs[run][i] == runs[0][i]) continue;
        ADD_FAILURE() << placement << ": run " << run << " (fill " << (run == 1 ? "0xFF" : "none")
                      << ") differs from the zero-filled run at step " << i + 1 << ": " << runs[run][i] << " against "
                      << runs[0][i];
        break;
      }
    }
  }
}

}  // namespace
}  // namespace moe::dist
