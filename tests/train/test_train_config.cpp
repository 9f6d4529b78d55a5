// test_train_config.cpp: the training program's settings (cuda/train/train_config.h): presets,
// JSON files and flags layered in order, every bad input named with what is allowed, and the FLOP
// accounting checked against a count by hand. CPU only.
// Run: ctest --test-dir build -R TrainConfig
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "temp_dir.h"  // moe::testing::TempDir
#include "train/train_config.h"

namespace {

using moe::train::TrainConfig;
using moe::train::TrainConfigError;
using moe::train::parse_arguments;

// The message of the TrainConfigError that `work` throws ("" if none).
template <typename Work>
std::string error_of(Work&& work) {
  try {
    work();
  } catch (const TrainConfigError& error) {
    return error.what();
  }
  return "";
}

std::string parse_error(const std::vector<std::string>& arguments) {
  return error_of([&] { moe::train::validate(parse_arguments(arguments)); });
}

TEST(TrainConfig, PresetsAreValidAndDiffer) {
  for (const std::string& name : moe::train::preset_names()) {
    const TrainConfig config = moe::train::preset(name);
    EXPECT_NO_THROW(moe::train::validate(config)) << name;
    EXPECT_EQ(config.preset, name);
  }
  const TrainConfig throughput = moe::train::preset("throughput");  // the speed configuration
  EXPECT_EQ(throughput.model.model_dim, 512);
  EXPECT_EQ(throughput.model.num_layers, 8);
  EXPECT_EQ(throughput.model.num_heads, 8);
  EXPECT_EQ(throughput.model.num_experts, 16);
  EXPECT_EQ(throughput.model.expert_hidden_dim, 1024);
  EXPECT_EQ(throughput.model.top_k, 2);
  EXPECT_EQ(throughput.model.seq_len, 256);
  EXPECT_EQ(throughput.batch, 64);
  EXPECT_NE(error_of([] { moe::train::preset("huge"); }).find("allowed: default, throughput, tiny"), std::string::npos);
}

TEST(TrainConfig, FlagsOverrideTheFileWhichOverridesThePreset) {
  moe::testing::TempDir dir;
  const auto file = dir.path() / "run.json";
  std::ofstream(file) << R"({"formulation": "dropping", "capacity_factor": 1.5, "steps": 300, "seed": 7})";
  const TrainConfig config = parse_arguments(
      {"--steps", "400", "--config", file.string(), "--preset", "tiny", "--capacity-factor=1.0", "--pregated"});
  EXPECT_EQ(config.preset, "tiny");
  EXPECT_EQ(config.model.model_dim, 64);                               // preset
  EXPECT_EQ(config.model.formulation, moe::Formulation::dropping);     // file
  EXPECT_EQ(config.seed, 7u);                                          // file
  EXPECT_EQ(config.steps, 400);                                        // flag over file
  EXPECT_DOUBLE_EQ(config.model.capacity_factor, 1.0);                 // flag over file
  EXPECT_TRUE(config.model.pregated);                                  // boolean flag without a value
}

TEST(TrainConfig, JsonRoundTrip) {
  TrainConfig config = parse_arguments({"--preset", "tiny", "--moe-layers", "every_other_block", "--top-k", "1",
                                        "--learning-rate", "0.004", "--name", "x"});
  TrainConfig again = moe::train::preset("tiny");
  moe::train::apply_json(again, moe::train::to_json(config), "round trip");
  EXPECT_EQ(moe::train::to_json(again), moe::train::to_json(config));
  EXPECT_EQ(again.model.moe_layers, moe::MoeLayers::every_other_block);
  EXPECT_EQ(moe::train::model_json(config)["top_k"], 1);
}

TEST(TrainConfig, BadInputNamesTheFieldAndWhatIsAllowed) {
  struct Case {
    std::vector<std::string> arguments;
    std::string expected;  // a part of the message
  };
  const std::vector<Case> cases = {
      {{"--top-k", "9"}, "top_k (K) = 9; allowed: 1 <= K <= E (E = 8)"},
      {{"--formulation", "dropping", "--capacity-factor", "0"}, "capacity_factor = 0"},
      {{"--formulation", "sparse"}, "unknown formulation 'sparse'; allowed: dropping, padded, dropless"},
      {{"--moe-layers", "some"}, "allowed: every_block, every_other_block, none"},
      {{"--block-size", "32", "--expert-hidden-dim", "512"}, "block_size (B) = 32; allowed: 64 or 128"},
      {{"--expert-hidden-dim", "500"}, "a multiple of block_size B = 128"},
      {{"--steps", "ten"}, "flag --steps ten: not an integer"},
      {{"--steps", "10x"}, "flag --steps 10x: not an integer"},
      {{"--learning-rate", "-1"}, "learning_rate = -1.000000; allowed: a finite number > 0"},
      {{"--warmup-steps", "3000"}, "warmup_steps = 3000; allowed: 0 <= warmup_steps < steps (2000)"},
      {{"--batch", "0"}, "batch (N) = 0; allowed: N >= 1"},
      {{"--sample-bytes", "1000"}, "sample_bytes = 1000; allowed: 1 <= sample_bytes <= seq_len (256)"},
      {{"--stop-after", "5000"}, "stop_after = 5000"},
      {{"--resume", "--overwrite"}, "one of the two"},
      {{"--stepz", "10"}, "unknown setting 'stepz'; allowed: model_dim,"},
      {{"--steps"}, "flag --steps needs a value"},
      {{"steps", "10"}, "unexpected argument 'steps'"},
      {{"--config", "/nonexistent/run.json"}, "cannot open the file"},
      {{"--seed", "-3"}, "seed = -3; allowed: an integer >= 0"},
      {{"--pregated", "--moe-layers", "none"}, "pregated = true with moe_layers = none"},
      {{"--activation", "relu"}, "unknown activation 'relu'; allowed: gelu, swiglu"},
      {{"--cuda-graph", "on", "--micro-batches", "2"}, "micro_batches (M) = 2 with cuda_graph = true"},
      {{"--cuda-graph", "maybe"}, "flag --cuda-graph maybe: not true or false (on or off)"},
      {{"--micro-batches", "0"}, "micro_batches (M) = 0; allowed: M >= 1 dividing batch (N = 32)"},
      {{"--micro-batches", "-2"}, "micro_batches (M) = -2; allowed: M >= 1 dividing batch (N = 32)"},
      {{"--micro-batches", "5"}, "micro_batches (M) = 5; allowed: M >= 1 dividing batch (N = 32)"},
      {{"--micro-batches", "two"}, "flag --micro-batches two: not an integer"},
      {{"--micro-batches", "2", "--formulation", "padded"}, "micro_batches (M) = 2 with formulation = padded"},
      {{"--micro-batches", "2", "--formulation", "padded", "--cuda-graph", "on"}, "micro_batches (M) = 2"},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(c.arguments);
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "arguments: " << ::testing::PrintToString(c.arguments) << "\nmessage: " << message;
  }
}

// --overlap is on, off or auto (the default): auto overlaps two micro-batches where it pays, on
// several ranks with an even share of the batch each, and nowhere on one GPU; records written with
// true / false read back as on / off.
TEST(TrainConfig, OverlapIsOnOffOrAutoWhereItPays) {
  using moe::train::overlaps;
  const TrainConfig automatic = parse_arguments({"--preset", "tiny", "--batch", "8"});
  EXPECT_FALSE(automatic.overlap.has_value());
  EXPECT_FALSE(overlaps(automatic, 1)) << "one GPU: nothing to hide";
  EXPECT_TRUE(overlaps(automatic, 2)) << "N / R = 4";
  EXPECT_TRUE(overlaps(automatic, 4)) << "N / R = 2";
  EXPECT_FALSE(overlaps(automatic, 8)) << "N / R = 1: no two halves";
  EXPECT_FALSE(overlaps(parse_arguments({"--preset", "tiny", "--batch", "6"}), 2)) << "N / R = 3 is odd";
  EXPECT_FALSE(overlaps(parse_arguments({"--preset", "tiny", "--batch", "8", "--micro-batches", "2"}), 2));
  EXPECT_FALSE(overlaps(parse_arguments({"--preset", "tiny", "--batch", "8", "--cuda-graph"}), 2));
  EXPECT_FALSE(overlaps(parse_arguments({"--preset", "tiny", "--batch", "8", "--overlap", "off"}), 2));
  EXPECT_TRUE(overlaps(parse_arguments({"--preset", "tiny", "--batch", "8", "--overlap", "on"}), 1));
  EXPECT_TRUE(overlaps(parse_arguments({"--preset", "tiny", "--batch", "8", "--overlap"}), 1)) << "a bare flag is on";
  EXPECT_FALSE(parse_arguments({"--preset", "tiny", "--overlap", "on", "--overlap", "auto"}).overlap.has_value());

  EXPECT_EQ(moe::train::to_json(automatic)["overlap"], "auto");
  for (const nlohmann::json& value : {nlohmann::json(true), nlohmann::json(false), nlohmann::json("auto")}) {
    TrainConfig config = moe::train::preset("tiny");
    moe::train::apply_json(config, {{"overlap", value}}, "a record");
    EXPECT_EQ(moe::train::to_json(config)["overlap"], value);
  }
  EXPECT_NE(parse_error({"--overlap", "sometimes"}).find("flag --overlap sometimes: not true, false or \"auto\""),
            std::string::npos);
  TrainConfig config = moe::train::preset("tiny");
  EXPECT_NE(error_of([&] { moe::train::apply_json(config, {{"overlap", "yes"}}, "run.json"); })
                .find("run.json: overlap = \"yes\"; allowed: true, false or \"auto\""),
            std::string::npos);
  EXPECT_NE(parse_error({"--overlap", "on", "--batch", "31"}).find("overlap = on with batch N = 31"), std::string::npos);
  EXPECT_EQ(parse_error({"--batch", "31"}), "") << "auto never refuses a batch: it is off where it cannot split";
}

// --placement is contiguous or eplb; eplb's limits that need the ranks (check_placement) name the
// flag and the bound: several ranks, spare slots a rank can hold, no replicas when padded.
TEST(TrainConfig, PlacementIsContiguousOrEplbWithinItsLimits) {
  EXPECT_EQ(moe::train::preset("tiny").placement, "contiguous");
  EXPECT_NE(parse_error({"--placement", "random"}).find("placement = \"random\"; allowed: contiguous or eplb (--placement)"),
            std::string::npos);
  EXPECT_NE(parse_error({"--rebalance-every", "0"}).find("rebalance_every = 0; allowed: rebalance_every >= 1"),
            std::string::npos);
  EXPECT_NE(parse_error({"--redundant-slots", "-1"}).find("redundant_slots = -1"), std::string::npos);
  EXPECT_EQ(parse_error({"--placement", "eplb", "--redundant-slots", "2", "--rebalance-every", "50"}), "");

  // tiny: E = 4 experts.
  const auto placement_error = [](const std::vector<std::string>& flags, int ranks) {
    std::vector<std::string> arguments = {"--preset", "tiny"};
    arguments.insert(arguments.end(), flags.begin(), flags.end());
    const TrainConfig config = parse_arguments(arguments);
    return error_of([&] { moe::train::check_placement(config, ranks); });
  };
  EXPECT_EQ(placement_error({"--placement", "eplb", "--redundant-slots", "2"}, 2), "");
  EXPECT_EQ(placement_error({}, 3), "") << "E = 4 on 3 ranks: 1, 1 and 2 experts";
  EXPECT_NE(placement_error({"--placement", "eplb"}, 1).find("placement = eplb on one GPU"), std::string::npos);
  EXPECT_NE(placement_error({"--placement", "eplb", "--redundant-slots", "3"}, 2)
                .find("allowed: 0 to E - ceil(E / R) = 2 (a rank holds an expert once) (--redundant-slots)"),
            std::string::npos);
  EXPECT_NE(placement_error({}, 8).find("num_experts (E) = 4 on 8 ranks; allowed: at least one expert a rank: E >= R"),
            std::string::npos);
  EXPECT_NE(placement_error({"--placement", "eplb", "--formulation", "padded"}, 2)
                .find("redundant_slots = 1 with formulation = padded"),
            std::string::npos);
  EXPECT_EQ(placement_error({"--placement", "eplb", "--formulation", "padded", "--redundant-slots", "0"}, 2), "");
}

// A value the settings reject ends with the flag that sets it, as the user types it.
TEST(TrainConfig, RejectedValueNamesItsFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--top-k", "9"}, "(--top-k)"},                       // the model's checks (reference_cpu)
      {{"--seq-len", "0"}, "(--seq-len)"},
      {{"--formulation", "dropping", "--capacity-factor", "0"}, "(--capacity-factor)"},
      {{"--block-size", "32", "--expert-hidden-dim", "512"}, "(--block-size)"},  // the trainer's own
      {{"--learning-rate", "-1"}, "(--learning-rate)"},
      {{"--warmup-steps", "3000"}, "(--warmup-steps)"},
      {{"--batch", "0"}, "(--batch)"},
      {{"--pregated", "--moe-layers", "none"}, "(--pregated)"},
      {{"--micro-batches", "3"}, "(--micro-batches)"},
  };
  for (const auto& [arguments, flag] : cases) {
    const std::string message = parse_error(arguments);
    EXPECT_NE(message.find(flag), std::string::npos)
        << "arguments: " << ::testing::PrintToString(arguments) << "\nmessage: " << message;
  }
}

TEST(TrainConfig, BadJsonFile) {
  moe::testing::TempDir dir;
  const auto broken = dir.path() / "broken.json";
  std::ofstream(broken) << R"({"steps": 10,)";
  EXPECT_NE(parse_error({"--config", broken.string()}).find("not valid JSON"), std::string::npos);
  const auto wrong_type = dir.path() / "wrong_type.json";
  std::ofstream(wrong_type) << R"({"steps": "many"})";
  EXPECT_NE(parse_error({"--config", wrong_type.string()}).find("steps = \"many\"; allowed: an integer"),
            std::string::npos);
  const auto not_object = dir.path() / "list.json";
  std::ofstream(not_object) << "[1, 2]";
  EXPECT_NE(parse_error({"--config", not_object.string()}).find("expected a JSON object"), std::string::npos);
}

// PaLM's accounting, counted by hand for the throughput configuration.
TEST(TrainConfig, FlopsPerTokenByHand) {
  const TrainConfig c = moe::train::preset("throughput");
  const int64_t D = 512, L = 8, E = 16, K = 2, H = 1024, S = 256, V = 256;
  const int64_t per_layer_active = 4 * D * D + D * E + K * 2 * D * H;
  EXPECT_EQ(moe::train::active_parameters(c.model), V * D + L * per_layer_active);
  const int64_t per_layer_total = 4 * D * D + 4 * D + D * E + E * 2 * D * H;
  EXPECT_EQ(moe::train::total_parameters(c.model), V * D + S * D + 2 * D + L * per_layer_total);
  EXPECT_DOUBLE_EQ(moe::train::flops_per_token(c.model), 6.0 * double(V * D + L * per_layer_active) + 12.0 * L * S * D);
  // A dense model of the same active FLOPs: H_dense = K * H gives the same FFN work per token,
  // less only the gate.
  TrainConfig dense = c;
  dense.model.moe_layers = moe::MoeLayers::none;
  EXPECT_EQ(moe::train::active_parameters(c.model) - moe::train::active_parameters(dense.model), L * D * E);
}

// SwiGLU experts: --activation swiglu reaches the model, the run record's model and a round trip;
// each expert then holds W1 [D, 2H] and W2 [H, D], 3 D H parameters instead of 2 D H.
TEST(TrainConfig, SwigluActivation) {
  const TrainConfig gelu = moe::train::preset("throughput");
  EXPECT_EQ(gelu.model.activation, moe::Activation::gelu);
  EXPECT_EQ(moe::train::model_json(gelu)["activation"], "gelu");
  const TrainConfig c = parse_arguments({"--preset", "throughput", "--activation", "swiglu"});
  EXPECT_NO_THROW(moe::train::validate(c));
  EXPECT_EQ(c.model.activation, moe::Activation::swiglu);
  EXPECT_EQ(moe::train::model_json(c)["activation"], "swiglu");
  TrainConfig again = moe::train::preset("throughput");
  moe::train::apply_json(again, moe::train::to_json(c), "round trip");
  EXPECT_EQ(again.model.activation, moe::Activation::swiglu);
  const int64_t D = 512, L = 8, E = 16, K = 2, H = 1024, S = 256, V = 256;
  const int64_t per_layer_active = 4 * D * D + D * E + K * 3 * D * H;
  EXPECT_EQ(moe::train::active_parameters(c.model), V * D + L * per_layer_active);
  const int64_t per_layer_total = 4 * D * D + 4 * D + D * E + E * 3 * D * H;
  EXPECT_EQ(moe::train::total_parameters(c.model), V * D + S * D + 2 * D + L * per_layer_total);
  EXPECT_DOUBLE_EQ(moe::train::flops_per_token(c.model), 6.0 * double(V * D + L * per_layer_active) + 12.0 * L * S * D);
  EXPECT_GT(moe::train::flops_per_token(c.model), moe::train::flops_per_token(gelu.model));
}

TEST(TrainConfig, HelpListsEveryFlag) {
  const std::string help = moe::train::help_text(moe::train::preset("default"));
  for (const char* flag : {"--formulation", "--capacity-factor", "--resume", "--run-dir", "--benchmark-steps",
                           "--pregated", "--eval-every", "--activation"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
