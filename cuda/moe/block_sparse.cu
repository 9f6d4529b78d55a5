// block_sparse.cu: launchers of the block-sparse products (SDD, DSD, DSᵀD, DDS) and the dropless
// expert FFN forward and backward built from them (see block_sparse.h for the API and the math,
// block_sparse.cuh for the mma.sync tensor-core kernel, block_sparse_wgmma.cuh for the Hopper one
// that runs all four products at B = 128 on an H100/H200, cuda/dev/sdd.cu for how it was reached).
// Build: cmake --build build --target moe_cuda
#include "moe/block_sparse.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "moe/block_sparse.cuh"           // block_sparse_mma_kernel and the problems
#include "moe/block_sparse_wgmma.cuh"     // block_sparse_wgmma_kernel (sm_90a)
#include "moe/block_sparse_wgmma_ws.cuh"  // block_sparse_wgmma_ws_kernel (sm_90a, warp-specialized)
#include "core/cuda_check.h"              // CUDA_CHECK
#include "core/launch_checks.h"           // NamedPointer
#include "moe/tensor_map.h"               // make_matrix_map, make_blocks_map, build_expert_maps

namespace moe::cuda {

namespace {

using namespace block_sparse_detail;

// ---- host-side checks: every one runs before any launch ----
void require(bool ok, const std::string& function, const std::string& what) {
  if (!ok) throw std::invalid_argument(function + ": " + what);
}
void require_pointer(const void* p, const std::string& function, const char* name) {
  require(p != nullptr, function, std::string(name) + " is null");
}
void require_multiple(int64_t value, int64_t of, const std::string& function, const char* name) {
  std::ostringstream text;
  text << name << " = " << value << " must be a positive multiple of the block size B = " << of;
  require(value > 0 && value % of == 0, function, text.str());
}

// The topology arrays a product reads, and the block size the kernels are built for.
void require_topology(const DeviceTopology& t, const std::string& function, bool rows, bool columns) {
  std::ostringstream text;
  text << "block_size = " << t.block_size << "; the kernels are built for B = 64 and 128";
  require(t.block_size == 64 || t.block_size == 128, function, text.str());
  require(t.blocks_per_expert > 0 && t.block_cols > 0 && t.block_cols % t.blocks_per_expert == 0,
          function, "blocks_per_expert must be positive and divide block_cols (= E * H / B)");
  require(t.max_block_rows >= 0 && t.max_block_rows <= 65535 && t.block_cols <= 65535, function,
          "max_block_rows and block_cols must fit a grid's y dimension (65535)");
  if (rows) {
    require_pointer(t.block_rows, function, "topology.block_rows");
    require_pointer(t.offsets, function, "topology.offsets");
    require_pointer(t.block_row_expert, function, "topology.block_row_expert");
    require_pointer(t.block_row_tokens, function, "topology.block_row_tokens");
  }
  if (columns) {
    require_pointer(t.column_offsets, function, "topology.column_offsets");
    require_pointer(t.transpose_indices, function, "topology.transpose_indices");
    require_pointer(t.row_indices, function, "topology.row_indices");
    require_pointer(t.block_row_tokens, function, "topology.block_row_tokens");
  }
}

// The opening checks of the four products: the side of the topology the product walks (block rows
// for SDD and DSD, block columns for the weight gradients DSᵀD and DDS), and its dense width, a
// multiple of B.
void require_walk(const DeviceTopology& t, const std::string& function, bool rows, int64_t width,
                  const char* width_name) {
  require_topology(t, function, rows, /*columns=*/!rows);
  require_multiple(width, t.block_size, function, width_name);
}

// Each pointer of the list, in order: the first null one is the one named.
void require_pointers(const std::string& function, std::initializer_list<detail::NamedPointer> pointers) {
  for (const detail::NamedPointer& p : pointers) require_pointer(p.pointer, function, p.name);
}

void require_operand(const ExpertOperand& b, const std::string& function) {
  require_pointer(b.pointers, function, "the expert operand's pointer table");
  // cp.async copies 16 bytes: 8 bf16 elements, so rows and column offsets must stay aligned.
  require(b.ld > 0 && b.ld % 8 == 0 && b.column_offset >= 0 && b.column_offset % 8 == 0, function,
          "the expert operand's ld must be a positive multiple of 8 and column_offset a multiple of 8");
}

// ---- launching one tile shape ----
template <int BM, int BN, class Problem>
void launch_shape(const Problem& problem, int x_extent, int y_count, cudaStream_t stream) {
  const int x_tiles = x_extent / (Problem::grid_x_over_m ? BM : BN);
  if (x_tiles == 0 || y_count == 0) return;
  constexpr int smem = pipeline_shared_bytes<BM, BN>();
  // 2 CTAs per SM (registers capped at 128): while one waits at its barrier, the other computes;
  // measured +30% over 1 CTA per SM on the SDD (cuda/dev/sdd.cu, versions 3 and 4).
  auto* kernel = &block_sparse_mma_kernel<BM, BN, 2, Problem>;
  // More than 48 KB of dynamic shared memory needs an explicit opt-in (per kernel, cheap to repeat).
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(x_tiles, y_count), kThreads, smem, stream>>>(problem);
  CUDA_CHECK(cudaGetLastError());
}

// ---- the Hopper path: wgmma, for every product at B = 128 ----
// wgmma exists on compute capability 9.0 only (H100, H200), and only in a build that carries sm_90a
// machine code (CMake defines MOE_CUDA_HAS_SM90A when CMAKE_CUDA_ARCHITECTURES names 90a); a newer
// GPU running the compute_90 PTX gets the mma.sync kernel.
bool wgmma_available() {
#if defined(MOE_CUDA_HAS_SM90A)
  int device = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

template <int BN, int STAGES, int MIN_BLOCKS, int IN_FLIGHT, bool STAGED, class Problem>
void launch_wgmma_shape(const Problem& problem, int x_extent, int y_count, cudaStream_t stream) {
  constexpr int smem = wgmma_shared_bytes<BN, STAGES>();
  auto* kernel = &block_sparse_wgmma_kernel<BN, STAGES, MIN_BLOCKS, IN_FLIGHT, STAGED, Problem>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // x tiles over N, or over M for DDS (128 rows of the output, one block column wide)
  const int x_tiles = x_extent / (Problem::grid_x_over_m ? kWgmmaBlockM : BN);
  kernel<<<dim3(x_tiles, y_count), kWgmmaThreads, smem, stream>>>(problem);
  CUDA_CHECK(cudaGetLastError());
}

// What the TMA copies of the warp-specialized kernel need: the activation operands' maps, and for
// the SDD and DSD the expert operand's prototype map and pointer table, for DSᵀD and DDS the
// output's (the weight gradients' TMA stores), from which one map per expert is built on the device
// just before the product (tensor_map.h).
struct TmaOperands {
  TmaMaps maps;  // a[0], a[1]; maps.experts and maps.outputs are filled at launch
  CUtensorMap expert_prototype;
  const bf16* const* expert_pointers = nullptr;
  int experts = 0;
  CUtensorMap output_prototype;
  const void* const* output_pointers = nullptr;  // [outputs] bf16* or float*
  int outputs = 0;
  bool gradient_pairs = false;  // DSᵀD, DDS: tiles 2 y', 2 y' + 1 always of one expert (pairs allowed)
};

// The stages of every warp-specialized product (lesson 03, "Where the consumers wait": 3 -> 4
// stages saves up to 6%, 2 -> 3 25-35%).
constexpr int kWsStages = 4;

// set_persistent_worker_cap's cap (0: none), and set_stream_k_tail's switch.
int persistent_worker_cap = 0;
bool stream_k_tail = true;
bool weight_gradient_pairs = true;
bool block_row_pairs_everywhere = false;  // set_block_row_pairs_everywhere

// block_row_pairs_share_weights, unless an experiment takes pairs everywhere.
bool block_row_pairs_taken(int max_block_rows, int experts) {
  return block_row_pairs_everywhere || block_row_pairs_share_weights(max_block_rows, experts);
}
int capped_workers(int workers) {
  return persistent_worker_cap > 0 ? std::min(workers, persistent_worker_cap) : workers;
}

// The stream-K tail's scratch (WsStreamKScratch) for `workers` workers of `ctas` CTAs, from the
// launch-scratch pool, its counts zeroed on the stream; none (no tail) when set_stream_k_tail(false).
// Give it back with free_launch_scratch (partials) on the same stream after the launch. Two parts
// of 16 KB a consumer warp: 33 MB for 132 CTAs, of which a launch touches what its tail cuts.
WsStreamKScratch allocate_stream_k(int workers, int ctas, cudaStream_t stream) {
  if (!stream_k_tail) return {};
  const size_t places = static_cast<size_t>(workers) * ctas * 8;  // consumer warps
  const size_t partial_bytes = 2 * places * kWsPartialFloats * sizeof(float), count_bytes = places * 2 * sizeof(int);
  auto* memory = static_cast<unsigned char*>(allocate_launch_scratch(partial_bytes + count_bytes, stream));
  WsStreamKScratch scratch;
  scratch.partials = reinterpret_cast<float*>(memory);
  scratch.counts = reinterpret_cast<int*>(memory + partial_bytes);
  CUDA_CHECK(cudaMemsetAsync(scratch.counts, 0, count_bytes, stream));
  return scratch;
}

// The SDD or DSD in clusters of two CTAs whose pairs of block rows share the expert's B chunk
// (WsCluster::share_b): as many clusters as can be resident at once, over the block rows rounded
// up to even. The DSD ends in a stream-K tail (tile_schedule.h says where it pays and where not).
template <class Problem>
void launch_ws_pairs(const Problem& problem, const TmaMaps& maps, int tiles_x, int y_count, int group_rows,
                     bool half_rows, int multiprocessors, cudaStream_t stream) {
  constexpr int kEpilogueColumns = WsBulkStore<Problem> ? kWsBulkEpilogue : kWsRegisterEpilogue;
  constexpr int smem = ws_shared_bytes<kWsStages, kEpilogueColumns, true>();
  auto* kernel = &block_sparse_wgmma_ws_kernel<kWsStages, kEpilogueColumns, true, true, Problem, WsCluster::share_b>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int pair_tiles = tiles_x * ((y_count + 1) / 2);
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kWsThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // Clusters that fit on the GPU at once (the GPCs decide, not only the SM count: an H200 holds 66
  // of these pairs, but only 30 clusters of four), asked once per kernel: every GPU of a process is
  // taken to be of one kind.
  static const int resident = [&] {
    int clusters = 0;
    config.gridDim = dim3(2 * (multiprocessors / 2));
    CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
    return clusters > 0 ? clusters : multiprocessors / 2;
  }();
  const int clusters = capped_workers(std::min(resident, pair_tiles));
  config.gridDim = dim3(2 * clusters);
  WsStreamKScratch stream_k;  // the DSD (its tiles all take the same k-steps) ends in a stream-K tail
  if constexpr (WsStreamK<Problem>) stream_k = allocate_stream_k(clusters, 2, stream);
  // The tile order groups block rows as the single-CTA order does: group_rows block rows are
  // group_rows / 2 pairs.
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, problem, maps, tiles_x, tiles_x * y_count, std::max(1, group_rows / 2),
                                half_rows, stream_k));
  if (stream_k.partials != nullptr) free_launch_scratch(stream_k.partials, stream);
}

// The warp-specialized persistent kernel (cuda/dev/sdd.cu, versions 16, 18 and 19): 128 x 256 tiles, a
// producer warpgroup 4 stages ahead of 2 wgmma warpgroups, one CTA per SM walking the tiles, so one
// tile's epilogue overlaps the next tile's loads. The tile count is the host bound; CTAs skip the
// tiles past the device's counts. With `tma`, the producer copies with TMA; the per-expert maps live
// in a stream-ordered allocation for the length of the launch.
// The epilogue: the register epilogue (version 19) for the SDD and DSD, whose long tiles hide it;
// the bulk-copy epilogue for the weight gradients (WsBulkStore: a plain output matrix), whose short
// tiles wait on their stores, its 32 KB staging beside the same 4 stages.
template <class Problem>
void launch_wgmma_ws(const Problem& problem, int x_extent, int y_count, cudaStream_t stream,
                     const TmaOperands* tma = nullptr) {
  constexpr bool bulk = WsBulkStore<Problem>;
  constexpr int kEpilogueColumns = bulk ? kWsBulkEpilogue : kWsRegisterEpilogue;
  constexpr int smem = ws_shared_bytes<kWsStages, kEpilogueColumns, true>();
  int device = 0, multiprocessors = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const int tiles_x = x_extent / ws_tile_x<Problem>(), tiles = tiles_x * y_count;
  const int grid = capped_workers(std::min(multiprocessors, tiles)), group_rows = ws_group_rows(tiles_x, multiprocessors);
  if (tma == nullptr) {
    auto* kernel = &block_sparse_wgmma_ws_kernel<kWsStages, kEpilogueColumns, true, false, Problem>;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, kWsThreads, smem, stream>>>(problem, TmaMaps{}, tiles_x, tiles, group_rows, false,
                                               WsStreamKScratch{});
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  if constexpr (WsTmaCopies<Problem>) {
    const bool half_rows = WsHalfRowTiles<Problem>;  // the SDD's (block_sparse_wgmma_ws.cuh)
    TmaMaps maps = tma->maps;
    // One allocation for the per-expert maps: the expert operand's (SDD, DSD), then the output's
    // (DSᵀD, DDS); each product has one of the two.
    const int map_count = tma->experts + tma->outputs;
    CUtensorMap* expert_maps = map_count > 0 ? allocate_expert_maps(map_count, stream) : nullptr;
    if (tma->experts > 0) {
      build_expert_maps(tma->expert_prototype, tma->expert_pointers, tma->experts, expert_maps, stream);
      maps.experts = expert_maps;
    }
    if (tma->outputs > 0) {
      build_expert_maps(tma->output_prototype, tma->output_pointers, tma->outputs, expert_maps + tma->experts, stream);
      maps.outputs = expert_maps + tma->experts;
    }
    bool launched = false;
    if constexpr (WsSharedB<Problem>) {
      const bool pairs = WsBulkStore<Problem> ? tma->gradient_pairs && weight_gradient_pairs
                                              : block_row_pairs_taken(y_count, tma->experts);
      if (pairs) {
        launch_ws_pairs(problem, maps, tiles_x, y_count, group_rows, half_rows, multiprocessors, stream);
        launched = true;
      }
    }
    if (!launched) {
      auto* kernel = &block_sparse_wgmma_ws_kernel<kWsStages, kEpilogueColumns, true, true, Problem>;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      kernel<<<grid, kWsThreads, smem, stream>>>(problem, maps, tiles_x, tiles, group_rows, half_rows,
                                                 WsStreamKScratch{});
      CUDA_CHECK(cudaGetLastError());
    }
    if (expert_maps != nullptr) free_expert_maps(expert_maps, stream);
  } else {
    throw std::logic_error("moe::cuda: TMA copies asked for a product that has none");
  }
}

// Whether `launch` takes the warp-specialized kernel: Hopper, B = 128, 256-wide tiles over the dense
// extent (the products tiled over N).
bool takes_warp_specialized(int block_size, int dense_extent) {
  return block_size == 128 && dense_extent % kWsBlockN == 0 && wgmma_available();
}

// A tile BLOCK wide along the blocks and DENSE along the dense extent: BM x BN = BLOCK x DENSE for
// the products tiled by block rows / block columns, DENSE x BLOCK for DDS, whose tiles run down the
// dense rows.
template <int BLOCK, int DENSE, class Problem>
void launch_block_by_dense(const Problem& problem, int dense_extent, int y_count, cudaStream_t stream) {
  if constexpr (Problem::grid_x_over_m)
    launch_shape<DENSE, BLOCK>(problem, dense_extent, y_count, stream);
  else
    launch_shape<BLOCK, DENSE>(problem, dense_extent, y_count, stream);
}

// The tile is B along the blocks by 128 along the dense extent (64 when the extent is not a
// multiple of 128).
template <class Problem>
void launch(const Problem& problem, int block_size, int dense_extent, int y_count, cudaStream_t stream,
            const TmaOperands* tma = nullptr) {
  if (y_count == 0) return;
  // Every product at B = 128 on Hopper, the epilogue staged through shared memory (16-byte stores,
  // the activation compiled once). Measured on an H200 (cuda/dev/sdd.cu, versions 12-14):
  //   - SDD: 128 x 128 tiles, 3 stages, 2 CTAs per SM (version 12): K = D is short (16-32 k-steps),
  //     so overlapping one CTA's pipeline fill and epilogue with the other's wgmma pays more than
  //     the 128 x 256 tile's lighter L2 traffic (366-390 TFLOP/s against 321-338);
  //   - DSD: K = H is long (64-128 k-steps): 128 x 256 tiles, 4 stages, 1 CTA per SM, one wgmma
  //     group in flight (version 14 on the DSD: 308-381 TFLOP/s against 309-340);
  //   - DSᵀD and DDS (the weight gradients, A read M-major): the SDD's configuration, not measured
  //     on its own. DDS's tiles run over M, so its dense extent (D) must be a multiple of 128 rows.
  const bool wgmma = block_size == 128 && dense_extent % 128 == 0 && wgmma_available();
  // The warp-specialized persistent kernel beats them: it takes the SDD from 368 to 399 TFLOP/s
  // (cuda/dev/sdd.cu, version 12 -> 16, H200, 2026-11-22, T=16384 D=1024 H=4096 E=64 K=1).
  // Every product tiled over N (SDD, DSD, DSᵀD) takes it where the dense extent allows 256-wide
  // tiles; DDS takes it in launch_dds (two block columns a tile); other extents keep the kernels
  // below.
  if constexpr (!Problem::grid_x_over_m) {
    if (wgmma && dense_extent % kWsBlockN == 0) {
      launch_wgmma_ws(problem, dense_extent, y_count, stream, tma);
      return;
    }
  }
  if constexpr (Problem::wgmma_wide_tile) {
    if (wgmma && dense_extent % 256 == 0) {
      launch_wgmma_shape<256, 4, 1, 1, true>(problem, dense_extent, y_count, stream);
      return;
    }
  }
  if (wgmma) {
    launch_wgmma_shape<128, 3, 2, 0, true>(problem, dense_extent, y_count, stream);
    return;
  }
  const bool wide = dense_extent % 128 == 0;
  if (block_size == 128)
    wide ? launch_block_by_dense<128, 128>(problem, dense_extent, y_count, stream)
         : launch_block_by_dense<128, 64>(problem, dense_extent, y_count, stream);
  else
    wide ? launch_block_by_dense<64, 128>(problem, dense_extent, y_count, stream)
         : launch_block_by_dense<64, 64>(problem, dense_extent, y_count, stream);
}

// ---- the products, with their epilogues (checked by the callers) ----
struct SddArguments {
  const bf16* a;
  int inner;
  ExpertOperand b;
  RowGather gather;  // set: `a` is x in token order, its rows gathered (forward only)
  SddEpilogue epilogue = SddEpilogue::store;
  const bf16* in0 = nullptr;
  const bf16* in1 = nullptr;
  bf16* out0 = nullptr;
  bf16* out1 = nullptr;
};

void launch_sdd(const DeviceTopology& t, const SddArguments& args, cudaStream_t stream) {
  const int hidden = t.blocks_per_expert * t.block_size;  // H
  auto fill = [&](auto empty) {
    auto problem = with_expert_operand(with_topology(empty, t), args.b);
    problem.a = args.a;
    problem.inner = args.inner;
    problem.gather = args.gather;
    problem.in0 = args.in0;
    problem.in1 = args.in1;
    problem.out0 = args.out0;
    problem.out1 = args.out1;
    return problem;
  };
  // One kernel per (layout, epilogue) pair that the products use: W stored [k][n] in the forward,
  // read transposed ([n][k]) in the backward.
  constexpr Layout km = Layout::row_major_km, nk = Layout::row_major_nk;
  // TMA on the warp-specialized kernel: rows of `a` in boxes of 64 x 64; W_e in [64 k][64 n] boxes
  // when stored [k][n], two [128 n][64 k] boxes when read transposed (a half each: WsPairHalves).
  TmaOperands tma;
  const bool use_tma = takes_warp_specialized(t.block_size, hidden);
  const bool gathered = args.gather.row_slot != nullptr;
  if (gathered && !use_tma) throw std::logic_error("moe::cuda: gathered SDD rows without the warp-specialized kernel");
  if (use_tma) {
    const int64_t rows = static_cast<int64_t>(t.max_block_rows) * t.block_size;
    if (!gathered) tma.maps.a[0] = make_matrix_map(args.a, rows, args.inner, args.inner, 64);  // else cp.async
    tma.maps.a[1] = tma.maps.a[0];
    tma.expert_prototype = args.b.transposed
                               ? make_matrix_map(args.a, args.b.column_offset + hidden, args.b.ld, args.b.ld, 128)
                               : make_matrix_map(args.a, args.inner, args.b.ld, args.b.ld, 64);
    tma.expert_pointers = args.b.pointers;
    tma.experts = t.block_cols / t.blocks_per_expert;
  }
  auto go = [&](auto problem) {
    launch(fill(problem), t.block_size, hidden, t.max_block_rows, stream, use_tma ? &tma : nullptr);
  };
  if (!args.b.transposed) {
    switch (args.epilogue) {
      case SddEpilogue::store: go(SddProblem<km, SddEpilogue::store>{}); return;
      case SddEpilogue::gelu: go(SddProblem<km, SddEpilogue::gelu>{}); return;
      case SddEpilogue::swiglu: go(SddProblem<km, SddEpilogue::swiglu>{}); return;
      default: break;
    }
  } else {
    switch (args.epilogue) {
      case SddEpilogue::store: go(SddProblem<nk, SddEpilogue::store>{}); return;
      case SddEpilogue::gelu_backward: go(SddProblem<nk, SddEpilogue::gelu_backward>{}); return;
      case SddEpilogue::swiglu_backward: go(SddProblem<nk, SddEpilogue::swiglu_backward>{}); return;
      default: break;
    }
  }
  throw std::logic_error("moe::cuda: no SDD kernel for this epilogue and layout of W");
}

void launch_dsd(const DeviceTopology& t, const bf16* s0, const bf16* s1, const ExpertOperand& b,
                int out_cols, bf16* out, cudaStream_t stream) {
  auto fill = [&](auto empty) {
    auto problem = with_expert_operand(with_topology(empty, t), b);
    problem.s0 = s0;
    problem.s1 = s1;
    problem.parts = s1 != nullptr ? 2 : 1;
    problem.out = out;
    problem.ldo = out_cols;
    return problem;
  };
  // TMA on the warp-specialized kernel: the blocks in boxes of 64 x 64 of one block; W_e as in the SDD.
  TmaOperands tma;
  const bool use_tma = takes_warp_specialized(t.block_size, out_cols);
  if (use_tma) {
    const int parts = s1 != nullptr ? 2 : 1, hidden = t.blocks_per_expert * t.block_size;
    tma.maps.a[0] = make_blocks_map(s0, t.max_nnz, t.block_size, 64);
    tma.maps.a[1] = s1 != nullptr ? make_blocks_map(s1, t.max_nnz, t.block_size, 64) : tma.maps.a[0];
    tma.expert_prototype = b.transposed ? make_matrix_map(s0, b.column_offset + out_cols, b.ld, b.ld, 128)
                                        : make_matrix_map(s0, int64_t(parts) * hidden, b.ld, b.ld, 64);
    tma.expert_pointers = b.pointers;
    tma.experts = t.block_cols / t.blocks_per_expert;
  }
  const TmaOperands* tma_or_null = use_tma ? &tma : nullptr;
  if (b.transposed)
    launch(fill(DsdProblem<Layout::row_major_nk>{}), t.block_size, out_cols, t.max_block_rows, stream, tma_or_null);
  else
    launch(fill(DsdProblem<Layout::row_major_km>{}), t.block_size, out_cols, t.max_block_rows, stream, tma_or_null);
}

// The weight gradients' output maps (ws_bulk_epilogue's TMA stores): every expert's [rows, ldo]
// matrix of OUT as its 128-byte column groups, in boxes of 16 rows x kWsBulkGroups groups. The
// prototype's own address is any aligned one (`aligned`); the launch swaps in each expert's. A map
// needs rows that start 16 bytes apart, and the tiles must start on a group (their first column is
// column_offset plus a multiple of 128): otherwise there are no maps, and the kernel stores from
// registers.
template <typename OUT>
void set_output_maps(TmaOperands& tma, OUT* const* out, int64_t rows, int ldo, int column_offset, int experts,
                     const void* aligned) {
  constexpr int group = 128 / sizeof(OUT);
  if ((static_cast<size_t>(ldo) * sizeof(OUT)) % 16 != 0 || column_offset % group != 0) return;
  tma.output_prototype = make_column_groups_map(static_cast<const OUT*>(aligned), rows, ldo, ldo, 16, kWsBulkGroups);
  tma.output_pointers = reinterpret_cast<const void* const*>(out);
  tma.outputs = experts;
}

// Whether a weight gradient's tiles (columns_per_tile block columns each) run in pairs: where every
// pair falls in one expert, by the block-row pairs' rule (block_sparse.h).
bool gradient_pairs_taken(const DeviceTopology& t, int columns_per_tile) {
  return weight_gradient_pairs_fit(t.blocks_per_expert, columns_per_tile) &&
         block_row_pairs_taken(t.max_block_rows, t.block_cols / t.blocks_per_expert);
}

// A weight-gradient problem (DSᵀD, DDS): the column walk, the blocks `s`, the dense operand with
// its row stride ldd, and the experts' outputs with theirs.
template <class Problem, typename OUT>
Problem weight_gradient_problem(Problem empty, const DeviceTopology& t, const bf16* s, const bf16* dense, int ldd,
                                OUT* const* out, int ldo) {
  Problem problem = with_topology(empty, t);
  problem.s = s;
  problem.dense = dense;
  problem.ldd = ldd;
  problem.out = out;
  problem.ldo = ldo;
  return problem;
}

template <typename OUT>
void launch_dsd_transposed(const DeviceTopology& t, const bf16* s, const bf16* dense, int cols,
                           OUT* const* out, int ldo, cudaStream_t stream) {
  const auto problem = weight_gradient_problem(DsdTransposedProblem<OUT>{}, t, s, dense, cols, out, ldo);
  // TMA on the warp-specialized kernel: the blocks in [64 k][64 m] boxes, the rows of `dense` in
  // [64 k][64 n] boxes; no expert operand (the output is per expert, the inputs are not).
  TmaOperands tma;
  const bool use_tma = takes_warp_specialized(t.block_size, cols);
  if (use_tma) {
    tma.maps.a[0] = make_blocks_map(s, t.max_nnz, t.block_size, 64);
    tma.maps.a[1] = make_matrix_map(dense, static_cast<int64_t>(t.max_block_rows) * t.block_size, cols, cols, 64);
    set_output_maps(tma, out, int64_t{t.blocks_per_expert} * t.block_size, ldo, 0, t.block_cols / t.blocks_per_expert,
                    dense);
    tma.gradient_pairs = gradient_pairs_taken(t, 1);
  }
  launch(problem, t.block_size, cols, t.block_cols, stream, use_tma ? &tma : nullptr);
}

template <typename OUT>
void launch_dds(const DeviceTopology& t, const bf16* dense, int cols, const bf16* s, OUT* const* out,
                int ldo, int column_offset, cudaStream_t stream) {
  auto fill = [&](auto empty) {
    auto problem = weight_gradient_problem(empty, t, s, dense, cols, out, ldo);
    problem.column_offset = column_offset;
    return problem;
  };
  // On Hopper at B = 128, the warp-specialized kernel takes two block columns of one expert a tile
  // (128 rows of D by 256 columns of H; H / B must be even so that pairs never straddle experts).
  // Why (ncu, H200, 2026-11-22): DDS on the 128 x 128 wgmma kernel below measured 0.68 ms at
  // T=16384 D=1024 H=4096 E=64 K=1 and 4.60 ms at T=8192 D=4096 H=14336 E=8 K=2, against 0.57 and
  // 3.63 ms for DSᵀD on the warp-specialized kernel (the same FLOPs).
  if (t.block_size == 128 && cols % kWgmmaBlockM == 0 && t.blocks_per_expert % 2 == 0 && wgmma_available()) {
    TmaOperands tma;  // the rows of `dense` in [64 k][64 m] boxes, the blocks in [64 k][64 n] boxes
    tma.maps.a[0] = make_matrix_map(dense, static_cast<int64_t>(t.max_block_rows) * t.block_size, cols, cols, 64);
    tma.maps.a[1] = make_blocks_map(s, t.max_nnz, t.block_size, 64);
    set_output_maps(tma, out, cols, ldo, column_offset, t.block_cols / t.blocks_per_expert, dense);
    tma.gradient_pairs = gradient_pairs_taken(t, 2);
    launch_wgmma_ws(fill(DdsProblem<OUT, 2>{}), cols, t.block_cols / 2, stream, &tma);
    return;
  }
  launch(fill(DdsProblem<OUT, 1>{}), t.block_size, cols, t.block_cols, stream);
}

// The FFN's shape checks: D and H multiples of B, and the topology built for this H.
void require_ffn(const MoeConfig& config, const DeviceTopology& t, const std::string& function) {
  require_topology(t, function, /*rows=*/true, /*columns=*/true);
  require_multiple(config.model_dim, t.block_size, function, "D (model_dim)");
  require_multiple(config.hidden_dim, t.block_size, function, "H (hidden_dim)");
  std::ostringstream text;
  text << "topology.blocks_per_expert = " << t.blocks_per_expert << " but H / B = "
       << config.hidden_dim / t.block_size;
  require(config.hidden_dim == static_cast<int64_t>(t.blocks_per_expert) * t.block_size, function, text.str());
  require(config.num_experts > 0 && t.block_cols == config.num_experts * t.blocks_per_expert, function,
          "topology.block_cols must be E * H / B");
}

// The experts' input rows: a permuted copy, or gathered where the kernels can (rows_gatherable).
RowGather checked_rows(const MoeConfig& config, const ExpertRows& x, const std::string& function) {
  require_pointer(x.data, function, "x.data (the experts' input rows)");
  if (x.row_slot == nullptr) return {};
  require(rows_gatherable(config), function,
          "gathered input rows (ExpertRows::gathered) need the warp-specialized Hopper kernel: a compute "
          "capability 9.0 GPU with an sm_90a build, B = 128 and H a multiple of 256; elsewhere permute the "
          "rows first (permute_tokens) and pass the permuted copy");
  require(x.top_k >= 1 && x.top_k == config.top_k, function, "x.top_k must be the config's K");
  require(x.tokens == config.tokens && int64_t{x.tokens} * config.model_dim < (int64_t{1} << 31), function,
          "x.tokens must be the config's T, and T * D below 2^31 (the gather's 32-bit offsets into x)");
  return RowGather{x.row_slot, x.top_k};
}

}  // namespace

// Pairs of block rows (WsCluster::share_b) where an expert has 4 or more block rows by the host
// bound (T·K/B + E). Measured on an H200, 2026-11-22, against the same code without clusters in the
// same run (notebooks_data/bench/ncu_block_row_pairs_h200_2026-11-22.txt; x dense cuBLAS, forward | forward +
// backward, two runs):
//   - T=8192 D=4096 E=8 K=2 (17 block rows an expert), Zipf: 0.912 | 0.912 -> 0.958 | 0.941 and
//     0.922 | 0.911 -> 0.969 | 0.956; uniform: 0.973 | 0.969 -> 0.983 | 0.958 and 0.987 | 0.961 ->
//     0.983 | 0.967 (a draw).
//   - T=16384 D=2048 E=64 K=2 (5): uniform 0.930 | 0.881 -> 0.958 | 0.888 and 0.926 | 0.859 ->
//     0.952 | 0.885; Zipf 0.852 | 0.820 -> 0.858 | 0.846 and 0.848 | 0.806 -> 0.847 | 0.822.
//   At locked base clocks (ncu) the same kernels ran as fast as without clusters, within 3%: the
//   multicast saves L2 reads, and power with them, so at the card's power limit the clock stays up.
//   - T=16384 D=1024 E=64 K=1 (3): slower at base clocks, the forward's SDD by 9% and its DSD by 2%
//     under Zipf (2% and 1% uniform). Each expert's weights are read by one or two block rows, so
//     they stream from HBM about once per pair anyway, many pairs straddle two experts (no sharing),
//     and the pairing only makes the two CTAs wait for each other.
// The weight gradients follow the same rule (ncu at locked base clocks, H200, 2026-11-22,
// notebooks_data/bench/ncu_weight_gradient_pairs_h200_2026-11-22.txt): their pairs of block columns
// share dy's rows (DSᵀD) or x's (DDS), and a tile runs as many k-steps as its expert has block rows.
// DSᵀD | DDS without pairs -> in pairs: D=4096 uniform 3.003 | 3.022 -> 2.911 | 2.955 ms (DSᵀD's L2
// traffic 22.3 -> 17.0 GB); D=2048 Zipf 2.211 | 2.258 -> 2.154 | 2.214; D=1024 Zipf 0.358 | 0.363 ->
// 0.355 | 0.368 and uniform 0.340 | 0.346 -> 0.342 | 0.355 (2 block rows an expert: no pairs there).
bool block_row_pairs_share_weights(int max_block_rows, int experts) {
  return experts > 0 && max_block_rows >= 4 * experts;
}

void set_persistent_worker_cap(int workers) {
  if (workers < 0) throw std::invalid_argument("set_persistent_worker_cap: workers must be >= 0 (0: no cap)");
  persistent_worker_cap = workers;
}

void set_stream_k_tail(bool enabled) { stream_k_tail = enabled; }

void set_weight_gradient_pairs(bool enabled) { weight_gradient_pairs = enabled; }

void set_block_row_pairs_everywhere(bool enabled) { block_row_pairs_everywhere = enabled; }

bool weight_gradient_pairs_fit(int blocks_per_expert, int columns_per_tile) {
  return blocks_per_expert > 0 && blocks_per_expert % (2 * columns_per_tile) == 0;
}

bool rows_gatherable(const MoeConfig& config) {
  return takes_warp_specialized(static_cast<int>(config.block_size), static_cast<int>(config.hidden_dim));
}

bool gathering_pays(const MoeConfig& config) {
  return config.hidden_dim <= kGatherMaxHidden && rows_gatherable(config);
}

// ---- public products ----
void sdd(const DeviceTopology& topology, const bf16* a, int inner, const ExpertOperand& b,
         bf16* out_blocks, cudaStream_t stream) {
  const std::string f = "moe::cuda::sdd";
  require_walk(topology, f, /*rows=*/true, inner, "inner");
  require_pointers(f, {{"a", a}, {"out_blocks", out_blocks}});
  require_operand(b, f);
  SddArguments args{a, inner, b};
  args.out0 = out_blocks;
  launch_sdd(topology, args, stream);
}

void dsd(const DeviceTopology& topology, const bf16* s_blocks, const ExpertOperand& b, int out_cols,
         bf16* out, cudaStream_t stream) {
  const std::string f = "moe::cuda::dsd";
  require_walk(topology, f, /*rows=*/true, out_cols, "out_cols");
  require_pointers(f, {{"s_blocks", s_blocks}, {"out", out}});
  require_operand(b, f);
  launch_dsd(topology, s_blocks, nullptr, b, out_cols, out, stream);
}

namespace {
template <typename OUT>
void checked_dsd_transposed(const DeviceTopology& topology, const bf16* s_blocks, const bf16* dense, int cols,
                            OUT* const* out, int ldo, cudaStream_t stream) {
  const std::string f = "moe::cuda::dsd_transposed";
  require_walk(topology, f, /*rows=*/false, cols, "cols");
  require(ldo >= cols && ldo % 2 == 0, f, "ldo must be >= cols and even");
  require_pointers(f, {{"s_blocks", s_blocks}, {"dense", dense}, {"out", out}});
  launch_dsd_transposed(topology, s_blocks, dense, cols, out, ldo, stream);
}

template <typename OUT>
void checked_dds(const DeviceTopology& topology, const bf16* dense, int cols, const bf16* s_blocks,
                 OUT* const* out, int ldo, int column_offset, cudaStream_t stream) {
  const std::string f = "moe::cuda::dds";
  require_walk(topology, f, /*rows=*/false, cols, "cols");
  const int hidden = topology.blocks_per_expert * topology.block_size;
  require(column_offset >= 0 && column_offset % 2 == 0 && ldo >= column_offset + hidden, f,
          "need ldo >= column_offset + H and an even column_offset");
  require_pointers(f, {{"dense", dense}, {"s_blocks", s_blocks}, {"out", out}});
  launch_dds(topology, dense, cols, s_blocks, out, ldo, column_offset, stream);
}
}  // namespace

void dsd_transposed(const DeviceTopology& topology, const bf16* s_blocks, const bf16* dense, int cols,
                    float* const* out, int ldo, cudaStream_t stream) {
  checked_dsd_transposed(topology, s_blocks, dense, cols, out, ldo, stream);
}
void dsd_transposed(const DeviceTopology& topology, const bf16* s_blocks, const bf16* dense, int cols,
                    bf16* const* out, int ldo, cudaStream_t stream) {
  checked_dsd_transposed(topology, s_blocks, dense, cols, out, ldo, stream);
}
void dds(const DeviceTopology& topology, const bf16* dense, int cols, const bf16* s_blocks,
         float* const* out, int ldo, int column_offset, cudaStream_t stream) {
  checked_dds(topology, dense, cols, s_blocks, out, ldo, column_offset, stream);
}
void dds(const DeviceTopology& topology, const bf16* dense, int cols, const bf16* s_blocks,
         bf16* const* out, int ldo, int column_offset, cudaStream_t stream) {
  checked_dds(topology, dense, cols, s_blocks, out, ldo, column_offset, stream);
}

// ---- the dropless expert FFN ----
void block_sparse_ffn_forward(const MoeConfig& config, const DeviceTopology& topology, const ExpertRows& x,
                              const bf16* const* w1, const bf16* const* w2, const BlockSparseFfnOutputs& outputs,
                              cudaStream_t stream) {
  const std::string f = "moe::cuda::block_sparse_ffn_forward";
  require_ffn(config, topology, f);
  const bool swiglu = config.activation == Activation::swiglu;
  const RowGather gather = checked_rows(config, x, f);
  require_pointer(w1, f, "w1");
  require_pointer(w2, f, "w2");
  require_pointer(outputs.pre_activation, f, "outputs.pre_activation");
  require_pointer(outputs.hidden, f, "outputs.hidden");
  require_pointer(outputs.out, f, "outputs.out");
  if (swiglu) require_pointer(outputs.up_projection, f, "outputs.up_projection (SwiGLU)");
  const int D = static_cast<int>(config.model_dim), H = static_cast<int>(config.hidden_dim);
  const int w1_cols = swiglu ? 2 * H : H;

  SddArguments first{x.data, D, ExpertOperand{w1, w1_cols, 0, false}, gather};
  first.out0 = outputs.pre_activation;
  if (swiglu) {
    launch_sdd(topology, first, stream);  // the gate blocks
    SddArguments up{x.data, D, ExpertOperand{w1, w1_cols, H, false}, gather};
    up.epilogue = SddEpilogue::swiglu;
    up.in0 = outputs.pre_activation;
    up.out0 = outputs.up_projection;
    up.out1 = outputs.hidden;
    launch_sdd(topology, up, stream);
  } else {
    first.epilogue = SddEpilogue::gelu;
    first.out1 = outputs.hidden;
    launch_sdd(topology, first, stream);
  }
  launch_dsd(topology, outputs.hidden, nullptr, ExpertOperand{w2, D, 0, false}, D, outputs.out, stream);
}

void block_sparse_ffn_backward(const MoeConfig& config, const DeviceTopology& topology,
                               const bf16* permuted_x, const bf16* const* w1, const bf16* const* w2,
                               const BlockSparseFfnOutputs& forward, const bf16* d_out,
                               const BlockSparseFfnGradients& gradients, cudaStream_t stream) {
  const std::string f = "moe::cuda::block_sparse_ffn_backward";
  require_ffn(config, topology, f);
  const bool swiglu = config.activation == Activation::swiglu;
  require_pointer(permuted_x, f, "permuted_x");
  require_pointer(w1, f, "w1");
  require_pointer(w2, f, "w2");
  require_pointer(d_out, f, "d_out");
  require_pointer(forward.pre_activation, f, "forward.pre_activation");
  require_pointer(forward.hidden, f, "forward.hidden");
  require_pointer(gradients.d_pre_activation, f, "gradients.d_pre_activation");
  require_pointer(gradients.d_permuted_x, f, "gradients.d_permuted_x");
  const bool fp32_gradients = gradients.d_w1 != nullptr || gradients.d_w2 != nullptr;
  const bool bf16_gradients = gradients.d_w1_bf16 != nullptr || gradients.d_w2_bf16 != nullptr;
  require(!(fp32_gradients && bf16_gradients), f,
          "set the weight gradients' fp32 tables (d_w1, d_w2) or their bf16 tables (d_w1_bf16, d_w2_bf16), "
          "not both (or neither, to leave them to one product over all micro-batches)");
  if (fp32_gradients) {
    require_pointer(gradients.d_w1, f, "gradients.d_w1");
    require_pointer(gradients.d_w2, f, "gradients.d_w2");
  } else if (bf16_gradients) {
    require_pointer(gradients.d_w1_bf16, f, "gradients.d_w1_bf16");
    require_pointer(gradients.d_w2_bf16, f, "gradients.d_w2_bf16");
  }
  if (swiglu) {
    require_pointer(forward.up_projection, f, "forward.up_projection (SwiGLU)");
    require_pointer(gradients.d_up_projection, f, "gradients.d_up_projection (SwiGLU)");
  }
  const int D = static_cast<int>(config.model_dim), H = static_cast<int>(config.hidden_dim);
  const int w1_cols = swiglu ? 2 * H : H;

  // d_hidden = d_out W2_eᵀ at the topology's blocks, times act'(pre) in the epilogue.
  SddArguments d_hidden{d_out, D, ExpertOperand{w2, D, 0, true}};
  d_hidden.in0 = forward.pre_activation;
  d_hidden.out0 = gradients.d_pre_activation;
  if (swiglu) {
    d_hidden.epilogue = SddEpilogue::swiglu_backward;
    d_hidden.in1 = forward.up_projection;
    d_hidden.out1 = gradients.d_up_projection;
  } else {
    d_hidden.epilogue = SddEpilogue::gelu_backward;
  }
  launch_sdd(topology, d_hidden, stream);

  // dW2_e = hidden_eᵀ d_out_e, walking block columns through the transpose indices;
  // dW1_e = permuted_x_eᵀ d_pre_e (and the up half for SwiGLU).
  auto weight_gradients = [&](auto* const* d_w1, auto* const* d_w2) {
    launch_dsd_transposed(topology, forward.hidden, d_out, D, d_w2, D, stream);
    launch_dds(topology, permuted_x, D, gradients.d_pre_activation, d_w1, w1_cols, 0, stream);
    if (swiglu) launch_dds(topology, permuted_x, D, gradients.d_up_projection, d_w1, w1_cols, H, stream);
  };
  if (fp32_gradients)
    weight_gradients(gradients.d_w1, gradients.d_w2);
  else if (bf16_gradients)
    weight_gradients(gradients.d_w1_bf16, gradients.d_w2_bf16);
  // d_permuted_x = [d_pre | d_up] W1_eᵀ: one DSD whose K runs over all w1_columns.
  launch_dsd(topology, gradients.d_pre_activation, swiglu ? gradients.d_up_projection : nullptr,
             ExpertOperand{w1, w1_cols, 0, true}, D, gradients.d_permuted_x, stream);
}

}  // namespace moe::cuda
