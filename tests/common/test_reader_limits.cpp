// test_reader_limits.cpp: sizes from untrusted files are bounded before anything is allocated:
// checked 64-bit arithmetic (checked_size.h), the configs' upper limits (moe_config.h,
// model_config.h) and the parameter count, and each reader (checkpoint, safetensors and the model
// weights file, .npy) refusing a header that demands more than the file holds, an overflowing size
// or a config beyond a limit, with an error naming the field.
//   ctest --test-dir build -R ReaderLimits
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checked_size.h"
#include "checkpoint.h"
#include "config_json.h"
#include "model_config.h"
#include "model_weights_file.h"
#include "npy.h"
#include "parameter_layout.h"
#include "safetensors.h"
#include "temp_dir.h"

namespace moe {
namespace {

using ::testing::HasSubstr;
using moe::testing::TempDir;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// The message of the std::invalid_argument that validate(config) throws ("" if it throws none).
template <typename Config>
std::string rejection(const Config& config) {
  try {
    validate(config);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

TEST(CheckedSize, OverflowAndNegativeGiveNothing) {
  EXPECT_EQ(checked_multiply(int64_t{1} << 31, int64_t{1} << 31), int64_t{1} << 62);
  EXPECT_FALSE(checked_multiply(int64_t{1} << 32, int64_t{1} << 31));
  EXPECT_FALSE(checked_multiply(-1, 2));
  EXPECT_EQ(checked_add(kInt64Max - 1, 1), kInt64Max);
  EXPECT_FALSE(checked_add(kInt64Max, 1));
  EXPECT_FALSE(checked_add(-1, 1));
  EXPECT_EQ(checked_product({}), 1);
  EXPECT_EQ(checked_product({3, 4, 5}), 60);
  EXPECT_FALSE(checked_product({int64_t{1} << 40, int64_t{1} << 40}));
  EXPECT_EQ(checked_product({int64_t{1} << 40, int64_t{1} << 40, 0}), 0);  // an empty tensor holds nothing
  EXPECT_FALSE(checked_product({int64_t{1} << 40, -1, 0}));
}

TEST(ReaderLimits, MoeConfigSizesHaveUpperLimits) {
  MoeConfig base;
  base.tokens = 64;
  base.model_dim = 32;
  base.hidden_dim = 128;
  base.num_experts = 4;
  base.block_size = 32;
  ASSERT_EQ(rejection(base), "");
  struct Case {
    int64_t MoeConfig::*field;
    int64_t limit;
    const char* name;
  };
  for (const Case& c : {Case{&MoeConfig::tokens, kMaxTokens, "tokens (T)"},
                        Case{&MoeConfig::model_dim, kMaxModelDim, "model_dim (D)"},
                        Case{&MoeConfig::hidden_dim, kMaxHiddenDim, "hidden_dim (H)"},
                        Case{&MoeConfig::num_experts, kMaxExperts, "num_experts (E)"},
                        Case{&MoeConfig::block_size, kMaxBlockSize, "block_size (B)"}}) {
    MoeConfig config = base;
    config.formulation = Formulation::dropping;  // H need not be a multiple of B
    config.*c.field = c.limit;
    EXPECT_EQ(rejection(config), "") << c.name << " at its limit";
    config.*c.field = c.limit + 1;
    EXPECT_THAT(rejection(config), HasSubstr(std::string(c.name) + " = " + std::to_string(c.limit + 1) +
                                             "; allowed: 1 <= "));
    config.*c.field = kInt64Max;
    EXPECT_THAT(rejection(config), HasSubstr(c.name));
  }
  // The capacity factor of the dropping and padded formulations: C = ceil(cf T K / E) stays an
  // integer a size can hold (a factor of 1e26 would convert to one undefined).
  MoeConfig dropping = base;
  dropping.formulation = Formulation::dropping;
  dropping.capacity_factor = kMaxCapacityFactor;
  EXPECT_EQ(rejection(dropping), "");
  for (const double factor : {kMaxCapacityFactor * 1.001, 1e26}) {
    dropping.capacity_factor = factor;
    EXPECT_THAT(rejection(dropping), HasSubstr("capacity_factor")) << factor;
  }
}

TEST(ReaderLimits, ModelConfigSizesHaveUpperLimits) {
  struct Case {
    int64_t ModelConfig::*field;
    int64_t limit;
    const char* name;
  };
  for (const Case& c : {Case{&ModelConfig::model_dim, kMaxModelDim, "model_dim (D)"},
                        Case{&ModelConfig::num_layers, kMaxLayers, "num_layers (L)"},
                        Case{&ModelConfig::seq_len, kMaxSeqLen, "seq_len (S)"},
                        Case{&ModelConfig::dense_hidden_dim, kMaxHiddenDim, "dense_hidden_dim (H_dense)"},
                        Case{&ModelConfig::num_experts, kMaxExperts, "num_experts (E)"},
                        Case{&ModelConfig::expert_hidden_dim, kMaxHiddenDim, "hidden_dim (H)"},
                        Case{&ModelConfig::block_size, kMaxBlockSize, "block_size (B)"}}) {
    ModelConfig config;
    config.moe_layers = MoeLayers::every_other_block;  // dense_hidden_dim is used
    config.formulation = Formulation::dropping;        // H need not be a multiple of B
    config.*c.field = c.limit + 1;
    EXPECT_THAT(rejection(config), HasSubstr(std::string(c.name) + " = " + std::to_string(c.limit + 1)));
    config.*c.field = int64_t{1} << 62;
    EXPECT_THAT(rejection(config), HasSubstr(c.name));
  }
  ModelConfig at_limit;
  at_limit.num_layers = kMaxLayers;
  at_limit.seq_len = kMaxSeqLen;
  EXPECT_EQ(rejection(at_limit), "");
}

TEST(ReaderLimits, ParameterCountIsBoundedAndMatchesTheLayout) {
  ModelConfig big;  // every size within its limit, the whole far beyond 2^36 parameters
  big.model_dim = kMaxModelDim;
  big.num_layers = kMaxLayers;
  big.num_experts = kMaxExperts;
  big.expert_hidden_dim = kMaxHiddenDim;
  EXPECT_THAT(rejection(big), HasSubstr("parameter count = "));
  EXPECT_THAT(rejection(big), HasSubstr("at most " + std::to_string(kMaxParameters)));
  EXPECT_TRUE(checked_parameter_count(big));  // the limits keep even this inside 64 bits
  ModelConfig wrapping;  // unvalidated sizes whose sums and products would wrap give nothing
  wrapping.seq_len = kInt64Max;
  EXPECT_FALSE(checked_parameter_count(wrapping));
  wrapping = ModelConfig{};
  wrapping.model_dim = kInt64Max;
  EXPECT_FALSE(checked_parameter_count(wrapping));
  wrapping = ModelConfig{};
  wrapping.num_experts = int64_t{1} << 40;
  wrapping.expert_hidden_dim = int64_t{1} << 30;
  EXPECT_FALSE(checked_parameter_count(wrapping));

  for (MoeLayers layers : {MoeLayers::every_block, MoeLayers::every_other_block, MoeLayers::none}) {
    for (Activation activation : {Activation::gelu, Activation::swiglu}) {
      ModelConfig config;
      config.num_layers = 3;
      config.moe_layers = layers;
      config.activation = activation;
      config.dense_hidden_dim = 96;
      const std::vector<ParameterInfo> layout = parameter_layout(config);
      const int64_t listed = layout.back().offset + layout.back().rows * layout.back().cols;
      EXPECT_EQ(parameter_count(config), listed) << to_string(layers) << " " << to_string(activation);
    }
  }
}

// A checkpoint file's bytes with a valid checksum (checkpoint.h's format) whose header is `header`
// and whose data section is `data_floats` floats.
std::string checkpoint_bytes(const nlohmann::json& header, size_t data_floats) {
  const std::string text = header.dump();
  std::string bytes("MOECKPT\0", 8);
  const uint32_t version = kCheckpointFormatVersion, reserved = 0;
  const uint64_t length = text.size();
  bytes.append(reinterpret_cast<const char*>(&version), 4);
  bytes.append(reinterpret_cast<const char*>(&reserved), 4);
  bytes.append(reinterpret_cast<const char*>(&length), 8);
  bytes += text;
  bytes.append(data_floats * sizeof(float), '\0');
  const uint64_t checksum = fnv1a_64(bytes.data(), bytes.size());
  bytes.append(reinterpret_cast<const char*>(&checksum), 8);
  return bytes;
}

nlohmann::json checkpoint_header(const nlohmann::json& model_config, uint64_t floats) {
  return {{"model_config", model_config}, {"step", 1}, {"tokens_seen", 1}, {"optimizer_step", 1},
          {"schedule_step", 1}, {"sampler_state", "0x0000000000000001"},
          {"validation_sampler_state", "0x0000000000000002"}, {"model_seed", "0x0000000000000003"},
          {"data_seed", "0x0000000000000004"}, {"run_directory", ""},
          {"arrays", {{{"name", "weights"}, {"floats", floats}, {"offset", 0}}}}};
}

// The default model's config as JSON with `overrides` applied.
nlohmann::json model_config_with(const nlohmann::json& overrides) {
  nlohmann::json config = model_config_to_json(ModelConfig{});
  config.update(overrides);
  return config;
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(ReaderLimits, CheckpointArrayBeyondTheFileIsRefused) {
  TempDir dir;
  for (uint64_t floats : {uint64_t{17}, uint64_t{1} << 62, std::numeric_limits<uint64_t>::max()}) {
    const std::filesystem::path path = dir.path() / "checkpoint.ckpt";
    write_file(path, checkpoint_bytes(checkpoint_header(nlohmann::json::object(), floats), 16));
    try {
      load_checkpoint(path);
      ADD_FAILURE() << floats << " floats in a file of 16 were accepted";
    } catch (const CheckpointError& error) {
      EXPECT_THAT(error.what(), HasSubstr("array weights (offset 0, " + std::to_string(floats) + " floats)"));
    }
  }
}

TEST(ReaderLimits, CheckpointConfigBeyondALimitNamesTheField) {
  TempDir dir;
  const std::filesystem::path path = dir.path() / "checkpoint.ckpt";
  for (const auto& [field, name] : {std::pair{"num_layers", "num_layers (L)"}, std::pair{"model_dim", "model_dim (D)"},
                                    std::pair{"num_experts", "num_experts (E)"}, std::pair{"seq_len", "seq_len (S)"}}) {
    write_file(path, checkpoint_bytes(checkpoint_header(model_config_with({{field, int64_t{1} << 62}}), 16), 16));
    const LoadedCheckpoint loaded = load_checkpoint(path);  // the file itself is well formed
    try {
      model_config_from_json(loaded.header.model_config);
      ADD_FAILURE() << field << " = 2^62 was accepted";
    } catch (const std::invalid_argument& error) {
      EXPECT_THAT(error.what(), HasSubstr(std::string(name) + " = 4611686018427387904; allowed: 1 <= "));
    }
  }
}

// A weights file (model_weights_file.h) whose __metadata__ describes the default model with
// `model_config` applied, but whose one tensor holds 16 floats.
std::string weights_bytes(const nlohmann::json& model_config) {
  const std::vector<float> values(16, 0.5f);
  return encode_safetensors({tensor_view("token_embedding", {16}, std::span<const float>(values))},
                            {{"layout", kWeightsLayout}, {"model_config", model_config_with(model_config).dump()}});
}

TEST(ReaderLimits, WeightsFileModelBeyondTheFileIsRefused) {
  TempDir dir;
  const std::filesystem::path path = dir.path() / "model.safetensors";
  struct Case {
    nlohmann::json config;
    const char* expected;
  };
  for (const Case& c : {Case{{{"model_dim", int64_t{1} << 62}}, "model_dim (D) = 4611686018427387904"},
                        Case{{{"num_experts", kMaxExperts + 1}}, "num_experts (E) = 1025"},
                        Case{{{"num_layers", kMaxLayers}, {"model_dim", 4096}, {"num_experts", 64}},
                             "parameter count = "},
                        // within every limit, yet ~ 17 billion parameters in a file of 64 bytes
                        Case{{{"num_layers", 64}, {"model_dim", 4096}, {"num_experts", 8}, {"expert_hidden_dim", 4096}},
                             "parameters (parameter count), at least "}}) {
    write_file(path, weights_bytes(c.config));
    try {
      load_flat_weights_safetensors(path);
      ADD_FAILURE() << c.config.dump() << " was accepted";
    } catch (const SafetensorsError& error) {
      EXPECT_THAT(error.what(), HasSubstr(path.string()));
      EXPECT_THAT(error.what(), HasSubstr(c.expected));
    }
  }
}

// A safetensors file with one tensor of `shape` and `data_offsets`, and `data_bytes` bytes of data.
std::string safetensors_bytes(const nlohmann::json& shape, const nlohmann::json& offsets, size_t data_bytes) {
  const std::string header =
      nlohmann::json{{"t", {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", offsets}}}}.dump();
  const uint64_t length = header.size();
  return std::string(reinterpret_cast<const char*>(&length), 8) + header + std::string(data_bytes, '\0');
}

TEST(ReaderLimits, SafetensorsSizesBeyondTheFileAreRefused) {
  struct Case {
    nlohmann::json shape, offsets;
    const char* expected;
  };
  const uint64_t huge = uint64_t{1} << 62;
  for (const Case& c : {Case{{int64_t{1} << 40, int64_t{1} << 40}, {0, 16}, "needs more than 2^63 - 1 bytes"},
                        Case{{huge / 4}, {0, huge}, "out of range: the data section has 16 bytes"},
                        Case{{4}, {0, std::numeric_limits<uint64_t>::max()}, "data_offsets"}}) {
    try {
      SafetensorsFile::parse(safetensors_bytes(c.shape, c.offsets, 16), "crafted.safetensors");
      ADD_FAILURE() << c.shape.dump() << " " << c.offsets.dump() << " was accepted";
    } catch (const SafetensorsError& error) {
      EXPECT_THAT(error.what(), HasSubstr("crafted.safetensors: tensor 't'"));
      EXPECT_THAT(error.what(), HasSubstr(c.expected));
    }
  }
}

TEST(ReaderLimits, NpyShapeBeyondTheFileIsRefused) {
  for (const std::string shape : {"(1099511627776, 1099511627776)", "(4611686018427387904,)", "(5,)"}) {
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
    header += std::string(63 - (10 + header.size()) % 64, ' ') + "\n";
    const uint16_t length = static_cast<uint16_t>(header.size());
    const std::string bytes = std::string("\x93NUMPY\x01\x00", 8) +
                              std::string(reinterpret_cast<const char*>(&length), 2) + header + std::string(16, '\0');
    try {
      parse_npy(bytes, "crafted.npy");
      ADD_FAILURE() << shape << " was accepted";
    } catch (const RecordError& error) {
      EXPECT_THAT(error.what(), HasSubstr("crafted.npy: .npy data is shorter than the shape says (16 bytes present)"));
    }
  }
}

}  // namespace
}  // namespace moe
