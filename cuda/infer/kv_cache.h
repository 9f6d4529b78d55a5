// infer/kv_cache.h: the keys and values of every position decoded so far, kept on the GPU per block,
// and the attention of one new token per sequence against them (decode attention). The CPU oracle
// is moe::ref::cached_attention_forward (reference_cpu/kv_cache.h), whose formulas these follow.
// Built into moe_cuda; tested through the decoding model by tests/cuda/test_infer.cpp
// (ctest --test-dir build -R CudaInfer; skips without a GPU).
//
// Dimension legend: L blocks, N sequences, heads, d = D / heads the head width, S the context (the
// positions a sequence can hold), D model width.
//
// Layout: keys and values are each one tensor [L, N, heads, S, d]: the cache of block l, sequence n,
// head h is one contiguous [S, d] matrix, so the decode attention of (n, h) reads its keys and
// values as two dense panels, row s at position s. Attention's projection writes [q | k | v] rows of
// 3D columns (model/attention.h: head h owns columns [h d, (h + 1) d) of each part); kv_cache_append
// scatters the k and v parts of the new rows into the cache at their positions.
//
// Why a cache: the keys and values of positions 0..s-1 do not change when byte s arrives (the mask
// is causal and the projection is per row), so a decode step projects only its new row and attends
// to the stored ones: a step costs O(S) rather than O(S^2).
//
// Decode attention, one new token per sequence, at position p = length - 1:
//   scores_s = q_h . K_h[s] / sqrt(d)  for s < length;  p_s = softmax(scores);  context_h = sum_s p_s V_h[s]
// One thread block per (head, sequence); scores, softmax and the weighted sum in fp32, q, K, V and
// the context bf16. Every reduction runs in a fixed order (warp butterflies, then warps in order),
// so the same inputs give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/bf16.h"           // bf16
#include "core/device_buffer.h"  // DeviceBuffer

namespace moe::cuda {

struct KvCacheShape {
  int64_t layers = 0;    // L
  int64_t batch = 0;     // N
  int64_t heads = 0;
  int64_t capacity = 0;  // S
  int64_t head_dim = 0;  // d
  int64_t elements_per_layer() const { return batch * heads * capacity * head_dim; }
};

class KvCacheGpu {
 public:
  explicit KvCacheGpu(const KvCacheShape& shape);
  const KvCacheShape& shape() const { return shape_; }
  bf16* keys(int64_t layer) { return keys_.data() + layer * shape_.elements_per_layer(); }    // [N, heads, S, d]
  bf16* values(int64_t layer) { return values_.data() + layer * shape_.elements_per_layer(); }  // [N, heads, S, d]
  size_t bytes() const { return keys_.bytes() + values_.bytes(); }
  // NaN in every entry (tests: a position that is read before it is written shows).
  void poison(cudaStream_t stream);

 private:
  KvCacheShape shape_;
  DeviceBuffer<bf16> keys_, values_;  // [L, N, heads, S, d] each
};

// Positions live on the device (first_position, position: device [1]), so that a decode step
// captured in a CUDA graph replays at whatever position the decoder has reached; the caller checks
// them against S on the host before writing them (a kernel skips a position outside [0, S) rather
// than writing past the cache).

// Writes the k and v parts of `count` new rows per sequence into one block's cache at positions
// *first_position .. *first_position + count - 1. The rows of qkv are grouped by sequence: sequence
// n's rows are n * count .. n * count + count - 1.
void kv_cache_append(const bf16* qkv,               // [N * count, 3D]
                     bf16* keys,                    // [N, heads, S, d] one block's cache
                     bf16* values,                  // [N, heads, S, d]
                     const KvCacheShape& shape, int64_t count,
                     const int32_t* first_position,  // device [1]
                     cudaStream_t stream);

// The attention of one new token per sequence, at position *position, against cached positions
// 0 .. *position of one block (the new token's own key and value already appended there). Its shared
// memory is sized for S positions, whatever the length.
void decode_attention(const bf16* qkv,         // [N, 3D] the new tokens' projections; the q part is read
                      const bf16* keys,        // [N, heads, S, d]
                      const bf16* values,      // [N, heads, S, d]
                      bf16* context,           // [N, D] heads side by side
                      const KvCacheShape& shape,
                      const int32_t* position,  // device [1]
                      cudaStream_t stream);

}  // namespace moe::cuda
