// block_sparse_wgmma.cuh: the Hopper (sm_90a) tile kernel behind the block-sparse products SDD, DSD,
// DSᵀD and DDS of MegaBlocks (Gale et al., MLSys 2023) at B = 128: warpgroup MMA (wgmma) instead of
// mma.sync.
// Included by block_sparse.cu (the mainline, on compute capability 9.0) and cuda/dev/sdd.cu (the
// lesson, versions 6-14). Build: cmake --build build --target moe_cuda
//
// Why a second kernel: on an H100/H200, mma.sync reaches about a third of the tensor cores' rate
// (cuda/dev/sdd.cu measured 235-296 TFLOP/s against cuBLAS's 690-760). Hopper's full rate comes only
// from wgmma.mma_async, which differs from mma.sync in three ways that shape this file:
//   - it is issued by a warpgroup (4 consecutive warps, 128 threads) for a 64 x N x 16 product, with
//     N up to 256: one instruction does the work of 64 mma.sync, so issue slots stop being the limit;
//   - it reads A and B straight from shared memory through 64-bit "matrix descriptors" (start
//     address, two strides, a swizzle mode): no ldmatrix, no operand registers;
//   - it is asynchronous: it returns at once, the tensor cores work while the warps go on (here: to
//     issue the next cp.async copies), and wgmma.commit_group / wait_group say when it is done.
//
// One CTA computes one 128 x BN tile (BN = 128 or 256) of C = A B, fp32 accumulation:
//   - 2 warpgroups, each the owner of 64 rows and all BN columns (m64nBNk16). The mainline's SDD runs
//     128 x 128 tiles, 3 stages, 2 CTAs per SM (64 accumulators per thread, registers capped at
//     128): while one CTA fills its pipeline or stores its tile, the other's wgmma run. Its DSD,
//     whose K is 4-8x longer, runs 128 x 256 tiles (half the A traffic per FLOP), 4 stages, 1 CTA
//     per SM (cuda/dev/sdd.cu, versions 12-14);
//   - the epilogue goes through shared memory (STAGED): 16-byte coalesced stores, the activation
//     compiled once in a loop;
//   - 128 rows = one block row of B = 128, so SDD's and DSD's tiles never straddle two experts
//     (DSᵀD's 128 rows are one block of an expert's H; DDS's tiles are 128 rows of D by one block
//     column, the grid's x running over M);
//   - the weight gradients (DSᵀD, DDS) take the SDD's configuration: 128 x 128, 3 stages, 2 CTAs
//     per SM (chosen by analogy with the SDD, not measured on their own; K = an expert's rows: 32
//     k-steps at T = 16384, K = 2, E = 16);
//   - every thread copies chunks with cp.async (16 bytes) STAGES deep, as the mma.sync kernel does,
//     so each k-step's operands may come from any address: the per-expert pointer table and the
//     sparse blocks of DSD need no tensor map (TMA wants one descriptor per tensor);
//   - the copies write the 128-byte swizzle layout that the descriptors name: rows of 128 bytes,
//     16-byte chunk c of row r stored at chunk c ^ (r % 8), in atoms of 8 rows (1024 bytes, aligned
//     to 1024). Eight consecutive rows of one chunk column then sit in 8 different bank groups, so
//     neither the copies nor the tensor cores' reads conflict.
// The problems are block_sparse.cuh's (SddProblem, DsdProblem, DsdTransposedProblem, DdsProblem):
// the same begin / k_steps / a_chunk / b_chunk / store, so a k-step is addressed exactly as in the
// mma.sync kernel. A is stored [m][k] (K-major: x_perm, the sparse blocks of SDD and DSD) or [k][m]
// (M-major, read with wgmma's transpose-A flag: a sparse block read as Sᵀ in DSᵀD, x_perm read as
// x_permᵀ in DDS); B either [k][n] (N-major: W1[e], W2[e] of the forward, d_out in DSᵀD, the sparse
// blocks in DDS; transpose-B flag) or [n][k] (K-major: Wᵀ in the backward). One kernel, the layouts
// compile-time switches: the MN-major copies and descriptors are the same code for A and for B.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, B block size.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moe/block_sparse.cuh"  // Layout, kBlockK, cp_async_*, the problems

namespace moe::cuda::block_sparse_detail {

constexpr int kWgmmaThreads = 256;  // 2 warpgroups: 2 x 64 rows
constexpr int kWgmmaBlockM = 128;   // = B: one block row per tile

// The bytes of one pipeline stage: A [128][64] and B [64][BN] (or [BN][64]) bf16.
template <int BN>
constexpr int wgmma_stage_bytes() {
  return (kWgmmaBlockM + BN) * kBlockK * static_cast<int>(sizeof(bf16));
}
// + 1024: the dynamic shared memory is only 16-byte aligned; the kernel rounds its base up to the
// 1024-byte alignment of a swizzle atom.
template <int BN, int STAGES>
constexpr int wgmma_shared_bytes() {
  return STAGES * wgmma_stage_bytes<BN>() + 1024;
}

// The staged epilogue's fp32 tile: 128 rows of BN + kStagingPad floats, inside the stages' memory.
constexpr int kStagingPad = 8;
template <int BN>
constexpr int wgmma_staging_bytes() {
  return kWgmmaBlockM * (BN + kStagingPad) * static_cast<int>(sizeof(float));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ---- the matrix descriptor (PTX ISA, "Matrix Descriptor Format" of wgmma) ----
// bits 0-13 start address >> 4; 16-29 leading-dimension byte offset >> 4; 32-45 stride-dimension
// byte offset >> 4; 49-51 base offset (0: atoms 1024-aligned); 62-63 swizzle (1 = 128 bytes).
// With the 128-byte swizzle:
//   K-major (A, and B stored [n][k]): a row of 64 k = 128 bytes; the stride byte offset is the step
//     between 8-row groups (1024); the leading one is unused (the 16 k of one instruction lie in one
//     row). The k-th slice of 16 starts 32 k bytes further: the hardware applies the swizzle to the
//     address it forms, which is why the atoms must be 1024-aligned.
//   MN-major (A stored [k][m], B stored [k][n]; read with the transpose flag): a row of 64 m (n) =
//     128 bytes for each k; the stride byte offset is the step between groups of 8 k rows (1024),
//     the leading one the step between groups of 64 m (n). In CUTLASS's words (make_gmma_desc,
//     Major::MN, 128B swizzle, in 16-byte units): ((8,n),(8,k)) : ((1,LBO),(8,SBO)). A warpgroup's
//     64 rows of A are exactly one such group, so A's leading byte offset is never used; B's is,
//     for BN = 128 or 256 (2 or 4 groups).
__device__ inline uint64_t matrix_descriptor(uint32_t shared_address, uint32_t leading_bytes,
                                             uint32_t stride_bytes) {
  return static_cast<uint64_t>((shared_address & 0x3FFFF) >> 4) |
         static_cast<uint64_t>(leading_bytes >> 4) << 16 | static_cast<uint64_t>(stride_bytes >> 4) << 32 |
         1ull << 62;
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}
// cp.async writes shared memory through the generic proxy; wgmma reads it through the async proxy.
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving a read of an accumulator above the wgmma.wait_group that makes it valid.
__device__ inline void register_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x N] += A[64 x 16] B[16 x N], A and B from shared memory through their descriptors, D in
// registers (N/2 fp32 per thread). The immediates after scale-d are imm-scale-a, imm-scale-b (1: no
// negation), imm-trans-a, imm-trans-b: TRANSPOSE_A = 1 reads A M-major, TRANSPOSE_B = 1 reads B
// N-major (PTX ISA, "Shared Memory Matrix Layout": allowed for .f16 / .bf16 only). scale-d = 1
// (accumulate): the accumulators start at zero.
// The accumulators are asm operands one by one (inline asm takes no arrays): the 64 of N = 128 are
// the first half of N = 256's 128, so both lists are made of the same runs of 8 and 64.
#define MOE_WGMMA_ACC8(i)                                                                                  \
  "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define MOE_WGMMA_ACC64(i)                                                                             \
  MOE_WGMMA_ACC8(i), MOE_WGMMA_ACC8((i) + 8), MOE_WGMMA_ACC8((i) + 16), MOE_WGMMA_ACC8((i) + 24),       \
      MOE_WGMMA_ACC8((i) + 32), MOE_WGMMA_ACC8((i) + 40), MOE_WGMMA_ACC8((i) + 48), MOE_WGMMA_ACC8((i) + 56)
// The asm's names of the first 64 accumulators, %0 to %63.
#define MOE_WGMMA_REGISTERS_0_63                                       \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"              \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"   \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"   \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"

template <int TRANSPOSE_A, int TRANSPOSE_B>
__device__ inline void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MOE_WGMMA_REGISTERS_0_63
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : MOE_WGMMA_ACC64(0)
      : "l"(a), "l"(b), "r"(1), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));
}

template <int TRANSPOSE_A, int TRANSPOSE_B>
__device__ inline void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" MOE_WGMMA_REGISTERS_0_63 ","
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : MOE_WGMMA_ACC64(0), MOE_WGMMA_ACC64(64)
      : "l"(a), "l"(b), "r"(1), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));
}
#undef MOE_WGMMA_ACC8
#undef MOE_WGMMA_ACC64
#undef MOE_WGMMA_REGISTERS_0_63

// One k-step's wgmma group on a 64-row slice of A by N columns of B (N = 128 or 256): a fence, the
// kBlockK / 16 MMAs, the commit. a and b are the operands' shared addresses; A_M_MAJOR and
// B_N_MAJOR say how the tiles there are stored, which is how the descriptors read them.
template <int N, bool A_M_MAJOR, bool B_N_MAJOR>
__device__ __forceinline__ void wgmma_k_step(float (&acc)[N / 2], uint32_t a, uint32_t b) {
  static_assert(N == 128 || N == 256, "m64n128k16 or m64n256k16");
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockK / 16; ++kk) {
    // The kk-th 16 of K: 32 bytes along a K-major row, or 16 rows of 128 bytes down an MN-major tile.
    const uint64_t a_descriptor = A_M_MAJOR ? matrix_descriptor(a + kk * 16 * 128, kBlockK * 128, 1024)
                                            : matrix_descriptor(a + kk * 32, 16, 1024);
    const uint64_t b_descriptor = B_N_MAJOR ? matrix_descriptor(b + kk * 16 * 128, kBlockK * 128, 1024)
                                            : matrix_descriptor(b + kk * 32, 16, 1024);
    if constexpr (N == 256)
      wgmma_m64n256k16<A_M_MAJOR ? 1 : 0, B_N_MAJOR ? 1 : 0>(acc, a_descriptor, b_descriptor);
    else
      wgmma_m64n128k16<A_M_MAJOR ? 1 : 0, B_N_MAJOR ? 1 : 0>(acc, a_descriptor, b_descriptor);
  }
  wgmma_commit();
}

// ---- copies into the swizzled layout ----
// K-major tile [ROWS][64] bf16: chunk c of row r at byte r * 128 + (c ^ (r % 8)) * 16.
template <int ROWS>
__device__ inline void load_k_major(uint32_t tile, const bf16* source, int64_t ld) {
  constexpr int chunks = ROWS * 8;
  static_assert(chunks % kWgmmaThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < chunks / kWgmmaThreads; ++i) {
    const int chunk = static_cast<int>(threadIdx.x) + i * kWgmmaThreads;
    const int row = chunk / 8, c = chunk % 8;  // 8 consecutive threads read one 128-byte row
    const uint32_t to = tile + row * 128 + ((c ^ (row & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(source + row * ld + c * 8));
  }
}
// MN-major tile: global [64 k][N] row-major (N = m of A or n of B), stored as N/64 column groups
// of [64 k][64], each a K-major-like [64][64] swizzled tile of 8 KB (the leading byte offset
// between groups is 8192).
template <int N>
__device__ inline void load_mn_major(uint32_t tile, const bf16* source, int64_t ld) {
  constexpr int chunks_per_row = N / 8, chunks = kBlockK * chunks_per_row;
  static_assert(chunks % kWgmmaThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < chunks / kWgmmaThreads; ++i) {
    const int chunk = static_cast<int>(threadIdx.x) + i * kWgmmaThreads;
    const int k = chunk / chunks_per_row, column_chunk = chunk % chunks_per_row;  // coalesced along n
    const int group = column_chunk / 8, c = column_chunk % 8;
    const uint32_t to = tile + group * (kBlockK * 128) + k * 128 + ((c ^ (k & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to),
                 "l"(source + k * ld + column_chunk * 8));
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---- the tile kernel ----
// The pipeline, per k-step (64 of K), with IN_FLIGHT (0 or 1) wgmma groups left running:
//   wait for this thread's copies of step; fence them to the async proxy; barrier (now every copy of
//   step has landed, and every warpgroup has retired its wgmma of step - 1 - IN_FLIGHT);
//   issue 4 wgmma (k = 16 each) on step's stage and commit them; copy step + AHEAD into the stage
//   of step - 1 - IN_FLIGHT; wait until at most IN_FLIGHT wgmma groups are pending.
// The copies run AHEAD = STAGES - 1 - IN_FLIGHT steps ahead: a wgmma left in flight keeps the tensor
// cores fed across the barrier but holds a stage that could be loading.
// MIN_BLOCKS: CTAs per SM the registers must make room for (2 caps them at 128: BN = 128 only).
// IN_FLIGHT 0 measured faster at 3 stages (the copies run 2 steps ahead rather than 1).
// STAGED: the epilogue goes through shared memory (below); false: each thread stores its own
// accumulator fragments, 4 bytes at a time (versions 6-10 of cuda/dev/sdd.cu).
// k_steps = 0 (DSᵀD and DDS on an expert with no rows) skips the loop: the tile is stored as zeros.
template <int BN, int STAGES, int MIN_BLOCKS, int IN_FLIGHT, bool STAGED, class Problem>
__global__ void __launch_bounds__(kWgmmaThreads, MIN_BLOCKS) block_sparse_wgmma_kernel(const Problem parameters) {
  static_assert(BN == 128 || BN == 256, "wgmma m64nNk16 with N = 128 or 256");
  static_assert(!STAGED || wgmma_staging_bytes<BN>() <= STAGES * wgmma_stage_bytes<BN>(),
                "the staged tile must fit in the pipeline's stages");
  static_assert(IN_FLIGHT == 0 || IN_FLIGHT == 1, "wgmma groups left running across the barrier");
  static_assert(STAGES - 1 - IN_FLIGHT >= 1, "at least one stage loading while one computes");
  static_assert(Problem::a_layout != Layout::row_major_nk, "A is stored [m][k] or [k][m]");
  static_assert(kBlockK == 64, "a k-step is one 128-byte swizzle row of K (K-major) or 64 rows (MN-major)");
  static_assert(!Problem::grid_x_over_m || BN == kWgmmaBlockM,
                "DDS (x over M): a tile's columns are one block column, B = 128");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool a_m_major = Problem::a_layout == Layout::row_major_km;  // stored [k][m]
  constexpr bool b_n_major = Problem::b_layout == Layout::row_major_km;  // stored [k][n]
  constexpr int kAccumulators = BN / 2;                                  // 64 x BN over 128 threads
  constexpr int kAhead = STAGES - 1 - IN_FLIGHT;                         // prefetch distance

  // The grid's y walks block rows (or block columns); x walks tiles over the dense dimension,
  // which is N, except for DDS where it is M.
  Problem problem = parameters;  // a register copy: begin() fills in the per-CTA fields
  if (!problem.begin(blockIdx.y, blockIdx.x, Problem::grid_x_over_m ? kWgmmaBlockM : BN)) return;
  const int k_steps = problem.k_steps();

  extern __shared__ unsigned char shared_bytes[];
  const uint32_t shared_base =
      (static_cast<uint32_t>(__cvta_generic_to_shared(shared_bytes)) + 1023u) & ~1023u;
  constexpr uint32_t a_bytes = kWgmmaBlockM * kBlockK * sizeof(bf16);  // 16 KB
  auto stage_a = [&](int step) { return shared_base + (step % STAGES) * wgmma_stage_bytes<BN>(); };
  auto stage_b = [&](int step) { return stage_a(step) + a_bytes; };

  auto load_stage = [&](int step) {
    int64_t ld;
    const bf16* a = problem.a_chunk(step, ld);
    if constexpr (a_m_major)
      load_mn_major<kWgmmaBlockM>(stage_a(step), a, ld);
    else
      load_k_major<kWgmmaBlockM>(stage_a(step), a, ld);
    const bf16* b = problem.b_chunk(step, ld);
    if constexpr (b_n_major)
      load_mn_major<BN>(stage_b(step), b, ld);
    else
      load_k_major<BN>(stage_b(step), b, ld);
  };

  float acc[kAccumulators];
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < k_steps) load_stage(s);
    cp_async_commit();  // an empty group keeps the wait_group count uniform
  }

  const int warpgroup = threadIdx.x / 128;
  for (int step = 0; step < k_steps; ++step) {
    cp_async_wait<kAhead - 1>();  // this thread's copies of `step` have landed
    fence_proxy_async();          // ... and are visible to the tensor cores
    __syncthreads();              // everyone's; and every wgmma of step - 1 - IN_FLIGHT has retired

    // This warpgroup's 64 rows of A: 64 rows of 128 bytes (K-major), or one [64 k][64 m] column
    // group (M-major: kBlockK = 64 rows of 128 bytes): 8 KB further either way.
    const uint32_t a = stage_a(step) + warpgroup * 64 * 128;
    const uint32_t b = stage_b(step);
    // Its fence orders this group after the accumulators' last writes (wgmma, or the zero fill above).
    wgmma_k_step<BN, a_m_major, b_n_major>(acc, a, b);

    if (step + kAhead < k_steps) load_stage(step + kAhead);  // into the stage of step - 1 - IN_FLIGHT
    cp_async_commit();
    wgmma_wait<IN_FLIGHT>();  // the wgmma of step - IN_FLIGHT has retired: its stage may be refilled
  }
  wgmma_wait<0>();
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) register_fence(acc[i]);

  // Epilogue. Accumulator layout of m64nNk16 (PTX ISA): warp w of the warpgroup owns rows 16w..16w+15;
  // acc[4j + v] is row 16w + lane/4 (+8 for v >= 2), column 8j + 2 (lane % 4) (+1 for odd v): the
  // mma.m16n8 layout, repeated N/8 times along n.
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int m = warpgroup * 64 + warp * 16 + lane / 4;
  if constexpr (!STAGED) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int n = 8 * j + 2 * (lane % 4);
      problem.store(m, n, acc[4 * j], acc[4 * j + 1]);
      problem.store(m + 8, n, acc[4 * j + 2], acc[4 * j + 3]);
    }
  } else {
    // Staged: the fp32 tile goes to shared memory (the stages are free now), then every thread takes
    // 16-byte chunks of 8 columns, consecutive threads consecutive chunks of one row: each warp
    // writes 512 contiguous bytes, and the activation code exists once, in a loop, instead of
    // unrolled into 64-128 fragment stores. Rows are padded by 8 floats (32 bytes), so the 4 rows a
    // half-warp writes at once start in 4 different groups of 8 banks.
    constexpr int row_floats = BN + kStagingPad;
    __syncthreads();  // every warpgroup's wgmma and every copy are done with the stages
    float* staging = reinterpret_cast<float*>(shared_bytes + (shared_base - static_cast<uint32_t>(
                                                                  __cvta_generic_to_shared(shared_bytes))));
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int n = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<float2*>(staging + m * row_floats + n) = make_float2(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<float2*>(staging + (m + 8) * row_floats + n) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
    __syncthreads();
    // Chunk order: 128-column slab (one B x B block of SDD), then row, then the 16 chunks of the row,
    // so that a warp's two rows of one slab are 512 contiguous bytes of an SDD block.
    constexpr int chunks = kWgmmaBlockM * BN / 8;
#pragma unroll 2
    for (int chunk = threadIdx.x; chunk < chunks; chunk += kWgmmaThreads) {
      const int slab = chunk / (kWgmmaBlockM * 16), within = chunk % (kWgmmaBlockM * 16);
      const int row = within / 16, n = slab * 128 + (within % 16) * 8;
      const float4 lo = *reinterpret_cast<const float4*>(staging + row * row_floats + n);
      const float4 hi = *reinterpret_cast<const float4*>(staging + row * row_floats + n + 4);
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      problem.store_chunk(row, n, v);
    }
  }
#else
  __trap();  // built without sm_90a: the host must never pick this kernel (wgmma_available() is false)
#endif
}

}  // namespace moe::cuda::block_sparse_detail
