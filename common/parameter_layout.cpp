// parameter_layout.cpp: the flat parameter list and its initial values (see parameter_layout.h).
#include "parameter_layout.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "uniform.h"  // uniform_symmetric

namespace moe {

std::vector<ParameterInfo> parameter_layout(const ModelConfig& config) {
  validate(config);
  const int64_t D = config.model_dim;
  std::vector<ParameterInfo> layout;
  int64_t offset = 0, block = -1;
  auto add = [&](std::string name, int64_t rows, int64_t cols, ParameterKind kind, int64_t expert = -1) {
    const bool decays = kind == ParameterKind::matrix || kind == ParameterKind::residual_projection;
    layout.push_back({std::move(name), rows, cols, offset, decays, kind, expert, block});
    offset += rows * cols;
  };
  add("token_embedding", kByteVocabulary, D, ParameterKind::matrix);
  add("position_embedding", config.seq_len, D, ParameterKind::matrix);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    block = i;
    const std::string prefix = "blocks." + std::to_string(i) + ".";
    add(prefix + "ln1.gain", 1, D, ParameterKind::gain);
    add(prefix + "ln1.bias", 1, D, ParameterKind::bias);
    add(prefix + "attention.qkv", D, 3 * D, ParameterKind::matrix);
    add(prefix + "attention.out", D, D, ParameterKind::residual_projection);
    add(prefix + "ln2.gain", 1, D, ParameterKind::gain);
    add(prefix + "ln2.bias", 1, D, ParameterKind::bias);
    if (is_moe_block(config, i)) {
      const int64_t E = config.num_experts, H = config.expert_hidden_dim;
      add(prefix + "moe.gate", D, E, ParameterKind::matrix);
      const int64_t columns = w1_columns(moe_layer_config(config, 1));
      for (int64_t e = 0; e < E; ++e) add(prefix + "moe.w1." + std::to_string(e), D, columns, ParameterKind::matrix, e);
      for (int64_t e = 0; e < E; ++e) {
        add(prefix + "moe.w2." + std::to_string(e), H, D, ParameterKind::residual_projection, e);
      }
    } else {
      add(prefix + "ffn.w1", D, config.dense_hidden_dim, ParameterKind::matrix);
      add(prefix + "ffn.w2", config.dense_hidden_dim, D, ParameterKind::residual_projection);
    }
  }
  block = -1;
  add("final_ln.gain", 1, D, ParameterKind::gain);
  add("final_ln.bias", 1, D, ParameterKind::bias);
  return layout;
}

int64_t parameter_count(const ModelConfig& config) {
  validate(config);  // which bounds the count, so it is there
  return *checked_parameter_count(config);
}

std::vector<double> initial_parameters(const ModelConfig& config, uint64_t seed) {
  const std::vector<ParameterInfo> layout = parameter_layout(config);
  std::vector<double> values(static_cast<size_t>(parameter_count(config)));
  std::mt19937_64 generator(seed);
  const double uniform_to_std = std::sqrt(3.0);  // U(-a, a) has standard deviation a / sqrt(3)
  const double matrix_std = 0.02;
  const double residual_std = matrix_std / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  for (const ParameterInfo& p : layout) {
    double* first = values.data() + p.offset;
    const int64_t size = p.rows * p.cols;
    switch (p.kind) {
      case ParameterKind::matrix:
        for (int64_t i = 0; i < size; ++i) first[i] = uniform_symmetric(generator, uniform_to_std * matrix_std);
        break;
      case ParameterKind::residual_projection:
        for (int64_t i = 0; i < size; ++i) first[i] = uniform_symmetric(generator, uniform_to_std * residual_std);
        break;
      case ParameterKind::gain: std::fill(first, first + size, 1.0); break;
      case ParameterKind::bias: std::fill(first, first + size, 0.0); break;
    }
  }
  return values;
}

}  // namespace moe
