// export_safetensors.cpp: the command-line tool moe_export_weights: a training run's checkpoint
// (common/checkpoint.h, written by moe_train) as model.safetensors, the weights file that inference
// loads (reference_cpu/model_safetensors.h; names and shapes in reference_cpu/README.md).
//
//   cmake --build build --target moe_export_weights
//   build/reference_cpu/moe_export_weights --checkpoint runs/default --out model.safetensors
//
// The checkpoint's "weights" array is the fp32 master weights in parameter_layout's order; they are
// written as they are (F32), with the checkpoint's model config in the file's metadata. AdamW's
// moments stay behind: inference does not need them. Exit status: 0 done or --help, 2 bad input
// (the message says what and where), nothing written in that case.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.h"       // CLI::App, parse_command_line
#include "checkpoint.h"         // load_checkpoint, latest_checkpoint, CheckpointError
#include "config_json.h"  // model_config_from_json
#include "model_safetensors.h"  // save_flat_weights_safetensors
#include "parameter_layout.h"   // parameter_count
#include "program_exit.h"       // check_output_path

namespace {

namespace fs = std::filesystem;

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A file as it is; a directory's latest checkpoint, looking in its checkpoints/ first (a run directory).
fs::path resolve_checkpoint(const fs::path& path) {
  std::error_code error;
  if (fs::is_regular_file(path, error)) return path;
  if (!fs::is_directory(path, error)) throw BadInput(path.string() + ": no such checkpoint file or run directory");
  for (const fs::path& directory : {path / "checkpoints", path}) {
    if (const std::optional<fs::path> latest = moe::latest_checkpoint(directory)) return *latest;
  }
  throw BadInput(path.string() + ": no checkpoint_<step>.ckpt in it or in its checkpoints/ directory");
}

int run(const std::vector<std::string>& arguments) {
  std::optional<std::string> checkpoint;
  std::string out = "model.safetensors";
  CLI::App app{"usage: moe_export_weights --checkpoint PATH [--out FILE]\n"
               "  Writes a training checkpoint's weights as a safetensors file for inference.",
               "moe_export_weights"};
  app.add_option("--checkpoint", checkpoint,
                 "a checkpoint file (checkpoint_00001000.ckpt), or a run directory or its checkpoints/ directory, "
                 "whose latest checkpoint is taken (required)")
      ->type_name("PATH");
  app.add_option("--out", out, "the file to write; written atomically")->type_name("FILE")->capture_default_str();
  if (const std::optional<int> exit_status = moe::parse_command_line(app, arguments)) return *exit_status;
  if (!checkpoint) throw BadInput("--checkpoint PATH is required (--help)");
  moe::check_output_path("--out", out, {{"--checkpoint", *checkpoint}});  // before reading hundreds of megabytes

  const fs::path source = resolve_checkpoint(*checkpoint);
  const moe::LoadedCheckpoint loaded = moe::load_checkpoint(source);
  moe::ModelConfig config;
  try {
    config = moe::model_config_from_json(loaded.header.model_config);
  } catch (const std::invalid_argument& error) {
    throw BadInput(source.string() + ": its " + error.what());
  }
  const std::vector<float>& weights = loaded.array("weights");
  if (const int64_t count = moe::parameter_count(config); static_cast<int64_t>(weights.size()) != count) {
    throw BadInput(source.string() + ": its weights hold " + std::to_string(weights.size()) +
                   " values; its model config has " + std::to_string(count) + " parameters (parameter count)");
  }
  moe::save_flat_weights_safetensors(out, config, weights,
                                          {{"source_checkpoint", source.string()},
                                           {"step", std::to_string(loaded.header.step)},
                                           {"tokens_seen", std::to_string(loaded.header.tokens_seen)}});
  std::printf("wrote %s: %zu parameters (F32, %.1f MB) from %s (step %lld): D=%lld L=%lld, MoE %s, E=%lld K=%lld%s\n",
              out.c_str(), weights.size(), 4.0 * static_cast<double>(weights.size()) / 1e6, source.string().c_str(),
              static_cast<long long>(loaded.header.step), static_cast<long long>(config.model_dim),
              static_cast<long long>(config.num_layers), std::string(to_string(config.moe_layers)).c_str(),
              static_cast<long long>(config.num_experts), static_cast<long long>(config.top_k),
              config.pregated ? ", pre-gated" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& error) {  // BadInput, CheckpointError, SafetensorsError: each names its file
    std::fprintf(stderr, "moe_export_weights: %s\n", error.what());
    return 2;
  }
}
