// block_sparse.h: the dropless expert FFN of MegaBlocks (Gale et al., MLSys 2023) on the GPU, as
// block-sparse products on tensor cores: SDD, DSD, DSᵀD and DDS over a DeviceTopology, forward and
// backward. Host API, includable by plain C++; the kernels are in block_sparse.cu / .cuh, and the
// lesson that builds them up version by version is cuda/dev/sdd.cu. On an H100/H200 (compute
// capability 9.0, sm_90a build) all four products at B = 128 with the dense extent (the dense
// operand's columns) a multiple of 128 run the wgmma kernel of block_sparse_wgmma.cuh; everything
// else runs the mma.sync kernel of block_sparse.cuh.
// Build: cmake --build build --target moe_cuda; tests: build/tests/cuda/cuda_test_block_sparse
//
// The hidden matrix [rows, E*H] is tiled in B x B blocks. The dropless plan rounds each expert's
// rows up to B, so block row r belongs to one expert e = block_row_expert[r] and holds all H/B of
// that expert's block columns. Sparse matrices are stored as their blocks in BCSR order,
// [max_nnz, B, B] bf16 (block i is rows i*B.. of the CPU reference's [nnz*B, B] matrix).
//
// Expert weights are addressed through device arrays of device pointers, one per expert of the
// topology (`const bf16* const* w1` = [E] pointers, each to a [D, w1_columns] matrix), so the same
// kernels serve experts stored in one tensor, a subset of experts on a rank, or an expert just
// copied into a cache slot. expert_pointer_table() builds such an array for one contiguous tensor.
//
// Contract (device_plan.h): the true counts (*block_rows, *nnz) stay on the device; grids are sized
// by topology.max_block_rows and block_cols; CTAs past *block_rows exit at once, so rows of dense
// outputs past the real rows and blocks past *nnz are NOT written. Weight gradients cover every
// expert of the topology (all E*H/B block columns) and are always written, zeros for an expert
// without rows. Everything runs asynchronously on `stream`; nothing synchronises with the host.
//
// Precision: bf16 operands, fp32 accumulation, bf16 activations and activation gradients, weight
// gradients in fp32 or bf16 (the caller picks; written, not accumulated into).
//
// Padding rows: the dropless plan's padding rows (past block_row_tokens[r] in block row r) are zero
// in every operand of the FFN. The weight-gradient products (DSᵀD, DDS) rely on it and skip them
// (64 rows at a time), so their S and dense operands must hold zeros there or the rows are ignored.
// So does the SDD on Hopper at B = 128: a block row whose routed rows all lie in its first 64 is
// computed as a half-row tile (block_sparse_wgmma_ws.cuh), which reads only those 64 rows of A and
// writes zeros in rows 64 .. B-1 of the output blocks, what a zero A row gives.
//
// Requirements, checked on the host before any launch (std::invalid_argument otherwise):
// B = 64 or 128, D and H multiples of B, every pointer argument non-null.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k, B block size.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/bf16.h"           // bf16
#include "core/device_buffer.h"  // DeviceBuffer
#include "moe/device_plan.h"     // DeviceTopology
#include "moe_config.h"          // MoeConfig, Activation

namespace moe::cuda {

// ---- the block-sparse products ----
// One dense operand per expert. Element (k, n) of expert e's operand matrix is
//   pointers[e][k * ld + column_offset + n]      when !transposed (stored [K, ld], row-major)
//   pointers[e][(column_offset + n) * ld + k]    when transposed  (stored [N, ld]; we use its ᵀ)
struct ExpertOperand {
  const bf16* const* pointers = nullptr;  // device array [E] of device pointers
  int ld = 0;                             // row stride of the stored matrix, in elements
  int column_offset = 0;                  // e.g. H for SwiGLU's up columns of W1
  bool transposed = false;
};

// SDD: out_blocks(r, j) = a[rB : rB+B, :] · op_e[:, jB : jB+B], e = block_row_expert[r], for the
// topology's blocks. a [max_rows, inner] bf16 row-major; op_e is [inner, H]; inner % B == 0.
void sdd(const DeviceTopology& topology, const bf16* a, int inner, const ExpertOperand& b,
         bf16* out_blocks,  // [max_nnz, B, B]
         cudaStream_t stream = nullptr);

// DSD: out[rB : rB+B, :] = sum_j S(r, j) · op_e[jB : jB+B, :], S given by its blocks;
// op_e is [H, out_cols]; out [max_rows, out_cols] bf16 row-major; out_cols % B == 0.
void dsd(const DeviceTopology& topology, const bf16* s_blocks,  // [max_nnz, B, B]
         const ExpertOperand& b, int out_cols, bf16* out, cudaStream_t stream = nullptr);

// DSᵀD: out_e = S_eᵀ · dense_e for every expert: out[e] [H, cols] fp32 or bf16 row-major, where
// S_e is expert e's block columns and dense_e its rows of dense [max_rows, cols]. Walks block
// columns through column_offsets / transpose_indices (MegaBlocks 5.1.4). cols % B == 0.
void dsd_transposed(const DeviceTopology& topology, const bf16* s_blocks,  // [max_nnz, B, B]
                    const bf16* dense, int cols,                           // [max_rows, cols]
                    float* const* out,  // device array [E] of device pointers, each [H, ldo]
                    int ldo, cudaStream_t stream = nullptr);
void dsd_transposed(const DeviceTopology& topology, const bf16* s_blocks, const bf16* dense, int cols,
                    bf16* const* out, int ldo, cudaStream_t stream = nullptr);

// DDS: out_e[:, column_offset + :H] = dense_eᵀ · S_e for every expert: out[e] [cols, ldo] fp32 or
// bf16, dense [max_rows, cols] bf16. (d W1_e = permuted_xᵀ · d_pre.) cols % B == 0.
void dds(const DeviceTopology& topology, const bf16* dense, int cols,  // [max_rows, cols]
         const bf16* s_blocks,                                         // [max_nnz, B, B]
         float* const* out,  // device array [E] of device pointers, each [cols, ldo]
         int ldo, int column_offset, cudaStream_t stream = nullptr);
void dds(const DeviceTopology& topology, const bf16* dense, int cols, const bf16* s_blocks,
         bf16* const* out, int ldo, int column_offset, cudaStream_t stream = nullptr);

// ---- the experts' input rows ----
// The forward's SDD reads its input x in expert order (row r of expert e's rows, padded to B).
// Either a permuted copy holds them ([max_rows, D], what permute_tokens writes), or the SDD gathers
// them from x in token order as it copies its operand: row r is then x[row_slot[r] / K], and a
// zero row where row_slot[r] < 0 (padding). Gathering saves the forward's permute kernel and its
// copy of x (ScatterMoE, Tan et al. 2024, does the same); it runs on the warp-specialized Hopper
// kernel only (rows_gatherable), elsewhere the caller permutes first. The backward's DDS reads a
// permuted copy either way (gathering there cost more than the permute: block_sparse_wgmma_ws.cuh).
struct ExpertRows {
  const bf16* data = nullptr;     // [max_rows, D] in expert order, or [T, D] in token order
  const int* row_slot = nullptr;  // nullptr: data is in expert order; else DevicePlan::row_slot
  int top_k = 1;                  // K, with row_slot
  int tokens = 0;                 // T, with row_slot: x's rows
  ExpertRows() = default;
  ExpertRows(const bf16* permuted) : data(permuted) {}  // NOLINT: a permuted copy converts implicitly
  static ExpertRows gathered(const bf16* x, const DevicePlan& plan) {
    ExpertRows rows(x);
    rows.row_slot = plan.row_slot;
    rows.top_k = plan.top_k;
    rows.tokens = plan.tokens;
    return rows;
  }
};

// Whether block_sparse_ffn_forward can gather the rows for this config on the current GPU:
// compute capability 9.0 with an sm_90a build, B = 128, H a multiple of 256.
bool rows_gatherable(const MoeConfig& config);

// Whether gathering is also the faster choice (what MoeLayerGpu does): where rows_gatherable and
// the experts are narrow, H <= kGatherMaxHidden. The permute it saves moves 4 T K D bytes, the SDD
// it slows computes 2 T K D H FLOPs, so the permute weighs ~ 2 (FLOP/s) / ((bytes/s) H) of the SDD:
// on an H200 (~600 TFLOP/s, ~4 TB/s) 7% at H = 4096 and 2% at H = 14336. The gathered SDD measured
// 2-3% slower at H = 4096 and 8-9% at H = 14336 (block_sparse_wgmma_ws.cuh, WsGatheredRows), so
// narrow experts gain and wide ones lose. The forward layer (FFN + the work outside it), permuted ->
// gathered, H200, notebooks_data/bench/moe_bench_rows_{permuted,gathered}_h200_2026-11-22.json:
// 0.636 -> 0.612 ms at T=16384 D=1024 H=4096 E=64 K=1 (uniform), 6.36 -> 6.52 ms at T=8192 D=4096
// H=14336 E=8 K=2 (uniform); at D=2048, H=8192, a wash: 3.99 -> 3.71 ms (uniform) and 4.26 -> 4.26
// (zipf) in those files, the other way round in two other A/B runs on the same H200.
constexpr int kGatherMaxHidden = 4096;
bool gathering_pays(const MoeConfig& config);

// Whether the SDDs and DSDs on Hopper (B = 128, the warp-specialized kernel) run in clusters of two
// CTAs whose pairs of block rows 2 y, 2 y + 1 share the expert's weights by TMA multicast
// (block_sparse_wgmma_ws.cuh, WsCluster::share_b), from the topology's host bound of block rows
// (max_block_rows) and its expert count: where an expert has 4 or more block rows. The weight
// gradients pair their tiles by the same rule (where weight_gradient_pairs_fit too). Where they pay
// and where they do not: block_sparse.cu.
bool block_row_pairs_share_weights(int max_block_rows, int experts);

// For tests and lessons: caps the persistent warp-specialized kernel at `workers` CTAs, or clusters
// of two where block rows pair up (0, the default: one per SM or resident cluster). A small problem
// then runs several rounds of tiles and a stream-K tail, as the reference shapes (moe_bench --shapes baselines) do on the whole GPU
// (tile_schedule.h). Process-wide; not for use while another thread launches products.
void set_persistent_worker_cap(int workers);
// For lessons and benchmarks: whether the DSDs end in a stream-K tail (tile_schedule.h; the
// default, true) or run their last partial round of tiles whole. Process-wide, as above.
void set_stream_k_tail(bool enabled);
// For lessons and benchmarks: whether the weight gradients (DSᵀD, DDS) may run in clusters of two
// tiles of one expert that share an operand's copies (the default, true: where the rule above takes
// pairs) or always one CTA a tile.
void set_weight_gradient_pairs(bool enabled);
// For experiments: take pairs of block rows (and the weight gradients' pairs, where they fit) at every
// shape, whatever block_row_pairs_share_weights says (true), or by that rule (false, the default).
// Process-wide, as above.
void set_block_row_pairs_everywhere(bool enabled);
// Whether the weight gradients' pairs of tiles (2 y', 2 y' + 1 over the block columns, or over pairs
// of them in DDS: columns_per_tile 1 or 2) always fall in one expert, so that both CTAs of a pair run
// the same k-steps and multiply the same rows: H / B a multiple of 2 * columns_per_tile.
bool weight_gradient_pairs_fit(int blocks_per_expert, int columns_per_tile);

// ---- the dropless expert FFN ----
// Forward (MegaBlocks 5.1): pre = SDD(x, W1), hidden = act(pre) fused into the SDD's epilogue,
// out = DSD(hidden, W2). SwiGLU: pre holds the gate blocks, up the up blocks, and the second SDD's
// epilogue writes hidden = silu(gate) · up.
struct BlockSparseFfnOutputs {  // device buffers the caller owns
  bf16* pre_activation = nullptr;  // [max_nnz, B, B] (the gate for SwiGLU)
  bf16* up_projection = nullptr;   // [max_nnz, B, B] SwiGLU only; nullptr for GeLU
  bf16* hidden = nullptr;          // [max_nnz, B, B]
  bf16* out = nullptr;             // [max_rows, D]
};

void block_sparse_ffn_forward(const MoeConfig& config, const DeviceTopology& topology,
                              const ExpertRows& x,      // permuted [max_rows, D] or gathered
                              const bf16* const* w1,    // device [E] -> [D, w1_columns]
                              const bf16* const* w2,    // device [E] -> [H, D]
                              const BlockSparseFfnOutputs& outputs, cudaStream_t stream = nullptr);

// Backward: d_hidden = SDD(d_out, W2ᵀ) with act' fused in its epilogue (-> d_pre, and d_up for
// SwiGLU); dW2_e = hidden_eᵀ d_out_e (DSᵀD); dW1_e = permuted_x_eᵀ d_pre_e (DDS);
// d_permuted_x = DSD(d_pre, W1ᵀ) (one DSD over [d_gate | d_up] for SwiGLU).
struct BlockSparseFfnGradients {  // device buffers the caller owns
  bf16* d_pre_activation = nullptr;  // [max_nnz, B, B] workspace and result
  bf16* d_up_projection = nullptr;   // [max_nnz, B, B] SwiGLU only
  bf16* d_permuted_x = nullptr;      // [max_rows, D]
  // The weight gradients, in fp32 (what an fp32 optimizer reads) or in bf16 (what cuBLAS and
  // PyTorch's bf16 layers write: half the bytes): set one pair, leave the other null. Leave all
  // four null to skip them: gradient accumulation computes them once over every micro-batch's rows
  // (MicroBatchTopology, moe/topology.h, with dsd_transposed and dds).
  float* const* d_w1 = nullptr;      // device [E] -> [D, w1_columns] fp32
  float* const* d_w2 = nullptr;      // device [E] -> [H, D] fp32
  bf16* const* d_w1_bf16 = nullptr;  // device [E] -> [D, w1_columns] bf16
  bf16* const* d_w2_bf16 = nullptr;  // device [E] -> [H, D] bf16
};

void block_sparse_ffn_backward(const MoeConfig& config, const DeviceTopology& topology,
                               const bf16* permuted_x,  // [max_rows, D] (permute_tokens)
                               const bf16* const* w1,   // device [E] -> [D, w1_columns]
                               const bf16* const* w2,   // device [E] -> [H, D]
                               const BlockSparseFfnOutputs& forward,
                               const bf16* d_out,       // [max_rows, D]
                               const BlockSparseFfnGradients& gradients,
                               cudaStream_t stream = nullptr);

// A device array of `count` pointers base, base + stride, base + 2 stride, ... (elements): the
// pointer table of experts stored one after another in one tensor.
template <typename T>
DeviceBuffer<T*> expert_pointer_table(T* base, int count, size_t stride) {
  std::vector<T*> pointers(count);
  for (int e = 0; e < count; ++e) pointers[e] = base + static_cast<size_t>(e) * stride;
  return DeviceBuffer<T*>(pointers);
}

}  // namespace moe::cuda
