// core/mma_sync.cuh: the tensor-core primitives the mma.sync kernels share (the block-sparse tile
// kernel, moe/block_sparse.cuh; the router's logits, moe/router.cu; the fused attention core,
// model/flash_attention.cu): asynchronous 16-byte copies into shared memory, ldmatrix, and one
// bf16 mma.m16n8k16 with fp32 accumulation. Header-only device code.
//
// Fragment layout of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane = 4 g + t
// holds A rows g and g + 8, columns 2t, 2t+1 and 2t+8, 2t+9 (a[0] = row g, a[1] = row g + 8, a[2],
// a[3] the same at columns + 8); B column g, rows 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1); C rows g
// (c[0], c[1]) and g + 8 (c[2], c[3]), columns 2t and 2t+1. Each 32-bit register holds two bf16,
// the lower column (A) or row (B) in the low half.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moe::cuda::tensor_core {

__device__ inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

// Four 8 x 8 bf16 matrices from shared memory; lanes 8i .. 8i+7 give the row addresses of matrix i,
// and lane l receives element (l / 4, 2 (l % 4) .. + 1) of each (.trans: the transposed element).
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(address)));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(address)));
}

// d += a b for one 16 x 8 x 16 step: a row-major (4 regs), b column-major (2 regs), fp32 d.
__device__ inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace moe::cuda::tensor_core
