// expert_layout_choice_gpu.h: Tutel's choice of the layout r for the GPU expert-parallel layer
// (expert_parallel_gpu.h, set_layout), by a cost model or by measurement. Both end with every rank
// holding the same r, set on the layer and recorded in last_step().layout_choice from its next
// forward on.
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_layouts_gpu
//
// Dimension legend: R ranks, E_r experts stored a rank, P_e = 2 D H the elements of one expert.
//
// Cost model: expert_layouts.h's choose_layout() over the GPU's valid layouts (valid_gpu_layouts),
// from the last forward's kept counts (or uniform routing before any forward), with what the GPU
// layer moves: token rows and gathered weights in bf16 (2 bytes), weight gradients in fp32 (4
// bytes), and r = 0's gradients summed by an all-reduce (a ring sends 2 (R - 1) E_r P_e elements a
// rank, twice a reduce-scatter's; the layer has no reduce-scatter). Pure arithmetic on values every
// rank holds: every rank gets the same r without a collective.
//
// Measurement: each candidate r runs one untimed forward + backward, then timed_calls timed ones,
// each timed with CUDA events on the caller's stream from the forward's start to the backward's end;
// a candidate's time is the median over the calls of the slowest rank's (an all-gather of the
// times), and every rank picks the same fastest r (ties: the smaller). The calls are ordinary
// steps: they overwrite the caller's y and gradients, and nothing is applied to the weights.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <span>

#include "ep/layout_choice.h"     // LayoutChoice, LayoutCostModel, check_layout, choose_layout: Tutel's layouts r
#include "ep/expert_parallel_gpu.h"  // ExpertParallelGpu, its weights and gradients

namespace moe::dist {

// The cost model's figures for GPUs: an H200 pair over NVLink (bytes_per_element is set per tensor,
// see above; the model's own is ignored).
LayoutCostModel gpu_layout_cost_model();

// Chooses by the cost model, sets the layer's layout to the choice (collective: set_layout's
// agreement) and returns it.
LayoutChoice choose_gpu_layout(ExpertParallelGpu& layer, const LayoutCostModel& model = gpu_layout_cost_model());

// Chooses by measurement among `candidates` (every one valid; empty: valid_gpu_layouts), sets the
// layer's layout to the choice and returns it. Collective.
LayoutChoice measure_gpu_layouts(ExpertParallelGpu& layer,
                                 const bf16* x,  // [T_r, D]
                                 int64_t local_tokens, const ExpertParallelGpuWeights& weights,
                                 bf16* y,         // [T_r, D]
                                 const bf16* dy,  // [T_r, D]
                                 const ExpertParallelGpuGradients& gradients, cudaStream_t stream,
                                 std::span<const int> candidates = {}, int timed_calls = 3);

}  // namespace moe::dist
