// test_model_safetensors.cpp: the reference model's weights as safetensors
// (reference_cpu/model_safetensors.h, config_json.h) and the export tool moe_export_weights:
// the names, shapes and offsets of the layout, round trips in F64 (exact) and F32 (the data section
// is the flat parameter buffer), the config check, every bad file, and the tool on a checkpoint
// written as the trainer writes one.
// Run: cmake --build build --target test_reference_cpu_model_safetensors && ctest --test-dir build -R ReferenceWeights
#include <gmock/gmock.h>  // HasSubstr
#include <gtest/gtest.h>

#include <sys/wait.h>  // WEXITSTATUS

#include <cmath>
#include <cstdlib>
#include <cstring>     // memcmp
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "checkpoint.h"  // save_checkpoint: a checkpoint as moe_train writes it
#include "model.h"
#include "config_json.h"
#include "model_safetensors.h"
#include "safetensors.h"
#include "temp_dir.h"    // TempDir (tests/common)

namespace moe::ref {
namespace {

using ::testing::HasSubstr;
using nlohmann::json;

ModelConfig small_config() {
  ModelConfig config;
  config.model_dim = 8;
  config.num_layers = 4;
  config.num_heads = 2;
  config.seq_len = 6;
  config.moe_layers = MoeLayers::every_other_block;  // blocks 1 and 3
  config.dense_hidden_dim = 12;
  config.num_experts = 3;
  config.top_k = 2;
  config.expert_hidden_dim = 4;
  config.block_size = 4;
  config.pregated = true;
  return config;
}

// The message of the SafetensorsError that f throws, or "" if it throws none.
template <typename Function>
std::string error_of(Function&& f) {
  try {
    f();
  } catch (const SafetensorsError& error) {
    return error.what();
  }
  return "";
}

std::vector<float> flat_floats(const ModelConfig& config, const ModelWeights& weights) {
  ModelWeights values = weights;
  ModelWeights unused = zero_weights(config);
  std::vector<float> flat;
  for (const Parameter& p : parameters(config, values, unused)) {
    for (int64_t i = 0; i < p.value->size(); ++i) flat.push_back(static_cast<float>(p.value->data()[i]));
  }
  return flat;
}

std::string read_all(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

bool weights_equal(const ModelConfig& config, const ModelWeights& a, const ModelWeights& b) {
  ModelWeights left = a, right = b, unused_left = zero_weights(config), unused_right = zero_weights(config);
  const std::vector<Parameter> pa = parameters(config, left, unused_left), pb = parameters(config, right, unused_right);
  for (size_t i = 0; i < pa.size(); ++i) {
    if (*pa[i].value != *pb[i].value) return false;
  }
  return true;
}

// ---- the layout ----

TEST(ReferenceWeightsLayout, OneTensorPerParameterWithTheExpertsStacked) {
  ModelConfig config = small_config();
  config.activation = Activation::swiglu;  // W1 = 2H columns
  const std::vector<WeightTensor> tensors = weight_tensors(config);
  std::vector<std::string> names;
  for (const WeightTensor& tensor : tensors) names.push_back(tensor.name);
  const std::vector<std::string> block0 = {"blocks.0.ln1.gain", "blocks.0.ln1.bias", "blocks.0.attention.qkv",
                                           "blocks.0.attention.out", "blocks.0.ln2.gain", "blocks.0.ln2.bias",
                                           "blocks.0.ffn.w1", "blocks.0.ffn.w2"};
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + 2),
            (std::vector<std::string>{"token_embedding", "position_embedding"}));
  EXPECT_EQ(std::vector<std::string>(names.begin() + 2, names.begin() + 10), block0);
  EXPECT_EQ(std::vector<std::string>(names.begin() + 16, names.begin() + 19),
            (std::vector<std::string>{"blocks.1.moe.gate", "blocks.1.moe.experts.w1", "blocks.1.moe.experts.w2"}));
  EXPECT_EQ(names.back(), "final_ln.bias");
  EXPECT_EQ(tensors.size(), 2u + 8 + 9 + 8 + 9 + 2);

  std::map<std::string, std::vector<int64_t>> shapes;
  for (const WeightTensor& tensor : tensors) shapes[tensor.name] = tensor.shape;
  EXPECT_EQ(shapes["token_embedding"], (std::vector<int64_t>{256, 8}));
  EXPECT_EQ(shapes["position_embedding"], (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(shapes["blocks.0.ln1.gain"], (std::vector<int64_t>{8}));
  EXPECT_EQ(shapes["blocks.2.attention.qkv"], (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(shapes["blocks.2.ffn.w1"], (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(shapes["blocks.3.moe.gate"], (std::vector<int64_t>{8, 3}));
  EXPECT_EQ(shapes["blocks.3.moe.experts.w1"], (std::vector<int64_t>{3, 8, 8}));
  EXPECT_EQ(shapes["blocks.3.moe.experts.w2"], (std::vector<int64_t>{3, 4, 8}));
  EXPECT_EQ(shapes["final_ln.bias"], (std::vector<int64_t>{8}));

  // Back to back in parameter_layout's flat buffer; a stacked tensor starts at its expert 0.
  int64_t offset = 0;
  for (const WeightTensor& tensor : tensors) {
    EXPECT_EQ(tensor.offset, offset) << tensor.name;
    int64_t elements = 1;
    for (int64_t extent : tensor.shape) elements *= extent;
    EXPECT_EQ(tensor.elements, elements) << tensor.name;
    offset += tensor.elements;
  }
  EXPECT_EQ(offset, parameter_count(config));
  for (const ParameterInfo& p : parameter_layout(config)) {
    if (p.name == "blocks.3.moe.w1.0") {
      EXPECT_EQ(p.offset, tensors[34].offset);
    }
  }
  EXPECT_EQ(tensors[34].name, "blocks.3.moe.experts.w1");
}

// ---- round trips ----

TEST(ReferenceWeightsRoundTrip, F64IsExactAndCarriesTheConfig) {
  testing::TempDir dir;
  const ModelConfig config = small_config();
  const ModelWeights weights = init_model(config, 3);
  const auto path = dir.path() / "model.safetensors";
  save_model_safetensors(path, config, weights, Dtype::f64, {{"note", "test"}});
  const LoadedModel loaded = load_model_safetensors(path);
  EXPECT_EQ(model_config_to_json(loaded.config), model_config_to_json(config));
  EXPECT_TRUE(weights_equal(config, loaded.weights, weights));
  EXPECT_EQ(loaded.metadata.at("layout"), kWeightsLayout);
  EXPECT_EQ(loaded.metadata.at("note"), "test");
  EXPECT_EQ(json::parse(loaded.metadata.at("model_config")), model_config_to_json(config));
  EXPECT_TRUE(weights_equal(config, load_model_safetensors(path, config).weights, weights));
}

TEST(ReferenceWeightsRoundTrip, F32DataSectionIsTheFlatParameterBuffer) {
  testing::TempDir dir;
  const ModelConfig config = small_config();
  const ModelWeights weights = init_model(config, 4);
  const std::vector<float> flat = flat_floats(config, weights);
  const auto from_weights = dir.path() / "a.safetensors", from_flat = dir.path() / "b.safetensors";
  save_model_safetensors(from_weights, config, weights);
  save_flat_weights_safetensors(from_flat, config, flat);
  const std::string bytes = read_all(from_weights);
  EXPECT_EQ(bytes, read_all(from_flat));

  const std::string data = bytes.substr(bytes.size() - flat.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(data.data(), flat.data(), data.size()), 0);
  const SafetensorsFile file = SafetensorsFile::load(from_weights);
  EXPECT_EQ(file.info("blocks.1.moe.experts.w2").dtype, Dtype::f32);

  const LoadedModel loaded = load_model_safetensors(from_flat);
  EXPECT_EQ(flat_floats(config, loaded.weights), flat);
}

// ---- the config check ----

TEST(ReferenceWeightsConfig, AnotherModelIsAnErrorNamingEachField) {
  testing::TempDir dir;
  const ModelConfig config = small_config();
  const auto path = dir.path() / "model.safetensors";
  save_model_safetensors(path, config, init_model(config, 5));

  ModelConfig other = config;
  other.num_experts = 8;
  other.pregated = false;
  EXPECT_THAT(error_of([&] { load_model_safetensors(path, other); }),
              HasSubstr("model.safetensors: the weights belong to another model: pregated is true in the file, false in "
                        "the model being built; num_experts is 3 in the file, 8 in the model being built"));

  // Fields that do not change what inference computes may differ.
  ModelConfig training = config;
  training.formulation = Formulation::dropping;
  training.capacity_factor = 2.0;
  training.aux_loss_coef = 0.5;
  training.block_size = 2;
  EXPECT_EQ(error_of([&] { load_model_safetensors(path, training); }), "");
}

TEST(ReferenceWeightsConfig, JsonRoundTripAndTheTrainersKeys) {
  ModelConfig config = small_config();
  config.activation = Activation::swiglu;
  config.renormalize = true;
  config.layer_norm_eps = 1e-6;
  EXPECT_EQ(model_config_to_json(model_config_from_json(model_config_to_json(config))), model_config_to_json(config));

  // What cuda/train's model_json writes: no layer_norm_eps, activation or renormalize, plus batch and vocabulary.
  const json trainer = json::parse(R"({"model_dim": 8, "num_layers": 2, "num_heads": 2, "seq_len": 6,
      "moe_layers": "every_block", "dense_hidden_dim": 16, "num_experts": 4, "top_k": 1, "expert_hidden_dim": 8,
      "formulation": "dropless", "capacity_factor": 1.0, "block_size": 4, "aux_loss_coef": 0.01,
      "z_loss_coef": 0.001, "pregated": true, "batch": 16, "vocabulary": 256})");
  const ModelConfig read = model_config_from_json(trainer);
  EXPECT_EQ(read.num_experts, 4);
  EXPECT_TRUE(read.pregated);
  EXPECT_EQ(read.activation, Activation::gelu);
  EXPECT_EQ(read.layer_norm_eps, ModelConfig{}.layer_norm_eps);

  const auto message = [&](json j) {
    try {
      model_config_from_json(j);
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  json missing = trainer;
  missing.erase("num_experts");
  EXPECT_EQ(message(missing), "model config: num_experts is missing (required)");
  json wrong = trainer;
  wrong["top_k"] = "2";
  EXPECT_EQ(message(wrong), "model config: top_k is \"2\"; expected an integer");
  json unknown = trainer;
  unknown["rotary"] = true;
  EXPECT_THAT(message(unknown), HasSubstr("unknown key 'rotary'"));
  json vocabulary = trainer;
  vocabulary["vocabulary"] = 50257;
  EXPECT_THAT(message(vocabulary), HasSubstr("vocabulary is 50257; expected 256 (bytes)"));
  json layers = trainer;
  layers["moe_layers"] = "sometimes";
  EXPECT_THAT(message(layers), HasSubstr("model config: moe_layers: unknown moe_layers 'sometimes'"));
  json invalid = trainer;
  invalid["num_heads"] = 3;
  EXPECT_THAT(message(invalid), HasSubstr("num_heads"));
}

// ---- bad files ----

TEST(ReferenceWeightsBadFiles, EveryFaultNamesTheFileAndWhat) {
  testing::TempDir dir;
  const ModelConfig config = small_config();
  const ModelWeights weights = init_model(config, 6);
  const std::vector<float> flat = flat_floats(config, weights);
  const auto good = dir.path() / "good.safetensors";
  save_model_safetensors(good, config, weights);
  const std::string bytes = read_all(good);
  const std::map<std::string, std::string> metadata = {{"layout", kWeightsLayout},
                                                       {"model_config", model_config_to_json(config).dump()}};
  const auto write = [&](const std::string& name, const std::string& contents) {
    std::ofstream(dir.path() / name, std::ios::binary) << contents;
    return dir.path() / name;
  };
  // The model's tensors as views of `flat`, with one changed by `edit`.
  const auto tensors_with = [&](const std::function<void(std::vector<TensorView>&)>& edit) {
    std::vector<TensorView> views;
    for (const WeightTensor& t : weight_tensors(config)) {
      views.push_back(tensor_view(t.name, t.shape, std::span<const float>(flat).subspan(t.offset, t.elements)));
    }
    edit(views);
    return views;
  };

  EXPECT_THAT(error_of([&] { load_model_safetensors(write("cut.safetensors", bytes.substr(0, bytes.size() - 10))); }),
              HasSubstr("cut.safetensors: tensor 'final_ln.bias' has data_offsets"));
  EXPECT_THAT(error_of([&] { load_model_safetensors(write("head.safetensors", bytes.substr(0, 100))); }),
              HasSubstr("(truncated file?)"));

  const std::vector<float> one = {1.0f};
  const auto plain = dir.path() / "plain.safetensors";
  save_safetensors(plain, {tensor_view("x", {1}, std::span<const float>(one))});
  EXPECT_THAT(error_of([&] { load_model_safetensors(plain); }),
              HasSubstr("is not a weights file of the reference model: __metadata__ has layout (none)"));

  const auto no_config = dir.path() / "no_config.safetensors";
  save_safetensors(no_config, tensors_with([](auto&) {}), {{"layout", kWeightsLayout}});
  EXPECT_THAT(error_of([&] { load_model_safetensors(no_config); }), HasSubstr("__metadata__ has no model_config"));

  const auto bad_config = dir.path() / "bad_config.safetensors";
  save_safetensors(bad_config, tensors_with([](auto&) {}), {{"layout", kWeightsLayout}, {"model_config", "{D: 8"}});
  EXPECT_THAT(error_of([&] { load_model_safetensors(bad_config); }), HasSubstr("model_config: not valid JSON"));

  const auto missing = dir.path() / "missing.safetensors";
  save_safetensors(missing, tensors_with([](auto& views) { views.erase(views.begin() + 3); }), metadata);
  EXPECT_THAT(error_of([&] { load_model_safetensors(missing); }),
              HasSubstr("missing.safetensors: has no tensor named 'blocks.0.ln1.bias'; the model needs it"));

  const auto extra = dir.path() / "extra.safetensors";
  save_safetensors(extra, tensors_with([&](auto& views) {
                     views.push_back(tensor_view("lm_head", {1}, std::span<const float>(one)));
                   }),
                   metadata);
  EXPECT_THAT(error_of([&] { load_model_safetensors(extra); }),
              HasSubstr("has a tensor 'lm_head' that the model has no parameter for"));

  const auto reshaped = dir.path() / "reshaped.safetensors";
  save_safetensors(reshaped, tensors_with([](auto& views) { views[0].shape = {8, 256}; }), metadata);
  EXPECT_THAT(error_of([&] { load_model_safetensors(reshaped); }),
              HasSubstr("tensor 'token_embedding' has shape [8, 256]; the model needs [256, 8]"));

  const auto integers = dir.path() / "integers.safetensors";
  save_safetensors(integers, tensors_with([](auto& views) { views[2].dtype = Dtype::i32; }), metadata);
  EXPECT_THAT(error_of([&] { load_model_safetensors(integers); }),
              HasSubstr("tensor 'blocks.0.ln1.gain' is I32; weights are F32, F64, BF16 or F16"));

  std::vector<float> with_nan = flat;
  with_nan[5] = NAN;
  const auto not_finite = dir.path() / "nan.safetensors";
  EXPECT_THAT(error_of([&] { save_flat_weights_safetensors(not_finite, config, with_nan); }),
              HasSubstr("flat weight 5 is nan; weights must be finite"));
  EXPECT_FALSE(std::filesystem::exists(not_finite));
  save_safetensors(not_finite,
                   tensors_with([&](auto& views) {
                     views[0].bytes = std::as_bytes(std::span<const float>(with_nan).subspan(0, 256 * 8));
                   }),
                   metadata);
  EXPECT_THAT(error_of([&] { load_model_safetensors(not_finite); }),
              HasSubstr("tensor 'token_embedding' entry 5 is nan; weights must be finite"));

  EXPECT_THAT(error_of([&] { save_flat_weights_safetensors(dir.path() / "short.safetensors", config,
                                                           std::span<const float>(flat).subspan(1)); }),
              HasSubstr("the flat weights have " + std::to_string(flat.size() - 1) + " values; the model has " +
                        std::to_string(flat.size()) + " parameters"));
}

// ---- the export tool ----

struct ToolResult {
  int status = -1;
  std::string output;  // stdout and stderr
};

ToolResult run_tool(const std::string& arguments, const std::filesystem::path& scratch) {
  const std::filesystem::path log = scratch / "tool_output.txt";
  const std::string command = std::string(MOE_EXPORT_WEIGHTS_PATH) + " " + arguments + " > " + log.string() + " 2>&1";
  const int raw = std::system(command.c_str());
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_all(log)};
}

// A run directory with a checkpoint as moe_train writes it: the trainer's model_json and the
// weights and AdamW's moments in parameter_layout's order.
std::filesystem::path write_run(const std::filesystem::path& run, const ModelConfig& config, const std::vector<float>& flat,
                                int64_t step) {
  json model = model_config_to_json(config);
  for (const char* key : {"layer_norm_eps", "activation", "renormalize"}) model.erase(key);
  model["batch"] = 8;
  model["vocabulary"] = 256;
  CheckpointHeader header;
  header.model_config = model;
  header.step = step;
  const std::vector<float> zeros(flat.size(), 0.0f);
  std::filesystem::create_directories(run / "checkpoints");
  const std::filesystem::path path = checkpoint_path(run / "checkpoints", step);
  save_checkpoint(path, header, {{"weights", flat}, {"adam_m", zeros}, {"adam_v", zeros}});
  return path;
}

TEST(ReferenceWeightsExportTool, WritesTheCheckpointsWeightsAndConfig) {
  testing::TempDir dir;
  const ModelConfig config = small_config();
  const std::vector<float> flat = flat_floats(config, init_model(config, 7));
  write_run(dir.path() / "run", config, std::vector<float>(flat.size(), 0.5f), 10);
  const std::filesystem::path latest = write_run(dir.path() / "run", config, flat, 20);
  const auto out = dir.path() / "model.safetensors";

  const ToolResult result = run_tool("--checkpoint " + (dir.path() / "run").string() + " --out " + out.string(), dir.path());
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("wrote " + out.string()));
  const LoadedModel loaded = load_model_safetensors(out, config);
  EXPECT_EQ(flat_floats(config, loaded.weights), flat);  // the latest checkpoint, values unchanged
  EXPECT_EQ(loaded.metadata.at("step"), "20");
  EXPECT_EQ(loaded.metadata.at("source_checkpoint"), latest.string());
  EXPECT_EQ(model_config_to_json(loaded.config), model_config_to_json(config));

  // A checkpoint file named directly.
  const ToolResult direct = run_tool("--checkpoint " + latest.string() + " --out " + out.string(), dir.path());
  EXPECT_EQ(direct.status, 0) << direct.output;
}

TEST(ReferenceWeightsExportTool, HelpAndBadInput) {
  testing::TempDir dir;
  const ToolResult help = run_tool("--help", dir.path());
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.output, HasSubstr("usage: moe_export_weights --checkpoint PATH"));

  EXPECT_EQ(run_tool("", dir.path()).status, 2);
  EXPECT_THAT(run_tool("", dir.path()).output, HasSubstr("--checkpoint PATH is required"));
  EXPECT_THAT(run_tool("--steps 3", dir.path()).output, HasSubstr("unknown argument '--steps'"));
  EXPECT_THAT(run_tool("--checkpoint", dir.path()).output, HasSubstr("--checkpoint needs a value"));

  const ToolResult nowhere = run_tool("--checkpoint " + (dir.path() / "nothing").string(), dir.path());
  EXPECT_EQ(nowhere.status, 2);
  EXPECT_THAT(nowhere.output, HasSubstr("no such checkpoint file or run directory"));
  std::filesystem::create_directories(dir.path() / "empty");
  EXPECT_THAT(run_tool("--checkpoint " + (dir.path() / "empty").string(), dir.path()).output,
              HasSubstr("no checkpoint_<step>.ckpt in it"));

  // Weights of the wrong length for the config the checkpoint names: nothing is written.
  const ModelConfig config = small_config();
  const std::filesystem::path wrong = write_run(dir.path() / "wrong", config, std::vector<float>(10, 1.0f), 1);
  const auto out = dir.path() / "model.safetensors";
  const ToolResult mismatch = run_tool("--checkpoint " + wrong.string() + " --out " + out.string(), dir.path());
  EXPECT_EQ(mismatch.status, 2);
  EXPECT_THAT(mismatch.output, HasSubstr("checkpoint_00000001.ckpt: its weights hold 10 values; its model config has " +
                                         std::to_string(parameter_count(config)) + " parameters"));
  EXPECT_FALSE(std::filesystem::exists(out));

  // A damaged checkpoint fails its own checks.
  const std::filesystem::path good = write_run(dir.path() / "damaged", config, flat_floats(config, init_model(config, 8)), 1);
  std::string bytes = read_all(good);
  bytes[bytes.size() / 2] ^= 0x40;
  std::ofstream(good, std::ios::binary | std::ios::trunc) << bytes;
  const ToolResult damaged = run_tool("--checkpoint " + good.string() + " --out " + out.string(), dir.path());
  EXPECT_EQ(damaged.status, 2);
  EXPECT_THAT(damaged.output, HasSubstr("moe_export_weights: " + good.string()));
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace moe::ref
