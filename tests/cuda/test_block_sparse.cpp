// test_block_sparse.cpp: the block-sparse tensor-core kernels (cuda/moe/block_sparse.h: SDD, DSD, DSᵀD,
// DDS and the dropless expert FFN forward and backward) against the CPU reference, on fresh random
// bf16 inputs with every output poisoned (0xFF bytes: NaN) before the run. Tolerance: relative
// Frobenius error ||gpu - ref|| / ||ref|| < 1e-2 (bf16 operands and outputs, fp32 accumulation).
// Also checked: nothing past the used rows / blocks is written, rows past the used part of the
// inputs are never read (they hold NaN), empty experts get exactly zero weight gradients.
// At B = 128 with D and H multiples of 128, an H100/H200 runs all four products on the wgmma kernels
// (block_sparse_wgmma_ws.cuh, its operands copied with TMA, where the tiles are 256 wide;
// block_sparse_wgmma.cuh otherwise; DSᵀD and DDS read A M-major); the B = 64 cases keep the
// mma.sync kernel.
// Run: ctest --test-dir build -R '^BlockSparse'   (skips without a GPU)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference_cpu/block_sparse.h"  // moe::ref::sdd, dsd, dds
#include "moe/block_sparse.h"            // moe::cuda: the kernels under test
#include "block_sparse_ffn.h"            // moe::ref::block_sparse_ffn_forward / backward
#include "bridge/reference_topology.h"       // upload_topology
#include "core/device_info.h"            // gpu_available, current_device
#include "init.h"                        // moe::ref::random_matrix
#include "moe/tile_schedule.h"           // moe::cuda::TileSchedule

namespace {

using moe::Activation;
using moe::MoeConfig;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

constexpr double kTolerance = 1e-2;
constexpr uint16_t kPoison = 0xFFFF;  // bf16 NaN, what fill_bytes(0xFF) leaves
bf16 poison_bf16() {
  __nv_bfloat16_raw raw;
  raw.x = kPoison;
  return bf16(raw);
}

// Uniform in [-scale, scale), rounded to bf16, so the reference sees exactly the GPU's inputs.
Matrix random_bf16_matrix(int64_t rows, int64_t cols, std::mt19937_64& generator, double scale) {
  Matrix m = moe::ref::random_matrix(rows, cols, generator, scale);
  for (int64_t i = 0; i < m.size(); ++i) m.data()[i] = __bfloat162float(__float2bfloat16(float(m.data()[i])));
  return m;
}

// A device copy of m in a buffer of `capacity_rows` rows; the rows past m's hold NaN, so reading
// them (rows past *block_rows) poisons a result.
DeviceBuffer<bf16> upload_rows(const Matrix& m, int64_t capacity_rows) {
  std::vector<bf16> host(size_t(capacity_rows * m.cols()), poison_bf16());
  for (int64_t i = 0; i < m.size(); ++i) host[size_t(i)] = __float2bfloat16(float(m.data()[i]));
  return DeviceBuffer<bf16>(host);
}

DeviceBuffer<bf16> poisoned_bf16(size_t count) {
  DeviceBuffer<bf16> b(count);
  b.fill_bytes(0xFF);
  return b;
}

struct Error {
  double relative = 0;
  int64_t not_finite = 0;
};
// ||gpu - ref|| / ||ref|| over the first ref.size() values; when ||ref|| = 0, the norm of gpu itself.
template <typename T>
Error compare(const std::vector<T>& gpu, const Matrix& ref) {
  double diff = 0, norm = 0;
  Error error;
  for (int64_t i = 0; i < ref.size(); ++i) {
    double g;
    if constexpr (std::is_same_v<T, bf16>) g = __bfloat162float(gpu[size_t(i)]);
    else g = gpu[size_t(i)];
    if (!std::isfinite(g)) ++error.not_finite;
    diff += (g - ref.data()[i]) * (g - ref.data()[i]);
    norm += ref.data()[i] * ref.data()[i];
  }
  error.relative = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  return error;
}

#define EXPECT_CLOSE(gpu, ref, what)                                                      \
  do {                                                                                    \
    const Error e_ = compare(gpu, ref);                                                   \
    EXPECT_EQ(e_.not_finite, 0) << what << ": NaN or Inf in the used part";              \
    EXPECT_LT(e_.relative, kTolerance) << what;                                           \
    std::printf("  %-28s rel_err=%.2e tol=%.0e\n", what, e_.relative, kTolerance);       \
  } while (0)

// Every value from `first` on still holds the poison: nothing was written there.
void expect_untouched(const std::vector<bf16>& values, size_t first, const char* what) {
  size_t written = 0;
  for (size_t i = first; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, &values[i], 2);
    written += bits != kPoison;
  }
  EXPECT_EQ(written, 0u) << what << ": values past the used part were written";
}

// Per-expert fp32 gradients, each in its own allocation (the pointer table need not be one tensor).
struct ExpertFloats {
  std::vector<DeviceBuffer<float>> buffers;
  DeviceBuffer<float*> table;
  ExpertFloats(int experts, size_t count) {
    std::vector<float*> pointers;
    for (int e = 0; e < experts; ++e) {
      buffers.emplace_back(count);
      buffers.back().fill_bytes(0xFF);
      pointers.push_back(buffers.back().data());
    }
    table = DeviceBuffer<float*>(pointers);
  }
  Matrix stacked(int64_t rows, int64_t cols) const {  // E x [rows, cols] -> [E*rows, cols]
    Matrix m(rows * int64_t(buffers.size()), cols);
    for (size_t e = 0; e < buffers.size(); ++e) {
      const std::vector<float> host = buffers[e].download();
      for (int64_t i = 0; i < rows * cols; ++i) m.data()[int64_t(e) * rows * cols + i] = host[size_t(i)];
    }
    return m;
  }
};

struct ExpertWeights {
  std::vector<DeviceBuffer<bf16>> buffers;
  DeviceBuffer<const bf16*> table;
  explicit ExpertWeights(const std::vector<Matrix>& per_expert) {
    std::vector<const bf16*> pointers;
    for (const Matrix& m : per_expert) {
      buffers.emplace_back(moe::cuda::to_bf16(m.data(), size_t(m.size())));
      pointers.push_back(buffers.back().data());
    }
    table = DeviceBuffer<const bf16*>(pointers);
  }
};

// tail_halves (K = 1, E = 5, T = 322): experts 0-3 get 192, 64, 65 and 1 tokens, expert 4 none, so
// block rows end with 64 tokens (rows 64-127 all padding), 65, and 1. On an H100/H200 the SDDs run
// the rows ending with 64 and 1 as half-row tiles (block_sparse_wgmma_ws.cuh), the row of 65 whole.
// block_row_pairs (K = 1, E = 4, T = 1540): experts 0-3 get 576, 385, 66 and 513 tokens, so 15
// block rows: 5 of expert 0 (the last of 64 tokens), 4 of expert 1 (the last of 1), 1 of expert 2,
// 5 of expert 3 (the last of 1). The host bound is 16 block rows, 4 an expert, so on an H100/H200
// the SDDs and DSDs run in pairs of block rows that share the expert's B chunk (WsCluster::share_b,
// block_sparse.cu: pairs_share_b), and every case of a pair comes up: rows 0-1, 2-3, 6-7, 10-11 and
// 12-13 share; rows 4-5 (a half row of expert 0 beside expert 1) and 8-9 (a half row of expert 1
// beside expert 2) do not; row 14's peer is past the 15 block rows, so its CTA multiplies row 14 (a
// half-row tile) and stores nothing.
enum class Routing { random, skip_one_expert, all_to_one_expert, tail_halves, block_row_pairs };
constexpr int kTailHalvesTokens[] = {192, 64, 65, 1};
constexpr int kBlockRowPairsTokens[] = {576, 385, 66, 513};

// One dropless layer's worth of inputs: config, plan, topology (host and device), tensors.
struct Problem {
  MoeConfig config;
  moe::ref::DispatchPlan plan;
  moe::ref::BlockSparseTopology topology;
  moe::cuda::UploadedTopology device;
  int64_t rows = 0, max_rows = 0;
  Matrix x;                       // [T, D] in token order
  Matrix permuted_x, d_out;       // [rows, D]: x's rows in expert order (zero padding rows), d_out
  std::vector<Matrix> w1, w2;     // E x [D, w1_columns], E x [H, D]

  Problem(int T, int D, int H, int E, int K, int B, Activation activation, Routing routing, uint64_t seed) {
    config.tokens = T;
    config.model_dim = D;
    config.hidden_dim = H;
    config.num_experts = E;
    config.top_k = K;
    config.block_size = B;
    config.activation = activation;
    config.formulation = moe::Formulation::dropless;
    std::mt19937_64 generator(seed);
    moe::ref::IndexMatrix top(T, K);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        int e = 0;
        switch (routing) {
          case Routing::random: e = int(generator() % uint64_t(E)); break;
          case Routing::skip_one_expert: e = int(generator() % uint64_t(E - 1)); e += (e >= E / 2); break;
          case Routing::all_to_one_expert: e = (1 + k) % E; break;
          case Routing::tail_halves:
            for (int first = 0; e < 4 && t >= first + kTailHalvesTokens[e]; first += kTailHalvesTokens[e++]) {
            }
            break;
          case Routing::block_row_pairs:
            for (int first = 0; e < 3 && t >= first + kBlockRowPairsTokens[e]; first += kBlockRowPairsTokens[e++]) {
            }
            break;
        }
        for (int j = 0; j < k; ++j)
          if (top(t, j) == e) e = (e + 1) % E;  // K distinct experts per token
        if (routing == Routing::skip_one_expert && e == E / 2) e = (e + 1) % E;
        top(t, k) = e;
      }
    }
    plan = moe::ref::plan_dispatch(config, top);
    topology = moe::ref::make_topology(config, plan);
    rows = plan.total_rows;
    max_rows = int64_t(T) * K + int64_t(E) * (B - 1);
    device = moe::cuda::upload_topology(topology, H, max_rows);

    const int64_t w1_cols = moe::w1_columns(config);
    x = random_bf16_matrix(T, D, generator, 1.0);
    permuted_x = Matrix::Zero(rows, D);  // padding rows zero, as permute_tokens writes them
    for (int64_t r = 0; r < rows; ++r)
      if (plan.row_slot[size_t(r)] >= 0) permuted_x.row(r) = x.row(plan.row_slot[size_t(r)] / K);
    d_out = random_bf16_matrix(rows, D, generator, 1.0);
    for (int64_t r = 0; r < rows; ++r)
      if (plan.row_slot[size_t(r)] < 0) d_out.row(r).setZero();  // as combine_backward writes
    for (int e = 0; e < E; ++e) {
      w1.push_back(random_bf16_matrix(D, w1_cols, generator, 1.0 / std::sqrt(double(D))));
      w2.push_back(random_bf16_matrix(H, D, generator, 1.0 / std::sqrt(double(H))));
    }
  }
  size_t block_elements() const { return size_t(device.topology.max_nnz) * config.block_size * config.block_size; }
  size_t used_block_elements() const { return size_t(topology.nnz) * config.block_size * config.block_size; }
};

// The whole dropless FFN, forward and backward, against block_sparse_ffn_* and expert_ffn_*.
void check_ffn(const Problem& p) {
  const MoeConfig& c = p.config;
  const int64_t D = c.model_dim, H = c.hidden_dim, E = c.num_experts, w1_cols = moe::w1_columns(c);
  const bool swiglu = c.activation == Activation::swiglu;
  std::printf("T=%ld D=%ld H=%ld E=%ld K=%ld B=%ld %s rows=%ld/%ld nnz=%ld\n", long(c.tokens), long(D),
              long(H), long(E), long(c.top_k), long(c.block_size), swiglu ? "swiglu" : "gelu",
              long(p.rows), long(p.max_rows), long(p.topology.nnz));

  const auto ref_forward = moe::ref::block_sparse_ffn_forward(c, p.topology, p.permuted_x, p.w1, p.w2);
  const auto ref_grads =
      moe::ref::block_sparse_ffn_backward(c, p.topology, p.permuted_x, p.w1, p.w2, ref_forward, p.d_out);
  const auto dense_forward = moe::ref::expert_ffn_forward(c, p.plan, p.permuted_x, p.w1, p.w2);
  const auto dense_grads =
      moe::ref::expert_ffn_backward(c, p.plan, p.permuted_x, p.w1, p.w2, dense_forward, p.d_out);

  const ExpertWeights w1(p.w1), w2(p.w2);
  const DeviceBuffer<bf16> d_out = upload_rows(p.d_out, p.max_rows);
  // The forward once with the rows in a permuted copy, once gathered from x in token order where the
  // kernels can; the backward reads the permuted copy.
  const DeviceBuffer<bf16> permuted_x = upload_rows(p.permuted_x, p.max_rows);
  const DeviceBuffer<bf16> token_x = upload_rows(p.x, p.x.rows());
  std::vector<int> row_slot(p.plan.row_slot.begin(), p.plan.row_slot.end());
  row_slot.resize(size_t(p.max_rows), -1);
  const DeviceBuffer<int> row_slot_device(row_slot);
  moe::cuda::ExpertRows gathered(token_x.data());
  gathered.row_slot = row_slot_device.data();
  gathered.top_k = int(c.top_k);
  gathered.tokens = int(c.tokens);
  for (const bool gather : {false, true}) {
    if (gather && !moe::cuda::rows_gatherable(c)) {
      std::printf("  (gathered rows: not on this GPU or config, only the permuted copy is checked)\n");
      continue;
    }
    SCOPED_TRACE(gather ? "rows gathered from x in token order" : "rows from the permuted copy");
    std::printf("  -- input rows %s\n", gather ? "gathered from x (token order)" : "from the permuted copy");
    const moe::cuda::ExpertRows x = gather ? gathered : moe::cuda::ExpertRows(permuted_x.data());
    DeviceBuffer<bf16> pre = poisoned_bf16(p.block_elements()), hidden = poisoned_bf16(p.block_elements());
    DeviceBuffer<bf16> up = poisoned_bf16(swiglu ? p.block_elements() : 0);
    DeviceBuffer<bf16> out = poisoned_bf16(size_t(p.max_rows * D));

    moe::cuda::BlockSparseFfnOutputs outputs{pre.data(), swiglu ? up.data() : nullptr, hidden.data(), out.data()};
    moe::cuda::block_sparse_ffn_forward(c, p.device.topology, x, w1.table.data(), w2.table.data(), outputs);

    const auto out_host = out.download();
    const auto pre_host = pre.download(), hidden_host = hidden.download();
    EXPECT_CLOSE(pre_host, ref_forward.pre_activation, "forward pre-activation");
    if (swiglu) EXPECT_CLOSE(up.download(), ref_forward.up_projection, "forward up projection");
    EXPECT_CLOSE(hidden_host, ref_forward.hidden, "forward hidden");
    EXPECT_CLOSE(out_host, ref_forward.out, "forward out (block-sparse ref)");
    EXPECT_CLOSE(out_host, dense_forward.out, "forward out (expert_ffn ref)");
    expect_untouched(out_host, size_t(p.rows * D), "forward out");
    expect_untouched(hidden_host, p.used_block_elements(), "forward hidden blocks");
    expect_untouched(pre_host, p.used_block_elements(), "forward pre-activation blocks");

    DeviceBuffer<bf16> d_pre = poisoned_bf16(p.block_elements());
    DeviceBuffer<bf16> d_up = poisoned_bf16(swiglu ? p.block_elements() : 0);
    DeviceBuffer<bf16> d_x = poisoned_bf16(size_t(p.max_rows * D));
    ExpertFloats d_w1(int(E), size_t(D * w1_cols)), d_w2(int(E), size_t(H * D));
    moe::cuda::BlockSparseFfnGradients gradients{d_pre.data(), swiglu ? d_up.data() : nullptr, d_x.data(),
                                                 d_w1.table.data(), d_w2.table.data()};
    moe::cuda::block_sparse_ffn_backward(c, p.device.topology, permuted_x.data(), w1.table.data(), w2.table.data(),
                                         outputs, d_out.data(), gradients);

    // d_pre against the reference's own blocks: SDD(d_out, W2catᵀ) . act'(pre).
    const Matrix d_hidden = moe::ref::sdd(p.d_out, moe::ref::concat_expert_rows(p.w2).transpose(), p.topology);
    Matrix d_pre_ref;
    if (swiglu) {
      d_pre_ref = d_hidden.cwiseProduct(ref_forward.up_projection)
                      .cwiseProduct(ref_forward.pre_activation.unaryExpr([](double a) { return moe::ref::silu_derivative(a); }));
      const Matrix d_up_ref =
          d_hidden.cwiseProduct(ref_forward.pre_activation.unaryExpr([](double a) { return moe::ref::silu(a); }));
      EXPECT_CLOSE(d_up.download(), d_up_ref, "backward d_up");
    } else {
      d_pre_ref = d_hidden.cwiseProduct(ref_forward.pre_activation.unaryExpr([](double a) { return moe::ref::gelu_derivative(a); }));
    }
    const auto d_pre_host = d_pre.download();
    EXPECT_CLOSE(d_pre_host, d_pre_ref, "backward d_pre");
    expect_untouched(d_pre_host, p.used_block_elements(), "backward d_pre blocks");

    const auto d_x_host = d_x.download();
    EXPECT_CLOSE(d_x_host, ref_grads.permuted_x, "backward d_x (block-sparse ref)");
    EXPECT_CLOSE(d_x_host, dense_grads.permuted_x, "backward d_x (expert_ffn ref)");
    expect_untouched(d_x_host, size_t(p.rows * D), "backward d_x");

    const Matrix d_w1_gpu = d_w1.stacked(D, w1_cols), d_w2_gpu = d_w2.stacked(H, D);
    const Matrix d_w1_ref = moe::ref::concat_expert_rows(ref_grads.w1), d_w2_ref = moe::ref::concat_expert_rows(ref_grads.w2);
    const Matrix d_w1_dense = moe::ref::concat_expert_rows(dense_grads.w1), d_w2_dense = moe::ref::concat_expert_rows(dense_grads.w2);
    auto as_vector = [](const Matrix& m) { return std::vector<float>(m.data(), m.data() + m.size()); };
    EXPECT_CLOSE(as_vector(d_w1_gpu), d_w1_ref, "backward d_w1 (block-sparse ref)");
    EXPECT_CLOSE(as_vector(d_w1_gpu), d_w1_dense, "backward d_w1 (expert_ffn ref)");
    EXPECT_CLOSE(as_vector(d_w2_gpu), d_w2_ref, "backward d_w2 (block-sparse ref)");
    EXPECT_CLOSE(as_vector(d_w2_gpu), d_w2_dense, "backward d_w2 (expert_ffn ref)");
    for (int64_t e = 0; e < E; ++e) {
      if (p.plan.rows_per_expert[size_t(e)] != 0) continue;
      EXPECT_EQ(d_w1_gpu.middleRows(e * D, D).cwiseAbs().maxCoeff(), 0.0) << "expert " << e << " has no rows";
      EXPECT_EQ(d_w2_gpu.middleRows(e * H, H).cwiseAbs().maxCoeff(), 0.0) << "expert " << e << " has no rows";
    }

    // The same backward with the weight gradients written in bf16 (here one tensor per weight).
    DeviceBuffer<bf16> d_w1_bf16 = poisoned_bf16(size_t(E * D * w1_cols)), d_w2_bf16 = poisoned_bf16(size_t(E * H * D));
    const auto d_w1_table = moe::cuda::expert_pointer_table(d_w1_bf16.data(), int(E), size_t(D * w1_cols));
    const auto d_w2_table = moe::cuda::expert_pointer_table(d_w2_bf16.data(), int(E), size_t(H * D));
    moe::cuda::BlockSparseFfnGradients bf16_gradients{d_pre.data(), swiglu ? d_up.data() : nullptr, d_x.data()};
    bf16_gradients.d_w1_bf16 = d_w1_table.data();
    bf16_gradients.d_w2_bf16 = d_w2_table.data();
    moe::cuda::block_sparse_ffn_backward(c, p.device.topology, permuted_x.data(), w1.table.data(), w2.table.data(),
                                         outputs, d_out.data(), bf16_gradients);
    EXPECT_CLOSE(d_w1_bf16.download(), d_w1_ref, "backward d_w1 in bf16");
    EXPECT_CLOSE(d_w2_bf16.download(), d_w2_ref, "backward d_w2 in bf16");
  }
}

TEST(BlockSparseFfn, GeluB128) {
  REQUIRE_GPU();
  check_ffn(Problem(300, 256, 256, 4, 1, 128, Activation::gelu, Routing::random, 1));
}
TEST(BlockSparseFfn, GeluB64NarrowTiles) {  // D and H not multiples of 128: the 64-wide tiles
  REQUIRE_GPU();
  check_ffn(Problem(200, 192, 320, 3, 2, 64, Activation::gelu, Routing::random, 2));
}
TEST(BlockSparseFfn, GeluB64) {
  REQUIRE_GPU();
  check_ffn(Problem(333, 256, 512, 6, 2, 64, Activation::gelu, Routing::random, 3));
}
TEST(BlockSparseFfn, SwigluB64) {
  REQUIRE_GPU();
  check_ffn(Problem(150, 128, 128, 4, 2, 64, Activation::swiglu, Routing::random, 4));
}
TEST(BlockSparseFfn, SwigluB128) {
  REQUIRE_GPU();
  check_ffn(Problem(260, 256, 384, 2, 1, 128, Activation::swiglu, Routing::random, 5));
}
TEST(BlockSparseFfn, ExpertWithNoTokens) {
  REQUIRE_GPU();
  check_ffn(Problem(280, 128, 256, 4, 1, 128, Activation::gelu, Routing::skip_one_expert, 6));
}
TEST(BlockSparseFfn, OneExpertGetsAllTokens) {
  REQUIRE_GPU();
  check_ffn(Problem(190, 128, 192, 4, 1, 64, Activation::gelu, Routing::all_to_one_expert, 7));
}
TEST(BlockSparseFfn, SingleExpert) {
  REQUIRE_GPU();
  check_ffn(Problem(130, 128, 256, 1, 1, 128, Activation::gelu, Routing::random, 8));
}
TEST(BlockSparseFfn, TopTwoOfEight) {
  REQUIRE_GPU();
  check_ffn(Problem(400, 384, 256, 8, 2, 128, Activation::gelu, Routing::random, 9));
}
// B = 128: the weight gradients of 3 empty experts and one with every row (5 blocks, 10 k-steps).
TEST(BlockSparseFfn, OneExpertGetsAllTokensB128) {
  REQUIRE_GPU();
  check_ffn(Problem(600, 256, 384, 4, 1, 128, Activation::gelu, Routing::all_to_one_expert, 16));
}
// B = 128 with more 128 x 256 tiles than an H100/H200 has SMs (8192 x 2 slots: 128+ block rows x
// 2 tiles of H, D = 256: 1 tile), so the persistent warp-specialized kernel's CTAs each walk
// several tiles, and its ring of stages carries over from one tile to the next.
TEST(BlockSparseFfn, PersistentTilesB128) {
  REQUIRE_GPU();
  check_ffn(Problem(8192, 256, 512, 4, 2, 128, Activation::gelu, Routing::random, 18));
}
// SwiGLU at B = 128, every token to experts 1 and 2: DDS writes both halves of dW1 (column_offset H).
TEST(BlockSparseFfn, SwigluAllTokensToTwoExpertsB128) {
  REQUIRE_GPU();
  check_ffn(Problem(300, 128, 256, 4, 2, 128, Activation::swiglu, Routing::all_to_one_expert, 17));
}

// Block rows that end with 64 tokens (the last 64 rows all padding), 65 and 1, and an expert with
// none: the weight gradients' walks stop at 1, 1, 2 and 1 k-steps into a block row, and on an
// H100/H200 their bulk-copy epilogue writes bf16 rows in one pass and fp32 rows in two.
TEST(BlockSparseFfn, GeluB128PaddingHalves) {
  REQUIRE_GPU();
  check_ffn(Problem(322, 256, 512, 5, 1, 128, Activation::gelu, Routing::tail_halves, 22));
}
TEST(BlockSparseFfn, SwigluB128PaddingHalves) {
  REQUIRE_GPU();
  check_ffn(Problem(322, 256, 512, 5, 1, 128, Activation::swiglu, Routing::tail_halves, 23));
}
// Pairs of block rows sharing the expert's weights (block_row_pairs above), forward and backward:
// the SDDs with W read [k][n] (forward) and [n][k] (backward, two 128-row boxes a k-step), the DSDs
// likewise, SwiGLU's two-part DSD.
// The premise of the tests below: this routing's topology takes the pairs (no GPU needed).
TEST(BlockSparseFfn, BlockRowPairsTaken) {
  EXPECT_TRUE(moe::cuda::block_row_pairs_share_weights(16, 4)) << "block_row_pairs: 16 block rows (host bound), 4 experts";
  EXPECT_FALSE(moe::cuda::block_row_pairs_share_weights(7, 5)) << "tail_halves: 7 block rows (host bound), 5 experts";
}
TEST(BlockSparseFfn, GeluB128BlockRowPairs) {
  REQUIRE_GPU();
  const Problem p(1540, 256, 512, 4, 1, 128, Activation::gelu, Routing::block_row_pairs, 24);
  ASSERT_EQ(p.topology.block_rows, 15);
  ASSERT_TRUE(moe::cuda::block_row_pairs_share_weights(p.device.topology.max_block_rows, 4));
  check_ffn(p);
}
TEST(BlockSparseFfn, SwigluB128BlockRowPairs) {
  REQUIRE_GPU();
  check_ffn(Problem(1540, 256, 512, 4, 1, 128, Activation::swiglu, Routing::block_row_pairs, 25));
}

// ---- the stream-K tail (cuda/moe/tile_schedule.h) ----
// The schedule on the CPU: over all workers, every k-step of every tile is computed exactly once;
// a tile is whole in one worker, or (a tail tile) cut into 2 or 3 parts of consecutive k-steps,
// each part knowing how many there are, each leaving its sum in a slot of its own, and the tile
// naming exactly the workers that hold its parts; the tail is spread evenly, and none of its
// ranges is shorter than half a tile.
void check_schedule(int tiles, int workers, int k_steps, bool stream_k) {
  SCOPED_TRACE("tiles " + std::to_string(tiles) + ", workers " + std::to_string(workers) + ", k_steps " +
               std::to_string(k_steps) + (stream_k ? ", stream-K" : ""));
  std::vector<std::vector<int>> owner(size_t(tiles), std::vector<int>(size_t(k_steps), -1));
  std::vector<std::vector<moe::cuda::TileSegment>> parts{size_t(tiles)};
  std::vector<std::vector<int>> part_workers{size_t(tiles)};
  std::vector<int> steps_of(size_t(workers), 0), tail_steps_of(size_t(workers), 0);
  std::vector<int> slot_taken(size_t(2 * workers), 0);
  bool tail = false;
  for (int w = 0; w < workers; ++w) {
    moe::cuda::TileSchedule schedule(tiles, workers, w, k_steps, stream_k);
    tail = schedule.has_tail();
    moe::cuda::TileSegment s;
    while (schedule.next(s)) {
      ASSERT_GE(s.tile, 0);
      ASSERT_LT(s.tile, tiles);
      ASSERT_LT(s.k_begin, s.k_end);
      ASSERT_LE(s.k_end, k_steps);
      for (int k = s.k_begin; k < s.k_end; ++k) {
        ASSERT_EQ(owner[size_t(s.tile)][size_t(k)], -1) << "tile " << s.tile << " k-step " << k << " twice";
        owner[size_t(s.tile)][size_t(k)] = w;
      }
      parts[size_t(s.tile)].push_back(s);
      part_workers[size_t(s.tile)].push_back(w);
      steps_of[size_t(w)] += s.k_end - s.k_begin;
      if (s.tail_tile >= 0) tail_steps_of[size_t(w)] += s.k_end - s.k_begin;
      if (s.cut(k_steps)) {
        ASSERT_EQ(s.tile, tiles / workers * workers + s.tail_tile);
        const int slot = schedule.part_slot(w, s.tail_tile);
        ASSERT_GE(slot, 0);
        ASSERT_LT(slot, 2 * workers);
        EXPECT_EQ(slot_taken[size_t(slot)]++, 0) << "slot " << slot << " written by two parts";
      }
    }
  }
  EXPECT_EQ(tail, stream_k && k_steps > 1 && tiles % workers != 0);
  for (int t = 0; t < tiles; ++t) {
    for (int k = 0; k < k_steps; ++k) ASSERT_NE(owner[size_t(t)][size_t(k)], -1) << "tile " << t << " k-step " << k;
    const auto& p = parts[size_t(t)];
    if (p.size() == 1) {
      EXPECT_FALSE(p[0].cut(k_steps)) << "whole tile " << t;
      continue;
    }
    ASSERT_LE(p.size(), 3u) << "tile " << t << " is cut into more than three parts";
    const moe::cuda::TileSchedule any(tiles, workers, 0, k_steps, stream_k);  // what the last part reads
    for (const auto& part : p) EXPECT_TRUE(part.cut(k_steps)) << "tile " << t;
    EXPECT_EQ(any.parts(p[0].tail_tile), int(p.size())) << "tile " << t;
    std::vector<int> named;
    for (int v = any.first_worker(p[0].tail_tile); v <= any.last_worker(p[0].tail_tile); ++v)
      if (any.has_steps(v)) named.push_back(v);
    EXPECT_EQ(named, part_workers[size_t(t)]) << "tile " << t;
  }
  const int rounds = tiles / workers;
  const auto high = *std::max_element(steps_of.begin(), steps_of.end());
  if (tail) {  // the tail's k-steps spread evenly over min(workers, 2 x its tiles) workers
    const int tail_tiles = tiles - rounds * workers, tail_workers = std::min(workers, 2 * tail_tiles);
    EXPECT_EQ(high, rounds * k_steps + (tail_tiles * k_steps + tail_workers - 1) / tail_workers);
    for (int w = 0; w < workers; ++w)
      if (tail_steps_of[size_t(w)] > 0) {
        EXPECT_GE(tail_steps_of[size_t(w)], k_steps / 2) << "worker " << w;
      }
  } else {
    EXPECT_EQ(high, (rounds + (tiles % workers != 0)) * k_steps);
  }
}
TEST(TileSchedule, StreamKTailCoversEveryKStepOnce) {
  check_schedule(1136, 66, 128, true);  // D=2048 Zipf's forward DSD: 17.2 rounds, 14 tiles in the tail
  check_schedule(620, 132, 64, true);   // D=1024 Zipf's: 4.7 rounds
  check_schedule(16, 3, 8, true);
  check_schedule(7, 4, 5, true);        // less than two rounds
  check_schedule(3, 4, 7, true);        // less than one round: it is all tail
  check_schedule(1, 132, 128, true);    // one tile over two workers
  check_schedule(131, 132, 3, true);    // k_steps < workers: some ranges as long as a tile
  check_schedule(1000, 132, 4, true);
}
TEST(TileSchedule, WholeTilesWithoutATail) {
  check_schedule(1024, 64, 32, true);   // whole rounds: nothing to even out
  check_schedule(5, 4, 1, true);        // one k-step a tile: nothing to cut
  check_schedule(1136, 66, 128, false);
  check_schedule(9, 1, 16, true);       // one worker
}

// The DSDs of the FFN and of the products on a persistent grid capped at a few clusters
// (set_persistent_worker_cap), so that small problems end in a stream-K tail: forward and backward
// DSD, SwiGLU's two-part one too, in pairs of block rows (block_row_pairs: 15 block rows, 8 pairs).
// Each test first works out on the host how many parts its forward DSD cuts a tile into.
struct PersistentWorkerCap {
  explicit PersistentWorkerCap(int workers) { moe::cuda::set_persistent_worker_cap(workers); }
  ~PersistentWorkerCap() { moe::cuda::set_persistent_worker_cap(0); }
};
int forward_dsd_tail_parts(int D, int H, int block_rows, int clusters) {
  const int tiles = D / 256 * ((block_rows + 1) / 2), k_steps = H / 64;
  const moe::cuda::TileSchedule schedule(tiles, clusters, 0, k_steps, true);
  int parts = 0;
  for (int t = 0; schedule.has_tail() && t < tiles % clusters; ++t) parts = std::max(parts, schedule.parts(t));
  return parts;
}
// The premise of the tests below (no GPU needed): 16 pair tiles over 3 clusters cut a tile in 2,
// 8 over 5 and 16 over 10 cut one in 3.
TEST(TileSchedule, StreamKTestsCutTiles) {
  EXPECT_EQ(forward_dsd_tail_parts(512, 512, 15, 3), 2);
  EXPECT_EQ(forward_dsd_tail_parts(256, 512, 15, 5), 3);
  EXPECT_EQ(forward_dsd_tail_parts(512, 512, 15, 10), 3);
}
TEST(BlockSparseFfn, GeluB128StreamKTail) {
  REQUIRE_GPU();
  const PersistentWorkerCap cap(3);
  check_ffn(Problem(1540, 512, 512, 4, 1, 128, Activation::gelu, Routing::block_row_pairs, 27));
}
TEST(BlockSparseFfn, SwigluB128StreamKTail) {
  REQUIRE_GPU();
  const PersistentWorkerCap cap(5);
  check_ffn(Problem(1540, 256, 512, 4, 1, 128, Activation::swiglu, Routing::block_row_pairs, 28));
}

// A wide model (D = 2048) at B = 128: on an H100/H200 every product copies its operands with TMA
// (as at every D there): per-expert tensor maps built on the device, 64-row boxes of x and of the
// blocks, W1 in [64 k][64 n] boxes, W2ᵀ and W1ᵀ (the backward's transposed reads) in [128 n][64 k]
// boxes, SwiGLU's two-part DSD, and many 64-wide boxes per row of x.
TEST(BlockSparseFfn, GeluB128WideModel) {
  REQUIRE_GPU();
  check_ffn(Problem(300, 2048, 512, 4, 2, 128, Activation::gelu, Routing::random, 19));
}
TEST(BlockSparseFfn, SwigluB128WideModelExpertWithNoTokens) {
  REQUIRE_GPU();
  check_ffn(Problem(260, 2048, 256, 4, 1, 128, Activation::swiglu, Routing::skip_one_expert, 20));
}

// The four public products on their own, on random sparse blocks (not an FFN's activations), with
// both layouts of the expert operand.
void check_products(int T, int D, int H, int E, int K, int B, uint64_t seed, Routing routing = Routing::random) {
  Problem p(T, D, H, E, K, B, Activation::gelu, routing, seed);
  const bool hopper = moe::cuda::current_device().compute_capability == 90;
  std::printf("T=%d D=%d H=%d E=%d K=%d B=%d rows=%ld nnz=%ld: %s\n", T, D, H, E, K, B, long(p.rows),
              long(p.topology.nnz),
              hopper && B == 128 && D % 128 == 0 ? "wgmma kernel (sm_90a build)" : "mma.sync kernel");
  std::mt19937_64 generator(seed + 100);
  const auto& t = p.device.topology;
  Matrix s = random_bf16_matrix(p.topology.nnz * B, B, generator, 1.0);
  // Padding rows are zero in every FFN operand, and the weight-gradient products skip them
  // (block_sparse.h): give S and dy zero padding rows, as an FFN's activations have.
  for (int64_t block = 0; block < p.topology.nnz; ++block)
    for (int64_t i = 0; i < B; ++i)
      if (p.plan.row_slot[size_t(p.topology.row_indices[size_t(block)] * B + i)] < 0) s.row(block * B + i).setZero();
  DeviceBuffer<bf16> s_device = poisoned_bf16(p.block_elements());
  {
    std::vector<bf16> host = s_device.download();
    for (int64_t i = 0; i < s.size(); ++i) host[size_t(i)] = __float2bfloat16(float(s.data()[i]));
    s_device.upload(host);
  }
  const ExpertWeights w1(p.w1), w2(p.w2);  // [D, H] and [H, D]
  const DeviceBuffer<bf16> x = upload_rows(p.permuted_x, p.max_rows), dy = upload_rows(p.d_out, p.max_rows);
  const Matrix w1_cat = moe::ref::concat_expert_columns(p.w1, 0, H), w2_cat = moe::ref::concat_expert_rows(p.w2);

  DeviceBuffer<bf16> blocks = poisoned_bf16(p.block_elements());
  moe::cuda::sdd(t, x.data(), D, moe::cuda::ExpertOperand{w1.table.data(), int(H), 0, false}, blocks.data());
  EXPECT_CLOSE(blocks.download(), moe::ref::sdd(p.permuted_x, w1_cat, p.topology), "sdd x W1");

  blocks.fill_bytes(0xFF);
  moe::cuda::sdd(t, dy.data(), D, moe::cuda::ExpertOperand{w2.table.data(), int(D), 0, true}, blocks.data());
  EXPECT_CLOSE(blocks.download(), moe::ref::sdd(p.d_out, w2_cat.transpose(), p.topology), "sdd dy W2^T");

  DeviceBuffer<bf16> dense = poisoned_bf16(size_t(p.max_rows * D));
  moe::cuda::dsd(t, s_device.data(), moe::cuda::ExpertOperand{w2.table.data(), int(D), 0, false}, D, dense.data());
  auto dense_host = dense.download();
  EXPECT_CLOSE(dense_host, moe::ref::dsd(p.topology, s, false, w2_cat), "dsd S W2");
  expect_untouched(dense_host, size_t(p.rows * D), "dsd out");

  dense.fill_bytes(0xFF);
  moe::cuda::dsd(t, s_device.data(), moe::cuda::ExpertOperand{w1.table.data(), int(H), 0, true}, D, dense.data());
  EXPECT_CLOSE(dense.download(), moe::ref::dsd(p.topology, s, false, w1_cat.transpose()), "dsd S W1^T");

  ExpertFloats st_dy(E, size_t(H * D));
  moe::cuda::dsd_transposed(t, s_device.data(), dy.data(), D, st_dy.table.data(), D);
  const Matrix st_dy_gpu = st_dy.stacked(H, D);
  EXPECT_CLOSE(std::vector<float>(st_dy_gpu.data(), st_dy_gpu.data() + st_dy_gpu.size()),
               moe::ref::dsd(p.topology, s, true, p.d_out), "dsd_transposed S^T dy");

  ExpertFloats xt_s(E, size_t(D * H));
  moe::cuda::dds(t, x.data(), D, s_device.data(), xt_s.table.data(), H, 0);
  // ref::dds gives [D, E*H]; the GPU gives E x [D, H]: compare expert by expert.
  const Matrix ref = moe::ref::dds(p.permuted_x.transpose(), p.topology, s, false);
  Matrix ref_stacked(E * D, H);
  for (int e = 0; e < E; ++e) ref_stacked.middleRows(e * D, D) = ref.middleCols(e * H, H);
  const Matrix xt_s_gpu = xt_s.stacked(D, H);
  EXPECT_CLOSE(std::vector<float>(xt_s_gpu.data(), xt_s_gpu.data() + xt_s_gpu.size()), ref_stacked, "dds x^T S");

  // dds at column_offset `offset` of rows of H + offset: the used columns match, columns left of
  // the offset stay untouched (NaN).
  auto check_dds_at = [&](int offset) {
    ExpertFloats out(E, size_t(D * (H + offset)));
    moe::cuda::dds(t, x.data(), D, s_device.data(), out.table.data(), H + offset, offset);
    const Matrix gpu = out.stacked(D, H + offset);
    const Matrix used = gpu.middleCols(offset, H);
    const std::string what = "dds x^T S at column " + std::to_string(offset);
    EXPECT_CLOSE(std::vector<float>(used.data(), used.data() + used.size()), ref_stacked, what.c_str());
    EXPECT_TRUE(gpu.leftCols(offset).array().isNaN().all()) << what << ": wrote left of column_offset";
  };
  // Offset 2: outputs only 8-byte aligned, so the staged epilogue's fp32 stores must fall back from
  // 16 to 8 bytes (and on Hopper the weight gradients' TMA stores to the register epilogue).
  check_dds_at(2);
  // Offset 4: rows 16-byte aligned, but the tiles do not start on a 128-byte column group, so on
  // Hopper the weight gradients' TMA stores (which need one) give way to the register epilogue.
  check_dds_at(4);
}

TEST(BlockSparseProducts, B128) {
  REQUIRE_GPU();
  check_products(300, 256, 384, 3, 2, 128, 11);
}
TEST(BlockSparseProducts, B64) {
  REQUIRE_GPU();
  check_products(250, 192, 256, 5, 1, 64, 12);
}
// B = 128, D a multiple of 128 but not of 256: DSᵀD's and DDS's 128 x 128 wgmma tiles, with an
// expert that has no rows (its weight gradients must be written as zeros, from zero k-steps).
TEST(BlockSparseProducts, B128ExpertWithNoTokens) {
  REQUIRE_GPU();
  check_products(280, 384, 256, 4, 1, 128, 14, Routing::skip_one_expert);
}
// B = 128, every row in one expert (7 blocks: 14 k-steps of DSᵀD and DDS), the others empty.
TEST(BlockSparseProducts, B128OneExpertGetsAllTokens) {
  REQUIRE_GPU();
  check_products(800, 256, 384, 4, 1, 128, 15, Routing::all_to_one_expert);
}

// The products on their own with tail_halves routing: the SDDs' half-row tiles with the plain
// store epilogue and both layouts of the expert operand, into poisoned blocks (rows 64-127 of a
// half row must come out zero, and no column may be left out); the DSDs' whole tiles over rows of
// padding; the weight gradients' k-steps stopping at the last routed row.
TEST(BlockSparseProducts, B128PaddingHalves) {
  REQUIRE_GPU();
  check_products(322, 512, 512, 5, 1, 128, 16, Routing::tail_halves);
}
// The products on their own in pairs of block rows (block_row_pairs above), into poisoned outputs:
// a CTA that multiplies its peer's tile must store nothing, and no row past the used ones is written.
TEST(BlockSparseProducts, B128BlockRowPairs) {
  REQUIRE_GPU();
  check_products(1540, 512, 512, 4, 1, 128, 26, Routing::block_row_pairs);
}

// The weight gradients in pairs of tiles that share an operand (set_weight_gradient_pairs, the
// default) and one CTA a tile, into poisoned outputs. The premise: with block_row_pairs routing
// (BlockRowPairsTaken), at H = 512 (4 block columns an expert) both DSᵀD and DDS take pairs, at
// H = 256 only DSᵀD; at H = 384 neither. With an expert that has no rows, its pairs run no k-step
// and must still write zeros.
TEST(BlockSparseProducts, WeightGradientPairsTaken) {
  EXPECT_TRUE(moe::cuda::weight_gradient_pairs_fit(4, 1));
  EXPECT_TRUE(moe::cuda::weight_gradient_pairs_fit(4, 2));
  EXPECT_TRUE(moe::cuda::weight_gradient_pairs_fit(2, 1));
  EXPECT_FALSE(moe::cuda::weight_gradient_pairs_fit(2, 2));
  EXPECT_FALSE(moe::cuda::weight_gradient_pairs_fit(3, 1));
}
struct WeightGradientPairs {
  explicit WeightGradientPairs(bool enabled) { moe::cuda::set_weight_gradient_pairs(enabled); }
  ~WeightGradientPairs() { moe::cuda::set_weight_gradient_pairs(true); }
};
TEST(BlockSparseProducts, B128WeightGradientPairsAndSingleTiles) {
  REQUIRE_GPU();
  for (const bool pairs : {true, false}) {
    SCOPED_TRACE(pairs ? "pairs" : "one CTA a tile");
    const WeightGradientPairs setting(pairs);
    check_products(1540, 512, 512, 4, 1, 128, 30, Routing::block_row_pairs);  // 4 block columns an expert
    check_products(1540, 256, 256, 4, 1, 128, 31, Routing::block_row_pairs);  // 2: DSᵀD pairs, DDS single
    check_products(1540, 512, 512, 4, 1, 128, 32, Routing::skip_one_expert);  // pairs of zero k-steps
  }
}

// Pairs of block rows (and of weight-gradient tiles) forced where the rule leaves them out
// (set_block_row_pairs_everywhere, moe_bench --block-row-pairs everywhere), random routing over 8
// experts, into poisoned outputs: at T = 700 every expert has one block row, so every pair straddles
// two experts (each CTA copies its own B) and the pairs past the device's 8 block rows (the host
// bound is 13) run nothing; at T = 1020, 13 block rows (5 experts with two), some pairs share an
// expert's weights and the odd last block row pairs with one past the count (multiplied, not stored).
struct BlockRowPairsEverywhere {
  BlockRowPairsEverywhere() { moe::cuda::set_block_row_pairs_everywhere(true); }
  ~BlockRowPairsEverywhere() { moe::cuda::set_block_row_pairs_everywhere(false); }
};
TEST(BlockSparseProducts, B128BlockRowPairsEverywhere) {
  REQUIRE_GPU();
  ASSERT_FALSE(moe::cuda::block_row_pairs_share_weights((1020 + 8 * 127) / 128, 8)) << "the rule would take pairs";
  const BlockRowPairsEverywhere everywhere;
  check_products(700, 512, 512, 8, 1, 128, 34);
  check_products(1020, 512, 512, 8, 1, 128, 34);
}

// The products on a grid of 3 and of 10 clusters: the DSDs end in a stream-K tail of 2 and 3 parts a tile.
TEST(BlockSparseProducts, B128StreamKTail) {
  REQUIRE_GPU();
  for (const int clusters : {3, 10}) {
    SCOPED_TRACE(std::to_string(clusters) + " clusters");
    const PersistentWorkerCap cap(clusters);
    check_products(1540, 512, 512, 4, 1, 128, 29, Routing::block_row_pairs);
  }
}

// The products of a wide model (D = 2048), on random blocks.
TEST(BlockSparseProducts, B128WideModel) {
  REQUIRE_GPU();
  check_products(300, 2048, 512, 3, 2, 128, 21);
}

// ---- bad input: refused on the host, before any launch ----
TEST(BlockSparseBadInput, SizesAndPointers) {
  REQUIRE_GPU();
  Problem p(100, 128, 128, 2, 1, 64, Activation::gelu, Routing::random, 13);
  const ExpertWeights w1(p.w1), w2(p.w2);
  const DeviceBuffer<bf16> x = upload_rows(p.permuted_x, p.max_rows);
  DeviceBuffer<bf16> pre(p.block_elements()), hidden(p.block_elements()), out(size_t(p.max_rows * 128));
  moe::cuda::BlockSparseFfnOutputs outputs{pre.data(), nullptr, hidden.data(), out.data()};
  auto forward = [&](const MoeConfig& c, const bf16* input, const moe::cuda::DeviceTopology& t) {
    moe::cuda::block_sparse_ffn_forward(c, t, input, w1.table.data(), w2.table.data(), outputs);
  };
  MoeConfig bad_d = p.config;
  bad_d.model_dim = 100;  // not a multiple of B = 64
  EXPECT_THROW(forward(bad_d, x.data(), p.device.topology), std::invalid_argument);
  MoeConfig bad_h = p.config;
  bad_h.hidden_dim = 96;
  EXPECT_THROW(forward(bad_h, x.data(), p.device.topology), std::invalid_argument);
  EXPECT_THROW(forward(p.config, nullptr, p.device.topology), std::invalid_argument);
  moe::cuda::DeviceTopology no_offsets = p.device.topology;
  no_offsets.offsets = nullptr;
  EXPECT_THROW(forward(p.config, x.data(), no_offsets), std::invalid_argument);
  moe::cuda::DeviceTopology odd_block = p.device.topology;
  odd_block.block_size = 32;
  EXPECT_THROW(forward(p.config, x.data(), odd_block), std::invalid_argument);
  EXPECT_THROW(moe::cuda::sdd(p.device.topology, x.data(), 100,
                              moe::cuda::ExpertOperand{w1.table.data(), 128, 0, false}, pre.data()),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::sdd(p.device.topology, x.data(), 128, moe::cuda::ExpertOperand{}, pre.data()),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::dsd(p.device.topology, pre.data(),
                              moe::cuda::ExpertOperand{w2.table.data(), 128, 0, false}, 128, nullptr),
               std::invalid_argument);
  // Gathered rows where the kernels cannot gather (B = 64 here, on any GPU): refused, with the way out.
  const DeviceBuffer<int> row_slot(std::vector<int>(size_t(p.max_rows), -1));
  moe::cuda::ExpertRows gathered(x.data());
  gathered.row_slot = row_slot.data();
  try {
    moe::cuda::block_sparse_ffn_forward(p.config, p.device.topology, gathered, w1.table.data(), w2.table.data(),
                                        outputs);
    ADD_FAILURE() << "gathered rows at B = 64 were accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("permute_tokens"), std::string::npos) << error.what();
  }
  // Gathered rows that do not match the config (K, T): refused where the kernels could gather.
  Problem wide(300, 256, 256, 4, 2, 128, Activation::gelu, Routing::random, 14);
  if (moe::cuda::rows_gatherable(wide.config)) {
    const ExpertWeights wide_w1(wide.w1), wide_w2(wide.w2);
    const DeviceBuffer<bf16> wide_x = upload_rows(wide.x, wide.x.rows());
    const DeviceBuffer<int> wide_slots(std::vector<int>(size_t(wide.max_rows), -1));
    DeviceBuffer<bf16> wide_pre(wide.block_elements()), wide_hidden(wide.block_elements());
    DeviceBuffer<bf16> wide_out(size_t(wide.max_rows * 256));
    const moe::cuda::BlockSparseFfnOutputs wide_outputs{wide_pre.data(), nullptr, wide_hidden.data(), wide_out.data()};
    auto gathered_message = [&](int top_k, int tokens) {
      moe::cuda::ExpertRows rows(wide_x.data());
      rows.row_slot = wide_slots.data();
      rows.top_k = top_k;
      rows.tokens = tokens;
      try {
        moe::cuda::block_sparse_ffn_forward(wide.config, wide.device.topology, rows, wide_w1.table.data(),
                                            wide_w2.table.data(), wide_outputs);
      } catch (const std::invalid_argument& error) {
        return std::string(error.what());
      }
      return std::string("no error");
    };
    EXPECT_NE(gathered_message(1, 300).find("top_k"), std::string::npos) << gathered_message(1, 300);
    EXPECT_NE(gathered_message(2, 299).find("tokens"), std::string::npos) << gathered_message(2, 299);
    EXPECT_EQ(gathered_message(2, 300), "no error");
  }
  // The weight gradients in fp32 and bf16 at once: refused with what to set. (Neither is allowed: the
  // micro-batches' one weight-gradient product, tests/cuda/test_micro_batches.cpp.)
  const DeviceBuffer<bf16> d_out = upload_rows(p.d_out, p.max_rows);
  DeviceBuffer<bf16> d_pre(p.block_elements()), d_x(size_t(p.max_rows * 128));
  ExpertFloats d_w1(2, 128 * 128), d_w2(2, 128 * 128);
  DeviceBuffer<bf16> d_w_bf16(size_t(2 * 128 * 128));
  const auto bf16_table = moe::cuda::expert_pointer_table(d_w_bf16.data(), 2, size_t(128 * 128));
  auto backward_message = [&](const moe::cuda::BlockSparseFfnGradients& g) {
    try {
      moe::cuda::block_sparse_ffn_backward(p.config, p.device.topology, x.data(), w1.table.data(), w2.table.data(),
                                           outputs, d_out.data(), g);
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  moe::cuda::BlockSparseFfnGradients both{d_pre.data(), nullptr, d_x.data(), d_w1.table.data(), d_w2.table.data()};
  both.d_w1_bf16 = bf16_table.data();
  both.d_w2_bf16 = bf16_table.data();
  EXPECT_NE(backward_message(both).find("not both"), std::string::npos) << backward_message(both);
  // Nothing was launched: the device is still healthy.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
