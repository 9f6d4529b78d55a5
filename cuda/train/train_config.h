// train_config.h: everything a training run of the tiny byte-level MoE language model is told:
// the model (moe::ModelConfig), the batch, the optimizer and its schedule, evaluation,
// recording, checkpoints, the data and where the run goes. Plain C++ (no CUDA), so its parsing and
// its errors are tested on machines without a GPU.
// Built into moe_train_config; used by moe_train (moe_train.cpp); tests: ctest -R train_config.
//
// Three layers, each overriding the one before:
//   1. a preset:          --preset default | throughput | tiny        (presets below)
//   2. a JSON file:       --config FILE   {"formulation": "dropping", "capacity_factor": 1.0, ...}
//   3. flags:             --formulation dropping --capacity-factor 1.0
// JSON keys and flag names are the same words (a flag's dashes are the key's underscores), taken
// from one table of fields (train_config.cpp), so the two can never drift apart; `moe_train --help`
// prints that table. An unknown key or flag, a value of the wrong type, or a config that
// validate() rejects gets an error that names the field, the value and what is allowed.
//
// Dimension legend (reference_cpu/README.md): D model width, L blocks, S sequence length,
// N sequences per step, T = N * S tokens, E experts, K top-k, H expert hidden width, B block size.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model_config.h"             // moe::ModelConfig
#include "optimizer_config.h"         // moe::ScheduleConfig

namespace moe::train {

// The one error type of configuration: the message names the field and what is allowed.
class TrainConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct TrainConfig {
  std::string preset = "default";
  ModelConfig model;       // D, L, heads, S, MoE fields, pre-gating
  int64_t batch = 32;           // N sequences of S bytes per step
  // Gradient accumulation: the step's N sequences run as M micro-batches of N / M, every gradient
  // added up, the MoE blocks' expert weight gradients as one product over all M (ModelGpu,
  // MoeLayerGpu). The activations are one micro-batch's. One GPU, dropless (or a dense model).
  int64_t micro_batches = 1;

  // optimizer: AdamW (moe::AdamWConfig) with warm-up + cosine decay (ScheduleConfig)
  int64_t steps = 2000;
  double learning_rate = 2e-3;  // the peak
  int64_t warmup_steps = 100;
  double min_lr_ratio = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double weight_decay = 0.1;
  double max_grad_norm = 1.0;   // global-norm clipping; <= 0 measures only

  // evaluation: the mean validation loss over the same eval_batches batches each time
  int64_t eval_every = 100;
  int64_t eval_batches = 16;

  // the run record (notebooks_data/README.md): a step event every step; routing, topology,
  // a text sample with its experts, and per-phase times every record_every steps
  int64_t record_every = 50;
  int64_t sample_bytes = 120;   // bytes of the "tokens" sample
  int64_t log_every = 10;       // the progress line and the step events are flushed this often

  // checkpoints in <run_dir>/checkpoints: every checkpoint_every steps and at the end
  int64_t checkpoint_every = 500;
  int64_t keep_checkpoints = 2;

  std::string data = "notebooks_data/brown";  // a converted corpus directory or any text file
  std::string run_dir = "runs/train";         // the run record (and checkpoints) go here
  std::string name;                           // "" = the last part of run_dir
  uint64_t seed = 1;        // model initialisation
  uint64_t data_seed = 2;   // the training batches (validation batches use a fixed seed of their own)

  bool resume = false;      // continue the run in run_dir from its latest checkpoint
  bool overwrite = false;   // replace an existing run in run_dir
  int64_t stop_after = 0;   // stop (with a checkpoint) after this many steps in total; 0 = at `steps`
  // Each step's forward and backward as one CUDA graph (ModelGpu::forward_backward_graph), captured
  // once and replayed; recorded steps run uncaptured (their phases are timed). One GPU only.
  bool cuda_graph = false;
  // Two-micro-batch overlap (cuda/model/model.h): each rank's N / R sequences run as two halves side
  // by side, so that one half's all-to-alls run while the other half computes. An even N / R, M = 1.
  // Unset ("auto", the default): on where it pays, see overlaps(); true / false: on / off.
  std::optional<bool> overlap;
  // The attention core (cuda/model/attention.h): "auto" (fused where the head width D / heads is 32,
  // 64 or 128, else unfused), "fused" (FlashAttention-2's algorithm, no [S, S] matrix in memory) or
  // "unfused" (cuBLAS batched products and a softmax kernel: the readable baseline).
  std::string attention = "auto";
  // Where each MoE block's experts live on several ranks (common/expert_placement.h):
  //   "contiguous"  E / R a rank in id order (FastMoE's; one more on some ranks where R does not
  //                 divide E), fixed for the run;
  //   "eplb"        DeepSeek's EPLB: every rebalance_every steps each block's placement is planned
  //                 again from the loads its experts were routed in those steps, with
  //                 redundant_slots spare slots a rank for replicas of the hot experts; the experts'
  //                 weights and AdamW moments move to their new ranks between two steps.
  // Checkpoints keep the placement; a run resumed on as many ranks continues with it.
  std::string placement = "contiguous";
  int64_t redundant_slots = 1;
  int64_t rebalance_every = 100;

  // benchmark mode: no data, no record; time this many steps of random bytes after warm-up
  int64_t benchmark_steps = 0;
  int64_t benchmark_warmup = 5;
  std::string benchmark_json;  // "" = print only
  bool benchmark_kernel_trace = false;  // also trace every kernel of 10 more steps (CUPTI)
};

// The named starting points. "default": a model that learns something visible from the Brown
// corpus in a minute or two on one H100/H200; "throughput": the configuration the training step is
// timed at (D=512, L=8, 8 heads, E=16 of H=1024, K=2, S=256, N=64); "tiny": the sizes the CPU
// reference runs in a second (tests).
TrainConfig preset(std::string_view name);
std::vector<std::string> preset_names();

// Builds a config from command-line arguments (argv without the program name): a --preset first
// if given, then --config FILE, then every other flag in order. The flags are CLI11's
// (common/command_line.h), declared from the table of fields. Throws TrainConfigError.
// `--help` is not handled here (help_text() is).
TrainConfig parse_arguments(const std::vector<std::string>& arguments);

// Applies the fields of a JSON object (keys as in to_json). Throws TrainConfigError.
void apply_json(TrainConfig& config, const nlohmann::json& object, const std::string& source);
nlohmann::json to_json(const TrainConfig& config);

// The model part alone, as the run record's "model" and a checkpoint's model_config keep it: a
// resumed run refuses a checkpoint whose model differs.
nlohmann::json model_json(const TrainConfig& config);

// Throws TrainConfigError naming the first bad field (the model through validate).
void validate(const TrainConfig& config);

// The placement's checks that need the number of ranks: "eplb" on several ranks, E >= R (a rank holds
// an expert of every block), 0 <= redundant_slots <= E - ceil(E / R) (a rank holds an expert once),
// no replicas with the padded formulation. Throws TrainConfigError naming the flag.
void check_placement(const TrainConfig& config, int ranks);

// Whether a run of `config` on `ranks` ranks overlaps two micro-batches: config.overlap where set;
// "auto" turns it on where it pays: on several ranks (expert-parallel exchanges to hide) with an
// even N / R, M = 1 and no CUDA graph. On one GPU there is nothing to hide and the halves' smaller
// kernels cost time (two H200s, 2026-11-28, the throughput preset, one call: 17.69 / 17.80 ms
// overlapped against 18.21 / 18.25 ms plain on two GPUs; 14.77 / 14.71 against 14.20 / 14.14 on one;
// notebooks_data/bench/train_overlap_default_h200x2_2026-11-28.txt).
bool overlaps(const TrainConfig& config, int ranks);

ScheduleConfig schedule(const TrainConfig& config);

// One line per field: flag, default of the given config, meaning.
std::string help_text(const TrainConfig& defaults);

// ---- arithmetic a run reports ----

// Model FLOPs per trained token (forward + backward), PaLM's accounting (Chowdhery et al. 2022,
// appendix B): 6 x the parameters a token passes through (attention, the K active experts or the
// dense FFN, gates, the tied output projection; not the embedding lookups) + 12 L S D for the
// attention scores and their use (causal halving not taken).
double flops_per_token(const ModelConfig& model);

// The parameters a token passes through (active) and all of them (total).
int64_t active_parameters(const ModelConfig& model);
int64_t total_parameters(const ModelConfig& model);

}  // namespace moe::train
