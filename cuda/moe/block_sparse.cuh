// block_sparse.cuh: the tensor-core tile machinery behind every block-sparse product (SDD, DSD,
// DSᵀD, DDS) of MegaBlocks (Gale et al., MLSys 2023), and the four "problems" that tell it where
// its operands live. Included by block_sparse.cu (the mainline) and cuda/dev/sdd.cu (the lesson,
// as its version 3). Build: cmake --build build --target moe_cuda
//
// One CTA computes one BM x BN tile of C = A B (fp32 accumulation, bf16 operands):
//   - 8 warps in a 2 x 4 grid, each owns a (BM/2) x (BN/4) sub-tile of mma.sync.m16n8k16 results;
//   - the K loop walks "k-steps" of BK = 64; a problem maps each k-step to the global address of
//     its A and B chunks, so a k-step may come from a dense matrix, from one B x B block of a
//     sparse matrix (DSD walks a block row), or from a block found through the transpose indices
//     (DSᵀD and DDS walk a block column, MegaBlocks 5.1.4);
//   - chunks land in shared memory with cp.async (16 bytes per thread, STAGES deep) in the layout
//     they have in global memory: row-major [rows][cols], cols = 64, 128 or 256 bf16. Each 16-byte
//     chunk of a row is XOR-swizzled with (row % 8), so the 8 row addresses of one ldmatrix phase
//     hit 8 different bank groups (no conflicts), whichever dimension is contiguous;
//   - ldmatrix feeds the mma fragments; when an operand is stored with the "wrong" contiguous
//     dimension (A as [k][m], B as [k][n]) ldmatrix.trans transposes it on the way into registers.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, B block size.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/mma_sync.cuh"         // cp_async_*, ldmatrix_x4(_trans), mma_bf16_16816
#include "moe/activation_math.cuh"  // gelu, silu and their derivatives (the epilogues)

namespace moe::cuda::block_sparse_detail {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;  // 8 warps: enough mma issue to hide ldmatrix and cp.async latency
constexpr int kWarpsM = 2;
constexpr int kWarpsN = 4;
constexpr int kBlockK = 64;    // k-step: a multiple of 16 (mma k) that divides B = 64 and 128
constexpr int kStages = 3;     // cp.async pipeline depth: 3 x 32 KB for a 128 x 128 tile

// How an operand's chunk is stored, in global and in shared memory alike.
enum class Layout {
  row_major_mk,  // A: [m][k], k contiguous        B: not used
  row_major_km,  // A: [k][m], m contiguous (Aᵀ)   B: [k][n], n contiguous
  row_major_nk,  // B: [n][k], k contiguous (Bᵀ)
};

// ---- shared-memory tile: [ROWS][COLS] bf16 with 16-byte chunks swizzled by row % 8 ----
template <int ROWS, int COLS>
struct SmemTile {
  static_assert(COLS % 64 == 0, "rows of a multiple of 8 chunks: the swizzle permutes 8");
  static constexpr int kElements = ROWS * COLS;
  __device__ static int offset(int row, int col) {  // col a multiple of 8 for chunk accesses
    return row * COLS + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
  }
  // Every thread copies its share of 16-byte chunks of the ROWS x COLS chunk at `source`
  // (row stride `ld` elements) into `tile`.
  __device__ static void load(bf16* tile, const bf16* source, int64_t ld) {
    constexpr int chunks_per_row = COLS / 8;
    constexpr int chunks = ROWS * chunks_per_row;
    static_assert(chunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < chunks / kThreads; ++i) {
      const int chunk = static_cast<int>(threadIdx.x) + i * kThreads;
      const int row = chunk / chunks_per_row, col = (chunk % chunks_per_row) * 8;
      const bf16* from = source + row * ld + col;
      const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(tile + offset(row, col)));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(from));
    }
  }
};

// cp.async, ldmatrix and mma.m16n8k16: core/mma_sync.cuh, shared with the router and fused attention.
using tensor_core::cp_async_commit;
using tensor_core::cp_async_wait;
using tensor_core::ldmatrix_x4;
using tensor_core::ldmatrix_x4_trans;
using tensor_core::mma_bf16_16816;

// ---- the tile kernel ----
// Problem supplies (all __device__):
//   static constexpr Layout a_layout, b_layout;
//   static constexpr bool grid_x_over_m;        x tiles run over M (DDS) rather than N
//   static constexpr bool wgmma_wide_tile;      Hopper, where the warp-specialized kernel does not
//                                               apply (block_sparse.cu, launch): 128 x 256 tiles of
//                                               block_sparse_wgmma.cuh rather than 128 x 128
//   bool begin(int y, int tile_x, int tile_x_size)  false: nothing to do (e.g. past *block_rows)
//   int k_steps() const
//   const bf16* a_chunk(int step, int64_t& ld)  origin of A's BM x BK (or BK x BM) chunk
//   const bf16* b_chunk(int step, int64_t& ld)  origin of B's BK x BN (or BN x BK) chunk
//   void store(int m, int n, float v0, float v1) C[m][n], C[m][n+1] of the tile (n even)
//   void store_chunk(int m, int n, const float (&v)[8])  C[m][n .. n+7] (n a multiple of 8): the
//   wgmma kernel's staged epilogue; one 16-byte store of bf16, two of fp32
//   optional: OUT* out_at(int m, int n), using Out = OUT, int ldo: the output is a plain matrix
//                                               (the weight gradients): the warp-specialized kernel
//                                               copies it out with the bulk-copy engine
//   optional: int64_t b_second_half()           the warp-specialized kernel's 256-wide B chunk (B
//                                               stored [k][n]) is two 128-column halves this many
//                                               elements apart (DDS: two B x B blocks); default 128
// MIN_BLOCKS: CTAs per SM the compiler must make room for (2 caps registers at 128 per thread).
template <int BM, int BN, int MIN_BLOCKS, class Problem>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) block_sparse_mma_kernel(const Problem parameters) {
  constexpr int WM = BM / kWarpsM, WN = BN / kWarpsN;  // warp sub-tile
  constexpr int MT = WM / 16, NT = WN / 8;             // mma tiles per warp
  static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
  constexpr bool a_transposed = Problem::a_layout == Layout::row_major_km;
  constexpr bool b_transposed = Problem::b_layout == Layout::row_major_km;  // [k][n]
  using TileA = SmemTile<a_transposed ? kBlockK : BM, a_transposed ? BM : kBlockK>;
  using TileB = SmemTile<b_transposed ? kBlockK : BN, b_transposed ? BN : kBlockK>;

  // The grid's y walks block rows (or block columns); x walks tiles over the dense dimension,
  // which is N, except for DDS where it is M.
  Problem problem = parameters;  // a register copy: begin() fills in the per-CTA fields
  if (!problem.begin(blockIdx.y, blockIdx.x, Problem::grid_x_over_m ? BM : BN)) return;
  const int k_steps = problem.k_steps();  // uniform per CTA, so no barrier below is skipped

  extern __shared__ __align__(128) unsigned char shared_bytes[];
  bf16* smem_a = reinterpret_cast<bf16*>(shared_bytes);
  bf16* smem_b = smem_a + kStages * TileA::kElements;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;

  auto load_stage = [&](int step) {
    int64_t ld;
    const bf16* a = problem.a_chunk(step, ld);
    TileA::load(smem_a + (step % kStages) * TileA::kElements, a, ld);
    const bf16* b = problem.b_chunk(step, ld);
    TileB::load(smem_b + (step % kStages) * TileB::kElements, b, ld);
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

  // Prologue: STAGES-1 chunks in flight before the first mma.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_steps) load_stage(s);
    cp_async_commit();  // an empty group keeps the wait_group count uniform
  }

  // ldmatrix lane roles (see the fragment layouts of mma.m16n8k16 in the PTX ISA):
  //   x4 matrix q = lane / 8 supplies rows lane % 8 of 8x8 matrix q.
  const int q = lane / 8, r8 = lane % 8;

  for (int step = 0; step < k_steps; ++step) {
    cp_async_wait<kStages - 2>();  // this thread's copies of chunk `step` have landed
    __syncthreads();               // everyone's have, and everyone is done with chunk step-1
    if (step + kStages - 1 < k_steps) load_stage(step + kStages - 1);
    cp_async_commit();

    const bf16* tile_a = smem_a + (step % kStages) * TileA::kElements;
    const bf16* tile_b = smem_b + (step % kStages) * TileB::kElements;
#pragma unroll
    for (int kk = 0; kk < kBlockK; kk += 16) {
      uint32_t a_frag[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int m0 = warp_m * WM + i * 16;
        if constexpr (!a_transposed) {  // matrices: (m 0-7,k 0-7) (m 8-15,k 0-7) (m 0-7,k 8-15) (m 8-15,k 8-15)
          ldmatrix_x4(a_frag[i], tile_a + TileA::offset(m0 + r8 + 8 * (q % 2), kk + 8 * (q / 2)));
        } else {  // stored [k][m]: the same four matrices, read as rows of k and transposed
          ldmatrix_x4_trans(a_frag[i], tile_a + TileA::offset(kk + 8 * (q / 2) + r8, m0 + 8 * (q % 2)));
        }
      }
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        const int n0 = warp_n * WN + j * 8;
        uint32_t b_frag[4];  // [0],[1]: n-tile j (k 0-7, 8-15); [2],[3]: n-tile j+1
        if constexpr (!b_transposed) {  // stored [n][k]: matrices (n 0-7,k 0-7) (n 0-7,k 8-15) (n 8-15,..)
          ldmatrix_x4(b_frag, tile_b + TileB::offset(n0 + 8 * (q / 2) + r8, kk + 8 * (q % 2)));
        } else {  // stored [k][n]
          ldmatrix_x4_trans(b_frag, tile_b + TileB::offset(kk + 8 * (q % 2) + r8, n0 + 8 * (q / 2)));
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma_bf16_16816(acc[i][j], a_frag[i], b_frag[0], b_frag[1]);
          mma_bf16_16816(acc[i][j + 1], a_frag[i], b_frag[2], b_frag[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

  // Epilogue: accumulator v of mma tile (i, j) is C[g (+8 for v >= 2)][2t (+1)], g = lane/4, t = lane%4.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int m = warp_m * WM + i * 16 + g, n = warp_n * WN + j * 8 + 2 * t;
      problem.store(m, n, acc[i][j][0], acc[i][j][1]);
      problem.store(m + 8, n, acc[i][j][2], acc[i][j][3]);
    }
}

template <int BM, int BN>
constexpr int pipeline_shared_bytes() {
  return kStages * (BM * kBlockK + kBlockK * BN) * static_cast<int>(sizeof(bf16));
}

// ---- the problems ----
// Epilogues of the SDD: what to do with the B x B block values once they are computed.
enum class SddEpilogue {
  store,            // out0 = acc                                            (any plain SDD)
  gelu,             // out0 = acc (pre-activation), out1 = gelu(acc)        (forward, GeLU)
  swiglu,           // out0 = acc (up), out1 = silu(in0) * acc, in0 = gate   (forward, SwiGLU)
  gelu_backward,    // out0 = acc * gelu'(in0), in0 = pre-activation          (backward, GeLU)
  swiglu_backward,  // out0 = acc * in1 * silu'(in0) (d gate), out1 = acc * silu(in0) (d up),
                    // in0 = gate, in1 = up                                   (backward, SwiGLU)
};

__device__ inline __nv_bfloat162 pack(float v0, float v1) { return __floats2bfloat162_rn(v0, v1); }
__device__ inline float2 unpack(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// 16-byte (8 x bf16) chunks: the staged epilogue of the wgmma kernel reads and writes 8 columns at once.
__device__ inline uint4 pack8(const float (&v)[8]) {
  uint4 r;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = pack(v[2 * i], v[2 * i + 1]);
  return r;
}
__device__ inline void unpack8(const uint4& r, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// 8 fp32 values to out[0 .. 7] (the weight gradients' staged epilogue): two 16-byte stores where out
// is 16-byte aligned, else four 8-byte ones (the products promise only what the mma.sync kernel's
// float2 stores need: even ldo and column_offset, 8-byte aligned expert pointers).
__device__ inline void store8(float* out, const float (&v)[8]) {
  if ((reinterpret_cast<uintptr_t>(out) & 15) == 0) {
    reinterpret_cast<float4*>(out)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(out)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<float2*>(out)[i] = make_float2(v[2 * i], v[2 * i + 1]);
  }
}

// The expert operand of the products that walk block rows (SDD, DSD): B = W_e of the block row's
// expert, stored [K, ldb] (row_major_km) or [N, ldb] and read transposed (row_major_nk), its columns
// from column_offset on. A CTA's tile reads from column n on, 64 rows of K a k-step.
template <Layout B_LAYOUT>
struct ExpertOperandWalk {
  const bf16* const* b;  // [E]
  int ldb;
  int column_offset;
  const bf16* b_tile;  // per CTA

  __device__ void begin_b(int e, int n) {
    if constexpr (B_LAYOUT == Layout::row_major_km)
      b_tile = b[e] + column_offset + n;
    else
      b_tile = b[e] + static_cast<int64_t>(column_offset + n) * ldb;
  }
  __device__ const bf16* b_chunk(int step, int64_t& ld) const {
    ld = ldb;
    if constexpr (B_LAYOUT == Layout::row_major_km)
      return b_tile + static_cast<int64_t>(step) * kBlockK * ldb;
    else
      return b_tile + step * kBlockK;
  }
};

// SDD: blocks(r, j) = A[rB : rB+B, :] · W_e[:, column_offset + jB : ...], e = block_row_expert[r].
// Tile (block row r, tile_n): BM = B rows, BN columns = BN/B consecutive blocks of that row.
// B_LAYOUT row_major_km: W_e stored [Kd, ld] (forward W1); row_major_nk: stored [N, ld] and read
// transposed (backward: d_hidden = d_out · W2_eᵀ).
// EPILOGUE is a template parameter, not a field: each kernel carries the code of its own epilogue
// only, with no run-time switch in every one of its 64-128 unrolled stores.
// Gathered rows (the SDD's A operand in the forward: the experts' input): `a` is either stored in
// expert order ([max_rows, inner], the permuted x) or, with row_slot set, is x itself in token order
// ([T, inner]): expert-order row r is then token row_slot[r] / top_k, and a zero row where
// row_slot[r] < 0 (padding). Only the warp-specialized kernel's producer gathers (WsGatheredRows,
// block_sparse_wgmma_ws.cuh); the host sends gathered problems nowhere else (block_sparse.cu,
// rows_gatherable).
struct RowGather {
  const int* row_slot = nullptr;  // [max_rows] (DevicePlan::row_slot), or nullptr: stored in expert order
  int top_k = 1;                  // K: slot t*K + k belongs to token t
};

template <Layout B_LAYOUT, SddEpilogue EPILOGUE>
struct SddProblem : ExpertOperandWalk<B_LAYOUT> {
  static constexpr bool grid_x_over_m = false;
  static constexpr bool wgmma_wide_tile = false;  // Hopper: 128 x 128 tiles (block_sparse.cu, launch)
  static constexpr Layout a_layout = Layout::row_major_mk;
  static constexpr Layout b_layout = B_LAYOUT;
  // inputs
  const int* block_rows;
  const int* offsets;
  const int* block_row_expert;
  const int* block_row_tokens;  // [max_block_rows] routed rows of each block row (half_row)
  const bf16* a;  // [max_rows, inner], or [T, inner] in token order when gather.row_slot is set
  int inner;      // Kd
  RowGather gather;
  int block_size;
  const bf16* in0;  // [max_nnz, B, B] epilogue inputs
  const bf16* in1;
  bf16* out0;  // [max_nnz, B, B]
  bf16* out1;
  // per-CTA state
  const bf16* a_tile;
  int64_t first_block;  // block id of the tile's first block
  int tile_n_start;     // first column of the tile inside the expert's H
  int row, expert;      // the block row and its expert

  __device__ bool begin(int r, int tile_n, int bn) {
    if (r >= *block_rows) return false;
    const int e = block_row_expert[r];
    row = r;
    expert = e;
    tile_n_start = tile_n * bn;
    first_block = offsets[r] + tile_n_start / block_size;
    a_tile = a + static_cast<int64_t>(r) * block_size * inner;
    this->begin_b(e, tile_n_start);
    return true;
  }
  __device__ int k_steps() const { return inner / kBlockK; }
  // Whether block row r holds routed rows, all of them in its first half (1 .. B/2 of them: an
  // expert's last block row, the rest padding). The warp-specialized kernel computes such a row as
  // a half-row tile (block_sparse_wgmma_ws.cuh). Past *block_rows block_row_tokens is 0: false.
  __device__ bool half_row(int r) const {
    const int routed = block_row_tokens[r];
    return routed > 0 && 2 * routed <= block_size;
  }
  __device__ const bf16* a_chunk(int step, int64_t& ld) const {
    ld = inner;
    return a_tile + step * kBlockK;
  }
  // Where C[m][n] of the tile lives in the block array: blocks are [B][B] row-major, one after another.
  __device__ int64_t index(int m, int n) const {
    return (first_block + n / block_size) * block_size * block_size + static_cast<int64_t>(m) * block_size +
           n % block_size;
  }
  // The epilogue on N values of one row, N = 2 (store) or 8 (store_chunk: one 16-byte access each).
  template <int N>
  __device__ static void apply(const float (&acc)[N], const float (&in0)[N], const float (&in1)[N],
                               float (&o0)[N], float (&o1)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if constexpr (EPILOGUE == SddEpilogue::store) {
        o0[i] = acc[i];
      } else if constexpr (EPILOGUE == SddEpilogue::gelu) {
        o0[i] = acc[i];
        o1[i] = gelu(acc[i]);
      } else if constexpr (EPILOGUE == SddEpilogue::swiglu) {
        o0[i] = acc[i];
        o1[i] = silu(in0[i]) * acc[i];
      } else if constexpr (EPILOGUE == SddEpilogue::gelu_backward) {
        o0[i] = acc[i] * gelu_derivative(in0[i]);
      } else {  // swiglu_backward
        o0[i] = acc[i] * in1[i] * silu_derivative(in0[i]);
        o1[i] = acc[i] * silu(in0[i]);
      }
    }
  }
  static constexpr bool reads_in0 = EPILOGUE != SddEpilogue::store && EPILOGUE != SddEpilogue::gelu;
  static constexpr bool reads_in1 = EPILOGUE == SddEpilogue::swiglu_backward;
  static constexpr bool writes_out1 = EPILOGUE != SddEpilogue::store && EPILOGUE != SddEpilogue::gelu_backward;

  __device__ void store(int m, int n, float v0, float v1) const {
    const int64_t at = index(m, n);
    const float acc[2] = {v0, v1};
    float i0[2] = {}, i1[2] = {}, o0[2], o1[2];
    if constexpr (reads_in0) {
      const float2 f = unpack(in0 + at);
      i0[0] = f.x, i0[1] = f.y;
    }
    if constexpr (reads_in1) {
      const float2 f = unpack(in1 + at);
      i1[0] = f.x, i1[1] = f.y;
    }
    apply<2>(acc, i0, i1, o0, o1);
    *reinterpret_cast<__nv_bfloat162*>(out0 + at) = pack(o0[0], o0[1]);
    if constexpr (writes_out1) *reinterpret_cast<__nv_bfloat162*>(out1 + at) = pack(o1[0], o1[1]);
  }
  // C[m][n .. n+7], n a multiple of 8 (8 columns never straddle two blocks), in two steps: the
  // epilogue's inputs (load_chunk), then the outputs (store_chunk). A caller that loads several
  // chunks' inputs before it stores any keeps their trips to memory in flight together: a load
  // placed after a store must wait for it, as the compiler cannot tell in0 from out0.
  struct ChunkInputs {
    uint4 in0, in1;  // 8 bf16 each
  };
  __device__ ChunkInputs load_chunk(int m, int n) const {
    const int64_t at = index(m, n);
    ChunkInputs in{};
    if constexpr (reads_in0) in.in0 = *reinterpret_cast<const uint4*>(in0 + at);
    if constexpr (reads_in1) in.in1 = *reinterpret_cast<const uint4*>(in1 + at);
    return in;
  }
  __device__ void store_chunk(int m, int n, const float (&acc)[8], const ChunkInputs& in) const {
    const int64_t at = index(m, n);
    float i0[8] = {}, i1[8] = {}, o0[8], o1[8];
    if constexpr (reads_in0) unpack8(in.in0, i0);
    if constexpr (reads_in1) unpack8(in.in1, i1);
    apply<8>(acc, i0, i1, o0, o1);
    *reinterpret_cast<uint4*>(out0 + at) = pack8(o0);
    if constexpr (writes_out1) *reinterpret_cast<uint4*>(out1 + at) = pack8(o1);
  }
  __device__ void store_chunk(int m, int n, const float (&acc)[8]) const {
    store_chunk(m, n, acc, load_chunk(m, n));
  }
};

// DSD: out[rB : rB+B, n-tile] = sum over the blocks j of block row r of S(r, j) · W_e[jB : jB+B, n-tile].
// The sparse operand may come in `parts` block arrays laid side by side along K (SwiGLU's backward:
// d_x = [d_gate | d_up] · W1_eᵀ, and W1_e [D, 2H] transposed is exactly [W1_gateᵀ; W1_upᵀ]).
// The expert operand: b[e] [H*parts, ldb] (km) or [N, ldb] read transposed (nk).
template <Layout B_LAYOUT>
struct DsdProblem : ExpertOperandWalk<B_LAYOUT> {
  static constexpr bool grid_x_over_m = false;
  static constexpr bool wgmma_wide_tile = true;  // Hopper: 128 x 256 tiles where D allows
  static constexpr Layout a_layout = Layout::row_major_mk;
  static constexpr Layout b_layout = B_LAYOUT;
  const int* block_rows;
  const int* offsets;
  const int* block_row_expert;
  const bf16* s0;  // [max_nnz, B, B]
  const bf16* s1;  // second part or nullptr
  int parts;
  int blocks_per_expert;  // H / B
  int block_size;
  bf16* out;  // [max_rows, ldo]
  int ldo;
  // per-CTA state
  int64_t row_first_block;
  bf16* out_tile;
  int expert, n0;

  __device__ bool begin(int r, int tile_n, int bn) {
    if (r >= *block_rows) return false;
    const int e = block_row_expert[r];
    expert = e;
    row_first_block = offsets[r];
    n0 = tile_n * bn;
    this->begin_b(e, n0);
    out_tile = out + static_cast<int64_t>(r) * block_size * ldo + n0;
    return true;
  }
  __device__ int k_steps() const { return parts * blocks_per_expert * (block_size / kBlockK); }
  // The true count of block rows (the tiles' y): the stream-K tail shares out the true tiles (WsStreamK).
  __device__ int device_block_rows() const { return *block_rows; }
  __device__ const bf16* a_chunk(int step, int64_t& ld) const {
    const int steps_per_block = block_size / kBlockK;
    const int steps_per_part = blocks_per_expert * steps_per_block;
    const int part = step / steps_per_part, within = step % steps_per_part;
    const int64_t block = row_first_block + within / steps_per_block;
    ld = block_size;
    return (part == 0 ? s0 : s1) + block * block_size * block_size + (within % steps_per_block) * kBlockK;
  }
  __device__ void store(int m, int n, float v0, float v1) const {
    *reinterpret_cast<__nv_bfloat162*>(out_tile + static_cast<int64_t>(m) * ldo + n) = pack(v0, v1);
  }
  __device__ void store_chunk(int m, int n, const float (&v)[8]) const {
    *reinterpret_cast<uint4*>(out_tile + static_cast<int64_t>(m) * ldo + n) = pack8(v);
  }
};

// The weight-gradient products (DSᵀD, DDS) reduce over the rows of one expert: block column c's
// blocks, top to bottom, 64 rows (one k-step) at a time. An expert's routed rows come first in its
// padded bin, so only its last block row holds padding rows, and those are zero in every operand of
// the FFN (permute_tokens writes zero rows, and an SDD of a zero row is zero). The k-steps stop at
// the expert's last routed row: a block row with 10 tokens costs one k-step instead of B / 64.
__device__ inline int weight_gradient_k_steps(const int* transpose_indices, const int* row_indices,
                                              const int* block_row_tokens, int first, int count,
                                              int block_size) {
  if (count == 0) return 0;
  const int last_block_row = row_indices[transpose_indices[first + count - 1]];
  const int rows = (count - 1) * block_size + block_row_tokens[last_block_row];
  return (rows + kBlockK - 1) / kBlockK;
}

// Weight gradients are written in fp32 (what an fp32 optimizer reads) or bf16 (what cuBLAS and
// PyTorch write: half the bytes, which matters when experts are small: at 256 rows per expert, a
// 128 x 256 tile of dW computes 4 k-steps and then writes 128 KB of fp32).
__device__ inline void store2(float* out, float v0, float v1) {
  *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
}
__device__ inline void store2(bf16* out, float v0, float v1) { *reinterpret_cast<__nv_bfloat162*>(out) = pack(v0, v1); }
__device__ inline void store8(bf16* out, const float (&v)[8]) {
  if ((reinterpret_cast<uintptr_t>(out) & 15) == 0) {
    *reinterpret_cast<uint4*>(out) = pack8(v);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<__nv_bfloat162*>(out)[i] = pack(v[2 * i], v[2 * i + 1]);
  }
}

// What the weight-gradient products (DSᵀD, DDS) share: the walk down block column c (its blocks
// through column_offsets and transpose_indices, MegaBlocks 5.1.4: no transposed copy of S is ever
// stored), the blocks S and the dense operand they multiply, and the tile of the expert's output
// that a CTA writes. The products differ in which of S and dense is A and which is B, and in where
// the tile sits in the output. OUT: float or bf16 (weight gradients).
template <typename OUT>
struct ColumnWalkProblem {
  const int* column_offsets;
  const int* transpose_indices;
  const int* row_indices;
  const int* block_row_tokens;
  int blocks_per_expert;
  int block_size;
  const bf16* s;      // [max_nnz, B, B]
  const bf16* dense;  // [max_rows, ldd]
  int ldd;
  OUT* const* out;    // [E]: [rows, ldo]
  int ldo;
  // per-CTA state
  int first, steps;
  OUT* out_tile;
  int out_expert, out_row, out_column;  // out_tile = out[out_expert] + out_row * ldo + out_column

  // Starts block column c's walk; returns j, c's place among its expert's block columns.
  __device__ int begin_column(int c) {
    first = column_offsets[c];
    steps = weight_gradient_k_steps(transpose_indices, row_indices, block_row_tokens, first,
                                    column_offsets[c + 1] - first, block_size);
    out_expert = c / blocks_per_expert;
    return c % blocks_per_expert;
  }
  // Puts the CTA's tile at (row, column) of its expert's output.
  __device__ void place_tile(int row, int column) {
    out_row = row;
    out_column = column;
    out_tile = out[out_expert] + static_cast<int64_t>(out_row) * ldo + out_column;
  }
  __device__ int k_steps() const { return steps; }
  __device__ int block_of(int step, int& k0) const {
    const int steps_per_block = block_size / kBlockK;
    k0 = (step % steps_per_block) * kBlockK;
    return transpose_indices[first + step / steps_per_block];
  }
  // The row of `dense` that k-step row k0 of `block` multiplies: the block's row, k0 rows down.
  __device__ int64_t dense_row(int block, int k0) const {
    return static_cast<int64_t>(row_indices[block]) * block_size + k0;
  }
  // The k-step's 64 rows of S's block [k = row][column], and of dense from `column` on.
  __device__ const bf16* s_chunk(int step, int64_t& ld) const {
    int k0;
    const int64_t block = block_of(step, k0);
    ld = block_size;
    return s + block * block_size * block_size + static_cast<int64_t>(k0) * block_size;
  }
  __device__ const bf16* dense_chunk(int step, int64_t& ld, int column) const {
    int k0;
    const int block = block_of(step, k0);
    ld = ldd;
    return dense + dense_row(block, k0) * ldd + column;
  }
  using Out = OUT;
  __device__ OUT* out_at(int m, int n) const { return out_tile + static_cast<int64_t>(m) * ldo + n; }
  __device__ void store(int m, int n, float v0, float v1) const { store2(out_at(m, n), v0, v1); }
  __device__ void store_chunk(int m, int n, const float (&v)[8]) const { store8(out_at(m, n), v); }
};

// DSᵀD: out_e[jB : jB+B, n-tile] = sum over the blocks (r, c) of block column c = e*H/B + j of
// S(r, c)ᵀ · dense[rB : rB+B, n-tile]. An expert with no rows has empty columns: its tile is
// written with zeros.
template <typename OUT>
struct DsdTransposedProblem : ColumnWalkProblem<OUT> {
  static constexpr bool grid_x_over_m = false;
  static constexpr bool wgmma_wide_tile = false;  // Hopper: 128 x 128 tiles, the SDD's configuration
  static constexpr Layout a_layout = Layout::row_major_km;  // S block [k = row][m = column]
  static constexpr Layout b_layout = Layout::row_major_km;  // dense [k = row][n]
  int n0;  // per CTA

  __device__ bool begin(int c, int tile_n, int bn) {
    n0 = tile_n * bn;
    const int j = this->begin_column(c);
    this->place_tile(j * this->block_size, n0);
    return true;
  }
  __device__ const bf16* a_chunk(int step, int64_t& ld) const { return this->s_chunk(step, ld); }
  __device__ const bf16* b_chunk(int step, int64_t& ld) const { return this->dense_chunk(step, ld, n0); }
};

// DDS: out_e[m-tile, column_offset + jB : ...] = sum over the blocks (r, c) of block column
// c = e*H/B + j of dense[rB : rB+B, m-tile]ᵀ · S(r, c). Tile: BM rows of the output (over P) by
// COLUMNS block columns. Output OUT (weight gradients: d W1_e = permuted_xᵀ · d_pre).
// COLUMNS = 1: BN = B, a tile is one block column wide (the mma.sync and 128 x 128 wgmma kernels).
// COLUMNS = 2: the warp-specialized kernel's 256-wide tiles at B = 128: block columns c and c+1 of
//   one expert (H/B even). They have blocks in the same block rows, and in the BCSR order block
//   (r, c+1) is block (r, c) + 1, so the 256 columns of a k-step are two [64][128] halves B*B
//   elements apart (b_second_half).
template <typename OUT, int COLUMNS>
struct DdsProblem : ColumnWalkProblem<OUT> {
  static_assert(COLUMNS == 1 || COLUMNS == 2, "one block column a tile, or two of the same expert");
  static constexpr bool grid_x_over_m = true;
  static constexpr bool wgmma_wide_tile = false;
  static constexpr Layout a_layout = Layout::row_major_km;  // dense [k = row][m]
  static constexpr Layout b_layout = Layout::row_major_km;  // S block [k = row][n]
  int column_offset;
  int m0;  // per CTA

  // Here the grid's y is the block column (pair) and x the tile over P (rows of the output).
  __device__ bool begin(int y, int tile_m, int bm) {
    m0 = tile_m * bm;
    const int j = this->begin_column(y * COLUMNS);
    this->place_tile(m0, column_offset + j * this->block_size);
    return true;
  }
  __device__ const bf16* a_chunk(int step, int64_t& ld) const { return this->dense_chunk(step, ld, m0); }
  __device__ const bf16* b_chunk(int step, int64_t& ld) const { return this->s_chunk(step, ld); }
  __device__ int64_t b_second_half() const { return static_cast<int64_t>(this->block_size) * this->block_size; }
};

// ---- the problems' fields, filled on the host ----
// Every topology field the problem declares, by its DeviceTopology name: the products that walk
// block rows (SDD, DSD) read the block rows, where their blocks start and their experts (and the
// block rows' token counts and H / B where they have them); the weight gradients (DSᵀD, DDS) walk
// block columns through column_offsets, transpose_indices and row_indices. Every one reads B.
template <class Problem, class Topology>
Problem with_topology(Problem problem, const Topology& t) {
  if constexpr (requires { problem.block_rows; }) problem.block_rows = t.block_rows;
  if constexpr (requires { problem.offsets; }) problem.offsets = t.offsets;
  if constexpr (requires { problem.block_row_expert; }) problem.block_row_expert = t.block_row_expert;
  if constexpr (requires { problem.column_offsets; }) problem.column_offsets = t.column_offsets;
  if constexpr (requires { problem.transpose_indices; }) problem.transpose_indices = t.transpose_indices;
  if constexpr (requires { problem.row_indices; }) problem.row_indices = t.row_indices;
  if constexpr (requires { problem.block_row_tokens; }) problem.block_row_tokens = t.block_row_tokens;
  if constexpr (requires { problem.blocks_per_expert; }) problem.blocks_per_expert = t.blocks_per_expert;
  problem.block_size = t.block_size;
  return problem;
}

// The expert operand of the products that walk block rows (SDD, DSD): ExpertOperand's pointers,
// row stride and first column (block_sparse.h). Whether it is read transposed is the problem's
// B_LAYOUT, picked by the caller.
template <class Problem, class Operand>
Problem with_expert_operand(Problem problem, const Operand& b) {
  problem.b = b.pointers;
  problem.ldb = b.ld;
  problem.column_offset = b.column_offset;
  return problem;
}

}  // namespace moe::cuda::block_sparse_detail
