// embedding.h: the input embeddings of the byte-level transformer on the GPU, forward and backward.
// The CPU oracle is the "embeddings" lines of moe::ref::model_forward / model_backward
// (reference_cpu/model.cpp). Built into moe_cuda; tested by tests/cuda/test_embedding.cpp
// (ctest --test-dir build -R CudaEmbedding; skips without a GPU).
//
// Dimension legend: V = 256 byte values, D model width, N sequences, S sequence length,
// T = N * S tokens, token t = n * S + s.
//   forward : x[t] = token_embedding[tokens[t]] + position_embedding[t % S]
//   backward: d_token_embedding[v]    (+)= sum over t with tokens[t] == v of dx[t]
//             d_position_embedding[s]  = sum over n of dx[n * S + s]
//
// Precision: tokens int32 (the reference's IndexMatrix), the tables bf16 (the forward copies of the
// fp32 master weights, model/optimizer.h), x bf16 (the residual stream); dx and both gradients fp32.
//
// A byte outside 0..255 cannot be caught on the host without a synchronisation, so the forward
// writes a NaN row for it: the loss turns NaN at once, at the step that read the bad byte, instead
// of the kernel reading outside the table. The backward ignores such a token.
//
// Determinism without atomics: several tokens share a byte, so the token table's gradient is a
// scatter-add. Instead of atomics (whose order, and so whose rounding, changes from run to run), the
// tokens are cut into segments of kEmbeddingSegmentTokens. One thread block owns a byte v, a slice of
// columns and a segment; it compacts the segment's positions that hold v in ascending order (a
// prefix count over its threads) and sums their rows in that order into a partial in `scratch`.
// Then each byte's partials are added in segment order. Every run adds the same numbers in the same
// order. The cost is V passes over the T token ids (cheap) and one read of each dx row; segments
// spread a frequent byte's rows over many SMs.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

inline constexpr int kEmbeddingVocabulary = 256;  // V: bytes

// first_position (device [1], or nullptr for 0): token t reads position row *first_position + t % S, so
// that a decoder's step reads its positions from the device (a CUDA graph replays it at any position;
// the caller keeps *first_position + S within the table).
void embedding_forward(const int32_t* tokens,          // [N, S] bytes 0..255
                       const bf16* token_embedding,     // [V, D]
                       const bf16* position_embedding,  // [S, D]
                       bf16* x,                         // [T, D]
                       int64_t batch, int64_t seq_len, int64_t model_dim, cudaStream_t stream,
                       const int32_t* first_position = nullptr);  // device [1] or nullptr

inline constexpr int64_t kEmbeddingSegmentTokens = 1024;

// The fp32 entries of the backward's scratch: [ceil(T / kEmbeddingSegmentTokens), V, D].
int64_t embedding_backward_scratch_floats(int64_t tokens, int64_t model_dim);

// With accumulate_token_gradient, the token table's gradient is added to d_token_embedding (the
// tied output projection writes its share there first, model.h); otherwise it is overwritten.
// d_position_embedding is always overwritten.
void embedding_backward(const int32_t* tokens,        // [N, S]
                        const float* dx,              // [T, D]
                        float* d_token_embedding,     // [V, D]
                        float* d_position_embedding,  // [S, D]
                        float* scratch,               // [embedding_backward_scratch_floats(T, D)]
                        int64_t batch, int64_t seq_len, int64_t model_dim, bool accumulate_token_gradient,
                        cudaStream_t stream);

}  // namespace moe::cuda
