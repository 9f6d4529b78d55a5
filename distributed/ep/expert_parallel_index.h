// expert_parallel_index.h: the index rules of the expert-parallel layer's exchange, as plain
// functions the same on the host and the device: the GPU kernels (expert_parallel_kernels.cu) run
// them per row, and the CPU test of the plan (tests/distributed/test_expert_parallel_plan.cpp) runs
// them on CPU ranks against the single-device dispatch plan. The tables are ExchangePlan's
// (expert_parallel_plan.h), narrowed to int32. Two more for Tutel's layouts r: where an element of
// the packed H-slices of the experts comes from, and where the r partial results of a row land.
//
// Dimension legend: E experts, E_r local experts, R ranks, d chunks, D model width, H hidden width,
// H_c = H / slices, P_c = 2 D H_c.
#pragma once

#include <cstddef>  // size_t

#if defined(__CUDACC__)
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif

namespace moe::dist {

// As the tokens' rank: the send-buffer row of the j-th routed slot of expert e (in token order),
// or -1 when the capacity dropped it. Expert e's kept slots fall into n segments (one a chunk, or
// one a replica and chunk under a placement with replicas):
//   segment_begin    [E, n + 1]  segment k takes kept slots [begin[k], begin[k + 1]); begin[n] = kept
//   segment_send_row [E, n]      the send-buffer row of segment k's first slot
MOE_EP_HOST_DEVICE inline int send_row_of(int j, int expert, const int* segment_begin, const int* segment_send_row,
                                          int segments) {
  const int* begin = segment_begin + expert * (segments + 1);
  if (j >= begin[segments]) return -1;
  int k = 0;
  while (j >= begin[k + 1]) ++k;
  return segment_send_row[expert * segments + k] + (j - begin[k]);
}

// As the experts' rank, in one chunk: the received row that feeds row `row` of the local experts'
// rows, or -1 for a padding row (and for rows past the last expert's).
//   row_offsets    [E_r + 1]     local expert j owns rows [row_offsets[j], row_offsets[j + 1])
//   arrived_before [E_r, R + 1]  j's received rows from the sources before s
//   block_start    [R, E_r]      where block (source s, local expert j) starts among the received rows
MOE_EP_HOST_DEVICE inline int received_row_of(int row, const int* row_offsets, const int* arrived_before,
                                              const int* block_start, int experts, int ranks) {
  if (row >= row_offsets[experts]) return -1;
  int lo = 0, hi = experts - 1;  // the last j with row_offsets[j] <= row: empty experts share offsets
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (row_offsets[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  const int j = lo, i = row - row_offsets[j];
  const int* before = arrived_before + j * (ranks + 1);
  if (i >= before[ranks]) return -1;  // past the rows that arrived: padding
  int source = 0;
  while (i >= before[source + 1]) ++source;
  return block_start[source * experts + j] + (i - before[source]);
}

// Element i of the packed experts [slices, E_r, P_c] (pack_expert_slices): slice s of stored expert
// j is W1's columns [s H_c, (s + 1) H_c) as [D, H_c], then W2's rows [s H_c, (s + 1) H_c) as [H_c, D].
struct SliceElement {
  int slice = 0, expert = 0;
  bool in_w1 = true;
  size_t offset = 0;  // into the stored expert's W1 [D, H] or W2 [H, D], row-major
};
MOE_EP_HOST_DEVICE inline SliceElement slice_element(size_t i, int experts, int model_dim, int hidden_dim,
                                                     int slices) {
  const size_t width = static_cast<size_t>(hidden_dim / slices);  // H_c
  const size_t w1_part = static_cast<size_t>(model_dim) * width, per_expert = 2 * w1_part;
  const size_t k = i % per_expert, block = i / per_expert;
  SliceElement at;
  at.slice = static_cast<int>(block / experts);
  at.expert = static_cast<int>(block % experts);
  at.in_w1 = k < w1_part;
  if (at.in_w1) {  // W1 [D, H]: row k / H_c, column s H_c + k % H_c
    at.offset = (k / width) * hidden_dim + at.slice * width + k % width;
  } else {  // W2 [H, D]: row s H_c + k' / D, column k' % D
    const size_t k2 = k - w1_part;
    at.offset = (at.slice * width + k2 / model_dim) * model_dim + k2 % model_dim;
  }
  return at;
}

// r > 1, the tokens' rank: the row of the returned partials that holds copy c (from rank g r + c)
// of kept row u, u in group g's block [group_begin[g], group_begin[g + 1]) of the send buffer. The r
// blocks of group g follow each other from r group_begin[g] (ExchangePlan::return_row_offsets).
MOE_EP_HOST_DEVICE inline size_t partial_row_of(int u, int copy, const int* group_begin, int groups, int copies) {
  int g = 0;  // groups = R / r: a few, a linear search
  while (g + 1 < groups && u >= group_begin[g + 1]) ++g;
  const size_t begin = static_cast<size_t>(group_begin[g]);
  const size_t width = static_cast<size_t>(group_begin[g + 1]) - begin;
  return static_cast<size_t>(copies) * begin + static_cast<size_t>(copy) * width + (static_cast<size_t>(u) - begin);
}

}  // namespace moe::dist
