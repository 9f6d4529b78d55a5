// bench_kernels.h: filling and checking device buffers for ep_bench, on the GPU so that a 256 MiB
// buffer costs no host time: deterministic values from (seed, index), so that any rank can make any
// other rank's data, and counts of the elements that differ from what was expected.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::dist::bench {

using cuda::bf16;

// out[i] = scale * u(seed, first + i), u uniform in [-1, 1): the same element of a tensor gets the
// same value on every rank, whichever slice of it a rank makes.
void fill_uniform(bf16* out, size_t count, uint64_t seed, uint64_t first, float scale, cudaStream_t stream);

// The all-to-all's data: element i of what rank `from` sends rank `to`, as 16 bits.
void fill_exchange_pattern(uint16_t* out, size_t count, int from, int to, cudaStream_t stream);
// Adds to *wrong the elements of got [count] that are not fill_exchange_pattern(from, to).
void count_pattern_mismatches(const uint16_t* got, size_t count, int from, int to, unsigned long long* wrong,
                              cudaStream_t stream);
// Adds to *wrong the elements where a and b differ (bit for bit).
void count_mismatches(const uint16_t* a, const uint16_t* b, size_t count, unsigned long long* wrong,
                      cudaStream_t stream);

// weights[i] -= learning_rate * gradients[i], rounded to bf16: plain SGD on a rank's expert weights.
void sgd_update(bf16* weights, const float* gradients, size_t count, float learning_rate, cudaStream_t stream);

}  // namespace moe::dist::bench
