// model_safetensors.cpp: the reference's matrices in and out of the weights file (see
// model_safetensors.h).
#include "model_safetensors.h"

#include <vector>

namespace moe::ref {

namespace {

LoadedModel in_matrices(LoadedWeights&& loaded) {
  LoadedModel model;
  model.config = loaded.config;
  model.metadata = std::move(loaded.metadata);
  model.weights = from_flat(loaded.config, loaded.flat);
  return model;
}

}  // namespace

void save_model_safetensors(const std::filesystem::path& path, const ModelConfig& config, const ModelWeights& weights,
                            Dtype dtype, const std::map<std::string, std::string>& extra_metadata) {
  check_model_weights(config, weights);
  const std::vector<double> flat = to_flat(config, weights);
  save_flat_weights_safetensors(path, config, std::span<const double>(flat), dtype, extra_metadata);
}

LoadedModel load_model_safetensors(const std::filesystem::path& path) {
  return in_matrices(load_flat_weights_safetensors(path));
}

LoadedModel load_model_safetensors(const std::filesystem::path& path, const ModelConfig& expected) {
  return in_matrices(load_flat_weights_safetensors(path, expected));
}

}  // namespace moe::ref
