// pregate.h: pre-gating (Pre-gated MoE, Hwang et al., ISCA 2024). Part of the CPU reference (moe::ref).
//
// A conventional MoE block can only choose its experts once its own input exists, so an engine that
// keeps experts in host memory must stall on the PCIe copy of the chosen experts. Pre-gated MoE
// moves the choice one block earlier: block i evaluates block i+1's gate on its own input x_i.
// The routing of block i+1 is then known while block i computes, which is what lets the offload
// engine prefetch block i+1's experts (copy their weights to the GPU) in the shadow of block i.
// The pre-gate is an ordinary router: its only difference is which activation it reads.
#pragma once

#include "dispatch.h"    // DispatchPlan
#include "moe_config.h"  // MoeConfig
#include "router.h"      // RouterOutput
#include "types.h"

namespace moe::ref {

struct PreGateOutput {
  RouterOutput router;              // block i+1's routing, computed from x_i
  DispatchPlan plan;                // block i+1's dispatch plan
  IndexVector experts_to_prefetch;  // block i+1's experts that receive at least one row, ascending
};

PreGateOutput pregate(const MoeConfig& next_config,          // block i+1's layer config
                      const Matrix& x_current,               // [T, D] block i's input x_i
                      const Matrix& next_gate_weights);      // [D, E] block i+1's gate weights

}  // namespace moe::ref
