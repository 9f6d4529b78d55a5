// expert_parallel_kernels.cu: the expert-parallel layer's own kernels (see expert_parallel_kernels.h).
// Each is a short index pass or a copy; none needs atomics, because every index map here is one to one.
#include "ep/expert_parallel_kernels.h"

#include <algorithm>
#include <cstring>

#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/elementwise.h"       // grid_stride_blocks, kElementwiseThreads
#include "ep/expert_parallel_index.h"  // send_row_of, received_row_of, slice_element, partial_row_of

namespace moe::dist {

namespace {

constexpr unsigned kThreads = cuda::kElementwiseThreads;  // a plain 1D launch: eight warps a block

// Grid-stride loops below (core/elementwise.h's rule).
unsigned blocks_for(int64_t threads) { return cuda::grid_stride_blocks(static_cast<size_t>(std::max<int64_t>(threads, 0))); }

__global__ void pack_routing_summary_kernel(const int* tokens_per_expert, const float* mean_probs,
                                            const float* z_loss, int local_tokens, int experts, int32_t* summary) {
  const bool any = local_tokens > 0;
  for (int i = threadIdx.x; i < 2 * experts + 2; i += blockDim.x) {
    int32_t word = 0;
    if (i == 0) {
      word = local_tokens;
    } else if (i <= experts) {
      word = any ? tokens_per_expert[i - 1] : 0;
    } else {
      const float value = !any ? 0.0f : i <= 2 * experts ? mean_probs[i - 1 - experts] : z_loss[0];
      word = __float_as_int(value);
    }
    summary[i] = word;
  }
}

__global__ void build_send_order_kernel(const int* top_experts, const int* routed_slots, const int* routed_offsets,
                                        const int* segment_begin, const int* segment_send_row, int slots,
                                        int segments, int* send_slot, int* slot_send_row) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < slots; i += gridDim.x * blockDim.x) {
    const int slot = routed_slots[i];
    const int expert = top_experts[slot];
    const int row = send_row_of(i - routed_offsets[expert], expert, segment_begin, segment_send_row, segments);
    slot_send_row[slot] = row;
    if (row >= 0) send_slot[row] = slot;
  }
}

__global__ void build_expert_rows_kernel(const int* row_offsets, const int* arrived_before, const int* block_start,
                                         int experts, int ranks, int rows, int* row_slot) {
  for (int row = blockIdx.x * blockDim.x + threadIdx.x; row < rows; row += gridDim.x * blockDim.x) {
    row_slot[row] = received_row_of(row, row_offsets, arrived_before, block_start, experts, ranks);
  }
}

// One warp per row; each lane moves 16 bytes (8 bf16) at a time when kWide, one bf16 otherwise.
template <bool kWide>
__global__ void scatter_rows_kernel(const int* row_slot, const bf16* rows, bf16* out, int count, int model_dim) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < count; row += warps) {
    const int target = row_slot[row];
    if (target < 0) continue;  // a padding row: it was made here and goes nowhere
    const bf16* from = rows + static_cast<size_t>(row) * model_dim;
    bf16* to = out + static_cast<size_t>(target) * model_dim;
    if constexpr (kWide) {
      const int4* from4 = reinterpret_cast<const int4*>(from);
      int4* to4 = reinterpret_cast<int4*>(to);
      for (int i = lane; i < model_dim / 8; i += 32) to4[i] = from4[i];
    } else {
      for (int i = lane; i < model_dim; i += 32) to[i] = from[i];
    }
  }
}

__global__ void zero_through_tables_kernel(float* const* to, int tables, size_t count) {
  const size_t total = static_cast<size_t>(tables) * count;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    to[i / count][i % count] = 0.0f;
  }
}

// One thread per element: packed[row[i]][k] <-> table[slot[i]][k].
template <bool kPack>
__global__ void through_table_kernel(float* const* table, const int* slot, const int* row, int n, size_t count,
                                     float* packed) {
  const size_t total = static_cast<size_t>(n) * count;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t j = i / count, k = i % count;
    float& in_table = table[slot[j]][k];
    float& in_packed = packed[static_cast<size_t>(row[j]) * count + k];
    if constexpr (kPack) {
      in_packed = in_table;
    } else {
      in_table = in_packed;
    }
  }
}

// One thread per element of the packed blocks (slice_element, expert_parallel_index.h).
__global__ void pack_expert_slices_kernel(const bf16* const* w1, const bf16* const* w2, int experts, int model_dim,
                                          int hidden_dim, int slices, bf16* packed) {
  const size_t total = static_cast<size_t>(experts) * 2 * model_dim * hidden_dim;  // slices x E_r x P_c
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const SliceElement at = slice_element(i, experts, model_dim, hidden_dim, slices);
    packed[i] = (at.in_w1 ? w1 : w2)[at.expert][at.offset];
  }
}

__global__ void unpack_expert_slices_kernel(const float* packed, float* const* d_w1, float* const* d_w2, int experts,
                                            int model_dim, int hidden_dim, int slices) {
  const size_t total = static_cast<size_t>(experts) * 2 * model_dim * hidden_dim;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const SliceElement at = slice_element(i, experts, model_dim, hidden_dim, slices);
    (at.in_w1 ? d_w1 : d_w2)[at.expert][at.offset] = packed[i];
  }
}

__global__ void sum_partial_rows_kernel(const bf16* partials, const int* group_begin, int groups, int copies,
                                        int rows, int model_dim, bf16* out) {
  const size_t total = static_cast<size_t>(rows) * model_dim;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const int u = static_cast<int>(i / model_dim), column = static_cast<int>(i % model_dim);
    float sum = 0.0f;
    for (int c = 0; c < copies; ++c) {
      sum += __bfloat162float(partials[partial_row_of(u, c, group_begin, groups, copies) * model_dim + column]);
    }
    out[i] = __float2bfloat16(sum);
  }
}

template <typename T>
__global__ void assemble_pointer_table_kernel(T* const* stored, const int* source, T* copies, size_t stride, int n,
                                              T** out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int s = source[i];
    out[i] = s >= 0 ? stored[s] : copies + static_cast<size_t>(-1 - s) * stride;
  }
}

__global__ void add_expert_blocks_kernel(const float* blocks, int copies, int experts, int model_dim, int hidden_dim,
                                         float* const* d_w1, float* const* d_w2) {
  const size_t w1 = static_cast<size_t>(model_dim) * hidden_dim, block = 2 * w1;
  const size_t total = static_cast<size_t>(experts) * block;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t expert = i / block, offset = i % block;
    float sum = 0.0f;
    for (int c = 0; c < copies; ++c) sum += blocks[static_cast<size_t>(c) * total + i];
    float& to = offset < w1 ? d_w1[expert][offset] : d_w2[expert][offset - w1];
    to += sum;
  }
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace

void pack_routing_summary(const int* tokens_per_expert, const float* mean_probs, const float* z_loss,
                          int local_tokens, int experts, int32_t* summary, cudaStream_t stream) {
  pack_routing_summary_kernel<<<1, kThreads, 0, stream>>>(tokens_per_expert, mean_probs, z_loss, local_tokens,
                                                          experts, summary);
  CUDA_CHECK(cudaGetLastError());
}

void build_send_order(const int* top_experts, const int* routed_slots, const int* routed_offsets,
                      const int* segment_begin, const int* segment_send_row, int slots, int segments,
                      int* send_slot, int* slot_send_row, cudaStream_t stream) {
  if (slots == 0) return;
  build_send_order_kernel<<<blocks_for(slots), kThreads, 0, stream>>>(
      top_experts, routed_slots, routed_offsets, segment_begin, segment_send_row, slots, segments, send_slot,
      slot_send_row);
  CUDA_CHECK(cudaGetLastError());
}

void build_expert_rows(const int* row_offsets, const int* arrived_before, const int* block_start, int experts,
                       int ranks, int rows, int* row_slot, cudaStream_t stream) {
  if (rows == 0) return;
  build_expert_rows_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(row_offsets, arrived_before, block_start,
                                                                      experts, ranks, rows, row_slot);
  CUDA_CHECK(cudaGetLastError());
}

void scatter_rows(const int* row_slot, const bf16* rows, bf16* out, int count, int model_dim, cudaStream_t stream) {
  if (count == 0) return;
  const unsigned grid = blocks_for(static_cast<int64_t>(count) * 32);  // a warp a row
  if (model_dim % 8 == 0 && aligned16(rows) && aligned16(out)) {
    scatter_rows_kernel<true><<<grid, kThreads, 0, stream>>>(row_slot, rows, out, count, model_dim);
  } else {
    scatter_rows_kernel<false><<<grid, kThreads, 0, stream>>>(row_slot, rows, out, count, model_dim);
  }
  CUDA_CHECK(cudaGetLastError());
}

void zero_through_tables(float* const* to, int tables, size_t count, cudaStream_t stream) {
  if (tables == 0 || count == 0) return;
  zero_through_tables_kernel<<<blocks_for(static_cast<int64_t>(tables * count)), kThreads, 0, stream>>>(
      to, tables, count);
  CUDA_CHECK(cudaGetLastError());
}

void pack_through_table(float* const* table, const int* slot, const int* row, int n, size_t count, float* packed,
                        cudaStream_t stream) {
  if (n == 0 || count == 0) return;
  through_table_kernel<true><<<blocks_for(static_cast<int64_t>(n * count)), kThreads, 0, stream>>>(table, slot, row, n,
                                                                                                 count, packed);
  CUDA_CHECK(cudaGetLastError());
}

void unpack_through_table(const float* packed, const int* slot, const int* row, int n, size_t count,
                          float* const* table, cudaStream_t stream) {
  if (n == 0 || count == 0) return;
  through_table_kernel<false><<<blocks_for(static_cast<int64_t>(n * count)), kThreads, 0, stream>>>(
      table, slot, row, n, count, const_cast<float*>(packed));  // read only: the kernel writes the table here
  CUDA_CHECK(cudaGetLastError());
}

void pack_expert_slices(const bf16* const* w1, const bf16* const* w2, int experts, int model_dim, int hidden_dim,
                        int slices, bf16* packed, cudaStream_t stream) {
  const int64_t total = int64_t{experts} * 2 * model_dim * hidden_dim;
  if (total == 0) return;
  pack_expert_slices_kernel<<<blocks_for(total), kThreads, 0, stream>>>(w1, w2, experts, model_dim, hidden_dim,
                                                                       slices, packed);
  CUDA_CHECK(cudaGetLastError());
}

void unpack_expert_slices(const float* packed, float* const* d_w1, float* const* d_w2, int experts, int model_dim,
                          int hidden_dim, int slices, cudaStream_t stream) {
  const int64_t total = int64_t{experts} * 2 * model_dim * hidden_dim;
  if (total == 0) return;
  unpack_expert_slices_kernel<<<blocks_for(total), kThreads, 0, stream>>>(packed, d_w1, d_w2, experts, model_dim,
                                                                         hidden_dim, slices);
  CUDA_CHECK(cudaGetLastError());
}

void assemble_pointer_table(const bf16* const* stored, const int* source, const bf16* copies, size_t stride, int n,
                            const bf16** out, cudaStream_t stream) {
  if (n == 0) return;
  assemble_pointer_table_kernel<const bf16><<<blocks_for(n), kThreads, 0, stream>>>(stored, source, copies, stride, n, out);
  CUDA_CHECK(cudaGetLastError());
}

void assemble_pointer_table(float* const* stored, const int* source, float* copies, size_t stride, int n, float** out,
                            cudaStream_t stream) {
  if (n == 0) return;
  assemble_pointer_table_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(stored, source, copies, stride, n, out);
  CUDA_CHECK(cudaGetLastError());
}

void add_expert_blocks(const float* blocks, int copies, int experts, int model_dim, int hidden_dim, float* const* d_w1,
                       float* const* d_w2, cudaStream_t stream) {
  const int64_t total = int64_t{experts} * 2 * model_dim * hidden_dim;
  if (total == 0 || copies == 0) return;
  add_expert_blocks_kernel<<<blocks_for(total), kThreads, 0, stream>>>(blocks, copies, experts, model_dim, hidden_dim,
                                                                       d_w1, d_w2);
  CUDA_CHECK(cudaGetLastError());
}

void sum_partial_rows(const bf16* partials, const int* group_begin, int groups, int copies, int rows, int model_dim,
                      bf16* out, cudaStream_t stream) {
  if (rows == 0) return;
  sum_partial_rows_kernel<<<blocks_for(int64_t{rows} * model_dim), kThreads, 0, stream>>>(
      partials, group_begin, groups, copies, rows, model_dim, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::dist
