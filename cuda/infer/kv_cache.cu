// infer/kv_cache.cu: the KV cache on the GPU, its append, and decode attention (see infer/kv_cache.h).
#include "infer/kv_cache.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/elementwise.h"  // fill_nan, grid_stride_blocks
#include "core/cuda_check.h"    // CUDA_CHECK
#include "core/warp_reduce.cuh"  // warp_sum, warp_max

namespace moe::cuda {

namespace {

void check_shape(const char* function, const KvCacheShape& s) {
  if (s.layers < 1 || s.batch < 1 || s.heads < 1 || s.capacity < 1 || s.head_dim < 1) {
    throw std::invalid_argument(std::string(function) + ": every size of the KV cache must be >= 1 (L " +
                                std::to_string(s.layers) + ", N " + std::to_string(s.batch) + ", heads " +
                                std::to_string(s.heads) + ", S " + std::to_string(s.capacity) + ", d " +
                                std::to_string(s.head_dim) + ")");
  }
}

// One thread per (row, column of D) of the new rows, for k and v together: a memory-bound scatter.
__global__ void kv_cache_append_kernel(const bf16* qkv, bf16* keys, bf16* values, int heads, int head_dim,
                                       int capacity, int count, const int32_t* first_position, size_t total) {
  const int D = heads * head_dim;
  const int first = *first_position;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const int column = static_cast<int>(i % D);
    const size_t row = i / D;  // n * count + new token
    const int n = static_cast<int>(row / count), position = first + static_cast<int>(row % count);
    if (position < 0 || position >= capacity) continue;  // the host checked it: never past the cache
    const int h = column / head_dim, j = column % head_dim;
    const size_t at = ((static_cast<size_t>(n) * heads + h) * capacity + position) * head_dim + j;
    keys[at] = qkv[row * 3 * D + D + column];
    values[at] = qkv[row * 3 * D + 2 * D + column];
  }
}

// 4 warps per (head, sequence): enough to keep a few hundred cached positions moving, and a block
// per pair keeps every SM busy once N x heads passes the SM count.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;

// The sum (or max) of one value per thread over the block, in a fixed order; every thread gets it.
template <bool kMax>
__device__ float block_reduce(float value, float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  value = kMax ? detail::warp_max(value) : detail::warp_sum(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kDecodeWarps; ++w) total = kMax ? fmaxf(total, scratch[w]) : total + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return total;
}

// Block (h, n): the new token of sequence n, head h, against positions [0, length).
// Shared memory: scores [S] (the first length used), q [d], the warps' partial contexts [kDecodeWarps, d], scratch.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(const bf16* qkv, const bf16* keys, const bf16* values, bf16* context, int heads,
                            int head_dim, int capacity, const int32_t* position, float scale) {
  extern __shared__ float shared[];
  // positions 0 .. *position; the host checked it, and a length outside 1..S is clamped, not read past
  const int length = min(max(*position + 1, 1), capacity);
  float* scores = shared;
  float* q = scores + capacity;
  float* partial = q + head_dim;
  float* scratch = partial + kDecodeWarps * head_dim;
  const int h = blockIdx.x, n = blockIdx.y, D = heads * head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t panel = (static_cast<size_t>(n) * heads + h) * capacity * head_dim;  // [S, d] of (n, h)
  const bf16* k = keys + panel;
  const bf16* v = values + panel;

  for (int j = threadIdx.x; j < head_dim; j += kDecodeThreads) {
    q[j] = __bfloat162float(qkv[static_cast<size_t>(n) * 3 * D + h * head_dim + j]);
  }
  __syncthreads();
  // scores: one warp per position, its lanes across the head's width
  for (int s = warp; s < length; s += kDecodeWarps) {
    float dot = 0.0f;
    for (int j = lane; j < head_dim; j += 32) dot += q[j] * __bfloat162float(k[static_cast<size_t>(s) * head_dim + j]);
    dot = detail::warp_sum(dot);
    if (lane == 0) scores[s] = dot * scale;
  }
  __syncthreads();
  // softmax over the positions
  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < length; s += kDecodeThreads) local_max = fmaxf(local_max, scores[s]);
  const float max_score = block_reduce<true>(local_max, scratch);
  float local_sum = 0.0f;
  for (int s = threadIdx.x; s < length; s += kDecodeThreads) {
    const float p = expf(scores[s] - max_score);
    scores[s] = p;
    local_sum += p;
  }
  const float sum = block_reduce<false>(local_sum, scratch);
  // context: warp w sums the positions s = w (mod warps), lanes across the width; then the warps in order
  for (int j = lane; j < head_dim; j += 32) {
    float acc = 0.0f;
    for (int s = warp; s < length; s += kDecodeWarps) acc += scores[s] * __bfloat162float(v[static_cast<size_t>(s) * head_dim + j]);
    partial[warp * head_dim + j] = acc;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < head_dim; j += kDecodeThreads) {
    float acc = partial[j];
    for (int w = 1; w < kDecodeWarps; ++w) acc += partial[w * head_dim + j];
    context[static_cast<size_t>(n) * D + h * head_dim + j] = __float2bfloat16(acc / sum);
  }
}

}  // namespace

KvCacheGpu::KvCacheGpu(const KvCacheShape& shape) : shape_(shape) {
  check_shape("KvCacheGpu", shape);
  const size_t elements = static_cast<size_t>(shape.layers * shape.elements_per_layer());
  keys_ = DeviceBuffer<bf16>(elements);
  values_ = DeviceBuffer<bf16>(elements);
}

void KvCacheGpu::poison(cudaStream_t stream) {
  for (DeviceBuffer<bf16>* buffer : {&keys_, &values_}) {
    fill_nan(buffer->data(), buffer->size(), stream);
  }
}

void kv_cache_append(const bf16* qkv, bf16* keys, bf16* values, const KvCacheShape& shape, int64_t count,
                     const int32_t* first_position, cudaStream_t stream) {
  check_shape("kv_cache_append", shape);
  if (count < 1 || count > shape.capacity || first_position == nullptr) {
    throw std::invalid_argument("kv_cache_append: count = " + std::to_string(count) + " new rows per sequence" +
                                (first_position == nullptr ? " and no first_position" : "") + "; allowed: 1..S = " +
                                std::to_string(shape.capacity) + ", at a device position");
  }
  const size_t total = static_cast<size_t>(shape.batch * count * shape.heads * shape.head_dim);
  kv_cache_append_kernel<<<grid_stride_blocks(total), kElementwiseThreads, 0, stream>>>(
      qkv, keys, values, int(shape.heads), int(shape.head_dim), int(shape.capacity), int(count), first_position,
      total);
  CUDA_CHECK(cudaGetLastError());
}

void decode_attention(const bf16* qkv, const bf16* keys, const bf16* values, bf16* context, const KvCacheShape& shape,
                      const int32_t* position, cudaStream_t stream) {
  check_shape("decode_attention", shape);
  if (position == nullptr) throw std::invalid_argument("decode_attention: position is null; expected a device [1]");
  const size_t shared_bytes =
      sizeof(float) * static_cast<size_t>(shape.capacity + (1 + kDecodeWarps) * shape.head_dim + kDecodeWarps);
  if (shared_bytes > 48 * 1024) {  // past the default: ask for more, up to what the device allows
    int device = 0, limit = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (shared_bytes > static_cast<size_t>(limit)) {
      throw std::invalid_argument("decode_attention: a context of S = " + std::to_string(shape.capacity) +
                                  " positions needs " + std::to_string(shared_bytes) + " bytes of shared memory for "
                                  "its scores; the device allows " + std::to_string(limit) + " (a shorter context)");
    }
    CUDA_CHECK(cudaFuncSetAttribute(decode_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(shared_bytes)));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  decode_attention_kernel<<<dim3(unsigned(shape.heads), unsigned(shape.batch)), kDecodeThreads, shared_bytes, stream>>>(
      qkv, keys, values, context, int(shape.heads), int(shape.head_dim), int(shape.capacity), position, scale);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
