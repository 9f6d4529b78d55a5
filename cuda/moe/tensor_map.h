// tensor_map.h: TMA tensor maps (CUtensorMap) for the warp-specialized block-sparse kernel
// (block_sparse_wgmma_ws.cuh), which copies its operands into shared memory with the Hopper Tensor
// Memory Accelerator instead of per-thread cp.async. Host code, includable by plain C++.
// Built into moe_cuda; exercised by tests/cuda/test_block_sparse.cpp on an H100/H200.
//
// A tensor map describes a tiled view of a global tensor (address, sizes, strides, the box one
// copy moves, the shared-memory swizzle), so that ONE thread issues one instruction per box and the
// TMA unit does the address arithmetic, the bounds checks and the 128-byte swizzle that wgmma's
// matrix descriptors expect (the same layout block_sparse_wgmma.cuh writes by hand).
//
// Every map here has SWIZZLE_128B, so a box's inner extent is 128 bytes (64 bf16 or 32 fp32):
//   - a dense row-major matrix [rows, cols]              2-D map, box {64 columns, box_rows rows}
//   - the same matrix as column groups, for the weight   3-D map [cols / 128 bytes][rows][128 bytes],
//     gradients' TMA stores (bf16 or fp32)               box {128 bytes, box_rows rows, groups}
//   - B x B blocks one after another [count, B, B]       3-D map, box {64, box_rows, 1}
//   - one map per expert of an ExpertOperand's table     built ON THE DEVICE (build_expert_maps):
//     the host knows only the device array of pointers, so it encodes a prototype with the right
//     sizes and strides, and a kernel copies it once per expert and swaps in the expert's address
//     (PTX tensormap.replace), as CUTLASS's grouped GEMM does. The maps are written by that kernel
//     and read by the product launched after it on the same stream: the kernel boundary orders the
//     writes before the reads (the writer also fences its generic-proxy writes towards the
//     tensor-map proxy), so the product needs no acquire fence of its own.
// The driver function cuTensorMapEncodeTiled is reached through cudaGetDriverEntryPointByVersion,
// so the project still links only the CUDA runtime.
#pragma once

#include <cuda.h>          // CUtensorMap
#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

// A 2-D bf16 row-major matrix [rows, cols] (row stride ld elements, a multiple of 8), copied in
// boxes of 64 columns x box_rows rows (box_rows <= 256).
CUtensorMap make_matrix_map(const bf16* base, int64_t rows, int64_t cols, int64_t ld, int box_rows);
// A row-major matrix [rows, cols] of bf16 or fp32 (row stride ld elements, ld * size a multiple of
// 16 bytes) seen as its column groups of 128 bytes (64 bf16 or 32 fp32): a 3-D map of
// [cols / group][rows][group] whose box {group, box_rows, groups} lands in shared memory as `groups`
// blocks of box_rows x 128 bytes, one after another. One copy then moves box_rows rows of
// groups x 128 bytes, each group in the 128-byte swizzle; a 2-D box cannot be wider than one
// swizzle row. Coordinates {0, row, column / group}: a box starts on a group boundary.
CUtensorMap make_column_groups_map(const bf16* base, int64_t rows, int64_t cols, int64_t ld, int box_rows, int groups);
CUtensorMap make_column_groups_map(const float* base, int64_t rows, int64_t cols, int64_t ld, int box_rows, int groups);

// count B x B bf16 blocks stored one after another, copied in boxes of 64 columns x box_rows rows of
// one block.
CUtensorMap make_blocks_map(const bf16* base, int64_t count, int block_size, int box_rows);

// Device memory for `count` maps, taken from a stream-ordered pool of this library's own that keeps
// its memory between launches (release threshold: unlimited). The default pool gives its memory back
// at every synchronisation, so a launch after a sync would map fresh physical memory for 8 KB of maps
// and the GPU would wait for that host work. Give the maps back with free_expert_maps on the same
// stream after the launch that reads them.
CUtensorMap* allocate_expert_maps(int count, cudaStream_t stream);
void free_expert_maps(CUtensorMap* maps, cudaStream_t stream);
// Any other per-launch scratch from the same pool (the stream-K tail's partial sums and flags,
// block_sparse.cu), given back with free_launch_scratch on the same stream after the launch.
void* allocate_launch_scratch(size_t bytes, cudaStream_t stream);
void free_launch_scratch(void* scratch, cudaStream_t stream);
// Creates the current device's pool now, if it is not there yet: a stream being captured into a CUDA
// graph can allocate from a pool but cannot create one.
void create_launch_scratch_pool();

// Writes maps[e] = `prototype` with its global address replaced by pointers[e], for e < count, on
// `stream`. maps: device memory, 64-byte aligned, count entries. The prototype must have been made
// for tensors of the experts' sizes and strides (its own address only has to be valid and aligned).
// pointers: the device array [E] of the experts' tensors, of the prototype's element type (bf16
// operands, or the bf16 / fp32 weight gradients that a TMA-store epilogue writes).
void build_expert_maps(const CUtensorMap& prototype, const void* const* pointers, int count, CUtensorMap* maps,
                       cudaStream_t stream);
template <typename T>
void build_expert_maps(const CUtensorMap& prototype, T* const* pointers, int count, CUtensorMap* maps,
                       cudaStream_t stream) {
  build_expert_maps(prototype, reinterpret_cast<const void* const*>(pointers), count, maps, stream);
}

}  // namespace moe::cuda
