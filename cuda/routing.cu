// routing.cu: the router kernels of routing.h: logits by cuBLAS, the fused softmax + top-K kernel,
// the router losses and the router backward. Build: cmake --build build-gpu --target moe_cuda.
//
// Why one warp per token: a token's E logits (E <= 256) fit in the registers of 32 lanes, so the
// softmax (max, exp, sum) and the top-K selection are shuffles inside one warp: no shared memory,
// no block barriers, and the logits are read from global memory exactly once.
#include "routing.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda_check.h"     // CUDA_CHECK, CudaError
#include "launch_checks.h"  // check_not_null, check_range

namespace moe::cuda {

namespace {

constexpr int kWarpSize = 32;
constexpr int kExpertsPerLane = kRouterMaxExperts / kWarpSize;  // logits a lane holds: 8
constexpr int kWarpsPerBlock = 4;  // 128 threads: small blocks keep many tokens per SM in flight

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string("routing.cu: ") + call + " failed: " + cublasGetStatusString(status));
  }
}

__device__ float warp_max(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

__device__ float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// ---- fused softmax + top-K ----
// Lane `lane` holds experts lane, lane + 32, lane + 64, ... so each unrolled index i is a register.
__global__ void route_top_k_kernel(const float* __restrict__ logits,  // [T, E]
                                   float* __restrict__ probs,         // [T, E]
                                   int* __restrict__ top_experts,     // [T, K]
                                   float* __restrict__ combine_weights,  // [T, K]
                                   float* __restrict__ logsumexp,     // [T]
                                   int tokens, int num_experts, int top_k, bool renormalize) {
  const int lane = threadIdx.x % kWarpSize;
  const int token = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= tokens) return;  // warp-uniform: every shuffle below has its full warp
  const float* logit_row = logits + static_cast<size_t>(token) * num_experts;
  float* prob_row = probs + static_cast<size_t>(token) * num_experts;

  // Softmax after subtracting the row max, so exp never overflows (as the reference does).
  float value[kExpertsPerLane];
  float row_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    value[i] = expert < num_experts ? logit_row[expert] : -INFINITY;
    row_max = fmaxf(row_max, value[i]);
  }
  row_max = warp_max(row_max);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    value[i] = expert < num_experts ? expf(value[i] - row_max) : 0.0f;
    sum += value[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    value[i] = value[i] / sum;
    if (expert < num_experts) prob_row[expert] = value[i];
  }
  if (lane == 0) logsumexp[token] = row_max + logf(sum);

  // Top-K: K rounds of a warp-wide arg-max over the experts not yet taken. The comparison
  // "greater probability, or equal probability and lower index" gives the reference's order:
  // descending probability, ties to the lower expert index.
  unsigned taken = 0;          // bit i: this lane's expert lane + 32 i is already chosen
  float chosen_prob = 0.0f;    // lane k keeps the probability of choice k
  float chosen_sum = 0.0f;     // sum of the K chosen probabilities, the same on every lane
  for (int k = 0; k < top_k; ++k) {
    float best = -1.0f;        // below every probability, so even an underflowed 0 can be chosen
    int best_expert = num_experts;
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      const int expert = lane + i * kWarpSize;
      // i ascending means expert ascending: strict > keeps the lower index of a tie.
      if (expert < num_experts && !((taken >> i) & 1u) && value[i] > best) {
        best = value[i];
        best_expert = expert;
      }
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_expert = __shfl_xor_sync(0xffffffffu, best_expert, offset);
      if (other > best || (other == best && other_expert < best_expert)) {
        best = other;
        best_expert = other_expert;
      }
    }
    if (best_expert % kWarpSize == lane) taken |= 1u << (best_expert / kWarpSize);
    if (lane == k) chosen_prob = best;
    if (lane == 0) top_experts[static_cast<size_t>(token) * top_k + k] = best_expert;
    chosen_sum += best;
  }
  if (lane < top_k) {
    combine_weights[static_cast<size_t>(token) * top_k + lane] =
        renormalize ? chosen_prob / chosen_sum : chosen_prob;
  }
}

// ---- router losses ----
// One block per expert, 1024 threads striding over the tokens: the T column reads of one expert are
// strided (E floats apart), so what bounds the kernel is how many loads are in flight. A first
// version gave each block 32 experts and only ceil(E / 32) blocks in all (2 blocks for E = 64:
// 0.19 ms on an H200); with 256 threads per expert block it still took ~47 us per layer at
// T = 16384, E = 16 (16 blocks on 132 SMs, 64 loads in sequence per thread); 1024 threads cut the
// sequence to 16. Each thread sums its tokens in order and the block combines the partial sums in
// a fixed tree, so the result is the same bit for bit on every run.
constexpr int kStatisticsThreads = 1024;

__global__ void __launch_bounds__(kStatisticsThreads) expert_statistics_kernel(const float* __restrict__ probs,     // [T, E]
                                         const int* __restrict__ top_experts, // [T, K]
                                         float* __restrict__ expert_fraction, // [E]
                                         float* __restrict__ mean_probs,      // [E]
                                         int tokens, int num_experts, int top_k) {
  __shared__ double prob_partial[kStatisticsThreads];
  __shared__ int count_partial[kStatisticsThreads];
  const int expert = blockIdx.x;
  double prob_sum = 0.0;  // double: a sum of T terms, and this kernel is far from any bottleneck
  int count = 0;
  for (int token = threadIdx.x; token < tokens; token += kStatisticsThreads) {
    prob_sum += probs[static_cast<size_t>(token) * num_experts + expert];
    for (int k = 0; k < top_k; ++k) count += top_experts[static_cast<size_t>(token) * top_k + k] == expert;
  }
  prob_partial[threadIdx.x] = prob_sum;
  count_partial[threadIdx.x] = count;
  __syncthreads();
  for (int stride = kStatisticsThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      prob_partial[threadIdx.x] += prob_partial[threadIdx.x + stride];
      count_partial[threadIdx.x] += count_partial[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    mean_probs[expert] = static_cast<float>(prob_partial[0] / tokens);
    expert_fraction[expert] =
        static_cast<float>(static_cast<double>(count_partial[0]) / (static_cast<double>(tokens) * top_k));
  }
}

constexpr int kLossThreads = 256;

// One block: the two scalar losses are sums over T (z) and over E (aux), a few microseconds.
__global__ void loss_totals_kernel(const float* __restrict__ expert_fraction,  // [E]
                                   const float* __restrict__ mean_probs,       // [E]
                                   const float* __restrict__ logsumexp,        // [T]
                                   float* __restrict__ aux_loss,               // [1]
                                   float* __restrict__ z_loss,                 // [1]
                                   int tokens, int num_experts) {
  __shared__ double aux_partial[kLossThreads];
  __shared__ double z_partial[kLossThreads];
  double aux = 0.0, z = 0.0;
  for (int e = threadIdx.x; e < num_experts; e += kLossThreads) {
    aux += static_cast<double>(expert_fraction[e]) * mean_probs[e];
  }
  for (int t = threadIdx.x; t < tokens; t += kLossThreads) {
    const double lse = logsumexp[t];
    z += lse * lse;
  }
  aux_partial[threadIdx.x] = aux;
  z_partial[threadIdx.x] = z;
  __syncthreads();
  for (int stride = kLossThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      aux_partial[threadIdx.x] += aux_partial[threadIdx.x + stride];
      z_partial[threadIdx.x] += z_partial[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *aux_loss = static_cast<float>(num_experts * aux_partial[0]);
    *z_loss = static_cast<float>(z_partial[0] / tokens);
  }
}

// ---- router backward ----
// The same register layout as the forward kernel: lane holds probs and d_probs of experts
// lane + 32 i. The K chosen experts are distinct, so each gradient lands in exactly one register.
__global__ void router_backward_kernel(const float* __restrict__ probs,              // [T, E]
                                       const float* __restrict__ logsumexp,          // [T]
                                       const int* __restrict__ top_experts,          // [T, K]
                                       const float* __restrict__ d_combine_weights,  // [T, K]
                                       const float* __restrict__ expert_fraction,    // [E]
                                       float* __restrict__ d_logits,                 // [T, E]
                                       int tokens, int num_experts, int top_k, bool renormalize,
                                       float aux_scale,      // aux_coef * E / T
                                       float z_coef_scale) { // z_coef * 2 / T
  const int lane = threadIdx.x % kWarpSize;
  const int token = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= tokens) return;  // warp-uniform
  const float* prob_row = probs + static_cast<size_t>(token) * num_experts;
  const int* chosen = top_experts + static_cast<size_t>(token) * top_k;
  const float* d_weight = d_combine_weights + static_cast<size_t>(token) * top_k;

  float prob[kExpertsPerLane], d_prob[kExpertsPerLane];
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    prob[i] = expert < num_experts ? prob_row[expert] : 0.0f;
    // aux = E sum_e f_e P_e and P_e = mean_t probs[t, e]: every token gets coef * E / T * f_e.
    d_prob[i] = expert < num_experts ? aux_scale * expert_fraction[expert] : 0.0f;
  }

  // Combine weights w_k = p_k / S (renormalised): dL/dp_k = (dw_k - sum_j dw_j w_j) / S.
  float chosen_sum = 1.0f, weighted = 0.0f;
  if (renormalize) {
    chosen_sum = 0.0f;
    for (int k = 0; k < top_k; ++k) chosen_sum += prob_row[chosen[k]];
    for (int k = 0; k < top_k; ++k) weighted += d_weight[k] * (prob_row[chosen[k]] / chosen_sum);
  }
  for (int k = 0; k < top_k; ++k) {
    const int expert = chosen[k];
    const float gradient = renormalize ? (d_weight[k] - weighted) / chosen_sum : d_weight[k];
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      if (expert == lane + i * kWarpSize) d_prob[i] += gradient;
    }
  }

  // Softmax backward: d_logit = p (d_p - <p, d_p>); z-loss: d lse / d logit = p.
  float inner = 0.0f;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) inner += prob[i] * d_prob[i];
  inner = warp_sum(inner);
  const float z_scale = z_coef_scale * logsumexp[token];
  float* out_row = d_logits + static_cast<size_t>(token) * num_experts;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = lane + i * kWarpSize;
    if (expert < num_experts) out_row[expert] = prob[i] * (d_prob[i] - inner) + z_scale * prob[i];
  }
}

void check_router_sizes(const char* function, int tokens, int num_experts, int top_k) {
  detail::check_range(function, "tokens (T)", tokens, 1, INT32_MAX / kRouterMaxExperts,
                      "T * E indexes the logits");
  detail::check_range(function, "num_experts (E)", num_experts, 1, kRouterMaxExperts,
                      "kRouterMaxExperts: one warp holds a token's logits in registers");
  detail::check_range(function, "top_k (K)", top_k, 1, std::min(num_experts, kRouterMaxTopK),
                      "K <= E and K <= kRouterMaxTopK");
}

unsigned token_blocks(int tokens) { return static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void router_logits(cublasHandle_t handle, const bf16* x, const bf16* gate_weights, float* logits,
                   int tokens, int model_dim, int num_experts, cudaStream_t stream) {
  constexpr const char* function = "router_logits";
  detail::check_not_null(function, "handle", handle);
  detail::check_not_null(function, "x", x);
  detail::check_not_null(function, "gate_weights", gate_weights);
  detail::check_not_null(function, "logits", logits);
  detail::check_range(function, "tokens (T)", tokens, 1, INT32_MAX);
  detail::check_range(function, "model_dim (D)", model_dim, 1, INT32_MAX);
  detail::check_range(function, "num_experts (E)", num_experts, 1, INT32_MAX);
  check_cublas(cublasSetStream(handle, stream), "cublasSetStream");
  // cuBLAS is column-major. A row-major [T, E] matrix is a column-major [E, T] one, so compute
  // logits^T [E, T] = Wg^T [E, D] * x^T [D, T]: the row-major buffers of Wg and x are exactly
  // those column-major transposes, with leading dimensions E and D.
  const float alpha = 1.0f, beta = 0.0f;
  check_cublas(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, num_experts, tokens, model_dim, &alpha,
                            gate_weights, CUDA_R_16BF, num_experts, x, CUDA_R_16BF, model_dim, &beta,
                            logits, CUDA_R_32F, num_experts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (router logits)");
}

void route_top_k(const float* logits, float* probs, int* top_experts, float* combine_weights,
                 float* logsumexp, int tokens, int num_experts, int top_k, bool renormalize,
                 cudaStream_t stream) {
  constexpr const char* function = "route_top_k";
  check_router_sizes(function, tokens, num_experts, top_k);
  detail::check_not_null(function, "logits", logits);
  detail::check_not_null(function, "probs", probs);
  detail::check_not_null(function, "top_experts", top_experts);
  detail::check_not_null(function, "combine_weights", combine_weights);
  detail::check_not_null(function, "logsumexp", logsumexp);
  route_top_k_kernel<<<token_blocks(tokens), kWarpsPerBlock * kWarpSize, 0, stream>>>(
      logits, probs, top_experts, combine_weights, logsumexp, tokens, num_experts, top_k, renormalize);
  CUDA_CHECK(cudaGetLastError());
}

void router_losses(const float* probs, const int* top_experts, const float* logsumexp,
                   float* expert_fraction, float* mean_probs, float* aux_loss, float* z_loss,
                   int tokens, int num_experts, int top_k, cudaStream_t stream) {
  constexpr const char* function = "router_losses";
  check_router_sizes(function, tokens, num_experts, top_k);
  detail::check_not_null(function, "probs", probs);
  detail::check_not_null(function, "top_experts", top_experts);
  detail::check_not_null(function, "logsumexp", logsumexp);
  detail::check_not_null(function, "expert_fraction", expert_fraction);
  detail::check_not_null(function, "mean_probs", mean_probs);
  detail::check_not_null(function, "aux_loss", aux_loss);
  detail::check_not_null(function, "z_loss", z_loss);
  expert_statistics_kernel<<<num_experts, kStatisticsThreads, 0, stream>>>(
      probs, top_experts, expert_fraction, mean_probs, tokens, num_experts, top_k);
  CUDA_CHECK(cudaGetLastError());
  loss_totals_kernel<<<1, kLossThreads, 0, stream>>>(expert_fraction, mean_probs, logsumexp, aux_loss,
                                                     z_loss, tokens, num_experts);
  CUDA_CHECK(cudaGetLastError());
}

void router_backward(const float* probs, const float* logsumexp, const int* top_experts,
                     const float* d_combine_weights, const float* expert_fraction, float* d_logits,
                     int tokens, int num_experts, int top_k, bool renormalize, double aux_loss_coef,
                     double z_loss_coef, cudaStream_t stream) {
  constexpr const char* function = "router_backward";
  check_router_sizes(function, tokens, num_experts, top_k);
  detail::check_not_null(function, "probs", probs);
  detail::check_not_null(function, "logsumexp", logsumexp);
  detail::check_not_null(function, "top_experts", top_experts);
  detail::check_not_null(function, "d_combine_weights", d_combine_weights);
  detail::check_not_null(function, "expert_fraction", expert_fraction);
  detail::check_not_null(function, "d_logits", d_logits);
  if (!std::isfinite(aux_loss_coef) || !std::isfinite(z_loss_coef)) {
    throw std::invalid_argument(std::string(function) + ": aux_loss_coef = " + std::to_string(aux_loss_coef) +
                                ", z_loss_coef = " + std::to_string(z_loss_coef) + "; expected finite numbers");
  }
  const float aux_scale = static_cast<float>(aux_loss_coef * num_experts / tokens);
  const float z_coef_scale = static_cast<float>(z_loss_coef * 2.0 / tokens);
  router_backward_kernel<<<token_blocks(tokens), kWarpsPerBlock * kWarpSize, 0, stream>>>(
      probs, logsumexp, top_experts, d_combine_weights, expert_fraction, d_logits, tokens, num_experts,
      top_k, renormalize, aux_scale, z_coef_scale);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
