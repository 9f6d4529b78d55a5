// block_sparse_wgmma_ws.cuh: a warp-specialized Hopper (sm_90a) tile kernel for the block-sparse
// products of MegaBlocks (Gale et al., MLSys 2023): one producer warpgroup copies operands into a
// ring of shared-memory stages, two consumer warpgroups run wgmma on them, and mbarriers (not
// __syncthreads) pass each stage back and forth. Optionally persistent: one CTA per SM walks many
// tiles, so that one tile's epilogue overlaps the next tile's copies; optionally in clusters of two
// CTAs that copy an operand once for both by TMA multicast (WsCluster: where an expert has 4 or more
// block rows, the SDD and DSD take pairs of block rows sharing the expert's weights, and the weight
// gradients pairs of block columns sharing dy's or x's rows).
// The mainline's kernel for every product at B = 128 where the tile fits (block_sparse.cu, launch),
// and cuda/dev/sdd.cu's versions 15-19 (the lesson). Build: cmake --build build --target dev_sdd
//
// Why: block_sparse_wgmma.cuh's kernel has every thread copy, then wait, then compute. Its 128 x 256
// tile (half the L2 traffic per FLOP of 128 x 128) lost to 128 x 128 at 2 CTAs per SM because, at
// 1 CTA per SM, nothing overlaps the pipeline fill and the epilogue, and a wgmma group left in
// flight holds a stage that could be loading (cuda/dev/sdd.cu, versions 12-14). Here:
//   - warpgroup 0 (the producer) only copies: cp.async, 16 bytes per thread per copy, into
//     STAGES stages of A [128][64] and B [64][256] bf16 (48 KB a stage), the same 128-byte-swizzled
//     layout as block_sparse_wgmma.cuh, so the matrix descriptors are the same;
//   - warpgroups 1 and 2 (the consumers) only compute: each owns 64 rows x 256 columns of the tile
//     (m64n256k16, 128 fp32 accumulators per thread), then stores them: straight from registers
//     (ws_register_epilogue: the mainline's SDD and DSD), through shared memory and the bulk-copy
//     engine (ws_bulk_epilogue: the mainline's weight gradients), or through a staged epilogue;
//   - setmaxnreg moves registers from the producer (40 per thread: addresses and a counter) to the
//     consumers (232: 128 accumulators and room to spare): 128 x 40 + 256 x 232 = 384 x 168, the
//     registers the CTA is launched with (__launch_bounds__(384, 1)).
//
// The handshake, per stage s (two mbarriers in shared memory, PTX ISA "Parallel Synchronization and
// Communication Instructions: mbarrier"):
//   full[s]   expects 128 arrivals: each producer thread issues its copies for the stage, then
//             cp.async.mbarrier.arrive.noinc, which arrives on full[s] once all of that thread's
//             earlier cp.async have landed (.noinc: the arrival is one of the 128 counted at init,
//             rather than an extra one the instruction adds and then removes).
//   empty[s]  expects 8 arrivals: lane 0 of each consumer warp, once wgmma.wait_group says the
//             wgmma that read stage s have retired (their reads of shared memory are done).
// Phases and parity (the classic bug): an mbarrier counts phases 0, 1, 2, ...; a phase completes
// when its expected arrivals have all come, and the next one begins. try_wait.parity P returns true
// once the phase of parity P has completed, i.e. while the current phase's parity is not P; a fresh
// barrier is in phase 0, so waiting on parity 1 returns at once ("phase -1 completed"), and waiting
// on parity 0 blocks until the first completion. Both sides count k-steps in one running counter
// `iteration` (across tiles, in the persistent kernel); the stage is iteration % STAGES and the use
// of that stage u = iteration / STAGES:
//   consumer, before reading use u of stage s: wait full[s], parity u & 1   (the u-th fill landed)
//   producer, before writing use u of stage s: wait empty[s], parity (u & 1) ^ 1 (the (u-1)-th
//             release came; u = 0 waits on parity 1 and passes at once: all stages start empty)
// Parity tells apart only two phases; it is enough because neither side can run two phases ahead
// of the other on one barrier: the producer cannot refill s before the consumers release it, and
// the consumers cannot release s before the producer has filled it.
// Memory order: cp.async writes shared memory through the generic proxy, wgmma reads it through the
// async proxy. The mbarrier wait (acquire) makes the copies visible to the consumer thread; its
// fence.proxy.async then orders them before the wgmma it issues next. (TMA writes through the async
// proxy, so its stages would need no fence; leaving it out there changed no kernel's time beyond 1%:
// ncu, H200, 2026-11-22, the three reference shapes.)
//
// CTAs past the true counts (the grid is sized by host bounds): begin() returns false, the same in
// every warp (it reads only the tile index and the device count), so every warp skips the tile and
// no barrier waits for a warp that is not coming.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, B block size.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "moe/block_sparse.cuh"        // Layout, kBlockK, the problems
#include "moe/block_sparse_wgmma.cuh"  // matrix_descriptor, wgmma_m64n256k16, fences, kWgmmaBlockM
#include "moe/tile_schedule.h"         // TileSchedule: whole rounds of tiles, then a stream-K tail

namespace moe::cuda::block_sparse_detail {

constexpr int kWsThreads = 384;          // producer warpgroup + 2 consumer warpgroups
constexpr int kWsProducerThreads = 128;  // every producer thread copies: one warp alone would issue
                                         // 96 copies of 16 bytes per 48 KB stage
constexpr int kWsBlockN = 256;           // m64n256k16: the widest wgmma
constexpr int kWsProducerRegisters = 40;
constexpr int kWsConsumerRegisters = 232;
static_assert(kWsProducerThreads * kWsProducerRegisters + (kWsThreads - kWsProducerThreads) * kWsConsumerRegisters <=
                  kWsThreads * 168,
              "setmaxnreg may only hand out what the CTA was launched with: 65536 / 384 -> 168 per thread");

// The tensor maps of one launch with TMA copies (a __grid_constant__ kernel parameter: TMA reads a
// map in parameter, constant or global memory, never in registers).
struct TmaMaps {
  CUtensorMap a[2];                      // the activations, by product: SDD a[0] the rows of x or dy
                                         // (2-D); DSD a[0], a[1] the blocks of its one or two parts
                                         // (3-D); DSᵀD and DDS a[0] the A operand, a[1] the B operand
  const CUtensorMap* experts = nullptr;  // [E] SDD, DSD: the expert operand, one map per expert
  const CUtensorMap* outputs = nullptr;  // [E] DSᵀD, DDS: the weight gradient, one map per expert,
                                         // for the TMA stores of ws_bulk_epilogue
};

// Clusters of two CTAs that share one operand's copies (block_sparse_wgmma_ws_kernel, CLUSTER).
enum class WsCluster { none, share_a, share_b };

// The stream-K tail's scratch in global memory (tile_schedule.h): where the parts of a cut tile
// meet, per CTA of the cluster and consumer warp. Null partials: no tail, every tile whole.
struct WsStreamKScratch {
  float* partials = nullptr;  // [2 x workers][CTAs][8 warps][32][32 lanes] float4: a part's 128 accumulators
                              // a warp (16 KB), at TileSchedule::part_slot
  int* counts = nullptr;      // [workers][CTAs][8 warps][2] by tail tile: the arrivals, and the parts
                              // written; zero at launch
};
constexpr int kWsPartialFloats = 32 * (kWsBlockN / 2);  // a consumer warp's accumulators

// How the consumers store a tile: EPILOGUE_COLUMNS, a template parameter of the kernel, is
//   > 0                  the staged epilogue: fp32 through shared memory, that many columns a pass;
//   kWsRegisterEpilogue  straight from the accumulators (ws_register_epilogue);
//   kWsBulkEpilogue      through shared memory in the output's type, copied out by the bulk-copy
//                        engine while the consumers go on to the next tile (ws_bulk_epilogue).
constexpr int kWsRegisterEpilogue = 0;
constexpr int kWsBulkEpilogue = -1;
// The bulk epilogue's staging: per consumer warp, its 16 rows of 256 bytes (128 columns of bf16 or
// 64 of fp32) a pass, as the 2 column groups of 16 rows x 128 bytes that its TMA store reads, each
// in the 128-byte swizzle of the output's tensor map (ws_bulk_epilogue).
constexpr int kWsBulkRowBytes = 256;
constexpr int kWsBulkGroups = kWsBulkRowBytes / 128;
constexpr int kWsBulkGroupBytes = 16 * 128;
constexpr int kWsBulkWarpBytes = kWsBulkGroups * kWsBulkGroupBytes;
// The staged epilogue's fp32 staging: per consumer warpgroup [64][EPILOGUE_COLUMNS + kWsStagingPad]
// floats (none for the register epilogue).
// The pad of 4 floats makes both of its accesses conflict-free. Rows are 4 banks apart (36 = 4 mod
// 32 words), so the fragment writes (a float2 at row lane/4, columns 2 (lane % 4)) start at banks
// 4r + 2c: 2 wavefronts for 256 bytes, the least; the chunk reads (a float4 at row lane/4, column
// 8 (lane % 4)) start at 4r + 8c: every bank 4 times, 4 wavefronts for 512 bytes, the least. A
// pad of 8 (rows 8 banks apart) puts every access on half the banks: ncu measured 10.4-12.7
// wavefronts per chunk read (H200, 2026-11-22), a third of a weight-gradient product's time in
// shared memory.
constexpr int kWsStagingPad = 4;
template <int EPILOGUE_COLUMNS>
constexpr bool ws_epilogue_columns_valid() {
  if constexpr (EPILOGUE_COLUMNS == kWsRegisterEpilogue || EPILOGUE_COLUMNS == kWsBulkEpilogue)
    return true;
  else
    return kWsBlockN % EPILOGUE_COLUMNS == 0 && EPILOGUE_COLUMNS % 8 == 0;
}
template <int EPILOGUE_COLUMNS>
constexpr int ws_staging_bytes() {
  if constexpr (EPILOGUE_COLUMNS == kWsRegisterEpilogue)
    return 0;
  else if constexpr (EPILOGUE_COLUMNS == kWsBulkEpilogue)
    return 8 * kWsBulkWarpBytes;  // the 8 consumer warps
  else
    return 2 * 64 * (EPILOGUE_COLUMNS + kWsStagingPad) * static_cast<int>(sizeof(float));
}
// Shared memory: the 1024-byte alignment slack, the stages, the staging (its own region when the
// kernel is persistent: the producer is already filling the stages with the next tile), then the
// 2 x STAGES mbarriers of 8 bytes.
template <int STAGES, int EPILOGUE_COLUMNS, bool PERSISTENT>
constexpr int ws_shared_bytes() {
  return 1024 + STAGES * wgmma_stage_bytes<kWsBlockN>() + (PERSISTENT ? ws_staging_bytes<EPILOGUE_COLUMNS>() : 0) +
         2 * STAGES * 8;
}

// ---- TMA: one thread copies a whole box (PTX ISA 8.0: cp.async.bulk.tensor) ----
// The copy lands in shared memory in the 128-byte swizzle of the map (tensor_map.h), which is the
// layout the matrix descriptors read; the mbarrier counts the bytes (complete_tx), so the stage's
// full barrier completes when the arrival that announced them (expect_tx) and all its bytes are in.
// (Declared in every compilation pass, so that the host pass sees which products have TMA copies;
// the instructions exist only in the sm_90a pass.)
// Left out (ncu at locked base clocks, H200, 2026-11-22,
// notebooks_data/bench/ncu_l2_prefetch_h200_2026-11-22.txt; the experiment's code: commit 2474622): with the
// copies of k-step s, the producer asking for the boxes of k-step s + N to be fetched into the L2 only
// (cp.async.bulk.prefetch.tensor), so that the copies that land late would find them there. Every
// product is slower, against N = 0 in the same binary: with N = 4 the forward SDD 0.452 -> 0.541 ms
// and DSD 0.292 -> 0.360 at T=16384 D=1024 E=64 K=1 (Zipf), 2.75 -> 3.74 and 2.11 -> 3.00 at D=2048
// E=64 K=2 (Zipf), 3.89 -> 5.31 and 3.14 -> 4.32 at T=8192 D=4096 E=8 K=2 (uniform); with N = 8 more.
// The look-ahead doubles the requests that the L2 and the TMA unit serve, and the copies are not
// waiting on HBM's latency alone.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define MOE_SM90A_ASM(...) __trap()
#endif
__device__ inline void tma_load(uint32_t to, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  MOE_SM90A_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          to),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ inline void tma_load(uint32_t to, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  MOE_SM90A_ASM(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(to),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The other way: a box of shared memory (in the map's swizzle) written to the 3-D tensor at {c0, c1,
// c2}, as a bulk group of the issuing thread (bulk_commit, bulk_wait_read, bulk_wait below).
__device__ inline void tma_store(const CUtensorMap* map, uint32_t from, int c0, int c1, int c2) {
  MOE_SM90A_ASM("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
                "r"(from), "r"(c0), "r"(c1), "r"(c2)
                : "memory");
}
// A map that another kernel built in global memory (build_expert_maps, tensor_map.h: the experts'
// maps for the SDD and DSD, the weight gradients' for DSᵀD and DDS) is read by the TMA unit through
// the tensor-map proxy, which may hold an older map at the same address: the pool hands a launch's
// maps the address of the launch before's, and a CUDA graph replays them at one address. The
// thread that issues copies through such a map acquires it first (PTX ISA, "tensormap proxy"; the
// writer released it). Launched one by one the kernels happened to see the new maps without it;
// replayed in a graph at moe_train's throughput shape they read stale ones (wrong outputs, hangs,
// illegal instructions: tests/cuda/test_moe_layer_graph.cpp). Maps in kernel parameters need none.
__device__ inline void acquire_tensor_map(const CUtensorMap* map) {
  MOE_SM90A_ASM("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}
__device__ inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  MOE_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The same box written to the same shared-memory offset of every CTA of the cluster in `cta_mask`,
// each CTA's mbarrier at `bar`'s offset counting the bytes that land in it (dev_sdd version 21).
__device__ inline void tma_load_multicast(uint32_t to, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                          uint16_t cta_mask) {
  MOE_SM90A_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
      "{%3, %4}], [%2], %5;\n" ::"r"(to),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}
#undef MOE_SM90A_ASM

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ---- mbarrier, named barriers, setmaxnreg (PTX ISA 8.0, sm_90) ----
__device__ inline void mbarrier_init(uint32_t bar, uint32_t expected_arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(expected_arrivals) : "memory");
}
// Arrives once all cp.async issued so far by this thread have completed, as one of the expected arrivals.
__device__ inline void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ inline void mbarrier_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Blocks until the phase of parity `parity` has completed (see the header). try_wait may itself
// suspend the thread for a while before it answers false, so the loop does not spin hot.
__device__ inline void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// ---- bulk groups of the TMA stores (PTX ISA 8.0: cp.async.bulk), for ws_bulk_epilogue ----
// The issuing thread's stores (tma_store) form bulk groups, which it can wait for: .read until the
// TMA unit has read the shared memory (it may be written again), plain until the writes are done.
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ inline void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ inline void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// ---- clusters (dev_sdd version 21): the CTA's rank, a barrier over the cluster, a remote arrival ----
__device__ inline uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// Every non-exited thread of the cluster; release / acquire: what each CTA wrote before (its
// initialised mbarriers) is visible to the others after.
__device__ inline void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrives on the mbarrier at `bar`'s offset in the shared memory of CTA `rank` of the cluster.
// With the default semantics, .release at CTA scope (the form CUTLASS's ClusterBarrier uses): the
// arrival only says "this warp's wgmma reading the stage have retired" (wgmma.wait_group already
// ordered those reads), so it has nothing to publish to the other SM. A .release.cluster arrival
// waits until the thread's earlier memory operations, the epilogue's global stores among them, are
// visible to the whole cluster: ptxas puts a MEMBAR.ALL.GPU before it (cuobjdump -sass). That, and
// not the pairing, makes dev_sdd's version 21 19-31% slower than version 19 with that form
// (notebooks_data/bench/dev_sdd_h200_2026-11-22.log).
// With this form (H200, 2026-11-22, dev_sdd, one run, % of cuBLAS, version 19 -> 21;
// notebooks_data/bench/ncu_block_row_pairs_h200_2026-11-22.txt): 67.2 -> 67.8 at D=1024, 83.6 ->
// 86.0 at D=2048, 92.0 -> 93.1 at D=4096; .relaxed.cluster measured the same within noise (66.2,
// 81.5, 93.0).
__device__ inline void mbarrier_arrive_remote(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}
// Barrier `id` (1-15; 0 is __syncthreads) over `threads` threads (a multiple of 32): syncs a subset.
__device__ inline void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int REGISTERS>
__device__ inline void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
template <int REGISTERS>
__device__ inline void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

// ---- the producer's copies into the swizzled layout (block_sparse_wgmma.cuh's, by 128 threads) ----
// Each thread keeps one source pointer and steps it by a fixed stride, and its shared-memory
// addresses differ by constants: with only 40 registers, the producer cannot afford what the
// compiler does with the plain `chunk = thread + 128 i` form of block_sparse_wgmma.cuh, which is to
// precompute the 24 64-bit offsets of a stage once, outside the k-loop (it spilled 670 bytes).
// The empty asm hides the stepped pointer's value from the compiler so it cannot do that here.
__device__ inline void opaque(const bf16*& pointer) { asm volatile("" : "+l"(pointer)); }

// K-major [ROWS][64]: chunk c of row r at byte r * 128 + (c ^ (r % 8)) * 16. Thread t copies chunk
// t % 8 of rows t / 8 + 16 i: rows 16 apart share r % 8, so the swizzle is the same for every i.
template <int ROWS>
__device__ inline void ws_copy_k_major(uint32_t tile, const bf16* source, int64_t ld, int thread) {
  constexpr int rows_per_pass = kWsProducerThreads / 8;  // 8 consecutive threads read one 128-byte row
  static_assert(ROWS % rows_per_pass == 0, "every producer thread copies the same number of chunks");
  const int row = thread / 8, c = thread % 8;
  const uint32_t to = tile + row * 128 + ((c ^ (row & 7)) << 4);
  const bf16* from = source + row * ld + c * 8;
  const int64_t stride = rows_per_pass * ld;
#pragma unroll
  for (int i = 0; i < ROWS / rows_per_pass; ++i) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to + i * rows_per_pass * 128), "l"(from)
                 : "memory");
    from += stride;
    opaque(from);
  }
}
// MN-major: global [64 k][N] row-major, stored as N/64 groups of [64 k][64] (8 KB apart), chunk c
// of k-row k of a group at byte k * 128 + (c ^ (k % 8)) * 16. Thread t copies column chunk
// t % (N/8) of k-rows t / (N/8) + (1024/N) i (4 or 8 apart: coalesced along n); with k0 < 4 when
// they are 4 apart, (k0 + 4 i) % 8 = k0 ^ (4 i % 8), so the swizzle is k0's, flipped on odd i.
// Columns 128 .. 255 of a 256-wide chunk start `second_half` elements after column 0 in global
// memory: 128 for one matrix, B * B for DDS's two blocks side by side (see DdsProblem).
template <int N>
__device__ inline void ws_copy_mn_major(uint32_t tile, const bf16* source, int64_t ld, int thread,
                                        int64_t second_half = 128) {
  constexpr int chunks_per_row = N / 8, k_per_pass = kWsProducerThreads / chunks_per_row;
  static_assert(k_per_pass % 4 == 0 && kBlockK % k_per_pass == 0, "N = 64, 128 or 256");
  const int k0 = thread / chunks_per_row, column_chunk = thread % chunks_per_row;
  const int group = column_chunk / 8, c = column_chunk % 8;
  const uint32_t to = tile + group * (kBlockK * 128) + k0 * 128 + ((c ^ (k0 & 7)) << 4);
  const bf16* from = source + k0 * ld + (column_chunk % 16) * 8 + (column_chunk / 16) * second_half;
  const int64_t stride = k_per_pass * ld;
#pragma unroll
  for (int i = 0; i < kBlockK / k_per_pass; ++i) {
    const uint32_t flip = static_cast<uint32_t>((k_per_pass * i) & 7) << 4;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((to ^ flip) + i * k_per_pass * 128), "l"(from)
                 : "memory");
    from += stride;
    opaque(from);
  }
}

// ---- gathered rows: the SDD's A operand straight from x in token order (RowGather) ----
// The copies of ws_copy_k_major<128> ([128 rows][64 k]: thread t copies chunk t % 8 of rows
// t / 8 + 16 i), with every row fetched from where the plan says: expert-order row r is token
// row_slot[r] / K. A tile keeps its 128 rows for every k-step (only the column moves), so each
// thread looks its 8 rows up once a tile, in two steps:
//   fetch    loads the 8 slots, at the start of the tile, before the wait for the first stage;
//   resolve  turns them into offsets into x after that wait, so the loads' trip to memory overlaps it;
// then copy issues one cp.async per row at every k-step.
// A padding row (row_slot < 0) copies 0 source bytes, which cp.async fills with zeros (its
// src-size operand): the operand holds zeros there, exactly what permute_tokens would have
// written. This is the permute kernel folded into the copies the product makes anyway: x is read
// once, by the product, and no permuted copy is written (ScatterMoE, Tan et al. 2024, fuses the
// same gather into its grouped GEMM). Thread 0 still copies B (W1) by TMA, into the same stage:
// the stage's full barrier counts its expect_tx arrival and the 128 cp.async arrivals.
// Measured on an H200 (ncu, 2026-11-22, the GeLU SDD at T=16384 D=1024 H=4096 E=64 K=1 / T=8192
// D=4096 H=14336 E=8 K=2), against TMA on the permuted copy (322-327 us / 2.78-2.80 ms):
//   - looking the rows up at every k-step, with a division, just before the copies: 501 us;
//   - once a tile (as here): 329-337 us / 3.00-3.04 ms, 2-9% slower: 128 threads issuing 16-byte
//     copies (~100 instructions a warp a k-step) against one thread issuing TMA boxes; 64-bit
//     pointers kept per row instead of offsets did not help (344 us / 3.20 ms);
//   - TMA boxes of one row each (the 32 lanes of one warp issuing 4 boxes a k-step each): right,
//     as the swizzle follows the shared-memory address, but 1.08 ms / 14.1 ms: the TMA unit took
//     ~55 cycles per 128-byte box. Hopper's TMA has no gather; Blackwell's tile::gather4 adds one.
// The DDS of the backward (dW1 = xᵀ d_pre) gathered the same way, its 64 new rows a k-step fetched
// one k-step ahead: 357 against 344 us at D=1024 but 3.69 against 2.68 ms at D=4096, so the
// backward permutes x once and its DDS reads the copy by TMA.
struct WsGatheredRows {
  static constexpr int kRows = 8;
  static constexpr int kRowStep = 16;  // rows 16 apart share row % 8: one swizzled address for all 8
  // this thread's rows: their slots after fetch, then (resolve) the element offset of this
  // thread's chunk of each row in x, or -1 for a padding row
  int source[kRows];

  template <class Problem>
  __device__ void fetch(const Problem& problem, int thread) {
    const int* const row_slot = problem.gather.row_slot + problem.row * problem.block_size + thread / 8;
#pragma unroll
    for (int i = 0; i < kRows; ++i) source[i] = __ldg(row_slot + kRowStep * i);
  }
  template <class Problem>
  __device__ void resolve(const Problem& problem, int thread) {
    const int top_k = problem.gather.top_k, column = (thread % 8) * 8;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      source[i] = source[i] < 0 ? -1 : (source[i] / top_k) * problem.inner + column;  // < 2^31: host-checked
    }
  }
  __device__ void copy(uint32_t tile, const bf16* x, int first_column, int thread) const {
    const int row0 = thread / 8, c = thread % 8;
    const uint32_t to = tile + row0 * 128 + ((c ^ (row0 & 7)) << 4);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const bool real = source[i] >= 0;
      const bf16* from = x + (real ? source[i] + first_column : 0);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to + i * kRowStep * 128), "l"(from),
                   "r"(real ? 16 : 0)
                   : "memory");
    }
  }
};

// ---- the stream-K tail: the parts of a cut tile meet (tile_schedule.h) ----
// Each consumer warp of the workers that computed a part of the tile meets the others at the tile's
// place in the scratch (its tail tile, its CTA of the cluster, its warp: the same 16 rows in every
// part, in the same accumulator layout, lane for lane). A ticket (atomicAdd on the place's arrival
// count) orders the arrivals: all but the last write their 128 accumulators to their own slot and
// count themselves written with a release; the last waits (acquire) until all the others are
// written, adds their partial sums to its own (ws_stream_k_add), and stores the tile. The last
// never waits for the others' k-steps, only for writes of 16 KB that began before it arrived.
// Each warp meets alone, with no barrier beyond the warp: bar.warp.sync (__syncwarp) orders the
// lanes' writes before lane 0's release, and lane 0's acquire before the lanes' reads (PTX ISA,
// "bar.warp.sync": it guarantees memory ordering among the threads taking part). The host zeroes
// the counts before each launch (block_sparse.cu). The sum's order follows the arrivals, so a cut
// tile's fp32 sums may differ in their last bits from run to run (before the bf16 rounding).
constexpr int kWsPartialFloat4s = kWsPartialFloats / 4;
// True for the last of `parts` arrivals, which then adds the others' partial sums and stores the tile.
__device__ inline bool ws_stream_k_arrive(int* counts, float4* own_partial, int parts, int lane,
                                          const float (&acc)[kWsBlockN / 2]) {
  int* const arrivals = counts;
  int* const written = counts + 1;
  int order = 0;
  if (lane == 0) order = atomicAdd(arrivals, 1);
  order = __shfl_sync(0xffffffffu, order, 0);
  if (order < parts - 1) {  // leave this part's sum, coalesced (lane-minor float4s)
#pragma unroll
    for (int i = 0; i < kWsBlockN / 8; ++i)
      __stcg(own_partial + i * 32 + lane, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
    __syncwarp();
    if (lane == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(written) : "memory");
    return false;
  }
  if (lane == 0) {
    int ready = 0;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(ready) : "l"(written) : "memory");
    } while (ready < parts - 1);
  }
  __syncwarp();
  return true;
}
__device__ inline void ws_stream_k_add(const float4* partial, int lane, float (&acc)[kWsBlockN / 2]) {
  // Eight float4 loads in flight at a time: with all 32 in flight beside the 128 accumulators, the
  // consumers ran out of registers (ptxas spilled). __syncwarp orders memory, so no load moves past it.
  constexpr int kInFlight = 8;
#pragma unroll
  for (int i0 = 0; i0 < kWsBlockN / 8; i0 += kInFlight) {
    __syncwarp();
#pragma unroll
    for (int i = i0; i < i0 + kInFlight; ++i) {
      const float4 p = __ldcg(partial + i * 32 + lane);
      acc[4 * i] += p.x;
      acc[4 * i + 1] += p.y;
      acc[4 * i + 2] += p.z;
      acc[4 * i + 3] += p.w;
    }
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Products whose tiles all take the same k-steps, k_steps() known from the parameters before
// begin(), with y the block row and *block_rows (device_block_rows) the true count: the DSD. The
// stream-K tail may cut their tiles (tile_schedule.h). The SDD could be one too, but its tails are
// short (19-69 rounds), and the meet's loads made ptxas spill in its paired kernels; the weight
// gradients' tiles run as many k-steps as their expert has block rows, and stay whole.
template <class Problem>
concept WsStreamK = requires(const Problem& p) {
  { p.device_block_rows() } -> std::same_as<int>;
  { p.k_steps() } -> std::same_as<int>;
};

// ---- the kernel ----
// Tiles are numbered 0 .. tiles-1 and visited in the order of ws_tile_coordinates (group_rows).
// PERSISTENT = false: the grid is (tiles_x, y bound), one tile per CTA; the epilogue's staging then
//   reuses the stages (all copies have landed and every wgmma has retired by then).
// PERSISTENT = true: the grid is one CTA per SM (or fewer); CTA b takes tiles b, b + gridDim.x, ...
//   (a static schedule: TileSchedule, tile_schedule.h), and the staging has its own region so the
//   producer can fill the stages with the next tile while the consumers store this one.
// EPILOGUE_COLUMNS: the staging holds that many columns of a warpgroup's 64 rows at a time; the
//   epilogue runs 256 / EPILOGUE_COLUMNS passes (1 pass when it reuses the stages). 0: the register
//   epilogue (ws_register_epilogue), which needs no staging.
// ---- the TMA copies of one k-step, per product (TMA = true) ----
// A: 128 rows of 64 k, in two boxes of 64 rows (8 KB). B: 64 k x 256 n of the expert's operand, as
// four [64 k][64 n] boxes when it is stored [k][n] (the MN-major layout of ws_copy_mn_major), or two
// [128 n][64 k] boxes when it is stored [n][k] (K-major, as ws_copy_k_major). Either way columns
// 128 n .. 128 n + 127 of the chunk are its half n, 16 KB into the stage's B.
// WsPairHalves says which halves of the operand a pair of tiles shares this CTA copies, and to which
// CTAs of its cluster: both to itself alone (no cluster, or a pair that does not share), or, in a
// pair that shares it (WsCluster::share_b: the expert's chunk of B in the SDD and DSD, the rows of
// dy in DSᵀD, the rows of x in DDS), its own half to both CTAs.
struct WsPairHalves {
  int first = 0, count = 2;
  uint16_t multicast = 0;  // CTA mask; 0: a plain copy into this CTA
};
// One box of a 2-D map: into this CTA alone, or into the CTAs of `halves`' mask.
__device__ inline void ws_tma_load(uint32_t to, const CUtensorMap* map, uint32_t bar, int c0, int c1, WsPairHalves halves) {
  if (halves.multicast != 0)
    tma_load_multicast(to, map, bar, c0, c1, halves.multicast);
  else
    tma_load(to, map, bar, c0, c1);
}
template <Layout B_LAYOUT>
__device__ inline void ws_tma_copy_b(const CUtensorMap* map, uint32_t b, uint32_t bar, int k0, int n0, WsPairHalves halves) {
  auto load = [&](uint32_t to, int c0, int c1) { ws_tma_load(to, map, bar, c0, c1, halves); };
  for (int h = halves.first; h < halves.first + halves.count; ++h) {
    if constexpr (B_LAYOUT == Layout::row_major_km) {
      for (int g = 2 * h; g < 2 * h + 2; ++g) load(b + g * kBlockK * 128, n0 + 64 * g, k0);
    } else {
      load(b + h * 128 * 128, k0, n0 + 128 * h);
    }
  }
}
// SDD: A = rows of x (or dy) from the 2-D map a[0]; B = the block row's expert's W. A half-row
// tile's stages hold only the first 64 rows of A (the other 64 are padding).
template <Layout B_LAYOUT, SddEpilogue EPILOGUE>
__device__ inline void ws_tma_copy(const SddProblem<B_LAYOUT, EPILOGUE>& p, const TmaMaps& maps, uint32_t a, uint32_t b,
                                   uint32_t bar, int step, bool half_row, WsPairHalves halves = {}) {
  const int k0 = step * kBlockK;
  if (p.gather.row_slot == nullptr) {  // gathered rows come by cp.async (WsGatheredRows)
    for (int h = 0; h < (half_row ? 1 : 2); ++h)
      tma_load(a + h * 64 * 128, &maps.a[0], bar, k0, p.row * p.block_size + 64 * h);
  }
  ws_tma_copy_b<B_LAYOUT>(maps.experts + p.expert, b, bar, k0, p.column_offset + p.tile_n_start, halves);
}
// Clusters of two CTAs on the tiles (r, 2p) and (r, 2p + 1), side by side in one block row (dev_sdd
// version 21): both multiply the same 128 rows of A, so CTA `rank` copies rows 64 rank .. + 63 and
// multicasts them into the same stage of both CTAs; each copies its own B. Each CTA's L2 reads a
// k-step: 8 + 32 KB instead of 16 + 32.
template <Layout B_LAYOUT, SddEpilogue EPILOGUE>
__device__ inline void ws_tma_copy_shared_a(const SddProblem<B_LAYOUT, EPILOGUE>& p, const TmaMaps& maps, uint32_t a,
                                            uint32_t b, uint32_t bar, int step, uint32_t rank) {
  const int k0 = step * kBlockK;
  tma_load_multicast(a + rank * 64 * 128, &maps.a[0], bar, k0, p.row * p.block_size + 64 * static_cast<int>(rank), 0b11);
  ws_tma_copy_b<B_LAYOUT>(maps.experts + p.expert, b, bar, k0, p.column_offset + p.tile_n_start, WsPairHalves{});
}
template <class Problem>
concept WsSharedA = requires(const Problem& p, const TmaMaps& maps) {
  ws_tma_copy_shared_a(p, maps, 0u, 0u, 0u, 0, 0u);
};
// DSD: A = the block row's blocks from the 3-D map of its part; B = the expert's W (rows over all parts).
template <Layout B_LAYOUT>
__device__ inline void ws_tma_copy(const DsdProblem<B_LAYOUT>& p, const TmaMaps& maps, uint32_t a, uint32_t b,
                                   uint32_t bar, int step, bool /*half_row: never*/, WsPairHalves halves = {}) {
  const int steps_per_block = p.block_size / kBlockK;
  const int steps_per_part = p.blocks_per_expert * steps_per_block;
  const int part = step / steps_per_part, within = step % steps_per_part;
  const int block = static_cast<int>(p.row_first_block) + within / steps_per_block;
  const int k_in_block = (within % steps_per_block) * kBlockK;
  for (int h = 0; h < 2; ++h) tma_load(a + h * 64 * 128, &maps.a[part], bar, k_in_block, 64 * h, block);
  ws_tma_copy_b<B_LAYOUT>(maps.experts + p.expert, b, bar, step * kBlockK, p.column_offset + p.n0, halves);
}

// The SDD's and DSD's expert map for this tile, acquired by the copying thread (acquire_tensor_map);
// the other products copy through kernel-parameter maps only.
template <class Problem>
__device__ inline void ws_acquire_expert_map(const Problem& p, const TmaMaps& maps) {
  if constexpr (requires { p.expert; }) {
    if (maps.experts != nullptr) acquire_tensor_map(maps.experts + p.expert);
  }
}

// DSᵀD: A = the block (r, c) read M-major, two [64 k][64 m] boxes of the 3-D blocks map a[0];
// B = rows of the dense operand (dy), four [64 k][64 n] boxes of the 2-D map a[1].
// The weight gradients' copies wait on two dependent loads a k-step (the block's id, then its block
// row), and their begin() on a chain of four (the column's offset, its last block, that block's
// row, the row's tokens). Ways of hiding them, left out (ncu, H200, Zipf routing, DSᵀD at
// T=16384 D=1024 E=64 | D=2048 E=64 K=2):
//   - the producer warp loading 32 walk entries at once, one per lane, each k-step taking its entry
//     by a shuffle: 0.370 -> 0.372 ms | 2.09 -> 2.09 ms, no change;
//   - the consumers running the next tile's begin() while the tile's first wgmma group runs:
//     0.348 -> 0.365 ms | 2.09 -> 2.12 ms, slower (the SDD gained 1-3%);
//   - begin()'s chain cut from four loads to two, the last block row taken from the dropless
//     topology's closed forms (moe/topology.h) instead of transpose_indices and row_indices:
//     DSᵀD 0.350 -> 0.357 ms and DDS 0.355 -> 0.367 ms | 2.08 -> 2.12 and 2.09 -> 2.15 ms, slower.
// Neither the producer, which runs stages ahead, nor the consumers' lookups held these products back.
// With the bulk epilogue they run 5-7% behind the SDD of the same shape (TFLOP/s of the rows
// computed: 394 against 423 at D = 1024, 526 against 555 at D = 2048): what holds the D = 1024
// shape at about 60% of cuBLAS is common to every product there.
// Left out (moe_bench --kernel-trace, H200, 2026-11-22,
// notebooks_data/bench/kernel_trace_h200_2026-11-22.txt): B kept in the stages from tile to tile. A tile of
// 4 k-steps (an expert of 256 rows) fills the 4 stages, so the next tile's k-step j lands where this
// one's did; the producer remembers which B each stage holds (a key: dy's rows and columns, or the
// d_pre blocks) and copies only A where it matches, workers taking runs of 8 consecutive tiles that
// share B. At T=16384 D=1024 E=64 uniform (7 of 8 copies of B skipped) DSᵀD | DDS 0.33 | 0.33 ->
// 0.33 | 0.31 ms; under Zipf the runs put 8 tiles of 54 k-steps on one SM: 0.34 | 0.34 -> 0.53 | 0.57.
// Left out too (same file; the experiment's code: commit 02b7ed1): DSᵀD on a ping-pong kernel, the
// two consumers taking turns over 128 x 128 tiles, each one's bulk stores under the other's k-loop:
// 0.33 -> 0.42-0.45 ms at D=1024 (uniform and Zipf), 2.14 -> 2.94 at D=2048 Zipf.
// In pairs of block columns of one expert (WsCluster::share_b), both multiply the same rows of dy:
// each CTA copies one half of them into both (halves).
template <typename OUT>
__device__ inline void ws_tma_copy(const DsdTransposedProblem<OUT>& p, const TmaMaps& maps, uint32_t a, uint32_t b,
                                   uint32_t bar, int step, bool /*half_row: never*/, WsPairHalves halves = {}) {
  int k0;
  const int block = p.block_of(step, k0);
  for (int g = 0; g < 2; ++g) tma_load(a + g * kBlockK * 128, &maps.a[0], bar, 64 * g, k0, block);
  const int row = p.row_indices[block] * p.block_size + k0;
  ws_tma_copy_b<Layout::row_major_km>(&maps.a[1], b, bar, row, p.n0, halves);
}
// DDS (two block columns a tile): A = rows of the dense operand (x) read M-major, two [64 k][64 m]
// boxes of the 2-D map a[0]; B = the blocks (r, c) and (r, c+1), two [64 k][64 n] boxes of each
// from the 3-D map a[1].
// In pairs of tiles at the same rows of x (WsCluster::share_b: block column pairs 2 y', 2 y' + 1 of
// one expert), both multiply the same A: each CTA copies one of its two boxes into both (halves).
template <typename OUT>
__device__ inline void ws_tma_copy(const DdsProblem<OUT, 2>& p, const TmaMaps& maps, uint32_t a, uint32_t b,
                                   uint32_t bar, int step, bool /*half_row: never*/, WsPairHalves halves = {}) {
  int k0;
  const int block = p.block_of(step, k0);
  const int row = p.row_indices[block] * p.block_size + k0;
  for (int g = halves.first; g < halves.first + halves.count; ++g)
    ws_tma_load(a + g * kBlockK * 128, &maps.a[0], bar, p.m0 + 64 * g, row, halves);
  for (int g = 0; g < kWsBlockN / 64; ++g) tma_load(b + g * kBlockK * 128, &maps.a[1], bar, 64 * (g % 2), k0, block + g / 2);
}

// The products whose pairs of tiles 2 y', 2 y' + 1 can share an operand (WsCluster::share_b): the SDD
// and the DSD, whose B chunk depends only on the block row's expert and the tile's columns, and
// whose tiles all take the same k-steps (so the two CTAs of a pair go through the stages in step);
// and the weight gradients, whose pairs are two block columns (DSᵀD) or two pairs of them (DDS) of
// one expert, with the same blocks' rows (so the same k-steps), sharing dy's rows (DSᵀD: B) or x's
// (DDS: A). The host pairs them only where every pair falls in one expert
// (weight_gradient_pairs_fit): the two CTAs of a pair must run the same k-steps.
template <class Problem>
concept WsSharedB = requires(const Problem& p, const TmaMaps& maps) {
  ws_tma_copy(p, maps, 0u, 0u, 0u, 0, false, WsPairHalves{});
};
// The expert a tile belongs to: the pair shares its operand only within one expert.
template <class Problem>
__device__ inline int ws_tile_expert(const Problem& p) {
  if constexpr (requires { p.expert; })
    return p.expert;
  else
    return p.out_expert;
}

// The products with TMA copies: those with a ws_tma_copy overload above. The host asks this, and
// the kernel's TMA path calls the same signature, so the two cannot drift apart.
template <class Problem>
concept WsTmaCopies = requires(const Problem& p, const TmaMaps& maps) { ws_tma_copy(p, maps, 0u, 0u, 0u, 0, false); };

// Whether the problem's A rows are gathered from token order (the SDD with a RowGather set);
// always false for the other products. The same on every thread: it reads a kernel parameter.
template <class Problem>
concept WsGatherable = requires(const Problem& p) {
  p.gather.row_slot;
  p.gather.top_k;
};
template <class Problem>
__device__ inline bool ws_gathers_a(const Problem& problem) {
  if constexpr (WsGatherable<Problem>)
    return problem.gather.row_slot != nullptr;
  else
    return false;
}

// Where columns 128 .. 255 of the problem's B chunk start (Problem::b_second_half, default 128).
template <class Problem>
__device__ inline int64_t ws_b_second_half(const Problem& problem) {
  if constexpr (requires { problem.b_second_half(); })
    return problem.b_second_half();
  else
    return 128;
}

// The order of the tiles. Numbered y-major (tile = y * tiles_x + x), the CTAs running at one time
// cover whole rows of tiles, so every column slab of one expert's weights at once. Where a row of
// tiles is short (tiles_x * 4 <= SMs), the several rows that run together are mostly rows of one
// expert and share its slabs in the L2: that order is kept (group_rows = 1). Where a row of tiles
// is long (T=8192 D=4096 H=14336 E=8: 56 tiles, 2.4 rows at once), the next rows would read the
// expert's 117 MB of W1 again after it left the L2; there the tiles are visited in groups of
// group_rows = 16 rows, x slow and y fast inside a group, so that the CTAs of one moment share a few
// column slabs across 16 rows of one expert (CUTLASS calls this a swizzled tile scheduler).
// Measured with ncu on an H200 (2026-11-22): SDD 3.64 -> 3.40 ms at D=4096 with groups of 16; at
// T=16384 D=1024 E=64 the same groups cost 6% (0.39 -> 0.41 ms), hence row-major there. Other sizes
// change nothing beyond 1% (groups of 4, 8, 32 at D=4096; 8 and 16 against row-major at D=2048 E=64
// K=2 Zipf; notebooks_data/bench/ncu_tile_group_size_h200_2026-11-22.txt).
// Left out (ncu at locked base clocks, H200, 2026-11-22,
// notebooks_data/bench/ncu_tile_order_h200_2026-11-22.txt; the experiment's code: commit 807d31e): this
// order taken from both ends at once, so that under Zipf routing every round mixes the large experts
// (their weights served from the L2) with the small ones (every tile's chunk from HBM), instead of
// leaving HBM idle in the first rounds and busy in the last. Forward SDD | DSD: 0.412 -> 0.422 |
// 0.302 -> 0.304 ms at D=1024 Zipf, 2.20 -> 2.26 | 1.86 -> 1.86 at D=2048 Zipf, 3.14 -> 3.11 |
// 2.80 -> 2.79 at D=4096 Zipf; uniform routing likewise within -3% .. +3%. Where HBM's load falls over the rounds is not what the copies
// wait for.
struct WsTile {
  int y, x;
};
__device__ inline WsTile ws_tile_coordinates(int tile, int tiles_x, int tiles, int group_rows) {
  const int y_count = tiles / tiles_x;
  const int group_tiles = group_rows * tiles_x;
  const int group = tile / group_tiles, within = tile % group_tiles;
  const int rows = min(group_rows, y_count - group * group_rows);  // the last group may be short
  return {group * group_rows + within % rows, within / rows};
}
inline int ws_group_rows(int tiles_x, int multiprocessors) { return tiles_x * 4 > multiprocessors ? 16 : 1; }

// The tile over the grid's x: 256 columns (N) for the products tiled by block rows or block
// columns; 128 rows (M) for DDS, whose 256 columns are two block columns (DdsProblem<OUT, 2>).
template <class Problem>
constexpr int ws_tile_x() {
  return Problem::grid_x_over_m ? kWgmmaBlockM : kWsBlockN;
}

// ---- half-row tiles: an expert's last block row when its routed rows fit in 64 (the SDD's) ----
// Under skewed routing most of the padding sits in block rows whose routed rows all lie in the
// first half (1 .. 64 of 128; block_row_tokens, Problem::half_row): the second consumer warpgroup
// then multiplies 64 rows of zeros. At T=16384 E=64 with Zipf routing, 27 of 155 block rows are
// such rows at K=1 (D=1024) and 29 of 283 at K=2 (D=2048); computing only their first halves takes
// the rows computed from 19840 to 18112 and from 36224 to 34368.
// A half-row tile keeps the tile's place (block row r, 256 columns) and its stage layout, but its
// stages hold only the first 64 rows of A (one TMA box instead of two), and the consumers split
// the columns instead of the rows: consumer c multiplies rows 0-63 by columns 128 c .. 128 c + 127
// (m64n128k16, 64 accumulators), half the tensor-core work of a whole tile for the same 32 KB of B
// a k-step. The epilogue stores rows 0-63 and writes zeros in rows 64-127, the value a whole tile
// computes there (the epilogue of a zero row is zero), so every output keeps the contract that
// padding rows are zero (block_sparse.h).
// The trade: a half-row tile moves 40 KB into shared memory per 1 M multiply-adds where a whole
// tile moves 48 KB per 2 M, and it reads all of the expert's weights as a whole row does: it saves
// tensor-core time, not bytes. Measured with ncu on an H200 (2026-11-22, Zipf routing, against
// whole tiles in the same run; notebooks_data/bench/ncu_half_row_tiles_h200_2026-11-22.txt): at
// T=16384 D=1024 H=4096 E=64 K=1 the GeLU SDD 0.35 -> 0.34 ms and the backward's SDD 0.386 -> 0.375
// ms (0.388 -> 0.364 in a second run); at D=2048 E=64 K=2 and at D=4096 E=8 K=2 (uniform, no half
// rows) no change beyond 0.5%.
// The SDDs take them; the DSDs do not. With half-row tiles the DSD measured 0.25 -> 0.26 ms at
// D=1024, 1.66 -> 1.88 ms at D=2048, and 2.54 -> 2.65 ms at D=4096 uniform, where no row is a half
// row: its long k-loops (64-224 k-steps a tile) lose to the second k-loop's mere presence, as they
// do to a zero-trip loop (below), and at D=2048 its half rows are no faster.
// Left out: 64 x 512 tiles, both consumers on m64n256k16 (the k-loop unchanged), each k-step
// filling two stages, one per consumer: DSD 0.25 -> 0.33 ms and SDD 0.35 -> 0.41 ms at D=1024.
// With each consumer holding two of the four stages (the one its wgmma reads and the one before,
// until that group retires), the producer runs one k-step ahead, and every k-step waits out a
// copy's latency: the half-row tiles take 5-6 times as long as whole ones.
template <class Problem>
concept WsHalfRowTiles = requires(const Problem& p) {
  { p.half_row(0) } -> std::same_as<bool>;
};
template <class Problem>
__device__ inline bool ws_half_row(const Problem& problem, int y) {
  if constexpr (WsHalfRowTiles<Problem>)
    return problem.half_row(y);
  else
    return false;
}

// ---- the register epilogue (EPILOGUE_COLUMNS = 0): no shared memory, no barrier ----
// Store_chunk takes 8 consecutive columns of one row (one 16-byte store of bf16). In the accumulator
// layout, the 8 columns of chunk j of a row are spread over the 4 lanes of a quad (lane q holds
// columns 2q, 2q+1). Take the chunks 4g .. 4g+3 of a row: lane q holds M[q][i] = its column pair of
// chunk 4g+i, and wants chunk 4g+q whole, i.e. M[0..3][q]: a 4 x 4 transpose over the quad, done
// in two butterfly stages with __shfl_xor_sync. Stage b (b = 1, 2) pairs the lanes q, q ^ b and
// the registers i, i ^ b: a lane keeps the register whose bit matches its own lane bit and trades
// the other. 8 shuffles per 4 chunks of a row (a float2 each way, two stages, two pairs); then
// each lane stores its chunk, and a warp writes 8 rows x 64 contiguous bytes per store.
// This replaces the staged epilogue's trip through shared memory (a float2 write and a float4 read
// per value, and two named barriers per pass), which the consumers spent with the tensor cores idle.
// Left out: starting consumer 1 one or two k-steps after consumer 0 (a named barrier at the start;
// the shared stages keep them that far apart), so that one's epilogue would overlap the other's
// last k-steps. moe_bench, two runs each on an H200 (2026-11-22): no change beyond the run-to-run
// noise of 2-5% at any reference shape, forward or forward + backward.
// Left out (ncu at locked base clocks, H200, 2026-11-22,
// notebooks_data/bench/ncu_sdd_epilogue_experiments_h200_2026-11-22.txt; D = 1024 is T=16384 D=1024 E=64 K=1 Zipf, D = 2048
// T=16384 D=2048 E=64 K=2 Zipf, D = 4096 T=8192 D=4096 E=8 K=2 uniform):
//   - what the GeLU costs: with gelu(x) replaced by x (timing only), the forward's SDD 0.407 -> 0.397
//     ms at D = 1024, 2.21 -> 2.15 at D = 2048, 3.09 -> 3.08 at D = 4096. The activation's arithmetic
//     is not what keeps the SDD behind the DSD (2.2 against 1.86 ms at D = 2048, about the same work);
//   - a deferred epilogue: the consumers store only the product (bf16) and go on to their next tile,
//     and warps 1-3 of the producer warpgroup (idle with TMA copies) read each tile back from the L2
//     and apply the GeLU, handed over through mbarriers. Correct (every test, memcheck, racecheck),
//     but the forward's SDD 0.38 -> 0.63-0.66 ms at D = 1024 (rows permuted), 2.20 -> 2.85-2.94
//     at D = 2048, 3.05 -> 3.23-3.30 at D = 4096, the backward's likewise. Warp sampling at D = 1024:
//     the consumers spend a quarter of their time waiting for the 96 workers, which wait on their
//     reads of the tile; at D = 4096, where a tile's 64 k-steps leave the workers time, the tile's
//     trip back through the L2 still costs 6-8%;
//   - CUTLASS's ping-pong schedule (the code: commit 768a43f, block_sparse_pingpong.cuh): the two
//     consumers take turns over whole 128 x 128 tiles, each one's epilogue under the other's k-loop
//     (an order barrier between their k-loops). 1-5% slower than this kernel at every shape, with 6 or 7
//     stages: the 128 x 128 tile's extra third of L2 bytes a multiply-add (and no half-row tiles or
//     pairs there) cost about what the hidden epilogue bought.
// Left out (ncu at locked base clocks, H200, 2026-11-22,
// notebooks_data/bench/ncu_deferred_epilogue_smem_h200_2026-11-22.txt; the experiment's code: commit
// 5b158b3): the deferred epilogue's handoff through shared memory instead of the L2. The consumers write
// the bf16 product into a 66 KB staging tile (64 conflict-free 4-byte writes a thread) and go on; the
// producer's warps 1-3 read it, apply the GeLU and store both outputs. Correct (every test, memcheck,
// racecheck, synccheck), and slower: the forward's SDD 0.380 -> 0.427 ms at D = 1024 Zipf (rows
// permuted), 2.20 -> 2.29 at D = 2048 Zipf, 3.10 -> 3.15 at D = 4096 uniform; the backward's (whose workers also load the pre-activation) 30-70%
// slower. The staging costs a stage (3 of 48 KB instead of 4), and with the consumers' epilogue down to
// a few shared-memory writes the SDD is no faster even at D = 4096, where 3 stages cost nothing: the
// register epilogue is not what keeps the SDD behind the DSD there.
__device__ inline void quad_trade(float2& keep_if_low, float2& keep_if_high, bool high, int lane_mask) {
  const float2 send = high ? keep_if_low : keep_if_high;
  float2 received;
  received.x = __shfl_xor_sync(0xffffffffu, send.x, lane_mask);
  received.y = __shfl_xor_sync(0xffffffffu, send.y, lane_mask);
  if (high)
    keep_if_low = received;
  else
    keep_if_high = received;
}
// Products whose epilogue reads inputs (the SDD's activations: SddProblem::load_chunk) have them
// loaded 4 chunks at a time before the 4 chunks are stored. Loading each chunk's inputs just before
// its store made the 16 chunks' loads wait one after the other (a load cannot pass an earlier store
// that might alias it): ncu on an H200 (2026-11-22) put the backward's GeLU SDD at 0.458 ms against
// the forward's 0.352 ms at T=16384 D=1024 H=4096 E=64 K=1, Zipf routing. With the loads batched:
// 0.388 ms there, 2.37 -> 2.15 ms at D=2048 E=64 K=2, 2.90 -> 2.75 ms at D=4096 E=8 K=2 (uniform).
// Left out: the producer asking for the tile's input blocks into L2 (cp.async.bulk.prefetch.L2,
// 64 KB) when it starts the tile, so that the epilogue's loads would hit there. ncu, H200,
// 2026-11-22, against this code in the same run (notebooks_data/bench/
// ncu_weight_gradient_stores_h200_2026-11-22.txt): 0.375 -> 0.391 ms at D=1024 (Zipf), 2.14 ->
// 2.21 ms at D=2048 (Zipf), 2.73 -> 2.75 ms at D=4096 (uniform): the loads are not what the
// epilogue waits for, and the early reads compete with the k-loop's copies.
template <class Problem>
concept WsChunkInputs = requires(const Problem& p) { p.load_chunk(0, 0); };
struct WsNoChunkInputs {};
template <class Problem>
__device__ inline auto ws_load_chunk(const Problem& problem, int m, int n) {
  if constexpr (WsChunkInputs<Problem>)
    return problem.load_chunk(m, n);
  else
    return WsNoChunkInputs{};
}
template <class Problem, class Inputs>
__device__ inline void ws_store_chunk(const Problem& problem, int m, int n, const float (&v)[8], const Inputs& inputs) {
  if constexpr (WsChunkInputs<Problem>)
    problem.store_chunk(m, n, v, inputs);
  else
    problem.store_chunk(m, n, v);
}
// COLUMNS: 256 (m64n256k16: all 128 accumulators), or 128 (a half-row tile's m64n128k16: the
// first 64), stored from first_column on.
template <int COLUMNS, class Problem>
__device__ inline void ws_register_epilogue(const Problem& problem, const float (&acc)[kWsBlockN / 2], int row,
                                            int first_column, int quad_lane) {
  constexpr int kBatch = 4;  // chunk groups whose inputs are in flight together
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // rows `row` and `row + 8`
    const int r = row + 8 * half;
#pragma unroll
    for (int g0 = 0; g0 < COLUMNS / 32; g0 += kBatch) {
      decltype(ws_load_chunk(problem, 0, 0)) inputs[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) inputs[b] = ws_load_chunk(problem, r, first_column + 8 * (4 * (g0 + b) + quad_lane));
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {  // chunks 4g .. 4g+3: 32 columns
        const int g = g0 + b;
        float2 m[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) m[i] = make_float2(acc[4 * (4 * g + i) + 2 * half], acc[4 * (4 * g + i) + 2 * half + 1]);
        const bool bit0 = quad_lane & 1, bit1 = quad_lane & 2;
        quad_trade(m[0], m[1], bit0, 1);  // now m[i] = M[q with bit 0 = i's][i with bit 0 = q's]
        quad_trade(m[2], m[3], bit0, 1);
        quad_trade(m[0], m[2], bit1, 2);  // and bit 1 likewise: m[i] = M[i][q]
        quad_trade(m[1], m[3], bit1, 2);
        const float v[8] = {m[0].x, m[0].y, m[1].x, m[1].y, m[2].x, m[2].y, m[3].x, m[3].y};
        ws_store_chunk(problem, r, first_column + 8 * (4 * g + quad_lane), v, inputs[b]);
      }
    }
  }
}
// A half-row tile's rows 64 .. 127 (padding): what a whole tile stores there, the epilogue of a zero
// accumulator with zero inputs (padding rows of the inputs are zero too), for one consumer's
// COLUMNS columns from first_column. Warp w stores rows 64 + 16 w .. 64 + 16 w + 15 (16 rows x
// COLUMNS / 8 chunks over its 32 lanes): each warp stores what it owns, as the register epilogue
// does, so that a warp can leave a tile to another (the stream-K tail's meet) on its own.
template <int COLUMNS, class Problem>
__device__ inline void ws_zero_rows(const Problem& problem, int first_column, int warp, int lane) {
  constexpr float zeros[8] = {};
  constexpr int row_chunks = COLUMNS / 8;
  using Inputs = decltype(ws_load_chunk(problem, 0, 0));
#pragma unroll 4
  for (int chunk = lane; chunk < 16 * row_chunks; chunk += 32) {
    const int r = 64 + 16 * warp + chunk / row_chunks, n = first_column + (chunk % row_chunks) * 8;
    ws_store_chunk(problem, r, n, zeros, Inputs{});
  }
}

// ---- the bulk-copy epilogue (kWsBulkEpilogue): the tile leaves through the copy engine ----
// A tile of a weight gradient with small experts runs a few k-steps and then writes 64 KB (bf16) or
// 128 KB (fp32); with the register epilogue the consumers wait until those stores have drained
// into the memory system, and the tensor cores wait with them. Here each consumer warp writes its
// 16 rows, converted to the output's type, into its own staging in shared memory, 256 bytes of each
// row a pass, and lane 0 hands the pass to the TMA unit as one store (tma_store through the
// expert's output map, TmaMaps::outputs: the column groups of make_column_groups_map), which writes
// it to global memory on its own while the warp goes on. Before the warp writes its staging again,
// lane 0 waits until the unit has read it. No barrier beyond the warp: each warp owns its rows (the
// accumulator layout gives warp w rows 16w .. 16w+15). bf16 rows take two passes of 128 columns,
// fp32 rows four of 64. The shared-memory writes go through the generic proxy and the TMA unit
// reads through the async proxy: a fence.proxy.async orders them.
// A group is stored in the map's 128-byte swizzle (16-byte chunk c of row r at r * 128 + (c ^ r % 8)
// * 16, as the operands' boxes), which also spreads a warp's writes over the banks: the 8 rows of
// one write land in 8 different chunk columns (bf16: 32 banks, one wavefront for 128 bytes; fp32:
// two wavefronts for 256 bytes, the least).
// The product's output must be a plain matrix (Problem::out_at) whose rows start on 16 bytes and
// whose tiles start on a column group (the maps' alignment, block_sparse.cu set_output_maps); a
// tile whose rows do not, or a launch without output maps, takes the register epilogue
// (ws_bulk_store_aligned). Its staging (32 KB) leaves room for the 4 stages of the other products.
// The forms of this epilogue, measured with ncu on an H200 (2026-11-22, Zipf routing, bf16 weight
// gradients; the first in notebooks_data/bench/ncu_epilogues_h200_2026-11-22.txt, the others in
// notebooks_data/bench/ncu_weight_gradient_stores_h200_2026-11-22.txt; D = 1024
// is T=16384 D=1024 H=4096 E=64 K=1, 4 k-steps a tile on average; D = 2048 is T=16384 D=2048 H=8192
// E=64 K=2, 8 k-steps):
//   - register epilogue (4 stages) -> one plain bulk copy (cp.async.bulk) per 512-byte row, 16
//     lanes a warp each copying one row, in a 66 KB staging (3 stages): DSᵀD 0.370 -> 0.349 ms and
//     DDS 0.372 -> 0.350 ms at D = 1024; 2.09 -> 2.09-2.10 ms at D = 2048;
//   - warp-state sampling of that form puts 15% of the DDS's warp samples at D = 1024 (12% at
//     D = 2048) on the loop that issues the 16 row copies: the copy takes its addresses in uniform
//     registers, so the compiler issues the lanes' copies one after another, each waiting until the
//     unit took the one before;
//   - TMA stores of 4 boxes of 16 rows x 128 bytes a warp (a 2-D map, 512-byte passes, 3 stages):
//     DSᵀD 0.343 -> 0.312 and DDS 0.349 -> 0.322 ms at D = 1024, 2.02 -> 1.87 and 2.04 -> 1.91 at
//     D = 2048, 2.64 -> 2.55 and 2.63 -> 2.58 at T=8192 D=4096 H=14336 E=8 K=2 (uniform); sampled,
//     each of the 4 stores still holds its warp about 2% of the time, and the consumers wait for a
//     stage's copies 27% of it (15% with the row copies);
//   - against that (same run): one 3-D store of 4 groups a warp, 0.306 / 0.314 ms at D = 1024 and
//     1.84 / 1.87 at D = 2048; 256-byte passes with 4 stages, 0.302 / 0.306 and 1.92 / 1.94 (1.81 /
//     1.82 in a second build); both (as here), 0.301 / 0.302 and 1.91 / 1.81 ms.
// Left out (ncu, H200, 2026-11-22, against the row-copy form in the same run;
// notebooks_data/bench/ncu_consumer_waits_h200_2026-11-22.txt): the forward's GeLU SDD through this
// epilogue (per pass 128 columns of the pre-activation and the same 128 of the GeLU side by side)
// 0.343 -> 0.373 ms at D = 1024, 2.03 -> 2.08 at D = 2048 and 2.65 -> 2.66 at D = 4096 (Zipf;
// uniform at D = 4096); with 4 stages beside a staging of 256-byte rows (34.7 KB), 0.345 -> 0.369,
// 2.02 -> 2.12 and 2.67 -> 2.70. The DSD through it: 0.251 -> 0.263, 1.69 -> 1.64, 2.54 -> 2.50 ms
// with 3 stages; no change beyond 1% with 4. The DSD through the TMA-store form
// (notebooks_data/bench/ncu_weight_gradient_stores_h200_2026-11-22.txt): 0.252 -> 0.254 / 0.257 ms
// at D = 1024, 1.69 -> 1.72 / 1.69 at D = 2048 and 2.57 -> 2.65 / 2.60 at D = 4096 (4 stages and
// 256-byte passes / 3 stages and 512-byte passes): no gain, as its long tiles hide the register
// epilogue. Warp-state sampling says what holds the SDD and the DSD back (lessons/03_block_sparse.md,
// "Where the consumers wait"): their consumers spend a quarter of their time waiting for a stage's
// copies to land.
template <class Problem>
concept WsBulkStore = requires(const Problem& p) {
  { p.out_at(0, 0) } -> std::same_as<typename Problem::Out*>;
  p.ldo;
  p.out_expert;  // the tile's place in its expert's output: the map, and the row and column there
  p.out_row;
  p.out_column;
};
template <class Problem>
__device__ inline bool ws_bulk_store_aligned(const Problem& problem) {
  const auto base = reinterpret_cast<uintptr_t>(problem.out_at(0, 0));
  const auto row_bytes = static_cast<uintptr_t>(problem.ldo) * sizeof(typename Problem::Out);
  return ((base | row_bytes) & 15) == 0;
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// first_row: this warp's first row in the tile; staging: its 2 column groups (1024-byte aligned).
template <class Problem>
__device__ inline void ws_bulk_epilogue(const Problem& problem, const CUtensorMap* map, const float (&acc)[kWsBlockN / 2],
                                        unsigned char* staging, uint32_t staging_address, int first_row, int lane) {
  using Out = typename Problem::Out;
  constexpr int columns = kWsBulkRowBytes / static_cast<int>(sizeof(Out));  // a pass: 128 bf16, 64 fp32
  constexpr int group_columns = 128 / static_cast<int>(sizeof(Out));        // 64 bf16, 32 fp32
  constexpr int chunks = columns / 8;                                        // of the accumulator layout
  const int row = lane / 4, pair = 2 * (lane % 4);
  if (lane == 0) acquire_tensor_map(map);  // built on the device by the launch's first kernel
#pragma unroll
  for (int pass = 0; pass < kWsBlockN / columns; ++pass) {
    if (lane == 0) bulk_wait_read();  // the TMA unit has read what this warp staged before
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < chunks; ++jj) {
      const int j = pass * chunks + jj;
      const int byte = (8 * jj + pair) * static_cast<int>(sizeof(Out));  // in the pass's 256-byte row
      const int group = byte / 128, chunk = (byte % 128) / 16, within = byte % 16;
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // rows `row` and `row + 8`, columns 8 jj + pair, + 1
        const int r = row + 8 * half;
        unsigned char* at = staging + group * kWsBulkGroupBytes + r * 128 + ((chunk ^ (r & 7)) << 4) + within;
        store2(reinterpret_cast<Out*>(at), acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
      }
    }
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
      tma_store(map, staging_address, 0, problem.out_row + first_row, (problem.out_column + pass * columns) / group_columns);
      bulk_commit();
    }
  }
}
#endif

// TMA = true: one producer thread copies each stage with TMA boxes (Problem::tma_copy, the maps in
//   `maps`) instead of 128 threads issuing 16-byte cp.async; the other producer threads exit.
// half_rows: compute the block rows whose routed rows fit in their first half as half-row tiles
//   (see above). Taken only with TMA copies, the register epilogue and no share_a cluster.
// CLUSTER (WsCluster): none, or clusters of two CTAs that share an operand's copies by TMA multicast.
//   A CTA's producer then writes into the peer's stages too, so a stage is empty only when both
//   CTAs' consumers have released it: each consumer warp arrives on its own CTA's "empty" barrier
//   and on the peer's (16 arrivals), and before it exits the producer waits until every stage has
//   been released, so that no peer arrives on the barriers of a CTA that is gone. The pair goes
//   through the stages in step, tile by tile.
//   share_a (dev_sdd version 21, the SDD without gathered rows): the two take tiles side by side in
//     a block row and share their A (ws_tma_copy_shared_a): 8 + 32 KB a k-step from the L2 instead
//     of 16 + 32.
//   share_b (the mainline's products, dev_sdd version 22): the two take block rows 2 y' and
//     2 y' + 1 at the same columns; where both belong to one expert they multiply the same chunk of
//     its weights, and each copies one half of it into both (WsPairHalves): 16 + 16 KB a k-step
//     instead of 16 + 32. Where the two block rows belong to different experts, each copies its own
//     B; where one block row is past the device's count, its CTA multiplies the peer's tile (sharing
//     B) and stores nothing, so that the pair stays in step. The weight gradients' pairs are two
//     block columns of one expert (DSᵀD: tiles y = block column) sharing dy's rows, or two pairs of
//     them (DDS: y = a pair of block columns) sharing x's rows; WsSharedB says which.
// stream_k (the DSD in pairs, WsStreamK; null partials: none): the tiles of the last partial round
//   are shared out by k-steps (TileSchedule's tail), and the parts of a cut tile meet in this
//   scratch (ws_stream_k_arrive, ws_stream_k_add) before the last of them stores it.
template <int STAGES, int EPILOGUE_COLUMNS, bool PERSISTENT, bool TMA, class Problem, WsCluster CLUSTER = WsCluster::none>
__global__ void __launch_bounds__(kWsThreads, 1)
    block_sparse_wgmma_ws_kernel(const Problem parameters, const __grid_constant__ TmaMaps maps, int tiles_x,
                                 int tiles, int group_rows, bool half_rows, WsStreamKScratch stream_k) {
  static_assert(STAGES >= 2, "one stage filling while one is read");
  static_assert(ws_epilogue_columns_valid<EPILOGUE_COLUMNS>(), "the register epilogue (0), or whole 16-byte chunks per pass");
  static_assert(PERSISTENT || ws_staging_bytes<EPILOGUE_COLUMNS>() <= STAGES * wgmma_stage_bytes<kWsBlockN>(),
                "the staging must fit in the stages it reuses");
  static_assert(EPILOGUE_COLUMNS != kWsBulkEpilogue || (PERSISTENT && WsBulkStore<Problem>),
                "the bulk epilogue needs its own staging (persistent) and a plain output matrix (out_at)");
  static_assert(ws_shared_bytes<STAGES, EPILOGUE_COLUMNS, PERSISTENT>() <= 227 * 1024,
                "Hopper gives a CTA at most 227 KB of shared memory");
  static_assert(Problem::a_layout != Layout::row_major_nk, "A is stored [m][k] or [k][m]");
  static_assert(kBlockK == 64, "a k-step is one 128-byte swizzle row of K (K-major) or 64 rows (MN-major)");
  static_assert(CLUSTER == WsCluster::none || (PERSISTENT && TMA), "clusters are persistent, with TMA copies");
  static_assert(CLUSTER != WsCluster::share_a || WsSharedA<Problem>, "share_a: the SDD (ws_tma_copy_shared_a)");
  static_assert(CLUSTER != WsCluster::share_b || WsSharedB<Problem>, "share_b: a product with a pair's copy (WsSharedB)");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kCtas = CLUSTER == WsCluster::none ? 1 : 2;
  constexpr bool a_m_major = Problem::a_layout == Layout::row_major_km;
  constexpr bool b_n_major = Problem::b_layout == Layout::row_major_km;
  constexpr uint32_t a_bytes = kWgmmaBlockM * kBlockK * sizeof(bf16);  // 16 KB
  constexpr int kAccumulators = kWsBlockN / 2;                         // 64 x 256 over 128 threads

  extern __shared__ unsigned char shared_bytes[];
  const uint32_t shared_raw = static_cast<uint32_t>(__cvta_generic_to_shared(shared_bytes));
  const uint32_t shared_base = (shared_raw + 1023u) & ~1023u;
  const uint32_t staging_base = PERSISTENT ? shared_base + STAGES * wgmma_stage_bytes<kWsBlockN>() : shared_base;
  const uint32_t barriers =
      shared_base + STAGES * wgmma_stage_bytes<kWsBlockN>() + (PERSISTENT ? ws_staging_bytes<EPILOGUE_COLUMNS>() : 0);
  auto full = [&](int stage) { return barriers + stage * 8; };
  auto empty = [&](int stage) { return barriers + (STAGES + stage) * 8; };
  auto stage_a = [&](int stage) { return shared_base + stage * wgmma_stage_bytes<kWsBlockN>(); };

  // TMA with gathered A rows: thread 0 copies B by TMA and every producer thread gathers A by cp.async.
  const bool gather = TMA && ws_gathers_a(parameters);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // The expect_tx arrival (TMA), one cp.async arrival per producer thread (cp.async), or both.
      mbarrier_init(full(s), (TMA ? 1 : 0) + (!TMA || gather ? kWsProducerThreads : 0));
      mbarrier_init(empty(s), 8 * kCtas);  // one arrival per consumer warp of the cluster
    }
    // Makes the initialised barriers visible to the other threads' (and the cp.async unit's) arrivals.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the only CTA-wide barrier: from here on, the roles meet only at mbarriers
  if constexpr (kCtas > 1) cluster_sync();  // the peer's barriers are initialised before we arrive on them

  // Tiles are handed out per cluster (one CTA when CLUSTER = none), in ws_tile_coordinates' order
  // over the grid of cluster tiles: share_a's cluster tile (y, x') is the tiles x = 2 x', 2 x' + 1
  // of row y; share_b's (y', x) the tiles y = 2 y', 2 y' + 1 of column x (the host bound of block
  // rows rounded up to even). This CTA takes the one of its rank.
  const uint32_t rank = kCtas > 1 ? cluster_rank() : 0;
  const int y_count = tiles / tiles_x;
  const int cluster_tiles_x = CLUSTER == WsCluster::share_a ? tiles_x / 2 : tiles_x;
  const int cluster_tiles = CLUSTER == WsCluster::share_a   ? tiles / 2
                            : CLUSTER == WsCluster::share_b ? tiles_x * ((y_count + 1) / 2)
                                                            : tiles;
  // The workers: one per CTA (or cluster) of the persistent grid, or one per tile. With a stream-K
  // tail (WsStreamK products, scratch given) they share out the true tiles, from the device's count
  // of block rows; otherwise the host bound's, skipping those past the count (claim).
  // The tail only in pairs of block rows (share_b), where it measured faster; with one CTA a tile
  // every tile runs whole (tile_schedule.h). The meet is per consumer warp, and so is the register
  // epilogue.
  constexpr bool kStreamK =
      WsStreamK<Problem> && PERSISTENT && EPILOGUE_COLUMNS == kWsRegisterEpilogue && CLUSTER == WsCluster::share_b;
  bool tail = false;
  int order_tiles = cluster_tiles, k_steps_each = 0;
  if constexpr (kStreamK) {
    if (stream_k.partials != nullptr) {
      order_tiles = cluster_tiles_x * ((parameters.device_block_rows() + 1) / 2);  // pairs of block rows
      k_steps_each = parameters.k_steps();
      tail = true;
    }
  }
  const int workers = PERSISTENT ? static_cast<int>(gridDim.x) / kCtas : tiles;
  const int worker = PERSISTENT ? static_cast<int>(blockIdx.x) / kCtas
                                : static_cast<int>(blockIdx.y) * tiles_x + blockIdx.x;
  auto schedule = [&] { return TileSchedule(order_tiles, workers, worker, k_steps_each, tail); };
  // The k-steps of a piece of work: a whole tile's are its own (the weight gradients' vary by tile).
  auto k_end_of = [](const TileSegment& segment, const Problem& problem) {
    return segment.tail_tile < 0 ? problem.k_steps() : segment.k_end;
  };
  // What this CTA does with cluster tile `tile`: the tile it multiplies (its own, or under share_b
  // its peer's when its own is past the device's counts), whether it stores it, and whether the
  // pair shares B. `problem` is begun on that tile. The same answer in both CTAs of a pair and in
  // every warp: it reads only tile indices and the topology.
  struct WsWork {
    WsTile at;
    bool run, store, share_b;
  };
  auto claim = [&](int tile, Problem& problem) -> WsWork {
    WsTile at = ws_tile_coordinates(tile, cluster_tiles_x, order_tiles, group_rows);
    if constexpr (CLUSTER == WsCluster::share_a) at.x = 2 * at.x + static_cast<int>(rank);
    if constexpr (CLUSTER == WsCluster::share_b) at.y = 2 * at.y + static_cast<int>(rank);
    problem = parameters;
    const bool mine = problem.begin(at.y, at.x, ws_tile_x<Problem>());
    if constexpr (CLUSTER == WsCluster::share_b) {
      Problem peer = parameters;
      const bool theirs = peer.begin(at.y ^ 1, at.x, ws_tile_x<Problem>());
      if (!mine && theirs) {
        problem = peer;
        at.y ^= 1;
      }
      return {at, mine || theirs, mine, mine && theirs ? ws_tile_expert(problem) == ws_tile_expert(peer) : true};
    } else {
      return {at, mine, mine, false};
    }
  };
  const int warpgroup = threadIdx.x / 128;
  int iteration = 0;  // k-steps this thread's role has gone through, over all tiles (see the header)
  // Whether tile `at` is a half-row tile (the same answer in every warp: it reads only the tile's
  // block row and the topology).
  constexpr bool kHalfRows =
      TMA && WsHalfRowTiles<Problem> && EPILOGUE_COLUMNS == kWsRegisterEpilogue && CLUSTER != WsCluster::share_a;
  auto half_row = [&](const Problem& problem, WsTile at) { return kHalfRows && half_rows && ws_half_row(problem, at.y); };

  if (warpgroup == 0) {
    // ---- producer ----
    setmaxnreg_dec<kWsProducerRegisters>();
    const int thread = threadIdx.x;
    if constexpr (TMA) {
      static_assert(WsTmaCopies<Problem>, "TMA copies for a product without a ws_tma_copy overload");
      if (thread != 0 && !gather) return;  // one thread issues every copy
      constexpr uint32_t b_bytes = kWsBlockN * kBlockK * sizeof(bf16);  // 32 KB
      WsGatheredRows rows;  // this thread's rows of x when they are gathered
      TileSchedule tiles_of_worker = schedule();
      for (TileSegment segment; tiles_of_worker.next(segment);) {
        Problem problem;
        const WsWork work = claim(segment.tile, problem);
        if (!work.run) continue;
        const int k_begin = segment.k_begin, k_end = k_end_of(segment, problem);
        const bool half = half_row(problem, work.at);
        // share_b: this CTA's half of B into both CTAs' stages, when the pair shares it
        const WsPairHalves halves = work.share_b ? WsPairHalves{static_cast<int>(rank), 1, 0b11} : WsPairHalves{};
        if constexpr (WsGatherable<Problem>) {
          if (gather) rows.fetch(problem, thread);
        }
        const uint32_t a_step_bytes = gather ? 0 : half ? a_bytes / 2 : a_bytes;
        if (thread == 0) ws_acquire_expert_map(problem, maps);
        for (int step = k_begin; step < k_end; ++step, ++iteration) {
          const int stage = iteration % STAGES;
          const uint32_t use = static_cast<uint32_t>(iteration / STAGES);
          mbarrier_wait(empty(stage), (use & 1) ^ 1);
          if (thread == 0) {
            mbarrier_arrive_expect_tx(full(stage), a_step_bytes + b_bytes);  // in a sharing pair, half of
                                                                              // A or B comes from the peer
            if constexpr (CLUSTER == WsCluster::share_a)
              ws_tma_copy_shared_a(problem, maps, stage_a(stage), stage_a(stage) + a_bytes, full(stage), step, rank);
            else if constexpr (CLUSTER == WsCluster::share_b)
              ws_tma_copy(problem, maps, stage_a(stage), stage_a(stage) + a_bytes, full(stage), step, half, halves);
            else
              ws_tma_copy(problem, maps, stage_a(stage), stage_a(stage) + a_bytes, full(stage), step, half);
          }
          if constexpr (WsGatherable<Problem>) {
            if (gather) {  // all 128 rows: a padding row is a zero fill, which reads nothing
              if (step == k_begin) rows.resolve(problem, thread);
              rows.copy(stage_a(stage), problem.a, step * kBlockK, thread);
              cp_async_arrive_noinc(full(stage));  // arrives when this thread's rows have landed
            }
          }
        }
      }
      if (gather) cp_async_wait<0>();  // leave no copy in flight behind an exited thread
      if constexpr (kCtas > 1) {  // stay until both CTAs' consumers have released every stage
        for (int i = 0; i < STAGES; ++i, ++iteration)
          mbarrier_wait(empty(iteration % STAGES), (static_cast<uint32_t>(iteration / STAGES) & 1) ^ 1);
      }
    } else {
      TileSchedule tiles_of_worker = schedule();
      for (TileSegment segment; tiles_of_worker.next(segment);) {
        Problem problem;
        if (!claim(segment.tile, problem).run) continue;  // the consumers skip it too
        const int k_end = k_end_of(segment, problem);
        for (int step = segment.k_begin; step < k_end; ++step, ++iteration) {
          const int stage = iteration % STAGES;
          const uint32_t use = static_cast<uint32_t>(iteration / STAGES);
          mbarrier_wait(empty(stage), (use & 1) ^ 1);  // the consumers released its previous use
          int64_t ld;
          const bf16* a = problem.a_chunk(step, ld);
          if constexpr (a_m_major)
            ws_copy_mn_major<kWgmmaBlockM>(stage_a(stage), a, ld, thread);
          else
            ws_copy_k_major<kWgmmaBlockM>(stage_a(stage), a, ld, thread);
          const bf16* b = problem.b_chunk(step, ld);
          if constexpr (b_n_major)
            ws_copy_mn_major<kWsBlockN>(stage_a(stage) + a_bytes, b, ld, thread, ws_b_second_half(problem));
          else
            ws_copy_k_major<kWsBlockN>(stage_a(stage) + a_bytes, b, ld, thread);
          cp_async_arrive_noinc(full(stage));  // arrives when this thread's copies have landed
        }
      }
      cp_async_wait<0>();  // leave no copy in flight behind an exited thread
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<kWsConsumerRegisters>();
  const int consumer = warpgroup - 1;  // rows 64 consumer .. 64 consumer + 63 of the tile
  const int thread = threadIdx.x % 128, lane = threadIdx.x % 32, warp = thread / 32;
  unsigned char* const staging_bytes = shared_bytes + (staging_base - shared_raw);
  constexpr int row_floats = EPILOGUE_COLUMNS + kWsStagingPad;  // the staged epilogue's
  float* staging = reinterpret_cast<float*>(staging_bytes) + consumer * 64 * row_floats;
  const int bulk_warp = consumer * 4 + warp;  // the bulk epilogue's: one staging per warp
  auto release = [&](int stage) {  // by lane 0 of each consumer warp, once its wgmma reading `stage` retired
    mbarrier_arrive(empty(stage));
    if constexpr (kCtas > 1) mbarrier_arrive_remote(empty(stage), rank ^ 1u);
  };

  TileSchedule tiles_of_worker = schedule();
  for (TileSegment segment; tiles_of_worker.next(segment);) {
    Problem problem;
    const WsWork work = claim(segment.tile, problem);
    if (!work.run) continue;
    const int k_count = k_end_of(segment, problem) - segment.k_begin;
    const bool half = half_row(problem, work.at);
    // Every consumer multiplies all of its 64 rows, padding rows too (they are zero), except in a
    // half-row tile. An `if` around the wgmma that skips a warpgroup whose rows are all padding makes
    // ptxas serialise every wgmma of the kernel ("C7518 Potential Performance Loss:
    // wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted
    // WG.DP in divergent path"), so that each waits for the one before it. Keep wgmma out of any
    // branch ptxas cannot prove uniform over the warpgroup; the build must show no C7518 (-Xptxas
    // -v). Loops are fine: a half-row tile runs the second k-loop below, a whole tile the first,
    // each with a trip count of 0 for the other kind.
    // Left out: a k-loop whose trip count is 0 for a warpgroup whose 64 rows are all padding, which
    // then only hands each stage back. Under Zipf routing the SDD gains (ncu, H200, 2026-11-22,
    // T=16384 D=1024 E=64: 0.39 -> 0.37 ms), but the DSD loses (D=2048 E=64 K=2: 1.65 -> 1.85 ms),
    // and the forward at D=4096, where no tile has a padding half, goes from 5.4-5.5 to 6.0-6.2 ms:
    // the loop, not the skipping, costs it. The half-row tiles' second loop costs the DSD in the
    // same way, so only the SDDs have one (WsHalfRowTiles).

    float acc[kAccumulators];
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.0f;

    // One k-step: wait for the stage, issue its wgmma group, hand the previous step's stage back.
    // A whole tile: this warpgroup's 64 rows of A by the 256 columns of B (m64n256k16). A half-row
    // tile: rows 0-63 of A by this warpgroup's 128 columns of B (m64n128k16, the first 64
    // accumulators), which start 16 KB into B in either of its layouts (four [64 k][64 n] groups
    // 8 KB apart, or 256 rows of n 128 bytes apart).
    int previous_stage = 0;
    auto k_step = [&](auto half_tile, int step) {
      constexpr bool kHalf = decltype(half_tile)::value;
      const int stage = iteration % STAGES;
      mbarrier_wait(full(stage), static_cast<uint32_t>(iteration / STAGES) & 1);  // its copies landed
      fence_proxy_async();  // ... and are visible to the tensor cores (async proxy)
      const uint32_t a = stage_a(stage) + (kHalf ? 0u : static_cast<uint32_t>(consumer) * 64 * 128);
      const uint32_t b = stage_a(stage) + a_bytes + (kHalf ? static_cast<uint32_t>(consumer) * 16 * 1024 : 0u);
      if constexpr (kHalf)
        wgmma_k_step<128, a_m_major, b_n_major>(*reinterpret_cast<float(*)[kAccumulators / 2]>(acc), a, b);
      else
        wgmma_k_step<256, a_m_major, b_n_major>(acc, a, b);
      // Keep this step's group running; once the previous step's has retired, its stage goes back.
      wgmma_wait<1>();
      if (step > 0 && lane == 0) release(previous_stage);
      previous_stage = stage;
      ++iteration;
    };
    const int whole_steps = half ? 0 : k_count, half_steps = half ? k_count : 0;
    for (int step = 0; step < whole_steps; ++step) k_step(std::false_type{}, step);
    for (int step = 0; step < half_steps; ++step) k_step(std::true_type{}, step);
    wgmma_wait<0>();
    if (k_count > 0 && lane == 0) release(previous_stage);
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) register_fence(acc[i]);
    if (!work.store) continue;  // share_b: the peer's tile, multiplied only to keep the pair in step
    if constexpr (kStreamK) {  // a part of a cut tile: the last of its parts to arrive stores it
      if (segment.cut(k_steps_each)) {
        auto place = [&](int index) { return (index * kCtas + static_cast<int>(rank)) * 8 + consumer * 4 + warp; };
        float4* const partials = reinterpret_cast<float4*>(stream_k.partials);
        const int tail_tile = segment.tail_tile;
        const int own = place(tiles_of_worker.part_slot(worker, tail_tile));
        if (!ws_stream_k_arrive(stream_k.counts + 2 * place(tail_tile), partials + own * kWsPartialFloat4s,
                                tiles_of_worker.parts(tail_tile), lane, acc))
          continue;
        for (int w = tiles_of_worker.first_worker(tail_tile), last = tiles_of_worker.last_worker(tail_tile); w <= last; ++w) {
          if (w == worker || !tiles_of_worker.has_steps(w)) continue;
          ws_stream_k_add(partials + place(tiles_of_worker.part_slot(w, tail_tile)) * kWsPartialFloat4s, lane, acc);
        }
      }
    }

    // Accumulator layout of m64nNk16: warp w owns rows 16w .. 16w+15; acc[4j + v] is row
    // 16w + lane/4 (+8 for v >= 2), column 8j + 2 (lane % 4) (+1 for odd v).
    const int row = warp * 16 + lane / 4;
    if constexpr (EPILOGUE_COLUMNS == kWsRegisterEpilogue) {
      if (half) {
        ws_register_epilogue<kWsBlockN / 2>(problem, acc, row, consumer * (kWsBlockN / 2), lane % 4);
        ws_zero_rows<kWsBlockN / 2>(problem, consumer * (kWsBlockN / 2), warp, lane);
      } else {
        ws_register_epilogue<kWsBlockN>(problem, acc, consumer * 64 + row, 0, lane % 4);
      }
    } else if constexpr (EPILOGUE_COLUMNS == kWsBulkEpilogue) {
      if (maps.outputs != nullptr && ws_bulk_store_aligned(problem))
        ws_bulk_epilogue(problem, maps.outputs + problem.out_expert, acc, staging_bytes + bulk_warp * kWsBulkWarpBytes,
                         staging_base + bulk_warp * kWsBulkWarpBytes, consumer * 64 + warp * 16, lane);
      else
        ws_register_epilogue<kWsBlockN>(problem, acc, consumer * 64 + row, 0, lane % 4);
    } else {
      // ---- staged epilogue: fragments -> staging -> 16-byte chunks, as block_sparse_wgmma.cuh's ----
      if constexpr (!PERSISTENT) named_barrier(1, 256);  // the staging reuses stages the other
                                                         // warpgroup's last wgmma may still read
      constexpr int passes = kWsBlockN / EPILOGUE_COLUMNS;
      constexpr int slab_columns = EPILOGUE_COLUMNS < 128 ? EPILOGUE_COLUMNS : 128;  // one B x B block at most
      constexpr int slab_row_chunks = slab_columns / 8;
#pragma unroll
      for (int pass = 0; pass < passes; ++pass) {
#pragma unroll
        for (int jj = 0; jj < EPILOGUE_COLUMNS / 8; ++jj) {
          const int j = pass * (EPILOGUE_COLUMNS / 8) + jj, n = 8 * jj + 2 * (lane % 4);
          *reinterpret_cast<float2*>(staging + row * row_floats + n) = make_float2(acc[4 * j], acc[4 * j + 1]);
          *reinterpret_cast<float2*>(staging + (row + 8) * row_floats + n) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
        }
        named_barrier(2 + consumer, 128);  // this warpgroup's fragments are all in the staging
        // Chunk order: slab of <= 128 columns (one block of SDD), row, chunk: a warp stores whole
        // 16-chunk rows of one block, contiguous in the block array.
        constexpr int chunks = 64 * EPILOGUE_COLUMNS / 8;
#pragma unroll 2
        for (int chunk = thread; chunk < chunks; chunk += 128) {
          const int slab = chunk / (64 * slab_row_chunks), within = chunk % (64 * slab_row_chunks);
          const int r = within / slab_row_chunks, n = slab * slab_columns + (within % slab_row_chunks) * 8;
          const float4 lo = *reinterpret_cast<const float4*>(staging + r * row_floats + n);
          const float4 hi = *reinterpret_cast<const float4*>(staging + r * row_floats + n + 4);
          const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          problem.store_chunk(consumer * 64 + r, pass * EPILOGUE_COLUMNS + n, v);
        }
        named_barrier(2 + consumer, 128);  // every read is done before the staging is written again
      }
    }
  }
  if constexpr (EPILOGUE_COLUMNS == kWsBulkEpilogue) {
    if (lane == 0) bulk_wait();  // the last tile's copies are written before the CTA exits
  }
#else
  __trap();  // built without sm_90a: the host must never pick this kernel
#endif
}

}  // namespace moe::cuda::block_sparse_detail
