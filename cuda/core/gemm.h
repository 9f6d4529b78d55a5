// gemm.h: row-major matrix products on cuBLAS, bf16 operands, fp32 accumulation.
//
// cuBLAS is column-major; the whole project is row-major. A row-major C = op(A) op(B) is, read
// column-major, Cᵀ = op(B)ᵀ op(A)ᵀ, so each wrapper swaps the operands and keeps the transposes.
// These wrappers are the cuBLAS "versions" every custom kernel is measured against:
//   gemm          one product (the dense baseline of the same useful FLOPs)
//   gemm_batched  E products of one shape, operands through device arrays of pointers: the
//                 padded / dropping formulations over [E, C, D] (GShard, Tutel); the pointers let
//                 expert weights live anywhere (one tensor, a rank's subset, a cache slot)
//   gemm_grouped  E products of different row counts (cublasGemmGroupedBatchedEx): the dropless
//                 grouped variant; its row counts must be on the host
// Shapes: op(A) [M, K], op(B) [K, N], C [M, N]; lda/ldb/ldc are row strides of the stored matrices.
#pragma once

#include <cublas_v2.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

struct CublasError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line);
#define CUBLAS_CHECK(call) ::moe::cuda::check_cublas((call), #call, __FILE__, __LINE__)

// An owned cuBLAS handle bound to a stream.
class CublasHandle {
 public:
  CublasHandle();
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }
  void set_stream(cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
};

enum class Op { none, transpose };

// C = alpha op(A) op(B) + beta C, with C bf16 or fp32 (c_is_float).
void gemm(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k,
          const bf16* a, int lda, const bf16* b, int ldb, void* c, int ldc,
          float alpha = 1.0f, float beta = 0.0f, bool c_is_float = false);

// For each e < batch: C[e] = op(A[e]) op(B[e]) (+ beta C[e]); a, b, c are DEVICE arrays of pointers.
// C is bf16 (activations) or fp32 (weight gradients).
void gemm_batched(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k,
                  const bf16* const* a, int lda, const bf16* const* b, int ldb, bf16* const* c, int ldc,
                  int batch, float beta = 0.0f);
void gemm_batched(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k,
                  const bf16* const* a, int lda, const bf16* const* b, int ldb, float* const* c, int ldc,
                  int batch, float beta = 0.0f);

// For each group g: C[g] [m[g], n[g]] = op(A[g]) op(B[g]) with op(A[g]) [m[g], k[g]] (sizes on the
// HOST, pointers in DEVICE arrays, one product per group). Groups with a zero size must be left out
// by the caller. The dropless grouped path's forward and backward.
void gemm_grouped(cublasHandle_t handle, Op op_a, Op op_b, const std::vector<int>& m, const std::vector<int>& n,
                  const std::vector<int>& k, const bf16* const* a, int lda, const bf16* const* b, int ldb,
                  bf16* const* c, int ldc);
// The common case: no transposes, the same n and k for every group.
void gemm_grouped(cublasHandle_t handle, const std::vector<int>& m, int n, int k,
                  const bf16* const* a, int lda, const bf16* const* b, int ldb, bf16* const* c, int ldc);

// Fills out[e] = base + e * stride (element units) for e < count, on the device: the pointer
// arrays of a strided [E, rows, cols] activation tensor, without a host round trip.
void fill_strided_pointers_bytes(const void* base, size_t stride_bytes, int count,
                                 void* out,  // [count] pointers
                                 cudaStream_t stream);
template <typename T>  // T = bf16 for outputs, const bf16 for inputs
void fill_strided_pointers(T* base, size_t stride, int count, T** out, cudaStream_t stream) {
  fill_strided_pointers_bytes(base, stride * sizeof(T), count, out, stream);
}

}  // namespace moe::cuda
