// model/attention.cu: causal multi-head attention, forward and backward: the projections on cuBLAS, and
// the core fused (model/flash_attention.h) or unfused, on cuBLAS batched products and our own causal
// softmax kernels (see model/attention.h).
#include "model/attention.h"

#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/gemm.h"           // gemm, gemm_batched, CUBLAS_CHECK
#include "core/launch_checks.h"  // check_not_null, check_range
#include "core/warp_reduce.cuh"  // warp_sum, warp_max
#include "model/flash_attention.h"  // flash_attention_forward, flash_attention_backward, flash_attention_supports

namespace moe::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;  // softmax rows per block

// ---- operand pointers ----

// Where operand b = n * heads + h of one batched product lives: base + n * sequence + h * head (bytes).
struct PointerPattern {
  const char* base = nullptr;
  int64_t sequence_stride = 0;
  int64_t head_stride = 0;
};

struct PointerPatterns {
  PointerPattern array[kAttentionPointerArrays];
};

enum Slot { kQ, kK, kV, kScores, kProbs, kContext, kDScores, kDQ, kDK, kDV };

// Block (b slice, array): one thread per pointer.
__global__ void fill_pointers_kernel(PointerPatterns patterns, int64_t batch_heads, int64_t num_heads,
                                     const char** out) {
  const int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (b >= batch_heads) return;
  const PointerPattern p = patterns.array[blockIdx.y];
  out[blockIdx.y * batch_heads + b] = p.base + (b / num_heads) * p.sequence_stride + (b % num_heads) * p.head_stride;
}

// ---- causal softmax ----

// One warp per row i of one [S, S] score matrix: row i sees columns 0..i; the rest of the row is
// written as zeros, so the following full-size product adds nothing from the future.
__global__ void causal_softmax_kernel(const float* scores, bf16* probs, int64_t rows, int64_t seq_len, float scale) {
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % seq_len;
  const float* in = scores + row * seq_len;
  bf16* out = probs + row * seq_len;
  float row_max = -INFINITY;
  for (int64_t j = lane; j <= i; j += 32) row_max = fmaxf(row_max, in[j]);
  row_max = detail::warp_max(row_max);  // finite: column 0 is always visible
  float sum = 0.0f;
  for (int64_t j = lane; j <= i; j += 32) sum += expf((in[j] - row_max) * scale);
  const float inverse_sum = 1.0f / detail::warp_sum(sum);
  for (int64_t j = lane; j < seq_len; j += 32) {  // the scores above the diagonal are never read
    float p = 0.0f;
    if (j <= i) p = expf((in[j] - row_max) * scale) * inverse_sum;
    out[j] = __float2bfloat16(p);
  }
}

// d_scores = scale * probs .* (d_probs - <probs, d_probs>) over the visible columns, zeros above.
__global__ void causal_softmax_backward_kernel(const bf16* probs, const float* d_probs, bf16* d_scores, int64_t rows,
                                               int64_t seq_len, float scale) {
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % seq_len;
  const bf16* p = probs + row * seq_len;
  const float* dp = d_probs + row * seq_len;
  float inner = 0.0f;
  for (int64_t j = lane; j <= i; j += 32) inner += __bfloat162float(p[j]) * dp[j];
  inner = detail::warp_sum(inner);
  bf16* out = d_scores + row * seq_len;
  for (int64_t j = lane; j < seq_len; j += 32) {
    out[j] = __float2bfloat16(j <= i ? scale * __bfloat162float(p[j]) * (dp[j] - inner) : 0.0f);
  }
}

// ---- host helpers ----

struct Sizes {  // the shape as the int arguments cuBLAS takes
  int tokens, seq_len, model_dim, head_dim, batch_heads;
  int64_t num_heads;
  float scale;
};

Sizes sizes_of(const AttentionShape& s) {
  Sizes z{};
  z.tokens = static_cast<int>(s.batch * s.seq_len);
  z.seq_len = static_cast<int>(s.seq_len);
  z.model_dim = static_cast<int>(s.model_dim);
  z.head_dim = static_cast<int>(s.model_dim / s.num_heads);
  z.batch_heads = static_cast<int>(s.batch * s.num_heads);
  z.num_heads = s.num_heads;
  z.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(z.head_dim)));
  return z;
}

template <typename T>
PointerPattern pattern(const T* base, int64_t sequence_stride, int64_t head_stride) {  // strides in elements
  return {reinterpret_cast<const char*>(base), sequence_stride * int64_t{sizeof(T)}, head_stride * int64_t{sizeof(T)}};
}

// Slots first, first + 1, first + 2: the Q, K and V heads of a [T, 3D] matrix (qkv or d_qkv).
void set_qkv_heads(PointerPatterns& p, Slot first, const bf16* qkv, const Sizes& z) {
  const int64_t sequence = int64_t{z.seq_len} * 3 * z.model_dim;
  for (int part = 0; part < 3; ++part) p.array[first + part] = pattern(qkv + part * z.model_dim, sequence, z.head_dim);
}

// An [N, heads, S, S] tensor (scores, probabilities and their gradients): one S x S square a head.
template <typename T>
PointerPattern squares(const T* base, const Sizes& z) {
  const int64_t square = int64_t{z.seq_len} * z.seq_len;
  return pattern(base, z.num_heads * square, square);
}

// A [T, D] matrix by heads (the context, or its gradient).
PointerPattern head_columns(const bf16* base, const Sizes& z) {
  return pattern(base, int64_t{z.seq_len} * z.model_dim, z.head_dim);
}

void fill_pointers(const PointerPatterns& patterns, int arrays, const Sizes& z, AttentionWorkspace& workspace,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((z.batch_heads + 127) / 128), static_cast<unsigned>(arrays));
  fill_pointers_kernel<<<grid, 128, 0, stream>>>(patterns, z.batch_heads, z.num_heads,
                                                 static_cast<const char**>(static_cast<void*>(workspace.pointers.data())));
  CUDA_CHECK(cudaGetLastError());
}

// The pointer array of one slot, typed as the gemm_batched argument it feeds.
template <typename T>
T* const* slot(AttentionWorkspace& workspace, Slot s) {
  return reinterpret_cast<T* const*>(workspace.pointers.data() + size_t(s) * size_t(workspace.shape.batch) *
                                                                     size_t(workspace.shape.num_heads));
}

unsigned softmax_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

void check_workspace(const char* function, const AttentionShape& shape, const AttentionWorkspace& workspace) {
  const AttentionShape& w = workspace.shape;
  if (w.batch != shape.batch || w.seq_len != shape.seq_len || w.model_dim != shape.model_dim ||
      w.num_heads != shape.num_heads) {
    throw std::invalid_argument(std::string(function) + ": the workspace was made for N = " + std::to_string(w.batch) +
                                ", S = " + std::to_string(w.seq_len) + ", D = " + std::to_string(w.model_dim) +
                                ", heads = " + std::to_string(w.num_heads) + "; the call has N = " +
                                std::to_string(shape.batch) + ", S = " + std::to_string(shape.seq_len) +
                                ", D = " + std::to_string(shape.model_dim) + ", heads = " +
                                std::to_string(shape.num_heads) + "; expected the same shape");
  }
}

}  // namespace

void check_attention_shape(const char* function, const AttentionShape& shape) {
  detail::check_range(function, "batch", shape.batch, 1, int64_t{1} << 20);
  detail::check_range(function, "seq_len", shape.seq_len, 1, int64_t{1} << 15, "[S, S] scores per head");
  detail::check_range(function, "model_dim", shape.model_dim, 1, int64_t{1} << 16);
  detail::check_range(function, "num_heads", shape.num_heads, 1, shape.model_dim, "model_dim");
  if (shape.model_dim % shape.num_heads != 0) {
    throw std::invalid_argument(std::string(function) + ": num_heads = " + std::to_string(shape.num_heads) +
                                " does not divide model_dim = " + std::to_string(shape.model_dim) +
                                "; expected a divisor of model_dim");
  }
  detail::check_range(function, "batch * seq_len", shape.batch * shape.seq_len, 1, (int64_t{1} << 31) - 1,
                      "cuBLAS int row counts");
  detail::check_range(function, "batch * num_heads * seq_len", shape.batch * shape.num_heads * shape.seq_len, 1,
                      (int64_t{1} << 31) - 1, "softmax rows");
  detail::check_range(function, "3 * model_dim * batch * seq_len", 3 * shape.model_dim * shape.batch * shape.seq_len, 1,
                      int64_t{1} << 40, "qkv entries");
}

namespace {

// The checks both passes open with, in order: the shape, the workspace made for it, the pointers
// both passes take, then the pass's own pointers. Returns the sizes.
Sizes checked_sizes(const char* function, const AttentionShape& shape, const AttentionWorkspace& workspace,
                    cublasHandle_t handle, const bf16* x, const bf16* qkv_weights, const bf16* out_weights,
                    const bf16* qkv, const AttentionSaved& saved, const bf16* context,
                    std::initializer_list<detail::NamedPointer> own) {
  check_attention_shape(function, shape);
  check_workspace(function, shape, workspace);
  detail::check_not_null(function, {{"handle", handle}, {"x", x}, {"qkv_weights", qkv_weights},
                                    {"out_weights", out_weights}, {"qkv", qkv}, {"context", context}});
  if (workspace.core == AttentionCore::fused) {
    detail::check_not_null(function, {{"saved.log_sum_exp (the fused core's)", saved.log_sum_exp}});
  } else {
    detail::check_not_null(function, {{"saved.probs (the unfused core's)", saved.probs}});
  }
  detail::check_not_null(function, own);
  return sizes_of(shape);
}

}  // namespace

const char* attention_core_name(AttentionCore core) {
  switch (core) {
    case AttentionCore::automatic: return "auto";
    case AttentionCore::fused: return "fused";
    case AttentionCore::unfused: return "unfused";
  }
  return "?";
}

AttentionCore resolve_attention_core(const AttentionShape& shape, AttentionCore core) {
  check_attention_shape("resolve_attention_core", shape);
  const int64_t head_dim = shape.model_dim / shape.num_heads;
  if (core == AttentionCore::automatic) {
    return flash_attention_supports(head_dim) ? AttentionCore::fused : AttentionCore::unfused;
  }
  if (core == AttentionCore::fused && !flash_attention_supports(head_dim)) {
    throw std::invalid_argument("the fused attention core has no kernels for head width D / heads = " +
                                std::to_string(head_dim) + " (D = " + std::to_string(shape.model_dim) + ", heads = " +
                                std::to_string(shape.num_heads) + "); allowed: 32, 64, 128, or the unfused core");
  }
  return core;
}

AttentionSavedBuffer::AttentionSavedBuffer(const AttentionShape& s, AttentionCore core)
    : rows_per_sequence_(s.num_heads * s.seq_len), squares_per_sequence_(s.num_heads * s.seq_len * s.seq_len) {
  if (resolve_attention_core(s, core) == AttentionCore::fused) {
    log_sum_exp_ = DeviceBuffer<float>(size_t(s.batch * rows_per_sequence_));
  } else {
    probs_ = DeviceBuffer<bf16>(size_t(s.batch * squares_per_sequence_));
  }
}

AttentionSaved AttentionSavedBuffer::at(int64_t first_sequence) {
  AttentionSaved saved;
  if (log_sum_exp_.size() > 0) saved.log_sum_exp = log_sum_exp_.data() + first_sequence * rows_per_sequence_;
  if (probs_.size() > 0) saved.probs = probs_.data() + first_sequence * squares_per_sequence_;
  return saved;
}

void AttentionSavedBuffer::fill_bytes(int byte, cudaStream_t stream) {
  if (log_sum_exp_.size() > 0) log_sum_exp_.fill_bytes(byte, stream);
  if (probs_.size() > 0) probs_.fill_bytes(byte, stream);
}

AttentionWorkspace::AttentionWorkspace(const AttentionShape& s, AttentionCore requested)
    : shape((check_attention_shape("AttentionWorkspace", s), s)),
      core(resolve_attention_core(s, requested)),
      d_context(size_t(s.batch * s.seq_len * s.model_dim)),
      d_qkv(size_t(s.batch * s.seq_len * 3 * s.model_dim)) {
  const size_t squares = size_t(s.batch * s.num_heads * s.seq_len * s.seq_len);
  if (core == AttentionCore::fused) {
    delta = DeviceBuffer<float>(size_t(s.batch * s.num_heads * s.seq_len));
  } else {
    scores = DeviceBuffer<float>(squares);
    d_scores = DeviceBuffer<bf16>(squares);
    pointers = DeviceBuffer<void*>(size_t(kAttentionPointerArrays * s.batch * s.num_heads));
  }
}

namespace {

// The unfused core's forward: scores, causal softmax, context, from qkv.
void unfused_core_forward(cublasHandle_t handle, const bf16* qkv, bf16* probs, bf16* context, const Sizes& z,
                          AttentionWorkspace& workspace, cudaStream_t stream) {
  const int D = z.model_dim, S = z.seq_len, d = z.head_dim;
  PointerPatterns p{};
  set_qkv_heads(p, kQ, qkv, z);
  p.array[kScores] = squares(workspace.scores.data(), z);
  p.array[kProbs] = squares(probs, z);
  p.array[kContext] = head_columns(context, z);
  fill_pointers(p, kContext + 1, z, workspace, stream);

  // scores_b [S, S] = Q_b [S, d] K_bᵀ, fp32 out
  gemm_batched(handle, Op::none, Op::transpose, S, S, d, slot<const bf16>(workspace, kQ), 3 * D,
               slot<const bf16>(workspace, kK), 3 * D, slot<float>(workspace, kScores), S, z.batch_heads);
  const int64_t rows = int64_t{z.batch_heads} * S;
  causal_softmax_kernel<<<softmax_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(workspace.scores.data(), probs, rows,
                                                                                  S, z.scale);
  CUDA_CHECK(cudaGetLastError());
  // context_b [S, d] = probs_b [S, S] V_b [S, d], written into its head's columns of context
  gemm_batched(handle, Op::none, Op::none, S, d, S, slot<const bf16>(workspace, kProbs), S,
               slot<const bf16>(workspace, kV), 3 * D, slot<bf16>(workspace, kContext), D, z.batch_heads);
}

// The unfused core's backward: d_qkv from qkv, probs and d_context.
void unfused_core_backward(cublasHandle_t handle, const bf16* qkv, const bf16* probs, const bf16* d_context,
                           bf16* d_qkv, const Sizes& z, AttentionWorkspace& workspace, cudaStream_t stream) {
  const int D = z.model_dim, S = z.seq_len, d = z.head_dim;
  PointerPatterns p{};
  set_qkv_heads(p, kQ, qkv, z);
  p.array[kScores] = squares(workspace.scores.data(), z);  // d_probs
  p.array[kProbs] = squares(probs, z);
  p.array[kContext] = head_columns(d_context, z);
  p.array[kDScores] = squares(workspace.d_scores.data(), z);
  set_qkv_heads(p, kDQ, d_qkv, z);
  fill_pointers(p, kAttentionPointerArrays, z, workspace, stream);

  // d_probs_b [S, S] = d_context_b [S, d] V_bᵀ (fp32);  d_V_b [S, d] = probs_bᵀ d_context_b
  gemm_batched(handle, Op::none, Op::transpose, S, S, d, slot<const bf16>(workspace, kContext), D,
               slot<const bf16>(workspace, kV), 3 * D, slot<float>(workspace, kScores), S, z.batch_heads);
  gemm_batched(handle, Op::transpose, Op::none, S, d, S, slot<const bf16>(workspace, kProbs), S,
               slot<const bf16>(workspace, kContext), D, slot<bf16>(workspace, kDV), 3 * D, z.batch_heads);
  const int64_t rows = int64_t{z.batch_heads} * S;
  causal_softmax_backward_kernel<<<softmax_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(
      probs, workspace.scores.data(), workspace.d_scores.data(), rows, S, z.scale);
  CUDA_CHECK(cudaGetLastError());
  // d_Q_b [S, d] = d_scores_b K_b;  d_K_b [S, d] = d_scores_bᵀ Q_b
  gemm_batched(handle, Op::none, Op::none, S, d, S, slot<const bf16>(workspace, kDScores), S,
               slot<const bf16>(workspace, kK), 3 * D, slot<bf16>(workspace, kDQ), 3 * D, z.batch_heads);
  gemm_batched(handle, Op::transpose, Op::none, S, d, S, slot<const bf16>(workspace, kDScores), S,
               slot<const bf16>(workspace, kQ), 3 * D, slot<bf16>(workspace, kDK), 3 * D, z.batch_heads);
}

}  // namespace

void attention_forward(cublasHandle_t handle, const AttentionShape& shape, const bf16* x, const bf16* qkv_weights,
                       const bf16* out_weights, bf16* qkv, AttentionSaved saved, bf16* context, bf16* out,
                       AttentionWorkspace& workspace, cudaStream_t stream) {
  const Sizes z = checked_sizes("attention_forward", shape, workspace, handle, x, qkv_weights, out_weights, qkv, saved,
                                context, {{"out", out}});
  const int D = z.model_dim;
  CUBLAS_CHECK(cublasSetStream(handle, stream));

  gemm(handle, Op::none, Op::none, z.tokens, 3 * D, D, x, D, qkv_weights, 3 * D, qkv, 3 * D);
  if (workspace.core == AttentionCore::fused) {
    flash_attention_forward(shape, qkv, context, saved.log_sum_exp, stream);
  } else {
    unfused_core_forward(handle, qkv, saved.probs, context, z, workspace, stream);
  }
  gemm(handle, Op::none, Op::none, z.tokens, D, D, context, D, out_weights, D, out, D);
}

void attention_backward(cublasHandle_t handle, const AttentionShape& shape, const bf16* x, const bf16* qkv_weights,
                        const bf16* out_weights, const bf16* qkv, AttentionSaved saved, const bf16* context,
                        const bf16* d_out, float* d_qkv_weights, float* d_out_weights, float* dx,
                        AttentionWorkspace& workspace, cudaStream_t stream) {
  const Sizes z = checked_sizes("attention_backward", shape, workspace, handle, x, qkv_weights, out_weights, qkv, saved,
                                context, {{"d_out", d_out}, {"d_qkv_weights", d_qkv_weights},
                                          {"d_out_weights", d_out_weights}, {"dx", dx}});
  const int D = z.model_dim;
  bf16* d_context = workspace.d_context.data();
  bf16* d_qkv = workspace.d_qkv.data();
  CUBLAS_CHECK(cublasSetStream(handle, stream));

  // d_out_weights [D, D] = contextᵀ d_out;  d_context [T, D] = d_out out_weightsᵀ
  gemm(handle, Op::transpose, Op::none, D, D, z.tokens, context, D, d_out, D, d_out_weights, D, 1.0f, 0.0f, true);
  gemm(handle, Op::none, Op::transpose, z.tokens, D, D, d_out, D, out_weights, D, d_context, D);

  if (workspace.core == AttentionCore::fused) {
    flash_attention_backward(shape, qkv, context, saved.log_sum_exp, d_context, workspace.delta.data(), d_qkv, stream);
  } else {
    unfused_core_backward(handle, qkv, saved.probs, d_context, d_qkv, z, workspace, stream);
  }

  // d_qkv_weights [D, 3D] = xᵀ d_qkv;  dx [T, D] = d_qkv qkv_weightsᵀ
  gemm(handle, Op::transpose, Op::none, D, 3 * D, z.tokens, x, D, d_qkv, 3 * D, d_qkv_weights, 3 * D, 1.0f, 0.0f,
       true);
  gemm(handle, Op::none, Op::transpose, z.tokens, D, 3 * D, d_qkv, 3 * D, qkv_weights, 3 * D, dx, D, 1.0f, 0.0f,
       true);
}

}  // namespace moe::cuda
