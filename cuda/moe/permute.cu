// moe/permute.cu: the gather / scatter kernels of moe/permute.h. Build: cmake --build build-gpu --target moe_cuda.
//
// Each kernel is templated on kPack, the bf16 values one lane moves per step: 8 (one 16-byte load,
// chosen when D % 8 == 0 and the pointers are 16-byte aligned) or 1 (any D). These kernels only
// move bytes, so their speed is the memory bandwidth: wide loads halve the instructions per byte,
// and each lane issues kUnroll loads before it stores anything (RowSteps), so that a warp keeps
// kUnroll x 512 bytes in flight instead of 512. Rows past the plan's true count (total_rows, read
// on the device) are neither read nor written: nothing downstream reads them.
// Measured on an H200 (moe_bench's routing overhead, T=16384 D=1024 E=64 K=1, 2026-11-22): permute
// 26.7 and un-permute 24.6 us with one load in flight per lane and every row up to max_rows written.
#include "moe/permute.h"

#include <cstdint>
#include <initializer_list>

#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/dependent_launch.h"  // launch_dependent, wait_for_previous_grid
#include "core/launch_checks.h"     // check_not_null, check_range

namespace moe::cuda {

namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;  // 128 threads: one row (or token) per warp

template <int kPack>
struct alignas(sizeof(bf16) * kPack) Pack {  // kPack = 8: 16 bytes, a single vector load/store
  bf16 value[kPack];
};

template <int kPack>
__device__ Pack<kPack> load_pack(const bf16* source) {
  return *reinterpret_cast<const Pack<kPack>*>(source);
}

template <int kPack>
__device__ void store_pack(bf16* destination, const Pack<kPack>& pack) {
  *reinterpret_cast<Pack<kPack>*>(destination) = pack;
}

template <int kPack>
__device__ Pack<kPack> zero_pack() {
  Pack<kPack> pack;
#pragma unroll
  for (int i = 0; i < kPack; ++i) pack.value[i] = __float2bfloat16(0.0f);
  return pack;
}

__device__ float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

__device__ int warp_index() { return blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize; }
__device__ int lane_index() { return threadIdx.x % kWarpSize; }

// A lane's columns of one row, in steps of kUnroll packs: step s covers the columns
// s * kStepColumns + lane * kPack + u * kWarpSize * kPack, u = 0 .. kUnroll-1 (coalesced per u).
// A kernel loads all kUnroll packs of a step (load), then computes and stores them.
constexpr int kUnroll = 4;
template <int kPack>
struct RowSteps {
  static constexpr int kStepColumns = kWarpSize * kPack * kUnroll;
  int model_dim;
  __device__ int column(int step_begin, int u) const { return step_begin + lane_index() * kPack + u * kWarpSize * kPack; }
  __device__ bool valid(int column) const { return column < model_dim; }
  // This lane's kUnroll packs of `row` at the step from step_begin: zeros past D, or everywhere
  // when row is nullptr (a padding row, a dropped slot).
  __device__ void load(const bf16* row, int step_begin, Pack<kPack> (&packs)[kUnroll]) const {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = column(step_begin, u);
      packs[u] = row != nullptr && valid(c) ? load_pack<kPack>(row + c) : zero_pack<kPack>();
    }
  }
  // f(u, column) for each of this lane's kUnroll packs of the step whose columns lie below D.
  template <class F>
  __device__ void for_each_valid(int step_begin, F f) const {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = column(step_begin, u);
      if (valid(c)) f(u, c);
    }
  }
};

// sum += weight * this lane's packs of `row` at the step from step_begin: one of a token's K slots,
// which the kernels that gather a token's rows add in slot order. A dropped slot (row < 0) adds
// nothing. weight = 1 is the plain sum (1 * x is exact, so the sum is the same as without it).
template <int kPack>
__device__ void add_slot_row(const RowSteps<kPack>& steps, const bf16* rows, int row, int step_begin, float weight,
                             float (&sum)[kUnroll][kPack]) {
  if (row < 0) return;
  Pack<kPack> value[kUnroll];
  steps.load(rows + static_cast<size_t>(row) * steps.model_dim, step_begin, value);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
    for (int i = 0; i < kPack; ++i) sum[u][i] += weight * __bfloat162float(value[u].value[i]);
  }
}

// ---- gather: x in token order -> rows in expert order, padding fused ----
template <int kPack>
__global__ void permute_tokens_kernel(const int* __restrict__ row_slot,    // [max_rows]
                                      const int* __restrict__ total_rows,  // [1]
                                      const bf16* __restrict__ x,          // [T, D]
                                      bf16* __restrict__ permuted_x,       // [max_rows, D]
                                      int max_rows, int top_k, int model_dim) {
  wait_for_previous_grid();  // dependent_launch.h: read nothing before the previous kernel is done
  const int row = warp_index();
  if (row >= max_rows || row >= *total_rows) return;
  const int slot = row_slot[row];
  const bf16* source = slot >= 0 ? x + static_cast<size_t>(slot / top_k) * model_dim : nullptr;
  bf16* destination = permuted_x + static_cast<size_t>(row) * model_dim;
  const RowSteps<kPack> steps{model_dim};
  for (int begin = 0; begin < model_dim; begin += steps.kStepColumns) {
    Pack<kPack> value[kUnroll];
    steps.load(source, begin, value);
    steps.for_each_valid(begin, [&](int u, int column) { store_pack<kPack>(destination + column, value[u]); });
  }
}

// ---- scatter and combine: y[t] = sum_k w[t, k] expert_out[row of (t, k)] ----
template <int kPack>
__global__ void unpermute_and_combine_kernel(const int* __restrict__ slot_row,          // [T*K]
                                             const float* __restrict__ combine_weights, // [T, K]
                                             const bf16* __restrict__ expert_out,       // [max_rows, D]
                                             bf16* __restrict__ y,                      // [T, D]
                                             int tokens, int top_k, int model_dim) {
  wait_for_previous_grid();  // dependent_launch.h: read nothing before the previous kernel is done
  const int token = warp_index();
  if (token >= tokens) return;
  const RowSteps<kPack> steps{model_dim};
  for (int begin = 0; begin < model_dim; begin += steps.kStepColumns) {
    float sum[kUnroll][kPack] = {};
    for (int k = 0; k < top_k; ++k) {  // a dropped slot adds zero: the residual carries the token
      const int slot = token * top_k + k;
      add_slot_row(steps, expert_out, slot_row[slot], begin, combine_weights[slot], sum);
    }
    steps.for_each_valid(begin, [&](int u, int column) {
      Pack<kPack> result;
#pragma unroll
      for (int i = 0; i < kPack; ++i) result.value[i] = __float2bfloat16(sum[u][i]);
      store_pack<kPack>(y + static_cast<size_t>(token) * model_dim + column, result);
    });
  }
}

// ---- rows computed elsewhere: expert_out[slot_row[s]] = rows[s] where replace[s] ----
__global__ void replace_slot_rows_kernel(const int* __restrict__ slot_row,    // [T*K]
                                         const bf16* __restrict__ rows,       // [T*K, D]
                                         const int32_t* __restrict__ replace, // [T*K]
                                         bf16* __restrict__ expert_out,       // [max_rows, D]
                                         int slots, int model_dim) {
  const int slot = warp_index();
  if (slot >= slots || replace[slot] == 0 || slot_row[slot] < 0) return;
  const bf16* source = rows + static_cast<size_t>(slot) * model_dim;
  bf16* destination = expert_out + static_cast<size_t>(slot_row[slot]) * model_dim;
  for (int column = static_cast<int>(threadIdx.x % 32); column < model_dim; column += 32) {
    destination[column] = source[column];
  }
}

// ---- backward of the combine, one warp per row ----
// A row knows its one slot, so it both scatters w * dy into its gradient and owns the dot product
// d_combine_weights[slot]: no atomics. Dropped slots have no row; the launcher zeroes them first.
template <int kPack>
__global__ void combine_backward_kernel(const int* __restrict__ row_slot,           // [max_rows]
                                        const int* __restrict__ total_rows,         // [1]
                                        const float* __restrict__ combine_weights,  // [T, K]
                                        const bf16* __restrict__ dy,                // [T, D]
                                        const bf16* __restrict__ expert_out,        // [max_rows, D]
                                        bf16* __restrict__ d_expert_out,            // [max_rows, D]
                                        float* __restrict__ d_combine_weights,      // [T, K]
                                        int max_rows, int top_k, int model_dim) {
  const int row = warp_index();
  if (row >= max_rows || row >= *total_rows) return;
  const int slot = row_slot[row];  // -1: a padding row, whose output never reached y: gradient 0
  const float weight = slot >= 0 ? combine_weights[slot] : 0.0f;
  const bf16* dy_row = slot >= 0 ? dy + static_cast<size_t>(slot / top_k) * model_dim : nullptr;
  const bf16* out_row = expert_out + static_cast<size_t>(row) * model_dim;
  bf16* gradient_row = d_expert_out + static_cast<size_t>(row) * model_dim;
  const RowSteps<kPack> steps{model_dim};
  float dot = 0.0f;
  for (int begin = 0; begin < model_dim; begin += steps.kStepColumns) {
    Pack<kPack> upstream[kUnroll], out[kUnroll];
    steps.load(dy_row, begin, upstream);
    steps.load(dy_row != nullptr ? out_row : nullptr, begin, out);  // a padding row's dot is 0
    steps.for_each_valid(begin, [&](int u, int column) {
      Pack<kPack> gradient;
#pragma unroll
      for (int i = 0; i < kPack; ++i) {
        const float g = __bfloat162float(upstream[u].value[i]);
        gradient.value[i] = __float2bfloat16(weight * g);
        dot += g * __bfloat162float(out[u].value[i]);
      }
      store_pack<kPack>(gradient_row + column, gradient);
    });
  }
  dot = warp_sum(dot);
  if (slot >= 0 && lane_index() == 0) d_combine_weights[slot] = dot;
}

// ---- backward of the gather: each token sums its K rows ----
template <int kPack>
__global__ void permute_backward_kernel(const int* __restrict__ slot_row,       // [T*K]
                                        const bf16* __restrict__ d_permuted_x,  // [max_rows, D]
                                        float* __restrict__ dx,                 // [T, D]
                                        int tokens, int top_k, int model_dim, bool accumulate) {
  const int token = warp_index();
  if (token >= tokens) return;
  float* dx_row = dx + static_cast<size_t>(token) * model_dim;
  const RowSteps<kPack> steps{model_dim};
  for (int begin = 0; begin < model_dim; begin += steps.kStepColumns) {
    float sum[kUnroll][kPack] = {};
    if (accumulate) {
      steps.for_each_valid(begin, [&](int u, int column) {
#pragma unroll
        for (int i = 0; i < kPack; ++i) sum[u][i] = dx_row[column + i];
      });
    }
    for (int k = 0; k < top_k; ++k) {  // a dropped slot: x reached no expert through it
      add_slot_row(steps, d_permuted_x, slot_row[token * top_k + k], begin, 1.0f, sum);
    }
    steps.for_each_valid(begin, [&](int u, int column) {
#pragma unroll
      for (int i = 0; i < kPack; ++i) dx_row[column + i] = sum[u][i];
    });
  }
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// The 16-byte path needs whole packs per row and 16-byte aligned rows.
bool use_wide_packs(int model_dim, std::initializer_list<const void*> pointers) {
  if (model_dim % 8 != 0) return false;
  for (const void* pointer : pointers) {
    if (!aligned16(pointer)) return false;
  }
  return true;
}

void check_plan(const char* function, const DevicePlan& plan, int model_dim) {
  detail::check_range(function, "plan.tokens (T)", plan.tokens, 1, INT32_MAX);
  detail::check_range(function, "plan.top_k (K)", plan.top_k, 1, INT32_MAX / plan.tokens,
                      "T * K indexes the slots");
  detail::check_range(function, "plan.max_rows", plan.max_rows, 0, INT32_MAX);
  detail::check_range(function, "model_dim (D)", model_dim, 1, INT32_MAX);
}

unsigned warp_blocks(int warps) {
  return static_cast<unsigned>((static_cast<int64_t>(warps) + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpSize;

}  // namespace

void permute_tokens(const DevicePlan& plan, const bf16* x, bf16* permuted_x, int model_dim,
                    cudaStream_t stream) {
  constexpr const char* function = "permute_tokens";
  check_plan(function, plan, model_dim);
  detail::check_not_null(function, {{"plan.row_slot", plan.row_slot}, {"plan.total_rows", plan.total_rows}, {"x", x},
                                    {"permuted_x", permuted_x}});
  if (plan.max_rows == 0) return;
  const unsigned grid = warp_blocks(plan.max_rows);
  if (use_wide_packs(model_dim, {x, permuted_x})) {
    launch_dependent(permute_tokens_kernel<8>, grid, kThreadsPerBlock, 0, stream, plan.row_slot, plan.total_rows, x,
                     permuted_x, plan.max_rows, plan.top_k, model_dim);
  } else {
    launch_dependent(permute_tokens_kernel<1>, grid, kThreadsPerBlock, 0, stream, plan.row_slot, plan.total_rows, x,
                     permuted_x, plan.max_rows, plan.top_k, model_dim);
  }
  CUDA_CHECK(cudaGetLastError());
}

void unpermute_and_combine(const DevicePlan& plan, const float* combine_weights, const bf16* expert_out,
                           bf16* y, int model_dim, cudaStream_t stream) {
  constexpr const char* function = "unpermute_and_combine";
  check_plan(function, plan, model_dim);
  detail::check_not_null(function, {{"plan.slot_row", plan.slot_row}, {"combine_weights", combine_weights},
                                    {"expert_out", expert_out}, {"y", y}});
  const unsigned grid = warp_blocks(plan.tokens);
  if (use_wide_packs(model_dim, {expert_out, y})) {
    launch_dependent(unpermute_and_combine_kernel<8>, grid, kThreadsPerBlock, 0, stream, plan.slot_row,
                     combine_weights, expert_out, y, plan.tokens, plan.top_k, model_dim);
  } else {
    launch_dependent(unpermute_and_combine_kernel<1>, grid, kThreadsPerBlock, 0, stream, plan.slot_row,
                     combine_weights, expert_out, y, plan.tokens, plan.top_k, model_dim);
  }
  CUDA_CHECK(cudaGetLastError());
}

void replace_slot_rows(const DevicePlan& plan, const bf16* rows, const int32_t* replace, bf16* expert_out,
                       int model_dim, cudaStream_t stream) {
  constexpr const char* function = "replace_slot_rows";
  check_plan(function, plan, model_dim);
  detail::check_not_null(function, {{"plan.slot_row", plan.slot_row}, {"rows", rows}, {"replace", replace},
                                    {"expert_out", expert_out}});
  const int slots = plan.tokens * plan.top_k;
  replace_slot_rows_kernel<<<warp_blocks(slots), kThreadsPerBlock, 0, stream>>>(plan.slot_row, rows, replace,
                                                                                expert_out, slots, model_dim);
  CUDA_CHECK(cudaGetLastError());
}

void combine_backward(const DevicePlan& plan, const float* combine_weights, const bf16* dy,
                      const bf16* expert_out, bf16* d_expert_out, float* d_combine_weights, int model_dim,
                      cudaStream_t stream) {
  constexpr const char* function = "combine_backward";
  check_plan(function, plan, model_dim);
  detail::check_not_null(function, {{"plan.row_slot", plan.row_slot}, {"plan.total_rows", plan.total_rows},
                                    {"combine_weights", combine_weights}, {"dy", dy}, {"expert_out", expert_out},
                                    {"d_expert_out", d_expert_out}, {"d_combine_weights", d_combine_weights}});
  // Dropped slots own no row, so no warp writes them: they start at zero.
  CUDA_CHECK(cudaMemsetAsync(d_combine_weights, 0,
                             static_cast<size_t>(plan.tokens) * plan.top_k * sizeof(float), stream));
  if (plan.max_rows == 0) return;
  const unsigned grid = warp_blocks(plan.max_rows);
  if (use_wide_packs(model_dim, {dy, expert_out, d_expert_out})) {
    combine_backward_kernel<8><<<grid, kThreadsPerBlock, 0, stream>>>(
        plan.row_slot, plan.total_rows, combine_weights, dy, expert_out, d_expert_out, d_combine_weights, plan.max_rows,
        plan.top_k, model_dim);
  } else {
    combine_backward_kernel<1><<<grid, kThreadsPerBlock, 0, stream>>>(
        plan.row_slot, plan.total_rows, combine_weights, dy, expert_out, d_expert_out, d_combine_weights, plan.max_rows,
        plan.top_k, model_dim);
  }
  CUDA_CHECK(cudaGetLastError());
}

void permute_backward(const DevicePlan& plan, const bf16* d_permuted_x, float* dx, int model_dim,
                      bool accumulate, cudaStream_t stream) {
  constexpr const char* function = "permute_backward";
  check_plan(function, plan, model_dim);
  detail::check_not_null(function, {{"plan.slot_row", plan.slot_row}, {"d_permuted_x", d_permuted_x}, {"dx", dx}});
  const unsigned grid = warp_blocks(plan.tokens);
  if (use_wide_packs(model_dim, {d_permuted_x})) {
    permute_backward_kernel<8><<<grid, kThreadsPerBlock, 0, stream>>>(
        plan.slot_row, d_permuted_x, dx, plan.tokens, plan.top_k, model_dim, accumulate);
  } else {
    permute_backward_kernel<1><<<grid, kThreadsPerBlock, 0, stream>>>(
        plan.slot_row, d_permuted_x, dx, plan.tokens, plan.top_k, model_dim, accumulate);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
