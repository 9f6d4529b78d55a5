// model.h: the tiny byte-level MoE transformer language model, forward and backward, in double
// precision: the oracle that one GPU training step is compared with. Part of the CPU
// reference (moe::ref); built into moe_reference_cpu, tested by tests/reference_cpu/test_model.cpp:
//   cmake --build build --target test_reference_cpu_model && ctest --test-dir build -R ReferenceModel
//
// Dimension legend: V = 256 bytes, D model width, L blocks, S sequence length, N sequences,
// T = N * S tokens (token t = n * S + s), H_dense dense hidden width; the MoE layer's as in README.md.
//
// A decoder-only pre-LayerNorm transformer (GPT-2's block order):
//   x      = token_embedding[inputs] + position_embedding[s]                    [T, D]
//   block i:  x += attention(LN1(x))          causal, multi-head (attention.h)
//             x += FFN(LN2(x))                the MoE layer (moe_forward over all T tokens) in an
//                                             MoE block, the dense GeLU FFN (dense_ffn.h) otherwise
//   logits = LN_final(x) token_embedding^T                                       [T, V]
//   loss   = mean_t -log softmax(logits[t])[targets[t]]                          (nats per byte)
//          + aux_loss_coef * sum over MoE blocks of aux + z_loss_coef * sum of z
// The output projection is tied to the token embedding (GPT-2, Press & Wolf 2017): a byte's input
// vector is also its output vector, 256 x D fewer parameters, and token_embedding's gradient is the
// sum of the two uses. Only the LayerNorms have biases.
//
// Inputs and targets are both [N, S]: a trainer cuts N windows of S + 1 bytes and passes bytes
// [0, S) as inputs and [1, S + 1) as targets (llm.c's convention), so every position has a target.
//
// Pre-gated routing (config.pregated; Pre-gated MoE, Hwang et al., ISCA 2024). Number the MoE
// blocks m_0 < m_1 < ... (model_config.h). Every MoE block owns its gate weights [D, E]; what
// changes is which tensor the gate reads and where it is evaluated:
//   block m_0's gate reads LN2(x) of block m_0 itself (nobody can route it earlier);
//   block m_j's gate (j >= 1) reads LN2(x) of block m_{j-1}, the input of the previous MoE layer,
//   and is evaluated inside block m_{j-1} (BlockForward::next_routing), so block m_j's experts are
//   known one MoE block ahead and an offload engine can copy them while block m_{j-1} computes.
// With MoE in every block, block i+1's gate reads block i's LN2 output. Block m_j's experts still
// read block m_j's own LN2(x). The gate is trained with the model: its gradient flows into block
// m_{j-1}'s LN2 and everything before it. The last MoE block's input feeds no later gate.
//
// Parameters: the flat list of common/parameter_layout.h (names, shapes, order, initialisation);
// parameters() hands out this reference's matrices in that order.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attention.h"       // AttentionForward
#include "dense_ffn.h"       // DenseFfnForward
#include "layer_norm.h"      // LayerNormForward
#include "model_config.h"    // ModelConfig
#include "parameter_layout.h"  // ParameterInfo, parameter_layout, initial_parameters
#include "moe_layer.h"       // MoeWeights, LayerForward
#include "pregate.h"         // PreGateOutput
#include "types.h"

namespace moe::ref {

// ---- weights ----

struct LayerNormWeights {
  Matrix gain;  // [1, D]
  Matrix bias;  // [1, D]
};

struct BlockWeights {
  LayerNormWeights ln1;
  Matrix qkv_weights;  // [D, 3D]  columns [Q | K | V]
  Matrix out_weights;  // [D, D]
  LayerNormWeights ln2;
  Matrix ffn_w1;       // [D, H_dense]   dense blocks only (empty in MoE blocks)
  Matrix ffn_w2;       // [H_dense, D]   dense blocks only
  MoeWeights moe;      // MoE blocks only (empty in dense blocks)
};

struct ModelWeights {
  Matrix token_embedding;     // [V, D]  also the output projection (tied)
  Matrix position_embedding;  // [S, D]
  std::vector<BlockWeights> blocks;  // L
  LayerNormWeights final_ln;
};

// Gradients have exactly the parameters' structure and shapes.
using ModelGradients = ModelWeights;

// Every parameter with its shape, and zeros as values.
ModelWeights zero_weights(const ModelConfig& config);

// GPT-2's initialisation: initial_parameters (parameter_layout.h) in this reference's matrices.
ModelWeights init_model(const ModelConfig& config, uint64_t seed);

// The weights as one flat buffer in parameter_layout's order, and back (flat.size() must be
// parameter_count(config)): how the reference meets checkpoints, weights files and the GPU.
std::vector<double> to_flat(const ModelConfig& config, const ModelWeights& weights);
ModelWeights from_flat(const ModelConfig& config, std::span<const double> flat);

// ---- the flat parameter list ----

struct Parameter {
  std::string name;
  bool weight_decay = false;
  Matrix* value = nullptr;     // a matrix of `values`
  Matrix* gradient = nullptr;  // the same parameter's matrix of `gradients`
};

// Pointers into values and gradients (both shaped for config), in the fixed order.
std::vector<Parameter> parameters(const ModelConfig& config, ModelWeights& values, ModelGradients& gradients);

// ---- forward ----

struct BlockForward {
  Matrix x;                   // [T, D] the residual stream entering the block
  LayerNormForward ln1;       // ln1.y [T, D] is the attention's input
  AttentionForward attention;
  Matrix x_mid;               // [T, D] x + attention
  LayerNormForward ln2;       // ln2.y [T, D] is the FFN's input
  std::optional<DenseFfnForward> dense;  // dense blocks
  std::optional<LayerForward> moe;       // MoE blocks
  // Pre-gated only: the routing of the next MoE block, evaluated here on ln2.y with that block's gate.
  std::optional<PreGateOutput> next_routing;
};

struct ModelForward {
  int64_t batch = 0;                 // N
  Matrix x0;                         // [T, D] token + position embeddings
  std::vector<BlockForward> blocks;  // L
  LayerNormForward final_ln;         // final_ln.y [T, D]
  Matrix logits;                     // [T, V]
  Matrix probs;                      // [T, V] softmax of logits
  double lm_loss = 0.0;   // mean cross-entropy over the T positions, nats per byte
  double aux_loss = 0.0;  // sum over MoE blocks of their aux loss, unscaled
  double z_loss = 0.0;    // sum over MoE blocks of their z loss, unscaled
  double loss = 0.0;      // lm_loss + aux_loss_coef * aux_loss + z_loss_coef * z_loss
};

// validate(config), then the number of blocks and the shape and finiteness of every weight.
void check_model_weights(const ModelConfig& config, const ModelWeights& weights);

// check_model_weights, then inputs and targets [N, S] of bytes.
void check_model_inputs(const ModelConfig& config, const ModelWeights& weights,
                        const IndexMatrix& inputs, const IndexMatrix& targets);

ModelForward model_forward(const ModelConfig& config, const ModelWeights& weights,
                           const IndexMatrix& inputs,    // [N, S] bytes 0..255
                           const IndexMatrix& targets);  // [N, S] the next byte of each position

// ---- backward ----

// The gradient of forward.loss with respect to every parameter. The routing (top-K, dropping) is
// piecewise constant and carries no gradient, as in moe_backward.
ModelGradients model_backward(const ModelConfig& config, const ModelWeights& weights,
                              const IndexMatrix& inputs,   // [N, S]
                              const IndexMatrix& targets,  // [N, S]
                              const ModelForward& forward);

}  // namespace moe::ref
