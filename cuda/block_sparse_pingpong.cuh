// block_sparse_pingpong.cuh: the weight gradient dW2 = hᵀ dy (DSᵀD) on Hopper with a "ping-pong"
// schedule (CUTLASS calls its kernel KernelTmaWarpSpecializedPingpong): two consumer warpgroups
// take turns over whole tiles, so that one stores its tile while the other multiplies the next. An
// experiment beside the mainline's cooperative kernel (block_sparse_wgmma_ws.cuh), taken only when
// set_weight_gradient_pingpong(true) (moe_bench --gradient-pingpong on).
//
// Why: at T=16384 D=1024 E=64 an expert has 256 rows, so a weight-gradient tile runs 4 k-steps and
// then writes 64 KB. In the cooperative kernel both consumers multiply one 128 x 256 tile and then
// both store it, and the tensor cores idle through every store: traced in place the product takes
// 0.33 ms where dense cuBLAS's dW GEMM takes 0.17 (notebooks_data/bench/trace_2026-11-22_h200.txt),
// and neither fewer operand copies nor multicast pairs closed it. Here:
//   - a tile is 128 rows x 128 columns, and a consumer owns it whole: two m64n128k16 a 16-deep slice
//     (rows 0-63 into acc[0..63], rows 64-127 into acc[64..127]), the same 128 accumulators a thread
//     as the cooperative kernel's m64n256k16;
//   - the producer (one thread, TMA) fills a ring of STAGES stages of A [128 m][64 k] (two [64 k]
//     [64 m] boxes, M-major) and B [64 k][128 n] (two [64 k][64 n] boxes) with the k-steps of this
//     CTA's tiles in order; tile j of those the CTA runs belongs to consumer j % 2;
//   - an order barrier (done[c], after the stages' barriers) lets consumer c start the k-loop of its
//     tile j only once consumer c ^ 1 has finished the k-loop of tile j - 1. The tensor cores then
//     serve one consumer at a time, and each consumer's stores run under the other's k-loop;
//   - the stores leave through the bulk-copy epilogue (ws_bulk_epilogue, two bands of 64 rows).
// The price: a 128 x 128 tile copies 32 KB into shared memory per million multiply-adds, where
// 128 x 256 copies 48 KB per two million: a third more.
// Parity: every role counts the ring's k-steps over all of the CTA's tiles (`iteration`), a consumer
// the other's too. A consumer jumps a whole tile ahead in that count, and mbarrier parity tells
// apart only two phases; the order barrier is what makes the jump safe: when consumer c waits on
// full[s] for use u, use u - 1 of stage s was consumed either by itself or by the other consumer in a
// k-loop that has finished, so that phase has completed and parity u & 1 names use u alone. Likewise
// done[c] cannot run two phases ahead of its waiter: consumer c finishes tile j + 2 only after
// waiting for the other's tile j + 1.
// An earlier ping-pong kernel for the SDD (commit 768a43f, twelfth session) measured 1-5% slower than
// the cooperative one; its SDD tiles run 16-32 k-steps, these 4.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, B block size.
#pragma once

#include "block_sparse_wgmma_ws.cuh"  // mbarriers, TMA, ws_tma_copy, the epilogues

namespace moe::cuda::block_sparse_detail {

constexpr int kPingPongBlockN = 128;  // a consumer's tile: 128 rows x 128 columns
constexpr int kPingPongStageBytes = (kWgmmaBlockM + kPingPongBlockN) * kBlockK * static_cast<int>(sizeof(bf16));
// The 1024-byte alignment slack, the stages, the bulk epilogue's staging (its 8 warps), then full[STAGES],
// empty[STAGES] and done[2].
template <int STAGES>
constexpr int pingpong_shared_bytes() {
  return 1024 + STAGES * kPingPongStageBytes + 8 * kWsBulkWarpBytes + (2 * STAGES + 2) * 8;
}
// The products this kernel takes: DSᵀD (its B the rows of dy at 128 columns n0 .., its output a plain
// matrix per expert).
template <class Problem>
concept WsPingPong = WsBulkStore<Problem> && WsSharedB<Problem> && requires(const Problem& p) { p.n0; };

template <int STAGES, class Problem>
__global__ void __launch_bounds__(kWsThreads, 1)
    block_sparse_pingpong_kernel(const Problem parameters, const __grid_constant__ TmaMaps maps, int tiles_x, int tiles,
                                 int group_rows) {
  static_assert(STAGES >= 2, "one stage filling while one is read");
  static_assert(pingpong_shared_bytes<STAGES>() <= 227 * 1024, "Hopper gives a CTA at most 227 KB of shared memory");
  static_assert(WsPingPong<Problem>, "the ping-pong kernel takes DSᵀD");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool a_m_major = Problem::a_layout == Layout::row_major_km;
  constexpr bool b_n_major = Problem::b_layout == Layout::row_major_km;
  constexpr uint32_t a_bytes = kWgmmaBlockM * kBlockK * sizeof(bf16);     // 16 KB
  constexpr uint32_t b_bytes = kPingPongBlockN * kBlockK * sizeof(bf16);  // 16 KB

  extern __shared__ unsigned char shared_bytes[];
  const uint32_t shared_raw = static_cast<uint32_t>(__cvta_generic_to_shared(shared_bytes));
  const uint32_t shared_base = (shared_raw + 1023u) & ~1023u;
  const uint32_t staging_base = shared_base + STAGES * kPingPongStageBytes;
  const uint32_t barriers = staging_base + 8 * kWsBulkWarpBytes;
  auto full = [&](int stage) { return barriers + stage * 8; };
  auto empty = [&](int stage) { return barriers + (STAGES + stage) * 8; };
  auto done = [&](int consumer) { return barriers + (2 * STAGES + consumer) * 8; };
  auto stage_a = [&](int stage) { return shared_base + stage * kPingPongStageBytes; };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(full(s), 1);   // the producer's expect_tx arrival
      mbarrier_init(empty(s), 4);  // the 4 warps of the consumer whose tile the stage holds
    }
    for (int c = 0; c < 2; ++c) mbarrier_init(done(c), 4);  // consumer c's warps, after a k-loop
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // This CTA's tiles: worker, worker + workers, ... in ws_tile_coordinates' order.
  const int workers = static_cast<int>(gridDim.x), worker = static_cast<int>(blockIdx.x);
  auto begin_tile = [&](int tile, Problem& problem) {
    const WsTile at = ws_tile_coordinates(tile, tiles_x, tiles, group_rows);
    problem = parameters;
    return problem.begin(at.y, at.x, kPingPongBlockN);
  };
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---- producer: one thread copies every stage by TMA ----
    setmaxnreg_dec<kWsProducerRegisters>();
    if (threadIdx.x != 0) return;
    int iteration = 0;
    for (int tile = worker; tile < tiles; tile += workers) {
      Problem problem;
      if (!begin_tile(tile, problem)) continue;
      for (int step = 0; step < problem.k_steps(); ++step, ++iteration) {
        const int stage = iteration % STAGES;
        mbarrier_wait(empty(stage), (static_cast<uint32_t>(iteration / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_tx(full(stage), a_bytes + b_bytes);
        // A's 128 rows, and the first 128 columns of B from n0 (one half of WsPairHalves)
        ws_tma_copy(problem, maps, stage_a(stage), stage_a(stage) + a_bytes, full(stage), step, false,
                    WsPairHalves{0, 1, 0});
      }
    }
    return;
  }

  // ---- consumers: tile j of this CTA's to consumer j % 2 ----
  setmaxnreg_inc<kWsConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  unsigned char* const staging = shared_bytes + (staging_base - shared_raw);
  const int bulk_warp = consumer * 4 + warp;  // one staging per warp
  int iteration = 0, j = 0;
  for (int tile = worker; tile < tiles; tile += workers) {
    Problem problem;
    if (!begin_tile(tile, problem)) continue;
    const int k_steps = problem.k_steps();
    if ((j & 1) != consumer) {  // the other consumer's tile: only its k-steps are counted
      iteration += k_steps;
      ++j;
      continue;
    }
    // The order barrier: the other consumer's k-loop of tile j - 1 has finished (its ((j-1)/2)-th).
    if (j > 0) mbarrier_wait(done(consumer ^ 1), static_cast<uint32_t>((j - 1) / 2) & 1);
    ++j;

    float acc[kWsBlockN / 2];
#pragma unroll
    for (int i = 0; i < kWsBlockN / 2; ++i) acc[i] = 0.0f;
    int previous_stage = 0;
    for (int step = 0; step < k_steps; ++step, ++iteration) {
      const int stage = iteration % STAGES;
      mbarrier_wait(full(stage), static_cast<uint32_t>(iteration / STAGES) & 1);
      fence_proxy_async();
      const uint32_t a = stage_a(stage), b = a + a_bytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t b_descriptor = b_n_major ? matrix_descriptor(b + kk * 16 * 128, kBlockK * 128, 1024)
                                                : matrix_descriptor(b + kk * 32, 16, 1024);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows 64 h .. 64 h + 63 of the tile: A's box h
          const uint32_t a_h = a + h * 64 * 128;
          const uint64_t a_descriptor = a_m_major ? matrix_descriptor(a_h + kk * 16 * 128, kBlockK * 128, 1024)
                                                  : matrix_descriptor(a_h + kk * 32, 16, 1024);
          wgmma_m64n128k16<a_m_major ? 1 : 0, b_n_major ? 1 : 0>(
              *reinterpret_cast<float(*)[kWsBlockN / 4]>(acc + h * (kWsBlockN / 4)), a_descriptor, b_descriptor);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous step's group has retired: its stage goes back
      if (step > 0 && lane == 0) mbarrier_arrive(empty(previous_stage));
      previous_stage = stage;
    }
    wgmma_wait<0>();
    if (lane == 0) {
      if (k_steps > 0) mbarrier_arrive(empty(previous_stage));
      mbarrier_arrive(done(consumer));  // the other consumer may begin its next k-loop
    }
#pragma unroll
    for (int i = 0; i < kWsBlockN / 2; ++i) register_fence(acc[i]);
    // Accumulator layout of m64n128k16: warp w owns rows 16w .. 16w+15 of each 64-row half.
    if (maps.outputs != nullptr && ws_bulk_store_aligned(problem)) {
      ws_bulk_epilogue<Problem, kPingPongBlockN>(problem, maps.outputs + problem.out_expert, acc,
                                                 staging + bulk_warp * kWsBulkWarpBytes,
                                                 staging_base + bulk_warp * kWsBulkWarpBytes, warp * 16, lane);
    } else {
      const int row = warp * 16 + lane / 4;
      ws_register_epilogue<kPingPongBlockN, 0>(problem, acc, row, 0, lane % 4);
      ws_register_epilogue<kPingPongBlockN, kWsBlockN / 4>(problem, acc, 64 + row, 0, lane % 4);
    }
  }
  if (lane == 0) bulk_wait();  // the last tile's stores are written before the CTA exits
#else
  __trap();  // built without sm_90a: the host must never pick this kernel
#endif
}

}  // namespace moe::cuda::block_sparse_detail
