// moe/router.cu: the router kernels of moe/router.h: the fused router (logits on the tensor cores, or
// given; softmax, top-K, router statistics), cuBLAS's logits, and the router backward.
// Build: cmake --build build-gpu --target moe_cuda.
//
// Why a group of lanes per token: a token's E logits (E <= 256) fit in the registers of at most 32
// lanes, so the softmax (max, exp, sum) and the top-K selection are shuffles inside one warp: no
// shared memory, no block barriers, and the logits are read from global memory exactly once. With
// E <= 64 a whole warp per token wastes most of it (E = 64 leaves 2 logits per lane, loaded as
// scalars), so each lane holds 8 logits, two float4 loads, and a warp routes 32 / G tokens at once.
//
// Why the router losses live in the same kernel: f_e and P_e are sums over tokens of what the
// kernel already holds in registers (the chosen experts, the probabilities). A separate kernel had
// to read probs [T, E] back column by column with one block per expert. Measured on an H200 with
// ncu, 2026-11-22, at T = 16384, E = 64, K = 1 (caches flushed): the one-warp-per-token kernel
// 14.9 us (11.0 us at E = 8, K = 2), the statistics kernel (64 blocks on 132 SMs) 18.8 us and the
// loss totals kernel 5.1 us: 39 us for 4 MB in and 4 MB out, which the memory moves in ~2 us.
// Now each block sums its tokens' statistics, warp by warp in a fixed order, into one row of
// partial sums (RouterWorkspace), and the last block to finish adds the rows in block order: the
// same bits on every run, and no second pass over probs. The grid is at most kRouterMaxBlocks
// (128, about one block per SM) blocks of 1024 threads, each block looping over passes of tokens:
// few blocks keep the last block's reading small (E = 64: 128 rows of 64 doubles and ints, 96 KB),
// and 32 warps a block (held to 64 registers a thread) give every token of T = 16384, E = 64 its
// lanes at once, one pass, with all of its logits in flight.
//
// The kernel is latency-bound: 4 MB in and 4 MB out take ~2 us of memory time. Measured on an H200
// with ncu (2026-11-22, T = 16384, E = 64, K = 1, caches flushed): 512 threads a block (two passes
// of 16 warps) 13.1 us; 1024 threads 11.5 us; one release-acquire ticket in place of two
// sequentially consistent fences (and the first loads issued before the first barrier) 11.2 us, of
// which the body was 7.0 us, the ticket 0.7 us and the last block 3.4 us (its loads had been
// serialised: eight L2 round trips in a row, as the SASS showed); the last block's loads in batches
// (below) 10.4 us. At E = 8, K = 2, T = 8192: 8.7 us before, 8.1 us now. What remains is mostly
// fixed cost: the count kernel of moe/dispatch.cu, a few hundred instructions, measures 2.8 us the
// same way; then the body's one trip to memory, the ticket, and the last block's round trips to L2
// after it.
#include "moe/router.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"        // CUDA_CHECK, CudaError
#include "core/dependent_launch.h"  // launch_dependent, wait_for_previous_grid
#include "core/launch_checks.h"     // check_not_null, check_range
#include "core/mma_sync.cuh"        // mma_bf16_16816

namespace moe::cuda {

namespace {

constexpr int kWarpSize = 32;
// The router backward: one warp per token, kExpertsPerLane probabilities per lane.
constexpr int kExpertsPerLane = kRouterMaxExperts / kWarpSize;  // 8
constexpr int kWarpsPerBlock = 4;  // 128 threads: small blocks keep many tokens per SM in flight

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string("moe/router.cu: ") + call + " failed: " + cublasGetStatusString(status));
  }
}

__device__ float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// ---- fused softmax + top-K + router statistics ----
// A group of G lanes holds one token, 8 logits per lane: G = the smallest power of two with 8 G >= E
// (E = 8: 1 lane, E = 64: 8 lanes, E = 256: the whole warp). Slot s = 4 i + j of group lane g holds
//   expert (i G + g) * 4 + j,     i in {0, 1}, j in {0, 1, 2, 3}
// so each i is one float4 load per lane and the G lanes of a group read 16 G contiguous bytes: whole
// 32-byte sectors from G = 2 on (with G = 1 a lane's two loads share one sector). For one lane the
// experts grow with s, which the top-K's tie rule relies on.
constexpr int kValuesPerLane = 8;
// 32 warps, one block per SM (<= 64 registers a thread): with T = 16384, E = 64 every token has its
// lanes at once, one pass, and the 128 blocks leave 128 rows of partial sums for the last block.
constexpr int kRouteThreads = 1024;
constexpr int kRouteWarps = kRouteThreads / kWarpSize;
static_assert(kRouterMaxExperts == kWarpSize * kValuesPerLane, "a warp holds the largest E");
static_assert(kRouteThreads >= 2 * kRouterMaxExperts, "the last block gives each expert >= 2 threads");
// The last block reuses the warp rows [kRouteWarps, E] as [slices, E] with slices <= 32.
static_assert(kRouteWarps >= kWarpSize, "the slice sums fit in the warp rows");

template <int kGroupLanes>
__device__ __forceinline__ int slot_expert(int slot, int group_lane) {
  return ((slot / 4) * kGroupLanes + group_lane) * 4 + slot % 4;
}

template <int kGroupLanes>
__device__ float group_max(float value) {
  for (int offset = kGroupLanes / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));  // xor < G stays in the group
  }
  return value;
}

template <int kGroupLanes>
__device__ float group_sum(float value) {
  for (int offset = kGroupLanes / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

__device__ double warp_sum_double(double value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// A lane's 8 logits of one token; experts past E read -inf (exp gives 0, top-K skips them).
// vector_rows: E % 4 == 0 and 16-byte aligned rows, so each slot quartet is one float4.
template <int kGroupLanes>
__device__ void load_logits(const float* __restrict__ row, int group_lane, int num_experts,
                            bool vector_rows, float (&value)[kValuesPerLane]) {
#pragma unroll
  for (int i = 0; i < kValuesPerLane / 4; ++i) {
    const int first = slot_expert<kGroupLanes>(4 * i, group_lane);
    if (vector_rows) {
      const float4 quad = first < num_experts ? *reinterpret_cast<const float4*>(row + first)
                                              : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      value[4 * i] = quad.x;
      value[4 * i + 1] = quad.y;
      value[4 * i + 2] = quad.z;
      value[4 * i + 3] = quad.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) value[4 * i + j] = first + j < num_experts ? row[first + j] : -INFINITY;
    }
  }
}

template <int kGroupLanes>
__device__ void store_probs(float* __restrict__ row, int group_lane, int num_experts, bool vector_rows,
                            const float (&value)[kValuesPerLane]) {
#pragma unroll
  for (int i = 0; i < kValuesPerLane / 4; ++i) {
    const int first = slot_expert<kGroupLanes>(4 * i, group_lane);
    if (vector_rows) {
      if (first < num_experts) {
        *reinterpret_cast<float4*>(row + first) =
            make_float4(value[4 * i], value[4 * i + 1], value[4 * i + 2], value[4 * i + 3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (first + j < num_experts) row[first + j] = value[4 * i + j];
      }
    }
  }
}

// The partial sums of the statistics, one row per block, and the ticket (RouterWorkspace).
struct BlockPartials {
  double* prob_sums;  // [gridDim.x, E]
  int* counts;        // [gridDim.x, E]
  double* z_sums;     // [gridDim.x]
  unsigned* ticket;   // [1]
};

// atomicAdd(ticket, 1) with release-acquire semantics at GPU scope; returns the previous value.
__device__ __forceinline__ unsigned take_ticket(unsigned* ticket) {
  unsigned previous;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(previous) : "l"(ticket) : "memory");
  return previous;
}

// Halves the slots a lane carries: the lane whose `offset` bit is clear keeps the first half and
// adds its partner's copy of it, the partner keeps the second half. One shuffle per kept slot.
template <int kHalf>
__device__ __forceinline__ void keep_half(double (&sum)[kValuesPerLane], int offset, bool upper) {
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const double send = upper ? sum[i] : sum[i + kHalf];
    const double keep = upper ? sum[i + kHalf] : sum[i];
    sum[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
  }
}

// Slots a lane still carries after reduce_scatter_slots: 8, halved once per level, at most 3 times.
template <int kGroupLanes>
constexpr int kept_slots() {
  int kept = kValuesPerLane;
  for (int lanes = kGroupLanes; lanes < kWarpSize && kept > 1; lanes *= 2) kept /= 2;
  return kept;
}

// Adds the slot sums of the lanes of a warp that hold the same experts (lanes g, g + G, g + 2G, ...)
// as a reduce-scatter: on each of the first three levels a lane keeps half of its slots and sends
// the other half to its partner, so 8 slots cost 4 + 2 + 1 shuffles instead of 8 per level
// (G = 1: 9 double shuffles instead of 40; the shuffle unit is shared by the block's 32 warps).
// Afterwards sum[0 .. kept) hold slots first_slot .. first_slot + kept of this lane's group lane;
// returns first_slot. Levels past the third add the one remaining slot in place, so that sum sits
// in 32 / (8 G) lanes: the `writer` among them is the lowest.
template <int kGroupLanes>
__device__ __forceinline__ int reduce_scatter_slots(double (&sum)[kValuesPerLane], int lane, bool& writer) {
  int first_slot = 0;
  int offset = kGroupLanes;
  if constexpr (kGroupLanes < kWarpSize) {
    keep_half<4>(sum, offset, lane & offset);
    first_slot += (lane & offset) ? 4 : 0;
    offset *= 2;
  }
  if constexpr (kGroupLanes * 2 < kWarpSize) {
    keep_half<2>(sum, offset, lane & offset);
    first_slot += (lane & offset) ? 2 : 0;
    offset *= 2;
  }
  if constexpr (kGroupLanes * 4 < kWarpSize) {
    keep_half<1>(sum, offset, lane & offset);
    first_slot += (lane & offset) ? 1 : 0;
    offset *= 2;
  }
  for (; offset < kWarpSize; offset *= 2) sum[0] += __shfl_xor_sync(0xffffffffu, sum[0], offset);
  writer = lane < kGroupLanes * kValuesPerLane;
  return first_slot;
}

// ---- the logits from x (route_fused) ----
// A pass's logits [tokens of the pass, E] = x Wg, computed by the block's warps on the tensor cores
// (mma.sync m16n8k16: bf16 in, fp32 accumulate, as cuBLAS computes router_logits) into shared memory,
// where the groups of lanes then read them as they would read them from global memory. A warp owns
// a tile of 16 tokens x kLogitTilesPerWarp * 8 experts over all of D: it loads x's 16 rows once per
// step of 16 columns (four 32-bit loads a lane, straight from global memory: x is read once when
// E <= 32) and Wg's columns through the L1 cache (Wg is small and every warp of the grid reads it).
// Fragment layout of mma.m16n8k16 (PTX ISA, "matrix fragments for mma.m16n8k16"): lane = 4 g + t
// holds A rows g and g + 8, columns 2t, 2t+1 and 2t+8, 2t+9; B columns g, rows 2t, 2t+1 and
// 2t+8, 2t+9; C rows g and g + 8, columns 2t and 2t+1. Each 32-bit register holds two bf16, the
// lower column (A) or row (B) in the low half. The instruction: core/mma_sync.cuh.
constexpr int kLogitTilesPerWarp = 4;  // 16 fp32 accumulators a lane (the kernel is held to 64 registers)

__device__ __forceinline__ uint32_t bf16_bits(const bf16* p) { return __bfloat16_as_ushort(*p); }
__device__ __forceinline__ uint32_t pack_bf16(uint32_t low, uint32_t high) { return low | (high << 16); }


// The inputs of route_fused's logits. pair_loads: D even and x 4-byte aligned, so two neighbouring
// bf16 of a row are one 32-bit load.
struct LogitInputs {
  const bf16* x;             // [T, D]
  const bf16* gate_weights;  // [D, E]
  int model_dim;
  bool pair_loads;
  int tokens_per_pass;       // a multiple of 16, <= kRouteThreads / G
  int splits;                // S: D is cut into S ranges, one warp each, when the tiles leave warps idle
};

// Columns k .. k+15 of A (rows row0, row1) and of B (expert n): zeros past D and past E.
__device__ __forceinline__ void load_fragments(const LogitInputs& in, const bf16* row0, const bf16* row1, int k,
                                               int t, bool full_step, uint32_t (&a)[4]) {
  const int c = k + 2 * t;
  if (full_step && in.pair_loads) {
    a[0] = *reinterpret_cast<const uint32_t*>(row0 + c);
    a[1] = *reinterpret_cast<const uint32_t*>(row1 + c);
    a[2] = *reinterpret_cast<const uint32_t*>(row0 + c + 8);
    a[3] = *reinterpret_cast<const uint32_t*>(row1 + c + 8);
    return;
  }
  const int D = in.model_dim;
  const auto element = [&](const bf16* row, int column) { return column < D ? bf16_bits(row + column) : 0u; };
  a[0] = pack_bf16(element(row0, c), element(row0, c + 1));
  a[1] = pack_bf16(element(row1, c), element(row1, c + 1));
  a[2] = pack_bf16(element(row0, c + 8), element(row0, c + 9));
  a[3] = pack_bf16(element(row1, c + 8), element(row1, c + 9));
}

__device__ __forceinline__ void load_weight_fragment(const LogitInputs& in, int num_experts, int k, int t, int n,
                                                     uint32_t (&b)[2]) {
  const int r = k + 2 * t, D = in.model_dim;
  const auto element = [&](int row) {
    return row < D && n < num_experts ? uint32_t{__bfloat16_as_ushort(__ldg(in.gate_weights + size_t(row) * num_experts + n))}
                                      : 0u;
  };
  b[0] = pack_bf16(element(r), element(r + 1));
  b[1] = pack_bf16(element(r + 8), element(r + 9));
}

// pass_logits[q, i, e] = x[first_token + i, range q of D] . Wg[range q of D, e] for the pass's
// tokens_per_pass tokens (rows past T use row T - 1, as the groups do) and the S ranges of D; the
// groups add the S partial logits in range order. A warp computes one tile of one range.
__device__ void logits_of_pass(const LogitInputs& in, int tokens, int num_experts, int first_token,
                               float* __restrict__ pass_logits) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize, warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int row_tiles = in.tokens_per_pass / 16, expert_tiles = (num_experts + 7) / 8;
  const int tiles = row_tiles * ((expert_tiles + kLogitTilesPerWarp - 1) / kLogitTilesPerWarp);
  const int steps = (in.model_dim + 15) / 16, steps_per_split = (steps + in.splits - 1) / in.splits;
  for (int work = warp; work < tiles * in.splits; work += kRouteWarps) {
    const int tile = work % tiles, split = work / tiles;
    const int row_tile = tile % row_tiles, first_tile = tile / row_tiles * kLogitTilesPerWarp;
    const int row = row_tile * 16 + g;
    const bf16* row0 = in.x + static_cast<size_t>(min(first_token + row, tokens - 1)) * in.model_dim;
    const bf16* row1 = in.x + static_cast<size_t>(min(first_token + row + 8, tokens - 1)) * in.model_dim;
    const int k_end = min(in.model_dim, (split + 1) * steps_per_split * 16);
    float acc[kLogitTilesPerWarp][4] = {};
#pragma unroll 2
    for (int k = split * steps_per_split * 16; k < k_end; k += 16) {
      uint32_t a[4];
      load_fragments(in, row0, row1, k, t, k + 16 <= in.model_dim, a);
#pragma unroll
      for (int j = 0; j < kLogitTilesPerWarp; ++j) {
        if (first_tile + j >= expert_tiles) break;  // the same for the whole warp
        uint32_t b[2];
        load_weight_fragment(in, num_experts, k, t, (first_tile + j) * 8 + g, b);
        tensor_core::mma_bf16_16816(acc[j], a, b[0], b[1]);
      }
    }
    float* const out = pass_logits + static_cast<size_t>(split) * in.tokens_per_pass * num_experts;
#pragma unroll
    for (int j = 0; j < kLogitTilesPerWarp; ++j) {
      const int n = (first_tile + j) * 8 + 2 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int expert = n + i % 2, r = row + (i / 2) * 8;
        if (expert < num_experts) out[r * num_experts + expert] = acc[j][i];
      }
    }
  }
}

// A lane's 8 logits of pass token `token_in_pass`: the S partial logits added in range order.
template <int kGroupLanes>
__device__ void load_pass_logits(const float* __restrict__ pass_logits, const LogitInputs& in, int token_in_pass,
                                 int group_lane, int num_experts, float (&value)[kValuesPerLane]) {
  const size_t split_stride = static_cast<size_t>(in.tokens_per_pass) * num_experts;
  const float* row = pass_logits + static_cast<size_t>(token_in_pass) * num_experts;
#pragma unroll
  for (int slot = 0; slot < kValuesPerLane; ++slot) {
    const int expert = slot_expert<kGroupLanes>(slot, group_lane);
    float sum = -INFINITY;  // experts past E
    if (expert < num_experts) {
      sum = row[expert];
      for (int q = 1; q < in.splits; ++q) sum += row[q * split_stride + expert];
    }
    value[slot] = sum;
  }
}

// Block b handles the passes b, b + gridDim.x, ...; one pass is kRouteThreads / G consecutive tokens,
// a token per group. With 32 warps a block there is no prefetch of the next pass (it would cost
// the 8 registers that keep the kernel under 64): up to T = 128 * 1024 / G there is one pass.
// kFromX: the logits are computed here from x and Wg (route_fused), a pass at a time into shared
// memory; otherwise they are read from `logits` (route_top_k).
template <int kGroupLanes, bool kFromX>
__global__ void __launch_bounds__(kRouteThreads, 1)
route_top_k_kernel(const float* __restrict__ logits,       // [T, E], or nullptr with kFromX
                   LogitInputs from_x,                      // with kFromX
                   float* __restrict__ probs,              // [T, E]
                   int* __restrict__ top_experts,          // [T, K]
                   float* __restrict__ combine_weights,    // [T, K]
                   float* __restrict__ logsumexp,          // [T]
                   float* __restrict__ expert_fraction,    // [E]
                   float* __restrict__ mean_probs,         // [E]
                   float* __restrict__ aux_loss,           // [1]
                   float* __restrict__ z_loss,             // [1]
                   BlockPartials partials, int tokens, int num_experts, int top_k, bool renormalize,
                   bool vector_rows) {
  // A pass: kRouteThreads / G tokens, a group each; with kFromX fewer when T is small, so that the
  // logits' tiles spread over up to kRouterMaxBlocks blocks (the groups past the pass's tokens idle).
  const int tokens_per_pass = kFromX ? from_x.tokens_per_pass : kRouteThreads / kGroupLanes;
  // warp_prob_sums [kRouteWarps, E] (dynamic: 32 E doubles, 16 KB at E = 64), reused by the last
  // block as [slices, E]; slice_counts likewise.
  wait_for_previous_grid();  // dependent_launch.h: read nothing before the logits are complete
  extern __shared__ double warp_prob_sums[];
  __shared__ int block_counts[kRouterMaxExperts];
  __shared__ int slice_counts[kRouteThreads];
  __shared__ double warp_values[kRouteWarps];
  __shared__ bool is_last_block;

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int group_lane = lane % kGroupLanes;

  // This lane's share of the probability sums, in pass order, and (group lane 0) the z-loss terms
  // of its tokens. Routed counts are integers, whose sum has no order: shared atomics add them.
  double prob_sum[kValuesPerLane] = {};
  double z_sum = 0.0;

  const int passes = (tokens + tokens_per_pass - 1) / tokens_per_pass;
  const int token_in_pass = min(static_cast<int>(threadIdx.x) / kGroupLanes, tokens_per_pass - 1);
  const bool group_in_pass = static_cast<int>(threadIdx.x) / kGroupLanes < tokens_per_pass;
  // Loads clamp the token to T - 1, so a group past the end computes on a real row and every
  // shuffle has its full warp; it just stores and counts nothing.
  auto logit_row = [&](int pass) {
    const int token = min(pass * tokens_per_pass + token_in_pass, tokens - 1);
    return logits + static_cast<size_t>(token) * num_experts;
  };
  // kFromX: the pass's partial logits [S, tokens_per_pass, E] after the warp rows of partial sums.
  float* const pass_logits = reinterpret_cast<float*>(warp_prob_sums + kRouteWarps * num_experts);
  // The first pass's logits are requested before the barrier, so their trip to memory overlaps it.
  float value[kValuesPerLane];
  if constexpr (!kFromX) {
    load_logits<kGroupLanes>(logit_row(static_cast<int>(blockIdx.x)), group_lane, num_experts, vector_rows, value);
  }
  for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) block_counts[e] = 0;
  __syncthreads();  // zeroed before any group adds its choices below

  for (int pass = blockIdx.x; pass < passes; pass += gridDim.x) {
    if constexpr (kFromX) {
      if (pass != static_cast<int>(blockIdx.x)) __syncthreads();  // every group has read the last pass's
      logits_of_pass(from_x, tokens, num_experts, pass * tokens_per_pass, pass_logits);
      __syncthreads();
      load_pass_logits<kGroupLanes>(pass_logits, from_x, token_in_pass, group_lane, num_experts, value);
    } else if (pass != static_cast<int>(blockIdx.x)) {
      load_logits<kGroupLanes>(logit_row(pass), group_lane, num_experts, vector_rows, value);
    }
    const int token = pass * tokens_per_pass + token_in_pass;
    const bool active = token < tokens && group_in_pass;

    // Softmax after subtracting the row max, so exp never overflows (as the reference does).
    float row_max = -INFINITY;
#pragma unroll
    for (int s = 0; s < kValuesPerLane; ++s) row_max = fmaxf(row_max, value[s]);
    row_max = group_max<kGroupLanes>(row_max);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kValuesPerLane; ++s) {
      value[s] = slot_expert<kGroupLanes>(s, group_lane) < num_experts ? expf(value[s] - row_max) : 0.0f;
      sum += value[s];
    }
    sum = group_sum<kGroupLanes>(sum);
#pragma unroll
    for (int s = 0; s < kValuesPerLane; ++s) value[s] = value[s] / sum;
    if (active) {
      store_probs<kGroupLanes>(probs + static_cast<size_t>(token) * num_experts, group_lane, num_experts,
                               vector_rows, value);
      if (group_lane == 0) {
        const float token_logsumexp = row_max + logf(sum);
        logsumexp[token] = token_logsumexp;
        z_sum += static_cast<double>(token_logsumexp) * token_logsumexp;
      }
    }

    // Top-K: K rounds of an arg-max over the group's experts not yet taken. The comparison
    // "greater probability, or equal probability and lower index" gives the reference's order:
    // descending probability, ties to the lower expert index. The loop is unrolled to
    // kRouterMaxTopK so that chosen_prob stays in registers.
    unsigned taken = 0;  // bit s: this lane's slot s is already chosen
    float chosen_prob[kRouterMaxTopK];
    float chosen_sum = 0.0f;  // sum of the K chosen probabilities, the same on every lane of the group
#pragma unroll
    for (int k = 0; k < kRouterMaxTopK; ++k) {
      if (k >= top_k) break;  // the same K for the whole grid: no divergence
      float best = -1.0f;      // below every probability, so even an underflowed 0 can be chosen
      int best_expert = num_experts;
#pragma unroll
      for (int s = 0; s < kValuesPerLane; ++s) {
        const int expert = slot_expert<kGroupLanes>(s, group_lane);
        // s ascending means expert ascending: strict > keeps the lower index of a tie.
        if (expert < num_experts && !((taken >> s) & 1u) && value[s] > best) {
          best = value[s];
          best_expert = expert;
        }
      }
      for (int offset = kGroupLanes / 2; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_expert = __shfl_xor_sync(0xffffffffu, best_expert, offset);
        if (other > best || (other == best && other_expert < best_expert)) {
          best = other;
          best_expert = other_expert;
        }
      }
      if (best_expert < num_experts && (best_expert / 4) % kGroupLanes == group_lane) {
        taken |= 1u << ((best_expert / 4 / kGroupLanes) * 4 + best_expert % 4);
      }
      chosen_prob[k] = best;
      chosen_sum += best;
      if (active && group_lane == 0) {
        top_experts[static_cast<size_t>(token) * top_k + k] = best_expert;
        atomicAdd(&block_counts[best_expert], 1);
      }
    }
    if (active && group_lane == 0) {
#pragma unroll
      for (int k = 0; k < kRouterMaxTopK; ++k) {
        if (k >= top_k) break;
        combine_weights[static_cast<size_t>(token) * top_k + k] =
            renormalize ? chosen_prob[k] / chosen_sum : chosen_prob[k];
      }
    }
    if (active) {
#pragma unroll
      for (int s = 0; s < kValuesPerLane; ++s) prob_sum[s] += value[s];
    }
  }

  // ---- this block's partial sums ----
  double* const warp_row = warp_prob_sums + warp * num_experts;
  bool writer = false;
  const int first_slot = reduce_scatter_slots<kGroupLanes>(prob_sum, lane, writer);
#pragma unroll
  for (int i = 0; i < kept_slots<kGroupLanes>(); ++i) {
    const int expert = slot_expert<kGroupLanes>(first_slot + i, group_lane);
    if (writer && expert < num_experts) warp_row[expert] = prob_sum[i];
  }
  z_sum = warp_sum_double(z_sum);
  if (lane == 0) warp_values[warp] = z_sum;
  __syncthreads();
  const int block_row = static_cast<int>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) {
    double block_sum = 0.0;
    for (int w = 0; w < kRouteWarps; ++w) block_sum += warp_prob_sums[w * num_experts + e];
    partials.prob_sums[block_row + e] = block_sum;
    partials.counts[block_row + e] = block_counts[e];
  }
  if (threadIdx.x == 0) {
    double block_z = 0.0;
    for (int w = 0; w < kRouteWarps; ++w) block_z += warp_values[w];
    partials.z_sums[blockIdx.x] = block_z;
  }

  // ---- the last block to finish adds the partial sums, in block order ----
  // The threadfence reduction (CUDA programming guide, "memory fence functions") with one
  // release-acquire ticket instead of two __threadfence() (fence.sc, the costliest fence): the
  // barrier orders the block's partial-sum writes before thread 0's release, which is cumulative
  // (CUTLASS's semaphore relies on the same), and the acquire of the block that draws the last
  // ticket then sees every block's partials.
  __syncthreads();
  if (threadIdx.x == 0) is_last_block = take_ticket(partials.ticket) == gridDim.x - 1;
  __syncthreads();
  if (!is_last_block) return;

  // E <= 256 and 1024 threads: each expert's column of block rows is split into `slices` strided
  // runs (E = 64: 16 runs of 8 blocks), which are then added in slice order; at most 32 runs, so
  // that adding them is short even for E = 1. __ldcg reads from L2, where the other blocks' writes
  // are, never from this SM's L1.
  const int slices = min(kRouteThreads / num_experts, kWarpSize);
  const int expert = static_cast<int>(threadIdx.x) % num_experts;
  const int slice = static_cast<int>(threadIdx.x) / num_experts;
  double* slice_prob_sums = warp_prob_sums;  // [slices, E], free again after the barriers above
  // Loads go in batches of kRowsInFlight, issued before any is added: written as a plain strided
  // loop, the compiler (held to 64 registers) reused one register and waited for each load in turn,
  // eight L2 round trips in a row (3.4 us of 11 at T = 16384, E = 64). Rows past the grid read 0,
  // which leaves a sum's bits unchanged: the order of the additions is still block order.
  constexpr int kRowsInFlight = 8;
  const int grid = static_cast<int>(gridDim.x);
  if (slice < slices) {
    double prob_total = 0.0;
    int count_total = 0;
    for (int first = slice; first < grid; first += kRowsInFlight * slices) {
      double prob[kRowsInFlight];
      int count[kRowsInFlight];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        const int block = first + i * slices;
        prob[i] = block < grid ? __ldcg(&partials.prob_sums[block * num_experts + expert]) : 0.0;
        count[i] = block < grid ? __ldcg(&partials.counts[block * num_experts + expert]) : 0;
      }
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        prob_total += prob[i];
        count_total += count[i];
      }
    }
    slice_prob_sums[slice * num_experts + expert] = prob_total;
    slice_counts[slice * num_experts + expert] = count_total;
  }
  if (warp == kRouteWarps - 1) {  // the z-loss: blocks strided over the lanes, then a fixed tree
    double z[kRouterMaxBlocks / kWarpSize];
#pragma unroll
    for (int i = 0; i < kRouterMaxBlocks / kWarpSize; ++i) {
      const int block = lane + i * kWarpSize;
      z[i] = block < grid ? __ldcg(&partials.z_sums[block]) : 0.0;
    }
    double z_total = 0.0;
#pragma unroll
    for (int i = 0; i < kRouterMaxBlocks / kWarpSize; ++i) z_total += z[i];
    z_total = warp_sum_double(z_total);
    if (lane == 0) *z_loss = static_cast<float>(z_total / tokens);
  }
  __syncthreads();
  double aux_term = 0.0;  // f_e P_e of the rounded outputs, as the reference's dot product
  if (threadIdx.x < num_experts) {
    double prob_total = 0.0;
    int count_total = 0;
    for (int s = 0; s < slices; ++s) {
      prob_total += slice_prob_sums[s * num_experts + expert];
      count_total += slice_counts[s * num_experts + expert];
    }
    const float mean_prob = static_cast<float>(prob_total / tokens);
    const float fraction = static_cast<float>(static_cast<double>(count_total) / (static_cast<double>(tokens) * top_k));
    mean_probs[expert] = mean_prob;
    expert_fraction[expert] = fraction;
    aux_term = static_cast<double>(fraction) * mean_prob;
  }
  // aux = E sum_e f_e P_e: each warp sums its experts in a fixed tree, then warp 0 adds the warps.
  aux_term = warp_sum_double(aux_term);
  if (lane == 0) warp_values[warp] = aux_term;
  __syncthreads();
  if (threadIdx.x == 0) {
    double aux = 0.0;
    for (int w = 0; w < kRouteWarps; ++w) aux += warp_values[w];
    *aux_loss = static_cast<float>(num_experts * aux);
    *partials.ticket = 0;  // every block has taken its ticket: ready for the next launch
  }
}

// ---- router backward ----
// The same register layout as the forward kernel: lane holds probs and d_probs of experts
// lane + 32 i. The K chosen experts are distinct, so each gradient lands in exactly one register.
__global__ void router_backward_kernel(const float* __restrict__ probs,              // [T, E]
                                       const float* __restrict__ logsumexp,          // [T]
                                       const int* __restrict__ top_experts,          // [T, K]
                                       const float* __restrict__ d_combine_weights,  // [T, K]
                                       const float* __restrict__ expert_fraction,    // [E]
                                       float* __restrict__ d_logits,                 // [T, E]
                                       int tokens, int num_experts, int top_k, bool renormalize,
                                       float aux_scale,      // aux_coef * E / T
                                       float z_coef_scale) { // z_coef * 2 / T
  const int lane = threadIdx.x % kWarpSize;
  const int token = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= tokens) return;  // warp-uniform
  const float* prob_row = probs + static_cast<size_t>(token) * num_experts;
  const int* chosen = top_experts + static_cast<size_t>(token) * top_k;
  const float* d_weight = d_combine_weights + static_cast<size_t>(token) * top_k;

  float prob[kExpertsPerLane], d_prob[kExpertsPerLane];
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    prob[i] = expert < num_experts ? prob_row[expert] : 0.0f;
    // aux = E sum_e f_e P_e and P_e = mean_t probs[t, e]: every token gets coef * E / T * f_e.
    d_prob[i] = expert < num_experts ? aux_scale * expert_fraction[expert] : 0.0f;
  }

  // Combine weights w_k = p_k / S (renormalised): dL/dp_k = (dw_k - sum_j dw_j w_j) / S.
  float chosen_sum = 1.0f, weighted = 0.0f;
  if (renormalize) {
    chosen_sum = 0.0f;
    for (int k = 0; k < top_k; ++k) chosen_sum += prob_row[chosen[k]];
    for (int k = 0; k < top_k; ++k) weighted += d_weight[k] * (prob_row[chosen[k]] / chosen_sum);
  }
  for (int k = 0; k < top_k; ++k) {
    const int expert = chosen[k];
    const float gradient = renormalize ? (d_weight[k] - weighted) / chosen_sum : d_weight[k];
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      if (expert == lane + i * kWarpSize) d_prob[i] += gradient;
    }
  }

  // Softmax backward: d_logit = p (d_p - <p, d_p>); z-loss: d lse / d logit = p.
  float inner = 0.0f;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) inner += prob[i] * d_prob[i];
  inner = warp_sum(inner);
  const float z_scale = z_coef_scale * logsumexp[token];
  float* out_row = d_logits + static_cast<size_t>(token) * num_experts;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    if (expert < num_experts) out_row[expert] = prob[i] * (d_prob[i] - inner) + z_scale * prob[i];
  }
}

void check_router_sizes(const char* function, int tokens, int num_experts, int top_k) {
  detail::check_range(function, "tokens (T)", tokens, 1, INT32_MAX / kRouterMaxExperts,
                      "T * E indexes the logits");
  detail::check_range(function, "num_experts (E)", num_experts, 1, kRouterMaxExperts,
                      "kRouterMaxExperts: one warp holds a token's logits in registers");
  detail::check_range(function, "top_k (K)", top_k, 1, std::min(num_experts, kRouterMaxTopK),
                      "K <= E and K <= kRouterMaxTopK");
}

unsigned token_blocks(int tokens) { return static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void router_logits(cublasHandle_t handle, const bf16* x, const bf16* gate_weights, float* logits,
                   int tokens, int model_dim, int num_experts, cudaStream_t stream) {
  constexpr const char* function = "router_logits";
  detail::check_not_null(function, {{"handle", handle}, {"x", x}, {"gate_weights", gate_weights}, {"logits", logits}});
  detail::check_range(function, "tokens (T)", tokens, 1, INT32_MAX);
  detail::check_range(function, "model_dim (D)", model_dim, 1, INT32_MAX);
  detail::check_range(function, "num_experts (E)", num_experts, 1, INT32_MAX);
  check_cublas(cublasSetStream(handle, stream), "cublasSetStream");
  // cuBLAS is column-major. A row-major [T, E] matrix is a column-major [E, T] one, so compute
  // logits^T [E, T] = Wg^T [E, D] * x^T [D, T]: the row-major buffers of Wg and x are exactly
  // those column-major transposes, with leading dimensions E and D.
  const float alpha = 1.0f, beta = 0.0f;
  check_cublas(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, num_experts, tokens, model_dim, &alpha,
                            gate_weights, CUDA_R_16BF, num_experts, x, CUDA_R_16BF, model_dim, &beta,
                            logits, CUDA_R_32F, num_experts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (router logits)");
}

namespace {
int checked_workspace_experts(int experts) {
  detail::check_range("RouterWorkspace", "num_experts (E)", experts, 1, kRouterMaxExperts, "kRouterMaxExperts");
  return experts;
}
}  // namespace

RouterWorkspace::RouterWorkspace(int experts)
    : num_experts(checked_workspace_experts(experts)),
      block_prob_sums(size_t(kRouterMaxBlocks) * experts),
      block_counts(size_t(kRouterMaxBlocks) * experts),
      block_z_sums(kRouterMaxBlocks),
      ticket(1) {
  ticket.fill_bytes(0);  // done before any stream's route_top_k reads it
}

namespace {

// The outputs shared by route_top_k and route_fused, checked.
struct RouteOutputs {
  float* probs;
  int* top_experts;
  float* combine_weights;
  float* logsumexp;
  float* expert_fraction;
  float* mean_probs;
  float* aux_loss;
  float* z_loss;
};

void check_route(const char* function, const RouteOutputs& out, const RouterWorkspace& workspace, int tokens,
                 int num_experts, int top_k) {
  check_router_sizes(function, tokens, num_experts, top_k);
  detail::check_range(function, "num_experts (E)", num_experts, 1, workspace.num_experts,
                      "the RouterWorkspace was sized for that many experts");
  detail::check_not_null(function, {{"probs", out.probs}, {"top_experts", out.top_experts},
                                    {"combine_weights", out.combine_weights}, {"logsumexp", out.logsumexp},
                                    {"expert_fraction", out.expert_fraction}, {"mean_probs", out.mean_probs},
                                    {"aux_loss", out.aux_loss}, {"z_loss", out.z_loss}});
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// One launch of route_top_k_kernel<G, kFromX>: logits from `logits`, or (kFromX) from `from_x`.
template <bool kFromX>
void launch_route(const float* logits, const LogitInputs& from_x, const RouteOutputs& out, RouterWorkspace& workspace,
                  int tokens, int num_experts, int top_k, bool renormalize, cudaStream_t stream) {
  // Lanes per token: the smallest power of two G with 8 G >= E.
  int group_lanes = 1;
  while (group_lanes * kValuesPerLane < num_experts) group_lanes *= 2;
  // The grid depends on T and E only, never on the device, so the order of the sums (and so every
  // bit of the statistics) is the same on any GPU.
  // kFromX: passes of at least 16 tokens and as many as the blocks can take, so that a small T still
  // spreads its logits over up to kRouterMaxBlocks blocks; the warps the tiles leave idle each take
  // one of S ranges of D (S <= 32 / tiles), whose partial logits the groups add in range order.
  LogitInputs in = from_x;
  int tokens_per_pass = kRouteThreads / group_lanes;
  if (kFromX) {
    const int per_block = (tokens + kRouterMaxBlocks - 1) / kRouterMaxBlocks;
    tokens_per_pass = std::min(tokens_per_pass, std::max(16, (per_block + 15) / 16 * 16));
    const int expert_tiles = (num_experts + 7) / 8;
    const int tiles = tokens_per_pass / 16 * ((expert_tiles + kLogitTilesPerWarp - 1) / kLogitTilesPerWarp);
    in.tokens_per_pass = tokens_per_pass;
    in.splits = std::max(1, std::min(kRouteWarps / tiles, (from_x.model_dim + 15) / 16));
  }
  const int passes = (tokens + tokens_per_pass - 1) / tokens_per_pass;
  const unsigned blocks = static_cast<unsigned>(std::min(passes, kRouterMaxBlocks));
  // Float4 rows: E % 4 == 0 and 16-byte aligned rows (the shared pass logits always are).
  const bool vector_rows = num_experts % 4 == 0 && (kFromX || aligned16(logits)) && aligned16(out.probs);
  const BlockPartials partials{workspace.block_prob_sums.data(), workspace.block_counts.data(),
                               workspace.block_z_sums.data(), workspace.ticket.data()};
  // The warp rows of partial sums (32 E doubles), and with kFromX a pass's partial logits (S
  // tokens_per_pass E floats, <= 64 KB). Beside them about 5.3 KB of static shared memory: past 40 KB
  // of dynamic the kernel needs the opt-in to more than the default 48 KB.
  const size_t shared_bytes = size_t(kRouteWarps) * num_experts * sizeof(double) +
                              (kFromX ? size_t(in.splits) * tokens_per_pass * num_experts * sizeof(float) : 0);
  const auto launch = [&](auto kernel) {
    if (shared_bytes > 40 * 1024) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(shared_bytes)));
    }
    launch_dependent(kernel, blocks, kRouteThreads, shared_bytes, stream, logits, in, out.probs, out.top_experts,
                     out.combine_weights, out.logsumexp, out.expert_fraction, out.mean_probs, out.aux_loss,
                     out.z_loss, partials, tokens, num_experts, top_k, renormalize, vector_rows);
  };
  switch (group_lanes) {
    case 1: launch(route_top_k_kernel<1, kFromX>); break;
    case 2: launch(route_top_k_kernel<2, kFromX>); break;
    case 4: launch(route_top_k_kernel<4, kFromX>); break;
    case 8: launch(route_top_k_kernel<8, kFromX>); break;
    case 16: launch(route_top_k_kernel<16, kFromX>); break;
    default: launch(route_top_k_kernel<32, kFromX>); break;
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void route_top_k(const float* logits, float* probs, int* top_experts, float* combine_weights, float* logsumexp,
                 float* expert_fraction, float* mean_probs, float* aux_loss, float* z_loss,
                 RouterWorkspace& workspace, int tokens, int num_experts, int top_k, bool renormalize,
                 cudaStream_t stream) {
  const RouteOutputs out{probs, top_experts, combine_weights, logsumexp, expert_fraction, mean_probs, aux_loss, z_loss};
  check_route("route_top_k", out, workspace, tokens, num_experts, top_k);
  detail::check_not_null("route_top_k", "logits", logits);
  launch_route<false>(logits, LogitInputs{}, out, workspace, tokens, num_experts, top_k, renormalize, stream);
}

void route_fused(const bf16* x, const bf16* gate_weights, int model_dim, float* probs, int* top_experts,
                 float* combine_weights, float* logsumexp, float* expert_fraction, float* mean_probs,
                 float* aux_loss, float* z_loss, RouterWorkspace& workspace, int tokens, int num_experts, int top_k,
                 bool renormalize, cudaStream_t stream) {
  constexpr const char* function = "route_fused";
  const RouteOutputs out{probs, top_experts, combine_weights, logsumexp, expert_fraction, mean_probs, aux_loss, z_loss};
  check_route(function, out, workspace, tokens, num_experts, top_k);
  detail::check_not_null(function, "x", x);
  detail::check_not_null(function, "gate_weights", gate_weights);
  detail::check_range(function, "model_dim (D)", model_dim, 1, INT32_MAX / kRouterMaxExperts, "D * E indexes Wg");
  const LogitInputs from_x{x, gate_weights, model_dim,
                           model_dim % 2 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0};
  launch_route<true>(nullptr, from_x, out, workspace, tokens, num_experts, top_k, renormalize, stream);
}

void router_backward(const float* probs, const float* logsumexp, const int* top_experts,
                     const float* d_combine_weights, const float* expert_fraction, float* d_logits,
                     int tokens, int num_experts, int top_k, bool renormalize, double aux_loss_coef,
                     double z_loss_coef, cudaStream_t stream) {
  constexpr const char* function = "router_backward";
  check_router_sizes(function, tokens, num_experts, top_k);
  detail::check_not_null(function, {{"probs", probs}, {"logsumexp", logsumexp}, {"top_experts", top_experts},
                                    {"d_combine_weights", d_combine_weights}, {"expert_fraction", expert_fraction},
                                    {"d_logits", d_logits}});
  if (!std::isfinite(aux_loss_coef) || !std::isfinite(z_loss_coef)) {
    throw std::invalid_argument(std::string(function) + ": aux_loss_coef = " + std::to_string(aux_loss_coef) +
                                ", z_loss_coef = " + std::to_string(z_loss_coef) + "; expected finite numbers");
  }
  const float aux_scale = static_cast<float>(aux_loss_coef * num_experts / tokens);
  const float z_coef_scale = static_cast<float>(z_loss_coef * 2.0 / tokens);
  router_backward_kernel<<<token_blocks(tokens), kWarpsPerBlock * kWarpSize, 0, stream>>>(
      probs, logsumexp, top_experts, d_combine_weights, expert_fraction, d_logits, tokens, num_experts,
      top_k, renormalize, aux_scale, z_coef_scale);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
