// model.cpp: the reference model's parameters, forward and backward (see model.h).
#include "model.h"

#include <algorithm>  // lower_bound, upper_bound over the MoE blocks
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "checks.h"          // check_shape, check_finite
#include "pregated_layer.h"  // pregated_moe_forward / backward

namespace moe::ref {

namespace {

// ---- the one walk over the parameters ----

// Calls visit(matrix) for every parameter of w in parameter_layout's order (common/parameter_layout.h).
// Weights is ModelWeights or const ModelWeights.
template <typename Weights, typename Visit>
void for_each_matrix(const ModelConfig& config, Weights& w, Visit&& visit) {
  visit(w.token_embedding);
  visit(w.position_embedding);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    auto& block = w.blocks[i];
    visit(block.ln1.gain);
    visit(block.ln1.bias);
    visit(block.qkv_weights);
    visit(block.out_weights);
    visit(block.ln2.gain);
    visit(block.ln2.bias);
    if (is_moe_block(config, i)) {
      visit(block.moe.gate_weights);
      for (int64_t e = 0; e < config.num_experts; ++e) visit(block.moe.w1[e]);
      for (int64_t e = 0; e < config.num_experts; ++e) visit(block.moe.w2[e]);
    } else {
      visit(block.ffn_w1);
      visit(block.ffn_w2);
    }
  }
  visit(w.final_ln.gain);
  visit(w.final_ln.bias);
}

// Calls visit(info, matrix) for every parameter of w: each entry of parameter_layout beside the
// matrix of this reference that holds it.
template <typename Weights, typename Visit>
void for_each_parameter(const ModelConfig& config, Weights& w, Visit&& visit) {
  const std::vector<ParameterInfo> layout = parameter_layout(config);
  size_t index = 0;
  for_each_matrix(config, w, [&](auto& m) { visit(layout[index++], m); });
}

LayerNormWeights zero_layer_norm(int64_t D) { return {Matrix::Zero(1, D), Matrix::Zero(1, D)}; }

void check_bytes(std::string_view name, const IndexMatrix& bytes, int64_t seq_len) {
  if (bytes.rows() < 1 || bytes.cols() != seq_len) {
    std::ostringstream message;
    message << name << " has shape [" << bytes.rows() << ", " << bytes.cols() << "]; expected [N, S] with N >= 1, S = "
            << seq_len;
    throw std::invalid_argument(message.str());
  }
  for (Eigen::Index n = 0; n < bytes.rows(); ++n) {
    for (Eigen::Index s = 0; s < bytes.cols(); ++s) {
      if (bytes(n, s) >= 0 && bytes(n, s) < kByteVocabulary) continue;
      std::ostringstream message;
      message << name << "[" << n << ", " << s << "] = " << bytes(n, s) << "; expected a byte, 0 <= value < "
              << kByteVocabulary;
      throw std::invalid_argument(message.str());
    }
  }
}

}  // namespace

// ---- parameters ----

ModelWeights zero_weights(const ModelConfig& config) {
  validate(config);
  const int64_t D = config.model_dim;
  ModelWeights w;
  w.token_embedding = Matrix::Zero(kByteVocabulary, D);
  w.position_embedding = Matrix::Zero(config.seq_len, D);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    BlockWeights block;
    block.ln1 = zero_layer_norm(D);
    block.qkv_weights = Matrix::Zero(D, 3 * D);
    block.out_weights = Matrix::Zero(D, D);
    block.ln2 = zero_layer_norm(D);
    if (is_moe_block(config, i)) {
      const MoeConfig layer = moe_layer_config(config, 1);
      block.moe.gate_weights = Matrix::Zero(D, config.num_experts);
      block.moe.w1.assign(config.num_experts, Matrix::Zero(D, w1_columns(layer)));
      block.moe.w2.assign(config.num_experts, Matrix::Zero(config.expert_hidden_dim, D));
    } else {
      block.ffn_w1 = Matrix::Zero(D, config.dense_hidden_dim);
      block.ffn_w2 = Matrix::Zero(config.dense_hidden_dim, D);
    }
    w.blocks.push_back(std::move(block));
  }
  w.final_ln = zero_layer_norm(D);
  return w;
}

ModelWeights init_model(const ModelConfig& config, uint64_t seed) {
  return from_flat(config, initial_parameters(config, seed));
}

std::vector<double> to_flat(const ModelConfig& config, const ModelWeights& weights) {
  std::vector<double> flat(static_cast<size_t>(parameter_count(config)));
  for_each_parameter(config, weights, [&](const ParameterInfo& p, const Matrix& m) {
    check_shape(p.name, m, p.rows, p.cols, "the shape in parameter_layout");
    std::copy(m.data(), m.data() + m.size(), flat.begin() + p.offset);  // row-major, as the list stores it
  });
  return flat;
}

ModelWeights from_flat(const ModelConfig& config, std::span<const double> flat) {
  if (static_cast<int64_t>(flat.size()) != parameter_count(config)) {
    throw std::invalid_argument("from_flat: " + std::to_string(flat.size()) + " values; the model has " +
                                std::to_string(parameter_count(config)) + " parameters");
  }
  ModelWeights w = zero_weights(config);
  for_each_parameter(config, w, [&](const ParameterInfo& p, Matrix& m) {
    m = Eigen::Map<const Matrix>(flat.data() + p.offset, p.rows, p.cols);
  });
  return w;
}

std::vector<Parameter> parameters(const ModelConfig& config, ModelWeights& values, ModelGradients& gradients) {
  std::vector<Parameter> list;
  for_each_parameter(config, values, [&](const ParameterInfo& p, Matrix& m) {
    list.push_back({p.name, p.weight_decay, &m, nullptr});
  });
  size_t index = 0;
  for_each_parameter(config, gradients, [&](const ParameterInfo& p, Matrix& m) {
    if (m.rows() != list[index].value->rows() || m.cols() != list[index].value->cols()) {
      std::ostringstream message;
      message << "gradient " << p.name << " has shape [" << m.rows() << ", " << m.cols() << "]; expected its value's ["
              << list[index].value->rows() << ", " << list[index].value->cols() << "]";
      throw std::invalid_argument(message.str());
    }
    list[index++].gradient = &m;
  });
  return list;
}

// ---- forward ----

void check_model_weights(const ModelConfig& config, const ModelWeights& weights) {
  validate(config);
  if (static_cast<int64_t>(weights.blocks.size()) != config.num_layers) {
    throw std::invalid_argument("weights have " + std::to_string(weights.blocks.size()) +
                                " blocks; expected num_layers (L) = " + std::to_string(config.num_layers));
  }
  for_each_parameter(config, weights, [&](const ParameterInfo& p, const Matrix& m) {
    check_shape(p.name, m, p.rows, p.cols, "the shape in parameter_layout");
    check_finite(p.name, m);
  });
}

void check_model_inputs(const ModelConfig& config, const ModelWeights& weights, const IndexMatrix& inputs,
                        const IndexMatrix& targets) {
  check_model_weights(config, weights);
  check_bytes("inputs", inputs, config.seq_len);
  check_bytes("targets", targets, config.seq_len);
  if (targets.rows() != inputs.rows()) {
    throw std::invalid_argument("targets have " + std::to_string(targets.rows()) + " sequences; expected inputs' N = " +
                                std::to_string(inputs.rows()));
  }
}

ModelForward model_forward(const ModelConfig& config, const ModelWeights& weights, const IndexMatrix& inputs,
                           const IndexMatrix& targets) {
  check_model_inputs(config, weights, inputs, targets);
  const int64_t N = inputs.rows(), S = config.seq_len, T = N * S, D = config.model_dim;
  const MoeConfig layer = moe_layer_config(config, N);
  const std::vector<int64_t> moe = moe_blocks(config);

  ModelForward f;
  f.batch = N;
  f.x0.resize(T, D);
  for (int64_t t = 0; t < T; ++t) {
    f.x0.row(t) = weights.token_embedding.row(inputs(t / S, t % S)) + weights.position_embedding.row(t % S);
  }

  Matrix x = f.x0;
  std::optional<PreGateOutput> routing;  // pre-gated: this block's routing, made one MoE block earlier
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const BlockWeights& w = weights.blocks[i];
    BlockForward b;
    b.x = x;
    b.ln1 = layer_norm_forward(x, w.ln1.gain, w.ln1.bias, config.layer_norm_eps);
    b.attention = attention_forward(b.ln1.y, w.qkv_weights, w.out_weights, S, config.num_heads);
    b.x_mid = x + b.attention.out;
    b.ln2 = layer_norm_forward(b.x_mid, w.ln2.gain, w.ln2.bias, config.layer_norm_eps);
    if (is_moe_block(config, i)) {
      b.moe = routing ? pregated_moe_forward(layer, b.ln2.y, w.moe, *routing) : moe_forward(layer, b.ln2.y, w.moe);
      routing.reset();
      f.aux_loss += b.moe->aux_loss;
      f.z_loss += b.moe->z_loss;
      // Pre-gating: evaluate the next MoE block's gate on this block's FFN input.
      const auto next = std::upper_bound(moe.begin(), moe.end(), i);
      if (config.pregated && next != moe.end()) {
        b.next_routing = pregate(layer, b.ln2.y, weights.blocks[*next].moe.gate_weights);
        routing = b.next_routing;
      }
      x = b.x_mid + b.moe->y;
    } else {
      b.dense = dense_ffn_forward(b.ln2.y, w.ffn_w1, w.ffn_w2);
      x = b.x_mid + b.dense->out;
    }
    f.blocks.push_back(std::move(b));
  }

  f.final_ln = layer_norm_forward(x, weights.final_ln.gain, weights.final_ln.bias, config.layer_norm_eps);
  f.logits = f.final_ln.y * weights.token_embedding.transpose();
  f.probs.resize(T, kByteVocabulary);
  double loss_sum = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const double row_max = f.logits.row(t).maxCoeff();
    const Eigen::RowVectorXd shifted = (f.logits.row(t).array() - row_max).exp().matrix();
    const double sum = shifted.sum();
    f.probs.row(t) = shifted / sum;
    const double logsumexp = row_max + std::log(sum);
    loss_sum += logsumexp - f.logits(t, targets(t / S, t % S));
  }
  f.lm_loss = loss_sum / static_cast<double>(T);
  f.loss = f.lm_loss + config.aux_loss_coef * f.aux_loss + config.z_loss_coef * f.z_loss;
  return f;
}

// ---- backward ----

ModelGradients model_backward(const ModelConfig& config, const ModelWeights& weights, const IndexMatrix& inputs,
                              const IndexMatrix& targets, const ModelForward& forward) {
  check_model_inputs(config, weights, inputs, targets);
  const int64_t N = inputs.rows(), S = config.seq_len, T = N * S;
  if (forward.batch != N || static_cast<int64_t>(forward.blocks.size()) != config.num_layers) {
    throw std::invalid_argument("model_backward: forward was computed for another batch or config (N = " +
                                std::to_string(forward.batch) + ", inputs have N = " + std::to_string(N) + ")");
  }
  const MoeConfig layer = moe_layer_config(config, N);
  const std::vector<int64_t> moe = moe_blocks(config);
  ModelGradients g = zero_weights(config);

  // ---- cross-entropy and the tied output projection ----
  Matrix d_logits = forward.probs;  // d mean_t CE / d logits = (probs - one_hot(target)) / T
  for (int64_t t = 0; t < T; ++t) d_logits(t, targets(t / S, t % S)) -= 1.0;
  d_logits /= static_cast<double>(T);
  g.token_embedding = d_logits.transpose() * forward.final_ln.y;
  const Matrix d_final = d_logits * weights.token_embedding;
  LayerNormGradients final_ln = layer_norm_backward(forward.final_ln, weights.final_ln.gain, d_final);
  g.final_ln = {std::move(final_ln.gain), std::move(final_ln.bias)};
  Matrix dx = std::move(final_ln.x);  // d loss / d residual stream, walking back through the blocks

  // Pre-gated: the gradient that block m_j's gate sends into block m_{j-1}'s LN2 output.
  std::vector<Matrix> d_ln2_from_next_gate(config.num_layers);

  for (int64_t i = config.num_layers - 1; i >= 0; --i) {
    const BlockWeights& w = weights.blocks[i];
    const BlockForward& b = forward.blocks[i];
    BlockWeights& gb = g.blocks[i];

    // ---- x_out = x_mid + FFN(LN2(x_mid)) ----
    Matrix d_ln2;
    if (is_moe_block(config, i)) {
      const auto self = std::lower_bound(moe.begin(), moe.end(), i);
      if (config.pregated && self != moe.begin()) {
        const int64_t previous = *(self - 1);  // the block whose LN2 output this block's gate read
        PreGatedGradients moe_grads =
            pregated_moe_backward(layer, b.ln2.y, forward.blocks[previous].ln2.y, w.moe, *b.moe, dx);
        d_ln2_from_next_gate[previous] = std::move(moe_grads.router_input);
        gb.moe = {std::move(moe_grads.layer.gate_weights), std::move(moe_grads.layer.w1),
                  std::move(moe_grads.layer.w2)};
        d_ln2 = std::move(moe_grads.layer.x);
      } else {
        LayerGradients moe_grads = moe_backward(layer, b.ln2.y, w.moe, *b.moe, dx);
        gb.moe = {std::move(moe_grads.gate_weights), std::move(moe_grads.w1), std::move(moe_grads.w2)};
        d_ln2 = std::move(moe_grads.x);
      }
    } else {
      DenseFfnGradients ffn = dense_ffn_backward(b.ln2.y, w.ffn_w1, w.ffn_w2, *b.dense, dx);
      gb.ffn_w1 = std::move(ffn.w1);
      gb.ffn_w2 = std::move(ffn.w2);
      d_ln2 = std::move(ffn.x);
    }
    if (d_ln2_from_next_gate[i].size() > 0) d_ln2 += d_ln2_from_next_gate[i];
    LayerNormGradients ln2 = layer_norm_backward(b.ln2, w.ln2.gain, d_ln2);
    gb.ln2 = {std::move(ln2.gain), std::move(ln2.bias)};
    dx += ln2.x;

    // ---- x_mid = x + attention(LN1(x)) ----
    AttentionGradients attention =
        attention_backward(b.ln1.y, w.qkv_weights, w.out_weights, b.attention, dx, S, config.num_heads);
    gb.qkv_weights = std::move(attention.qkv_weights);
    gb.out_weights = std::move(attention.out_weights);
    LayerNormGradients ln1 = layer_norm_backward(b.ln1, w.ln1.gain, attention.x);
    gb.ln1 = {std::move(ln1.gain), std::move(ln1.bias)};
    dx += ln1.x;
  }

  // ---- embeddings: x0[t] = token_embedding[inputs[t]] + position_embedding[s] ----
  for (int64_t t = 0; t < T; ++t) {
    g.token_embedding.row(inputs(t / S, t % S)) += dx.row(t);
    g.position_embedding.row(t % S) += dx.row(t);
  }
  return g;
}

}  // namespace moe::ref
