// tensor_map.cu: encoding TMA tensor maps on the host, and the per-expert maps on the device (see
// tensor_map.h). Build: cmake --build build --target moe_cuda
#include "moe/tensor_map.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult status{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000, cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || pointer == nullptr)
      throw std::runtime_error("moe::cuda: the driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 and a Hopper GPU)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pointer);
  }();
  return function;
}

// rank 2 or 3, sizes and byte strides of the dimensions above the first, the box, 128-byte swizzle.
CUtensorMap encode(const void* base, CUtensorMapDataType type, int rank, const cuuint64_t* sizes,
                   const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap map{};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = encode_function()(
      &map, type, rank, const_cast<void*>(base), sizes, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::runtime_error("moe::cuda: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(result) +
                             " (rank " + std::to_string(rank) + ", " + std::to_string(sizes[0]) + " x " +
                             std::to_string(sizes[1]) + ")");
  return map;
}

// One thread per expert: copy the prototype's 128 bytes, swap in the expert's address, then make
// the new map visible to the tensor-map proxy that the copies read it through.
__global__ void build_expert_maps_kernel(const __grid_constant__ CUtensorMap prototype, const void* const* pointers,
                                         int count, CUtensorMap* maps) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= count) return;
  const uint4* from = reinterpret_cast<const uint4*>(&prototype);
  uint4* to = reinterpret_cast<uint4*>(&maps[e]);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(CUtensorMap) / sizeof(uint4)); ++i) to[i] = from[i];
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;\n" ::"l"(&maps[e]),
               "l"(pointers[e])
               : "memory");
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
#else
  __trap();  // only the sm_90a build has tensormap.replace; the host never asks for it elsewhere
#endif
}

// One pool per device, created on first use and kept for the life of the process.
cudaMemPool_t launch_scratch_pool() {
  static std::mutex mutex;
  static std::vector<cudaMemPool_t> pools;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (pools.size() <= static_cast<size_t>(device)) pools.resize(device + 1, nullptr);
  if (pools[device] == nullptr) {
    cudaMemPoolProps properties{};
    properties.allocType = cudaMemAllocationTypePinned;
    properties.location.type = cudaMemLocationTypeDevice;
    properties.location.id = device;
    CUDA_CHECK(cudaMemPoolCreate(&pools[device], &properties));
    uint64_t keep_everything = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pools[device], cudaMemPoolAttrReleaseThreshold, &keep_everything));
  }
  return pools[device];
}

}  // namespace

void* allocate_launch_scratch(size_t bytes, cudaStream_t stream) {
  void* scratch = nullptr;
  CUDA_CHECK(cudaMallocFromPoolAsync(&scratch, bytes, launch_scratch_pool(), stream));
  return scratch;
}

void free_launch_scratch(void* scratch, cudaStream_t stream) { CUDA_CHECK(cudaFreeAsync(scratch, stream)); }

void create_launch_scratch_pool() { (void)launch_scratch_pool(); }

CUtensorMap* allocate_expert_maps(int count, cudaStream_t stream) {
  return static_cast<CUtensorMap*>(allocate_launch_scratch(sizeof(CUtensorMap) * static_cast<size_t>(count), stream));
}

void free_expert_maps(CUtensorMap* maps, cudaStream_t stream) { free_launch_scratch(maps, stream); }

CUtensorMap make_matrix_map(const bf16* base, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  const cuuint64_t sizes[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * sizeof(bf16)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  return encode(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, sizes, strides, box);
}

namespace {
// The dimensions, innermost first: the 128 bytes of a group (stride: the element), the rows
// (stride ld), the groups (stride 128 bytes). Strides need not grow outwards.
template <typename T>
CUtensorMap column_groups_map(const T* base, CUtensorMapDataType type, int64_t rows, int64_t cols, int64_t ld,
                              int box_rows, int groups) {
  constexpr cuuint64_t group = 128 / sizeof(T);
  const cuuint64_t sizes[3] = {group, static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(cols) / group};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld) * sizeof(T), 128};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(group), static_cast<cuuint32_t>(box_rows),
                             static_cast<cuuint32_t>(groups)};
  return encode(base, type, 3, sizes, strides, box);
}
}  // namespace

CUtensorMap make_column_groups_map(const bf16* base, int64_t rows, int64_t cols, int64_t ld, int box_rows, int groups) {
  return column_groups_map(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rows, cols, ld, box_rows, groups);
}
CUtensorMap make_column_groups_map(const float* base, int64_t rows, int64_t cols, int64_t ld, int box_rows, int groups) {
  return column_groups_map(base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, rows, cols, ld, box_rows, groups);
}

CUtensorMap make_blocks_map(const bf16* base, int64_t count, int block_size, int box_rows) {
  const cuuint64_t B = static_cast<cuuint64_t>(block_size);
  const cuuint64_t sizes[3] = {B, B, static_cast<cuuint64_t>(count)};
  const cuuint64_t strides[2] = {B * sizeof(bf16), B * B * sizeof(bf16)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_rows), 1};
  return encode(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, sizes, strides, box);
}

void build_expert_maps(const CUtensorMap& prototype, const void* const* pointers, int count, CUtensorMap* maps,
                       cudaStream_t stream) {
  if (count <= 0) return;
  constexpr int threads = 128;
  build_expert_maps_kernel<<<(count + threads - 1) / threads, threads, 0, stream>>>(prototype, pointers, count, maps);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
