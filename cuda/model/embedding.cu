// embedding.cu: token + position embedding forward and the deterministic backward (see embedding.h).
#include "model/embedding.h"

#include <cmath>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/elementwise.h"     // grid_stride_blocks
#include "core/launch_checks.h"  // check_not_null, check_range

namespace moe::cuda {

namespace {

constexpr int kThreads = 256;  // threads per block; also the token tile of the backward's scan

__global__ void embedding_forward_kernel(const int32_t* tokens, const bf16* token_embedding,
                                         const bf16* position_embedding, bf16* x, int64_t tokens_total,
                                         int64_t seq_len, int64_t model_dim, const int32_t* first_position) {
  const int64_t count = tokens_total * model_dim;
  if (first_position != nullptr) position_embedding += int64_t{*first_position} * model_dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / model_dim, j = i % model_dim;
    const int32_t byte = tokens[t];
    float value = NAN;  // a byte outside the table poisons its row (embedding.h)
    if (byte >= 0 && byte < kEmbeddingVocabulary) {
      value = __bfloat162float(token_embedding[int64_t{byte} * model_dim + j]) +
              __bfloat162float(position_embedding[(t % seq_len) * model_dim + j]);
    }
    x[i] = __float2bfloat16(value);
  }
}

// Pass 1, block (v, column slice, segment): thread c owns column blockIdx.y * kThreads + c of byte v's
// partial over segment blockIdx.z, its kEmbeddingSegmentTokens tokens. Each thread tests kScanTokens
// consecutive tokens, the block compacts the matches into `rows` in ascending token order (a scan of
// the threads' counts), then every thread adds those rows' entries of its column, in that order.
// Segments spread a frequent byte over many SMs: with one block a byte walking all T tokens, the
// space's block alone read ~15% of dx through one SM, and the kernel took 0.25 ms at T = 16384,
// D = 512 on an H200 (moe_train --benchmark-kernel-trace, 2026-11-30).
constexpr int kScanTokens = int(kEmbeddingSegmentTokens) / kThreads;
static_assert(kScanTokens * kThreads == kEmbeddingSegmentTokens, "a segment is one scan of the block");

__global__ void embedding_token_partials_kernel(const int32_t* tokens, const float* dx, float* partials,
                                                int64_t tokens_total, int64_t model_dim) {
  __shared__ int64_t rows[kEmbeddingSegmentTokens];
  __shared__ int warp_counts[kThreads / 32];
  const int v = blockIdx.x;
  const int64_t column = int64_t{blockIdx.y} * kThreads + threadIdx.x;
  const int64_t first = int64_t{blockIdx.z} * kEmbeddingSegmentTokens + int64_t{threadIdx.x} * kScanTokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned matches = 0;  // bit i: token first + i is byte v
  for (int i = 0; i < kScanTokens; ++i) matches |= unsigned(first + i < tokens_total && tokens[first + i] == v) << i;
  const int mine = __popc(matches);
  int through_me = mine;  // inclusive scan of the warp's counts
  for (int width = 1; width < 32; width *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, through_me, width);
    if (lane >= width) through_me += other;
  }
  if (lane == 31) warp_counts[warp] = through_me;
  __syncthreads();
  int offset = through_me - mine, count = 0;  // matches before this thread's, and in the whole segment
  for (int w = 0; w < kThreads / 32; ++w) {
    offset += w < warp ? warp_counts[w] : 0;
    count += warp_counts[w];
  }
  for (int i = 0; i < kScanTokens; ++i) {
    if (matches >> i & 1u) rows[offset++] = first + i;
  }
  __syncthreads();
  if (column >= model_dim) return;
  float sum = 0.0f;
  for (int r = 0; r < count; ++r) sum += dx[rows[r] * model_dim + column];
  partials[(int64_t{blockIdx.z} * kEmbeddingVocabulary + v) * model_dim + column] = sum;
}

// Pass 2, block (v, column slice): the segments' partials added in segment order.
__global__ void embedding_token_finish_kernel(const float* partials, float* d_token_embedding, int64_t segments,
                                              int64_t model_dim, bool accumulate) {
  const int v = blockIdx.x;
  const int64_t column = int64_t{blockIdx.y} * kThreads + threadIdx.x;
  if (column >= model_dim) return;
  float sum = 0.0f;
  for (int64_t segment = 0; segment < segments; ++segment) {
    sum += partials[(segment * kEmbeddingVocabulary + v) * model_dim + column];
  }
  float* out = d_token_embedding + int64_t{v} * model_dim + column;
  *out = accumulate ? *out + sum : sum;
}

// Block (s, column slice): the sum over the N sequences, in order n = 0, 1, ...
__global__ void embedding_position_backward_kernel(const float* dx, float* d_position_embedding, int64_t batch,
                                                   int64_t seq_len, int64_t model_dim) {
  const int64_t s = blockIdx.x;
  const int64_t column = int64_t{blockIdx.y} * kThreads + threadIdx.x;
  if (column >= model_dim) return;
  float sum = 0.0f;
  for (int64_t n = 0; n < batch; ++n) sum += dx[(n * seq_len + s) * model_dim + column];
  d_position_embedding[s * model_dim + column] = sum;
}

void check_sizes(const char* function, int64_t batch, int64_t seq_len, int64_t model_dim) {
  detail::check_range(function, "batch", batch, 1, int64_t{1} << 24);
  detail::check_range(function, "seq_len", seq_len, 1, int64_t{1} << 20, "one grid row per position");
  detail::check_range(function, "model_dim", model_dim, 1, int64_t{65535} * kThreads,
                      "column slices of 256 in the grid's y dimension");
  detail::check_range(function, "batch * seq_len", batch * seq_len, 1, int64_t{65535} * kEmbeddingSegmentTokens,
                      "tokens: segments of 1024 in the grid's z dimension");
}

int64_t segments_of(int64_t tokens) { return (tokens + kEmbeddingSegmentTokens - 1) / kEmbeddingSegmentTokens; }


}  // namespace

void embedding_forward(const int32_t* tokens, const bf16* token_embedding, const bf16* position_embedding, bf16* x,
                       int64_t batch, int64_t seq_len, int64_t model_dim, cudaStream_t stream,
                       const int32_t* first_position) {
  constexpr const char* kFunction = "embedding_forward";
  check_sizes(kFunction, batch, seq_len, model_dim);
  detail::check_not_null(kFunction, {{"tokens", tokens}, {"token_embedding", token_embedding},
                                     {"position_embedding", position_embedding}, {"x", x}});
  const int64_t tokens_total = batch * seq_len;
  // Up to 8192 blocks: the grid-stride loop covers the rest.
  const unsigned blocks = grid_stride_blocks(static_cast<size_t>(tokens_total * model_dim), kThreads, 8192);
  embedding_forward_kernel<<<blocks, kThreads, 0, stream>>>(
      tokens, token_embedding, position_embedding, x, tokens_total, seq_len, model_dim, first_position);
  CUDA_CHECK(cudaGetLastError());
}

int64_t embedding_backward_scratch_floats(int64_t tokens, int64_t model_dim) {
  return segments_of(tokens) * kEmbeddingVocabulary * model_dim;
}

void embedding_backward(const int32_t* tokens, const float* dx, float* d_token_embedding,
                        float* d_position_embedding, float* scratch, int64_t batch, int64_t seq_len,
                        int64_t model_dim, bool accumulate_token_gradient, cudaStream_t stream) {
  constexpr const char* kFunction = "embedding_backward";
  check_sizes(kFunction, batch, seq_len, model_dim);
  detail::check_not_null(kFunction, {{"tokens", tokens}, {"dx", dx}, {"d_token_embedding", d_token_embedding},
                                     {"d_position_embedding", d_position_embedding}, {"scratch", scratch}});
  const unsigned column_slices = static_cast<unsigned>((model_dim + kThreads - 1) / kThreads);
  const int64_t segments = segments_of(batch * seq_len);
  embedding_token_partials_kernel<<<dim3(kEmbeddingVocabulary, column_slices, static_cast<unsigned>(segments)),
                                    kThreads, 0, stream>>>(tokens, dx, scratch, batch * seq_len, model_dim);
  CUDA_CHECK(cudaGetLastError());
  embedding_token_finish_kernel<<<dim3(kEmbeddingVocabulary, column_slices), kThreads, 0, stream>>>(
      scratch, d_token_embedding, segments, model_dim, accumulate_token_gradient);
  CUDA_CHECK(cudaGetLastError());
  embedding_position_backward_kernel<<<dim3(static_cast<unsigned>(seq_len), column_slices), kThreads, 0, stream>>>(
      dx, d_position_embedding, batch, seq_len, model_dim);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
