// test_infer.cpp: generation on the GPU (cuda/infer/): the decoding model against the CPU
// reference's incremental decoding, prefill + decode against the full-sequence forward of ModelGpu,
// every expert schedule bit for bit the same, the host sampler against the reference's, and the
// errors of bad input. Tiny models (D=64, 2 heads, S=32, E=4, H=64), random weights rounded to bf16
// so that both sides see the same bytes, as tests/cuda/test_model.cpp does.
// Run: ctest --test-dir build -R "CudaInfer"   (the decoding tests skip without a GPU; the sampler,
// weights-file and config checks run anywhere)
//
// Tolerance, from the precision: next-byte logits within 2e-2 relative (Frobenius over [N, V]).
// Every activation is bf16 between fp32-accumulated products, through L blocks of LayerNorm,
// attention and FFN; the KV cache holds bf16 keys and values. Errors of a few 1e-3 are expected.
//
// Routing is the one discontinuity (test_model.cpp says it in full): a token whose K-th and
// (K+1)-th router probabilities differ by less than bf16 rounding may choose another expert on the
// GPU. The decoding tests compare every MoE block's choices first and, on a near tie, draw other
// bytes (at most kTries times), reporting how many draws they took.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"                       // save_checkpoint, CheckpointHeader
#include "core/cuda_check.h"                  // CUDA_CHECK
#include "core/device_buffer.h"               // DeviceBuffer
#include "gpu_test_support.h"                 // REQUIRE_GPU, bf16_init, relative_error
#include "infer/generate.h"                   // moe::cuda::generate
#include "infer/inference_model.h"            // InferenceModelGpu
#include "infer/offload_recording.h"          // RecordedExpertSource
#include "infer/sampling.h"                   // moe::cuda::ByteSampler
#include "infer/weights_file.h"               // load_weights_safetensors, load_weights_checkpoint, gpu_config_of
#include "model/model.h"                      // ModelGpu
#include "offload/device_slot_cache.h"        // DeviceSlotCache
#include "offload/expert_source.h"            // ExpertSource
#include "offload/offloaded_experts.h"        // OffloadedExperts, OffloadOptions, HostExperts
#include "offload/resident_blocks.h"          // ResidentBlocks, parse_resident_blocks
#include "offload/resident_experts.h"         // ResidentExperts
#include "reference_cpu/generate.h"           // moe::ref::prefill, decode_step
#include "reference_cpu/model.h"              // moe::ref::init_model, parameters
#include "config_json.h"  // model_config_to_json
#include "reference_cpu/model_safetensors.h"  // save_model_safetensors
#include "reference_cpu/sampling.h"           // moe::ref::ByteSampler
#include "run_record.h"                       // RunWriter, RunReader

namespace {

namespace fs = std::filesystem;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::cuda::ExpertSchedule;
using moe::cuda::ExpertTables;
using moe::cuda::InferenceModelGpu;
using moe::cuda::ModelGpuConfig;
using moe::cuda::MoeBlockStep;
using moe::cuda::StepResult;
using moe::ref::Matrix;
using moe::ModelConfig;
using moe::MoeLayers;
using namespace moe::test;

constexpr double kTolerance = 2e-2;
constexpr int kTries = 8;
constexpr int64_t kV = 256;

ModelConfig tiny_config(MoeLayers moe_layers, bool pregated, int64_t num_layers, int64_t top_k) {
  ModelConfig c;
  c.model_dim = 64;
  c.num_layers = num_layers;
  c.num_heads = 2;
  c.seq_len = 32;
  c.moe_layers = moe_layers;
  c.dense_hidden_dim = 128;
  c.num_experts = 4;
  c.top_k = top_k;
  c.expert_hidden_dim = 64;
  c.block_size = 64;
  c.pregated = pregated;
  return c;
}

std::vector<int32_t> random_bytes(std::mt19937_64& rng, size_t count) {
  std::vector<int32_t> bytes(count);
  for (int32_t& b : bytes) b = int32_t(rng() & 0xFF);
  return bytes;
}

// N prompts of P random bytes, then `steps` rows of N bytes to decode after them.
struct DecodeInputs {
  std::vector<std::vector<int32_t>> prompts, bytes;
};
DecodeInputs random_decode_inputs(uint64_t seed, int64_t N, int64_t P, int64_t steps) {
  std::mt19937_64 rng(seed);
  DecodeInputs in;
  for (int64_t n = 0; n < N; ++n) in.prompts.push_back(random_bytes(rng, size_t(P)));
  for (int64_t s = 0; s < steps; ++s) in.bytes.push_back(random_bytes(rng, size_t(N)));
  return in;
}

Matrix logits_matrix(const std::vector<float>& next_logits, int64_t N) {
  Matrix m(N, kV);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = 0; v < kV; ++v) m(n, v) = next_logits[size_t(n * kV + v)];
  }
  return m;
}

// Tokens whose expert set differs between the GPU step's record and the reference step's routing.
int routing_differences(const StepResult& gpu, const moe::ref::StepOutput& ref, int64_t K) {
  if (gpu.moe.size() != ref.moe.size()) return 1 << 20;
  int differences = 0;
  for (size_t j = 0; j < gpu.moe.size(); ++j) {
    const moe::ref::IndexMatrix& top = ref.moe[j].top_experts;
    if (gpu.moe[j].block != ref.moe[j].block || int64_t(gpu.moe[j].top_experts.size()) != top.size()) return 1 << 20;
    for (int64_t t = 0; t < top.rows(); ++t) {
      std::set<int32_t> got(gpu.moe[j].top_experts.begin() + t * K, gpu.moe[j].top_experts.begin() + (t + 1) * K), want;
      for (int64_t k = 0; k < K; ++k) want.insert(int32_t(top(t, k)));
      differences += got != want;
    }
  }
  return differences;
}

// A resident ExpertSource for the tests: every expert of every MoE block on the GPU, at addresses
// that change with `placement` (a leading offset and, for odd placements, the experts in reverse
// order). With on_host, it asks for the blocks' choices and points every expert a block did not
// choose at a NaN expert, so a kernel that read one, or an acquire that missed one, shows in the
// logits; it logs what it was asked and counts calls out of order.
class TestExperts : public moe::cuda::ExpertSource {
 public:
  TestExperts(const ModelGpuConfig& config, const std::vector<float>& flat, int placement, bool on_host)
      : on_host_(on_host), experts_(config.moe.num_experts) {
    const int64_t D = config.model_dim, H = config.moe.hidden_dim, E = experts_;
    const size_t matrix = size_t(D * H), pad = size_t(placement) * 64;  // keeps 128-byte alignment
    const std::vector<moe::cuda::ParameterSpan> layout = moe::cuda::parameter_layout(config);
    auto offset_of = [&](const std::string& name) {
      return std::find_if(layout.begin(), layout.end(), [&](const auto& s) { return s.name == name; })->offset;
    };
    nan_expert_ = DeviceBuffer<bf16>(std::vector<bf16>(matrix, __float2bfloat16(NAN)));
    for (int64_t i = 0; i < config.num_layers; ++i) {
      if (!moe::cuda::is_moe_block(config, i)) continue;
      // [pad, then 2E matrices: expert e's w1 and w2 at slot p(e)]
      std::vector<bf16> host(pad + 2 * size_t(E) * matrix, __float2bfloat16(0.0f));
      auto slot = [&](int64_t e) { return size_t(placement % 2 == 1 ? E - 1 - e : e); };
      for (int64_t e = 0; e < E; ++e) {
        const std::string prefix = "blocks." + std::to_string(i) + ".moe.";
        const int64_t w1 = offset_of(prefix + "w1." + std::to_string(e)), w2 = offset_of(prefix + "w2." + std::to_string(e));
        for (size_t k = 0; k < matrix; ++k) {
          host[pad + 2 * slot(e) * matrix + k] = __float2bfloat16(flat[size_t(w1) + k]);
          host[pad + (2 * slot(e) + 1) * matrix + k] = __float2bfloat16(flat[size_t(w2) + k]);
        }
      }
      weights_.emplace_back(host);
      std::vector<const bf16*> table(2 * size_t(E));
      for (int64_t e = 0; e < E; ++e) {
        table[size_t(e)] = weights_.back().data() + pad + 2 * slot(e) * matrix;
        table[size_t(E + e)] = weights_.back().data() + pad + (2 * slot(e) + 1) * matrix;
      }
      resident_tables_.push_back(table);
      tables_.emplace_back(table);
      held_.push_back(false);
    }
  }

  bool needs_experts_on_host() const override { return on_host_; }

  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override {
    const size_t b = size_t(block);
    if (block < 0 || b >= tables_.size()) throw std::invalid_argument("TestExperts: no MoE block " + std::to_string(block));
    if (held_[b]) ++misuse;
    if (!std::is_sorted(experts.begin(), experts.end()) ||
        std::adjacent_find(experts.begin(), experts.end()) != experts.end()) {
      ++misuse;
    }
    held_[b] = true;
    acquired.push_back({block, {experts.begin(), experts.end()}});
    if (on_host_) {
      // Chosen experts at their weights, the others at NaN; uploaded on the compute stream, ahead
      // of the kernels that read the table (a pageable copy is staged before the call returns).
      std::vector<const bf16*>& table = staged_[b];
      table.assign(2 * size_t(experts_), nan_expert_.data());
      for (int32_t e : experts) {
        table[size_t(e)] = resident_tables_[b][size_t(e)];
        table[size_t(experts_ + e)] = resident_tables_[b][size_t(experts_ + e)];
      }
      CUDA_CHECK(cudaMemcpyAsync(tables_[b].data(), table.data(), tables_[b].bytes(), cudaMemcpyHostToDevice, compute));
    }
    return {tables_[b].data(), tables_[b].data() + experts_};
  }

  void release(int64_t block, cudaStream_t) override {
    if (block < 0 || size_t(block) >= held_.size()) throw std::invalid_argument("TestExperts: no MoE block");
    if (!held_[size_t(block)]) ++misuse;
    held_[size_t(block)] = false;
  }

  void prefetch(int64_t block, std::span<const int32_t> experts) override {
    if (block < 0 || size_t(block) >= held_.size()) ++misuse;
    prefetched.push_back({block, {experts.begin(), experts.end()}});
  }

  struct Call {
    int64_t block;
    std::vector<int32_t> experts;
  };
  std::vector<Call> acquired, prefetched;
  int misuse = 0;

 private:
  bool on_host_;
  int64_t experts_;
  DeviceBuffer<bf16> nan_expert_;                        // [D * H]
  std::vector<DeviceBuffer<bf16>> weights_;              // [M] each [pad + 2E * D * H]
  std::vector<std::vector<const bf16*>> resident_tables_;  // [M][2E] w1 pointers, then w2 pointers
  std::vector<DeviceBuffer<const bf16*>> tables_;        // [M][2E] what acquire returns
  std::map<size_t, std::vector<const bf16*>> staged_;    // [M][2E] the last table uploaded
  std::vector<bool> held_;
};

// ---------------------------------------------------------------------------------------------
// (a) one GPU decode step against the reference's incremental decoding

struct DecodeCase {
  MoeLayers moe_layers;
  bool pregated;
  int64_t num_layers;
  int64_t top_k;
  int64_t batch;
};

std::string case_name(const DecodeCase& c) {
  return std::string(c.moe_layers == MoeLayers::every_block ? "every_block" : "every_other_block") +
         (c.pregated ? "_pregated" : "_self_gated") + "_L" + std::to_string(c.num_layers) + "_K" +
         std::to_string(c.top_k) + "_N" + std::to_string(c.batch);
}

void PrintTo(const DecodeCase& c, std::ostream* out) { *out << case_name(c); }  // ctest's names, not bytes

class CudaInferDecode : public ::testing::TestWithParam<DecodeCase> {};

// Prefill of 5 bytes, then 3 decode steps, each step's next-byte logits against the reference's.
TEST_P(CudaInferDecode, StepMatchesReferenceIncrementalDecoding) {
  REQUIRE_GPU();
  const DecodeCase& c = GetParam();
  const ModelConfig config = tiny_config(c.moe_layers, c.pregated, c.num_layers, c.top_k);
  const int64_t N = c.batch, P = 5, steps = 3;
  const Bf16ModelWeights weights = bf16_init(config, 17);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
  TestExperts experts(gpu, weights.flat, 0, /*on_host=*/true);
  InferenceModelGpu model(gpu, weights.flat, experts, c.pregated ? ExpertSchedule::pregated : ExpertSchedule::on_demand);

  std::mt19937_64 rng(23);
  int tries = 0, differences = 0;
  std::vector<double> errors;
  do {
    errors.clear();
    differences = 0;
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t n = 0; n < N; ++n) prompts.push_back(random_bytes(rng, size_t(P)));
    model.poison();  // the cache and the step's buffers NaN: nothing may be read before it is written
    moe::ref::KvCache cache = moe::ref::make_kv_cache(config, N);
    moe::ref::StepOutput ref = moe::ref::prefill(config, weights.values, prompts, cache);
    StepResult gpu_step = model.prefill(prompts);
    differences += routing_differences(gpu_step, ref, c.top_k);
    errors.push_back(relative_error(logits_matrix(gpu_step.next_logits, N), ref.next_logits));
    for (int64_t step = 0; step < steps; ++step) {
      const std::vector<int32_t> next = random_bytes(rng, size_t(N));
      ref = moe::ref::decode_step(config, weights.values, next, cache);
      gpu_step = model.decode_step(next);
      differences += routing_differences(gpu_step, ref, c.top_k);
      errors.push_back(relative_error(logits_matrix(gpu_step.next_logits, N), ref.next_logits));
      for (size_t j = 0; j < gpu_step.moe.size(); ++j) {
        EXPECT_EQ(gpu_step.moe[j].known_in_block, ref.moe[j].known_in_block) << "MoE block " << j;
      }
    }
  } while (differences > 0 && ++tries < kTries);
  ASSERT_EQ(differences, 0) << "every one of " << kTries << " draws had a token routed differently";
  EXPECT_EQ(model.length(), P + steps);
  EXPECT_EQ(experts.misuse, 0) << "acquire / release / prefetch out of order";
  double worst = 0;
  for (size_t i = 0; i < errors.size(); ++i) {
    EXPECT_LT(errors[i], kTolerance) << (i == 0 ? "prefill" : "decode step " + std::to_string(i));
    if (!(errors[i] <= worst)) worst = errors[i];  // a NaN becomes the worst
  }
  std::printf("%s %s: draws %d, prefill + %lld decode steps, worst next-logit error %.2e (tol %.0e)\n",
              worst < kTolerance ? "PASS" : "FAIL", case_name(c).c_str(), tries + 1, (long long)steps, worst, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaInferDecode,
                         ::testing::Values(DecodeCase{MoeLayers::every_block, false, 2, 1, 1},
                                           DecodeCase{MoeLayers::every_block, false, 2, 1, 3},
                                           DecodeCase{MoeLayers::every_block, false, 2, 2, 1},
                                           DecodeCase{MoeLayers::every_block, false, 2, 2, 3},
                                           DecodeCase{MoeLayers::every_block, true, 3, 1, 1},
                                           DecodeCase{MoeLayers::every_block, true, 3, 1, 3},
                                           DecodeCase{MoeLayers::every_block, true, 3, 2, 1},
                                           DecodeCase{MoeLayers::every_block, true, 3, 2, 3},
                                           DecodeCase{MoeLayers::every_other_block, false, 2, 2, 3},
                                           DecodeCase{MoeLayers::every_other_block, true, 4, 2, 3}),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) { return case_name(info.param); });

// ---------------------------------------------------------------------------------------------
// (b) prefill + decode against the full-sequence forward of ModelGpu

// The log-softmax of ModelGpu's logits at (sequence 0, position p), read through its loss: ModelGpu
// keeps its logits to itself and returns the loss, whose dependence on one target byte v is
// -log_softmax(logits[p])[v] / T plus a constant. 256 forwards with targets[p] = v, then the
// constant that makes the row a log-probability (logsumexp 0). Batch 1, so T = S.
std::vector<double> model_gpu_log_softmax(moe::cuda::ModelGpu& model, const std::vector<int32_t>& tokens, int64_t p) {
  const int64_t S = int64_t(tokens.size());
  DeviceBuffer<int32_t> device_tokens(tokens), targets(tokens.size());
  std::vector<int32_t> target_bytes(tokens.size(), 0);
  std::vector<double> row(kV);
  for (int64_t v = 0; v < kV; ++v) {
    target_bytes[size_t(p)] = int32_t(v);
    targets.upload(target_bytes);
    model.forward(device_tokens.data(), targets.data());
    row[size_t(v)] = -double(S) * double(model.read_loss());
  }
  double max = *std::max_element(row.begin(), row.end()), sum = 0;
  for (double value : row) sum += std::exp(value - max);
  const double shift = max + std::log(sum);
  for (double& value : row) value -= shift;
  return row;
}

std::vector<double> log_softmax(std::span<const float> logits) {
  double max = *std::max_element(logits.begin(), logits.end()), sum = 0;
  for (float value : logits) sum += std::exp(double(value) - max);
  std::vector<double> row;
  for (float value : logits) row.push_back(double(value) - max - std::log(sum));
  return row;
}

// Prefill of 6 bytes and 4 decode steps give the last position's next-byte distribution of a
// ModelGpu forward over the same 10 bytes (and whatever follows them: the mask is causal).
TEST(CudaInferDecode, PrefillAndDecodeMatchModelGpuForward) {
  REQUIRE_GPU();
  for (const bool pregated : {false, true}) {
    const ModelConfig config = tiny_config(MoeLayers::every_block, pregated, 3, 2);
    const int64_t N = 2, P = 6, steps = 4, S = config.seq_len;
    const Bf16ModelWeights weights = bf16_init(config, 29);
    const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
    TestExperts experts(gpu, weights.flat, 1, /*on_host=*/false);
    InferenceModelGpu model(gpu, weights.flat, experts);
    moe::cuda::ModelGpu full(moe::cuda::gpu_config_of(config, 1));
    full.upload_weights(weights.flat);

    std::mt19937_64 rng(31);
    int tries = 0, differences = 0;
    double worst = 0;
    do {
      differences = 0;
      worst = 0;
      std::vector<std::vector<int32_t>> sequences;
      for (int64_t n = 0; n < N; ++n) sequences.push_back(random_bytes(rng, size_t(S)));
      std::vector<std::vector<int32_t>> prompts;
      for (const auto& s : sequences) prompts.emplace_back(s.begin(), s.begin() + P);
      StepResult step = model.prefill(prompts);
      std::vector<StepResult> record{step};
      for (int64_t i = 0; i < steps; ++i) {
        std::vector<int32_t> next;
        for (const auto& s : sequences) next.push_back(s[size_t(P + i)]);
        record.push_back(step = model.decode_step(next));
      }
      const int64_t last = P + steps - 1;  // the position whose next-byte logits the last step gave
      for (int64_t n = 0; n < N; ++n) {
        // ModelGpu's routing of positions 0..last must be the decoding's (a near tie redraws).
        const DeviceBuffer<int32_t> tokens(sequences[size_t(n)]);  // targets: any bytes will do here
        full.forward(tokens.data(), tokens.data());
        CUDA_CHECK(cudaDeviceSynchronize());
        const int64_t K = config.top_k;
        for (size_t j = 0; j < model.moe_blocks().size(); ++j) {
          const std::vector<int> full_top = full.moe_layer(model.moe_blocks()[j])->top_experts().download();
          for (int64_t position = 0; position <= last; ++position) {
            // the prefill's rows are n * P + position; decode step i's row is n
            const StepResult& r = position < P ? record[0] : record[size_t(position - P + 1)];
            const int64_t row = position < P ? n * P + position : n;
            std::set<int32_t> got(r.moe[j].top_experts.begin() + row * K, r.moe[j].top_experts.begin() + (row + 1) * K);
            std::set<int32_t> want(full_top.begin() + position * K, full_top.begin() + (position + 1) * K);
            differences += got != want;
          }
        }
        if (differences > 0) break;
        const std::vector<double> want = model_gpu_log_softmax(full, sequences[size_t(n)], last);
        const std::vector<double> got = log_softmax(std::span<const float>(step.next_logits).subspan(size_t(n * kV), kV));
        double error = 0, norm = 0;
        for (int64_t v = 0; v < kV; ++v) {
          error += (got[size_t(v)] - want[size_t(v)]) * (got[size_t(v)] - want[size_t(v)]);
          norm += want[size_t(v)] * want[size_t(v)];
        }
        const double relative = std::sqrt(error / norm);
        if (!(relative <= worst)) worst = relative;
      }
    } while (differences > 0 && ++tries < kTries);
    ASSERT_EQ(differences, 0) << "every one of " << kTries << " draws had a token routed differently";
    EXPECT_LT(worst, kTolerance) << (pregated ? "pre-gated" : "self-gated");
    std::printf("%s %s: draws %d, log-softmax of position %lld after prefill %lld + %lld steps against ModelGpu: "
                "rel %.2e (tol %.0e)\n",
                worst < kTolerance ? "PASS" : "FAIL", pregated ? "pre-gated" : "self-gated", tries + 1,
                (long long)(P + steps - 1), (long long)P, (long long)steps, worst, kTolerance);
  }
}

// ---------------------------------------------------------------------------------------------
// (c) every schedule gives the same bytes and logits, bit for bit

// One generation of `bytes` bytes per sequence with sampling (not greedy: every logit matters).
struct ScheduleRun {
  moe::cuda::Generation generation;
  std::vector<TestExperts::Call> acquired, prefetched;
  int misuse = 0;
};

ScheduleRun generate_with(const ModelConfig& config, const Bf16ModelWeights& weights, ExpertSchedule schedule,
                          int placement, bool on_host, const std::vector<std::vector<int32_t>>& prompts, int64_t bytes) {
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, int64_t(prompts.size()));
  TestExperts experts(gpu, weights.flat, placement, on_host);
  InferenceModelGpu model(gpu, weights.flat, experts, schedule);
  ScheduleRun run;
  run.generation = moe::cuda::generate(model, prompts, bytes, {0.9, 0, 5});
  run.acquired = experts.acquired;
  run.prefetched = experts.prefetched;
  run.misuse = experts.misuse;
  return run;
}

TEST(CudaInferSchedules, EveryScheduleGivesTheSameBytesAndLogits) {
  REQUIRE_GPU();
  for (const bool pregated : {false, true}) {
    const ModelConfig config = tiny_config(MoeLayers::every_block, pregated, 3, 2);
    const Bf16ModelWeights weights = bf16_init(config, 37);
    std::mt19937_64 rng(41);
    std::vector<std::vector<int32_t>> prompts;
    for (int n = 0; n < 3; ++n) prompts.push_back(random_bytes(rng, 7));
    const int64_t bytes = 12, E = config.num_experts;
    const ScheduleRun baseline = generate_with(config, weights, ExpertSchedule::gpu_only, 0, false, prompts, bytes);
    int placement = 1;
    for (const ExpertSchedule schedule : moe::cuda::kExpertSchedules) {
      if (schedule == ExpertSchedule::pregated && !pregated) continue;
      const std::string name = std::string(pregated ? "pre-gated " : "self-gated ") + std::string(to_string(schedule));
      const ScheduleRun run = generate_with(config, weights, schedule, placement++, /*on_host=*/true, prompts, bytes);
      EXPECT_EQ(run.misuse, 0) << name;
      EXPECT_EQ(run.generation.bytes, baseline.generation.bytes) << name;
      ASSERT_EQ(run.generation.steps.size(), baseline.generation.steps.size()) << name;
      size_t acquire = 0;
      int mismatched_logits = 0, wrong_acquires = 0, wrong_prefetches = 0;
      for (size_t s = 0; s < run.generation.steps.size(); ++s) {
        const StepResult& got = run.generation.steps[s];
        const StepResult& want = baseline.generation.steps[s];
        mismatched_logits += got.next_logits.size() != want.next_logits.size() ||
                             std::memcmp(got.next_logits.data(), want.next_logits.data(),
                                         got.next_logits.size() * sizeof(float)) != 0;
        for (size_t j = 0; j < got.moe.size(); ++j) {
          EXPECT_EQ(got.moe[j].top_experts, want.moe[j].top_experts) << name << " step " << s << " block " << j;
          // the source was asked for exactly the experts the block used, in block order
          const TestExperts::Call& call = run.acquired.at(acquire++);
          wrong_acquires += call.block != int64_t(j) || call.experts != got.moe[j].experts;
          // what each schedule prefetches
          std::vector<int32_t> expected;
          if (schedule == ExpertSchedule::prefetch_all) {
            for (int32_t e = 0; e < E; ++e) expected.push_back(e);
          } else if (j > 0 && (schedule == ExpertSchedule::pregated ||
                               (schedule == ExpertSchedule::speculative && pregated))) {
            expected = got.moe[j].experts;  // the pre-gate's choice is the block's routing
          }
          if (schedule == ExpertSchedule::speculative && !pregated) {
            wrong_prefetches += (j == 0) != got.moe[j].prefetched.empty();  // a guess for every block after m_0
          } else {
            wrong_prefetches += got.moe[j].prefetched != expected;
          }
        }
      }
      EXPECT_EQ(mismatched_logits, 0) << name << ": steps whose logits differ from gpu_only's in a bit";
      EXPECT_EQ(wrong_acquires, 0) << name;
      EXPECT_EQ(wrong_prefetches, 0) << name;
      EXPECT_EQ(acquire, run.acquired.size()) << name;
      std::printf("%s %s: %zu steps, bytes and logits %s gpu_only's, %zu acquires, %zu prefetches\n",
                  mismatched_logits == 0 && run.generation.bytes == baseline.generation.bytes ? "PASS" : "FAIL",
                  name.c_str(), run.generation.steps.size(), mismatched_logits == 0 ? "identical to" : "DIFFER from",
                  run.acquired.size(), run.prefetched.size());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// (d) experts computed on the host (offload/host_expert_choice.h): every offloading mode with the
// misses on the host, and with the cost model, against gpu_only on the same bytes. Not bit for bit:
// the host sums an expert's products in another order; equal within bf16 rounding, and the same
// bits run after run. A cost model whose host is slower than any copy computes nothing there, and
// is then gpu_only's bits exactly.

struct HostRun {
  std::vector<std::vector<float>> logits;         // [steps][N * V]
  std::vector<std::vector<MoeBlockStep>> blocks;  // [steps][M]
};

// Prefill `prompts`, then decode `bytes` (one row per step, [steps][N]), the same inputs whatever
// the source: the logits are compared step by step.
HostRun run_forced(const ModelGpuConfig& gpu, const Bf16ModelWeights& weights, moe::cuda::ExpertSource& experts,
                   ExpertSchedule schedule, const std::vector<std::vector<int32_t>>& prompts,
                   const std::vector<std::vector<int32_t>>& bytes) {
  InferenceModelGpu model(gpu, weights.flat, experts, schedule);
  HostRun run;
  auto keep = [&](StepResult&& result) {
    run.logits.push_back(std::move(result.next_logits));
    run.blocks.push_back(std::move(result.moe));
  };
  keep(model.prefill(prompts));
  for (const std::vector<int32_t>& row : bytes) keep(model.decode_step(row));
  return run;
}

// One case per (model, offloading schedule): the pre-gated model runs every schedule, the
// self-gated one all but pregated.
struct HostCase {
  bool pregated = false;
  ExpertSchedule schedule = ExpertSchedule::on_demand;
};

// The case's name in test listings (the default would print the struct's bytes, padding included).
void PrintTo(const HostCase& c, std::ostream* os) {
  *os << (c.pregated ? "pre-gated " : "self-gated ") << to_string(c.schedule);
}

std::vector<HostCase> host_cases() {
  std::vector<HostCase> cases;
  for (const bool pregated : {false, true}) {
    for (const ExpertSchedule schedule : moe::cuda::kExpertSchedules) {
      if (schedule == ExpertSchedule::gpu_only || (schedule == ExpertSchedule::pregated && !pregated)) continue;
      cases.push_back({pregated, schedule});
    }
  }
  return cases;
}

class CudaInferHostExpertsModes : public ::testing::TestWithParam<HostCase> {};

TEST_P(CudaInferHostExpertsModes, MatchGpuOnlyWithinBf16AndRepeat) {
  REQUIRE_GPU();
  using moe::cuda::HostExperts;
  const auto [pregated, schedule] = GetParam();
  const ModelConfig config = tiny_config(MoeLayers::every_block, pregated, 3, 2);
  const Bf16ModelWeights weights = bf16_init(config, 53);
  const int64_t N = 3, P = 5, steps = 10;
  const auto [prompts, bytes] = random_decode_inputs(59, N, P, steps);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  moe::cuda::ResidentExperts resident(store);
  const HostRun baseline = run_forced(gpu, weights, resident, ExpertSchedule::gpu_only, prompts, bytes);

  auto offloaded = [&](HostExperts host, const moe::cuda::HostExpertCosts& costs) {
    moe::cuda::OffloadOptions options;
    options.cache_slots = moe::cuda::minimum_cache_slots(gpu.moe.num_experts, N * P, gpu.moe.top_k);  // misses
    options.max_tokens_per_step = N * P;
    options.top_k = gpu.moe.top_k;
    options.host_experts = host;
    options.host_threads = 2;
    options.costs = costs;
    return std::make_unique<moe::cuda::OffloadedExperts>(store, options);
  };
  // A host faster than any copy (the cost model then splits the misses), and one slower.
  const moe::cuda::HostExpertCosts split{1.0, {0.6, 0.7, 0.8, 0.9}}, slow_host{1.0, {50.0}};
  for (const HostExperts host : {HostExperts::misses, HostExperts::cost_model}) {
    const std::string name = std::string(pregated ? "pre-gated " : "self-gated ") + std::string(to_string(schedule)) +
                             " host " + std::string(to_string(host));
    auto source = offloaded(host, split);
    const HostRun run = run_forced(gpu, weights, *source, schedule, prompts, bytes);
    ASSERT_EQ(run.logits.size(), baseline.logits.size()) << name;
    double worst = 0, largest = 0;
    int64_t on_host = 0, not_finite = 0, outside = 0;
    for (size_t s = 0; s < run.logits.size(); ++s) {
      for (size_t i = 0; i < run.logits[s].size(); ++i) {
        not_finite += !std::isfinite(run.logits[s][i]);
        worst = std::max(worst, double(std::abs(run.logits[s][i] - baseline.logits[s][i])));
        largest = std::max(largest, double(std::abs(baseline.logits[s][i])));
      }
      for (size_t j = 0; j < run.blocks[s].size(); ++j) {
        const MoeBlockStep& b = run.blocks[s][j];
        EXPECT_EQ(b.top_experts, baseline.blocks[s][j].top_experts) << name << " step " << s << " block " << j;
        on_host += int64_t(b.on_host.size());
        for (int32_t e : b.on_host) outside += !std::binary_search(b.experts.begin(), b.experts.end(), e);
      }
    }
    EXPECT_EQ(not_finite, 0) << name << ": a host expert's rows were not put in place of the poison's";
    EXPECT_EQ(outside, 0) << name << ": an expert computed on the host that the block did not choose";
    EXPECT_GT(on_host, 0) << name << ": no expert was computed on the host";
    EXPECT_LE(worst, kTolerance * std::max(1.0, largest)) << name;
    // The same bits run after run.
    auto again_source = offloaded(host, split);
    const HostRun again = run_forced(gpu, weights, *again_source, schedule, prompts, bytes);
    EXPECT_EQ(again.logits, run.logits) << name << ": not deterministic";
    std::printf("%s: %lld experts on the host over %zu steps, logits within %.3g of gpu_only's (largest %.3g)\n",
                name.c_str(), (long long)on_host, run.logits.size(), worst, largest);
  }
  // The cost model with a host slower than any copy: nothing on the host, gpu_only's bits.
  auto source = offloaded(HostExperts::cost_model, slow_host);
  const HostRun run = run_forced(gpu, weights, *source, schedule, prompts, bytes);
  EXPECT_EQ(run.logits, baseline.logits) << to_string(schedule) << ": a slow host must leave gpu_only's bits";
}

INSTANTIATE_TEST_SUITE_P(Schedules, CudaInferHostExpertsModes, ::testing::ValuesIn(host_cases()),
                         [](const ::testing::TestParamInfo<HostCase>& info) {
                           return std::string(info.param.pregated ? "pregated_model_" : "self_gated_model_") +
                                  std::string(to_string(info.param.schedule));
                         });

TEST(CudaInferHostExperts, BadInputIsRefusedSayingWhatIsAllowed) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, false, 2, 1);
  const Bf16ModelWeights weights = bf16_init(config, 61);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, 1);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  auto message_of = [](auto&& work) -> std::string {
    try {
      work();
    } catch (const std::exception& error) {
      return error.what();
    }
    return "no error";
  };
  moe::cuda::OffloadOptions options;
  options.cache_slots = 4;
  options.host_experts = moe::cuda::HostExperts::misses;
  options.host_threads = 1 << 20;
  EXPECT_NE(message_of([&] { moe::cuda::OffloadedExperts source(store, options); }).find("allowed: 1 to"),
            std::string::npos);
  options.host_experts = moe::cuda::HostExperts::off;
  options.host_threads = 0;
  moe::cuda::OffloadedExperts off(store, options);
  std::vector<float> x(size_t(gpu.model_dim)), y(x.size());
  EXPECT_NE(message_of([&] { off.host_forward(0, 0, x, 1, y); }).find("host experts are off"), std::string::npos);
  options.host_experts = moe::cuda::HostExperts::misses;
  moe::cuda::OffloadedExperts on(store, options);
  EXPECT_THROW(on.host_forward(0, 0, x, 2, y), std::invalid_argument);  // one row's x for two rows
  EXPECT_THROW(on.host_forward(5, 0, x, 1, y), std::invalid_argument);  // no block 5
  EXPECT_NE(message_of([&] { (void)on.choose_host_experts(0, std::vector<int32_t>{1, 2}, std::vector<int64_t>{1}, false); })
                .find("2 experts but 1 row counts"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The decode step as one CUDA graph: the same bits as the launched step, at every position

// A stream of the test's own: the legacy default stream cannot be captured.
struct TestStream {
  cudaStream_t stream = nullptr;
  TestStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~TestStream() { cudaStreamDestroy(stream); }
};

// Two models on the same weights and resident experts, one replaying the captured step and one
// launching it, fed the same bytes until the context is full: every step's logits and routing must
// be equal bit for bit (the positions are read on the device: a graph captured at position P + 1
// that baked its position in would differ from the next step on). Self-gated MoE in every block,
// pre-gated every other block with a dense FFN between, and a dense model (no MoE block).
TEST(CudaInferGraph, ReplaysTheLaunchedStepBitForBitAtEveryPosition) {
  REQUIRE_GPU();
  struct Case {
    MoeLayers layers;
    bool pregated;
    ExpertSchedule schedule;
  };
  for (const Case& c : {Case{MoeLayers::every_block, false, ExpertSchedule::gpu_only},
                        Case{MoeLayers::every_other_block, true, ExpertSchedule::pregated},
                        Case{MoeLayers::none, false, ExpertSchedule::gpu_only}}) {
    const ModelConfig config = tiny_config(c.layers, c.pregated, 3, 2);
    const int64_t N = 2, P = 3, S = config.seq_len;
    const Bf16ModelWeights weights = bf16_init(config, 41);
    const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
    TestStream graph_stream, launched_stream;
    TestExperts graph_experts(gpu, weights.flat, 0, /*on_host=*/false);
    TestExperts launched_experts(gpu, weights.flat, 0, /*on_host=*/false);
    InferenceModelGpu graphed(gpu, weights.flat, graph_experts, c.schedule, graph_stream.stream);
    InferenceModelGpu launched(gpu, weights.flat, launched_experts, c.schedule, launched_stream.stream);
    launched.set_decode_graph(false);
    EXPECT_TRUE(graphed.decode_graph_applies());
    EXPECT_FALSE(launched.decode_graph_applies());

    std::mt19937_64 rng(43);
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t n = 0; n < N; ++n) prompts.push_back(random_bytes(rng, size_t(P)));
    StepResult a = graphed.prefill(prompts), b = launched.prefill(prompts);
    ASSERT_EQ(a.next_logits, b.next_logits);
    int64_t steps = 0, unequal = 0;
    while (graphed.length() < S) {
      if (steps == 6) {  // a new schedule: the graph is captured again, its record the new schedule's
        graphed.set_schedule(ExpertSchedule::prefetch_all);
        launched.set_schedule(ExpertSchedule::prefetch_all);
      }
      const std::vector<int32_t> next = random_bytes(rng, size_t(N));
      a = graphed.decode_step(next);
      b = launched.decode_step(next);
      ++steps;
      unequal += a.next_logits != b.next_logits;
      for (const float v : a.next_logits) unequal += !std::isfinite(v);
      ASSERT_EQ(a.moe.size(), b.moe.size());
      for (size_t j = 0; j < a.moe.size(); ++j) {
        unequal += a.moe[j].top_experts != b.moe[j].top_experts;
        unequal += a.moe[j].prefetched != b.moe[j].prefetched;
      }
    }
    EXPECT_EQ(steps, S - P);
    EXPECT_EQ(unequal, 0) << "steps whose logits, routing or record differ between the graph and the launched step";
    // The context is full: refused before anything runs, in the graph as launched.
    EXPECT_THROW(graphed.decode_step(std::vector<int32_t>(size_t(N), 1)), std::invalid_argument);
    EXPECT_EQ(graphed.length(), S);
    std::printf("%s %s: %lld decode steps to S = %lld, graph against launched: %lld differences\n",
                unequal == 0 ? "PASS" : "FAIL",
                c.layers == MoeLayers::none ? "dense" : c.pregated ? "pre-gated, every other block" : "every block",
                (long long)steps, (long long)S, (long long)unequal);
  }
}

// Where the step waits on the host (a source that fetches experts), or a phase timer or the legacy
// default stream is in use, the graph does not apply and the steps run launched.
TEST(CudaInferGraph, AppliesOnlyWhereTheStepHasNoHostWait) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, false, 2, 1);
  const Bf16ModelWeights weights = bf16_init(config, 47);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, 1);
  TestStream stream;
  TestExperts fetching(gpu, weights.flat, 0, /*on_host=*/true), resident(gpu, weights.flat, 0, /*on_host=*/false);
  InferenceModelGpu on_demand(gpu, weights.flat, fetching, ExpertSchedule::on_demand, stream.stream);
  EXPECT_FALSE(on_demand.decode_graph_applies());
  InferenceModelGpu default_stream(gpu, weights.flat, resident);
  EXPECT_FALSE(default_stream.decode_graph_applies());
  InferenceModelGpu timed(gpu, weights.flat, resident, ExpertSchedule::gpu_only, stream.stream);
  EXPECT_TRUE(timed.decode_graph_applies());
  moe::cuda::PhaseTimer timer;
  timed.set_phase_timer(&timer);
  EXPECT_FALSE(timed.decode_graph_applies());
  timed.set_phase_timer(nullptr);
  EXPECT_TRUE(timed.decode_graph_applies());
}

// ---------------------------------------------------------------------------------------------
// The slot table on the device (offload/device_slot_cache.h): gpu_only's bits in every schedule,
// launched and as one CUDA graph, and the least-recently-used rule replayed on the host

// The rule of device_slot_cache.h for acquires alone (on_demand): per block of each step, the clock
// ticks, resident chosen experts are stamped, then each missing one (ascending) takes the slot of
// smallest (stamp, index) stamped before now. Returns the misses per MoE block.
std::vector<int64_t> replay_lru(const std::vector<std::vector<MoeBlockStep>>& steps, int64_t E, int64_t C) {
  std::vector<int64_t> stamp(size_t(C), -1), in_slot(size_t(C), -1), misses;  // -1: empty, older than any use
  std::map<int64_t, int64_t> slot_of;
  int64_t clock = 0;
  for (const std::vector<MoeBlockStep>& step : steps) {
    misses.resize(step.size(), 0);
    for (size_t j = 0; j < step.size(); ++j) {
      ++clock;
      for (int32_t e : step[j].experts) {
        if (auto at = slot_of.find(int64_t(j) * E + e); at != slot_of.end()) stamp[size_t(at->second)] = clock;
      }
      for (int32_t e : step[j].experts) {
        const int64_t id = int64_t(j) * E + e;
        if (slot_of.count(id) != 0) continue;
        int64_t victim = -1;
        for (int64_t s = 0; s < C; ++s) {
          if (stamp[size_t(s)] < clock && (victim < 0 || stamp[size_t(s)] < stamp[size_t(victim)])) victim = s;
        }
        if (victim < 0) return {};  // the cache cannot hold one block's experts: the constructor refuses it
        if (in_slot[size_t(victim)] >= 0) slot_of.erase(in_slot[size_t(victim)]);
        in_slot[size_t(victim)] = id;
        slot_of[id] = victim;
        stamp[size_t(victim)] = clock;
        ++misses[j];
      }
    }
  }
  return misses;
}

struct DeviceSlotCase {
  bool pregated = false;
  ExpertSchedule schedule = ExpertSchedule::on_demand;
};

void PrintTo(const DeviceSlotCase& c, std::ostream* os) {
  *os << (c.pregated ? "pre-gated " : "self-gated ") << to_string(c.schedule);
}

// Every offloading schedule of the self-gated model, and pregated and on_demand on the pre-gated one.
std::vector<DeviceSlotCase> offloading_cases() {
  return {{false, ExpertSchedule::on_demand}, {false, ExpertSchedule::prefetch_all},
          {false, ExpertSchedule::speculative}, {true, ExpertSchedule::pregated}, {true, ExpertSchedule::on_demand}};
}

std::string schedule_case_name(const ::testing::TestParamInfo<DeviceSlotCase>& info) {
  return std::string(info.param.pregated ? "pregated_model_" : "self_gated_model_") +
         std::string(to_string(info.param.schedule));
}

// The prefill and every decode step of `bytes` through `recorded` (one begin/end pair a step), the
// record written to `writer` and closed; the steps' results.
std::vector<StepResult> run_recorded(InferenceModelGpu& model, moe::cuda::RecordedExpertSource& recorded,
                                     moe::RunWriter& writer, cudaStream_t stream,
                                     const std::vector<std::vector<int32_t>>& prompts,
                                     const std::vector<std::vector<int32_t>>& bytes) {
  model.set_phase_timer(&recorded.phase_timer());
  std::vector<StepResult> results;
  recorded.begin_step(stream);
  results.push_back(model.prefill(prompts));
  recorded.end_step();
  for (const std::vector<int32_t>& row : bytes) {
    recorded.begin_step(stream);
    results.push_back(model.decode_step(row));
    recorded.end_step();
  }
  recorded.write(results, model.moe_blocks());
  writer.close();
  return results;
}

// A fresh run directory under the system's temporary folder, and its writer.
moe::RunWriter temporary_run(const fs::path& dir, const std::string& name) {
  fs::remove_all(dir);
  moe::RunInfo info;
  info.kind = moe::RunKind::infer;
  info.name = name;
  return moe::RunWriter::create(dir, info, moe::OnExisting::overwrite);
}

class CudaInferDeviceSlots : public ::testing::TestWithParam<DeviceSlotCase> {};

// Every offloading schedule on both models, at two shapes (one sequence, top-1, a cache of just the
// prefill's two experts: evictions and dropped prefetches every step; three sequences, top-2, four
// slots), and with every expert cached: the same bytes and logits as gpu_only, bit for bit,
// launched and as one CUDA graph; the counters add up; on_demand misses exactly what the rule says.
TEST_P(CudaInferDeviceSlots, GpuOnlysBitsLaunchedAndAsOneGraph) {
  REQUIRE_GPU();
  const auto [pregated, schedule] = GetParam();
  struct Shape {
    int64_t N, P, K;
  };
  for (const Shape shape : {Shape{1, 2, 1}, Shape{3, 5, 2}}) {
    const ModelConfig config = tiny_config(MoeLayers::every_block, pregated, 3, shape.K);
    const Bf16ModelWeights weights = bf16_init(config, 61);
    std::mt19937_64 rng(67);
    const int64_t N = shape.N, P = shape.P, steps = 12;
    std::vector<std::vector<int32_t>> prompts, bytes;
    for (int64_t n = 0; n < N; ++n) prompts.push_back(random_bytes(rng, size_t(P)));
    for (int64_t s = 0; s < steps; ++s) bytes.push_back(random_bytes(rng, size_t(N)));
    const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
    const int64_t E = gpu.moe.num_experts, M = 3;
    const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
    moe::cuda::ResidentExperts resident(store);
    const HostRun baseline = run_forced(gpu, weights, resident, ExpertSchedule::gpu_only, prompts, bytes);
    const int64_t smallest = moe::cuda::minimum_cache_slots(E, N * P, gpu.moe.top_k);
    for (const int64_t slots : {smallest, M * E}) {
      for (const bool graph : {false, true}) {
        const std::string name = std::string(pregated ? "pre-gated " : "self-gated ") +
                                 std::string(to_string(schedule)) + ", N " + std::to_string(N) + " K " +
                                 std::to_string(shape.K) + ", " + std::to_string(slots) + " slots, " +
                                 (graph ? "graph" : "launched");
        moe::cuda::DeviceSlotCache cache(store, {slots, N * P, gpu.moe.top_k, 8});
        TestStream stream;
        InferenceModelGpu model(gpu, weights.flat, cache, schedule, stream.stream);
        model.set_decode_graph(graph);
        EXPECT_EQ(model.decode_graph_applies(), graph) << name;
        HostRun run;
        StepResult r = model.prefill(prompts);
        run.logits.push_back(r.next_logits);
        run.blocks.push_back(r.moe);
        for (const std::vector<int32_t>& row : bytes) {
          r = model.decode_step(row);
          run.logits.push_back(r.next_logits);
          run.blocks.push_back(r.moe);
        }
        EXPECT_EQ(run.logits, baseline.logits) << name << ": not gpu_only's bits";
        const moe::cuda::BlockOffloadStatistics total = cache.statistics().total();
        int64_t used = 0;
        for (const auto& step : run.blocks) {
          for (const MoeBlockStep& b : step) used += int64_t(b.experts.size());
        }
        EXPECT_EQ(total.acquires, int64_t(run.blocks.size()) * M) << name;
        EXPECT_EQ(total.hits + total.misses, used) << name << ": every chosen expert is a hit or a miss";
        EXPECT_EQ(total.bytes_copied, (total.misses + total.prefetched) * int64_t(store.expert_bytes())) << name;
        EXPECT_LE(total.prefetched_used, total.prefetched) << name;
        if (slots == M * E) {  // nothing is ever evicted: each expert crosses once, whoever asks first
          std::set<int64_t> distinct;
          for (const auto& step : run.blocks) {
            for (size_t j = 0; j < step.size(); ++j) {
              for (int32_t e : step[j].experts) distinct.insert(int64_t(j) * E + e);
            }
          }
          const int64_t copied = total.misses + total.prefetched;
          if (schedule == ExpertSchedule::prefetch_all) {
            EXPECT_EQ(copied, M * E) << name;
          } else {
            EXPECT_EQ(copied, int64_t(distinct.size())) << name;
          }
          EXPECT_EQ(total.prefetch_dropped, 0) << name;
        }
        if (schedule == ExpertSchedule::on_demand) {
          const std::vector<int64_t> want = replay_lru(run.blocks, E, slots);
          ASSERT_EQ(want.size(), size_t(M)) << name;
          const moe::cuda::OffloadStatistics per_block = cache.statistics();
          for (size_t j = 0; j < want.size(); ++j) EXPECT_EQ(per_block.blocks[j].misses, want[j]) << name << " block " << j;
        }
        std::printf("%s %s: %zu steps, hits %lld, misses %lld, prefetched %lld (used %lld, dropped %lld)\n",
                    run.logits == baseline.logits ? "PASS" : "FAIL", name.c_str(), run.logits.size(),
                    (long long)total.hits, (long long)total.misses, (long long)total.prefetched,
                    (long long)total.prefetched_used, (long long)total.prefetch_dropped);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, CudaInferDeviceSlots, ::testing::ValuesIn(offloading_cases()),
                         schedule_case_name);

// A run recorded through the slot table on the GPU (moe_generate --slot-table device --run-dir):
// one offload event per step and MoE block whose counts are that step's and add up to the cache's
// counters, "plan + copy" and "prefetch" spans, and the same bits as gpu_only (recording changes
// nothing the model computes).
TEST(CudaInferDeviceSlots, ARecordedRunHasEachStepsCountsAndSpans) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, /*pregated=*/true, 3, 2);
  const Bf16ModelWeights weights = bf16_init(config, 71);
  const int64_t N = 2, P = 3, steps = 6, M = 3;
  const auto [prompts, bytes] = random_decode_inputs(73, N, P, steps);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  moe::cuda::ResidentExperts resident(store);
  const HostRun baseline = run_forced(gpu, weights, resident, ExpertSchedule::gpu_only, prompts, bytes);

  const fs::path dir = fs::temp_directory_path() / ("moe_test_device_record_" + std::to_string(::getpid()));
  moe::RunWriter writer = temporary_run(dir, "device slot table");
  const int64_t slots = moe::cuda::minimum_cache_slots(gpu.moe.num_experts, N * P, gpu.moe.top_k);
  moe::cuda::DeviceSlotCache cache(store, {slots, N * P, gpu.moe.top_k, 8});
  moe::cuda::RecordedExpertSource recorded(cache, writer);
  EXPECT_TRUE(recorded.plans_on_device());
  TestStream stream;
  InferenceModelGpu model(gpu, weights.flat, recorded, ExpertSchedule::pregated, stream.stream);
  model.set_phase_timer(&recorded.phase_timer());
  EXPECT_FALSE(model.decode_graph_applies()) << "a recorded step runs launched";
  const std::vector<StepResult> results = run_recorded(model, recorded, writer, stream.stream, prompts, bytes);
  std::vector<std::vector<float>> logits;
  for (const StepResult& r : results) logits.push_back(r.next_logits);
  EXPECT_EQ(logits, baseline.logits) << "recording changed the model's bits";

  const moe::RunRecord run = moe::RunReader::load(dir);
  const moe::cuda::BlockOffloadStatistics total = cache.statistics().total();
  int64_t events = 0, hits = 0, misses = 0, bytes_copied = 0, plans = 0, prefetches = 0;
  for (const nlohmann::json& e : run.events) {
    if (e.at("type") == "offload") {
      ++events;
      const int64_t chosen = int64_t(e.at("experts").size());
      EXPECT_EQ(e.at("hits").get<int64_t>() + e.at("misses").get<int64_t>(), chosen) << e.dump();
      hits += e.at("hits").get<int64_t>();
      misses += e.at("misses").get<int64_t>();
      bytes_copied += e.at("bytes").get<int64_t>();
    } else if (e.at("type") == "span") {
      const std::string name = e.at("name").get<std::string>();
      plans += name.rfind("plan + copy m", 0) == 0 ? 1 : 0;
      prefetches += name.rfind("prefetch m", 0) == 0 ? 1 : 0;
    }
  }
  EXPECT_EQ(events, (steps + 1) * M);
  EXPECT_EQ(hits, total.hits);
  EXPECT_EQ(misses, total.misses);
  EXPECT_EQ(bytes_copied, total.bytes_copied);
  EXPECT_GT(misses, 0) << "a cache of the smallest size misses";
  EXPECT_EQ(plans, (steps + 1) * M) << "one plan + copy span a block and step";
  EXPECT_GT(prefetches, 0) << "the pre-gate prefetches the next block";
  std::filesystem::remove_all(dir);
}

TEST(CudaInferDeviceSlots, BadInputIsRefusedSayingWhatIsAllowed) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, false, 2, 2);
  const Bf16ModelWeights weights = bf16_init(config, 71);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, 2);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  // Two tokens of top-2 may choose 4 experts: 3 slots cannot serve one acquire.
  EXPECT_THROW(moe::cuda::DeviceSlotCache(store, {3, 2, 2, 8}), std::invalid_argument);
  EXPECT_THROW(moe::cuda::DeviceSlotCache(store, {9, 2, 2, 8}), std::invalid_argument);  // more than 2 x 4 experts
  EXPECT_THROW(moe::cuda::DeviceSlotCache(store, {4, 2, 2, 0}), std::invalid_argument);  // no copy blocks
  moe::cuda::DeviceSlotCache cache(store, {4, 2, 2, 8});
  EXPECT_TRUE(cache.plans_on_device());
  EXPECT_FALSE(cache.needs_experts_on_host());
  EXPECT_THROW(cache.acquire(0, std::vector<int32_t>{0}, nullptr), std::logic_error);  // the host interface
  const DeviceBuffer<int32_t> top(std::vector<int32_t>{0, 1});
  EXPECT_THROW(cache.acquire_on_device(2, top.data(), 2, nullptr), std::invalid_argument);  // no block 2
  EXPECT_THROW(cache.acquire_on_device(0, nullptr, 2, nullptr), std::invalid_argument);
  EXPECT_THROW(cache.prefetch_on_device(-1, top.data(), 2, nullptr), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Resident blocks (offload/resident_blocks.h): m_0 held on the GPU, the other blocks from either
// slot table: gpu_only's bits in every schedule, and the cache never sees m_0

class CudaInferResidentBlocks : public ::testing::TestWithParam<DeviceSlotCase> {};

// At the smallest cache (evictions every step), with the slot table on the host and on the device
// (launched and as one graph): the same logits as gpu_only, bit for bit; the cache's counters for
// m_0 stay zero (no acquire, no copy, no prefetch) and every other block is acquired once a step.
TEST_P(CudaInferResidentBlocks, GpuOnlysBitsAndTheCacheNeverSeesTheBlock) {
  REQUIRE_GPU();
  const auto [pregated, schedule] = GetParam();
  const ModelConfig config = tiny_config(MoeLayers::every_block, pregated, 3, 2);
  const Bf16ModelWeights weights = bf16_init(config, 79);
  const int64_t N = 3, P = 5, steps = 10, M = 3;
  const auto [prompts, bytes] = random_decode_inputs(83, N, P, steps);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  moe::cuda::ResidentExperts resident(store);
  const HostRun baseline = run_forced(gpu, weights, resident, ExpertSchedule::gpu_only, prompts, bytes);
  const int64_t slots = moe::cuda::minimum_cache_slots(gpu.moe.num_experts, N * P, gpu.moe.top_k);
  const std::vector<int64_t> held = {0};

  struct Table {
    bool device, graph;
  };
  for (const Table table : {Table{false, false}, Table{true, false}, Table{true, true}}) {
    const std::string name = std::string(pregated ? "pre-gated " : "self-gated ") + std::string(to_string(schedule)) +
                             ", slot table on the " + (table.device ? "device" : "host") +
                             (table.graph ? ", graph" : ", launched");
    std::unique_ptr<moe::cuda::DeviceSlotCache> device;
    std::unique_ptr<moe::cuda::OffloadedExperts> host;
    moe::cuda::ExpertSource* cache = nullptr;
    if (table.device) {
      device = std::make_unique<moe::cuda::DeviceSlotCache>(store, moe::cuda::DeviceSlotCacheOptions{slots, N * P, gpu.moe.top_k, 8});
      cache = device.get();
    } else {
      moe::cuda::OffloadOptions options;
      options.cache_slots = slots;
      options.max_tokens_per_step = N * P;
      options.top_k = gpu.moe.top_k;
      host = std::make_unique<moe::cuda::OffloadedExperts>(store, options);
      cache = host.get();
    }
    moe::cuda::ResidentBlocks blocks(store, held, *cache);
    EXPECT_TRUE(blocks.resident(0)) << name;
    EXPECT_FALSE(blocks.resident(1)) << name;
    TestStream stream;
    InferenceModelGpu model(gpu, weights.flat, blocks, schedule, stream.stream);
    model.set_decode_graph(table.graph);
    EXPECT_EQ(model.decode_graph_applies(), table.graph) << name;
    HostRun run;
    run.logits.push_back(model.prefill(prompts).next_logits);
    for (const std::vector<int32_t>& row : bytes) run.logits.push_back(model.decode_step(row).next_logits);
    EXPECT_EQ(run.logits, baseline.logits) << name << ": not gpu_only's bits";

    const moe::cuda::OffloadStatistics statistics = device ? device->statistics() : host->statistics();
    ASSERT_EQ(statistics.blocks.size(), size_t(M)) << name;
    const moe::cuda::BlockOffloadStatistics& m0 = statistics.blocks[0];
    EXPECT_EQ(m0.acquires + m0.hits + m0.misses + m0.prefetched + m0.bytes_copied, 0) << name << ": the cache saw m_0";
    for (int64_t j = 1; j < M; ++j) {
      EXPECT_EQ(statistics.blocks[size_t(j)].acquires, steps + 1) << name << " block " << j;
    }
    EXPECT_GT(statistics.total().misses, 0) << name << ": a cache of the smallest size misses";
    std::printf("%s %s: %zu steps, m_0 resident (%s), the cache: %lld misses, %lld prefetched\n",
                run.logits == baseline.logits ? "PASS" : "FAIL", name.c_str(), run.logits.size(),
                moe::cuda::gigabytes(double(blocks.device_bytes())).c_str(),
                (long long)statistics.total().misses, (long long)statistics.total().prefetched);
  }
}

// The self-gated model's offloading schedules and the pre-gated model's pregated.
INSTANTIATE_TEST_SUITE_P(Schedules, CudaInferResidentBlocks,
                         ::testing::Values(DeviceSlotCase{false, ExpertSchedule::on_demand},
                                           DeviceSlotCase{false, ExpertSchedule::prefetch_all},
                                           DeviceSlotCase{false, ExpertSchedule::speculative},
                                           DeviceSlotCase{true, ExpertSchedule::pregated}),
                         schedule_case_name);

// A recorded pre-gated run with m_0 resident: m_0's events count every chosen expert as a hit and
// copy nothing; the other blocks' events add up to the cache's counters.
TEST(CudaInferResidentBlocks, ARecordedRunCountsTheResidentBlockAsHits) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, /*pregated=*/true, 3, 2);
  const Bf16ModelWeights weights = bf16_init(config, 89);
  const int64_t N = 2, P = 3, steps = 6;
  const auto [prompts, bytes] = random_decode_inputs(97, N, P, steps);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, N);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  moe::cuda::OffloadOptions options;
  options.cache_slots = moe::cuda::minimum_cache_slots(gpu.moe.num_experts, N * P, gpu.moe.top_k);
  options.max_tokens_per_step = N * P;
  options.top_k = gpu.moe.top_k;
  moe::cuda::OffloadedExperts cache(store, options);
  const std::vector<int64_t> held = {0};
  moe::cuda::ResidentBlocks blocks(store, held, cache);

  const fs::path dir = fs::temp_directory_path() / ("moe_test_resident_record_" + std::to_string(::getpid()));
  moe::RunWriter writer = temporary_run(dir, "resident m_0");
  moe::cuda::RecordedExpertSource recorded(blocks, &cache, writer);
  EXPECT_TRUE(recorded.resident(0));
  TestStream stream;
  InferenceModelGpu model(gpu, weights.flat, recorded, ExpertSchedule::pregated, stream.stream);
  (void)run_recorded(model, recorded, writer, stream.stream, prompts, bytes);

  const moe::RunRecord run = moe::RunReader::load(dir);
  const moe::cuda::BlockOffloadStatistics total = cache.statistics().total();
  int64_t m0_events = 0, m0_hits = 0, m0_chosen = 0, m0_bytes = 0, hits = 0, misses = 0, copied = 0;
  for (const nlohmann::json& e : run.events) {
    if (e.at("type") != "offload") continue;
    const int64_t chosen = int64_t(e.at("experts").size());
    EXPECT_EQ(e.at("hits").get<int64_t>() + e.at("misses").get<int64_t>(), chosen) << e.dump();
    if (e.at("layer").get<int64_t>() == model.moe_blocks()[0]) {
      ++m0_events;
      m0_hits += e.at("hits").get<int64_t>();
      m0_chosen += chosen;
      m0_bytes += e.at("bytes").get<int64_t>();
    } else {
      hits += e.at("hits").get<int64_t>();
      misses += e.at("misses").get<int64_t>();
      copied += e.at("bytes").get<int64_t>();
    }
  }
  EXPECT_EQ(m0_events, steps + 1);
  EXPECT_EQ(m0_hits, m0_chosen) << "every expert of a resident block is a hit";
  EXPECT_EQ(m0_bytes, 0);
  EXPECT_EQ(hits, total.hits);
  EXPECT_EQ(misses, total.misses);
  EXPECT_EQ(copied, total.bytes_copied);
  fs::remove_all(dir);
}

TEST(CudaInferResidentBlocks, BadInputIsRefusedSayingWhatIsAllowed) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, false, 3, 2);
  const Bf16ModelWeights weights = bf16_init(config, 71);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, 2);
  const moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(gpu, weights.flat);
  moe::cuda::DeviceSlotCache cache(store, {4, 2, 2, 8});
  const auto message = [&](std::vector<int64_t> list) {
    try {
      moe::cuda::ResidentBlocks blocks(store, list, cache);
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({}).find("none given"), std::string::npos) << message({});
  EXPECT_NE(message({3}).find("MoE block 3; allowed: MoE block indices from 0 to 2"), std::string::npos) << message({3});
  EXPECT_NE(message({-1}).find("MoE block -1"), std::string::npos) << message({-1});
  EXPECT_NE(message({1, 1}).find("twice"), std::string::npos) << message({1, 1});
  EXPECT_NE(message({2, 0, 1}).find("all 3 MoE blocks"), std::string::npos) << message({2, 0, 1});
  EXPECT_EQ(moe::cuda::parse_resident_blocks("2,0", 3), (std::vector<int64_t>{0, 2}));
  for (const std::string bad : {"", "x", "0,", "1.5", "0,,1", "3"}) {
    EXPECT_THROW(moe::cuda::parse_resident_blocks(bad, 3), std::invalid_argument) << "'" << bad << "'";
  }
  const std::vector<int64_t> one = {1};
  moe::cuda::ResidentBlocks blocks(store, one, cache);
  EXPECT_TRUE(blocks.plans_on_device()) << "the cache's kind of table";
  EXPECT_THROW(blocks.host_forward(1, 0, {}, 0, {}), std::logic_error);
  moe::cuda::ResidentExperts held(store, one);
  EXPECT_FALSE(held.resident(0));
  EXPECT_THROW(held.acquire(0, {}, nullptr), std::invalid_argument);  // not held
  EXPECT_THROW(moe::cuda::ResidentExperts(store, std::vector<int64_t>{}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Sampling: the GPU's host sampler picks the reference's byte from the same logits

TEST(CudaInferSampling, SameBytesAsReference) {
  std::mt19937_64 rng(43);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t N = 3;
  for (const moe::cuda::SamplingSettings settings :
       {moe::cuda::SamplingSettings{0.0, 0, 1}, moe::cuda::SamplingSettings{1.0, 0, 2},
        moe::cuda::SamplingSettings{0.7, 40, 3}, moe::cuda::SamplingSettings{2.0, 1, 4},
        moe::cuda::SamplingSettings{0.5, 256, 5}}) {
    moe::cuda::ByteSampler gpu(settings, N);
    moe::ref::ByteSampler ref({settings.temperature, settings.top_k, settings.seed}, N);
    int differences = 0;
    for (int draw = 0; draw < 200; ++draw) {
      std::vector<float> logits(size_t(N * kV));
      for (float& value : logits) value = normal(rng);
      if (draw % 7 == 0) logits[5] = logits[9];  // ties go to the lower byte on both sides
      Matrix ref_logits(N, kV);
      for (int64_t i = 0; i < N * kV; ++i) ref_logits(i / kV, i % kV) = logits[size_t(i)];
      differences += gpu.sample(logits) != ref.sample(ref_logits);
    }
    EXPECT_EQ(differences, 0) << "temperature " << settings.temperature << " top_k " << settings.top_k;
  }
  EXPECT_THROW((moe::cuda::ByteSampler{{-1.0, 0, 0}, 1}), std::invalid_argument);
  EXPECT_THROW((moe::cuda::ByteSampler{{1.0, 257, 0}, 1}), std::invalid_argument);
  moe::cuda::ByteSampler sampler({1.0, 0, 0}, 1);
  std::vector<float> bad(kV, 0.0f);
  bad[3] = NAN;
  EXPECT_THROW(sampler.sample(0, bad), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// (d) bad input

fs::path temporary_directory(const std::string& name) {
  const fs::path directory = fs::temp_directory_path() / ("moe_test_infer_" + name);
  fs::remove_all(directory);
  fs::create_directories(directory);
  return directory;
}

template <typename Error, typename Work>
std::string error_of(Work&& work) {
  try {
    work();
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

// A safetensors file round trip, a file of another model (the field named), a truncated file.
TEST(CudaInferWeights, SafetensorsFileChecked) {
  const ModelConfig config = tiny_config(MoeLayers::every_other_block, true, 4, 2);
  const Bf16ModelWeights weights = bf16_init(config, 47);
  const fs::path directory = temporary_directory("safetensors");
  const fs::path file = directory / "model.safetensors";
  moe::ref::save_model_safetensors(file, config, weights.values);

  const moe::cuda::InferenceWeights loaded = moe::cuda::load_weights_safetensors(file, moe::cuda::gpu_config_of(config, 3));
  EXPECT_EQ(loaded.weights, weights.flat);
  EXPECT_EQ(loaded.config.batch, 3);
  EXPECT_TRUE(loaded.config.pregated);
  EXPECT_EQ(loaded.config.moe_layers, moe::MoeLayers::every_other_block);
  EXPECT_EQ(loaded.config.moe.top_k, 2);

  ModelConfig other = config;
  other.num_experts = 8;
  const std::string message = error_of<moe::SafetensorsError>(
      [&] { moe::cuda::load_weights_safetensors(file, moe::cuda::gpu_config_of(other, 1)); });
  EXPECT_NE(message.find("num_experts"), std::string::npos) << message;
  EXPECT_NE(message.find(file.string()), std::string::npos) << message;

  // half of the file: the reader names the file and says it is short
  const fs::path truncated = directory / "truncated.safetensors";
  fs::copy_file(file, truncated);
  fs::resize_file(truncated, fs::file_size(file) / 2);
  const std::string truncated_message =
      error_of<moe::SafetensorsError>([&] { moe::cuda::load_weights_safetensors(truncated); });
  EXPECT_NE(truncated_message.find(truncated.string()), std::string::npos) << truncated_message;
  fs::remove_all(directory);
}

// A moe_train run directory: its latest checkpoint's config and weights.
TEST(CudaInferWeights, CheckpointRunDirectory) {
  const ModelConfig config = tiny_config(MoeLayers::every_block, false, 2, 1);
  const Bf16ModelWeights weights = bf16_init(config, 53);
  const fs::path run = temporary_directory("checkpoint");
  moe::CheckpointHeader header;
  header.model_config = moe::model_config_to_json(config);
  header.model_config["batch"] = 16;  // moe_train writes its batch too
  header.step = 100;
  fs::create_directories(run / "checkpoints");
  moe::save_checkpoint(moe::checkpoint_path(run / "checkpoints", 100), header, {{"weights", weights.flat}});
  const moe::cuda::InferenceWeights loaded = moe::cuda::load_weights_checkpoint(run);
  EXPECT_EQ(loaded.weights, weights.flat);
  EXPECT_EQ(loaded.config.num_layers, 2);
  EXPECT_EQ(loaded.config.moe.num_experts, 4);
  EXPECT_EQ(loaded.source, moe::checkpoint_path(run / "checkpoints", 100));
  const std::string message = error_of<std::invalid_argument>([&] { moe::cuda::load_weights_checkpoint(run / "none"); });
  EXPECT_NE(message.find("no such checkpoint"), std::string::npos) << message;
  fs::remove_all(run);
}

// Configs and schedules the decoding model refuses, before any allocation (no GPU needed).
TEST(CudaInferConfig, RefusedWithTheFieldNamed) {
  const ModelConfig self_gated = tiny_config(MoeLayers::every_block, false, 2, 2);
  const std::string message = error_of<std::invalid_argument>([&] {
    moe::cuda::check_schedule(moe::cuda::gpu_config_of(self_gated, 1), ExpertSchedule::pregated);
  });
  EXPECT_NE(message.find("pregated"), std::string::npos) << message;
  EXPECT_NO_THROW(moe::cuda::check_schedule(moe::cuda::gpu_config_of(self_gated, 1), ExpertSchedule::speculative));
  ModelConfig odd = self_gated;
  odd.expert_hidden_dim = 96;  // not a multiple of B = 64
  odd.block_size = 32;
  const std::string hidden = error_of<std::invalid_argument>(
      [&] { moe::cuda::validate_for_inference(moe::cuda::gpu_config_of(odd, 1)); });
  EXPECT_NE(hidden.find("hidden_dim"), std::string::npos) << hidden;
  // A model trained padded or with B = 16 decodes (dropless, B = 64 at inference).
  ModelConfig padded = self_gated;
  padded.formulation = moe::Formulation::padded;
  padded.block_size = 16;
  EXPECT_NO_THROW(moe::cuda::validate_for_inference(moe::cuda::gpu_config_of(padded, 2)));
  // A SwiGLU model trains on the GPU (ModelGpu validates it) but does not decode here.
  ModelConfig swiglu = self_gated;
  swiglu.activation = moe::Activation::swiglu;
  EXPECT_NO_THROW(moe::cuda::validate(moe::cuda::gpu_config_of(swiglu, 1)));
  const std::string activation = error_of<std::invalid_argument>(
      [&] { moe::cuda::validate_for_inference(moe::cuda::gpu_config_of(swiglu, 1)); });
  EXPECT_NE(activation.find("activation = swiglu"), std::string::npos) << activation;
  EXPECT_EQ(moe::cuda::parse_expert_schedule("speculative"), ExpertSchedule::speculative);
  EXPECT_THROW(moe::cuda::parse_expert_schedule("eventually"), std::invalid_argument);
}

// A prompt longer than the context, unequal prompts, the wrong batch, a full context, the pregated
// schedule on a self-gated model: clear errors, and the model still decodes afterwards.
TEST(CudaInferConfig, BadInputOnTheGpu) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block, false, 2, 2);
  const Bf16ModelWeights weights = bf16_init(config, 59);
  const ModelGpuConfig gpu = moe::cuda::gpu_config_of(config, 2);
  TestExperts experts(gpu, weights.flat, 0, false);
  EXPECT_THROW((InferenceModelGpu{gpu, weights.flat, experts, ExpertSchedule::pregated}), std::invalid_argument);
  InferenceModelGpu model(gpu, weights.flat, experts);
  EXPECT_THROW(model.set_schedule(ExpertSchedule::pregated), std::invalid_argument);
  EXPECT_THROW(model.decode_step({1, 2}), std::logic_error);  // before a prefill

  const std::vector<int32_t> too_long(size_t(config.seq_len + 1), 'a');
  std::string message = error_of<std::invalid_argument>([&] { model.prefill({too_long, too_long}); });
  EXPECT_NE(message.find("longer than the context"), std::string::npos) << message;
  message = error_of<std::invalid_argument>([&] { model.prefill({{'a', 'b'}, {'a'}}); });
  EXPECT_NE(message.find("equal length"), std::string::npos) << message;
  EXPECT_THROW(model.prefill({{'a'}}), std::invalid_argument);           // N = 1, the model decodes 2
  EXPECT_THROW(model.prefill({{'a'}, {256}}), std::invalid_argument);    // not a byte
  message = error_of<std::invalid_argument>(
      [&] { moe::cuda::generate(model, {{'a', 'b'}, {'c', 'd'}}, config.seq_len, {}); });
  EXPECT_NE(message.find("context holds S"), std::string::npos) << message;

  // The whole context, then one step too many.
  const std::vector<int32_t> full(size_t(config.seq_len), 'x');
  const StepResult step = model.prefill({full, full});
  EXPECT_EQ(step.next_logits.size(), size_t(2 * kV));
  message = error_of<std::invalid_argument>([&] { model.decode_step({'a', 'b'}); });
  EXPECT_NE(message.find("context is full"), std::string::npos) << message;
  EXPECT_EQ(model.length(), config.seq_len);
  // A one-byte prompt (the decode step's shape) and a step after it.
  model.prefill({{'a'}, {'b'}});
  EXPECT_NO_THROW(model.decode_step({'c', 'd'}));
  EXPECT_EQ(model.length(), 2);
}

}  // namespace
