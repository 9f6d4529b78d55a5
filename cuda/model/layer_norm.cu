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
                                     const bf16* gain, float* dx, bf16* dx_bf16, int64_t rows, int64_t model_dim,
                                     bool accumulate) {
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
    const float out = accumulate ? dx_row[j] + value : value;
    dx_row[j] = out;
    if (dx_bf16 != nullptr) dx_bf16[row * model_dim + j] = __float2bfloat16(out);
  }
}

// The fused backward, for D = 128 G (G = 1 .. kMaxFusedGroups) with dy and dx 16-byte aligned and x and
// gain 8-byte aligned: one pass over dy and x gives dx (and its bf16 copy) and the chunk's parameter
// partials. The two kernels below read dy and x twice, once per row for dx and once per column for
// the partials, and the model then cast dx to bf16 in a third: at T = 16384, D = 512 that was 218 MB
// and 39 + 36 + 12 us an LN on an H200; this kernel moves 134 MB in 35 us (moe_train
// --benchmark-kernel-trace, 2026-11-30).
// Block b owns chunk b (kLayerNormRowsPerChunk rows); warp w takes the chunk's rows w * 8 .. w * 8 + 7 in
// order. Lane l holds columns 128 g + 4 l .. 128 g + 4 l + 3 of each group g: float4 loads of dy and dx,
// 8-byte loads of x. Each lane adds its columns' dy x_hat and dy over its warp's rows, then the warps'
// sums are added in warp order through shared memory: a fixed order, so the gradient is the same bits
// on every run (not the two-kernel path's bits: that one adds a column's 64 rows in one sequence).
constexpr int kMaxFusedGroups = 8;  // D up to 1024: 2 x 4 G accumulators and G float4 of dy a lane
constexpr int kFusedRowsPerWarp = static_cast<int>(kLayerNormRowsPerChunk) / kWarpsPerBlock;

template <int G>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_backward_fused_kernel(const float* __restrict__ dy, const bf16* __restrict__ x,
                                     const float* __restrict__ mean, const float* __restrict__ rstd,
                                     const bf16* __restrict__ gain, float* __restrict__ dx,
                                     bf16* __restrict__ dx_bf16, float* __restrict__ scratch, int64_t rows,
                                     bool accumulate) {
  constexpr int D = 128 * G;
  __shared__ float4 block_sums[2][D / 4];  // [dy x_hat | dy][column / 4]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunk = blockIdx.x;
  float gains[G][4];
  for (int g = 0; g < G; ++g) {
    const uint2 packed = *reinterpret_cast<const uint2*>(gain + g * 128 + lane * 4);
    const bf16* pair = reinterpret_cast<const bf16*>(&packed);
    for (int i = 0; i < 4; ++i) gains[g][i] = __bfloat162float(pair[i]);
  }
  float sum_dy_x_hat[G][4] = {}, sum_dy[G][4] = {};
  for (int r = 0; r < kFusedRowsPerWarp; ++r) {
    const int64_t row = chunk * kLayerNormRowsPerChunk + warp * kFusedRowsPerWarp + r;
    if (row >= rows) break;
    const float row_mean = mean[row], row_rstd = rstd[row];
    float d[G][4], x_hat[G][4];
    float4 before[G];  // dx's value before this backward, loaded with dy (accumulate)
    float sum_g = 0.0f, sum_g_x_hat = 0.0f;
    for (int g = 0; g < G; ++g) {
      const int64_t at = row * D + g * 128 + lane * 4;
      before[g] = accumulate ? *reinterpret_cast<const float4*>(dx + at) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      const float4 dy4 = *reinterpret_cast<const float4*>(dy + at);
      const uint2 packed = *reinterpret_cast<const uint2*>(x + at);
      const bf16* xs = reinterpret_cast<const bf16*>(&packed);
      d[g][0] = dy4.x, d[g][1] = dy4.y, d[g][2] = dy4.z, d[g][3] = dy4.w;
      for (int i = 0; i < 4; ++i) {
        x_hat[g][i] = (__bfloat162float(xs[i]) - row_mean) * row_rstd;
        const float gi = d[g][i] * gains[g][i];
        sum_g += gi;
        sum_g_x_hat += gi * x_hat[g][i];
      }
    }
    const float mean_g = detail::warp_sum(sum_g) / static_cast<float>(D);
    const float mean_g_x_hat = detail::warp_sum(sum_g_x_hat) / static_cast<float>(D);
    for (int g = 0; g < G; ++g) {
      const int64_t at = row * D + g * 128 + lane * 4;
      float value[4];
      for (int i = 0; i < 4; ++i) {
        value[i] = row_rstd * (d[g][i] * gains[g][i] - mean_g - x_hat[g][i] * mean_g_x_hat);
        sum_dy_x_hat[g][i] += d[g][i] * x_hat[g][i];
        sum_dy[g][i] += d[g][i];
      }
      const float4 out = accumulate ? make_float4(before[g].x + value[0], before[g].y + value[1],
                                                  before[g].z + value[2], before[g].w + value[3])
                                    : make_float4(value[0], value[1], value[2], value[3]);
      *reinterpret_cast<float4*>(dx + at) = out;
      if (dx_bf16 != nullptr) {
        const __nv_bfloat162 low = __floats2bfloat162_rn(out.x, out.y), high = __floats2bfloat162_rn(out.z, out.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&low);
        packed.y = *reinterpret_cast<const uint32_t*>(&high);
        *reinterpret_cast<uint2*>(dx_bf16 + at) = packed;
      }
    }
  }
  // The warps' partials, added in warp order: warp 0 writes, then each next warp adds its own.
  for (int turn = 0; turn < kWarpsPerBlock; ++turn) {
    if (warp == turn) {
      for (int g = 0; g < G; ++g) {
        float4& a = block_sums[0][g * 32 + lane];
        float4& b = block_sums[1][g * 32 + lane];
        const float4 a_new = make_float4(sum_dy_x_hat[g][0], sum_dy_x_hat[g][1], sum_dy_x_hat[g][2], sum_dy_x_hat[g][3]);
        const float4 b_new = make_float4(sum_dy[g][0], sum_dy[g][1], sum_dy[g][2], sum_dy[g][3]);
        a = turn == 0 ? a_new : make_float4(a.x + a_new.x, a.y + a_new.y, a.z + a_new.z, a.w + a_new.w);
        b = turn == 0 ? b_new : make_float4(b.x + b_new.x, b.y + b_new.y, b.z + b_new.z, b.w + b_new.w);
      }
    }
    __syncthreads();
  }
  // scratch [chunk][2][D], as the two-kernel path writes it.
  float4* out = reinterpret_cast<float4*>(scratch + chunk * 2 * D);
  for (int i = threadIdx.x; i < 2 * D / 4; i += blockDim.x) out[i] = block_sums[i / (D / 4)][i % (D / 4)];
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
                         bool accumulate_dx, cudaStream_t stream, bf16* dx_bf16) {
  constexpr const char* kFunction = "layer_norm_backward";
  check_sizes(kFunction, rows, model_dim);
  detail::check_not_null(kFunction, {{"dy", dy}, {"x", x}, {"mean", mean}, {"rstd", rstd}, {"gain", gain}, {"dx", dx},
                                     {"d_gain", d_gain}, {"d_bias", d_bias}, {"scratch", scratch}});
  const int64_t chunks = chunks_of(rows);
  auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  const bool fused = model_dim % 128 == 0 && model_dim / 128 <= kMaxFusedGroups && aligned(dy, 16) &&
                     aligned(dx, 16) && aligned(scratch, 16) && aligned(x, 8) && aligned(gain, 8) &&
                     aligned(dx_bf16, 8);
  if (fused) {
    const auto fused_launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(chunks), kWarpsPerBlock * 32, 0, stream>>>(dy, x, mean, rstd, gain, dx, dx_bf16,
                                                                             scratch, rows, accumulate_dx);
    };
    switch (model_dim / 128) {
      case 1: fused_launch(layer_norm_backward_fused_kernel<1>); break;
      case 2: fused_launch(layer_norm_backward_fused_kernel<2>); break;
      case 3: fused_launch(layer_norm_backward_fused_kernel<3>); break;
      case 4: fused_launch(layer_norm_backward_fused_kernel<4>); break;
      case 5: fused_launch(layer_norm_backward_fused_kernel<5>); break;
      case 6: fused_launch(layer_norm_backward_fused_kernel<6>); break;
      case 7: fused_launch(layer_norm_backward_fused_kernel<7>); break;
      default: fused_launch(layer_norm_backward_fused_kernel<8>); break;
    }
    CUDA_CHECK(cudaGetLastError());
  } else {
    layer_norm_dx_kernel<<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(dy, x, mean, rstd, gain, dx, dx_bf16,
                                                                               rows, model_dim, accumulate_dx);
    CUDA_CHECK(cudaGetLastError());
    layer_norm_parameter_partials_kernel<<<dim3(column_blocks(model_dim), static_cast<unsigned>(chunks)),
                                           kColumnThreads, 0, stream>>>(dy, x, mean, rstd, scratch, rows, model_dim);
    CUDA_CHECK(cudaGetLastError());
  }
  const unsigned finish_blocks = static_cast<unsigned>((model_dim + kFinishColumns - 1) / kFinishColumns);
  layer_norm_parameter_finish_kernel<<<finish_blocks, dim3(kFinishColumns, kFinishLanes), 0, stream>>>(
      scratch, d_gain, d_bias, chunks, model_dim);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
