// model/layer_norm.cu: LayerNorm forward and backward, parameter gradients reduced deterministically
// (see model/layer_norm.h).
#include "model/layer_norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/launch_checks.h"  // check_not_null, check_range
#include "core/warp_reduce.cuh"  // warp_sum

namespace moe::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;    // rows per block in the row kernels
constexpr int kColumnThreads = 256;  // columns per block in the column-sum kernels

// One warp per row. Two passes over the row (mean, then the centred variance, as the reference
// computes it) instead of E[x^2] - mean^2, which cancels badly when |mean| >> std; then y.
// Staged: the warp first copies its row into shared memory with 16-byte loads, all in flight at once;
// the two sums read it there, and y is written 8 elements a lane at a time from 16-byte loads of the
// row, gain and bias. Lane l still adds the elements l, l + 32, l + 64, ... in that order, and each y
// is the same expression, so the result is the unstaged kernel's bit for bit; what changes is the
// waiting. Unstaged, each of the three passes is D/32 dependent steps per lane, and the last one
// waits for a gain and a bias load every element: at one row (a decode step) and D = 4096 one LN took
// 55-58 us on an H200 (offload_bench --kernel-trace, 2026-11-29), a quarter of the step's GPU time.
// Unstaged where the row, y, gain or bias cannot be read in 16-byte pieces (D % 8 != 0, or a pointer
// not 16-byte aligned) or a row would not fit (layer_norm_forward below).
__device__ __forceinline__ float layer_norm_value(float x, float mean, float rstd, float gain, float bias) {
  return __fmaf_rn((x - mean) * rstd, gain, bias);
}

template <bool kStaged>
__global__ void layer_norm_forward_kernel(const bf16* __restrict__ x, const bf16* __restrict__ gain,
                                          const bf16* __restrict__ bias, bf16* __restrict__ y, float* mean,
                                          float* rstd, int64_t rows, int64_t model_dim, float eps) {
  extern __shared__ __align__(16) unsigned char staged_rows[];  // [warps per block][D] bf16 when staged
  const int warps = static_cast<int>(blockDim.x / 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t row = int64_t{blockIdx.x} * warps + warp;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp leaves together
  const bf16* x_row = x + row * model_dim;
  if constexpr (kStaged) {
    bf16* staged = reinterpret_cast<bf16*>(staged_rows) + int64_t{warp} * model_dim;
    for (int64_t v = lane; v < model_dim / 8; v += 32) {
      reinterpret_cast<uint4*>(staged)[v] = reinterpret_cast<const uint4*>(x_row)[v];
    }
    __syncwarp();
    x_row = staged;
  }
  float sum = 0.0f;
  for (int64_t j = lane; j < model_dim; j += 32) sum += __bfloat162float(x_row[j]);
  const float row_mean = detail::warp_sum(sum) / static_cast<float>(model_dim);
  float squares = 0.0f;
  for (int64_t j = lane; j < model_dim; j += 32) {
    const float centred = __bfloat162float(x_row[j]) - row_mean;
    squares += centred * centred;
  }
  const float row_rstd = rsqrtf(detail::warp_sum(squares) / static_cast<float>(model_dim) + eps);
  bf16* y_row = y + row * model_dim;
  if constexpr (kStaged) {
    for (int64_t v = lane; v < model_dim / 8; v += 32) {
      const uint4 xs = reinterpret_cast<const uint4*>(x_row)[v];
      const uint4 gs = reinterpret_cast<const uint4*>(gain)[v];
      const uint4 bs = reinterpret_cast<const uint4*>(bias)[v];
      const bf16* xv = reinterpret_cast<const bf16*>(&xs);
      const bf16* gv = reinterpret_cast<const bf16*>(&gs);
      const bf16* bv = reinterpret_cast<const bf16*>(&bs);
      uint4 out;
      bf16* ov = reinterpret_cast<bf16*>(&out);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        ov[k] = __float2bfloat16(layer_norm_value(__bfloat162float(xv[k]), row_mean, row_rstd, __bfloat162float(gv[k]),
                                                  __bfloat162float(bv[k])));
      }
      reinterpret_cast<uint4*>(y_row)[v] = out;
    }
  } else {
    for (int64_t j = lane; j < model_dim; j += 32) {
      y_row[j] = __float2bfloat16(layer_norm_value(__bfloat162float(x_row[j]), row_mean, row_rstd,
                                                   __bfloat162float(gain[j]), __bfloat162float(bias[j])));
    }
  }
  if (lane == 0) {
    mean[row] = row_mean;
    rstd[row] = row_rstd;
  }
}

__global__ void layer_norm_dx_kernel(const float* dy, const bf16* x, const float* mean, const float* rstd,
                                     const bf16* gain, float* dx, int64_t rows, int64_t model_dim, bool accumulate) {
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float row_mean = mean[row], row_rstd = rstd[row];
  const float* dy_row = dy + row * model_dim;
  const bf16* x_row = x + row * model_dim;
  float sum_g = 0.0f, sum_g_x_hat = 0.0f;
  for (int64_t j = lane; j < model_dim; j += 32) {
    const float g = dy_row[j] * __bfloat162float(gain[j]);
    sum_g += g;
    sum_g_x_hat += g * (__bfloat162float(x_row[j]) - row_mean) * row_rstd;
  }
  const float mean_g = detail::warp_sum(sum_g) / static_cast<float>(model_dim);
  const float mean_g_x_hat = detail::warp_sum(sum_g_x_hat) / static_cast<float>(model_dim);
  float* dx_row = dx + row * model_dim;
  for (int64_t j = lane; j < model_dim; j += 32) {
    const float g = dy_row[j] * __bfloat162float(gain[j]);
    const float x_hat = (__bfloat162float(x_row[j]) - row_mean) * row_rstd;
    const float value = row_rstd * (g - mean_g - x_hat * mean_g_x_hat);
    dx_row[j] = accumulate ? dx_row[j] + value : value;
  }
}

// Pass 1: block (column slice, chunk) sums its chunk's rows, in row order, for one column per thread.
// Consecutive threads read consecutive columns of a row: coalesced.
__global__ void layer_norm_parameter_partials_kernel(const float* dy, const bf16* x, const float* mean,
                                                     const float* rstd, float* scratch, int64_t rows,
                                                     int64_t model_dim) {
  const int64_t column = int64_t{blockIdx.x} * kColumnThreads + threadIdx.x;
  if (column >= model_dim) return;
  const int64_t chunk = blockIdx.y;
  const int64_t first = chunk * kLayerNormRowsPerChunk;
  const int64_t last = first + kLayerNormRowsPerChunk < rows ? first + kLayerNormRowsPerChunk : rows;
  float sum_dy_x_hat = 0.0f, sum_dy = 0.0f;
  for (int64_t row = first; row < last; ++row) {
    const float g = dy[row * model_dim + column];
    const float x_hat = (__bfloat162float(x[row * model_dim + column]) - mean[row]) * rstd[row];
    sum_dy_x_hat += g * x_hat;
    sum_dy += g;
  }
  scratch[(chunk * 2 + 0) * model_dim + column] = sum_dy_x_hat;
  scratch[(chunk * 2 + 1) * model_dim + column] = sum_dy;
}

// Pass 2: the chunks' partials summed per column. A thread per column summing all T/64 chunks
// alone is latency-bound (T = 16384: 256 dependent loads; 30 us for 512 columns). Here a block
// owns kFinishColumns columns and kFinishLanes threads per column: lane l sums chunks l, l + 8,
// l + 16, ... in order, then lanes 0..7 are added in a fixed order through shared memory. The
// order never depends on timing, so the gradient is the same bits on every run.
constexpr int kFinishColumns = 32;  // blockDim.x: consecutive columns, coalesced loads
constexpr int kFinishLanes = 8;     // blockDim.y: threads splitting one column's chunks

__global__ void layer_norm_parameter_finish_kernel(const float* scratch, float* d_gain, float* d_bias,
                                                   int64_t chunks, int64_t model_dim) {
  __shared__ float gain_part[kFinishLanes][kFinishColumns];
  __shared__ float bias_part[kFinishLanes][kFinishColumns];
  const int64_t column = int64_t{blockIdx.x} * kFinishColumns + threadIdx.x;
  float gain_sum = 0.0f, bias_sum = 0.0f;
  if (column < model_dim) {
    for (int64_t chunk = threadIdx.y; chunk < chunks; chunk += kFinishLanes) {
      gain_sum += scratch[(chunk * 2 + 0) * model_dim + column];
      bias_sum += scratch[(chunk * 2 + 1) * model_dim + column];
    }
  }
  gain_part[threadIdx.y][threadIdx.x] = gain_sum;
  bias_part[threadIdx.y][threadIdx.x] = bias_sum;
  __syncthreads();
  if (threadIdx.y != 0 || column >= model_dim) return;
  for (int lane = 1; lane < kFinishLanes; ++lane) {
    gain_sum += gain_part[lane][threadIdx.x];
    bias_sum += bias_part[lane][threadIdx.x];
  }
  d_gain[column] = gain_sum;
  d_bias[column] = bias_sum;
}

int64_t chunks_of(int64_t rows) { return (rows + kLayerNormRowsPerChunk - 1) / kLayerNormRowsPerChunk; }

void check_sizes(const char* function, int64_t rows, int64_t model_dim) {
  detail::check_range(function, "rows", rows, 1, int64_t{65535} * kLayerNormRowsPerChunk,
                      "row chunks of 64 in the grid's y dimension");
  detail::check_range(function, "model_dim", model_dim, 1, int64_t{1} << 20);
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }
unsigned column_blocks(int64_t model_dim) {
  return static_cast<unsigned>((model_dim + kColumnThreads - 1) / kColumnThreads);
}

}  // namespace

int64_t layer_norm_backward_scratch_floats(int64_t rows, int64_t model_dim) { return chunks_of(rows) * 2 * model_dim; }

void layer_norm_forward(const bf16* x, const bf16* gain, const bf16* bias, bf16* y, float* mean, float* rstd,
                        int64_t rows, int64_t model_dim, float eps, cudaStream_t stream) {
  constexpr const char* kFunction = "layer_norm_forward";
  check_sizes(kFunction, rows, model_dim);
  if (!(eps > 0.0f) || !std::isfinite(eps)) {
    throw std::invalid_argument(std::string(kFunction) + ": eps = " + std::to_string(eps) +
                                "; expected a finite eps > 0");
  }
  detail::check_not_null(kFunction, {{"x", x}, {"gain", gain}, {"bias", bias}, {"y", y}, {"mean", mean},
                                     {"rstd", rstd}});
  // Staged rows in the default 48 KB of shared memory (no opt-in attribute, which a captured decode
  // step could not set): up to kWarpsPerBlock rows a block, fewer when D is large (6 at D = 4096).
  constexpr int64_t kStagingBytes = 48 * 1024;
  const int64_t row_bytes = model_dim * int64_t{sizeof(bf16)};
  const int64_t staged_warps = std::min<int64_t>(kWarpsPerBlock, kStagingBytes / row_bytes);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool staged = model_dim % 8 == 0 && aligned(x) && aligned(y) && aligned(gain) && aligned(bias) && staged_warps >= 1;
  if (staged) {
    const auto blocks = static_cast<unsigned>((rows + staged_warps - 1) / staged_warps);
    layer_norm_forward_kernel<true><<<blocks, static_cast<unsigned>(staged_warps * 32),
                                      static_cast<size_t>(staged_warps * row_bytes), stream>>>(x, gain, bias, y, mean,
                                                                                               rstd, rows, model_dim, eps);
  } else {
    layer_norm_forward_kernel<false><<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(x, gain, bias, y, mean, rstd,
                                                                                           rows, model_dim, eps);
  }
  CUDA_CHECK(cudaGetLastError());
}

void layer_norm_backward(const float* dy, const bf16* x, const float* mean, const float* rstd, const bf16* gain,
                         float* dx, float* d_gain, float* d_bias, float* scratch, int64_t rows, int64_t model_dim,
                         bool accumulate_dx, cudaStream_t stream) {
  constexpr const char* kFunction = "layer_norm_backward";
  check_sizes(kFunction, rows, model_dim);
  detail::check_not_null(kFunction, {{"dy", dy}, {"x", x}, {"mean", mean}, {"rstd", rstd}, {"gain", gain}, {"dx", dx},
                                     {"d_gain", d_gain}, {"d_bias", d_bias}, {"scratch", scratch}});
  layer_norm_dx_kernel<<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(dy, x, mean, rstd, gain, dx, rows,
                                                                             model_dim, accumulate_dx);
  CUDA_CHECK(cudaGetLastError());
  const int64_t chunks = chunks_of(rows);
  layer_norm_parameter_partials_kernel<<<dim3(column_blocks(model_dim), static_cast<unsigned>(chunks)),
                                         kColumnThreads, 0, stream>>>(dy, x, mean, rstd, scratch, rows, model_dim);
  CUDA_CHECK(cudaGetLastError());
  const unsigned finish_blocks = static_cast<unsigned>((model_dim + kFinishColumns - 1) / kFinishColumns);
  layer_norm_parameter_finish_kernel<<<finish_blocks, dim3(kFinishColumns, kFinishLanes), 0, stream>>>(
      scratch, d_gain, d_bias, chunks, model_dim);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
