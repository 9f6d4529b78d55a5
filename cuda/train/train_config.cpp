// train_config.cpp: presets, the one table of fields behind both JSON keys and flags, validation,
// and the FLOP accounting of a run. See train_config.h.
#include "train/train_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <type_traits>

#include "command_line.h"  // CLI::App, command_line_message
#include "moe_config.h"    // parse_formulation, parse_activation, to_string
#include "parse_number.h"  // parse_integer, parse_real: a flag's text read whole
#include "file_io.h"       // read_file_capped
#include "untrusted_json.h"  // parse_untrusted_json, json_excerpt

namespace moe::train {
namespace {

using nlohmann::json;

// ---- [SECTION] the table of fields ----

// What a field's value is; decides how a flag's text becomes JSON and which JSON types it accepts.
// switch_or_auto: true, false or "auto" (an std::optional<bool>, unset when auto).
enum class Kind { integer, number, text, boolean, switch_or_auto };

struct Field {
  std::string key;   // JSON key; the flag is "--" + key with '_' -> '-'
  Kind kind;
  std::string help;
  std::function<void(TrainConfig&, const json&)> set;  // value already of the right JSON type
  std::function<json(const TrainConfig&)> get;
};

// Short helpers so each field is one line of the table.

// A member's JSON kind from its C++ type (bool first: it is an integral type too).
template <typename T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, bool>) return Kind::boolean;
  else if constexpr (std::is_integral_v<T>) return Kind::integer;
  else if constexpr (std::is_floating_point_v<T>) return Kind::number;
  else return Kind::text;
}

// The struct a member pointer reaches into: the TrainConfig itself, or its model.
template <typename Owner, typename Config>  // Config: TrainConfig or const TrainConfig
auto& part(Config& c) {
  if constexpr (std::is_same_v<Owner, ModelConfig>) return c.model;
  else return c;
}

// A member of TrainConfig or of its model, in JSON as it is.
template <typename Owner, typename T>
Field field(std::string key, T Owner::*member, std::string help) {
  return {key, kind_of<T>(), help, [member](TrainConfig& c, const json& v) { part<Owner>(c).*member = v.get<T>(); },
          [member](const TrainConfig& c) { return json(part<Owner>(c).*member); }};
}

// An on / off / auto setting of TrainConfig: JSON true, false or "auto" (unset).
Field switch_field(std::string key, std::optional<bool> TrainConfig::*member, std::string help) {
  return {key, Kind::switch_or_auto, help,
          [member](TrainConfig& c, const json& v) {
            c.*member = v.is_boolean() ? std::optional<bool>(v.get<bool>()) : std::nullopt;
          },
          [member](const TrainConfig& c) { return (c.*member).has_value() ? json(*(c.*member)) : json("auto"); }};
}

// A model enum, in JSON as its name, read through its parser.
template <typename Enum>
Field name_field(std::string key, Enum ModelConfig::*member, Enum (*parse)(std::string_view), std::string help) {
  return {key, Kind::text, help,
          [member, parse](TrainConfig& c, const json& v) { c.model.*member = parse(v.get<std::string>()); },
          [member](const TrainConfig& c) { return json(std::string(to_string(c.model.*member))); }};
}

const std::vector<Field>& fields() {
  using M = ModelConfig;
  static const std::vector<Field> table = {
      // the model
      field("model_dim", &M::model_dim, "D, the model width"),
      field("num_layers", &M::num_layers, "L, transformer blocks"),
      field("num_heads", &M::num_heads, "attention heads (D % heads == 0)"),
      field("seq_len", &M::seq_len, "S, bytes of context per sequence"),
      name_field("moe_layers", &M::moe_layers, parse_moe_layers, "every_block | every_other_block | none (a dense model)"),
      field("dense_hidden_dim", &M::dense_hidden_dim, "H_dense of the dense FFN blocks (K*H: equal active FLOPs)"),
      field("num_experts", &M::num_experts, "E, experts per MoE layer"),
      field("top_k", &M::top_k, "K, experts per token"),
      field("expert_hidden_dim", &M::expert_hidden_dim, "H, each expert's hidden width (a multiple of B)"),
      name_field("formulation", &M::formulation, parse_formulation, "dropless | padded | dropping"),
      name_field("activation", &M::activation, parse_activation, "gelu | swiglu (W1 [D, 2H]: gate and up halves) of the experts"),
      field("capacity_factor", &M::capacity_factor, "dropping / padded: C = ceil(cf * T * K / E)"),
      field("block_size", &M::block_size, "B of the dropless block-sparse layer (64 or 128 on the GPU)"),
      field("aux_loss_coef", &M::aux_loss_coef, "weight of each MoE layer's load-balancing loss"),
      field("z_loss_coef", &M::z_loss_coef, "weight of each MoE layer's router z-loss"),
      field("pregated", &M::pregated, "route MoE block j from MoE block j-1's input (Pre-gated MoE)"),
      field("batch", &TrainConfig::batch, "N, sequences per step (T = N * S tokens)"),
      field("micro_batches", &TrainConfig::micro_batches, "M, micro-batches of N / M sequences a step (gradient accumulation; one GPU, dropless)"),
      // the optimizer
      field("steps", &TrainConfig::steps, "optimizer steps of the whole run"),
      field("learning_rate", &TrainConfig::learning_rate, "peak learning rate"),
      field("warmup_steps", &TrainConfig::warmup_steps, "linear warm-up steps"),
      field("min_lr_ratio", &TrainConfig::min_lr_ratio, "final learning rate / peak (cosine decay)"),
      field("beta1", &TrainConfig::beta1, "AdamW beta1"),
      field("beta2", &TrainConfig::beta2, "AdamW beta2"),
      field("weight_decay", &TrainConfig::weight_decay, "AdamW decoupled weight decay (matrices only)"),
      field("max_grad_norm", &TrainConfig::max_grad_norm, "clip the global gradient norm (<= 0: no clipping)"),
      // evaluation and records
      field("eval_every", &TrainConfig::eval_every, "validation loss every this many steps"),
      field("eval_batches", &TrainConfig::eval_batches, "validation batches per evaluation"),
      field("record_every", &TrainConfig::record_every, "routing / topology / sample / spans every this many steps"),
      field("sample_bytes", &TrainConfig::sample_bytes, "bytes of text in each recorded sample"),
      field("log_every", &TrainConfig::log_every, "progress line and step events flushed this often"),
      field("checkpoint_every", &TrainConfig::checkpoint_every, "checkpoint every this many steps (and at the end)"),
      field("keep_checkpoints", &TrainConfig::keep_checkpoints, "checkpoints kept (the newest)"),
      // data and the run
      field("data", &TrainConfig::data, "a converted corpus directory or any text file"),
      field("run_dir", &TrainConfig::run_dir, "where the run record and checkpoints go"),
      field("name", &TrainConfig::name, "the run's name (default: run_dir's last part)"),
      field("seed", &TrainConfig::seed, "model initialisation seed"),
      field("data_seed", &TrainConfig::data_seed, "training batch seed"),
      field("resume", &TrainConfig::resume, "continue the run in run_dir from its latest checkpoint"),
      field("overwrite", &TrainConfig::overwrite, "replace an existing run in run_dir"),
      field("stop_after", &TrainConfig::stop_after, "stop after this many steps in total (0: at steps)"),
      field("cuda_graph", &TrainConfig::cuda_graph, "each step's forward + backward as one CUDA graph, replayed (on | off)"),
      field("placement", &TrainConfig::placement, "where the experts live on several ranks: contiguous (E / R a rank in id order) | eplb (re-planned by load every rebalance_every steps, with replicas of hot experts)"),
      field("redundant_slots", &TrainConfig::redundant_slots, "eplb: spare expert slots a rank, for replicas of the hot experts"),
      field("rebalance_every", &TrainConfig::rebalance_every, "eplb: re-plan the placement every this many steps, from their loads"),
      field("attention", &TrainConfig::attention, "the attention core: auto (fused where D / heads is 32, 64 or 128) | fused | unfused (cuBLAS products, the baseline)"),
      switch_field("overlap", &TrainConfig::overlap, "two-micro-batch overlap: each rank's batch as two halves, one's exchanges under the other's compute (on | off | auto: on where it pays, several ranks)"),
      // benchmark mode
      field("benchmark_steps", &TrainConfig::benchmark_steps, "benchmark: time this many steps of random bytes (no data, no record)"),
      field("benchmark_warmup", &TrainConfig::benchmark_warmup, "benchmark: untimed steps first (and at least 1 s of them)"),
      field("benchmark_json", &TrainConfig::benchmark_json, "benchmark: also write the results to this JSON file"),
      field("benchmark_kernel_trace", &TrainConfig::benchmark_kernel_trace, "benchmark: also trace every kernel of 10 more steps (CUPTI, cuda/bench/kernel_trace.h): each kernel's GPU time a step"),
  };
  return table;
}

std::string flag_of(const std::string& key) {
  std::string flag = "--" + key;
  for (char& c : flag) if (c == '_') c = '-';
  return flag;
}

std::string allowed_keys() {
  std::string list;
  for (const Field& field : fields()) list += (list.empty() ? "" : ", ") + field.key;
  return list;
}

const Field& find_field(const std::string& key, const std::string& source) {
  for (const Field& field : fields()) {
    if (field.key == key) return field;
  }
  throw TrainConfigError(source + ": unknown setting '" + key + "'; allowed: " + allowed_keys());
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::integer: return "an integer";
    case Kind::number: return "a number";
    case Kind::text: return "a string";
    case Kind::boolean: return "true or false (on or off)";
    case Kind::switch_or_auto: return "true, false or \"auto\" (on, off or auto)";
  }
  return "?";
}

// Sets one field from a JSON value, checking its type; enum parsers' errors get the source in front.
void set_field(TrainConfig& config, const Field& field, const json& value, const std::string& source) {
  const bool ok = (field.kind == Kind::integer && value.is_number_integer()) ||
                  (field.kind == Kind::number && value.is_number()) ||
                  (field.kind == Kind::text && value.is_string()) ||
                  (field.kind == Kind::boolean && value.is_boolean()) ||
                  (field.kind == Kind::switch_or_auto && (value.is_boolean() || value == "auto"));
  if (!ok) {
    throw TrainConfigError(source + ": " + field.key + " = " + json_excerpt(value) + "; allowed: " + kind_name(field.kind));
  }
  if (field.kind == Kind::integer && value.is_number_integer() && value.get<int64_t>() < 0 &&
      (field.key == "seed" || field.key == "data_seed")) {
    throw TrainConfigError(source + ": " + field.key + " = " + json_excerpt(value) + "; allowed: an integer >= 0");
  }
  try {
    field.set(config, value);
  } catch (const std::invalid_argument& error) {
    throw TrainConfigError(source + ": " + error.what());
  }
}

// A flag's text as the JSON value its field expects.
json value_of_flag(const Field& field, const std::string& text, const std::string& flag) {
  auto bad = [&] {
    return TrainConfigError("flag " + flag + " " + text + ": not " + kind_name(field.kind));
  };
  switch (field.kind) {
    case Kind::integer: {
      const std::optional<int64_t> value = parse_integer(text);
      if (!value) throw bad();
      return json(*value);
    }
    case Kind::number: {  // NaN and infinities too: validate() names the setting and its range
      const std::optional<double> value = parse_real(text);
      if (!value) throw bad();
      return json(*value);
    }
    case Kind::text: return json(text);
    case Kind::boolean:
    case Kind::switch_or_auto:
      if (text == "true" || text == "1" || text == "on") return json(true);
      if (text == "false" || text == "0" || text == "off") return json(false);
      if (field.kind == Kind::switch_or_auto && text == "auto") return json("auto");
      throw bad();
  }
  throw bad();
}

// `field` starts with the setting's key ("block_size (B)"); the message ends with its flag, so the
// user of the command line and the writer of a JSON file both find what to change.
void reject(const std::string& field, const std::string& value, const std::string& allowed) {
  throw TrainConfigError("invalid training config: " + field + " = " + value + "; allowed: " + allowed + " (" +
                         flag_of(field.substr(0, field.find(' '))) + ")");
}

}  // namespace

// ---- [SECTION] presets ----

TrainConfig preset(std::string_view name) {
  TrainConfig c;
  c.preset = std::string(name);
  ModelConfig& m = c.model;
  m.formulation = Formulation::dropless;
  m.moe_layers = MoeLayers::every_block;
  m.top_k = 2;
  m.capacity_factor = 1.0;
  m.aux_loss_coef = 0.01;
  m.z_loss_coef = 0.001;
  if (name == "default") {
    // About 8.5M parameters, 3.4M active per byte: two epochs of Brown's 5.3 MB in 2000 steps.
    m.model_dim = 256; m.num_layers = 4; m.num_heads = 4; m.seq_len = 256;
    m.num_experts = 8; m.expert_hidden_dim = 512; m.dense_hidden_dim = 1024; m.block_size = 128;
    c.batch = 32;
  } else if (name == "throughput") {
    // The speed configuration: its step timed beside PyTorch's is in
    // notebooks_data/bench/train_throughput_vs_torch_h200_2026-11-22.json.
    m.model_dim = 512; m.num_layers = 8; m.num_heads = 8; m.seq_len = 256;
    m.num_experts = 16; m.expert_hidden_dim = 1024; m.dense_hidden_dim = 2048; m.block_size = 128;
    c.batch = 64;
    c.learning_rate = 1e-3;
  } else if (name == "tiny") {
    m.model_dim = 64; m.num_layers = 2; m.num_heads = 2; m.seq_len = 64;
    m.num_experts = 4; m.expert_hidden_dim = 128; m.dense_hidden_dim = 256; m.block_size = 64;
    c.batch = 8;
    c.steps = 60; c.warmup_steps = 10; c.eval_every = 20; c.eval_batches = 2;
    c.record_every = 10; c.log_every = 5; c.checkpoint_every = 20; c.sample_bytes = 48;
  } else {
    std::string names;
    for (const std::string& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw TrainConfigError("unknown preset '" + std::string(name) + "'; allowed: " + names);
  }
  return c;
}

std::vector<std::string> preset_names() { return {"default", "throughput", "tiny"}; }

// ---- [SECTION] JSON and flags ----

void apply_json(TrainConfig& config, const json& object, const std::string& source) {
  if (!object.is_object()) throw TrainConfigError(source + ": expected a JSON object of settings");
  for (const auto& [key, value] : object.items()) {
    if (key == "preset") continue;  // chosen before the file is applied (parse_arguments)
    set_field(config, find_field(key, source), value, source);
  }
}

json to_json(const TrainConfig& config) {
  json object = json::object();
  object["preset"] = config.preset;
  for (const Field& field : fields()) object[field.key] = field.get(config);
  return object;
}

json model_json(const TrainConfig& config) {
  static const std::vector<std::string> model_keys = {
      "model_dim", "num_layers", "num_heads", "seq_len", "moe_layers", "dense_hidden_dim", "num_experts", "top_k",
      "expert_hidden_dim", "formulation", "activation", "capacity_factor", "block_size", "aux_loss_coef", "z_loss_coef",
      "pregated", "batch"};
  const json all = to_json(config);
  json model = json::object();
  for (const std::string& key : model_keys) model[key] = all[key];
  model["vocabulary"] = kByteVocabulary;
  return model;
}

TrainConfig parse_arguments(const std::vector<std::string>& arguments) {
  // CLI11 reads the command line (common/command_line.h), its flags declared from the table of
  // fields. Each flag's text is kept in the order given and applied after --preset and --config.
  // A flag's value is the next argument or follows '=' ("--steps=100"); a boolean may have none.
  struct Flag { std::string name; std::optional<std::string> value; };
  std::vector<Flag> flags;
  CLI::App app{"moe_train's settings", "moe_train"};
  app.set_help_flag();  // --help is the program's (help_text)
  app.allow_extras();   // an unknown setting is named below, with the settings that exist
  auto keep = [&flags](const std::string& name) {
    return [&flags, name](const std::vector<std::string>& values) {
      const bool given = !values.empty() && !values.front().empty();
      flags.push_back({name, given ? std::optional<std::string>(values.front()) : std::nullopt});
    };
  };
  for (const char* flag : {"--preset", "--config"}) {
    app.add_option_function<std::vector<std::string>>(flag, keep(flag))
        ->trigger_on_parse()
        ->expected(1)
        ->allow_extra_args(false);
  }
  for (const Field& field : fields()) {
    const std::string flag = flag_of(field.key);
    // One value at most: what follows is the next flag, or an argument named below as unexpected.
    CLI::Option* option =
        app.add_option_function<std::vector<std::string>>(flag, keep(flag))->trigger_on_parse()->allow_extra_args(false);
    if (field.kind == Kind::boolean || field.kind == Kind::switch_or_auto) option->expected(0, 1);
    else option->expected(1);
  }
  try {
    app.parse(std::vector<std::string>(arguments.rbegin(), arguments.rend()));  // CLI11 takes them last first
  } catch (const CLI::ParseError& error) {
    throw TrainConfigError("flag " + command_line_message(error));
  }
  for (const std::string& extra : app.remaining()) {
    if (extra.rfind("--", 0) != 0) {
      throw TrainConfigError("unexpected argument '" + extra + "'; settings are flags such as --steps 100 (--help)");
    }
    const std::string name = extra.substr(0, extra.find('='));
    std::string key = name.substr(2);
    for (char& c : key) if (c == '-') c = '_';
    find_field(key, "flag " + name);  // throws: no such setting
  }
  auto require_value = [](const Flag& flag) -> const std::string& {
    if (!flag.value) throw TrainConfigError("flag " + flag.name + " needs a value");
    return *flag.value;
  };

  TrainConfig config = preset("default");
  for (const Flag& flag : flags) {
    if (flag.name == "--preset") config = preset(require_value(flag));
  }
  for (const Flag& flag : flags) {
    if (flag.name != "--config") continue;
    const std::string& path = require_value(flag);
    if (std::error_code error; std::filesystem::is_directory(path, error)) {
      throw TrainConfigError("--config " + path + ": a directory, not a JSON file");
    }
    if (!std::ifstream(path)) throw TrainConfigError("--config " + path + ": cannot open the file");
    std::string text;
    try {
      text = read_file_capped(path, uint64_t{1} << 20);  // a config is a few hundred bytes
    } catch (const std::exception& error) {
      throw TrainConfigError("--config " + std::string(error.what()));
    }
    json object;
    if (const std::string why = parse_untrusted_json(text, object); !why.empty()) {
      throw TrainConfigError("--config " + path + ": " + why);
    }
    apply_json(config, object, path);
  }
  for (const Flag& flag : flags) {
    if (flag.name == "--preset" || flag.name == "--config") continue;
    std::string key = flag.name.substr(2);
    for (char& c : key) if (c == '-') c = '_';
    const Field& field = find_field(key, "flag " + flag.name);
    const bool bare_switch = field.kind == Kind::boolean || field.kind == Kind::switch_or_auto;
    const json value = bare_switch && !flag.value ? json(true)
                                                                  : value_of_flag(field, require_value(flag), flag.name);
    set_field(config, field, value, "flag " + flag.name);
  }
  return config;
}

// ---- [SECTION] validation ----

void validate(const TrainConfig& c) {
  try {
    validate(c.model);
  } catch (const std::invalid_argument& error) {
    // The model's checks name the key ("seq_len (S) = 0"): add the flag of the first key named.
    const std::string message = error.what();
    size_t first = std::string::npos;
    std::string flag;
    for (const Field& field : fields()) {
      for (const char* after : {" (", " ="}) {
        const size_t at = message.find(field.key + after);
        const bool whole_word = at != std::string::npos && (at == 0 || message[at - 1] == ' ');
        if (whole_word && at < first) first = at, flag = flag_of(field.key);
      }
    }
    throw TrainConfigError("invalid training config: " + message + (flag.empty() ? "" : " (" + flag + ")"));
  }
  const bool moe = c.model.moe_layers != MoeLayers::none;
  if (moe && c.model.formulation == Formulation::dropless && c.model.block_size != 64 && c.model.block_size != 128) {
    reject("block_size (B)", std::to_string(c.model.block_size), "64 or 128 (the GPU's block-sparse kernels)");
  }
  if (c.batch < 1) reject("batch (N)", std::to_string(c.batch), "N >= 1");
  if (c.micro_batches < 1 || c.batch % c.micro_batches != 0) {
    reject("micro_batches (M)", std::to_string(c.micro_batches),
           "M >= 1 dividing batch (N = " + std::to_string(c.batch) + ")");
  }
  if (c.micro_batches > 1 && moe && c.model.formulation != Formulation::dropless) {
    reject("micro_batches (M)", std::to_string(c.micro_batches) + " with formulation = " +
           std::string(to_string(c.model.formulation)),
           "1, or formulation = dropless (one expert weight-gradient product over the micro-batches)");
  }
  if (c.micro_batches > 1 && c.cuda_graph) {
    reject("micro_batches (M)", std::to_string(c.micro_batches) + " with cuda_graph = true",
           "1 with cuda_graph (the graph holds one forward + backward)");
  }
  if (c.overlap.value_or(false) && (c.micro_batches > 1 || c.cuda_graph || c.batch % 2 != 0)) {
    reject("overlap", "on with batch N = " + std::to_string(c.batch) + ", micro_batches M = " +
           std::to_string(c.micro_batches) + ", cuda_graph " + (c.cuda_graph ? "on" : "off"),
           "an even batch, M = 1 and cuda_graph off (each rank's N / R sequences run as two halves)");
  }
  if (c.attention != "auto" && c.attention != "fused" && c.attention != "unfused") {
    reject("attention", "\"" + c.attention + "\"", "auto, fused or unfused");
  }
  if (c.attention == "fused" && c.model.num_heads > 0 && c.model.model_dim % c.model.num_heads == 0) {
    const int64_t head_dim = c.model.model_dim / c.model.num_heads;
    if (head_dim != 32 && head_dim != 64 && head_dim != 128) {
      reject("attention", "fused with head width D / heads = " + std::to_string(head_dim),
             "head widths 32, 64, 128 for the fused core; or auto / unfused");
    }
  }
  if (c.placement != "contiguous" && c.placement != "eplb") reject("placement", "\"" + c.placement + "\"", "contiguous or eplb");
  if (c.redundant_slots < 0 || c.redundant_slots > 256) {
    reject("redundant_slots", std::to_string(c.redundant_slots), "0 to 256 spare slots a rank (E <= 256)");
  }
  if (c.rebalance_every < 1) reject("rebalance_every", std::to_string(c.rebalance_every), "rebalance_every >= 1 steps");
  if (c.steps < 1) reject("steps", std::to_string(c.steps), "steps >= 1");
  if (!(c.learning_rate > 0) || !std::isfinite(c.learning_rate)) {
    reject("learning_rate", std::to_string(c.learning_rate), "a finite number > 0");
  }
  if (c.warmup_steps < 0 || c.warmup_steps >= c.steps) {
    reject("warmup_steps", std::to_string(c.warmup_steps), "0 <= warmup_steps < steps (" + std::to_string(c.steps) + ")");
  }
  if (!(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1)) reject("min_lr_ratio", std::to_string(c.min_lr_ratio), "0 <= ratio <= 1");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) reject("beta1", std::to_string(c.beta1), "0 <= beta1 < 1");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) reject("beta2", std::to_string(c.beta2), "0 <= beta2 < 1");
  if (!(c.weight_decay >= 0) || !std::isfinite(c.weight_decay)) reject("weight_decay", std::to_string(c.weight_decay), "a finite number >= 0");
  if (!std::isfinite(c.max_grad_norm)) reject("max_grad_norm", std::to_string(c.max_grad_norm), "a finite number");
  if (c.eval_every < 1) reject("eval_every", std::to_string(c.eval_every), "eval_every >= 1");
  if (c.eval_batches < 1) reject("eval_batches", std::to_string(c.eval_batches), "eval_batches >= 1");
  if (c.record_every < 1) reject("record_every", std::to_string(c.record_every), "record_every >= 1");
  if (c.sample_bytes < 1 || c.sample_bytes > c.model.seq_len) {
    reject("sample_bytes", std::to_string(c.sample_bytes), "1 <= sample_bytes <= seq_len (" + std::to_string(c.model.seq_len) + ")");
  }
  if (c.log_every < 1) reject("log_every", std::to_string(c.log_every), "log_every >= 1");
  if (c.checkpoint_every < 1) reject("checkpoint_every", std::to_string(c.checkpoint_every), "checkpoint_every >= 1");
  if (c.keep_checkpoints < 1) reject("keep_checkpoints", std::to_string(c.keep_checkpoints), "keep_checkpoints >= 1");
  if (c.stop_after < 0 || c.stop_after > c.steps) {
    reject("stop_after", std::to_string(c.stop_after), "0 (run to the end) or 1 .. steps (" + std::to_string(c.steps) + ")");
  }
  if (c.resume && c.overwrite) reject("resume", "true with overwrite = true", "one of the two (resume continues a run, overwrite replaces it)");
  if (c.benchmark_steps < 0) reject("benchmark_steps", std::to_string(c.benchmark_steps), "0 (train) or >= 1 (benchmark)");
  if (c.benchmark_warmup < 0) reject("benchmark_warmup", std::to_string(c.benchmark_warmup), "benchmark_warmup >= 0");
  if (c.benchmark_steps == 0 && c.run_dir.empty()) reject("run_dir", "\"\"", "a directory for the run record");
  if (c.benchmark_steps == 0 && c.data.empty()) reject("data", "\"\"", "a corpus directory or a text file");
}

void check_placement(const TrainConfig& c, int ranks) {
  if (c.model.moe_layers == MoeLayers::none) {
    if (c.placement == "eplb") reject("placement", "eplb for a dense model", "contiguous (there are no experts to place)");
    return;
  }
  const int64_t E = c.model.num_experts, R = ranks;
  if (R > 1 && E < R) {
    reject("num_experts (E)", std::to_string(E) + " on " + std::to_string(R) + " ranks",
           "at least one expert a rank: E >= R");
  }
  if (c.placement != "eplb") return;
  if (R == 1) reject("placement", "eplb on one GPU", "contiguous (every expert is on the one GPU; eplb places them over several ranks)");
  const int64_t spare_at_most = E - (E + R - 1) / R;
  if (c.redundant_slots > spare_at_most) {
    reject("redundant_slots", std::to_string(c.redundant_slots) + " with E = " + std::to_string(E) + " on R = " +
           std::to_string(R) + " ranks", "0 to E - ceil(E / R) = " + std::to_string(spare_at_most) + " (a rank holds an expert once)");
  }
  if (c.redundant_slots > 0 && c.model.formulation == Formulation::padded) {
    reject("redundant_slots", std::to_string(c.redundant_slots) + " with formulation = padded",
           "0 (padded computes each expert as C rows on one rank), or formulation dropless or dropping");
  }
}

bool overlaps(const TrainConfig& c, int ranks) {
  if (c.overlap.has_value()) return *c.overlap;
  return ranks > 1 && c.micro_batches == 1 && !c.cuda_graph && c.batch % ranks == 0 && (c.batch / ranks) % 2 == 0;
}

ScheduleConfig schedule(const TrainConfig& c) {
  ScheduleConfig s;
  s.peak_lr = c.learning_rate;
  s.warmup_steps = c.warmup_steps;
  s.total_steps = c.steps;
  s.min_lr_ratio = c.min_lr_ratio;
  return s;
}

std::string help_text(const TrainConfig& defaults) {
  std::ostringstream out;
  out << "  --preset NAME                   default | throughput | tiny (applied first)\n"
      << "  --config FILE.json              settings as JSON, keys as the flags below (applied second)\n";
  const json values = to_json(defaults);
  for (const Field& field : fields()) {
    std::string left = flag_of(field.key);
    if (field.kind != Kind::boolean) {
      left += ' ';
      left += values[field.key].dump();
    }
    if (left.size() < 30) left.resize(30, ' ');
    out << "  " << left << "  " << field.help << "\n";
  }
  return out.str();
}

// ---- [SECTION] FLOP accounting ----

namespace {
int64_t attention_parameters(const ModelConfig& m) { return 4 * m.model_dim * m.model_dim; }
int64_t layer_norm_parameters(const ModelConfig& m) { return 4 * m.model_dim; }
// One expert's W1 [D, w1_columns] and W2 [H, D]: 2 D H for GeLU, 3 D H for SwiGLU.
int64_t expert_parameters(const ModelConfig& m) {
  const int64_t w1 = m.activation == Activation::swiglu ? 2 * m.expert_hidden_dim : m.expert_hidden_dim;
  return m.model_dim * w1 + m.expert_hidden_dim * m.model_dim;
}
}  // namespace

int64_t active_parameters(const ModelConfig& m) {
  const int64_t D = m.model_dim;
  int64_t active = kByteVocabulary * D;  // the tied output projection
  for (int64_t layer = 0; layer < m.num_layers; ++layer) {
    active += attention_parameters(m);
    active += is_moe_block(m, layer) ? D * m.num_experts + m.top_k * expert_parameters(m)
                                          : 2 * D * m.dense_hidden_dim;
  }
  return active;
}

int64_t total_parameters(const ModelConfig& m) {
  const int64_t D = m.model_dim;
  int64_t total = kByteVocabulary * D + m.seq_len * D + 2 * D;  // embeddings, final LayerNorm
  for (int64_t layer = 0; layer < m.num_layers; ++layer) {
    total += attention_parameters(m) + layer_norm_parameters(m);
    total += is_moe_block(m, layer) ? D * m.num_experts + m.num_experts * expert_parameters(m)
                                         : 2 * D * m.dense_hidden_dim;
  }
  return total;
}

double flops_per_token(const ModelConfig& m) {
  return 6.0 * double(active_parameters(m)) + 12.0 * double(m.num_layers * m.seq_len * m.model_dim);
}

}  // namespace moe::train
