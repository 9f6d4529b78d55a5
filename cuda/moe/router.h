// moe/router.h: the gate of an MoE layer on the GPU: router logits (a cuBLAS GEMM), the fused softmax +
// top-K + combine weights + logsumexp + router losses kernel (Switch load balancing, ST-MoE z-loss),
// the same kernel computing the logits itself (route_fused, measured slower, below) and the router
// backward (d_logits). The CPU oracle is reference_cpu/router.h; the chain
// of derivatives is the one of moe::ref::moe_backward (reference_cpu/moe_layer.cpp).
// Built into moe_cuda (cmake --build build-gpu --target moe_cuda); tested by
// tests/cuda/test_router.cpp (ctest --test-dir build -R CudaRouting).
//
// Dimension legend: T tokens, D model width, E experts, K top-k.
//
//   logits          = x Wg                                [T, E] fp32 (x, Wg bf16; fp32 accumulate)
//   probs           = softmax(logits) per token           [T, E]
//   top_experts     = the K largest probs, descending;    [T, K] equal probabilities go to the
//                                                                lower expert index
//   combine_weights = the chosen probs (/ their sum when renormalize)   [T, K]
//   logsumexp       = log sum_e exp(logits[t, e])         [T]    the z-loss term
//   f_e = routed slots that chose e / (T*K),  P_e = mean_t probs[t, e],
//   aux_loss = E * sum_e f_e P_e,  z_loss = mean_t logsumexp_t^2
//
// Jitter (Switch's multiplicative noise on the router input) is the caller's: multiply x by the
// noise before routing, and the noise into dx afterwards, as reference_cpu/moe_layer.cpp does.
//
// Every launcher is asynchronous on `stream`: no host synchronisation, no device->host copy.
// Arguments are checked on the host before anything is launched (std::invalid_argument).
#pragma once

#include <cublas_v2.h>     // cublasHandle_t
#include <cuda_runtime.h>  // cudaStream_t

#include "core/bf16.h"           // bf16
#include "core/device_buffer.h"  // DeviceBuffer (RouterWorkspace)

namespace moe::cuda {

// The fused router kernel keeps one token's E logits in the registers of a group of lanes (8 per
// lane, so E <= 256 fits in one warp) and selects the top-K with K arg-max rounds over the group.
inline constexpr int kRouterMaxExperts = 256;
inline constexpr int kRouterMaxTopK = 8;
// Blocks of the fused router kernel at most: the rows of partial sums the last block adds up.
inline constexpr int kRouterMaxBlocks = 128;

// logits[T, E] = x[T, D] Wg[D, E] with cuBLAS (bf16 inputs, fp32 compute and output). The handle's
// stream is set to `stream`.
void router_logits(cublasHandle_t handle,
                   const bf16* x,             // [T, D] row-major
                   const bf16* gate_weights,  // [D, E] row-major
                   float* logits,             // [T, E] row-major
                   int tokens, int model_dim, int num_experts, cudaStream_t stream);

// Scratch memory of route_top_k's router statistics: each block of the kernel writes its partial
// sums there, and the last block to finish adds them up (moe/router.cu says why). Owned by the caller
// and reused on every call: size it once for the largest E it will route. One workspace per stream
// that routes concurrently: two launches in flight on one workspace would mix their partial sums.
struct RouterWorkspace {
  // Allocates for 1 <= num_experts <= kRouterMaxExperts and zeroes the ticket (a synchronous memset).
  explicit RouterWorkspace(int num_experts);

  int num_experts = 0;                  // the largest E this workspace serves
  DeviceBuffer<double> block_prob_sums; // [kRouterMaxBlocks, E] sum over the block's tokens of probs
  DeviceBuffer<int> block_counts;       // [kRouterMaxBlocks, E] routed slots of the block per expert
  DeviceBuffer<double> block_z_sums;    // [kRouterMaxBlocks]    sum of the block's logsumexp^2
  DeviceBuffer<unsigned> ticket;        // [1] blocks done; 0 between launches (the last block resets it)
};

// Softmax, top-K, combine weights and logsumexp of every token, and from them the router losses'
// statistics, in one kernel (a group of G lanes per token, 8 G >= E: 32 / G tokens per warp):
//   expert_fraction f_e, mean_probs P_e, aux_loss = E sum_e f_e P_e, z_loss = mean_t logsumexp_t^2.
// Deterministic: the sums over tokens run in a fixed order with double accumulators, so every run
// gives the same bits. 1 <= E <= min(kRouterMaxExperts, workspace.num_experts),
// 1 <= K <= min(E, kRouterMaxTopK).
void route_top_k(const float* logits,        // [T, E]
                 float* probs,               // [T, E]
                 int* top_experts,           // [T, K]
                 float* combine_weights,     // [T, K]
                 float* logsumexp,           // [T]
                 float* expert_fraction,     // [E]
                 float* mean_probs,          // [E]
                 float* aux_loss,            // [1]  E * sum_e f_e P_e (unscaled)
                 float* z_loss,              // [1]  mean_t logsumexp_t^2 (unscaled)
                 RouterWorkspace& workspace,
                 int tokens, int num_experts, int top_k, bool renormalize, cudaStream_t stream);

// What a layer keeps of its routing, for up to T tokens: the logits (router_logits' output), and
// everything route_top_k writes from them, which the combine, the backward and the losses read.
struct RouterBuffers {
  RouterBuffers() = default;
  RouterBuffers(size_t tokens, size_t num_experts, size_t top_k)
      : logits(tokens * num_experts), probs(tokens * num_experts), logsumexp(tokens),
        combine_weights(tokens * top_k), top_experts(tokens * top_k), expert_fraction(num_experts),
        mean_probs(num_experts), aux_loss(1), z_loss(1) {}

  DeviceBuffer<float> logits, probs, logsumexp, combine_weights;      // [T,E] [T,E] [T] [T,K]
  DeviceBuffer<int> top_experts;                                      // [T, K]
  DeviceBuffer<float> expert_fraction, mean_probs, aux_loss, z_loss;  // [E] [E] [1] [1]
};

// route_top_k from router.logits into the rest of `router`.
inline void route_top_k(RouterBuffers& router, RouterWorkspace& workspace, int tokens, int num_experts, int top_k,
                        bool renormalize, cudaStream_t stream) {
  route_top_k(router.logits.data(), router.probs.data(), router.top_experts.data(), router.combine_weights.data(),
              router.logsumexp.data(), router.expert_fraction.data(), router.mean_probs.data(),
              router.aux_loss.data(), router.z_loss.data(), workspace, tokens, num_experts, top_k, renormalize,
              stream);
}

// The router in one kernel: logits = x Wg on the tensor cores (bf16 in, fp32 accumulate, as
// router_logits), a pass of tokens at a time in shared memory, then everything route_top_k does.
// x is read once (E <= 32; E / 32 times from L2 above that), the logits never reach global memory,
// and a small T still spreads over up to kRouterMaxBlocks blocks (shorter passes, and D cut into
// ranges for the warps the tiles leave idle): one launch where router_logits + route_top_k take two
// and write and read T * E floats between them. The same outputs and checks as route_top_k; any D >= 1.
//
// The layers do not use it: it is slower. Measured on an H200 (moe_bench, Zipf routing, 2026-11-26,
// notebooks_data/bench/router_fused_h200_2026-11-26.txt), route_fused against router_logits +
// route_top_k back to back: T=16384 D=512 E=16 K=2 0.029 / 0.023 ms; T=16384 D=1024 E=64 K=1
// 0.081 / 0.025 ms; T=16384 D=2048 E=64 K=2 0.138 / 0.039 ms. What the fusion saves is small: the
// logits' round trip (T * E * 8 bytes, 1-4 MB here, about 1 us of memory time) and one launch gap.
// What it loses is the GEMM's main loop: each warp loads its fragments of x with 32-bit loads and
// of Wg with 16-bit ones straight from global memory, and each mma waits for them, while cuBLAS
// stages both through shared memory in a pipeline that keeps the loads in flight. Winning would take
// that pipeline (cp.async or TMA copies of x's rows into shared memory, ldmatrix into fragments)
// inside the router kernel, whose 1024 threads are held to 64 registers by the softmax and top-K
// part; as it stands the kernel is kept as the tested reference of the fused formulation, and
// moe_bench times it beside the layer's pair.
void route_fused(const bf16* x,             // [T, D] row-major
                 const bf16* gate_weights,  // [D, E] row-major
                 int model_dim,
                 float* probs,              // [T, E]
                 int* top_experts,          // [T, K]
                 float* combine_weights,    // [T, K]
                 float* logsumexp,          // [T]
                 float* expert_fraction,    // [E]
                 float* mean_probs,         // [E]
                 float* aux_loss,           // [1]
                 float* z_loss,             // [1]
                 RouterWorkspace& workspace,
                 int tokens, int num_experts, int top_k, bool renormalize, cudaStream_t stream);

// d_logits of  L = (terms through the combine weights) + aux_coef * aux_loss + z_coef * z_loss,
// given dL/d combine_weights (from combine_backward in moe/permute.h), one warp per token:
//   d_probs[t, top_experts[t, k]] += d_cw[t, k]                          (no renormalisation)
//                                 or (d_cw[t, k] - sum_j d_cw[t, j] w[t, j]) / S_t   (renormalised,
//                                    S_t = sum_k probs[t, top_experts[t, k]], w = probs / S_t)
//   d_probs[t, e] += aux_coef * E / T * f_e          (aux through P_e; f_e has no gradient)
//   d_logits[t, e] = probs[t, e] (d_probs[t, e] - sum_j probs[t, j] d_probs[t, j])   (softmax)
//                  + z_coef * 2 logsumexp_t / T * probs[t, e]                          (z-loss)
// The gate's GEMMs are left to the caller, who picks their precision:
//   d_gate_weights[D, E] = x^T d_logits        dx[T, D] += d_logits Wg^T
// (with cuBLAS on row-major data: the same operand swap as router_logits.)
void router_backward(const float* probs,              // [T, E]
                     const float* logsumexp,          // [T]
                     const int* top_experts,          // [T, K]
                     const float* d_combine_weights,  // [T, K]
                     const float* expert_fraction,    // [E]
                     float* d_logits,                 // [T, E]
                     int tokens, int num_experts, int top_k, bool renormalize,
                     double aux_loss_coef, double z_loss_coef, cudaStream_t stream);

}  // namespace moe::cuda
