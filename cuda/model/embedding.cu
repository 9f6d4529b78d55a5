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

// Block (v, column slice): thread c owns column blockIdx.y * kThreads + c of byte v's gradient row.
// Per tile of kThreads tokens: each thread tests one token, the block compacts the matches into
// `rows` in ascending token order, then every thread adds those rows' entries of its column.
__global__ void embedding_token_backward_kernel(const int32_t* tokens, const float* dx, float* d_token_embedding,
                                                int64_t tokens_total, int64_t model_dim, bool accumulate) {
  __shared__ int64_t rows[kThreads];
  __shared__ int warp_counts[kThreads / 32];
  const int v = blockIdx.x;
  const int64_t column = int64_t{blockIdx.y} * kThreads + threadIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float sum = 0.0f;
  for (int64_t tile = 0; tile < tokens_total; tile += kThreads) {
    const int64_t t = tile + threadIdx.x;
    const bool match = t < tokens_total && tokens[t] == v;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, count = 0;  // matches before this warp, and in the whole tile
    for (int w = 0; w < kThreads / 32; ++w) {
      offset += w < warp ? warp_counts[w] : 0;
      count += warp_counts[w];
    }
    if (match) rows[offset + __popc(ballot & ((1u << lane) - 1u))] = t;
    __syncthreads();
    if (column < model_dim) {
      for (int r = 0; r < count; ++r) sum += dx[rows[r] * model_dim + column];
    }
    __syncthreads();  // rows and warp_counts are rewritten by the next tile
  }
  if (column < model_dim) {
    float* out = d_token_embedding + int64_t{v} * model_dim + column;
    *out = accumulate ? *out + sum : sum;
  }
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
  detail::check_range(function, "batch * seq_len", batch * seq_len, 1, int64_t{1} << 31, "tokens");
}


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

void embedding_backward(const int32_t* tokens, const float* dx, float* d_token_embedding,
                        float* d_position_embedding, int64_t batch, int64_t seq_len, int64_t model_dim,
                        bool accumulate_token_gradient, cudaStream_t stream) {
  constexpr const char* kFunction = "embedding_backward";
  check_sizes(kFunction, batch, seq_len, model_dim);
  detail::check_not_null(kFunction, {{"tokens", tokens}, {"dx", dx}, {"d_token_embedding", d_token_embedding},
                                     {"d_position_embedding", d_position_embedding}});
  const unsigned column_slices = static_cast<unsigned>((model_dim + kThreads - 1) / kThreads);
  embedding_token_backward_kernel<<<dim3(kEmbeddingVocabulary, column_slices), kThreads, 0, stream>>>(
      tokens, dx, d_token_embedding, batch * seq_len, model_dim, accumulate_token_gradient);
  CUDA_CHECK(cudaGetLastError());
  embedding_position_backward_kernel<<<dim3(static_cast<unsigned>(seq_len), column_slices), kThreads, 0, stream>>>(
      dx, d_position_embedding, batch, seq_len, model_dim);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
