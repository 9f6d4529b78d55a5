// trainer.cpp: the training loop, its run record and checkpoints, and the throughput benchmark.
// See trainer.h for what one step does and when the host synchronises.
//
// Index:
//   [SECTION] the model on the GPU      config translation, initial weights
//   [SECTION] batches                   pinned double-buffered uploads
//   [SECTION] recording                 routing / topology / tokens / span events from one step
//   [SECTION] run directory             create, resume, cut events past a checkpoint
//   [SECTION] train
//   [SECTION] benchmark
#include "train/trainer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include "batch_sampler.h"        // BatchSampler, ByteBatch
#include "core/clock_warm_up.h"   // warm_up_clock
#include "checkpoint.h"           // save_checkpoint, load_checkpoint, latest_checkpoint
#include "core/cuda_check.h"      // CUDA_CHECK
#include "core/device_buffer.h"   // DeviceBuffer
#include "core/device_info.h"     // current_device
#include "reference_cpu/model.h"  // ref::init_model, ref::parameters (the initial weights)
#include "model/model.h"          // ModelGpu
#include "core/phase_timer.h"     // PhaseTimer
#include "progress_line.h"        // ProgressLine
#include "run_record.h"           // RunWriter, events
#include "text_corpus.h"          // load_corpus, unigram_bits_per_byte

namespace moe::train {
namespace {

using cuda::DeviceBuffer;
using nlohmann::json;
namespace fs = std::filesystem;

constexpr double kLn2 = 0.69314718055994530942;
// The validation batches are the same in every run and every evaluation: a fixed seed of their own.
constexpr uint64_t kValidationSeed = 0x5eed'0f'7a11'da7aull;

// ---- [SECTION] the model on the GPU ----

cuda::ModelGpuConfig gpu_config(const TrainConfig& c) {
  cuda::ModelGpuConfig g;
  g.model_dim = c.model.model_dim;
  g.num_layers = c.model.num_layers;
  g.num_heads = c.model.num_heads;
  g.seq_len = c.model.seq_len;
  g.batch = c.batch;
  g.moe_blocks = c.model.moe_layers == ref::MoeLayers::every_block         ? cuda::MoeBlocks::every_block
                 : c.model.moe_layers == ref::MoeLayers::every_other_block ? cuda::MoeBlocks::every_other_block
                                                                           : cuda::MoeBlocks::none;
  g.dense_hidden_dim = c.model.dense_hidden_dim;
  g.layer_norm_eps = c.model.layer_norm_eps;
  g.moe = ref::moe_layer_config(c.model, c.batch);
  g.pregated = c.model.pregated;
  return g;
}

cuda::OptimizerSettings optimizer_settings(const TrainConfig& c) {
  cuda::OptimizerSettings o;
  o.beta1 = float(c.beta1);
  o.beta2 = float(c.beta2);
  o.weight_decay = float(c.weight_decay);
  o.max_grad_norm = float(c.max_grad_norm);
  return o;
}

// The reference model's initialisation (GPT-2's), flattened in the one parameter order.
std::vector<float> initial_weights(const TrainConfig& c) {
  ref::ModelWeights values = ref::init_model(c.model, c.seed);
  ref::ModelWeights unused = ref::zero_weights(c.model);
  std::vector<float> flat;
  for (ref::Parameter& p : ref::parameters(c.model, values, unused)) {
    const double* data = p.value->data();
    for (int64_t i = 0; i < p.value->size(); ++i) flat.push_back(float(data[i]));
  }
  return flat;
}

std::string device_name() { return cuda::current_device().name; }

// The model's stream, created non-blocking (the legacy default stream would serialise with it),
// drained and destroyed when the run ends, also when it ends by an exception.
class OwnedStream {
 public:
  OwnedStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~OwnedStream() {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// ---- [SECTION] batches ----

// Two pinned host slots and two device slots: the host writes slot s while the GPU may still read
// slot 1 - s; an event per slot says when the GPU is done with it.
class BatchUploader {
 public:
  BatchUploader(int64_t batch, int64_t seq_len, cudaStream_t stream)
      : tokens_per_slot_(size_t(batch * seq_len)), seq_len_(seq_len), stream_(stream) {
    for (Slot& slot : slots_) {
      CUDA_CHECK(cudaMallocHost(&slot.host, 2 * tokens_per_slot_ * sizeof(int32_t)));
      slot.device = DeviceBuffer<int32_t>(2 * tokens_per_slot_);
      CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    }
  }
  ~BatchUploader() {
    for (Slot& slot : slots_) {
      cudaEventSynchronize(slot.done);
      cudaFreeHost(slot.host);
      cudaEventDestroy(slot.done);
    }
  }
  BatchUploader(const BatchUploader&) = delete;
  BatchUploader& operator=(const BatchUploader&) = delete;

  // Enqueues the upload of one batch's windows; returns {tokens, targets} on the device.
  std::pair<const int32_t*, const int32_t*> upload(const ByteBatch& batch) {
    Slot& slot = slots_[next_];
    next_ = 1 - next_;
    CUDA_CHECK(cudaEventSynchronize(slot.done));  // the step two back has finished reading it
    const size_t window = size_t(seq_len_ + 1);
    for (size_t n = 0; n < size_t(batch.batch); ++n) {
      for (size_t s = 0; s < size_t(seq_len_); ++s) {
        slot.host[n * seq_len_ + s] = batch.bytes[n * window + s];                           // inputs
        slot.host[tokens_per_slot_ + n * seq_len_ + s] = batch.bytes[n * window + s + 1];  // targets
      }
    }
    CUDA_CHECK(cudaMemcpyAsync(slot.device.data(), slot.host, 2 * tokens_per_slot_ * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    current_ = &slot;
    return {slot.device.data(), slot.device.data() + tokens_per_slot_};
  }
  // After the work that reads the current slot is enqueued.
  void release_current() { CUDA_CHECK(cudaEventRecord(current_->done, stream_)); }

 private:
  struct Slot {
    int32_t* host = nullptr;
    DeviceBuffer<int32_t> device;
    cudaEvent_t done = nullptr;
  };
  size_t tokens_per_slot_;
  int64_t seq_len_;
  cudaStream_t stream_;
  Slot slots_[2];
  int next_ = 0;
  Slot* current_ = nullptr;
};

ByteBatch random_batch(int64_t batch, int64_t seq_len, std::mt19937_64& generator) {
  ByteBatch b;
  b.batch = int(batch);
  b.sequence = int(seq_len);
  b.bytes.resize(size_t(batch * (seq_len + 1)));
  for (uint8_t& byte : b.bytes) byte = uint8_t(generator() & 0xFF);
  b.offsets.assign(size_t(batch), 0);
  b.genres.assign(size_t(batch), 0);
  return b;
}

// ---- [SECTION] recording ----

int64_t capacity_of(const TrainConfig& c) {
  return c.model.formulation == Formulation::dropless ? 0 : capacity(ref::moe_layer_config(c.model, c.batch));
}

struct RoutingSummary {
  int64_t routed = 0;   // (token, expert) pairs
  int64_t dropped = 0;
};

// Reads each MoE layer's routing of the last forward and appends its routing, topology and
// tokens events. Synchronises (through the downloads).
RoutingSummary record_routing(const TrainConfig& c, const TextCorpus* corpus, const cuda::ModelGpu& model,
                              const ByteBatch& batch, int64_t step, RunWriter& writer) {
  const int64_t E = c.model.num_experts, K = c.model.top_k, S = c.model.seq_len, B = c.model.block_size;
  const int64_t H = c.model.expert_hidden_dim;
  const int64_t C = capacity_of(c);
  const bool dropless = c.model.formulation == Formulation::dropless;
  RoutingSummary summary;
  for (int64_t layer = 0; layer < c.model.num_layers; ++layer) {
    const cuda::MoeLayerGpu* moe = model.moe_layer(layer);
    if (moe == nullptr) continue;
    const std::vector<int> top = moe->top_experts().download();  // [T, K]

    RoutingEvent routing{.step = step, .layer = layer};
    routing.tokens_per_expert.assign(size_t(E), 0);
    for (size_t t = 0; t < top.size() / size_t(K); ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int expert = top[t * size_t(K) + size_t(k)];
        ++routing.tokens_per_expert[size_t(expert)];
        if (corpus != nullptr) {
          const std::string& genre = corpus->genres[size_t(batch.genres[t / size_t(S)])].name;
          std::vector<int64_t>& counts = routing.tokens_per_expert_by_genre[genre];
          if (counts.empty()) counts.assign(size_t(E), 0);
          ++counts[size_t(expert)];
        }
      }
    }
    if (!dropless) {
      routing.capacity = C;
      routing.dropped_per_expert.assign(size_t(E), 0);
      for (int64_t e = 0; e < E; ++e) {
        routing.dropped_per_expert[size_t(e)] = std::max<int64_t>(0, routing.tokens_per_expert[size_t(e)] - C);
        summary.dropped += routing.dropped_per_expert[size_t(e)];
      }
    }
    for (int64_t count : routing.tokens_per_expert) summary.routed += count;
    writer.append(to_event(routing));

    if (dropless) {  // MegaBlocks' topology: each expert's rows rounded up to a multiple of B
      TopologyEvent topology{.step = step, .layer = layer, .block_size = B, .block_cols = H / B};
      for (int64_t count : routing.tokens_per_expert) {
        const int64_t rows = (count + B - 1) / B * B;
        topology.rows_per_expert.push_back(rows);
        topology.padding_rows += rows - count;
        topology.block_rows += rows / B;
      }
      topology.nnz = topology.block_rows * topology.block_cols;
      writer.append(to_event(topology));
    }

    // The first sample_bytes bytes of sequence 0 and the experts each went to.
    TokensEvent tokens{.step = step, .layer = layer};
    tokens.text.assign(batch.bytes.begin(), batch.bytes.begin() + c.sample_bytes);
    for (int64_t s = 0; s < c.sample_bytes; ++s) {
      tokens.experts.emplace_back(top.begin() + s * K, top.begin() + (s + 1) * K);
    }
    writer.append(to_event(tokens));
  }
  return summary;
}

// The phases of one step as span events on the run's clock (GPU times from the step's first
// phase, placed at the host time the step began). The MoE layers' own phases nest inside the
// model's "moe" phases: they go on a second timeline row so the rows never overlap.
void record_spans(cuda::PhaseTimer& timer, int64_t step, double origin_us, RunWriter& writer) {
  for (const cuda::TimedPhase& phase : timer.collect()) {
    writer.append(to_event(SpanEvent{.step = step, .rank = 0, .stream = phase.depth,
                                      .stream_name = phase.depth == 0 ? "compute" : "compute: inside the MoE layer",
                                      .name = phase.name, .start_us = origin_us + phase.start_us,
                                      .duration_us = phase.duration_us}));
  }
}

// ---- [SECTION] run directory ----

fs::path checkpoints_dir(const TrainConfig& c) { return fs::path(c.run_dir) / "checkpoints"; }

// Keeps the events up to and including `step` (and those without a step); the rest were written
// by the interrupted run after its last checkpoint and will be written again.
void cut_events_after(const fs::path& run_dir, int64_t step) {
  const fs::path events = run_dir / "events.jsonl";
  std::ifstream in(events);
  if (!in) return;
  std::ostringstream kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json event = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (event.is_discarded()) continue;  // a half-written last line
    if (event.contains("step") && event["step"].is_number_integer() && event["step"].get<int64_t>() > step) continue;
    kept << line << '\n';
  }
  in.close();
  const fs::path temporary = events.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << kept.str();
    if (!out) throw RecordError(temporary.string() + ": cannot write");
  }
  fs::rename(temporary, events);
}

std::string differences(const json& saved, const json& wanted) {
  std::string list;
  for (const auto& [key, value] : wanted.items()) {
    if (!saved.contains(key) || saved[key] != value) {
      list += (list.empty() ? "" : ", ") + key + " (checkpoint " + (saved.contains(key) ? saved[key].dump() : "absent") +
              ", now " + value.dump() + ")";
    }
  }
  return list;
}

std::vector<CheckpointArraySpec> checkpoint_arrays(int64_t parameters) {
  const uint64_t n = uint64_t(parameters);
  return {{"weights", n}, {"adam_m", n}, {"adam_v", n}};
}

void save(const TrainConfig& c, const cuda::ModelGpu& model, int64_t step, int64_t tokens_seen,
          const BatchSampler& sampler) {
  CheckpointHeader header;
  header.model_config = model_json(c);
  header.step = step;
  header.tokens_seen = tokens_seen;
  const cuda::ModelGpu::OptimizerState state = model.download_optimizer_state();
  header.optimizer_step = state.steps;
  header.schedule_step = step;
  header.sampler_state = sampler.state();
  header.model_seed = c.seed;
  header.data_seed = c.data_seed;
  header.run_directory = c.run_dir;
  const std::vector<float> weights = model.download_weights();
  fs::create_directories(checkpoints_dir(c));
  save_checkpoint(checkpoint_path(checkpoints_dir(c), step), header,
                  {{"weights", weights}, {"adam_m", state.first_moment}, {"adam_v", state.second_moment}});
  prune_checkpoints(checkpoints_dir(c), int(c.keep_checkpoints));
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(digits);
  out << value;
  return out.str();
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

}  // namespace

double peak_bf16_flops(const std::string& device_name) {
  // Dense (not 2:4 sparse) bf16 tensor-core peaks from NVIDIA's data sheets; SXM parts.
  if (device_name.find("H100") != std::string::npos) return 989e12;
  if (device_name.find("H200") != std::string::npos) return 989e12;
  return 0;
}

// ---- [SECTION] train ----

TrainResult train(const TrainConfig& c, std::ostream& log) {
  validate(c);
  const auto wall_start = std::chrono::steady_clock::now();
  TextCorpus corpus;
  try {
    corpus = load_corpus(c.data, {.load_tags = false});
  } catch (const TextCorpusError& error) {
    throw TextCorpusError(std::string(error.what()) +
                          (c.data == "notebooks_data/brown" ? " (fetch the Brown corpus with ./moe data)" : ""));
  }
  const int64_t N = c.batch, S = c.model.seq_len, T = N * S;
  BatchSampler sampler(corpus, Split::train, int(N), int(S), c.data_seed);
  std::vector<ByteBatch> validation;
  {
    BatchSampler validation_sampler(corpus, Split::validation, int(N), int(S), kValidationSeed);
    for (int64_t i = 0; i < c.eval_batches; ++i) validation.push_back(validation_sampler.next());
  }
  TrainResult result;
  result.unigram_bits_per_byte = unigram_bits_per_byte(corpus.train.bytes, corpus.validation.bytes);

  // The model, initialised or restored. Nothing is written before the config, the data and the
  // checkpoint have all been accepted.
  const OwnedStream owned_stream;
  const cudaStream_t stream = owned_stream.get();
  cuda::ModelGpu model(gpu_config(c), optimizer_settings(c), stream);
  int64_t step = 0, tokens_seen = 0;
  std::optional<RunWriter> writer;
  if (c.resume) {
    const std::optional<fs::path> latest = latest_checkpoint(checkpoints_dir(c));
    if (!latest) {
      throw CheckpointError("--resume: no checkpoint in " + checkpoints_dir(c).string() +
                            "; start the run without --resume (or check --run-dir)");
    }
    const LoadedCheckpoint checkpoint = load_checkpoint(*latest, checkpoint_arrays(model.parameter_count()));
    const std::string changed = differences(checkpoint.header.model_config, model_json(c));
    if (!changed.empty()) {
      throw CheckpointError(latest->string() + " was trained with another model: " + changed +
                            "; resume with the same settings, or start a new run");
    }
    const int64_t target = c.stop_after > 0 ? c.stop_after : c.steps;
    if (checkpoint.header.step >= target) {
      throw CheckpointError(latest->string() + " is at step " + std::to_string(checkpoint.header.step) +
                            ": the run already reached step " + std::to_string(target) +
                            "; nothing to resume (a longer run is a new run: --steps sets its schedule)");
    }
    model.upload_weights(checkpoint.array("weights"));
    model.upload_optimizer_state({checkpoint.header.optimizer_step, checkpoint.array("adam_m"), checkpoint.array("adam_v")});
    sampler.set_state(checkpoint.header.sampler_state);
    step = checkpoint.header.step;
    tokens_seen = checkpoint.header.tokens_seen;
    cut_events_after(c.run_dir, step);
    writer.emplace(RunWriter::resume(c.run_dir));
    log << "resumed " << c.run_dir << " at step " << step << " from " << latest->filename().string() << "\n";
  } else {
    model.upload_weights(initial_weights(c));
    RunInfo info;
    info.kind = RunKind::train;
    info.name = c.name.empty() ? fs::path(c.run_dir).filename().string() : c.name;
    if (c.model.moe_layers != ref::MoeLayers::none) info.moe_config = ref::moe_layer_config(c.model, c.batch);
    info.model = model_json(c);
    info.model["layers"] = c.model.num_layers;
    info.formulation = c.model.moe_layers == ref::MoeLayers::none ? "dense" : std::string(to_string(c.model.formulation));
    info.devices = {device_name()};
    info.extra["train_config"] = to_json(c);
    info.extra["data"] = corpus.source;
    json genres = json::array();
    for (const Genre& g : corpus.genres) genres.push_back(g.name);
    info.extra["genres"] = genres;
    info.extra["unigram_bits_per_byte"] = result.unigram_bits_per_byte;
    info.extra["parameters"] = total_parameters(c.model);
    info.extra["active_parameters"] = active_parameters(c.model);
    info.extra["flops_per_token"] = flops_per_token(c.model);
    if (c.overwrite) fs::remove_all(checkpoints_dir(c));
    // RunWriter names its C++ option; the user types the flag.
    if (!c.overwrite && (fs::exists(fs::path(c.run_dir) / "run.json") || fs::exists(fs::path(c.run_dir) / "events.jsonl"))) {
      throw TrainConfigError("refusing to overwrite the existing run at " + c.run_dir +
                             "; pick a new --run-dir, pass --resume to continue it or --overwrite to replace it");
    }
    writer.emplace(RunWriter::create(c.run_dir, info, c.overwrite ? OnExisting::overwrite : OnExisting::refuse));
  }
  result.first_step = step;
  const int64_t last_step = c.stop_after > 0 ? c.stop_after : c.steps;
  const ref::ScheduleConfig lr_schedule = schedule(c);
  const double peak = peak_bf16_flops(device_name());
  const double model_flops = flops_per_token(c.model);

  log << "training " << (c.name.empty() ? c.run_dir : c.name) << ": " << total_parameters(c.model) / 1e6
      << "M parameters (" << active_parameters(c.model) / 1e6 << "M active per byte), T = " << T
      << " bytes per step, steps " << step << " -> " << last_step << ", data " << corpus.source << "\n";

  BatchUploader uploader(N, S, stream);
  // The ring of per-step losses {loss, lm, aux, z}: one device copy per step, read every log_every.
  const int64_t ring_rows = c.log_every;
  DeviceBuffer<float> loss_ring(size_t(ring_rows * 4));
  std::vector<double> ring_lr(static_cast<size_t>(ring_rows));
  // Step-end events: the GPU time between two consecutive ends is one step's time.
  std::vector<cudaEvent_t> step_end(size_t(ring_rows + 1));
  for (cudaEvent_t& event : step_end) CUDA_CHECK(cudaEventCreate(&event));
  std::vector<bool> plain_step(size_t(ring_rows + 1), false);  // no evaluation / recording in it
  std::vector<double> plain_step_ms;
  cuda::PhaseTimer timer;
  ProgressLine progress(log, {.total_steps = last_step, .terminal = &log == &std::cout && stdout_is_terminal(),
                              .plain_every_seconds = 5});
  int64_t routed = 0, dropped = 0;
  int64_t ring_first = step;  // the ring's row 0 holds step ring_first + 1
  bool host_waited = true;    // the host synchronised since the last step was enqueued
  CUDA_CHECK(cudaEventRecord(step_end[0], stream));

  // Each validation batch's losses {loss, lm, aux, z} are copied on the device; one read at the end.
  DeviceBuffer<float> validation_losses(validation.size() * 4);
  auto evaluate = [&]() {
    for (size_t i = 0; i < validation.size(); ++i) {
      const auto [tokens, targets] = uploader.upload(validation[i]);
      model.forward(tokens, targets);
      uploader.release_current();
      CUDA_CHECK(cudaMemcpyAsync(validation_losses.data() + i * 4, model.losses().data(), 4 * sizeof(float),
                                 cudaMemcpyDeviceToDevice, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> losses = validation_losses.download();
    double sum = 0;
    for (size_t i = 0; i < validation.size(); ++i) sum += losses[i * 4 + 1];  // the language-model part: nats per byte
    return sum / double(validation.size());
  };

  auto flush = [&](int64_t through_step) {  // steps ring_first+1 .. through_step
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> ring = loss_ring.download();
    const int64_t rows = through_step - ring_first;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = ring_first + r + 1;
      const float* l = &ring[size_t(r * 4)];
      result.losses.push_back(l[0]);
      std::vector<std::pair<std::string, double>> metrics = {
          {"loss", l[0]}, {"lm_loss", l[1]}, {"aux_loss", l[2]}, {"z_loss", l[3]}, {"lr", ring_lr[size_t(r)]}};
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, step_end[size_t(r)], step_end[size_t(r + 1)]));
      if (plain_step[size_t(r + 1)]) plain_step_ms.push_back(ms);
      metrics.push_back({"step_ms", ms});
      if (r + 1 == rows) {  // the rates once per flush: a step event stays short (~150 bytes)
        metrics.push_back({"tokens_per_s", double(T) / (ms * 1e-3)});
        if (peak > 0) metrics.push_back({"mfu", model_flops * double(T) / (ms * 1e-3) / peak});
        metrics.push_back({"grad_norm", model.read_grad_norm()});
      }
      writer->append(step_event(s, metrics));
    }
    if (rows > 0) {
      progress.update(through_step, tokens_seen, ring[size_t((rows - 1) * 4)],
                      {{"lr", fixed(ring_lr[size_t(rows - 1)] * 1e3, 3) + "e-3"}});
    }
    std::swap(step_end[0], step_end[size_t(rows)]);
    ring_first = through_step;
  };

  while (step < last_step) {
    const bool record = (step + 1) % c.record_every == 0 || step == 0;
    const bool evaluate_now = (step + 1) % c.eval_every == 0 || step + 1 == last_step;
    const bool checkpoint_now = (step + 1) % c.checkpoint_every == 0 || step + 1 == last_step;
    const int64_t row = step - ring_first;
    const double lr = ref::learning_rate(lr_schedule, step);
    ring_lr[size_t(row)] = lr;

    const ByteBatch batch = sampler.next();
    const auto [tokens, targets] = uploader.upload(batch);
    const double origin_us = writer->elapsed_us();
    if (record) model.set_phase_timer(&timer);
    model.forward(tokens, targets);
    model.backward();
    model.step(float(lr));
    if (record) model.set_phase_timer(nullptr);
    uploader.release_current();
    CUDA_CHECK(cudaMemcpyAsync(loss_ring.data() + row * 4, model.losses().data(), 4 * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaEventRecord(step_end[size_t(row + 1)], stream));
    // A plain step: nothing but training in it, and the host did not stop to wait just before it
    // (then the GPU would have idled while the host enqueued the step's first kernels).
    plain_step[size_t(row + 1)] = !record && !evaluate_now && !checkpoint_now && !host_waited;
    host_waited = record || evaluate_now || checkpoint_now;
    ++step;
    tokens_seen += T;

    if (record) {
      const RoutingSummary summary = record_routing(c, &corpus, model, batch, step, *writer);
      routed += summary.routed;
      dropped += summary.dropped;
      record_spans(timer, step, origin_us, *writer);
    }
    if (step - ring_first == ring_rows || evaluate_now || checkpoint_now) {
      flush(step);
      host_waited = true;
    }
    if (evaluate_now) {
      result.validation_loss = evaluate();
      result.validation_bits_per_byte = result.validation_loss / kLn2;
      writer->append(step_event(step, {{"val_loss", result.validation_loss},
                                       {"val_bits_per_byte", result.validation_bits_per_byte}}));
      CUDA_CHECK(cudaEventRecord(step_end[0], stream));  // the next step's time starts after evaluation
    }
    if (checkpoint_now) {
      save(c, model, step, tokens_seen, sampler);
      CUDA_CHECK(cudaEventRecord(step_end[0], stream));
    }
  }
  progress.finish();
  for (cudaEvent_t event : step_end) cudaEventDestroy(event);

  result.steps_done = step;
  result.median_step_ms = median(plain_step_ms);
  result.tokens_per_second = result.median_step_ms > 0 ? double(T) / (result.median_step_ms * 1e-3) : 0;
  result.mfu = peak > 0 ? model_flops * result.tokens_per_second / peak : 0;
  result.dropped_fraction = routed > 0 ? double(dropped) / double(routed) : 0;
  result.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();

  writer->append(to_event(TableEvent{
      .name = "summary",
      .columns = {"steps", "val_loss", "val_bits_per_byte", "unigram_bits_per_byte", "median_step_ms",
                  "tokens_per_s", "mfu", "dropped_fraction"},
      .rows = {{step, result.validation_loss, result.validation_bits_per_byte, result.unigram_bits_per_byte,
                result.median_step_ms, result.tokens_per_second, result.mfu, result.dropped_fraction}}}));
  log << "done at step " << step << ": validation " << fixed(result.validation_loss, 4) << " nats/byte = "
      << fixed(result.validation_bits_per_byte, 3) << " bits/byte (unigram baseline "
      << fixed(result.unigram_bits_per_byte, 3) << "), median step " << fixed(result.median_step_ms, 2) << " ms, "
      << format_rate(result.tokens_per_second) << " tokens/s";
  if (peak > 0) log << ", MFU " << fixed(100 * result.mfu, 1) << "%";
  if (c.model.formulation != Formulation::dropless && c.model.moe_layers != ref::MoeLayers::none) {
    log << ", dropped " << fixed(100 * result.dropped_fraction, 2) << "% of routed tokens (recorded steps)";
  }
  log << "; run record " << c.run_dir << "\n";
  return result;
}

// ---- [SECTION] benchmark ----

BenchmarkResult benchmark(const TrainConfig& config, std::ostream& log) {
  TrainConfig c = config;
  c.run_dir = c.run_dir.empty() ? "unused" : c.run_dir;
  validate(c);
  if (c.benchmark_steps < 1) throw TrainConfigError("benchmark: benchmark_steps must be >= 1");
  const int64_t N = c.batch, S = c.model.seq_len, T = N * S;
  BenchmarkResult result;
  result.device = device_name();
  result.tokens_per_step = T;
  result.flops_per_token = flops_per_token(c.model);

  // Real text when the corpus is there (routing then looks like training's), else random bytes.
  std::optional<TextCorpus> corpus;
  try {
    corpus = load_corpus(c.data, {.load_tags = false});
    result.data = corpus->source;
  } catch (const TextCorpusError&) {
    result.data = "random bytes";
  }
  std::optional<BatchSampler> sampler;
  if (corpus) sampler.emplace(*corpus, Split::train, int(N), int(S), c.data_seed);
  std::mt19937_64 generator(c.data_seed);
  auto next_batch = [&] { return sampler ? sampler->next() : random_batch(N, S, generator); };

  const OwnedStream owned_stream;
  const cudaStream_t stream = owned_stream.get();
  cuda::ModelGpu model(gpu_config(c), optimizer_settings(c), stream);
  model.upload_weights(initial_weights(c));
  BatchUploader uploader(N, S, stream);
  const ref::ScheduleConfig lr_schedule = schedule(c);
  int64_t step = 0;
  auto one_step = [&] {
    const auto [tokens, targets] = uploader.upload(next_batch());
    model.forward(tokens, targets);
    model.backward();
    model.step(float(ref::learning_rate(lr_schedule, step++)));
    uploader.release_current();
  };

  // Untimed steps: benchmark_warmup of them, and at least a second's worth (clock_warm_up.h).
  cuda::warm_up_clock(stream, static_cast<int>(c.benchmark_warmup), 1000.0, one_step);
  // Steps back to back as in training (the host enqueues ahead); an event between each two.
  std::vector<cudaEvent_t> ends(size_t(c.benchmark_steps + 1));
  for (cudaEvent_t& event : ends) CUDA_CHECK(cudaEventCreate(&event));
  CUDA_CHECK(cudaEventRecord(ends[0], stream));
  for (int64_t i = 0; i < c.benchmark_steps; ++i) {
    one_step();
    CUDA_CHECK(cudaEventRecord(ends[size_t(i + 1)], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> step_ms;
  for (int64_t i = 0; i < c.benchmark_steps; ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, ends[size_t(i)], ends[size_t(i + 1)]));
    step_ms.push_back(ms);
  }
  for (cudaEvent_t event : ends) cudaEventDestroy(event);
  if (!std::isfinite(model.read_loss())) throw std::runtime_error("benchmark: the loss is not finite");

  result.median_step_ms = median(step_ms);
  result.min_step_ms = *std::min_element(step_ms.begin(), step_ms.end());
  result.tokens_per_second = double(T) / (result.median_step_ms * 1e-3);
  const double peak = peak_bf16_flops(result.device);
  result.mfu = peak > 0 ? result.flops_per_token * result.tokens_per_second / peak : 0;

  // One more step with the phase timer: where the time goes (events add a little of their own).
  cuda::PhaseTimer timer;
  model.set_phase_timer(&timer);
  one_step();
  model.set_phase_timer(nullptr);
  // The model's own phases (depth 0) tile the step; the MoE layers' phases (router, plan,
  // dispatch, expert_compute, combine and their backward) nest inside "moe" / "backward_moe" and
  // are listed as "moe/<name>", each summed over the layers.
  std::map<std::string, double> by_name;
  std::vector<std::string> order;
  double total = 0, moe = 0;
  for (const cuda::TimedPhase& phase : timer.collect()) {
    const std::string name = phase.depth == 0 ? phase.name : "moe/" + phase.name;
    if (!by_name.count(name)) order.push_back(name);
    by_name[name] += phase.duration_us * 1e-3;
    if (phase.depth == 0) total += phase.duration_us * 1e-3;
    if (name == "moe" || name == "backward_moe") moe += phase.duration_us * 1e-3;
  }
  for (const std::string& name : order) result.phase_ms.push_back({name, by_name[name]});
  result.moe_share = total > 0 ? moe / total : 0;

  log << "benchmark on " << result.device << " (" << result.data << "): T = " << T << " bytes per step, "
      << c.benchmark_steps << " steps after " << c.benchmark_warmup << " warm-up\n"
      << "  median step " << fixed(result.median_step_ms, 3) << " ms (min " << fixed(result.min_step_ms, 3)
      << "), " << format_rate(result.tokens_per_second) << " tokens/s, MFU " << fixed(100 * result.mfu, 1)
      << "% (" << fixed(result.flops_per_token / 1e6, 1) << " MFLOP per token)\n  phases of one timed step:";
  for (const auto& [name, ms] : result.phase_ms) log << " " << name << " " << fixed(ms, 3);
  log << " ms; MoE share " << fixed(100 * result.moe_share, 1) << "%\n";

  if (!c.benchmark_json.empty()) {
    json out = {{"device", result.device}, {"date", utc_now_iso8601()}, {"data", result.data},
                {"config", to_json(c)}, {"tokens_per_step", T}, {"median_step_ms", result.median_step_ms},
                {"min_step_ms", result.min_step_ms}, {"step_ms", step_ms},
                {"tokens_per_second", result.tokens_per_second}, {"mfu", result.mfu},
                {"flops_per_token", result.flops_per_token}, {"moe_share", result.moe_share}};
    for (const auto& [name, ms] : result.phase_ms) out["phase_ms"][name] = ms;
    std::ofstream file(c.benchmark_json);
    file << out.dump(2) << "\n";
    if (!file) throw std::runtime_error("benchmark: cannot write " + c.benchmark_json);
  }
  return result;
}

}  // namespace moe::train
