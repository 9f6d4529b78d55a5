// model_safetensors.h: the CPU reference's weights (ModelWeights, Eigen) in and out of the model's
// weights file (common/model_weights_file.h: the names, shapes, metadata and checks). Part of the
// CPU reference (moe::ref); tested by tests/reference_cpu/test_model_safetensors.cpp:
//   cmake --build build --target test_reference_cpu_model_safetensors && ctest --test-dir build -R ReferenceWeights
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "model.h"               // ModelWeights
#include "model_config.h"        // ModelConfig
#include "model_weights_file.h"  // weight_tensors, save_flat_weights_safetensors, load_flat_weights_safetensors

namespace moe::ref {

// Writes the weights (checked with check_model_weights) as F32 or F64 (exact), atomically.
// Throws SafetensorsError for a file that cannot be written, std::invalid_argument for bad weights.
void save_model_safetensors(const std::filesystem::path& path, const ModelConfig& config, const ModelWeights& weights,
                            Dtype dtype = Dtype::f32, const std::map<std::string, std::string>& extra_metadata = {});

struct LoadedModel {
  ModelConfig config;    // from the file's model_config
  ModelWeights weights;  // converted to double (the file may hold F32, F64, BF16 or F16)
  std::map<std::string, std::string> metadata;
};

// load_flat_weights_safetensors (model_weights_file.h), in this reference's matrices.
LoadedModel load_model_safetensors(const std::filesystem::path& path);
LoadedModel load_model_safetensors(const std::filesystem::path& path, const ModelConfig& expected);

}  // namespace moe::ref
