// test_micro_batches.cpp: gradient accumulation in the GPU layer (cuda/moe/moe_layer.h): a batch
// run as M micro-batches, each with its own routing, forward and backward, and the expert weight
// gradients computed once over every micro-batch's rows (MicroBatchTopology, moe/topology.h).
// M = 1, 2, 4 must give the gradients of one batch of the same tokens: dW1, dW2, the router's and
// each micro-batch's dx, against the GPU layer run on the whole batch and against the CPU reference
// (moe::ref::moe_forward / moe_backward in double on the concatenated tokens). With the router
// losses on, each micro-batch's losses are its own, so the reference is the sum over micro-batches
// of the reference on each. bf16 activations, fp32 accumulation: tolerance 2e-2, as test_moe_layer.
// Compaction before the weight gradients (set_compacted_weight_gradients) gives the same gradients
// to fp32 rounding, and the same bits where no micro-batch pads.
// Bad micro-batch counts (0, negative, not dividing T, more memory than fits) get a clear error.
// Run: ctest --test-dir build -R CudaMicroBatches   (skips without a GPU)
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/block_sparse.h"         // expert_pointer_table, rows_gatherable
#include "core/device_buffer.h"       // DeviceBuffer
#include "gpu_test_support.h"         // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error
#include "init.h"                     // moe::ref::random_matrix, random_weights
#include "reference_cpu/moe_layer.h"  // moe::ref::moe_forward, moe_backward
#include "moe/moe_layer.h"            // MoeLayerGpu, micro_batch_config

namespace {

using moe::MoeConfig;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;

using namespace moe::test;  // round_bf16, bf16_of, matrix_of, relative_error

constexpr double kTolerance = 2e-2;

// The whole batch's tokens: 600 split into 1, 2 or 4 micro-batches of 600, 300, 150 (none a
// multiple of B, so every micro-batch pads its experts' rows).
MoeConfig batch_config(moe::Activation activation = moe::Activation::gelu, int block_size = 64) {
  MoeConfig c;
  c.activation = activation;
  c.tokens = 600;
  c.model_dim = 128;
  c.hidden_dim = 256;
  c.num_experts = 8;
  c.top_k = 2;
  c.block_size = block_size;
  c.renormalize = true;
  c.aux_loss_coef = 0.0;  // the router losses are batch statistics: off, so M micro-batches = one batch
  c.z_loss_coef = 0.0;
  return c;
}

// The layer's gradients on the host, in the reference's shapes.
struct Gradients {
  Matrix x, gate_weights;       // [T, D], [D, E]
  std::vector<Matrix> w1, w2;   // E x [D, w1_columns], E x [H, D]
  Matrix y;                     // [T, D] the forward's output
};

void expect_close(const Gradients& got, const moe::ref::LayerGradients& ref, const Matrix& ref_y,
                  const std::string& what, double tolerance = kTolerance) {
  ASSERT_TRUE(got.x.allFinite() && got.gate_weights.allFinite() && got.y.allFinite()) << what;
  EXPECT_LT(relative_error(got.y, ref_y), tolerance) << what << ": y";
  EXPECT_LT(relative_error(got.x, ref.x), tolerance) << what << ": dx";
  EXPECT_LT(relative_error(got.gate_weights, ref.gate_weights), tolerance) << what << ": dWg";
  for (size_t e = 0; e < ref.w1.size(); ++e) {
    ASSERT_TRUE(got.w1[e].allFinite() && got.w2[e].allFinite()) << what << ": expert " << e;
    if (ref.w1[e].norm() == 0) {  // an expert no micro-batch routed to: exactly zero
      EXPECT_EQ(got.w1[e].norm(), 0.0) << what << ": dW1 expert " << e;
      EXPECT_EQ(got.w2[e].norm(), 0.0) << what << ": dW2 expert " << e;
      continue;
    }
    EXPECT_LT(relative_error(got.w1[e], ref.w1[e]), tolerance) << what << ": dW1 expert " << e;
    EXPECT_LT(relative_error(got.w2[e], ref.w2[e]), tolerance) << what << ": dW2 expert " << e;
  }
}

// The inputs of one batch, rounded to bf16 and uploaded once.
struct Batch {
  Batch(const MoeConfig& config, uint64_t seed, int favoured_expert)
      : weights(moe::ref::random_weights(config, seed + 1)) {
    std::mt19937_64 rng(seed);
    if (favoured_expert >= 0) weights.gate_weights.col(favoured_expert).array() += 50.0;  // x > 0 below
    weights.gate_weights = round_bf16(weights.gate_weights);
    for (auto& w : weights.w1) w = round_bf16(w);
    for (auto& w : weights.w2) w = round_bf16(w);
    x = round_bf16(moe::ref::random_matrix(config.tokens, config.model_dim, rng));
    if (favoured_expert >= 0) x = x.cwiseAbs();
    dy = round_bf16(moe::ref::random_matrix(config.tokens, config.model_dim, rng));
    const int E = int(config.num_experts);
    const size_t D = config.model_dim, H = config.hidden_dim, W1 = moe::w1_columns(config);
    x_gpu = DeviceBuffer<bf16>(bf16_of(x));
    dy_gpu = DeviceBuffer<bf16>(bf16_of(dy));
    gate_gpu = DeviceBuffer<bf16>(bf16_of(weights.gate_weights));
    w1_gpu = DeviceBuffer<bf16>(bf16_of(weights.w1));
    w2_gpu = DeviceBuffer<bf16>(bf16_of(weights.w2));
    w1_table = moe::cuda::expert_pointer_table<const bf16>(w1_gpu.data(), E, D * W1);
    w2_table = moe::cuda::expert_pointer_table<const bf16>(w2_gpu.data(), E, H * D);
  }
  moe::cuda::MoeLayerWeights gpu_weights() const { return {gate_gpu.data(), w1_table.data(), w2_table.data()}; }

  moe::ref::MoeWeights weights;
  Matrix x, dy;  // [T, D]
  DeviceBuffer<bf16> x_gpu, dy_gpu, gate_gpu, w1_gpu, w2_gpu;
  DeviceBuffer<const bf16*> w1_table, w2_table;
};

// Gradient buffers of the whole batch, NaN-poisoned, and their download.
struct GpuGradients {
  explicit GpuGradients(const MoeConfig& batch)
      : T(batch.tokens), D(batch.model_dim), H(batch.hidden_dim), E(batch.num_experts), W1(moe::w1_columns(batch)),
        y(size_t(T * D)), dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * W1)), d_w2(size_t(E * H * D)) {
    d_w1_table = moe::cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * W1));
    d_w2_table = moe::cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
    y.fill_bytes(0xFF);
    for (auto* buffer : {&dx, &d_gate, &d_w1, &d_w2}) buffer->fill_bytes(0xFF);
  }
  Gradients download() const {
    Gradients g;
    g.y = matrix_of(y.download(), T, D);
    g.x = matrix_of(dx.download(), T, D);
    g.gate_weights = matrix_of(d_gate.download(), D, E);
    const std::vector<float> w1_host = d_w1.download(), w2_host = d_w2.download();
    for (int64_t e = 0; e < E; ++e) {
      g.w1.push_back(matrix_of(w1_host, D, W1, size_t(e * D * W1)));
      g.w2.push_back(matrix_of(w2_host, H, D, size_t(e * H * D)));
    }
    return g;
  }
  int64_t T, D, H, E, W1;
  DeviceBuffer<bf16> y;
  DeviceBuffer<float> dx, d_gate, d_w1, d_w2;
  DeviceBuffer<float*> d_w1_table, d_w2_table;
};

// The layer on the whole batch, as one forward and one backward.
Gradients one_batch(const MoeConfig& batch, const Batch& in) {
  GpuGradients g(batch);
  moe::cuda::MoeLayerGpu layer(batch);
  const moe::cuda::MoeLayerWeights w = in.gpu_weights();
  layer.forward(in.x_gpu.data(), w, g.y.data(), nullptr);
  layer.backward(in.x_gpu.data(), w, in.dy_gpu.data(), {g.dx.data(), g.d_gate.data(), g.d_w1_table.data(),
                                                         g.d_w2_table.data()}, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return g.download();
}

// The layer on M micro-batches: micro-batch m is tokens [m T/M, (m+1) T/M) of the batch. Each
// micro-batch's router gradient is its own; the caller (here) sums them, as a trainer sums every
// gradient but the experts'.
Gradients micro_batches(const MoeConfig& batch, const Batch& in, int M, bool compacted = false) {
  GpuGradients g(batch);
  const MoeConfig config = moe::cuda::micro_batch_config(batch, M);
  moe::cuda::MoeLayerGpu layer(config, M);
  EXPECT_EQ(layer.micro_batches(), M);
  if (compacted) layer.set_compacted_weight_gradients(true);
  const moe::cuda::MoeLayerWeights w = in.gpu_weights();
  const size_t rows = size_t(config.tokens) * config.model_dim;  // one micro-batch's [T/M, D]
  Matrix d_gate_sum = Matrix::Zero(batch.model_dim, batch.num_experts);
  for (int m = 0; m < M; ++m) {
    g.d_gate.fill_bytes(0xFF);
    layer.forward_micro_batch(m, in.x_gpu.data() + m * rows, w, g.y.data() + m * rows, nullptr);
    layer.backward_micro_batch(m, in.x_gpu.data() + m * rows, w, in.dy_gpu.data() + m * rows, g.dx.data() + m * rows,
                               g.d_gate.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    d_gate_sum += matrix_of(g.d_gate.download(), batch.model_dim, batch.num_experts);
  }
  layer.expert_weight_gradients(g.d_w1_table.data(), g.d_w2_table.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  Gradients got = g.download();
  got.gate_weights = d_gate_sum;
  return got;
}

// The reference of M micro-batches with the router losses on: each micro-batch's gradients of its
// own loss, summed (dW1, dW2, dWg) or placed at its rows (dx, y).
struct SummedReference {
  moe::ref::LayerGradients gradients;
  Matrix y;
};
SummedReference reference_per_micro_batch(const MoeConfig& batch, const Batch& in, int M) {
  const MoeConfig config = moe::cuda::micro_batch_config(batch, M);
  const int64_t T = config.tokens;
  SummedReference sum;
  sum.y = Matrix::Zero(batch.tokens, batch.model_dim);
  sum.gradients.x = Matrix::Zero(batch.tokens, batch.model_dim);
  for (int m = 0; m < M; ++m) {
    const Matrix x = in.x.middleRows(m * T, T), dy = in.dy.middleRows(m * T, T);
    const moe::ref::LayerForward forward = moe::ref::moe_forward(config, x, in.weights);
    const moe::ref::LayerGradients g = moe::ref::moe_backward(config, x, in.weights, forward, dy);
    sum.y.middleRows(m * T, T) = forward.y;
    sum.gradients.x.middleRows(m * T, T) = g.x;
    if (m == 0) {
      sum.gradients.gate_weights = g.gate_weights;
      sum.gradients.w1 = g.w1;
      sum.gradients.w2 = g.w2;
      continue;
    }
    sum.gradients.gate_weights += g.gate_weights;
    for (size_t e = 0; e < g.w1.size(); ++e) {
      sum.gradients.w1[e] += g.w1[e];
      sum.gradients.w2[e] += g.w2[e];
    }
  }
  return sum;
}

// M = 1, 2, 4 against the reference on the whole batch and against the GPU layer on the whole batch.
void check_micro_batches(const MoeConfig& batch, uint64_t seed, int favoured_expert = -1) {
  const Batch in(batch, seed, favoured_expert);
  const moe::ref::LayerForward forward = moe::ref::moe_forward(batch, in.x, in.weights);
  const moe::ref::LayerGradients reference = moe::ref::moe_backward(batch, in.x, in.weights, forward, in.dy);
  const Gradients whole = one_batch(batch, in);
  expect_close(whole, reference, forward.y, "one batch vs reference");
  moe::ref::LayerGradients whole_as_reference{whole.x, whole.gate_weights, whole.w1, whole.w2};
  for (int M : {1, 2, 4}) {
    const Gradients got = micro_batches(batch, in, M);
    const std::string what = std::to_string(M) + " micro-batches";
    expect_close(got, reference, forward.y, what + " vs reference");
    expect_close(got, whole_as_reference, whole.y, what + " vs the GPU layer on one batch");
    if (M == 1) continue;
    // Compacted: the same rows summed in another grouping of k-steps, so fp32 rounding apart.
    const Gradients compacted = micro_batches(batch, in, M, /*compacted=*/true);
    expect_close(compacted, reference, forward.y, what + ", compacted, vs reference");
    moe::ref::LayerGradients slots{got.x, got.gate_weights, got.w1, got.w2};
    expect_close(compacted, slots, got.y, what + ", compacted, vs the slot layout", 1e-4);
  }
}

TEST(CudaMicroBatches, DroplessBlockSize64) {
  REQUIRE_GPU();
  check_micro_batches(batch_config(), 101);
}

// B = 128: on Hopper the forward's SDD gathers x's rows and the backward permutes them into the
// micro-batch's slot (the weight gradients' operand).
TEST(CudaMicroBatches, DroplessBlockSize128) {
  REQUIRE_GPU();
  check_micro_batches(batch_config(moe::Activation::gelu, 128), 102);
}

// SwiGLU: dW1's gate and up halves come from two DDS over the slots of d_pre and d_up.
TEST(CudaMicroBatches, Swiglu) {
  REQUIRE_GPU();
  check_micro_batches(batch_config(moe::Activation::swiglu), 103);
  check_micro_batches(batch_config(moe::Activation::swiglu, 128), 104);
}

// Every token on one expert (K = 1): the others have no rows in any micro-batch (exactly zero
// gradients), and the busy one has block rows in every micro-batch's slot.
TEST(CudaMicroBatches, AllTokensOnOneExpert) {
  REQUIRE_GPU();
  MoeConfig c = batch_config();
  c.top_k = 1;
  c.renormalize = false;
  check_micro_batches(c, 105, /*favoured_expert=*/5);
}

// Where every micro-batch's expert counts are multiples of B, the compacted layout is the slot
// layout without the gaps between slots: the same blocks in the same order, the same bits.
TEST(CudaMicroBatches, CompactionIsBitIdenticalWhereNoMicroBatchPads) {
  REQUIRE_GPU();
  MoeConfig c = batch_config();
  c.tokens = 512;  // two micro-batches of 256 = 4 B, all on expert 5
  c.top_k = 1;
  c.renormalize = false;
  const Batch in(c, 108, /*favoured_expert=*/5);
  const Gradients slots = micro_batches(c, in, 2);
  const Gradients compacted = micro_batches(c, in, 2, /*compacted=*/true);
  for (size_t e = 0; e < slots.w1.size(); ++e) {
    EXPECT_EQ(slots.w1[e], compacted.w1[e]) << "dW1 expert " << e;
    EXPECT_EQ(slots.w2[e], compacted.w2[e]) << "dW2 expert " << e;
  }
  EXPECT_GT(slots.w1[5].norm(), 0.0);
}

// With the router losses on, each micro-batch's losses are its own: the sum of the reference on
// each micro-batch.
TEST(CudaMicroBatches, RouterLossesPerMicroBatch) {
  REQUIRE_GPU();
  MoeConfig batch = batch_config();
  batch.aux_loss_coef = 0.01;
  batch.z_loss_coef = 0.001;
  const Batch in(batch, 106, -1);
  for (int M : {1, 2, 4}) {
    const SummedReference reference = reference_per_micro_batch(batch, in, M);
    expect_close(micro_batches(batch, in, M), reference.gradients, reference.y,
                 std::to_string(M) + " micro-batches with router losses vs the reference per micro-batch");
  }
}

// Host-side checks: no GPU needed.
TEST(CudaMicroBatches, BadMicroBatchCounts) {
  const MoeConfig batch = batch_config();
  for (int M : {0, -1, 7}) {  // 7 does not divide T = 600
    try {
      moe::cuda::micro_batch_config(batch, M);
      FAIL() << "micro_batch_config accepted M = " << M;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("allowed: M >= 1 dividing T"), std::string::npos) << error.what();
    }
  }
  EXPECT_EQ(moe::cuda::micro_batch_config(batch, 4).tokens, 150);
  // The layer refuses M < 1, and M > 1 outside dropless, before touching the GPU.
  for (int M : {0, -3}) {
    try {
      moe::cuda::MoeLayerGpu layer(batch, M);
      FAIL() << "MoeLayerGpu accepted micro_batches = " << M;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("allowed: M >= 1"), std::string::npos) << error.what();
    }
  }
  MoeConfig padded = batch;
  padded.formulation = moe::Formulation::padded;
  padded.capacity_factor = 2.0;
  try {
    moe::cuda::MoeLayerGpu layer(padded, 2);
    FAIL() << "MoeLayerGpu accepted micro_batches = 2 for the padded formulation";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("needs the dropless formulation"), std::string::npos) << error.what();
  }
  // Memory grows with M, and the check names M.
  EXPECT_GT(moe::cuda::layer_memory_bytes(batch, 4), moe::cuda::layer_memory_bytes(batch, 1));
  try {
    moe::cuda::check_layer_fits(batch, size_t{1} << 20, 4);
    FAIL() << "a layer of " << moe::cuda::layer_memory_bytes(batch, 4) << " bytes fit in 1 MiB";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("micro-batches M=4"), std::string::npos) << error.what();
  }
}

// On the GPU: more micro-batches than memory holds is refused before any allocation; the
// micro-batch calls are checked (index, order, every micro-batch before the weight gradients).
TEST(CudaMicroBatches, MisuseFailsWithAClearError) {
  REQUIRE_GPU();
  MoeConfig huge = batch_config(moe::Activation::gelu, 128);
  huge.tokens = 16384;
  huge.model_dim = 4096;
  huge.hidden_dim = 16384;
  huge.num_experts = 64;
  huge.top_k = 1;  // about 2 GB of kept operands a micro-batch: 200 of them fit on no GPU
  try {
    moe::cuda::MoeLayerGpu layer(huge, 200);
    FAIL() << "a layer of " << moe::cuda::layer_memory_bytes(huge, 200) << " bytes was made";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("GiB are free"), std::string::npos) << error.what();
  }

  const MoeConfig batch = batch_config();
  const Batch in(batch, 107, -1);
  const MoeConfig config = moe::cuda::micro_batch_config(batch, 2);
  GpuGradients g(batch);
  moe::cuda::MoeLayerGpu layer(config, 2);
  const moe::cuda::MoeLayerWeights w = in.gpu_weights();
  EXPECT_THROW(layer.forward_micro_batch(2, in.x_gpu.data(), w, g.y.data(), nullptr), std::invalid_argument);
  EXPECT_THROW(layer.forward_micro_batch(-1, in.x_gpu.data(), w, g.y.data(), nullptr), std::invalid_argument);
  layer.forward_micro_batch(0, in.x_gpu.data(), w, g.y.data(), nullptr);
  // the backward of another micro-batch than the last forward's
  EXPECT_THROW(layer.backward_micro_batch(1, in.x_gpu.data(), w, in.dy_gpu.data(), g.dx.data(), g.d_gate.data(),
                                          nullptr),
               std::invalid_argument);
  layer.backward_micro_batch(0, in.x_gpu.data(), w, in.dy_gpu.data(), g.dx.data(), g.d_gate.data(), nullptr);
  // micro-batch 1 has not run its backward yet
  EXPECT_THROW(layer.expert_weight_gradients(g.d_w1_table.data(), g.d_w2_table.data(), nullptr),
               std::invalid_argument);
  CUDA_CHECK(cudaDeviceSynchronize());
  // Compaction needs something to compact: M >= 2 micro-batches.
  moe::cuda::MoeLayerGpu one(batch_config(), 1);
  try {
    one.set_compacted_weight_gradients(true);
    FAIL() << "compaction was accepted with one micro-batch";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("allowed: M >= 2"), std::string::npos) << error.what();
  }
  one.set_compacted_weight_gradients(false);  // off is always allowed
  EXPECT_FALSE(one.compacted_weight_gradients());
}

}  // namespace
