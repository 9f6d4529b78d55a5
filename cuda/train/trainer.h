// trainer.h: trains the tiny byte-level MoE transformer on one GPU and records the run: the loop
// that joins ModelGpu (cuda/model/model.h), the text and its batches (common/text_corpus.h,
// batch_sampler.h), the learning-rate schedule (reference_cpu/optimizer.h), checkpoints
// (common/checkpoint.h), the run record the viewer follows (common/run_record.h) and the progress
// line (common/progress_line.h). moe_train.cpp is its command line; tests/train/ drive it directly.
//
// One step, all enqueued on the model's stream with no host synchronisation:
//   bytes of N windows -> pinned host slot -> device tokens / targets (two slots, so the host fills
//   one while the GPU reads the other) -> forward -> backward -> clip + AdamW -> this step's four
//   losses copied into a device ring of log_every rows.
// Every log_every steps the host synchronises once, reads the ring, appends one "step" event per
// step and redraws the progress line. Every record_every steps it also reads each MoE layer's
// routing (routing, topology, tokens events) and the phase times of that step (span events).
// Every eval_every steps: the mean loss over the same eval_batches validation batches, in nats and
// bits per byte. Every checkpoint_every steps (and at the end): a checkpoint, the oldest pruned.
//
// On several GPUs (`ranks`, model/model_ranks.h; distributed/train/moe_train_distributed.cpp is its
// command line under mpirun): every rank samples the same global batch of N sequences and trains on
// its N / R of them; the replicated parameters' gradients are summed over the ranks, the experts live
// E / R per rank (model/model.h). Rank 0 writes the run record (every rank's spans, the all-to-all
// row counts as rank x rank byte matrices) and the checkpoints, which hold the whole model in the
// one-GPU layout: a run resumes on any number of ranks, one GPU included. Losses and validation
// are averaged over the ranks; every collective happens on every rank at the same step.
//
// Stopping early (common/stop_signal.h): once the program has installed the stop handlers, a SIGINT
// or SIGTERM ends the run after the step in flight, with a checkpoint of that step and the record
// flushed, as if it were the last step (no summary). On several ranks every rank must stop after the
// same step: the ranks decide together at each flush of the losses (the signal rides in the
// losses' mean, a collective made anyway), so a run of R ranks stops within log_every steps.
//
// Resuming (config.resume): the newest checkpoint of <run_dir>/checkpoints gives the weights,
// AdamW's moments and step, the schedule's position and the batch sampler's state, so the run
// continues the curve it was on (tests/train/test_trainer.cpp checks it step for step). Events the
// interrupted run wrote after that checkpoint are cut from events.jsonl first, so every step
// appears once.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "bench/kernel_trace.h"  // KernelShare: --benchmark-kernel-trace
#include "model/model.h"         // ModelGpuConfig
#include "model/model_ranks.h"   // ModelRanks
#include "train/train_config.h"  // TrainConfig

namespace moe::train {

struct TrainResult {
  int64_t first_step = 0;             // 0, or the checkpoint's step when resumed
  int64_t steps_done = 0;             // the step the run stopped at
  std::vector<double> losses;         // [steps run here] the training loss of each step
  double validation_loss = 0;         // nats per byte, the last evaluation
  double validation_bits_per_byte = 0;
  double unigram_bits_per_byte = 0;   // the baseline of the same validation text
  double median_step_ms = 0;          // GPU time of a plain step (no evaluation or recording)
  double tokens_per_second = 0;       // T / median step time
  double mfu = 0;                     // model FLOPs utilisation; 0 when the peak is unknown
  double dropped_fraction = 0;        // routed (token, expert) pairs dropped, over the recorded steps
  double wall_seconds = 0;
  int stopped_by_signal = 0;          // SIGINT or SIGTERM ended the run early (after a checkpoint), else 0
};

// Trains as configured, writing the run record and checkpoints; progress and the summary go to
// `log`. Throws TrainConfigError for a bad config, TextCorpusError for missing or bad data,
// CheckpointError for a bad checkpoint or none to resume from, TrainConfigError for an existing run
// without --overwrite or a --run-dir that cannot be created (all before the GPU is touched).
// With `ranks`, this is one rank of a collective run: every rank calls it with the same config; only
// rank 0 writes to `log` and to the run directory.
TrainResult train(const TrainConfig& config, std::ostream& log, cuda::ModelRanks* ranks = nullptr);

// The checks train() makes before it touches the GPU: the settings, the data (both splits hold a
// sequence), the checkpoint a resumed run reads (whole, the same model) and the run directory (no
// run there without --overwrite, creatable). Throws as train() does. moe_train_distributed calls it
// on every rank before the ranks take their GPUs, so bad input is reported on any machine; it
// costs one more read of the data and of the checkpoint.
void check_inputs(const TrainConfig& config, int ranks);

struct BenchmarkResult {
  std::string device;
  std::string data;                  // where the batches came from
  int64_t tokens_per_step = 0;       // T
  double median_step_ms = 0;
  double min_step_ms = 0;
  double tokens_per_second = 0;
  double mfu = 0;
  double flops_per_token = 0;
  std::vector<std::pair<std::string, double>> phase_ms;  // one timed step, by phase (summed over layers)
  double moe_share = 0;              // the MoE phases' share of that step (forward + backward)
  double exposed_communication_ms = 0;  // that step's phases of communication not hidden (is_exposed_communication)
  std::string weights;               // "the initial weights", or the checkpoint resumed from
  // How evenly that step's routing spread each MoE block's rows (all ranks' tokens): the busiest
  // expert's rows over the mean expert's, and the busiest rank's (its E / R experts') over the mean
  // rank's, one value per MoE block.
  std::vector<double> expert_max_over_mean, rank_max_over_mean;
  // That step's routing itself: per MoE block, [source rank][expert] the tokens' slots (moe_sim
  // predicts the measured step from it).
  std::vector<std::vector<std::vector<int64_t>>> routing_tokens;
  // --placement eplb (placed once, from the warm-up steps' loads, before the timed steps): per MoE
  // block the busiest rank's expected rows over the mean rank's under the starting placement and
  // under the plan, the plan itself (ExpertPlacement::describe) and the seconds the move took.
  std::vector<std::pair<double, double>> planned_rank_max_over_mean;
  std::vector<std::string> placements;
  double rebalance_seconds = 0;
  // --benchmark-kernel-trace: the kernels of the traced steps by name, the most GPU time first.
  std::vector<bench::KernelShare> kernels;
  int64_t traced_steps = 0;
};

// Times config.benchmark_steps optimizer steps after config.benchmark_warmup untimed ones, from the
// initial weights, or with config.resume from run_dir's latest checkpoint (its weights, optimizer
// state and step): a trained model routes as training does, where a few steps from the initial
// weights collapse each block's routing onto one or two experts. With `ranks`, collective as
// train(); tokens per step and per second count all ranks' tokens.
BenchmarkResult benchmark(const TrainConfig& config, std::ostream& log, cuda::ModelRanks* ranks = nullptr);

// Every rank's parameters, parts[q] in rank q's layout (cuda::parameter_layout of `local` with rank
// q), merged into the one-GPU layout: what a checkpoint holds. A replicated expert's tensor is taken
// from the lowest rank that holds it, and its other copies must agree bit for bit: else
// std::runtime_error naming the tensor, both ranks, the entry and the values. A part of the wrong
// length is a std::invalid_argument.
std::vector<float> merge_ranks(const cuda::ModelGpuConfig& local, const std::vector<std::vector<float>>& parts);

// The dense bf16 tensor-core peak of a known GPU in FLOP/s (H100 SXM and H200: 989e12), else 0.
double peak_bf16_flops(const std::string& device_name);

}  // namespace moe::train
