// model_weights_file.cpp: the model's flat weights in and out of a safetensors file (see
// model_weights_file.h).
#include "model_weights_file.h"

#include <algorithm>  // copy
#include <cmath>
#include <set>
#include <stdexcept>

#include "config_json.h"  // model_config_to_json, model_config_from_json, inference_differences
#include "untrusted_json.h"  // parse_untrusted_json, json_excerpt

namespace moe {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& message) {
  throw SafetensorsError(path.string() + ": " + message);
}

std::map<std::string, std::string> metadata_for(const ModelConfig& config,
                                                const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> metadata = extra;
  metadata["layout"] = kWeightsLayout;
  metadata["model_config"] = model_config_to_json(config).dump();
  return metadata;
}

// Views of a flat buffer in parameter_layout's order, one per tensor of weight_tensors.
template <typename T>
std::vector<TensorView> flat_views(const ModelConfig& config, std::span<const T> flat) {
  std::vector<TensorView> views;
  for (const WeightTensor& tensor : weight_tensors(config)) {
    views.push_back(tensor_view(tensor.name, tensor.shape, flat.subspan(tensor.offset, tensor.elements)));
  }
  return views;
}

LoadedWeights read_weights(const std::filesystem::path& path, const SafetensorsFile& file, const ModelConfig& config) {
  // Before any list or buffer of the model's size: the tensors must hold every parameter in at least
  // the narrowest weight dtype (BF16 / F16, 2 bytes), so a model_config that describes more than the
  // file holds is refused here, whatever it claims.
  const int64_t count = parameter_count(config);
  const uint64_t data_bytes = file.tensors().empty() ? 0 : file.tensors().back().end;  // no holes: the last end
  if (static_cast<uint64_t>(count) > data_bytes / 2) {
    fail(path, "__metadata__'s model_config describes " + std::to_string(count) + " parameters (parameter count), " +
                   "at least " + std::to_string(2 * static_cast<uint64_t>(count)) + " bytes of tensors; the file's " +
                   "tensors hold " + std::to_string(data_bytes) + " bytes");
  }
  LoadedWeights model;
  model.config = config;
  model.metadata = file.metadata();
  const std::vector<WeightTensor> tensors = weight_tensors(config);
  std::set<std::string> expected;
  for (const WeightTensor& tensor : tensors) expected.insert(tensor.name);
  for (const TensorInfo& info : file.tensors()) {
    if (!expected.contains(info.name)) fail(path, "has a tensor '" + info.name + "' that the model has no parameter for");
  }

  std::vector<double> flat(static_cast<size_t>(count));
  for (const WeightTensor& tensor : tensors) {
    if (!file.contains(tensor.name)) fail(path, "has no tensor named '" + tensor.name + "'; the model needs it");
    const TensorInfo& info = file.info(tensor.name);
    if (info.shape != tensor.shape) {
      fail(path, "tensor '" + tensor.name + "' has shape " + shape_text(info.shape) + "; the model needs " +
                     shape_text(tensor.shape));
    }
    if (info.dtype != Dtype::f32 && info.dtype != Dtype::f64 && info.dtype != Dtype::bf16 && info.dtype != Dtype::f16) {
      fail(path, "tensor '" + tensor.name + "' is " + std::string(to_string(info.dtype)) +
                     "; weights are F32, F64, BF16 or F16");
    }
    const std::vector<double> values = file.to_double(tensor.name);
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        fail(path, "tensor '" + tensor.name + "' entry " + std::to_string(i) + " is " + std::to_string(values[i]) +
                       "; weights must be finite");
      }
    }
    std::copy(values.begin(), values.end(), flat.begin() + tensor.offset);
  }

  model.flat = std::move(flat);
  return model;
}

ModelConfig config_of(const std::filesystem::path& path, const SafetensorsFile& file) {
  const auto layout = file.metadata().find("layout");
  if (layout == file.metadata().end() || layout->second != kWeightsLayout) {
    fail(path, std::string("is not a weights file of the reference model: __metadata__ has layout ") +
                   (layout == file.metadata().end() ? "(none)" : "'" + layout->second + "'") + ", expected '" +
                   kWeightsLayout + "'");
  }
  const auto text = file.metadata().find("model_config");
  if (text == file.metadata().end()) fail(path, "__metadata__ has no model_config");
  nlohmann::json json;
  if (const std::string why = parse_untrusted_json(text->second, json); !why.empty()) {
    fail(path, "__metadata__'s model_config: " + why);
  }
  try {
    return model_config_from_json(json);
  } catch (const std::invalid_argument& error) {
    fail(path, std::string("__metadata__'s ") + error.what());
  }
}

}  // namespace

std::vector<WeightTensor> weight_tensors(const ModelConfig& config) {
  std::vector<WeightTensor> tensors;
  for (const ParameterInfo& p : parameter_layout(config)) {
    // An expert matrix "blocks.i.moe.w1.e": expert 0 opens the stacked tensor, the others extend it.
    const size_t moe = p.name.find(".moe.w");
    if (moe != std::string::npos) {
      const std::string which = p.name.substr(moe + 5, 2);  // "w1" or "w2"
      if (p.name.substr(moe + 8) == "0") {
        tensors.push_back({p.name.substr(0, moe) + ".moe.experts." + which, {0, p.rows, p.cols}, p.offset, 0});
      }
      tensors.back().shape[0] += 1;
      tensors.back().elements += p.rows * p.cols;
      continue;
    }
    const bool vector = p.name.ends_with(".gain") || p.name.ends_with(".bias");
    tensors.push_back({p.name, vector ? std::vector<int64_t>{p.cols} : std::vector<int64_t>{p.rows, p.cols}, p.offset,
                       p.rows * p.cols});
  }
  return tensors;
}

namespace {

template <typename T>
void save_flat(const std::filesystem::path& path, const ModelConfig& config, std::span<const T> flat_weights,
               const std::map<std::string, std::string>& extra_metadata) {
  validate(config);
  const int64_t count = parameter_count(config);
  if (static_cast<int64_t>(flat_weights.size()) != count) {
    fail(path, "the flat weights have " + std::to_string(flat_weights.size()) + " values; the model has " +
                   std::to_string(count) + " parameters");
  }
  for (size_t i = 0; i < flat_weights.size(); ++i) {
    if (!std::isfinite(flat_weights[i])) {
      fail(path, "flat weight " + std::to_string(i) + " is " + std::to_string(flat_weights[i]) + "; weights must be finite");
    }
  }
  save_safetensors(path, flat_views(config, flat_weights), metadata_for(config, extra_metadata));
}

}  // namespace

void save_flat_weights_safetensors(const std::filesystem::path& path, const ModelConfig& config,
                                   std::span<const float> flat_weights,
                                   const std::map<std::string, std::string>& extra_metadata) {
  save_flat(path, config, flat_weights, extra_metadata);
}

void save_flat_weights_safetensors(const std::filesystem::path& path, const ModelConfig& config,
                                   std::span<const double> flat_weights, Dtype dtype,
                                   const std::map<std::string, std::string>& extra_metadata) {
  if (dtype == Dtype::f64) {
    save_flat(path, config, flat_weights, extra_metadata);
  } else if (dtype == Dtype::f32) {
    const std::vector<float> narrow(flat_weights.begin(), flat_weights.end());
    save_flat(path, config, std::span<const float>(narrow), extra_metadata);
  } else {
    fail(path, "weights are saved as F32 or F64, not " + std::string(to_string(dtype)));
  }
}

LoadedWeights load_flat_weights_safetensors(const std::filesystem::path& path) {
  const SafetensorsFile file = SafetensorsFile::load(path);
  return read_weights(path, file, config_of(path, file));
}

LoadedWeights load_flat_weights_safetensors(const std::filesystem::path& path, const ModelConfig& expected) {
  validate(expected);
  const SafetensorsFile file = SafetensorsFile::load(path);
  const ModelConfig config = config_of(path, file);
  const std::vector<std::string> differences = inference_differences(config, "the file", expected, "the model being built");
  if (!differences.empty()) {
    std::string list;
    for (const std::string& difference : differences) list += (list.empty() ? "" : "; ") + difference;
    fail(path, "the weights belong to another model: " + list);
  }
  return read_weights(path, file, config);
}

}  // namespace moe
