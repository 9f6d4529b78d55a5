// model_weights_file.h: the language model's weights as a safetensors file (safetensors.h), the file
// that inference loads (cuda/infer) and that numpy, PyTorch and JAX read as they are. Plain C++ over
// the flat parameter list (parameter_layout.h); the CPU reference reads and writes its matrices
// through it (reference_cpu/model_safetensors.h). Tested by tests/reference_cpu/test_model_safetensors.cpp:
//   cmake --build build --target test_reference_cpu_model_safetensors && ctest --test-dir build -R ReferenceWeights
//
// Dimension legend (README.md): V = 256, D, S, L, E, H, H_dense; W1 = H (GeLU) or 2H (SwiGLU).
//
// One tensor per parameter of parameter_layout (parameter_layout.h), in its order, except that the E expert
// matrices of a block are one stacked tensor: blocks.i.moe.w1.0 .. w1.{E-1} become
// blocks.i.moe.experts.w1 [E, D, W1]. They are adjacent in the flat parameter list, so the data
// section is the flat buffer itself, and expert e of a block is one contiguous slice of it (what a
// copy engine moves to the GPU). LayerNorm gains and biases are vectors [D]. Every matrix is
// [inputs, outputs] as the model multiplies it (y = x W), the transpose of torch.nn.Linear's weight.
//
//   token_embedding [V, D], position_embedding [S, D]
//   blocks.i.ln1.gain [D], blocks.i.ln1.bias [D], blocks.i.attention.qkv [D, 3D],
//   blocks.i.attention.out [D, D], blocks.i.ln2.gain [D], blocks.i.ln2.bias [D],
//   dense block: blocks.i.ffn.w1 [D, H_dense], blocks.i.ffn.w2 [H_dense, D]
//   MoE block:   blocks.i.moe.gate [D, E], blocks.i.moe.experts.w1 [E, D, W1], blocks.i.moe.experts.w2 [E, H, D]
//   final_ln.gain [D], final_ln.bias [D]
//
// __metadata__ (strings, as the format requires):
//   "layout"        "moe-reference-1": the names and shapes above
//   "model_config"  model_config_to_json (config_json.h), so a loader can check that the
//                   weights belong to the model it builds
// and whatever the writer adds (the export tool adds the checkpoint and its step).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "model_config.h"      // ModelConfig
#include "parameter_layout.h"  // parameter_layout, parameter_count
#include "safetensors.h"       // Dtype, SafetensorsError

namespace moe {

inline constexpr const char* kWeightsLayout = "moe-reference-1";

struct WeightTensor {
  std::string name;            // "blocks.1.moe.experts.w1"
  std::vector<int64_t> shape;  // [E, D, W1]
  int64_t offset = 0;          // first entry in parameter_layout's flat buffer
  int64_t elements = 0;        // product of shape
};

// Every tensor of the file for config's model, in file order (which is parameter_layout's).
std::vector<WeightTensor> weight_tensors(const ModelConfig& config);

// Writes a flat buffer in parameter_layout's order (e.g. a training checkpoint's "weights" array),
// without a copy: parameter_count(config) finite values, atomically. The double form writes F64
// (exact) or F32. Throws SafetensorsError naming the file and the fault.
void save_flat_weights_safetensors(const std::filesystem::path& path, const ModelConfig& config,
                                   std::span<const float> flat_weights,
                                   const std::map<std::string, std::string>& extra_metadata = {});
void save_flat_weights_safetensors(const std::filesystem::path& path, const ModelConfig& config,
                                   std::span<const double> flat_weights, Dtype dtype,
                                   const std::map<std::string, std::string>& extra_metadata = {});

struct LoadedWeights {
  ModelConfig config;         // from the file's model_config
  std::vector<double> flat;   // parameter_layout's order, converted to double (the file may hold F32, F64, BF16 or F16)
  std::map<std::string, std::string> metadata;
};

// Reads the file and the model its metadata describes. Throws SafetensorsError naming the file and
// the fault: not this layout, no or bad model_config, a missing or unexpected tensor, a wrong shape
// or dtype, a value that is not finite.
LoadedWeights load_flat_weights_safetensors(const std::filesystem::path& path);

// As above, and first checks that the file's model is `expected` in every field that decides what
// it computes (inference_differences, config_json.h): a mismatch names each field that differs.
LoadedWeights load_flat_weights_safetensors(const std::filesystem::path& path, const ModelConfig& expected);

}  // namespace moe
