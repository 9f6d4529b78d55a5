// fuzz_reader_seeds.cpp: writes the seed corpora of the readers' fuzz targets, one directory each
// under OUT_DIR, from the project's own writers, so every seed is a valid file to mutate:
//   checkpoint/   checkpoints of two small models without their last 8 bytes (fuzz_checkpoint.cpp
//                 appends the checksum)
//   safetensors/  the same models' weights files (F32 and F64), and a file of assorted dtypes
//   npy/          arrays of each dtype, a 0-d one and an empty one
//   config/       the models' and an MoE layer's configs as JSON
//   fuzz_reader_seeds OUT_DIR      (tests/common/CMakeLists.txt runs it before each bounded fuzz run)
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint.h"
#include "config_json.h"
#include "model_weights_file.h"
#include "npy.h"
#include "parameter_layout.h"
#include "safetensors.h"

namespace fs = std::filesystem;

namespace {

void write(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_reader_seeds OUT_DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  for (const char* kind : {"checkpoint", "safetensors", "npy", "config"}) fs::create_directories(out / kind);

  moe::ModelConfig tiny;  // D = 8, two blocks, one dense
  tiny.model_dim = 8;
  tiny.num_heads = 2;
  tiny.seq_len = 4;
  tiny.moe_layers = moe::MoeLayers::every_other_block;
  tiny.dense_hidden_dim = 8;
  tiny.num_experts = 2;
  tiny.expert_hidden_dim = 8;
  tiny.block_size = 4;
  moe::ModelConfig swiglu = tiny;
  swiglu.moe_layers = moe::MoeLayers::every_block;
  swiglu.activation = moe::Activation::swiglu;
  swiglu.num_layers = 1;
  int index = 0;
  for (const moe::ModelConfig& config : {tiny, swiglu}) {
    const std::string n = std::to_string(index++);
    const std::vector<double> weights = moe::initial_parameters(config, 1);
    const std::vector<float> narrow(weights.begin(), weights.end());
    write(out / "config" / ("model_" + n + ".json"), moe::model_config_to_json(config).dump());
    moe::save_flat_weights_safetensors(out / "safetensors" / ("weights_f32_" + n), config, narrow);
    moe::save_flat_weights_safetensors(out / "safetensors" / ("weights_f64_" + n), config, std::span<const double>(weights),
                                       moe::Dtype::f64);
    moe::CheckpointHeader header;
    header.model_config = moe::model_config_to_json(config);
    header.step = 3;
    const fs::path checkpoint = out / "checkpoint" / ("checkpoint_" + n + ".full");
    moe::save_checkpoint(checkpoint, header, {{"weights", narrow}, {"adam_m", narrow}});
    const std::string bytes = read(checkpoint);
    write(out / "checkpoint" / ("checkpoint_" + n), bytes.substr(0, bytes.size() - 8));
    fs::remove(checkpoint);
  }
  const std::vector<float> f32{1.5f, -2.0f, 0.25f, 8.0f};
  const std::vector<double> f64{1.0, 2.0};
  const std::vector<int32_t> i32{1, -1, 7};
  const std::vector<int64_t> i64{1ll << 40};
  moe::save_safetensors(out / "safetensors" / "assorted",
                        {moe::tensor_view("a", {2, 2}, std::span<const float>(f32)),
                         moe::tensor_view("b", {2}, std::span<const double>(f64)),
                         moe::tensor_view("c", {3}, std::span<const int32_t>(i32)),
                         moe::tensor_view("scalar", {}, std::span<const int64_t>(i64))},
                        {{"format", "pt"}});

  moe::MoeConfig layer;
  layer.tokens = 16;
  layer.model_dim = 8;
  layer.hidden_dim = 16;
  layer.num_experts = 4;
  layer.top_k = 2;
  layer.block_size = 4;
  write(out / "config" / "moe_layer.json", nlohmann::json(layer).dump());

  auto npy = [&](const std::string& name, const std::string& dtype, std::vector<int64_t> shape, size_t bytes) {
    moe::NpyArray array;
    array.dtype = dtype;
    array.shape = std::move(shape);
    array.data.assign(bytes, 0x3f);
    write(out / "npy" / name, moe::serialize_npy(array));
  };
  npy("f4_2x3", "<f4", {2, 3}, 24);
  npy("f8_3", "<f8", {3}, 24);
  npy("i4_0d", "<i4", {}, 4);
  npy("i8_empty", "<i8", {0, 5}, 0);
  npy("u1_4x1x2", "|u1", {4, 1, 2}, 8);
  npy("u2_3", "<u2", {3}, 6);
  std::printf("fuzz_reader_seeds: seeds in %s/{checkpoint,safetensors,npy,config}\n", out.string().c_str());
  return 0;
}
