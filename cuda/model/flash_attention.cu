// model/flash_attention.cu: the fused attention core, forward and backward (see model/flash_attention.h
// for the algorithm). Four parts: the tensor-core primitives, the tile loads, the three kernels and
// their launchers.
#include "model/flash_attention.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/launch_checks.h"  // check_not_null
#include "core/mma_sync.cuh"      // cp_async_*, ldmatrix_x4(_trans), mma_bf16_16816

namespace moe::cuda {

namespace {

constexpr int kTile = 64;   // query rows and key rows of a CTA's tiles
constexpr int kWarps = 4;   // each owns 16 rows of the CTA's 64
constexpr int kThreads = kWarps * 32;
constexpr int kPad = 8;     // bf16 that pad a row in shared memory: a row stride of 16 bytes past a
                            // multiple of 128, so ldmatrix's eight rows fall in eight different
                            // 16-byte bank groups (no bank conflicts, no swizzle to explain)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- [SECTION] tensor-core primitives ----
// One warp computes C[16 x 8] += A[16 x 16] B[16 x 8] with mma.sync.m16n8k16 (bf16 in, fp32 out);
// core/mma_sync.cuh has the instructions and the fragment layout. The one fact this file leans on:
// the C of two neighbouring n-tiles is, packed to bf16, the A of one k-step of the next product.
using tensor_core::cp_async_commit;
using tensor_core::cp_async_wait;
using tensor_core::ldmatrix_x4;
using tensor_core::ldmatrix_x4_trans;
using tensor_core::mma_bf16_16816;
using tensor_core::shared_address;

// A shared tile: 64 rows of one head's d values, padded.
template <int D>
struct Tile {
  static constexpr int kStride = D + kPad;
  bf16 at[kTile * kStride];
  __device__ const bf16* row(int r, int col) const { return at + r * kStride + col; }
};

// A[16 x 16] = tile rows row0 .. row0+15, columns col0 .. col0+15.
template <int D>
__device__ inline void load_a(uint32_t (&a)[4], const Tile<D>& tile, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, tile.row(row0 + lane % 16, col0 + (lane / 16) * 8));
}

// The B of two n-tiles, n0 .. n0+7 in b[0], b[1] and n0+8 .. n0+15 in b[2], b[3], k = k0 .. k0+15,
// from a tile whose rows are n (B[k][n] = tile[n][k]: K or V against queries, Q or dO against keys).
template <int D>
__device__ inline void load_b_rows_n(uint32_t (&b)[4], const Tile<D>& tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, tile.row(n0 + lane % 8 + (lane / 16) * 8, k0 + ((lane / 8) % 2) * 8));
}

// The same from a tile whose rows are k (B[k][n] = tile[k][n]: V or K after p, dO or Q after pᵀ).
template <int D>
__device__ inline void load_b_rows_k(uint32_t (&b)[4], const Tile<D>& tile, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(b, tile.row(k0 + lane % 8 + ((lane / 8) % 2) * 8, n0 + (lane / 16) * 8));
}

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// k-step kk (columns 16 kk .. 16 kk + 15) of a 16 x 64 accumulator as an A operand.
__device__ inline void accumulator_as_a(uint32_t (&a)[4], const float (&c)[8][4], int kk) {
  a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc[16 x 64] (+)= A_rows[16 x D] B_rowsᵀ: A from rows row0.. of `a_tile`, B's n from the rows of `b_tile`.
template <int D>
__device__ inline void product_a_bt(float (&acc)[8][4], const Tile<D>& a_tile, int row0, const Tile<D>& b_tile) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    load_a(a, a_tile, row0, ks * 16);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      load_b_rows_n(b, b_tile, np * 16, ks * 16);
      mma_bf16_16816(acc[2 * np], a, b[0], b[1]);
      mma_bf16_16816(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// out[16 x D] += P[16 x 64] (registers, rounded to bf16) tile[64 x D].
template <int D>
__device__ inline void product_p_tile(float (&out)[D / 8][4], const float (&p)[8][4], const Tile<D>& tile) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    accumulator_as_a(a, p, kk);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      load_b_rows_k(b, tile, kk * 16, dp * 16);
      mma_bf16_16816(out[2 * dp], a, b[0], b[1]);
      mma_bf16_16816(out[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// ---- [SECTION] tile loads ----
// Rows first_row .. first_row + 63 of one head (`base` points at row 0, `stride` elements a row) into
// shared memory with cp.async, 16 bytes a copy; rows at or past `rows` are zeros.
template <int D>
__device__ inline void load_tile(Tile<D>& tile, const bf16* base, int64_t stride, int first_row, int rows) {
  constexpr int kChunks = D / 8;  // 16-byte copies a row
  for (int chunk = threadIdx.x; chunk < kTile * kChunks; chunk += kThreads) {
    const int r = chunk / kChunks, c = chunk % kChunks;
    const bool valid = first_row + r < rows;
    const bf16* from = base + (valid ? int64_t(first_row + r) * stride + c * 8 : 0);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(tile.row(r, c * 8))),
                 "l"(from), "r"(valid ? 16 : 0));
  }
}

// Step j of a walk over the key tiles 0 .. last (the forward's and dQ's): start loading tile j + 1
// into the other buffers, if there is one, then wait for tile j and make it visible to every warp.
template <int D>
__device__ inline void next_key_tile(int j, int last, Tile<D>* k_tiles, Tile<D>* v_tiles, const bf16* k_rows,
                                     const bf16* v_rows, int64_t stride, int seq_len) {
  if (j < last) {
    load_tile(k_tiles[(j + 1) % 2], k_rows, stride, (j + 1) * kTile, seq_len);
    load_tile(v_tiles[(j + 1) % 2], v_rows, stride, (j + 1) * kTile, seq_len);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// Where one pair's rows live: b = n * heads + h.
struct Head {
  int64_t sequence_row;  // n * S: the pair's first token
  int column;            // h * d
};
__device__ inline Head head_of(int pair, int seq_len, int heads, int head_dim) {
  return {int64_t(pair / heads) * seq_len, (pair % heads) * head_dim};
}

// ---- [SECTION] forward ----

template <int D>
__global__ void __launch_bounds__(kThreads) flash_forward_kernel(const bf16* __restrict__ qkv,
                                                                 bf16* __restrict__ context,
                                                                 float* __restrict__ log_sum_exp, int seq_len,
                                                                 int heads, float scale_log2) {
  extern __shared__ uint4 shared_words[];
  Tile<D>* tiles = reinterpret_cast<Tile<D>*>(shared_words);
  Tile<D>& q_tile = tiles[0];
  Tile<D>* k_tiles = tiles + 1;  // two: the one in use and the next
  Tile<D>* v_tiles = tiles + 3;

  const int pair = blockIdx.x;
  const int q_block = gridDim.y - 1 - blockIdx.y;  // the longest rows start first
  const int q0 = q_block * kTile;
  const int model_dim = heads * D;
  const int64_t stride = 3 * int64_t{model_dim};
  const Head head = head_of(pair, seq_len, heads, D);
  const bf16* q_rows = qkv + head.sequence_row * stride + head.column;
  const bf16* k_rows = q_rows + model_dim;
  const bf16* v_rows = q_rows + 2 * model_dim;

  load_tile(q_tile, q_rows, stride, q0, seq_len);
  load_tile(k_tiles[0], k_rows, stride, 0, seq_len);
  load_tile(v_tiles[0], v_rows, stride, 0, seq_len);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = q0 + warp * 16 + lane / 4;  // this thread's rows: row and row + 8
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY};  // the running maxima, in log2 units (scores scale log2 e)
  float l[2] = {0.0f, 0.0f};            // this thread's part of the running sums
  for (int j = 0; j <= q_block; ++j) {
    next_key_tile(j, q_block, k_tiles, v_tiles, k_rows, v_rows, stride, seq_len);
    const Tile<D>& k_tile = k_tiles[j % 2];
    const Tile<D>& v_tile = v_tiles[j % 2];

    float s[8][4] = {};
    product_a_bt(s, q_tile, warp * 16, k_tile);

    const int k0 = j * kTile;
    if (j == q_block || k0 + kTile > seq_len) {  // the diagonal tile, or keys past the end
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + nt * 8 + (lane % 4) * 2 + e % 2;
          if (key > row + (e / 2) * 8 || key >= seq_len) s[nt][e] = -INFINITY;
        }
      }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {  // row + 8 r: its 64 scores live in the four threads of a quad
      float top = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) top = fmaxf(top, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const float m_new = fmaxf(m[r], top * scale_log2);  // finite: every row sees key 0 in tile 0
      const float correction = exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= correction;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * r] *= correction;
        o[dt][2 * r + 1] *= correction;
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[nt][e] = exp2f(s[nt][e] * scale_log2 - m_new);
          l[r] += s[nt][e];
        }
      }
    }
    product_p_tile<D>(o, s, v_tile);
    __syncthreads();  // every warp is done with this buffer before the next iteration refills it
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int s_row = row + 8 * r;
    if (s_row >= seq_len) continue;
    const float inverse = 1.0f / l[r];
    bf16* out = context + (head.sequence_row + s_row) * model_dim + head.column + (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<__nv_bfloat162*>(out + dt * 8) =
          __floats2bfloat162_rn(o[dt][2 * r] * inverse, o[dt][2 * r + 1] * inverse);
    }
    if (lane % 4 == 0) log_sum_exp[int64_t(pair) * seq_len + s_row] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// ---- [SECTION] backward ----

// delta[b, s] = <dO row, O row> over the head's d columns: d / 8 lanes a row, each a 16-byte load of
// O and of dO (8 products added in order), then a butterfly over those lanes. A warp a row with 2-byte
// loads took 32 us a block at the throughput preset on an H200 (moe_train --benchmark-kernel-trace,
// 2026-11-30), three times the time to read O and dO.
template <int D>
__global__ void flash_delta_kernel(const bf16* __restrict__ context, const bf16* __restrict__ d_context,
                                   float* __restrict__ delta, int64_t rows, int seq_len, int heads) {
  constexpr int kLanesPerRow = D / 8;  // 4, 8 or 16: a row's lanes are aligned within a warp
  const int64_t thread = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t index = thread / kLanesPerRow;
  const int part = int(thread % kLanesPerRow);
  float sum = 0.0f;
  if (index < rows) {  // no return before the shuffles: every lane of the warp takes part
    const int pair = int(index / seq_len), s = int(index % seq_len);
    const Head head = head_of(pair, seq_len, heads, D);
    const int64_t offset = (head.sequence_row + s) * int64_t{heads} * D + head.column + part * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(context + offset);
    const uint4 d_o = *reinterpret_cast<const uint4*>(d_context + offset);
    const bf16* os = reinterpret_cast<const bf16*>(&o);
    const bf16* d_os = reinterpret_cast<const bf16*>(&d_o);
    for (int c = 0; c < 8; ++c) sum += __bfloat162float(os[c]) * __bfloat162float(d_os[c]);
  }
  for (int width = kLanesPerRow / 2; width > 0; width /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, width);
  if (index < rows && part == 0) delta[index] = sum;
}

// dK and dV of 64 keys: the query tiles from the diagonal on.
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dk_dv_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ d_context,
                                const float* __restrict__ log_sum_exp, const float* __restrict__ delta,
                                bf16* __restrict__ d_qkv, int seq_len, int heads, float scale_log2, float scale) {
  extern __shared__ uint4 shared_words[];
  Tile<D>* tiles = reinterpret_cast<Tile<D>*>(shared_words);
  Tile<D>& k_tile = tiles[0];
  Tile<D>& v_tile = tiles[1];
  Tile<D>* q_tiles = tiles + 2;   // two
  Tile<D>* do_tiles = tiles + 4;  // two
  float* lse_shared = reinterpret_cast<float*>(tiles + 6);  // [2][64], log2 units; +inf past the end
  float* delta_shared = lse_shared + 2 * kTile;             // [2][64]

  const int pair = blockIdx.x;
  const int k_block = blockIdx.y;  // key tile 0 has the most query tiles: it starts first
  const int k0 = k_block * kTile;
  const int model_dim = heads * D;
  const int64_t stride = 3 * int64_t{model_dim};
  const Head head = head_of(pair, seq_len, heads, D);
  const bf16* q_rows = qkv + head.sequence_row * stride + head.column;
  const bf16* do_rows = d_context + head.sequence_row * model_dim + head.column;
  const int q_blocks = (seq_len + kTile - 1) / kTile;

  auto load_queries = [&](int i, int buffer) {
    load_tile(q_tiles[buffer], q_rows, stride, i * kTile, seq_len);
    load_tile(do_tiles[buffer], do_rows, model_dim, i * kTile, seq_len);
    if (threadIdx.x < kTile) {  // plain loads, seen by all after the loop's __syncthreads
      const int s = i * kTile + threadIdx.x;
      const bool valid = s < seq_len;
      lse_shared[buffer * kTile + threadIdx.x] =
          valid ? log_sum_exp[int64_t(pair) * seq_len + s] * kLog2e : INFINITY;
      delta_shared[buffer * kTile + threadIdx.x] = valid ? delta[int64_t(pair) * seq_len + s] : 0.0f;
    }
  };
  load_tile(k_tile, q_rows + model_dim, stride, k0, seq_len);
  load_tile(v_tile, q_rows + 2 * model_dim, stride, k0, seq_len);
  load_queries(k_block, 0);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key = k0 + warp * 16 + lane / 4;  // this thread's keys: key and key + 8
  float dk[D / 8][4] = {};
  float dv[D / 8][4] = {};
  for (int i = k_block; i < q_blocks; ++i) {
    const int buffer = (i - k_block) % 2;
    if (i + 1 < q_blocks) {
      load_queries(i + 1, 1 - buffer);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const Tile<D>& q_tile = q_tiles[buffer];
    const Tile<D>& do_tile = do_tiles[buffer];
    const float* lse = lse_shared + buffer * kTile;
    const float* dlt = delta_shared + buffer * kTile;

    float p[8][4] = {};  // sᵀ, then pᵀ: this warp's 16 keys against the tile's 64 queries
    product_a_bt(p, k_tile, warp * 16, q_tile);
    const bool diagonal = i == k_block;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = nt * 8 + (lane % 4) * 2 + e % 2;  // in the tile
        const bool visible = !diagonal || i * kTile + q >= key + (e / 2) * 8;
        p[nt][e] = visible ? exp2f(p[nt][e] * scale_log2 - lse[q]) : 0.0f;
      }
    }
    product_p_tile<D>(dv, p, do_tile);  // dV += pᵀ dO

    float ds[8][4] = {};  // dpᵀ = V dOᵀ, then dsᵀ = pᵀ (dpᵀ - delta)
    product_a_bt(ds, v_tile, warp * 16, do_tile);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[nt][e] = p[nt][e] * (ds[nt][e] - dlt[nt * 8 + (lane % 4) * 2 + e % 2]);
    }
    product_p_tile<D>(dk, ds, q_tile);  // dK += dsᵀ Q
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int k_row = key + 8 * r;
    if (k_row >= seq_len) continue;
    bf16* out = d_qkv + (head.sequence_row + k_row) * stride + model_dim + head.column + (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<__nv_bfloat162*>(out + dt * 8) =
          __floats2bfloat162_rn(dk[dt][2 * r] * scale, dk[dt][2 * r + 1] * scale);
      *reinterpret_cast<__nv_bfloat162*>(out + model_dim + dt * 8) =
          __floats2bfloat162_rn(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
}

// dQ of 64 queries: the key tiles up to the diagonal.
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dq_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ d_context,
                             const float* __restrict__ log_sum_exp, const float* __restrict__ delta,
                             bf16* __restrict__ d_qkv, int seq_len, int heads, float scale_log2, float scale) {
  extern __shared__ uint4 shared_words[];
  Tile<D>* tiles = reinterpret_cast<Tile<D>*>(shared_words);
  Tile<D>& q_tile = tiles[0];
  Tile<D>& do_tile = tiles[1];
  Tile<D>* k_tiles = tiles + 2;  // two
  Tile<D>* v_tiles = tiles + 4;  // two

  const int pair = blockIdx.x;
  const int q_block = gridDim.y - 1 - blockIdx.y;
  const int q0 = q_block * kTile;
  const int model_dim = heads * D;
  const int64_t stride = 3 * int64_t{model_dim};
  const Head head = head_of(pair, seq_len, heads, D);
  const bf16* q_rows = qkv + head.sequence_row * stride + head.column;
  const bf16* k_rows = q_rows + model_dim;
  const bf16* v_rows = q_rows + 2 * model_dim;

  load_tile(q_tile, q_rows, stride, q0, seq_len);
  load_tile(do_tile, d_context + head.sequence_row * model_dim + head.column, model_dim, q0, seq_len);
  load_tile(k_tiles[0], k_rows, stride, 0, seq_len);
  load_tile(v_tiles[0], v_rows, stride, 0, seq_len);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = q0 + warp * 16 + lane / 4;  // this thread's rows: row and row + 8
  float lse[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool valid = row + 8 * r < seq_len;
    lse[r] = valid ? log_sum_exp[int64_t(pair) * seq_len + row + 8 * r] * kLog2e : INFINITY;
    dlt[r] = valid ? delta[int64_t(pair) * seq_len + row + 8 * r] : 0.0f;
  }
  float dq[D / 8][4] = {};
  for (int j = 0; j <= q_block; ++j) {
    next_key_tile(j, q_block, k_tiles, v_tiles, k_rows, v_rows, stride, seq_len);
    const Tile<D>& k_tile = k_tiles[j % 2];
    const Tile<D>& v_tile = v_tiles[j % 2];

    float p[8][4] = {};  // s, then p
    product_a_bt(p, q_tile, warp * 16, k_tile);
    const int k0 = j * kTile;
    const bool edge = j == q_block || k0 + kTile > seq_len;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + nt * 8 + (lane % 4) * 2 + e % 2;
        const bool visible = !edge || (key <= row + (e / 2) * 8 && key < seq_len);
        p[nt][e] = visible ? exp2f(p[nt][e] * scale_log2 - lse[e / 2]) : 0.0f;
      }
    }
    float ds[8][4] = {};  // dp = dO Vᵀ, then ds = p (dp - delta)
    product_a_bt(ds, do_tile, warp * 16, v_tile);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[nt][e] = p[nt][e] * (ds[nt][e] - dlt[e / 2]);
    }
    product_p_tile<D>(dq, ds, k_tile);  // dQ += ds K
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q_row = row + 8 * r;
    if (q_row >= seq_len) continue;
    bf16* out = d_qkv + (head.sequence_row + q_row) * stride + head.column + (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<__nv_bfloat162*>(out + dt * 8) =
          __floats2bfloat162_rn(dq[dt][2 * r] * scale, dq[dt][2 * r + 1] * scale);
    }
  }
}

// ---- [SECTION] launchers ----

struct Launch {
  int seq_len, heads, head_dim, pairs, tiles;
  float scale, scale_log2;
};

void check_aligned(const char* function, const char* name, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    throw std::invalid_argument(std::string(function) + ": " + name +
                                " is not 16-byte aligned; the fused core copies 16 bytes at a time");
  }
}

Launch checked_launch(const char* function, const AttentionShape& shape) {
  check_attention_shape(function, shape);
  const int64_t head_dim = shape.model_dim / shape.num_heads;
  if (!flash_attention_supports(head_dim)) {
    throw std::invalid_argument(std::string(function) + ": head width D / heads = " + std::to_string(head_dim) +
                                " has no fused kernels; allowed: 32, 64, 128 (other widths use the unfused core)");
  }
  const int64_t pairs = shape.batch * shape.num_heads;
  detail::check_range(function, "batch * num_heads", pairs, 1, (int64_t{1} << 31) - 1, "grid columns");
  Launch z{};
  z.seq_len = int(shape.seq_len);
  z.heads = int(shape.num_heads);
  z.head_dim = int(head_dim);
  z.pairs = int(pairs);
  z.tiles = int((shape.seq_len + kTile - 1) / kTile);
  z.scale = float(1.0 / std::sqrt(double(head_dim)));
  z.scale_log2 = z.scale * kLog2e;
  return z;
}

template <int D>
constexpr int tile_bytes() {
  return int(sizeof(Tile<D>));
}

// Opts a kernel into more than 48 KB of dynamic shared memory (once a kernel; cheap to repeat).
template <typename Kernel>
void allow_shared(Kernel kernel, int bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <int D>
void forward(const Launch& z, const bf16* qkv, bf16* context, float* log_sum_exp, cudaStream_t stream) {
  const int bytes = 5 * tile_bytes<D>();
  allow_shared(flash_forward_kernel<D>, bytes);
  flash_forward_kernel<D><<<dim3(unsigned(z.pairs), unsigned(z.tiles)), kThreads, bytes, stream>>>(
      qkv, context, log_sum_exp, z.seq_len, z.heads, z.scale_log2);
  CUDA_CHECK(cudaGetLastError());
}

template <int D>
void backward(const Launch& z, const bf16* qkv, const bf16* context, const bf16* d_context, const float* log_sum_exp,
              float* delta, bf16* d_qkv, cudaStream_t stream) {
  constexpr int kDeltaThreads = 256;
  const int64_t rows = int64_t{z.pairs} * z.seq_len, delta_threads = rows * (D / 8);
  flash_delta_kernel<D><<<unsigned((delta_threads + kDeltaThreads - 1) / kDeltaThreads), kDeltaThreads, 0, stream>>>(
      context, d_context, delta, rows, z.seq_len, z.heads);
  CUDA_CHECK(cudaGetLastError());
  const dim3 grid(unsigned(z.pairs), unsigned(z.tiles));
  const int dk_dv_bytes = 6 * tile_bytes<D>() + 4 * kTile * int(sizeof(float));
  allow_shared(flash_backward_dk_dv_kernel<D>, dk_dv_bytes);
  flash_backward_dk_dv_kernel<D><<<grid, kThreads, dk_dv_bytes, stream>>>(qkv, d_context, log_sum_exp, delta, d_qkv,
                                                                         z.seq_len, z.heads, z.scale_log2, z.scale);
  CUDA_CHECK(cudaGetLastError());
  const int dq_bytes = 6 * tile_bytes<D>();
  allow_shared(flash_backward_dq_kernel<D>, dq_bytes);
  flash_backward_dq_kernel<D><<<grid, kThreads, dq_bytes, stream>>>(qkv, d_context, log_sum_exp, delta, d_qkv,
                                                                   z.seq_len, z.heads, z.scale_log2, z.scale);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool flash_attention_supports(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

void flash_attention_forward(const AttentionShape& shape, const bf16* qkv, bf16* context, float* log_sum_exp,
                             cudaStream_t stream) {
  constexpr const char* kFunction = "flash_attention_forward";
  const Launch z = checked_launch(kFunction, shape);
  detail::check_not_null(kFunction, {{"qkv", qkv}, {"context", context}, {"log_sum_exp", log_sum_exp}});
  check_aligned(kFunction, "qkv", qkv);
  check_aligned(kFunction, "context", context);
  switch (z.head_dim) {
    case 32: forward<32>(z, qkv, context, log_sum_exp, stream); break;
    case 64: forward<64>(z, qkv, context, log_sum_exp, stream); break;
    default: forward<128>(z, qkv, context, log_sum_exp, stream); break;
  }
}

void flash_attention_backward(const AttentionShape& shape, const bf16* qkv, const bf16* context,
                              const float* log_sum_exp, const bf16* d_context, float* delta, bf16* d_qkv,
                              cudaStream_t stream) {
  constexpr const char* kFunction = "flash_attention_backward";
  const Launch z = checked_launch(kFunction, shape);
  detail::check_not_null(kFunction, {{"qkv", qkv}, {"context", context}, {"log_sum_exp", log_sum_exp},
                                     {"d_context", d_context}, {"delta", delta}, {"d_qkv", d_qkv}});
  check_aligned(kFunction, "qkv", qkv);
  check_aligned(kFunction, "context", context);
  check_aligned(kFunction, "d_context", d_context);
  check_aligned(kFunction, "d_qkv", d_qkv);
  switch (z.head_dim) {
    case 32: backward<32>(z, qkv, context, d_context, log_sum_exp, delta, d_qkv, stream); break;
    case 64: backward<64>(z, qkv, context, d_context, log_sum_exp, delta, d_qkv, stream); break;
    default: backward<128>(z, qkv, context, d_context, log_sum_exp, delta, d_qkv, stream); break;
  }
}

}  // namespace moe::cuda
