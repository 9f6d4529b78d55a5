// gemm.cu: row-major cuBLAS wrappers (see gemm.h).
#include "core/gemm.h"

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw CublasError(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " +
                      cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")");
  }
}

CublasHandle::CublasHandle() { CUBLAS_CHECK(cublasCreate(&handle_)); }
CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}
void CublasHandle::set_stream(cudaStream_t stream) { CUBLAS_CHECK(cublasSetStream(handle_, stream)); }

namespace {
cublasOperation_t to_cublas(Op op) { return op == Op::transpose ? CUBLAS_OP_T : CUBLAS_OP_N; }

__global__ void fill_strided_pointers_kernel(const char* base, size_t stride_bytes, int count, const char** out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < count) out[e] = base + e * stride_bytes;
}
}  // namespace

// Row-major C [m, n] = op(A) op(B)  <=>  column-major Cᵀ [n, m] = op(B)ᵀ op(A)ᵀ: pass B first.
void gemm(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k, const bf16* a, int lda,
          const bf16* b, int ldb, void* c, int ldc, float alpha, float beta, bool c_is_float) {
  CUBLAS_CHECK(cublasGemmEx(handle, to_cublas(op_b), to_cublas(op_a), n, m, k, &alpha, b, CUDA_R_16BF, ldb,
                            a, CUDA_R_16BF, lda, &beta, c, c_is_float ? CUDA_R_32F : CUDA_R_16BF, ldc,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

namespace {
void gemm_batched_any(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k, const bf16* const* a,
                      int lda, const bf16* const* b, int ldb, void* const* c, cudaDataType_t c_type, int ldc,
                      int batch, float beta) {
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasGemmBatchedEx(handle, to_cublas(op_b), to_cublas(op_a), n, m, k, &alpha,
                                   reinterpret_cast<const void* const*>(b), CUDA_R_16BF, ldb,
                                   reinterpret_cast<const void* const*>(a), CUDA_R_16BF, lda, &beta, c, c_type,
                                   ldc, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
}  // namespace

void gemm_batched(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k, const bf16* const* a,
                  int lda, const bf16* const* b, int ldb, bf16* const* c, int ldc, int batch, float beta) {
  gemm_batched_any(handle, op_a, op_b, m, n, k, a, lda, b, ldb, reinterpret_cast<void* const*>(c), CUDA_R_16BF,
                   ldc, batch, beta);
}

void gemm_batched(cublasHandle_t handle, Op op_a, Op op_b, int m, int n, int k, const bf16* const* a,
                  int lda, const bf16* const* b, int ldb, float* const* c, int ldc, int batch, float beta) {
  gemm_batched_any(handle, op_a, op_b, m, n, k, a, lda, b, ldb, reinterpret_cast<void* const*>(c), CUDA_R_32F,
                   ldc, batch, beta);
}

// Per group, column-major: Cᵀ [n, m] = op(B)ᵀ op(A)ᵀ, so B goes first with A's transpose flag swapped.
void gemm_grouped(cublasHandle_t handle, Op op_a, Op op_b, const std::vector<int>& m, const std::vector<int>& n,
                  const std::vector<int>& k, const bf16* const* a, int lda, const bf16* const* b, int ldb,
                  bf16* const* c, int ldc) {
  const int groups = static_cast<int>(m.size());
  if (groups == 0) return;
  if (n.size() != m.size() || k.size() != m.size()) {
    throw std::invalid_argument("gemm_grouped: m, n and k must have one entry per group");
  }
  std::vector<cublasOperation_t> trans_b_first(groups, to_cublas(op_b)), trans_a_second(groups, to_cublas(op_a));
  std::vector<int> ld_first(groups, ldb), ld_second(groups, lda), ld_c(groups, ldc), size(groups, 1);
  std::vector<float> alpha(groups, 1.0f), beta(groups, 0.0f);
  CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle, trans_b_first.data(), trans_a_second.data(), n.data(), m.data(),
                                          k.data(), alpha.data(), reinterpret_cast<const void* const*>(b),
                                          CUDA_R_16BF, ld_first.data(), reinterpret_cast<const void* const*>(a),
                                          CUDA_R_16BF, ld_second.data(), beta.data(),
                                          reinterpret_cast<void* const*>(c), CUDA_R_16BF, ld_c.data(), groups,
                                          size.data(), CUBLAS_COMPUTE_32F));
}

void gemm_grouped(cublasHandle_t handle, const std::vector<int>& m, int n, int k, const bf16* const* a, int lda,
                  const bf16* const* b, int ldb, bf16* const* c, int ldc) {
  gemm_grouped(handle, Op::none, Op::none, m, std::vector<int>(m.size(), n), std::vector<int>(m.size(), k), a, lda,
               b, ldb, c, ldc);
}

void fill_strided_pointers_bytes(const void* base, size_t stride_bytes, int count, void* out,
                                 cudaStream_t stream) {
  if (count <= 0) return;
  fill_strided_pointers_kernel<<<(count + 127) / 128, 128, 0, stream>>>(static_cast<const char*>(base),
                                                                         stride_bytes, count, static_cast<const char**>(out));
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
