// sdd.cu: lesson: the SDD of MegaBlocks (Gale et al., MLSys 2023), the first expert layer of the
// dropless MoE forward, from one thread per output to tensor cores, in the llm.c dev/cuda style.
//
//   blocks(r, j) = x_perm[rB : rB+B, :] · W1[e][:, jB : jB+B]     e = block_row_expert[r]
//
// x_perm [max_rows, D] bf16 (tokens sorted by expert, each expert padded to a multiple of B),
// W1[e] [D, H] bf16 through a device table of per-expert pointers, out [max_nnz, B, B] bf16 in BCSR
// order. The grid is sized by host bounds (max_nnz, max_block_rows); the true counts stay on the
// device and the CTAs past them exit (cuda/moe/device_plan.h).
//
// Versions (kTileVersions and run_version):
//   1  naive: one thread per output element, fp32 FMA straight from global memory
//   2  shared-memory tiles: a CTA computes 64 x 64 of a block, 4 x 4 outputs per thread, bf16 tiles
//      converted to fp32 in shared memory, fp32 FMA
//   3  tensor cores: mma.sync.m16n8k16 bf16, ldmatrix, a 3-stage cp.async pipeline, XOR-swizzled
//      shared memory, a B x 128 tile per CTA, 8 warps of 64 x 32 (the kernel of block_sparse.cuh);
//      188 registers, so 1 CTA per SM
//   4  the same with registers capped at 128 (__launch_bounds__(256, 2)): 2 CTAs per SM, one computes
//      while the other waits at its barrier. Measured on an H200 (T=16384 D=1024 H=4096 E=64 K=1):
//      180 -> 235 TFLOP/s useful. This is the mainline's configuration.
//   5  a B x 256 tile, warps of 64 x 64 (fewer ldmatrix per mma): 255 registers, slower (95 TFLOP/s).
//      Also tried and dropped: double-buffering the ldmatrix fragments in registers: no change
//      (ptxas already overlaps them with the mma).
//   6  Hopper tensor cores: wgmma.mma_async m64n128k16 (sm_90a), a 128 x 128 tile per CTA of 2
//      warpgroups (64 rows each), operands read by the tensor cores straight from 128-byte-swizzled
//      shared memory through matrix descriptors, 6 cp.async stages, one wgmma group left in flight
//      across the barrier (the kernel of block_sparse_wgmma.cuh); W1[e] [D, H] is N-major for
//      wgmma's B: the transpose-B flag reads it as stored
//   7  the same with a 128 x 256 tile (m64n256k16, 128 fp32 accumulators per thread), 4 stages
//   8  128 x 128, 3 stages, 2 CTAs per SM (registers capped at 128)
//   9  the same, with no wgmma left in flight (wait_group 0 each step): the copies then run 2 steps
//      ahead instead of 1. The mainline's configuration for SDD and DSD before version 12
//   10 128 x 256, 4 stages, no wgmma in flight
//      Measured on an H200 (TFLOP/s useful, T=16384 D=1024 H=4096 E=64 K=1 | D=2048 H=8192 K=2;
//      cuBLAS dense 705 | 778), with the epilogue kind a run-time switch in every store:
//      v4 239 | 270, v6 217 | 306, v7 93 | 169, v8 264 | 337, v9 327 | 364-427, v10 92 | 163.
//   11 the mainline library call moe::cuda::sdd (on an H100/H200 at B = 128 and H % 256 = 0 the
//      kernel of version 19, before it 18, 16 and 12; else version 4)
//   12 version 9 with the epilogue staged through shared memory: after the main loop the fp32 tile
//      goes to the (now idle) stage buffers, then each thread applies the epilogue to 16-byte chunks
//      of 8 columns and stores them, a warp 512 contiguous bytes of a block (instead of 4-byte
//      stores spread over 8 rows). The mainline's SDD.
//   13 version 10 (128 x 256, wait 0), staged;  14 version 7 (128 x 256, one wgmma in flight), staged
//      In every version of this file the epilogue kind is a template parameter of SddProblem: one
//      kernel per kind, no switch. That alone takes the SDD kernels from 10k-20k SASS instructions
//      to 1.4k-2.6k (the cubin's .text sizes); the switch was the 128 x 256 tiles' 3x loss: v7 93
//      -> 275 | 169 -> 359.
//      Measured on an H200, 2026-11-22 (same shapes; cuBLAS 688 | 750):
//        v4 228 | 264, v6 259 | 319, v7 275 | 359, v8 258 | 323, v9 307 | 361, v10 267 | 339,
//        v12 366 (53%) | 390 (52%), v13 321 | 336, v14 323 | 339; a second run: v12 366 | 408,
//        v13 314 | 366, v14 316 | 366 (the large shape drifts up to 10% between runs, cuBLAS too).
//      Whole forward with this mainline (SDD v12 + GeLU, DSD as v14): 0.44x | 0.51x two dense cuBLAS
//      GEMMs, from 0.40x | 0.48x with version 9's.
//      Predicted: staged epilogue +10-20% at 128 x 128 (measured: +19% | +8%), and 128 x 256 then
//      ahead of 128 x 128 by its lighter L2 traffic (12 KB per MFLOP against 16): it is not, at
//      1 CTA per SM: K = D gives only 16-32 k-steps, and nothing overlaps one CTA's pipeline fill
//      and epilogue. On the DSD (K = H: 64-128 k-steps) it is: v9 315 | 344, v12 309 | 340,
//      v13 310 | 358, v14 308 | 381; the mainline DSD takes version 14's configuration.
//      What limits version 12: at 390 TFLOP/s its 128 x 128 tiles pull about 6 TB/s of operands
//      from L2 into the SMs; the way forward is 128 x 256 tiles with the fill and the epilogue
//      hidden: a producer warp with deeper stages, a persistent grid, TMA multicast in a cluster.
//   15 warp-specialized (block_sparse_wgmma_ws.cuh): a 128 x 256 tile per CTA of 3 warpgroups, 1 CTA
//      per SM. Warpgroup 0, the producer, only issues cp.async into a ring of 4 stages of 48 KB and
//      marks each stage "full" on an mbarrier (cp.async.mbarrier.arrive.noinc: the arrival fires
//      when the copies land); warpgroups 1-2, the consumers, each 64 rows x 256 columns
//      (m64n256k16), wait for "full", issue wgmma, and mark the stage "empty" on a second mbarrier
//      once wgmma.wait_group says its reads are done. No __syncthreads in the k-loop: the producer
//      runs up to 4 stages ahead whatever the consumers do, and one wgmma group stays in flight
//      without holding back a copy (versions 7 and 14 had to choose). setmaxnreg moves registers
//      from the producer (40) to the consumers (232). The staged epilogue reuses the stages.
//   16 version 15, persistent: grid = one CTA per SM, each CTA walks tiles b, b + grid, ... with
//      one running stage counter, so the producer fills the next tile's stages while the consumers
//      store this one; the staging then needs its own shared memory: 4 stages (192 KB) leave room
//      for 32 columns of fp32 per pass (8 passes per tile)
//   17 version 16 with 3 stages, leaving room for 128-column passes (2 per tile)
//      Prediction: 15 above 14 by the per-step barrier it drops and the copies it keeps 4 stages
//      ahead, though at 1 CTA per SM its fill and epilogue are still exposed (16-32 k-steps a tile
//      at D = 1024 | 2048); 16-17 above 15 by hiding them (a 128 x 256 tile stores 64 KB), and
//      above version 12 if the 128 x 256 tile's lighter L2 traffic is what limits it.
//      Measured on an H200, 2026-11-22 (T=16384 D=1024 H=4096 E=64 K=1; cuBLAS 697): v12 368 (53%),
//      v15 393 (56%), v16 399 (57%), v17 399 (57%). The producer pays (+7% over v12, +25% over v14,
//      its 128 x 256 tile without a producer); persistence adds little (+2%). The mainline takes
//      version 16 for every product tiled over N (block_sparse.cu). Every version passes the
//      check on the small problem; the persistent loop over several tiles per CTA is checked by
//      tests/cuda/test_block_sparse.cpp (PersistentTilesB128) and moe_bench's checks.
//   18 version 16 with TMA copies (cuda/moe/tensor_map.h): the producer is ONE thread, which issues a
//      box per 8 KB (two 64-row boxes of x, four [64 k][64 n] boxes of W1) from tensor maps, and the
//      stage's full mbarrier counts bytes (expect_tx / complete_tx) instead of 128 cp.async
//      arrivals; the TMA unit does the addressing, the bounds and the 128-byte swizzle. W1 is
//      reached through a device pointer table, so its maps (one per expert) are built on the device
//      before each launch: a kernel copies a prototype map and swaps in each expert's address
//      (tensormap.replace).
//      Measured on an H200, 2026-11-22 (useful TFLOP/s, % of cuBLAS), version 16 -> 18:
//        T=16384 D=1024 H=4096 E=64 K=1:   373 -> 400 (58%)     cuBLAS 694
//        T=16384 D=2048 H=8192 E=64 K=2:   395 -> 489 (62%)     cuBLAS 788
//        T=8192 D=4096 H=14336 E=8 K=2:    501 -> 566 (74%)     cuBLAS 770
//      The maps come from a pool that keeps its memory: the default pool of cudaMallocAsync gives
//      its memory back at every synchronisation, so a benchmark that synchronises between runs has
//      the GPU wait for fresh physical memory before every launch, and version 18 then measures
//      slower than 16 at D = 1024 (0.40 against 0.37 ms).
//      Also tried, and left out: clusters of 2 CTAs on the two tiles of a block row side by side,
//      each copying half of the shared A tile and multicasting it to both (the "empty" barriers
//      then wait for both CTAs' consumers). Half the L2 reads of A, but no gain: the FFN forward
//      measured 2-5% slower at the three reference shapes (moe_bench --shapes baselines), the DSD alone 0.32 -> 0.31 ms at D = 1024
//      but 2.14 -> 2.35 ms at D = 2048 (H200, 2026-11-22).
//      The figures of version 18 above (not those of 15-17) come from a build with ptxas serialising
//      the wgmma (each waits for the one before it). An `if` around the consumers' wgmma (to skip a
//      warpgroup whose 64 rows are all padding) makes ptxas report "C7518 Potential Performance
//      Loss: wgmma.mma_async instructions are serialized due to program dependence on
//      compiler-inserted WG.DP in divergent path" for every kernel of the header; the report shows
//      only with -Xptxas -v, and nothing else changes. Without the `if` (padding rows are zero, so
//      computing them is harmless), version 18 at the three shapes: 418, 498, 606 TFLOP/s (59%, 65%,
//      75% of cuBLAS; H200, 2026-11-22), and the whole forward at D = 4096 0.83x -> 1.05x dense.
//      The ctest PtxasWgmmaPipelined.block_sparse fails on any C751x.
//      The cluster-multicast figures above come from the same build, with the wgmma serialised:
//      the issue of wgmma, not the L2 traffic that multicast halves, held those kernels back, so
//      they say nothing of the pipelined kernel (version 21 measures it).
//   19 version 18 with the register epilogue (ws_register_epilogue): no staging. The 4 lanes of a
//      quad hold the 8 columns of a chunk between them; two butterfly stages of __shfl_xor_sync
//      give each lane a whole chunk, which it stores as 16 bytes. No shared memory, no named
//      barrier. ncu on the staged epilogue shows why it costs: the consumers wait at 16 named
//      barriers a tile with the tensor cores idle; with rows padded by 8 floats every access also
//      used half the banks (10.4-12.7 wavefronts per chunk read, 2.3-2.5 per fragment write), which
//      the pad of 4 removes (conflict-free), but the trip through shared memory remains.
//      Measured on an H200, 2026-11-22 (useful TFLOP/s, % of cuBLAS), version 18 -> 19:
//        T=16384 D=1024 H=4096 E=64 K=1:   418 -> 423 (59%)     cuBLAS 712
//        T=16384 D=2048 H=8192 E=64 K=2:   498 -> 492 (64%)     cuBLAS 765
//        T=8192 D=4096 H=14336 E=8 K=2:    606 -> 578 (72%)     cuBLAS 804
//      On the SDD alone a draw, or a loss where tiles are long (64 k-steps at D = 4096: the
//      epilogue is a small share, and a warp's stores cover 8 rows x 64 bytes instead of 512
//      contiguous bytes). It pays where tiles are short: the weight gradients (4 k-steps a tile at
//      D = 1024) went from 431 / 424 / 439 us to 409 / 344 / 334 us (the SDD of the backward, DSᵀD,
//      DDS; ncu, T=16384 D=1024 E=64 uniform), and the layer (moe_bench, the same run, mainline
//      built both ways): forward + backward 0.62x -> 0.68x dense at D = 1024, 0.77x -> 0.79x at
//      D = 2048; forward 0.84x -> 0.94x at D = 2048, 0.98x -> 1.05x at D = 4096.
//      The mainline (version 11) runs version 19's kernel for every product at B = 128, with a
//      grouped tile order where a row of tiles is long (block_sparse_wgmma_ws.cuh).
//   20 version 19 reading x in token order: the producer gathers each row through the plan's
//      row_slot (row r = x[row_slot[r] / K], zeros for padding) with cp.async, 8 rows per thread
//      looked up once a tile, while thread 0 still copies W1 by TMA (WsGatheredRows). No permuted
//      copy of x exists: the permute kernel before the SDD is folded into its copies (ScatterMoE
//      does the same in its grouped GEMM). Its cost against version 19 is what the layer weighs
//      against the permute it saves (block_sparse.h, gathering_pays: narrow experts only).
//      Measured on an H200, 2026-11-22 (useful TFLOP/s, % of cuBLAS), version 19 -> 20:
//        T=16384 D=1024 H=4096 E=64 K=1:   431 -> 393 (55%)     cuBLAS 710
//        T=16384 D=2048 H=8192 E=64 K=2:   502 -> 452 (59%)     cuBLAS 762
//        T=8192 D=4096 H=14336 E=8 K=2:    557 -> 498 (65%)     cuBLAS 770
//      9-11% here, on the plain store epilogue; on the layer's GeLU SDD, whose consumers are busier
//      with two outputs, ncu measured 2-3% at D = 1024 (322 -> 329 us) and 8% at D = 4096 (2.78 ->
//      3.00 ms). The 128 producer threads issue ~100 instructions a warp a k-step where one thread
//      issued TMA boxes. TMA boxes of one row each instead: right (the swizzle follows the
//      shared-memory address), but 1.08 / 14.1 ms, ~55 cycles a box: Hopper's TMA has no gather.
//   21 version 19 in clusters of two CTAs (a launch attribute): the two take the tiles side by side
//      in a block row, (r, 2p) and (r, 2p + 1), which multiply the same 128 rows of x. Each CTA's
//      producer copies 64 of those rows with TMA multicast into the same stage of both CTAs, so the
//      L2 serves 8 + 32 KB a k-step to each SM instead of 16 + 32. A stage is then empty only when
//      both CTAs' consumers are done with it: each consumer warp arrives on its own "empty" barrier
//      and, through mapa, on the peer's; each producer stays until every stage has been released,
//      so that no arrival lands in a CTA that has exited (block_sparse_wgmma_ws.cuh, CLUSTER).
//      Version 18's note has the same idea measured with the wgmma serialised; this one runs on the
//      pipelined kernel.
//      Measured on an H200, 2026-11-22 (useful TFLOP/s, % of cuBLAS, one run; dev_sdd's own random
//      routing; notebooks_data/bench/dev_sdd_h200_2026-11-22.log), version 19 -> 21:
//        T=16384 D=1024 H=4096 E=64 K=1:   385 -> 311 (53%)     cuBLAS 584
//        T=16384 D=2048 H=8192 E=64 K=2:   515 -> 353 (58%)     cuBLAS 607
//        T=8192 D=4096 H=14336 E=8 K=2:    595 -> 453 (70%)     cuBLAS 651
//      Right (the check passes), and 19-31% slower, with the consumers' arrival on the peer's
//      "empty" barrier as mbarrier.arrive.release.cluster: a cluster-scope release makes ptxas put a
//      MEMBAR.ALL.GPU before it (cuobjdump -sass), so each consumer warp waits at every k-step for
//      its earlier stores to reach the L2. The lockstep (a stage is refilled only when both CTAs'
//      consumers have released it) is not the cause. With the default .release.cta form (CUTLASS's;
//      the arrival has nothing to publish), one run, H200, 2026-11-22, % of cuBLAS, version 19 -> 21:
//      67.2 -> 67.8, 83.6 -> 86.0, 92.0 -> 93.1
//      (notebooks_data/bench/ncu_block_row_pairs_h200_2026-11-22.txt).
//   22 version 19 in clusters of two CTAs the other way (WsCluster::share_b): the two take block rows
//      2y and 2y + 1 at the same columns; where one expert owns both, each copies one half of W1's
//      chunk by TMA multicast into both, so the L2 serves 16 + 16 KB a k-step to each SM instead of
//      16 + 32, twice what version 21 saves. Where the rows belong to two experts each copies its own
//      chunk; where one row is past the routed rows its CTA multiplies the peer's tile and stores
//      nothing, so that the pair stays in step. H200, 2026-11-22 (one run, % of cuBLAS, dev_sdd's
//      own random routing; notebooks_data/bench/ncu_block_row_pairs_h200_2026-11-22.txt), versions
//      19 | 21 | 22: 67.0 | 66.6 | 67.2 at D = 1024, 83.3 | 86.5 | 86.9 at D = 2048, 97.5 | 98.3 |
//      98.3 at D = 4096. The mainline's SDDs and DSDs take these pairs where an expert has 4 or
//      more block rows (block_sparse.cu, block_row_pairs_share_weights).
//   cuBLAS: cublasGemmEx bf16 / fp32 compute on the dense product [T*K, D] x [D, H], the same useful
//      FLOPs with no padding and no sparsity: the ceiling a block-sparse kernel is measured against.
// Every version is first checked against the CPU reference (moe::ref::sdd) on a small problem with
// fresh random inputs and a NaN-poisoned output; then all are timed on the large problem (CUDA
// events, 3 warm-up runs and at least 1 s of them, median of 20) and a table prints TFLOP/s of useful work and % of cuBLAS.
// Last lines time the mainline DSD alone and the whole dropless forward (SDD + GeLU, DSD) against
// cuBLAS's dense GEMMs.
//
// Build: cmake --build build --target dev_sdd
// Run:   build/cuda/dev/dev_sdd [T D H E K B] [--versions 19,21,22]
//        (default 16384 1024 4096 64 1 128, uniform routing, every version this GPU runs)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "command_line.h"                 // CLI::App, parse_command_line, whole_number_list
#include "reference_cpu/block_sparse.h"   // moe::ref::sdd
#include "moe/block_sparse.h"             // moe::cuda::sdd, dsd, block_sparse_ffn_forward (version 11)
#include "moe/block_sparse.cuh"           // the mma.sync tile kernel (versions 3-5)
#include "moe/block_sparse_wgmma.cuh"     // the wgmma tile kernel (versions 6-10, 12-14)
#include "moe/tensor_map.h"               // make_matrix_map, build_expert_maps (version 18)
#include "moe/block_sparse_wgmma_ws.cuh"  // the warp-specialized wgmma kernel (versions 15-18)
#include "bridge/reference_topology.h"        // upload_topology
#include "core/clock_warm_up.h"           // warm_up_clock
#include "core/cuda_check.h"              // CUDA_CHECK
#include "core/device_buffer.h"           // DeviceBuffer
#include "reference_cpu/topology.h"       // moe::ref::plan_dispatch, make_topology
#include "init.h"                         // moe::ref::random_matrix

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::cuda::DeviceTopology;
using moe::cuda::block_sparse_detail::WsCluster;

#define CUBLAS_CHECK(call)                                                              \
  do {                                                                                  \
    cublasStatus_t status_ = (call);                                                    \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #call, int(status_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// ---- version 1: one thread per output element ----
// Thread (block, m, n) walks the inner dimension D alone. Consecutive threads take consecutive n,
// so the W1 reads are coalesced and the x reads are broadcasts; but every element of x and W1 is
// re-read from L2 by B threads of B CTAs, and each FMA costs two loads: memory-latency bound.
__global__ void sdd_kernel1(const DeviceTopology t, const bf16* x, int D, const bf16* const* w1, int H,
                            bf16* out) {
  const int B = t.block_size;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t block = index / (B * B);
  if (block >= *t.nnz) return;  // past the true count: nothing to do
  const int m = static_cast<int>(index % (B * B)) / B, n = static_cast<int>(index % B);
  const int r = t.row_indices[block], c = t.column_indices[block];
  const int e = t.block_row_expert[r], j = c % t.blocks_per_expert;
  const bf16* a = x + (static_cast<int64_t>(r) * B + m) * D;
  const bf16* b = w1[e] + j * B + n;
  float sum = 0.0f;
  for (int k = 0; k < D; ++k) sum += __bfloat162float(a[k]) * __bfloat162float(b[static_cast<int64_t>(k) * H]);
  out[index] = __float2bfloat16(sum);
}

// ---- version 2: shared-memory tiles, register micro-tiles ----
// A CTA of 16 x 16 threads computes a 64 x 64 quarter (B = 128) or all (B = 64) of one block. Per
// k-step of 32 it stages x[64 x 32] and W1[32 x 64] in shared memory (as fp32), and each thread
// accumulates a 4 x 4 micro-tile from 8 shared loads per 16 FMA. Strided micro-tiles (rows ty + 16i,
// columns tx + 16j) keep the shared-memory reads free of bank conflicts.
constexpr int kTile2 = 64, kTileK2 = 32;
__global__ void __launch_bounds__(256) sdd_kernel2(const DeviceTopology t, const bf16* x, int D,
                                                   const bf16* const* w1, int H, bf16* out) {
  __shared__ float tile_a[kTileK2][kTile2 + 1];  // [k][m]: +1 breaks the transposed store's conflicts
  __shared__ float tile_b[kTileK2][kTile2];      // [k][n]
  const int B = t.block_size;
  const int quarters = (B / kTile2) * (B / kTile2);
  const int64_t block = blockIdx.x / quarters;
  if (block >= *t.nnz) return;
  const int quarter = blockIdx.x % quarters;
  const int m0 = (quarter / (B / kTile2)) * kTile2, n0 = (quarter % (B / kTile2)) * kTile2;
  const int r = t.row_indices[block], c = t.column_indices[block];
  const int e = t.block_row_expert[r], j = c % t.blocks_per_expert;
  const bf16* a = x + (static_cast<int64_t>(r) * B + m0) * D;  // [64, D] rows of x
  const bf16* b = w1[e] + j * B + n0;                          // [D, 64] columns of W1[e]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;

  float acc[4][4] = {};
  for (int k0 = 0; k0 < D; k0 += kTileK2) {
    for (int i = threadIdx.x; i < kTile2 * kTileK2; i += 256) {
      const int m = i / kTileK2, k = i % kTileK2;  // consecutive threads: consecutive k of one x row
      tile_a[k][m] = __bfloat162float(a[static_cast<int64_t>(m) * D + k0 + k]);
      const int kb = i / kTile2, n = i % kTile2;  // consecutive threads: consecutive n of one W1 row
      tile_b[kb][n] = __bfloat162float(b[static_cast<int64_t>(k0 + kb) * H + n]);
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kTileK2; ++k) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = tile_a[k][ty + 16 * i];
#pragma unroll
      for (int q = 0; q < 4; ++q) bv[q] = tile_b[k][tx + 16 * q];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][q] += av[i] * bv[q];
    }
    __syncthreads();
  }
  bf16* o = out + block * B * B;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      o[static_cast<int64_t>(m0 + ty + 16 * i) * B + n0 + tx + 16 * q] = __float2bfloat16(acc[i][q]);
}

// ---- versions 3-5: the tensor-core tile kernel of block_sparse.cuh, three tile configurations ----
// The kernel is the mainline's; only the tile shape and the CTAs per SM change:
//   3  BM x 128 tile (BM = B), 8 warps of 64 x 32 (B = 128), 1 CTA per SM (188 registers)
//   4  the same, registers capped at 128 so that 2 CTAs share an SM (one computes while the other
//      waits at its barrier)
//   5  BM x 256 tile, 8 warps of 64 x 64: 8 ldmatrix per 32 mma instead of 6 per 16
template <int BN, int MIN_BLOCKS, int BM>
void launch_tensor_core_shape(const moe::cuda::block_sparse_detail::SddProblem<
                                  moe::cuda::block_sparse_detail::Layout::row_major_km,
                                  moe::cuda::block_sparse_detail::SddEpilogue::store>& problem,
                              int H, int block_rows, cudaStream_t stream) {
  using namespace moe::cuda::block_sparse_detail;
  constexpr int smem = pipeline_shared_bytes<BM, BN>();
  auto* kernel =
      &block_sparse_mma_kernel<BM, BN, MIN_BLOCKS, SddProblem<Layout::row_major_km, SddEpilogue::store>>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(H / BN, block_rows), kThreads, smem, stream>>>(problem);
}

// The SDD of this lesson as the tile kernels' problem: x [rows, D] times W1[e] [D, H], stored as
// blocks (the plain store epilogue: the CPU oracle is the plain SDD). Every tensor-core version
// below launches this same problem; only the kernel and its tile configuration change.
using LessonSdd = moe::cuda::block_sparse_detail::SddProblem<moe::cuda::block_sparse_detail::Layout::row_major_km,
                                                             moe::cuda::block_sparse_detail::SddEpilogue::store>;
// The problem's a is x [rows, D] (inner = D), its b W1 (ldb = H), its out0 the blocks.
LessonSdd lesson_sdd_problem(const DeviceTopology& t, const bf16* x, int D, const bf16* const* w1, int H, bf16* out) {
  using namespace moe::cuda::block_sparse_detail;
  LessonSdd problem = with_expert_operand(with_topology(LessonSdd{}, t), moe::cuda::ExpertOperand{w1, H, 0, false});
  problem.a = x;
  problem.inner = D;
  problem.out0 = out;
  return problem;
}

template <int BN, int MIN_BLOCKS>
void launch_tensor_core(const LessonSdd& problem, const DeviceTopology& t, cudaStream_t stream) {
  const int H = problem.ldb;
  if (H % BN != 0) {
    std::fprintf(stderr, "this tile needs H %% %d == 0\n", BN);
    std::exit(1);
  }
  if (t.block_size == 128)
    launch_tensor_core_shape<BN, MIN_BLOCKS, 128>(problem, H, t.max_block_rows, stream);
  else
    launch_tensor_core_shape<BN, MIN_BLOCKS, 64>(problem, H, t.max_block_rows, stream);
}

// ---- versions 6-10, 12-14: the wgmma tile kernel of block_sparse_wgmma.cuh (sm_90a, B = 128 only) ----
template <int BN, int STAGES, int MIN_BLOCKS, int IN_FLIGHT, bool STAGED>
void launch_wgmma(const LessonSdd& problem, const DeviceTopology& t, cudaStream_t stream) {
  using namespace moe::cuda::block_sparse_detail;
  using Sdd = LessonSdd;
  const int H = problem.ldb;
  if (H % BN != 0 || t.block_size != kWgmmaBlockM) {
    std::fprintf(stderr, "the wgmma versions need B = 128 and H %% %d == 0\n", BN);
    std::exit(1);
  }
  constexpr int smem = wgmma_shared_bytes<BN, STAGES>();
  auto* kernel = &block_sparse_wgmma_kernel<BN, STAGES, MIN_BLOCKS, IN_FLIGHT, STAGED, Sdd>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(H / BN, t.max_block_rows), kWgmmaThreads, smem, stream>>>(problem);
}

// ---- versions 15-17: the warp-specialized kernel of block_sparse_wgmma_ws.cuh (sm_90a, B = 128) ----
// 128 x 256 tiles, a producer warpgroup and 2 consumer warpgroups, 384 threads, 1 CTA per SM.
// Not persistent: one CTA per tile, the grid (H / 256, block-row bound) as in versions 6-14.
// Persistent: one CTA per SM (fewer if there are fewer tiles), each walking tiles with a stride of
// the grid; the tile count is the host bound, the CTAs skip the tiles past the device count.
// TMA (version 18): the producer's copies come from tensor maps (cuda/moe/tensor_map.h): x as a 2-D map
// in boxes of 64 k x 64 rows, and one map per expert's W1 in boxes of 64 n x 64 k, built on the
// device before each launch from the pointer table, as the mainline does.
// Gathered rows (version 20): x is in token order [T, D] and the problem's `gather` says where each
// row comes from.
// Clusters (versions 21 and 22): the persistent grid in clusters of two CTAs, which share the A
// operand of two tiles side by side (share_a; H / 256 must be even) or the B operand of two block
// rows one above the other (share_b), by TMA multicast.
template <int STAGES, int EPILOGUE_COLUMNS, bool PERSISTENT, bool TMA = false, WsCluster CLUSTER = WsCluster::none>
void launch_wgmma_ws(const LessonSdd& problem, const DeviceTopology& t, cudaStream_t stream) {
  using namespace moe::cuda::block_sparse_detail;
  using Sdd = LessonSdd;
  const bf16* x = problem.a;
  const int D = problem.inner, H = problem.ldb;
  if (H % kWsBlockN != 0 || t.block_size != kWgmmaBlockM) {
    std::fprintf(stderr, "the warp-specialized versions need B = 128 and H %% %d == 0\n", kWsBlockN);
    std::exit(1);
  }
  const int tiles_x = H / kWsBlockN, tiles = tiles_x * t.max_block_rows;
  constexpr int smem = ws_shared_bytes<STAGES, EPILOGUE_COLUMNS, PERSISTENT>();
  auto* kernel = &block_sparse_wgmma_ws_kernel<STAGES, EPILOGUE_COLUMNS, PERSISTENT, TMA, Sdd, CLUSTER>;
  constexpr int ctas = CLUSTER == WsCluster::none ? 1 : 2;
  if (CLUSTER == WsCluster::share_a && tiles_x % 2 != 0) {
    std::fprintf(stderr, "version 21 pairs the 256-column tiles of a block row: H / 256 must be even\n");
    std::exit(1);
  }
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  dim3 grid(tiles_x, t.max_block_rows);
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if constexpr (PERSISTENT) grid = dim3(std::min(sms, tiles) / ctas * ctas);
  TmaMaps maps{};
  CUtensorMap* expert_maps = nullptr;  // stream-ordered: alive for this launch only, as in the mainline
  if constexpr (TMA) {
    const int experts = t.block_cols / t.blocks_per_expert;
    expert_maps = moe::cuda::allocate_expert_maps(experts, stream);
    if (problem.gather.row_slot == nullptr) {  // else the producer gathers x's rows with cp.async
      maps.a[0] = maps.a[1] = moe::cuda::make_matrix_map(x, static_cast<int64_t>(t.max_block_rows) * t.block_size, D, D, 64);
    }
    moe::cuda::build_expert_maps(moe::cuda::make_matrix_map(x, D, H, H, 64), problem.b, experts, expert_maps, stream);
    maps.experts = expert_maps;
  }
  // Half-row tiles and the stream-K tail off: the versions here are the steps before them; the
  // mainline takes them.
  if constexpr (ctas == 1) {
    kernel<<<grid, kWsThreads, smem, stream>>>(problem, maps, tiles_x, tiles, ws_group_rows(tiles_x, sms), false,
                                               WsStreamKScratch{});
  } else {
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(kWsThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = ctas;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, problem, maps, tiles_x, tiles,
                                  CLUSTER == WsCluster::share_a ? ws_group_rows(tiles_x / 2, sms / 2)
                                                                : std::max(1, ws_group_rows(tiles_x, sms) / 2),
                                  false, WsStreamKScratch{}));
  }
  if constexpr (TMA) moe::cuda::free_expert_maps(expert_maps, stream);
}

// The same wgmma kernel configurations on the DSD (out = hidden blocks · W2[e]), to pick the mainline's
// for both products: out [max_rows, D], W2[e] [H, D] N-major.
template <int BN, int STAGES, int MIN_BLOCKS, int IN_FLIGHT, bool STAGED>
void launch_wgmma_dsd(const DeviceTopology& t, const bf16* hidden, const bf16* const* w2, int D, bf16* out,
                      cudaStream_t stream) {
  using namespace moe::cuda::block_sparse_detail;
  using Dsd = DsdProblem<Layout::row_major_km>;
  Dsd problem = with_expert_operand(with_topology(Dsd{}, t), moe::cuda::ExpertOperand{w2, D, 0, false});
  problem.s0 = hidden;
  problem.parts = 1;
  problem.out = out;
  problem.ldo = D;
  constexpr int smem = wgmma_shared_bytes<BN, STAGES>();
  auto* kernel = &block_sparse_wgmma_kernel<BN, STAGES, MIN_BLOCKS, IN_FLIGHT, STAGED, Dsd>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(D / BN, t.max_block_rows), kWgmmaThreads, smem, stream>>>(problem);
  CUDA_CHECK(cudaGetLastError());
}

// ---- one problem: routing, topology, tensors ----
// The dropless layer of these sizes: what the plan, the topology and the whole forward read.
moe::MoeConfig dropless_config(int T, int D, int H, int E, int K, int B) {
  return moe::MoeConfig{.tokens = T, .model_dim = D, .hidden_dim = H, .num_experts = E, .top_k = K,
                        .formulation = moe::Formulation::dropless, .block_size = B};
}

struct Problem {
  int T, D, H, E, K, B;
  int64_t rows = 0, max_rows = 0;
  moe::ref::BlockSparseTopology topology;
  moe::cuda::UploadedTopology device;
  moe::ref::Matrix x, w1_cat;  // reference copies (only for the small checked problem)
  DeviceBuffer<bf16> x_device, out_device;  // x_device: x's rows in expert order (what permute_tokens writes)
  DeviceBuffer<bf16> x_tokens;              // x in token order [T, D] (version 20 gathers from it)
  DeviceBuffer<int> row_slot;               // [max_rows] the plan's slot of each row, -1 padding
  std::vector<DeviceBuffer<bf16>> w1_device;
  DeviceBuffer<const bf16*> w1_table;
  int64_t max_nnz_elements = 0;

  Problem(int T_, int D_, int H_, int E_, int K_, int B_, uint64_t seed, bool keep_reference)
      : T(T_), D(D_), H(H_), E(E_), K(K_), B(B_) {
    const moe::MoeConfig config = dropless_config(T, D, H, E, K, B);
    std::mt19937_64 generator(seed);
    moe::ref::IndexMatrix top(T, K);  // uniform routing, K distinct experts per token
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        int e = static_cast<int>(generator() % static_cast<uint64_t>(E));
        auto taken = [&](int candidate) {
          for (int i = 0; i < k; ++i)
            if (top(t, i) == candidate) return true;
          return false;
        };
        while (taken(e)) e = (e + 1) % E;
        top(t, k) = e;
      }
    const auto plan = moe::ref::plan_dispatch(config, top);
    topology = moe::ref::make_topology(config, plan);
    rows = plan.total_rows;
    max_rows = static_cast<int64_t>(T) * K + static_cast<int64_t>(E) * (B - 1);
    device = moe::cuda::upload_topology(topology, H, max_rows);
    max_nnz_elements = static_cast<int64_t>(device.topology.max_nnz) * B * B;

    // Values in [-1, 1) and [-1/sqrt(D), 1/sqrt(D)), rounded to bf16 before the reference sees them.
    auto random_bf16 = [&](int64_t r, int64_t c, double scale) {
      moe::ref::Matrix m = moe::ref::random_matrix(r, c, generator, scale);
      std::vector<bf16> values = moe::cuda::to_bf16(m.data(), static_cast<size_t>(m.size()));
      for (int64_t i = 0; i < m.size(); ++i) m.data()[i] = __bfloat162float(values[static_cast<size_t>(i)]);
      return std::make_pair(m, values);
    };
    // x in token order, and its rows in expert order as permute_tokens writes them (padding zero).
    auto [tokens_m, tokens_v] = random_bf16(T, D, 1.0);
    moe::ref::Matrix xm = moe::ref::Matrix::Zero(rows, D);
    std::vector<bf16> xv(static_cast<size_t>(max_rows * D), __float2bfloat16(NAN));  // past rows: never read
    std::vector<int> slots(static_cast<size_t>(max_rows), -1);
    for (int64_t r = 0; r < rows; ++r) {
      const int slot = plan.row_slot[static_cast<size_t>(r)];
      slots[static_cast<size_t>(r)] = slot;
      if (slot >= 0) xm.row(r) = tokens_m.row(slot / K);
      for (int c = 0; c < D; ++c) {
        xv[static_cast<size_t>(r * D + c)] = slot >= 0 ? tokens_v[static_cast<size_t>(int64_t(slot / K) * D + c)]
                                                       : __float2bfloat16(0.0f);
      }
    }
    x_device = DeviceBuffer<bf16>(xv);
    x_tokens = DeviceBuffer<bf16>(tokens_v);
    row_slot = DeviceBuffer<int>(slots);
    std::vector<const bf16*> pointers;
    if (keep_reference) {
      x = xm;
      w1_cat.resize(D, static_cast<int64_t>(E) * H);
    }
    for (int e = 0; e < E; ++e) {
      auto [wm, wv] = random_bf16(D, H, 1.0 / std::sqrt(double(D)));
      if (keep_reference) w1_cat.middleCols(static_cast<int64_t>(e) * H, H) = wm;
      w1_device.emplace_back(wv);
      pointers.push_back(w1_device.back().data());
    }
    w1_table = DeviceBuffer<const bf16*>(pointers);
    out_device = DeviceBuffer<bf16>(static_cast<size_t>(max_nnz_elements));
  }
  double useful_flops() const { return 2.0 * T * K * static_cast<double>(D) * H; }
};

// ---- the versions ----
// The tensor-core versions: the lesson's SDD problem, each with its kernel and tile configuration.
using TileLaunch = void (*)(const LessonSdd&, const DeviceTopology&, cudaStream_t);
const std::map<int, TileLaunch> kTileVersions = {
    {3, launch_tensor_core<128, 1>},
    {4, launch_tensor_core<128, 2>},
    {5, launch_tensor_core<256, 1>},
    {6, launch_wgmma<128, 6, 1, 1, false>},
    {7, launch_wgmma<256, 4, 1, 1, false>},
    {8, launch_wgmma<128, 3, 2, 1, false>},
    {9, launch_wgmma<128, 3, 2, 0, false>},
    {10, launch_wgmma<256, 4, 1, 0, false>},
    {12, launch_wgmma<128, 3, 2, 0, true>},
    {13, launch_wgmma<256, 4, 1, 0, true>},
    {14, launch_wgmma<256, 4, 1, 1, true>},
    {15, launch_wgmma_ws<4, 256, false>},
    {16, launch_wgmma_ws<4, 32, true>},
    {17, launch_wgmma_ws<3, 128, true>},
    {18, launch_wgmma_ws<4, 32, true, true>},
    {19, launch_wgmma_ws<4, 0, true, true>},
    {20, launch_wgmma_ws<4, 0, true, true>},  // on a problem whose rows are gathered (run_version)
    {21, launch_wgmma_ws<4, 0, true, true, WsCluster::share_a>},
    {22, launch_wgmma_ws<4, 0, true, true, WsCluster::share_b>},
};

void run_version(int version, Problem& p, cudaStream_t stream) {
  const DeviceTopology& t = p.device.topology;
  if (const auto tile = kTileVersions.find(version); tile != kTileVersions.end()) {
    LessonSdd problem = lesson_sdd_problem(t, p.x_device.data(), p.D, p.w1_table.data(), p.H, p.out_device.data());
    if (version == 20) {  // x in token order: the producer gathers each row from its token
      problem.a = p.x_tokens.data();
      problem.gather = {p.row_slot.data(), p.K};
    }
    tile->second(problem, t, stream);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  switch (version) {
    case 1: {
      const int64_t threads = p.max_nnz_elements;  // host bound; CTAs past *nnz exit at once
      sdd_kernel1<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
          t, p.x_device.data(), p.D, p.w1_table.data(), p.H, p.out_device.data());
      break;
    }
    case 2: {
      const int quarters = (p.B / kTile2) * (p.B / kTile2);
      sdd_kernel2<<<static_cast<unsigned>(t.max_nnz * quarters), 256, 0, stream>>>(
          t, p.x_device.data(), p.D, p.w1_table.data(), p.H, p.out_device.data());
      break;
    }
    case 11:  // the mainline library call
      moe::cuda::sdd(t, p.x_device.data(), p.D, moe::cuda::ExpertOperand{p.w1_table.data(), p.H, 0, false},
                     p.out_device.data(), stream);
      break;
    default:
      std::fprintf(stderr, "no version %d\n", version);
      std::exit(1);
  }
  CUDA_CHECK(cudaGetLastError());
}

// Median of 20 timed runs after 3 warm-ups and at least a second of them (clock_warm_up.h), in ms.
template <typename Launch>
float time_median(Launch launch, cudaStream_t stream) {
  moe::cuda::warm_up_clock(stream, 3, 1000.0, launch);
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    launch();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return (times[9] + times[10]) / 2;
}

// Row-major C[M, N] = A[M, Kd] · Bm[Kd, N] in bf16 with fp32 compute: cuBLAS is column-major, so it
// computes Cᵀ = Bmᵀ Aᵀ, which has exactly the memory layout of the row-major C.
void gemm_row_major(cublasHandle_t handle, int M, int N, int Kd, const bf16* a, const bf16* bm, bf16* c) {
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, N, M, Kd, &one, bm, CUDA_R_16BF, N, a,
                            CUDA_R_16BF, Kd, &zero, c, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

// Bad usage found after the parse (the sizes' rules): one line naming what is wrong, exit 2.
[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "dev_sdd: %s\n", message.c_str());
  std::exit(2);
}

// A whole positive integer in [low, high], or a usage error naming `what`.
int parse_int(const std::string& what, const std::string& text, int low, int high) {
  const std::optional<int64_t> value = moe::parse_integer(text);
  if (!value || *value < low || *value > high) usage_error(what + " " + text + ": allowed: " + moe::whole_number_range(low, high));
  return static_cast<int>(*value);
}

int run(int argc, char** argv);

// A CUDA or cuBLAS error (no GPU, a failed launch) ends with its message, never an abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "dev_sdd: %s\n", error.what());
    return 1;
  }
}

int run(int argc, char** argv) {
  int T = 16384, D = 1024, H = 4096, E = 64, K = 1, B = 128;
  std::vector<int> only_versions;  // empty: every version this GPU runs
  std::vector<std::string> positional;
  std::string versions_text;
  CLI::App app{"usage: dev_sdd [T D H E K B] [--versions LIST]\n"
               "  the block-sparse SDD of MegaBlocks, every kernel version checked against the CPU reference, then timed",
               "dev_sdd"};
  app.add_option("sizes", positional, "the timed problem, all six or none (default 16384 1024 4096 64 1 128)")
      ->type_name("T D H E K B");
  app.add_option("--versions", versions_text,
                 "kernel versions to check and time, comma-separated, 1-22 (default: every version this GPU runs; "
                 "6-10 and 12-22 need an sm_90 GPU and B = 128)")
      ->check(moe::whole_number_list(1, 22));
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
  if (!versions_text.empty()) {
    for (int64_t version : *moe::parse_integer_list(versions_text)) only_versions.push_back(static_cast<int>(version));
  }
  if (positional.size() == 6) {
    const char* names[] = {"T", "D", "H", "E", "K", "B"};
    int* sizes[] = {&T, &D, &H, &E, &K, &B};
    for (int j = 0; j < 6; ++j) *sizes[j] = parse_int(names[j], positional[static_cast<size_t>(j)], 1, 1 << 30);
  } else if (!positional.empty()) {
    usage_error("takes all six sizes T D H E K B or none, got " + std::to_string(positional.size()));
  }
  if (K > E) {  // each token picks K distinct experts
    usage_error("K " + std::to_string(K) + ": allowed: at most E = " + std::to_string(E));
  }
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  std::printf("device: %s, %d SMs\n", properties.name, properties.multiProcessorCount);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));

  // ---- 1. correctness, every version, on a small problem the CPU reference can afford ----
  // The wgmma versions need a compute capability 9.0 GPU (and this program's sm_90a code) and B = 128.
  const bool hopper = properties.major == 9 && properties.minor == 0 && B == 128;
  std::vector<int> versions = {1, 2, 3, 4, 5};
  if (hopper) versions.insert(versions.end(), {6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22});
  versions.push_back(11);
  if (!only_versions.empty()) versions = only_versions;  // --versions 19,21: those alone
  bool all_pass = true;
  {
    const int check_D = std::min(D, 512), check_H = std::min(H, 512), check_E = std::min(E, 8);
    for (int version : versions) {
      Problem small(1000, check_D, check_H, check_E, std::min(K, check_E), B, 1000 + version, true);
      const moe::ref::Matrix ref = moe::ref::sdd(small.x, small.w1_cat, small.topology);
      small.out_device.fill_bytes(0xFF, stream);  // NaN: an unwritten element cannot pass
      run_version(version, small, stream);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<bf16> out = small.out_device.download();
      double diff = 0, norm = 0;
      int64_t not_finite = 0;
      for (int64_t i = 0; i < ref.size(); ++i) {
        const double g = __bfloat162float(out[static_cast<size_t>(i)]);
        not_finite += !std::isfinite(g);
        diff += (g - ref.data()[i]) * (g - ref.data()[i]);
        norm += ref.data()[i] * ref.data()[i];
      }
      const double rel = std::sqrt(diff / norm);
      const bool pass = not_finite == 0 && rel < 1e-2;
      all_pass = all_pass && pass;
      std::printf("check version %d (T=1000 D=%d H=%d E=%d K=%d B=%d): %s rel_err=%.2e tol=1e-2 nan=%ld\n",
                  version, check_D, check_H, check_E, std::min(K, check_E), B, pass ? "PASS" : "FAIL", rel,
                  static_cast<long>(not_finite));
    }
  }

  // ---- 2. timing on the large problem ----
  Problem big(T, D, H, E, K, B, 7, false);
  std::printf("\nSDD T=%d D=%d H=%d E=%d K=%d B=%d: rows %ld (padding %.1f%%), nnz %ld blocks\n", T, D, H,
              E, K, B, static_cast<long>(big.rows), 100.0 * (big.rows - int64_t(T) * K) / big.rows,
              static_cast<long>(big.topology.nnz));
  std::printf("napkin: useful %.1f GFLOP; bytes >= x %.0f MB + W1 %.0f MB + out %.0f MB\n",
              big.useful_flops() / 1e9, 2.0 * big.rows * D / 1e6, 2.0 * E * D * H / 1e6,
              2.0 * big.rows * H / 1e6);

  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  CUBLAS_CHECK(cublasSetStream(handle, stream));
  // The dense product of the same useful FLOPs: [T*K, D] x [D, H] (one expert's W1 stands in).
  DeviceBuffer<bf16> dense_out(static_cast<size_t>(T) * K * H);
  const float cublas_ms = time_median(
      [&] { gemm_row_major(handle, T * K, H, D, big.x_device.data(), big.w1_device[0].data(), dense_out.data()); },
      stream);

  std::printf("\n%-34s %10s %10s %10s\n", "version", "ms", "TFLOP/s", "% cuBLAS");
  auto row = [&](const char* name, float ms) {
    std::printf("%-34s %10.3f %10.1f %9.1f%%\n", name, ms, big.useful_flops() / (ms * 1e-3) / 1e12,
                100.0 * cublas_ms / ms);
  };
  row("cuBLAS dense [T*K,D]x[D,H]", cublas_ms);
  const char* names[] = {"", "1 naive", "2 smem tiles (fp32 FMA)", "3 mma.sync Bx128, 1 CTA/SM",
                         "4 mma.sync Bx128, 2 CTA/SM", "5 mma.sync Bx256, warp 64x64",
                         "6 wgmma 128x128, 6 stages", "7 wgmma 128x256, 4 stages",
                         "8 wgmma 128x128, 3 st, 2 CTA/SM", "9 wgmma 128x128, 3 st, 2 CTA, wait 0",
                         "10 wgmma 128x256, 4 st, wait 0", "11 mainline moe::cuda::sdd",
                         "12 = 9, staged epilogue", "13 = 10, staged epilogue",
                         "14 = 7, staged epilogue", "15 warp-spec. 128x256, 4 stages",
                         "16 = 15, persistent, 4 st", "17 = 15, persistent, 3 st",
                         "18 = 16, TMA copies", "19 = 18, register epilogue",
                         "20 = 19, rows gathered from x", "21 = 19, clusters of 2 share A",
                         "22 = 19, clusters of 2 share B"};
  for (int version : versions) row(names[version], time_median([&] { run_version(version, big, stream); }, stream));

  // ---- 3. the whole dropless forward: SDD + GeLU, then DSD, against two dense GEMMs ----
  {
    const moe::MoeConfig config = dropless_config(T, D, H, E, K, B);
    DeviceBuffer<bf16> pre(static_cast<size_t>(big.max_nnz_elements)), hidden(static_cast<size_t>(big.max_nnz_elements));
    DeviceBuffer<bf16> out(static_cast<size_t>(big.max_rows) * D), dense_hidden(static_cast<size_t>(T) * K * H);
    std::vector<DeviceBuffer<bf16>> w2;
    std::vector<const bf16*> w2_pointers;
    for (int e = 0; e < E; ++e) {
      w2.emplace_back(static_cast<size_t>(H) * D);
      CUDA_CHECK(cudaMemcpyAsync(w2.back().data(), big.w1_device[e].data(), w2.back().bytes(),
                                 cudaMemcpyDeviceToDevice, stream));  // any nonzero values will do
      w2_pointers.push_back(w2.back().data());
    }
    DeviceBuffer<const bf16*> w2_table(w2_pointers);
    moe::cuda::BlockSparseFfnOutputs outputs{pre.data(), nullptr, hidden.data(), out.data()};
    const float ffn_ms = time_median(
        [&] {
          moe::cuda::block_sparse_ffn_forward(config, big.device.topology, big.x_device.data(),
                                              big.w1_table.data(), w2_table.data(), outputs, stream);
        },
        stream);
    const float dense_ms = time_median(
        [&] {
          gemm_row_major(handle, T * K, H, D, big.x_device.data(), big.w1_device[0].data(), dense_hidden.data());
          gemm_row_major(handle, T * K, D, H, dense_hidden.data(), w2[0].data(), dense_out.data());
        },
        stream);
    const float dsd_ms = time_median(
        [&] {
          moe::cuda::dsd(big.device.topology, hidden.data(), moe::cuda::ExpertOperand{w2_table.data(), D, 0, false},
                         D, out.data(), stream);
        },
        stream);
    const float dense_dsd_ms = time_median(
        [&] { gemm_row_major(handle, T * K, D, H, dense_hidden.data(), w2[0].data(), dense_out.data()); }, stream);
    if (hopper) {  // the wgmma configurations on the DSD (its check is the library tests')
      using DsdLaunch = void (*)(const DeviceTopology&, const bf16*, const bf16* const*, int, bf16*, cudaStream_t);
      const std::pair<const char*, DsdLaunch> configurations[] = {{"v9", launch_wgmma_dsd<128, 3, 2, 0, false>},
                                                                   {"v12", launch_wgmma_dsd<128, 3, 2, 0, true>},
                                                                   {"v13", launch_wgmma_dsd<256, 4, 1, 0, true>},
                                                                   {"v14", launch_wgmma_dsd<256, 4, 1, 1, true>}};
      std::string line = "\nDSD TFLOP/s useful by configuration:";
      const char* separator = " ";
      for (const auto& [name, launch] : configurations) {
        const float ms = time_median(
            [&] { launch(big.device.topology, hidden.data(), w2_table.data(), D, out.data(), stream); }, stream);
        char value[64];
        std::snprintf(value, sizeof value, "%s%s %.1f", separator, name, big.useful_flops() / (ms * 1e-3) / 1e12);
        line += value;
        separator = " | ";
      }
      std::printf("%s\n", line.c_str());
    }
    std::printf("\nDSD alone (mainline): %.3f ms, %.1f TFLOP/s useful; cuBLAS [T*K,H]x[H,D] %.3f ms; ratio %.2fx\n",
                dsd_ms, big.useful_flops() / (dsd_ms * 1e-3) / 1e12, dense_dsd_ms, dense_dsd_ms / dsd_ms);
    const double flops = 2 * big.useful_flops();
    std::printf("\ndropless FFN forward (SDD+GeLU, DSD): %.3f ms, %.1f TFLOP/s useful; cuBLAS 2 GEMMs %.3f ms, "
                "%.1f TFLOP/s; ratio %.2fx\n",
                ffn_ms, flops / (ffn_ms * 1e-3) / 1e12, dense_ms, flops / (dense_ms * 1e-3) / 1e12,
                dense_ms / ffn_ms);
  }
  CUBLAS_CHECK(cublasDestroy(handle));
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("%s\n", all_pass ? "PASS every version matches the CPU reference (tol=1e-2)" : "FAIL");
  return all_pass ? 0 : 1;
}
