// expert_ffn_block_sparse.h: the buffers of the dropless layer's expert FFN on this project's
// block-sparse kernels (MegaBlocks), and of the router, as moe_bench times them.
//   cmake --build build --target moe_bench
#pragma once

#include <cstddef>

#include "moe/block_sparse.h"   // BlockSparseFfnOutputs, BlockSparseFfnGradients, expert_pointer_table
#include "moe/dispatch.h"       // DispatchPlanBuffers
#include "moe/router.h"         // RouterWorkspace
#include "moe/topology.h"       // TopologyBuffers
#include "moe_bench_harness.h"  // Shape, bf16, DeviceBuffer

namespace moe::bench {

// ---------------------------------------------------------------------------------------------
// [SECTION] block-sparse expert FFN
// ---------------------------------------------------------------------------------------------

inline MoeConfig layer_config(const Shape& s, moe::Activation activation, Formulation formulation, int block_size,
                       double capacity_factor = 1.0) {
  MoeConfig c;
  c.tokens = s.T;
  c.model_dim = s.D;
  c.hidden_dim = s.H;
  c.num_experts = s.E;
  c.top_k = s.K;
  c.formulation = formulation;
  c.block_size = block_size;
  c.capacity_factor = capacity_factor;
  c.activation = activation;
  return c;
}

// The dropless layer's buffers: plan and topology built on the GPU, activations in B x B blocks,
// bf16 weight gradients, as every cuBLAS formulation here writes them (block_sparse_ffn_backward
// writes fp32 or bf16; the trainer takes fp32 for its optimizer). SwiGLU adds the up projection's
// blocks and their gradient; dW1 is [E, D, 2H].
struct BlockSparseFfn {
  BlockSparseFfn(const MoeConfig& config_in)
      : config(config_in), plan(config), topology(config),
        x(size_t(plan.max_rows()) * config.model_dim), out(x.size()), d_out(x.size()), dx(x.size()),
        pre(blocks()), up(swiglu() ? blocks() : 0), hidden(blocks()), d_pre(blocks()), d_up(up.size()),
        dw1(size_t(config.num_experts) * config.model_dim * moe::w1_columns(config)),
        dw2(size_t(config.num_experts) * config.hidden_dim * config.model_dim) {
    dw1_of = moe::cuda::expert_pointer_table(dw1.data(), int(config.num_experts),
                                             size_t(config.model_dim) * moe::w1_columns(config));
    dw2_of = moe::cuda::expert_pointer_table(dw2.data(), int(config.num_experts),
                                             size_t(config.hidden_dim) * config.model_dim);
  }
  bool swiglu() const { return config.activation == moe::Activation::swiglu; }
  size_t blocks() const {
    const moe::cuda::DeviceTopology t = topology.topology();
    return size_t(t.max_nnz) * t.block_size * t.block_size;
  }
  static size_t bytes(const Shape& s, moe::Activation activation, int B) {
    const size_t rows = size_t(s.T) * s.K + size_t(s.E) * (B - 1);
    const bool swiglu = activation == moe::Activation::swiglu;
    const size_t hidden_widths = swiglu ? 5 : 3;  // pre, hidden, d_pre (+ up, d_up)
    const size_t weight_widths = swiglu ? 3 : 2;  // dW1 [D, W1] + dW2 [H, D], in units of D H
    return rows * (4 * size_t(s.D) + hidden_widths * size_t(s.H)) * sizeof(bf16) +
           weight_widths * size_t(s.E) * s.D * s.H * sizeof(bf16) + rows * 16;  // + plan and topology, generously
  }
  moe::cuda::BlockSparseFfnOutputs outputs() {
    moe::cuda::BlockSparseFfnOutputs o;
    o.pre_activation = pre.data();
    o.up_projection = up.data();  // nullptr for GeLU (an empty buffer)
    o.hidden = hidden.data();
    o.out = out.data();
    return o;
  }
  moe::cuda::BlockSparseFfnGradients gradients() {
    moe::cuda::BlockSparseFfnGradients g;
    g.d_pre_activation = d_pre.data();
    g.d_up_projection = d_up.data();
    g.d_permuted_x = dx.data();
    g.d_w1_bf16 = dw1_of.data();
    g.d_w2_bf16 = dw2_of.data();
    return g;
  }

  MoeConfig config;
  moe::cuda::DispatchPlanBuffers plan;
  moe::cuda::TopologyBuffers topology;
  DeviceBuffer<bf16> x, out, d_out, dx;  // [max_rows, D]
  DeviceBuffer<bf16> pre, up, hidden, d_pre, d_up;  // [max_nnz, B, B]; up, d_up SwiGLU only
  DeviceBuffer<bf16> dw1, dw2;                      // [E, D, W1], [E, H, D]
  DeviceBuffer<bf16*> dw1_of, dw2_of;
};

// The router's buffers, for timing the work outside the expert FFN.
struct RouterBuffers {
  RouterBuffers(const Shape& s)
      : gate_weights(size_t(s.D) * s.E), logits(size_t(s.T) * s.E), probs(logits.size()),
        top_experts(size_t(s.T) * s.K), combine_weights(top_experts.size()), logsumexp(s.T), expert_fraction(s.E),
        mean_probs(s.E), aux_loss(1), z_loss(1), workspace(s.E), y(size_t(s.T) * s.D) {}
  DeviceBuffer<bf16> gate_weights;  // [D, E]
  DeviceBuffer<float> logits, probs;  // [T, E]
  DeviceBuffer<int> top_experts;      // [T, K]
  DeviceBuffer<float> combine_weights, logsumexp, expert_fraction, mean_probs, aux_loss, z_loss;
  moe::cuda::RouterWorkspace workspace;
  DeviceBuffer<bf16> y;  // [T, D]
};

}  // namespace moe::bench
