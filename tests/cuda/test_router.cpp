// test_router.cpp: the GPU router (cuda/moe/router.h) against the CPU reference (reference_cpu/router.h
// and the router part of moe_backward): probs, top-K, combine weights, logsumexp, f_e, P_e, the two
// losses, d_logits, bad arguments, and the same bits on every run.
// Run: ctest --test-dir build -R CudaRouting   (skips without a GPU)
//
// Near-ties: the GPU computes in fp32, the reference in double. Two experts whose probabilities
// differ by less than fp32 rounding may come out in either order, so a top-K difference is accepted
// only where the reference's two probabilities are that close (and counted); exact ties are tested
// separately and must go to the lower expert index on both.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>

#include "core/bf16.h"                // to_bf16
#include "core/cuda_check.h"          // CUDA_CHECK
#include "core/device_buffer.h"       // DeviceBuffer
#include "core/device_info.h"         // gpu_available, why_no_gpu
#include "init.h"                     // moe::ref::random_matrix, random_weights
#include "reference_cpu/moe_layer.h"  // moe::ref::moe_forward, moe_backward
#include "reference_cpu/router.h"     // moe::ref::route
#include "moe/router.h"               // the launchers under test
#include "routing_test_support.h"

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

struct Stream {
  cudaStream_t stream = nullptr;
  Stream() { CUDA_CHECK(cudaStreamCreate(&stream)); }
  ~Stream() { cudaStreamDestroy(stream); }
  void sync() const { CUDA_CHECK(cudaStreamSynchronize(stream)); }
};

struct Cublas {
  cublasHandle_t handle = nullptr;
  Cublas() { EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS); }
  ~Cublas() { cublasDestroy(handle); }
};

// The router outputs on the device, poisoned before every run.
struct GpuRouter {
  int tokens, num_experts, top_k;
  DeviceBuffer<float> probs, combine_weights, logsumexp, expert_fraction, mean_probs, aux_loss, z_loss;
  DeviceBuffer<int> top_experts;
  moe::cuda::RouterWorkspace workspace;
  GpuRouter(int T, int E, int K)
      : tokens(T), num_experts(E), top_k(K), probs(size_t(T) * E), combine_weights(size_t(T) * K),
        logsumexp(T), expert_fraction(E), mean_probs(E), aux_loss(1), z_loss(1), top_experts(size_t(T) * K),
        workspace(E) {
    poison();
  }
  void poison() {
    for (auto* buffer : {&probs, &combine_weights, &logsumexp, &expert_fraction, &mean_probs, &aux_loss, &z_loss}) {
      buffer->fill_bytes(kFloatPoisonByte);
    }
    top_experts.fill_bytes(kIntPoisonByte);
  }
  void run(const float* logits, bool renormalize, cudaStream_t stream) {
    moe::cuda::route_top_k(logits, probs.data(), top_experts.data(), combine_weights.data(), logsumexp.data(),
                           expert_fraction.data(), mean_probs.data(), aux_loss.data(), z_loss.data(), workspace,
                           tokens, num_experts, top_k, renormalize, stream);
  }
  void run_fused(const bf16* x, const bf16* gate_weights, int model_dim, bool renormalize, cudaStream_t stream) {
    moe::cuda::route_fused(x, gate_weights, model_dim, probs.data(), top_experts.data(), combine_weights.data(),
                           logsumexp.data(), expert_fraction.data(), mean_probs.data(), aux_loss.data(), z_loss.data(),
                           workspace, tokens, num_experts, top_k, renormalize, stream);
  }
  // Every output's bytes, in one vector, to compare two runs bit for bit.
  std::vector<unsigned char> output_bytes() const {
    std::vector<unsigned char> bytes;
    auto append = [&](const auto& buffer) {
      const auto host = buffer.download();
      const auto* first = reinterpret_cast<const unsigned char*>(host.data());
      bytes.insert(bytes.end(), first, first + host.size() * sizeof(host[0]));
    };
    for (const auto* buffer : {&probs, &combine_weights, &logsumexp, &expert_fraction, &mean_probs, &aux_loss, &z_loss}) {
      append(*buffer);
    }
    append(top_experts);
    return bytes;
  }
};

moe::MoeConfig router_config(int64_t T, int64_t D, int64_t E, int64_t K, bool renormalize) {
  moe::MoeConfig config;
  config.tokens = T;
  config.model_dim = D;
  config.hidden_dim = 4;
  config.num_experts = E;
  config.top_k = K;
  config.block_size = 1;
  config.renormalize = renormalize;
  return config;
}

// Compares every router output with the reference's. `tie_tolerance` is the probability gap below
// which two experts count as tied (their order may differ between fp32 and double).
void compare_router(const moe::ref::RouterOutput& ref, GpuRouter& gpu, double tolerance, double tie_tolerance) {
  const int T = gpu.tokens, E = gpu.num_experts, K = gpu.top_k;
  const std::vector<float> probs = gpu.probs.download();
  const std::vector<int> top = gpu.top_experts.download();
  expect_close("probs", probs, std::vector<double>(ref.probs.data(), ref.probs.data() + ref.probs.size()), tolerance);
  expect_close("logsumexp", gpu.logsumexp.download(),
               std::vector<double>(ref.logsumexp.data(), ref.logsumexp.data() + T), tolerance);
  expect_close("combine_weights", gpu.combine_weights.download(),
               std::vector<double>(ref.combine_weights.data(), ref.combine_weights.data() + ref.combine_weights.size()),
               tolerance);

  // Top-K: identical, except near-ties of the reference's own probabilities.
  int near_tie_swaps = 0;
  std::vector<double> fraction_from_gpu_choice(E, 0.0);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int g = top[size_t(t) * K + k], r = ref.top_experts(t, k);
      ASSERT_TRUE(g >= 0 && g < E) << "top_experts[" << t << ", " << k << "] = " << g;
      fraction_from_gpu_choice[g] += 1.0 / (double(T) * K);
      if (g == r) continue;
      const double gap = std::abs(ref.probs(t, g) - ref.probs(t, r));
      ASSERT_LE(gap, tie_tolerance) << "token " << t << " choice " << k << ": GPU expert " << g << " (p=" << ref.probs(t, g)
                                    << "), reference expert " << r << " (p=" << ref.probs(t, r) << ")";
      ++near_tie_swaps;
    }
  }
  std::printf("top_experts: %d near-tie swaps of %d choices (tie tolerance %.1g)\n", near_tie_swaps, T * K,
              tie_tolerance);
  EXPECT_LE(near_tie_swaps, std::max(2, T * K / 1000));

  // f_e is exact arithmetic on the GPU's choice; P_e and the losses are fp32 sums.
  expect_close("expert_fraction", gpu.expert_fraction.download(), fraction_from_gpu_choice, 1e-6);
  expect_close("mean_probs", gpu.mean_probs.download(),
               std::vector<double>(ref.mean_probs.data(), ref.mean_probs.data() + E), tolerance);
  double aux = 0.0;
  for (int e = 0; e < E; ++e) aux += fraction_from_gpu_choice[e] * ref.mean_probs(e);
  aux *= E;
  expect_close("aux_loss", gpu.aux_loss.download(), std::vector<double>{aux}, tolerance);
  expect_close("z_loss", gpu.z_loss.download(), std::vector<double>{ref.z_loss}, tolerance);
}

// Logits given directly: the reference routes x = logits through Wg = identity, so both sides see
// the very same logits (multiplying by an identity is exact in double).
void check_from_logits(int T, int E, int K, bool renormalize, uint64_t seed, double logit_scale = 3.0) {
  SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K) +
               " renormalize=" + std::to_string(renormalize));
  std::mt19937_64 generator(seed);
  Matrix logits = moe::ref::random_matrix(T, E, generator, logit_scale);
  const std::vector<float> logits_float = to_float_vector(logits);
  for (int64_t i = 0; i < logits.size(); ++i) logits.data()[i] = logits_float[size_t(i)];
  const moe::ref::RouterOutput ref =
      moe::ref::route(router_config(T, E, E, K, renormalize), logits, Matrix::Identity(E, E));

  Stream stream;
  DeviceBuffer<float> device_logits(logits_float);
  GpuRouter gpu(T, E, K);
  gpu.run(device_logits.data(), renormalize, stream.stream);
  stream.sync();
  compare_router(ref, gpu, 1e-5, 1e-6);
}

TEST(CudaRouting, SoftmaxTopKAndLossesMatchReference) {
  REQUIRE_GPU();
  check_from_logits(1, 1, 1, false, 11);       // one token, one expert
  check_from_logits(1, 8, 2, true, 12);
  check_from_logits(37, 8, 8, true, 13);       // K = E
  check_from_logits(5, 3, 3, false, 14);
  check_from_logits(100, 33, 2, false, 15);    // E not a multiple of 32
  check_from_logits(513, 64, 2, true, 16);
  check_from_logits(200, 256, 8, true, 17);    // the largest E and K supported
  check_from_logits(1000, 255, 7, false, 18);
  check_from_logits(16384, 64, 2, false, 19);  // a realistic batch
  check_from_logits(64, 16, 4, true, 20, 15.0);  // large logits: a peaked softmax
  // The fused kernel's shapes: 8 G >= E lanes per token, kRouterMaxBlocks blocks looping over passes
  // of 1024 / G tokens, the last pass partly past T, and the last block adding up to 128 block rows.
  check_from_logits(16384 + 37, 64, 1, false, 22);  // the target shape, 37 tokens more: block 0 takes 2 passes
  check_from_logits(16384, 8, 2, true, 23);         // one lane per token, 16 blocks
  check_from_logits(16384, 16, 2, false, 24);       // two lanes per token
  check_from_logits(5000, 256, 8, true, 25);        // a warp per token, 1-2 passes per block
  check_from_logits(3001, 1, 1, false, 26);         // E = 1: every prob is 1
  check_from_logits(999, 12, 3, true, 27);          // E % 4 == 0, the second float4 half past E
  check_from_logits(70000, 128, 2, false, 28, 1.0); // 16 lanes per token, 8-9 passes per block
}

// The same bits on every run: the statistics are sums over T in a fixed order, the top-K a fixed
// rule. Between the two runs the same workspace serves another shape (fewer experts, a grid of
// another size), which must leave its ticket ready for the next launch.
TEST(CudaRouting, SameBitsOnEveryRunAndWorkspaceReuse) {
  REQUIRE_GPU();
  for (auto [T, E, K] : {std::tuple{16384 + 37, 64, 1}, {16384, 8, 2}, {4099, 256, 8}, {777, 33, 2}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K));
    std::mt19937_64 generator(60 + T);
    const std::vector<float> logits_float = to_float_vector(moe::ref::random_matrix(T, E, generator, 3.0));
    Stream stream;
    DeviceBuffer<float> device_logits(logits_float);
    GpuRouter gpu(T, E, K);
    gpu.run(device_logits.data(), true, stream.stream);
    stream.sync();
    const std::vector<unsigned char> first = gpu.output_bytes();

    // Another shape on the same workspace: its own statistics must be right too.
    const int other_T = 100, other_E = 1 + E / 2;
    const std::vector<float> other_logits = to_float_vector(moe::ref::random_matrix(other_T, other_E, generator, 3.0));
    DeviceBuffer<float> device_other(other_logits), other_probs(size_t(other_T) * other_E), other_fraction(other_E);
    DeviceBuffer<float> other_cw(other_T), other_lse(other_T), other_mean(other_E), other_aux(1), other_z(1);
    DeviceBuffer<int> other_top(other_T);
    other_fraction.fill_bytes(kFloatPoisonByte);
    moe::cuda::route_top_k(device_other.data(), other_probs.data(), other_top.data(), other_cw.data(), other_lse.data(),
                           other_fraction.data(), other_mean.data(), other_aux.data(), other_z.data(), gpu.workspace,
                           other_T, other_E, 1, false, stream.stream);
    stream.sync();
    const std::vector<float> fraction = other_fraction.download();
    double fraction_total = 0.0;
    for (float f : fraction) fraction_total += f;
    EXPECT_NEAR(fraction_total, 1.0, 1e-6) << "expert_fraction of the other shape";

    gpu.poison();
    gpu.run(device_logits.data(), true, stream.stream);
    stream.sync();
    const std::vector<unsigned char> second = gpu.output_bytes();
    ASSERT_EQ(first.size(), second.size());
    EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size()), 0) << "two runs differ";
  }
}

// Rows that are not 16-byte aligned (a logits pointer one float into its buffer) take the scalar
// loads; the results must be the reference's all the same.
TEST(CudaRouting, UnalignedLogitsTakeTheScalarPath) {
  REQUIRE_GPU();
  const int T = 1000, E = 64, K = 2;
  std::mt19937_64 generator(70);
  Matrix logits = moe::ref::random_matrix(T, E, generator, 3.0);
  const std::vector<float> logits_float = to_float_vector(logits);
  for (int64_t i = 0; i < logits.size(); ++i) logits.data()[i] = logits_float[size_t(i)];
  const moe::ref::RouterOutput ref = moe::ref::route(router_config(T, E, E, K, false), logits, Matrix::Identity(E, E));
  std::vector<float> shifted(logits_float.size() + 1, 0.0f);
  std::copy(logits_float.begin(), logits_float.end(), shifted.begin() + 1);
  Stream stream;
  DeviceBuffer<float> device_logits(shifted);
  GpuRouter gpu(T, E, K);
  gpu.run(device_logits.data() + 1, false, stream.stream);
  stream.sync();
  compare_router(ref, gpu, 1e-5, 1e-6);
}

TEST(CudaRouting, ExactTiesGoToTheLowerExpertIndex) {
  REQUIRE_GPU();
  const int E = 64, K = 4;
  Matrix logits = Matrix::Zero(4, E);                 // token 0: all equal -> experts 0, 1, 2, 3
  logits(1, 1) = logits(1, 2) = logits(1, 40) = 3.0;  // token 1: 1, 2, 40, then 7
  logits(1, 7) = 2.0;
  logits(2, 37) = logits(2, 5) = 1.5;                 // token 2: 5 before 37 (different lanes, same value)
  logits(2, 63) = logits(2, 32) = 1.0;                // then 32 before 63
  for (int e = 0; e < E; ++e) logits(3, e) = -(e % 3);  // token 3: every third expert ties at 0
  std::vector<float> logits_float = to_float_vector(logits);
  for (bool renormalize : {false, true}) {
    const moe::ref::RouterOutput ref =
        moe::ref::route(router_config(4, E, E, K, renormalize), logits, Matrix::Identity(E, E));
    Stream stream;
    DeviceBuffer<float> device_logits(logits_float);
    GpuRouter gpu(4, E, K);
    gpu.run(device_logits.data(), renormalize, stream.stream);
    stream.sync();
    expect_equal("top_experts (exact ties)", gpu.top_experts.download(), to_vector(ref.top_experts));
    compare_router(ref, gpu, 1e-5, 0.0);
  }
}

TEST(CudaRouting, AllTokensOnOneExpert) {
  REQUIRE_GPU();
  const int T = 300, E = 16, K = 1;
  std::mt19937_64 generator(21);
  Matrix logits = moe::ref::random_matrix(T, E, generator, 1.0);
  logits.col(9).array() += 20.0;  // expert 9 wins every token
  const std::vector<float> logits_float = to_float_vector(logits);
  for (int64_t i = 0; i < logits.size(); ++i) logits.data()[i] = logits_float[size_t(i)];
  const moe::ref::RouterOutput ref = moe::ref::route(router_config(T, E, E, K, false), logits, Matrix::Identity(E, E));
  Stream stream;
  DeviceBuffer<float> device_logits(logits_float);
  GpuRouter gpu(T, E, K);
  gpu.run(device_logits.data(), false, stream.stream);
  stream.sync();
  compare_router(ref, gpu, 1e-5, 0.0);
  const std::vector<float> fraction = gpu.expert_fraction.download();
  EXPECT_EQ(fraction[9], 1.0f);
}

// Random tokens x [T, D] and gate weights Wg [D, E] in bf16, on the device, and the reference's
// routing of the very same bf16 values in double.
struct TokensAndGate {
  DeviceBuffer<bf16> x, wg;
  moe::ref::RouterOutput ref;
  TokensAndGate(int T, int D, int E, int K, bool renormalize, uint64_t seed) {
    std::mt19937_64 generator(seed);
    const std::vector<bf16> x_host = moe::cuda::to_bf16(moe::ref::random_matrix(T, D, generator).data(), size_t(T) * D);
    const std::vector<bf16> wg_host = moe::cuda::to_bf16(
        moe::ref::random_matrix(D, E, generator, 1.0 / std::sqrt(double(D))).data(), size_t(D) * E);
    Matrix x_ref(T, D), wg_ref(D, E);
    for (int64_t i = 0; i < x_ref.size(); ++i) x_ref.data()[i] = __bfloat162float(x_host[size_t(i)]);
    for (int64_t i = 0; i < wg_ref.size(); ++i) wg_ref.data()[i] = __bfloat162float(wg_host[size_t(i)]);
    ref = moe::ref::route(router_config(T, D, E, K, renormalize), x_ref, wg_ref);
    x = DeviceBuffer<bf16>(x_host);
    wg = DeviceBuffer<bf16>(wg_host);
  }
};

// From x and Wg: cuBLAS logits (bf16 in, fp32 out), then the fused kernel. The reference routes the
// same bf16-rounded values in double.
TEST(CudaRouting, RouteFromTokensWithCublasLogits) {
  REQUIRE_GPU();
  for (auto [T, D, E, K] : {std::tuple{257, 96, 32, 2}, {1, 8, 1, 1}, {1000, 256, 64, 4}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D) + " E=" + std::to_string(E));
    const TokensAndGate problem(T, D, E, K, true, 30 + T);
    const moe::ref::RouterOutput& ref = problem.ref;
    const DeviceBuffer<bf16>& device_x = problem.x;
    const DeviceBuffer<bf16>& device_wg = problem.wg;
    Stream stream;
    Cublas cublas;
    DeviceBuffer<float> logits(size_t(T) * E);
    logits.fill_bytes(kFloatPoisonByte);
    moe::cuda::router_logits(cublas.handle, device_x.data(), device_wg.data(), logits.data(), T, D, E, stream.stream);
    GpuRouter gpu(T, E, K);
    gpu.run(logits.data(), true, stream.stream);
    stream.sync();
    expect_close("logits", logits.download(), std::vector<double>(ref.logits.data(), ref.logits.data() + ref.logits.size()),
                 1e-5);
    compare_router(ref, gpu, 1e-5, 1e-5);  // fp32 vs double accumulation over D: wider near-tie band
  }
}

// route_fused: the logits computed inside the kernel on the tensor cores, against the reference on the
// same bf16 values in double. Every group width G (E = 1 .. 256), D a multiple of 16, with a tail
// (D = 40, 100) and odd (D = 1, 17: the scalar loads), T from one token to several passes a block
// (E = 256 routes 32 tokens a pass: T = 5000 is 157 passes over 128 blocks; E = 64, T = 20000 the same).
TEST(CudaRouting, RouteFusedMatchesReference) {
  REQUIRE_GPU();
  for (auto [T, D, E, K] : {std::tuple{257, 96, 32, 2}, {1, 8, 1, 1}, {1000, 256, 64, 4}, {5000, 40, 256, 8},
                            {3000, 17, 5, 2}, {20000, 64, 64, 2}, {333, 512, 16, 2}, {100, 1, 3, 1},
                            {600, 100, 128, 3}, {4000, 48, 8, 2}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D) + " E=" + std::to_string(E) +
                 " K=" + std::to_string(K));
    const bool renormalize = K > 1;
    const TokensAndGate problem(T, D, E, K, renormalize, 50 + T + D);
    const moe::ref::RouterOutput& ref = problem.ref;
    const DeviceBuffer<bf16>& device_x = problem.x;
    const DeviceBuffer<bf16>& device_wg = problem.wg;
    Stream stream;
    GpuRouter gpu(T, E, K);
    gpu.run_fused(device_x.data(), device_wg.data(), D, renormalize, stream.stream);
    stream.sync();
    compare_router(ref, gpu, 1e-5, 1e-5);  // fp32 vs double accumulation over D, as with cuBLAS's logits
    // A second run on the same workspace gives the same bits.
    const std::vector<unsigned char> first = gpu.output_bytes();
    gpu.poison();
    gpu.run_fused(device_x.data(), device_wg.data(), D, renormalize, stream.stream);
    stream.sync();
    EXPECT_TRUE(first == gpu.output_bytes()) << "two runs of route_fused differ";
  }
}

// d_logits against the reference's whole chain: moe_backward's gate-weight gradient is
// x^T d_logits, so the test feeds the GPU the reference's forward state and d_combine_weights and
// checks x^T d_logits_gpu against it. With T <= D, x^T has no null space, so no error can hide.
void check_router_backward(moe::Formulation formulation, int T, int D, int E, int K, bool renormalize, uint64_t seed) {
  SCOPED_TRACE(std::string(moe::to_string(formulation)) + " T=" + std::to_string(T) + " E=" + std::to_string(E) +
               " K=" + std::to_string(K) + " renormalize=" + std::to_string(renormalize));
  moe::MoeConfig config;
  config.tokens = T;
  config.model_dim = D;
  config.hidden_dim = 8;
  config.num_experts = E;
  config.top_k = K;
  config.formulation = formulation;
  config.capacity_factor = 0.75;  // dropping drops slots: their d_combine_weights are zero
  config.block_size = 4;
  config.renormalize = renormalize;
  config.aux_loss_coef = 0.3;
  config.z_loss_coef = 0.2;
  std::mt19937_64 generator(seed);
  const Matrix x = moe::ref::random_matrix(T, D, generator);
  const Matrix dy = moe::ref::random_matrix(T, D, generator);
  const moe::ref::MoeWeights weights = moe::ref::random_weights(config, seed + 1);
  const moe::ref::LayerForward forward = moe::ref::moe_forward(config, x, weights);
  const moe::ref::LayerGradients grads = moe::ref::moe_backward(config, x, weights, forward, dy);

  Matrix d_combine = Matrix::Zero(T, K);  // what combine_backward produces (tested in test_permute)
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int row = forward.plan.slot_row[size_t(t) * K + k];
      if (row >= 0) d_combine(t, k) = dy.row(t).dot(forward.expert_out.row(row));
    }
  }
  const moe::ref::RouterOutput& router = forward.router;
  Stream stream;
  DeviceBuffer<float> probs(to_float_vector(router.probs)), d_combine_weights(to_float_vector(d_combine));
  DeviceBuffer<float> logsumexp(to_float_vector(Matrix(router.logsumexp.transpose())));
  DeviceBuffer<float> fraction(to_float_vector(Matrix(router.expert_fraction.transpose())));
  DeviceBuffer<int> top(to_vector(router.top_experts));
  DeviceBuffer<float> d_logits(size_t(T) * E);
  d_logits.fill_bytes(kFloatPoisonByte);
  moe::cuda::router_backward(probs.data(), logsumexp.data(), top.data(), d_combine_weights.data(), fraction.data(),
                             d_logits.data(), T, E, K, renormalize, config.aux_loss_coef, config.z_loss_coef,
                             stream.stream);
  stream.sync();
  const std::vector<float> d_logits_host = d_logits.download();
  Matrix d_logits_gpu(T, E);
  for (int64_t i = 0; i < d_logits_gpu.size(); ++i) d_logits_gpu.data()[i] = d_logits_host[size_t(i)];
  ASSERT_TRUE(d_logits_gpu.allFinite());
  const Matrix d_gate_weights = x.transpose() * d_logits_gpu;
  expect_close("d_gate_weights = x^T d_logits",
               std::vector<double>(d_gate_weights.data(), d_gate_weights.data() + d_gate_weights.size()),
               std::vector<double>(grads.gate_weights.data(), grads.gate_weights.data() + grads.gate_weights.size()),
               1e-5);
}

TEST(CudaRouting, RouterBackwardMatchesReferenceChain) {
  REQUIRE_GPU();
  check_router_backward(moe::Formulation::dropless, 24, 32, 8, 2, false, 41);
  check_router_backward(moe::Formulation::dropless, 24, 32, 8, 2, true, 42);
  check_router_backward(moe::Formulation::dropping, 30, 40, 4, 2, true, 43);   // dropped slots
  check_router_backward(moe::Formulation::padded, 30, 40, 4, 2, false, 44);
  check_router_backward(moe::Formulation::dropless, 1, 8, 1, 1, true, 45);     // T = 1, E = 1
  check_router_backward(moe::Formulation::dropless, 16, 64, 40, 8, true, 46);  // E > 32: two registers per lane
  check_router_backward(moe::Formulation::dropless, 300, 48, 64, 2, true, 47); // T > D
}

TEST(CudaRouting, BadArgumentsAreRejectedBeforeLaunch) {
  REQUIRE_GPU();
  DeviceBuffer<float> f(4096);
  DeviceBuffer<int> i(4096);
  moe::cuda::RouterWorkspace workspace(moe::cuda::kRouterMaxExperts);
  auto route = [&](int T, int E, int K) {
    moe::cuda::route_top_k(f.data(), f.data(), i.data(), f.data(), f.data(), f.data(), f.data(), f.data(), f.data(),
                           workspace, T, E, K, false, nullptr);
  };
  EXPECT_THROW(route(4, 257, 2), std::invalid_argument);  // E > kRouterMaxExperts
  EXPECT_THROW(route(4, 16, 9), std::invalid_argument);   // K > kRouterMaxTopK
  EXPECT_THROW(route(4, 4, 5), std::invalid_argument);    // K > E
  EXPECT_THROW(route(0, 4, 1), std::invalid_argument);    // T = 0
  EXPECT_THROW(route(4, 0, 1), std::invalid_argument);    // E = 0
  EXPECT_THROW(moe::cuda::route_top_k(nullptr, f.data(), i.data(), f.data(), f.data(), f.data(), f.data(), f.data(),
                                      f.data(), workspace, 4, 4, 1, false, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::route_top_k(f.data(), f.data(), i.data(), f.data(), f.data(), f.data(), f.data(), nullptr,
                                      f.data(), workspace, 4, 4, 1, false, nullptr),
               std::invalid_argument);  // aux_loss
  moe::cuda::RouterWorkspace small_workspace(8);
  EXPECT_THROW(moe::cuda::route_top_k(f.data(), f.data(), i.data(), f.data(), f.data(), f.data(), f.data(), f.data(),
                                      f.data(), small_workspace, 4, 16, 1, false, nullptr),
               std::invalid_argument);  // E above the workspace's
  EXPECT_THROW(moe::cuda::RouterWorkspace(0), std::invalid_argument);
  EXPECT_THROW(moe::cuda::RouterWorkspace(moe::cuda::kRouterMaxExperts + 1), std::invalid_argument);
  try {
    route(4, 300, 2);
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("300"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("256"), std::string::npos) << error.what();
  }
  EXPECT_THROW(moe::cuda::router_backward(f.data(), f.data(), i.data(), f.data(), f.data(), f.data(), 4, 4, 2, true,
                                          std::nan(""), 0.0, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::router_logits(nullptr, nullptr, nullptr, f.data(), 4, 4, 4, nullptr), std::invalid_argument);
  DeviceBuffer<bf16> b(4096);
  auto route_fused = [&](const bf16* x, const bf16* wg, int D, int T, int E, int K) {
    moe::cuda::route_fused(x, wg, D, f.data(), i.data(), f.data(), f.data(), f.data(), f.data(), f.data(), f.data(),
                           workspace, T, E, K, false, nullptr);
  };
  EXPECT_THROW(route_fused(nullptr, b.data(), 4, 4, 4, 1), std::invalid_argument);  // x
  EXPECT_THROW(route_fused(b.data(), nullptr, 4, 4, 4, 1), std::invalid_argument);  // gate_weights
  EXPECT_THROW(route_fused(b.data(), b.data(), 0, 4, 4, 1), std::invalid_argument);  // D = 0
  EXPECT_THROW(route_fused(b.data(), b.data(), 4, 4, 257, 1), std::invalid_argument);  // E > kRouterMaxExperts
  EXPECT_THROW(route_fused(b.data(), b.data(), 4, 4, 4, 5), std::invalid_argument);  // K > E
  CUDA_CHECK(cudaDeviceSynchronize());  // nothing was launched: no error is pending
}

}  // namespace
