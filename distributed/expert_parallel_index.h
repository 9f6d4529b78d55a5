// expert_parallel_index.h: the two index rules of the expert-parallel layer's exchange, as plain
// functions the same on the host and the device: the GPU kernels (expert_parallel_kernels.cu) run
// them per row, and the CPU test of the plan (tests/distributed/test_expert_parallel_plan.cpp) runs
// them on CPU ranks against the single-device dispatch plan. The tables are ExchangePlan's
// (expert_parallel_plan.h), narrowed to int32.
//
// Dimension legend: E experts, E_r local experts, R ranks, d chunks.
#pragma once

#if defined(__CUDACC__)
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif

namespace moe::dist {

// As the tokens' rank: the send-buffer row of the j-th routed slot of expert e (in token order),
// or -1 when the capacity dropped it.
//   slot_chunk_begin [E, d + 1]  chunk c takes kept slots [begin[c], begin[c + 1]); begin[d] = kept
//   part_send_row    [E, d]      the send-buffer row of chunk c's first slot of e
MOE_EP_HOST_DEVICE inline int send_row_of(int j, int expert, const int* slot_chunk_begin, const int* part_send_row,
                                          int chunks) {
  const int* begin = slot_chunk_begin + expert * (chunks + 1);
  if (j >= begin[chunks]) return -1;
  int chunk = 0;
  while (j >= begin[chunk + 1]) ++chunk;
  return part_send_row[expert * chunks + chunk] + (j - begin[chunk]);
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

}  // namespace moe::dist
