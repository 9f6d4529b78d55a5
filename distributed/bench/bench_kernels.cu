// bench_kernels.cu: ep_bench's fills and checks (see bench_kernels.h). Grid-stride loops; the
// checks count with one atomic per block.
#include "bench_kernels.h"

#include <algorithm>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::dist::bench {

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(size_t count) {  // at most 4096 blocks: the loops stride over the rest
  return static_cast<unsigned>(std::clamp<size_t>((count + kThreads - 1) / kThreads, 1, 4096));
}

__device__ inline uint64_t mix_step(uint64_t x, uint64_t y) {  // one splitmix64 round, y folded in
  x += 0x9e3779b97f4a7c15ull + y * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ inline uint64_t mix(uint64_t a, uint64_t b, uint64_t c) { return mix_step(mix_step(a, b), c); }

__device__ inline uint16_t pattern(int from, int to, size_t i) { return static_cast<uint16_t>(mix(from, to, i)); }

__global__ void fill_uniform_kernel(bf16* out, size_t count, uint64_t seed, uint64_t first, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    const double u = static_cast<double>(mix(seed, first + i, 0) >> 11) * 0x1.0p-53;  // [0, 1)
    out[i] = __float2bfloat16(scale * static_cast<float>(2.0 * u - 1.0));
  }
}

__global__ void sgd_update_kernel(bf16* weights, const float* gradients, size_t count, float learning_rate) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    weights[i] = __float2bfloat16(__bfloat162float(weights[i]) - learning_rate * gradients[i]);
  }
}

// The same, 8 elements a thread in 16-byte loads and stores (count a multiple of 8, 16-byte aligned):
// the update is a pass over memory, and wide accesses keep it near the memory's bandwidth.
__global__ void sgd_update_by_8_kernel(uint4* weights, const float4* gradients, size_t groups, float learning_rate) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < groups; i += size_t{gridDim.x} * blockDim.x) {
    uint4 packed = weights[i];
    const float4 g0 = gradients[2 * i], g1 = gradients[2 * i + 1];
    const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    bf16* w = reinterpret_cast<bf16*>(&packed);
    for (int j = 0; j < 8; ++j) w[j] = __float2bfloat16(__bfloat162float(w[j]) - learning_rate * g[j]);
    weights[i] = packed;
  }
}

__global__ void fill_pattern_kernel(uint16_t* out, size_t count, int from, int to) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = pattern(from, to, i);
  }
}

// One atomic per block: the block's count, summed through shared memory.
__device__ void add_block_count(unsigned long long mine, unsigned long long* wrong) {
  __shared__ unsigned long long block_total;
  if (threadIdx.x == 0) block_total = 0;
  __syncthreads();
  if (mine != 0) atomicAdd(&block_total, mine);
  __syncthreads();
  if (threadIdx.x == 0 && block_total != 0) atomicAdd(wrong, block_total);
}

__global__ void count_pattern_kernel(const uint16_t* got, size_t count, int from, int to, unsigned long long* wrong) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    mine += got[i] != pattern(from, to, i);
  }
  add_block_count(mine, wrong);
}

__global__ void count_mismatches_kernel(const uint16_t* a, const uint16_t* b, size_t count, unsigned long long* wrong) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    mine += a[i] != b[i];
  }
  add_block_count(mine, wrong);
}

}  // namespace

void fill_uniform(bf16* out, size_t count, uint64_t seed, uint64_t first, float scale, cudaStream_t stream) {
  if (count == 0) return;
  fill_uniform_kernel<<<blocks_for(count), kThreads, 0, stream>>>(out, count, seed, first, scale);
  CUDA_CHECK(cudaGetLastError());
}

void sgd_update(bf16* weights, const float* gradients, size_t count, float learning_rate, cudaStream_t stream) {
  if (count == 0) return;
  const bool by_8 = count % 8 == 0 && reinterpret_cast<uintptr_t>(weights) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(gradients) % 16 == 0;
  if (by_8) {
    sgd_update_by_8_kernel<<<blocks_for(count / 8), kThreads, 0, stream>>>(
        reinterpret_cast<uint4*>(weights), reinterpret_cast<const float4*>(gradients), count / 8, learning_rate);
  } else {
    sgd_update_kernel<<<blocks_for(count), kThreads, 0, stream>>>(weights, gradients, count, learning_rate);
  }
  CUDA_CHECK(cudaGetLastError());
}

void fill_exchange_pattern(uint16_t* out, size_t count, int from, int to, cudaStream_t stream) {
  if (count == 0) return;
  fill_pattern_kernel<<<blocks_for(count), kThreads, 0, stream>>>(out, count, from, to);
  CUDA_CHECK(cudaGetLastError());
}

void count_pattern_mismatches(const uint16_t* got, size_t count, int from, int to, unsigned long long* wrong,
                              cudaStream_t stream) {
  if (count == 0) return;
  count_pattern_kernel<<<blocks_for(count), kThreads, 0, stream>>>(got, count, from, to, wrong);
  CUDA_CHECK(cudaGetLastError());
}

void count_mismatches(const uint16_t* a, const uint16_t* b, size_t count, unsigned long long* wrong,
                      cudaStream_t stream) {
  if (count == 0) return;
  count_mismatches_kernel<<<blocks_for(count), kThreads, 0, stream>>>(a, b, count, wrong);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::dist::bench
