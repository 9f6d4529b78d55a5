// trainer.cpp: the training loop, its run record and checkpoints, and the throughput benchmark.
// See trainer.h for what one step does and when the host synchronises.
//
// Index:
//   [SECTION] the model on the GPU      config translation, initial weights
//   [SECTION] ranks                     one rank of several: its share, collectives, the whole model
//   [SECTION] batches                   pinned double-buffered uploads
//   [SECTION] recording                 routing / topology / tokens / span events from one step
//   [SECTION] run directory             checkpoints: save, compare a resumed model
//   [SECTION] inputs                    data, checkpoint and run directory, checked before the GPU
//   [SECTION] train
//   [SECTION] benchmark
#include "train/trainer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <csignal>  // SIGTERM
#include <cstring>  // memcmp
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
#include "core/device_info.h"     // current_device, why_no_gpu
#include "expert_placement.h"     // eplb_placement, expected_rank_load: --placement eplb
#include "parameter_layout.h"     // initial_parameters
#include "model/model.h"          // ModelGpu
#include "core/phase_timer.h"     // PhaseTimer
#include "program_exit.h"         // check_output_path
#include "progress_line.h"        // ProgressLine
#include "run_record.h"           // RunWriter, events
#include "stop_signal.h"          // stop_signal
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

// Rank `rank` of `ranks` trains on N / R of the N sequences; its MoE layers see all R's tokens.
// With M micro-batches (one GPU) the model holds one micro-batch of N / M sequences.
// Each MoE block's experts where `placements` put them (empty: E / R a rank in id order).
cuda::ModelGpuConfig gpu_config(const TrainConfig& c, int ranks = 1, int rank = 0,
                                std::vector<dist::ExpertPlacement> placements = {}) {
  cuda::ModelGpuConfig g = cuda::gpu_config_of(c.model, c.batch / ranks / c.micro_batches);
  g.expert_placements = std::move(placements);
  g.moe = moe_layer_config(c.model, c.batch / c.micro_batches);  // tokens: the global (micro-)batch's
  g.micro_batches = c.micro_batches;
  g.overlap = overlaps(c, ranks);  // --overlap, or auto: on where it pays (train_config.h)
  g.attention_core = c.attention == "fused"     ? cuda::AttentionCore::fused
                     : c.attention == "unfused" ? cuda::AttentionCore::unfused
                                                : cuda::AttentionCore::automatic;
  g.ranks = ranks;
  g.rank = rank;
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

// GPT-2's initialisation in the one parameter order (common/parameter_layout.h), as the CPU
// reference draws it.
std::vector<float> initial_weights(const TrainConfig& c) {
  const std::vector<double> values = initial_parameters(c.model, c.seed);
  return std::vector<float>(values.begin(), values.end());
}

std::string device_name() { return cuda::current_device().name; }

// ---- [SECTION] ranks ----

// This process's place in the run and the host collectives the loop needs; on one GPU, rank 0 of 1
// with nothing to exchange. Every collective is called by every rank at the same point.
class RankView {
 public:
  explicit RankView(cuda::ModelRanks* ranks) : ranks_(ranks) {}
  cuda::ModelRanks* ranks() const { return ranks_; }
  int rank() const { return ranks_ != nullptr ? ranks_->rank() : 0; }
  int size() const { return ranks_ != nullptr ? ranks_->size() : 1; }
  bool root() const { return rank() == 0; }

  // The mean over the ranks of each value.
  std::vector<double> mean(std::vector<double> values) const {
    if (ranks_ == nullptr) return values;
    ranks_->host_all_reduce_sum(values);
    for (double& v : values) v /= double(size());
    return values;
  }
  // Ends on every rank together when `failure` is set on any (a rank that throws alone leaves the
  // others waiting in the next collective): the failing rank's message there, a pointer to it on
  // the others.
  void agree(const std::string& what, const std::string& failure) const {
    if (ranks_ == nullptr) {
      if (!failure.empty()) throw std::runtime_error(failure);
      return;
    }
    std::vector<double> failed = {failure.empty() ? 0.0 : 1.0};
    ranks_->host_all_reduce_sum(failed);
    if (!failure.empty()) throw std::runtime_error(failure);
    if (failed[0] > 0) throw std::runtime_error(what + " failed on another rank (its message is above)");
  }

 private:
  cuda::ModelRanks* ranks_;
};

// The whole model's layout (one GPU's) for a rank's config.
cuda::ModelGpuConfig one_gpu(cuda::ModelGpuConfig config) {
  config.batch *= config.ranks;
  config.ranks = 1;
  config.rank = 0;
  config.expert_placements.clear();  // every expert on the one GPU
  return config;
}

// The values of this rank's tensors, in its layout's order, picked by name from the whole model's.
std::vector<float> local_part(const std::vector<float>& whole, const cuda::ModelGpuConfig& local) {
  if (local.ranks == 1) return whole;
  std::map<std::string, int64_t> offset;
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(one_gpu(local))) offset[p.name] = p.offset;
  std::vector<float> part;
  for (const cuda::ParameterSpan& p : cuda::parameter_layout(local)) {
    const auto first = whole.begin() + offset.at(p.name);
    part.insert(part.end(), first, first + p.rows * p.cols);
  }
  return part;
}

}  // namespace

std::vector<float> merge_ranks(const cuda::ModelGpuConfig& local, const std::vector<std::vector<float>>& parts) {
  std::map<std::string, int64_t> offset;
  const std::vector<cuda::ParameterSpan> whole_layout = cuda::parameter_layout(one_gpu(local));
  for (const cuda::ParameterSpan& p : whole_layout) offset[p.name] = p.offset;
  const cuda::ParameterSpan& last = whole_layout.back();
  std::vector<float> whole(size_t(last.offset + last.rows * last.cols));
  std::map<std::string, int> taken_from;  // an expert's tensor: the first rank that held it
  for (int q = 0; q < int(parts.size()); ++q) {
    cuda::ModelGpuConfig theirs = local;
    theirs.rank = q;
    const std::vector<cuda::ParameterSpan> layout = cuda::parameter_layout(theirs);
    if (parts[size_t(q)].size() != size_t(layout.back().offset + layout.back().rows * layout.back().cols)) {
      throw std::invalid_argument("merge_ranks: rank " + std::to_string(q) + " sent " +
                                  std::to_string(parts[size_t(q)].size()) + " values; its layout holds " +
                                  std::to_string(layout.back().offset + layout.back().rows * layout.back().cols));
    }
    const float* base = parts[size_t(q)].data();
    for (const cuda::ParameterSpan& p : layout) {
      const float* first = base + p.offset;
      const float* end = first + p.rows * p.cols;
      float* into = whole.data() + offset.at(p.name);
      const auto [held, fresh] = taken_from.try_emplace(p.name, q);
      if (p.is_expert() && !fresh) {  // a replica: bit for bit the copy taken already
        const auto [at, there] = std::mismatch(first, end, into, [](float a, float b) {
          return std::memcmp(&a, &b, sizeof a) == 0;
        });
        if (at != end) {
          throw std::runtime_error("the replicas of expert tensor " + p.name + " differ: rank " +
                                   std::to_string(held->second) + " holds " + std::to_string(*there) + " and rank " +
                                   std::to_string(q) + " holds " + std::to_string(*at) + " at entry " +
                                   std::to_string(at - first) + "; a replicated expert's copies must stay equal");
        }
        continue;
      }
      std::copy(first, end, into);
    }
  }
  return whole;
}

namespace {

// Every rank's tensors back in the whole model's layout, on every rank (collective); replicas of an
// expert must agree (merge_ranks).
std::vector<float> gather_whole(const RankView& view, const std::vector<float>& mine,
                                const cuda::ModelGpuConfig& local) {
  if (view.ranks() == nullptr) return mine;
  // Ranks may hold different numbers of values (their slots): gather each rank's size first.
  const uint64_t n = mine.size();
  const std::vector<int32_t> halves = view.ranks()->host_all_gather(
      std::vector<int32_t>{int32_t(n >> 31), int32_t(n & 0x7fffffffu)});  // [R][2]: sizes up to 2^62
  std::vector<size_t> sizes;
  for (size_t q = 0; q < size_t(view.size()); ++q) {
    sizes.push_back((size_t(halves[2 * q]) << 31) | size_t(halves[2 * q + 1]));
  }
  const size_t most = *std::max_element(sizes.begin(), sizes.end());
  std::vector<float> padded = mine;
  padded.resize(most, 0.0f);
  const std::vector<float> all = view.ranks()->host_all_gather(padded);  // [R][most]
  std::vector<std::vector<float>> parts;
  for (size_t q = 0; q < sizes.size(); ++q) {
    parts.emplace_back(all.begin() + ptrdiff_t(q * most), all.begin() + ptrdiff_t(q * most + sizes[q]));
  }
  return merge_ranks(local, parts);
}

// ---- [SECTION] placement by load ----

// Per MoE block, each expert's routed slots summed over the steps since the last plan: [block][E].
using ExpertLoads = std::vector<std::vector<double>>;

// Adds every MoE block's last forward (both lanes) to `loads`; nothing on one GPU.
void add_expert_load(const cuda::ModelGpu& model, ExpertLoads& loads) {
  size_t block = 0;
  for (int64_t layer = 0; layer < model.config().num_layers; ++layer) {
    if (model.moe_ffn(layer) == nullptr) continue;
    if (loads.size() <= block) loads.resize(block + 1);
    for (int lane = 0; lane < model.lanes(); ++lane) {
      const std::vector<int64_t> load = model.moe_ffn(layer, lane)->expert_load();
      loads[block].resize(load.size(), 0.0);
      for (size_t e = 0; e < load.size(); ++e) loads[block][e] += double(load[e]);
    }
    ++block;
  }
}

// EPLB's placement of each MoE block from its loads (every rank computes the same).
std::vector<dist::ExpertPlacement> plan_placements(const TrainConfig& c, int R, const ExpertLoads& loads) {
  std::vector<dist::ExpertPlacement> planned;
  for (const std::vector<double>& load : loads) planned.push_back(dist::eplb_placement(load, R, c.redundant_slots));
  return planned;
}

// The busiest rank's expected rows over the mean rank's, for `placement` and per-expert loads.
double rank_max_over_mean(const dist::ExpertPlacement& placement, const std::vector<double>& load) {
  const std::vector<double> ranks = dist::expected_rank_load(placement, load);
  const double sum = std::accumulate(ranks.begin(), ranks.end(), 0.0);
  return sum > 0 ? *std::max_element(ranks.begin(), ranks.end()) * double(ranks.size()) / sum : 0.0;
}

// The run record's and a checkpoint's form of the placements: {"ranks": R, "blocks": [per MoE block,
// per rank, its experts]}.
json placements_json(const std::vector<dist::ExpertPlacement>& placements, int R) {
  json blocks = json::array();
  for (const dist::ExpertPlacement& p : placements) {
    json ranks = json::array();
    for (int r = 0; r < p.ranks(); ++r) ranks.push_back(p.experts_of(r));
    blocks.push_back(ranks);
  }
  return {{"ranks", R}, {"blocks", blocks}};
}

// The model over other placements, its state moved on the device: the whole model's weights and
// AdamW moments in three arrays of the one-GPU layout, zeros but for what this rank is the first to
// hold (rank 0 the replicated tensors, each expert's lowest rank its tensors), summed over the ranks
// (so each value arrives once, unchanged but for the sign of a zero); the old model freed; the new
// one built over `placements` and filled from them. Collective, with the same placements on every
// rank.
std::unique_ptr<cuda::ModelGpu> replace_model(std::unique_ptr<cuda::ModelGpu> model,
                                              std::vector<dist::ExpertPlacement> placements, const TrainConfig& c,
                                              const RankView& view, cudaStream_t stream) {
  const cuda::ModelGpuConfig old = model->config();
  const std::vector<cuda::ParameterSpan> whole_layout = cuda::parameter_layout(one_gpu(old));
  const size_t count = size_t(whole_layout.back().offset + whole_layout.back().rows * whole_layout.back().cols);
  std::array<DeviceBuffer<float>, 3> whole = {DeviceBuffer<float>(count), DeviceBuffer<float>(count),
                                              DeviceBuffer<float>(count)};
  for (DeviceBuffer<float>& array : whole) CUDA_CHECK(cudaMemsetAsync(array.data(), 0, count * sizeof(float), stream));
  // Per expert tensor's name, whether this rank is the lowest that holds it.
  std::map<std::string, bool> first_holder;
  for (int64_t j = 0, layer = 0; layer < old.num_layers; ++layer) {
    if (!cuda::is_moe_block(old, layer)) continue;
    const dist::ExpertPlacement placement = cuda::expert_placement(old, j++);
    for (int64_t e = 0; e < placement.experts(); ++e) {
      const bool mine = placement.slot_rank(placement.replicas(e).front()) == view.rank();
      for (const char* matrix : {"w1", "w2"}) {
        first_holder["blocks." + std::to_string(layer) + ".moe." + matrix + "." + std::to_string(e)] = mine;
      }
    }
  }
  const cuda::ModelGpu::StateArrays arrays{whole[0].data(), whole[1].data(), whole[2].data()};
  model->export_state(whole_layout, arrays, [&](const cuda::ParameterSpan& p) {
    return p.is_expert() ? first_holder.at(p.name) : view.root();
  });
  const int64_t optimizer_steps = model->optimizer_steps();
  if (view.ranks() != nullptr) {
    for (DeviceBuffer<float>& array : whole) view.ranks()->all_reduce_sum(array.data(), int64_t(count), stream);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  model.reset();  // its memory before the new model's
  auto next = std::make_unique<cuda::ModelGpu>(gpu_config(c, view.size(), view.rank(), std::move(placements)),
                                               optimizer_settings(c), stream, view.ranks());
  next->import_state(whole_layout, arrays, optimizer_steps);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return next;
}

// Sequences [first, first + count) of a batch: one rank's share.
ByteBatch share_of(const ByteBatch& batch, int first, int count) {
  if (first == 0 && count == batch.batch) return batch;
  ByteBatch part;
  part.batch = count;
  part.sequence = batch.sequence;
  const size_t window = size_t(batch.sequence + 1);
  part.bytes.assign(batch.bytes.begin() + first * window, batch.bytes.begin() + (first + count) * window);
  part.offsets.assign(batch.offsets.begin() + first, batch.offsets.begin() + first + count);
  part.genres.assign(batch.genres.begin() + first, batch.genres.begin() + first + count);
  return part;
}

// A stream that drops what is written: the log of ranks other than 0.
class NullStream : public std::ostream {
 public:
  NullStream() : std::ostream(nullptr) {}
};

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
  return c.model.formulation == Formulation::dropless ? 0 : capacity(moe_layer_config(c.model, c.batch));
}

// A step's forward and backward: one CUDA graph (--cuda-graph, on the steps that time no phases), or
// the model's kernels launched one by one; with micro-batches, each micro-batch's forward and
// backward in turn (tokens, targets [N_r, S]: micro-batch m is sequences [m N_r / M, (m+1) N_r / M)).
void forward_backward(cuda::ModelGpu& model, bool graph, const int32_t* tokens, const int32_t* targets) {
  const int micro_batches = int(model.config().micro_batches);
  if (micro_batches > 1) {
    const int64_t micro_tokens = model.config().batch * model.config().seq_len;
    for (int m = 0; m < micro_batches; ++m) {
      model.forward_micro_batch(m, tokens + m * micro_tokens, targets + m * micro_tokens);
      model.backward_micro_batch(m);
    }
    return;
  }
  if (graph) {
    model.forward_backward_graph(tokens, targets);
  } else {
    model.forward(tokens, targets);
    model.backward();
  }
}

// The step's losses {loss, lm, aux, z} on the device: with micro-batches, their mean.
const float* step_losses(const cuda::ModelGpu& model) {
  return model.config().micro_batches > 1 ? model.step_losses().data() : model.losses().data();
}

// --cuda-graph needs one GPU: the expert-parallel layers wait on the host for their counts; so do
// micro-batches (the expert-parallel layer keeps none).
void check_cuda_graph(const TrainConfig& c, const cuda::ModelRanks* ranks) {
  if (c.cuda_graph && ranks != nullptr) {
    throw TrainConfigError("--cuda-graph on: allowed on one GPU only (the expert-parallel layers wait on the host for "
                           "the count exchange, which a CUDA graph cannot hold)");
  }
  if (c.micro_batches > 1 && ranks != nullptr) {
    throw TrainConfigError("--micro-batches " + std::to_string(c.micro_batches) +
                           ": allowed on one GPU only (the expert-parallel layer keeps no micro-batches)");
  }
  const int64_t R = ranks != nullptr ? ranks->size() : 1;
  if (c.overlap.value_or(false) && (c.batch / R) % 2 != 0) {
    throw TrainConfigError("--overlap on: each rank's batch N / R = " + std::to_string(c.batch / R) +
                           " must be even (its two halves run side by side); allowed: an even N / R, or --overlap off");
  }
}

// MoE block `layer`'s top experts of this rank's tokens, [T_r, K] in token order: with overlap the
// two lanes' halves one after the other.
std::vector<int32_t> local_top_experts(const cuda::ModelGpu& model, int64_t layer) {
  const size_t lane_slots = size_t(model.config().batch / model.lanes() * model.config().seq_len *
                                   model.config().moe.top_k);
  std::vector<int32_t> top;
  for (int lane = 0; lane < model.lanes(); ++lane) {
    std::vector<int32_t> mine = model.moe_ffn(layer, lane)->top_experts().download();  // the buffer may hold more
    top.insert(top.end(), mine.begin(), mine.begin() + std::ptrdiff_t(lane_slots));
  }
  return top;
}

// Rows this rank's last forward of MoE block `layer` sent to each rank, over its lanes; empty on one GPU.
std::vector<int64_t> local_rows_sent(const cuda::ModelGpu& model, int64_t layer) {
  std::vector<int64_t> rows;
  for (int lane = 0; lane < model.lanes(); ++lane) {
    const std::vector<int64_t> mine = model.moe_ffn(layer, lane)->rows_sent_per_rank();
    rows.resize(mine.size(), 0);
    for (size_t p = 0; p < mine.size(); ++p) rows[p] += mine[p];
  }
  return rows;
}

struct RoutingSummary {
  int64_t routed = 0;   // (token, expert) pairs
  int64_t dropped = 0;
};

// Reads each MoE layer's routing of the last forward and appends its routing, topology and
// tokens events; on several ranks, every rank's routing (gathered: collective) and the rows each
// rank sent each rank, as the dispatch and combine all-to-all byte matrices. `batch` is the global
// batch; `writer` is null on ranks other than 0. Synchronises (through the downloads).
// `phases`: rank 0's phases of the step (record_spans), whose k-th forward "ep_dispatch" and
// "ep_combine_exchange" time MoE block k's two all-to-alls.
RoutingSummary record_routing(const TrainConfig& c, const TextCorpus* corpus, const cuda::ModelGpu& model,
                              const ByteBatch& batch, int64_t step, const RankView& view, RunWriter* writer,
                              const std::vector<cuda::TimedPhase>& phases) {
  const int64_t E = c.model.num_experts, K = c.model.top_k, S = c.model.seq_len, B = c.model.block_size;
  const int64_t H = c.model.expert_hidden_dim;
  const int64_t C = capacity_of(c);
  const bool dropless = c.model.formulation == Formulation::dropless;
  RoutingSummary summary;
  // The k-th phase of a name, or null: the forward's exchanges come before the backward's.
  const auto nth_phase = [&](const char* name, int64_t k) -> const cuda::TimedPhase* {
    for (const cuda::TimedPhase& p : phases) {
      if (p.name == name && k-- == 0) return &p;
    }
    return nullptr;
  };
  int64_t moe_block = 0;
  for (int64_t layer = 0; layer < c.model.num_layers; ++layer) {
    const cuda::MoeBlockFfn* moe = model.moe_ffn(layer);
    if (moe == nullptr) continue;
    const int64_t local_slots = model.config().batch * S * K;
    std::vector<int32_t> top = local_top_experts(model, layer);  // [T_r, K]
    if (view.size() > 1) {
      top = view.ranks()->host_all_gather(top);  // [T, K]: the ranks' tokens in token order
      if (writer != nullptr) {  // the routing trace per source rank: rank r's tokens are the r-th T_r
        ExpertLoadEvent load{.step = step, .layer = layer};
        load.tokens.assign(size_t(view.size()), std::vector<int64_t>(size_t(E), 0));
        for (size_t slot = 0; slot < top.size(); ++slot) ++load.tokens[slot / size_t(local_slots)][size_t(top[slot])];
        writer->append(to_event(load));
      }
      std::vector<int32_t> sent;
      for (int64_t rows : local_rows_sent(model, layer)) sent.push_back(int32_t(rows));
      const std::vector<int32_t> rows = view.ranks()->host_all_gather(sent);  // [R source][R destination]
      if (writer != nullptr) {
        const int64_t R = view.size(), row_bytes = c.model.model_dim * int64_t(sizeof(uint16_t));  // bf16 rows
        const std::vector<std::vector<int64_t>> zeros(static_cast<size_t>(R), std::vector<int64_t>(static_cast<size_t>(R), 0));
        std::vector<std::vector<int64_t>> dispatch = zeros, combine = zeros;
        for (int64_t from = 0; from < R; ++from) {
          for (int64_t to = 0; to < R; ++to) {
            dispatch[size_t(from)][size_t(to)] = rows[size_t(from * R + to)] * row_bytes;
            combine[size_t(to)][size_t(from)] = rows[size_t(from * R + to)] * row_bytes;  // the way back
          }
        }
        // Timed on rank 0's exchange stream (its wait for the slowest peer included).
        const cuda::TimedPhase* out = nth_phase("ep_dispatch", moe_block);
        const cuda::TimedPhase* back = nth_phase("ep_combine_exchange", moe_block);
        writer->append(to_event(AllToAllEvent{.step = step, .layer = layer, .name = "dispatch", .bytes = dispatch,
                                              .duration_us = out ? out->duration_us : 0.0,
                                              .start_us = out ? std::optional<double>(out->start_us) : std::nullopt}));
        writer->append(to_event(AllToAllEvent{.step = step, .layer = layer, .name = "combine", .bytes = combine,
                                              .duration_us = back ? back->duration_us : 0.0,
                                              .start_us = back ? std::optional<double>(back->start_us) : std::nullopt}));
      }
    }
    ++moe_block;
    if (writer == nullptr) continue;

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
    writer->append(to_event(routing));

    if (dropless) {  // MegaBlocks' topology: each expert's rows rounded up to a multiple of B
      TopologyEvent topology{.step = step, .layer = layer, .block_size = B, .block_cols = H / B};
      for (int64_t count : routing.tokens_per_expert) {
        const int64_t rows = (count + B - 1) / B * B;
        topology.rows_per_expert.push_back(rows);
        topology.padding_rows += rows - count;
        topology.block_rows += rows / B;
      }
      topology.nnz = topology.block_rows * topology.block_cols;
      writer->append(to_event(topology));
    }

    // The first sample_bytes bytes of sequence 0 and the experts each went to.
    TokensEvent tokens{.step = step, .layer = layer};
    tokens.text.assign(batch.bytes.begin(), batch.bytes.begin() + c.sample_bytes);
    for (int64_t s = 0; s < c.sample_bytes; ++s) {
      tokens.experts.emplace_back(top.begin() + s * K, top.begin() + (s + 1) * K);
    }
    writer->append(to_event(tokens));
  }
  return summary;
}

// The timeline row of a recorded phase, by the name of its stream (model.cu and the expert-parallel
// layer name them): a compute stream's phases by depth (the model's, then the MoE layer's inside
// them), rows 0-1 for the first micro-batch and 2-3 for the second when two overlap; the exchange
// streams (every MoE block's layer has one of its own, and they never overlap: one row per
// micro-batch) rows 9 and 10. A stream without a name goes on the exchange row.
std::pair<int64_t, std::string> timeline_row(const cuda::TimedPhase& p) {
  const std::string second = kSecondMicroBatchSuffix;
  const bool second_lane = p.stream_name.ends_with(second);
  if (p.stream_name.rfind(kComputeRow, 0) == 0) {
    const int64_t lane_row = second_lane ? 2 : 0;
    if (p.depth == 0) return {lane_row, p.stream_name};
    return {lane_row + 1, second_lane ? std::string(kComputeInsideMoeRow) + second : std::string(kComputeInsideMoeRow)};
  }
  return {second_lane ? 10 : 9, second_lane ? std::string(kExchangeRow) + second : std::string(kExchangeRow)};
}

// The phases of one step as span events on the run's clock (GPU times from the step's first
// phase, placed at the host time the step began). The MoE layers' own phases nest inside the
// model's "moe" phases: they go on a second timeline row so the rows never overlap. On several
// ranks, every rank's phases (gathered: collective), each on its own GPU's clock from its step's
// first phase, placed at rank 0's host time; `writer` is null on ranks other than 0.
// Returns this rank's phases with their start on the run's clock (origin_us + the GPU offset).
std::vector<cuda::TimedPhase> record_spans(cuda::PhaseTimer& timer, int64_t step, double origin_us,
                                           const RankView& view, RunWriter* writer) {
  std::vector<cuda::TimedPhase> phases = timer.collect();
  std::vector<float> times;  // [phases][start, duration]
  for (const cuda::TimedPhase& phase : phases) {
    times.push_back(float(phase.start_us));
    times.push_back(float(phase.duration_us));
  }
  int ranks_recorded = 1;
  if (view.size() > 1) {
    // The ranks run the same phases in the same order; where a count differs, rank 0's alone.
    const std::vector<int32_t> counts = view.ranks()->host_all_gather(std::vector<int32_t>{int32_t(phases.size())});
    if (std::all_of(counts.begin(), counts.end(), [&](int32_t n) { return n == counts[0]; })) {
      times = view.ranks()->host_all_gather(times);
      ranks_recorded = view.size();
    }
  }
  for (cuda::TimedPhase& p : phases) p.start_us += origin_us;
  if (writer == nullptr) return phases;
  for (int q = 0; q < ranks_recorded; ++q) {
    for (size_t i = 0; i < phases.size(); ++i) {
      const float* t = &times[(size_t(q) * phases.size() + i) * 2];
      const cuda::TimedPhase& p = phases[i];
      const auto [row, row_name] = timeline_row(p);
      writer->append(to_event(SpanEvent{.step = step, .rank = q, .stream = row, .stream_name = row_name,
                                        .name = p.name, .start_us = origin_us + t[0], .duration_us = t[1]}));
    }
  }
  return phases;
}

// ---- [SECTION] run directory ----

fs::path checkpoints_dir(const TrainConfig& c) { return fs::path(c.run_dir) / "checkpoints"; }

std::string differences(const json& saved_config, const json& wanted) {
  // A model config without "activation" has GeLU experts, the only ones it could describe.
  json saved = saved_config;
  if (saved.is_object() && !saved.contains("activation")) saved["activation"] = "gelu";
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

// The whole model in the one-GPU layout, written by rank 0 (the others send it their experts). On
// several ranks the header also keeps each MoE block's placement and, with --placement eplb, the
// loads counted since the last plan, so a resumed run plans its next placement from the same steps.
void save(const TrainConfig& c, const cuda::ModelGpu& model, int64_t step, int64_t tokens_seen,
          const BatchSampler& sampler, const RankView& view, const ExpertLoads& loads) {
  CheckpointHeader header;
  header.model_config = model_json(c);
  if (view.size() > 1 && c.model.moe_layers != MoeLayers::none) {
    std::vector<dist::ExpertPlacement> placements;
    for (size_t j = 0; j < moe_blocks(c.model).size(); ++j) placements.push_back(cuda::expert_placement(model.config(), int64_t(j)));
    header.extra["expert_placements"] = placements_json(placements, view.size());
    if (c.placement == "eplb" && !loads.empty()) header.extra["expert_load_window"] = loads;
  }
  header.step = step;
  header.tokens_seen = tokens_seen;
  const cuda::ModelGpu::OptimizerState state = model.download_optimizer_state();
  header.optimizer_step = state.steps;
  header.schedule_step = step;
  header.sampler_state = sampler.state();
  header.model_seed = c.seed;
  header.data_seed = c.data_seed;
  header.run_directory = c.run_dir;
  const std::vector<float> weights = gather_whole(view, model.download_weights(), model.config());
  const std::vector<float> first_moment = gather_whole(view, state.first_moment, model.config());
  const std::vector<float> second_moment = gather_whole(view, state.second_moment, model.config());
  std::string failure;
  if (view.root()) {
    try {
      fs::create_directories(checkpoints_dir(c));
      save_checkpoint(checkpoint_path(checkpoints_dir(c), step), header,
                      {{"weights", weights}, {"adam_m", first_moment}, {"adam_v", second_moment}});
      prune_checkpoints(checkpoints_dir(c), int(c.keep_checkpoints));
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  view.agree("saving the checkpoint", failure);
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(digits);
  out << value;
  return out.str();
}

// Tutel's pipelining degree of each MoE block on several ranks (the expert-parallel layers): one row
// per block, [layer, d of the last step, how d is set, the trial time of each candidate d in ms].
// Empty on one GPU.
TableEvent pipelining_table(const cuda::ModelGpu& model, int64_t step) {
  TableEvent table{.name = "pipelining degree per MoE block, step " + std::to_string(step),
                   .columns = {"layer", "d", "chosen by", "trials (the slowest rank's forward + backward)"}};
  for (int64_t layer = 0; layer < model.config().num_layers; ++layer) {
    const cuda::MoeBlockFfn* moe = model.moe_ffn(layer);
    if (moe == nullptr || moe->single_gpu_layer() != nullptr) continue;
    const cuda::MoeBlockFfn::PipelineDegree d = moe->pipeline_degree();
    std::string trials;
    for (size_t i = 0; i < d.candidates.size() && i < d.trial_ms.size(); ++i) {
      if (i > 0) trials += ", ";
      trials += "d=" + std::to_string(d.candidates[i]);
      trials += d.trial_ms[i] < 0 ? std::string(" -") : ' ' + fixed(d.trial_ms[i], 3) + " ms";
    }
    table.rows.push_back({layer, d.last,
                          d.adaptive ? (d.chosen == 0 ? "measurement (trials running)" : "measurement") : "--pipeline-chunks",
                          trials});
  }
  return table;
}

// One line of it: "d = 1 1 2 1 (by measurement)".
std::string pipelining_line(const TableEvent& table) {
  std::string line = "d =";
  bool adaptive = false;
  for (const auto& row : table.rows) {
    line += ' ';
    line += std::to_string(row[1].get<int>());
    adaptive = adaptive || row[2].get<std::string>().starts_with("measurement");
  }
  return line + (adaptive ? " (chosen by measurement)" : "");
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

// ---- [SECTION] inputs ----

namespace {

// What a run reads, loaded and checked before the GPU is touched, so a bad flag, data file,
// checkpoint or run directory is reported the same way on a machine without one.
struct RunInputs {
  TextCorpus corpus;
  std::optional<LoadedCheckpoint> checkpoint;  // the one resumed from
  fs::path checkpoint_file;
  std::vector<dist::ExpertPlacement> placements;  // the checkpoint's, on as many ranks; else empty
  ExpertLoads loads;                              // the checkpoint's loads since its last plan
};

// A checkpoint's placements, checked: one per MoE block, each a valid placement of the model's E
// experts on R ranks (common/expert_placement.h says what is valid). Empty when the checkpoint holds
// none, or holds those of another number of ranks (the run then starts from E / R in id order).
// `loads` gets its load window when it has one for those placements. Throws CheckpointError naming
// the file and the fault.
std::vector<dist::ExpertPlacement> saved_placements(const LoadedCheckpoint& checkpoint, const TrainConfig& c, int R,
                                                    ExpertLoads& loads) {
  const json& extra = checkpoint.header.extra;
  if (!extra.is_object() || !extra.contains("expert_placements")) return {};
  const json& saved = extra["expert_placements"];
  const std::string where = checkpoint.path.string() + ": expert_placements: ";
  if (!saved.is_object() || !saved.contains("ranks") || !saved["ranks"].is_number_integer() || !saved.contains("blocks") ||
      !saved["blocks"].is_array()) {
    throw CheckpointError(where + "not {\"ranks\": R, \"blocks\": [per MoE block, per rank, its experts]}");
  }
  if (saved["ranks"].get<int64_t>() != R) return {};
  const int64_t E = c.model.num_experts;
  const size_t blocks = moe_blocks(c.model).size();
  if (saved["blocks"].size() != blocks) {
    throw CheckpointError(where + std::to_string(saved["blocks"].size()) + " placements; the model has " +
                          std::to_string(blocks) + " MoE blocks");
  }
  std::vector<dist::ExpertPlacement> placements;
  for (size_t j = 0; j < blocks; ++j) {
    const json& ranks = saved["blocks"][j];
    const std::string block = where + "MoE block " + std::to_string(j) + ": ";
    if (!ranks.is_array() || int64_t(ranks.size()) != R) {
      throw CheckpointError(block + "not a list of " + std::to_string(R) + " ranks' experts");
    }
    std::vector<std::vector<int64_t>> held;
    for (const json& experts : ranks) {
      if (!experts.is_array()) throw CheckpointError(block + "a rank's experts are not a list of expert ids");
      if (experts.empty()) {
        throw CheckpointError(block + "rank " + std::to_string(held.size()) + " holds no expert; every rank holds at least one");
      }
      std::vector<int64_t>& mine = held.emplace_back();
      for (const json& e : experts) {
        if (!e.is_number_integer()) throw CheckpointError(block + "an expert id is not an integer: " + e.dump());
        mine.push_back(e.get<int64_t>());
      }
    }
    try {
      placements.emplace_back(E, std::move(held));
    } catch (const std::invalid_argument& error) {
      throw CheckpointError(block + error.what());
    }
  }
  if (extra.contains("expert_load_window")) {
    const json& window = extra["expert_load_window"];
    bool valid = window.is_array() && (window.empty() || window.size() == blocks);
    for (size_t j = 0; valid && j < blocks; ++j) {
      valid = window[j].is_array() && int64_t(window[j].size()) == E;
      for (size_t e = 0; valid && e < window[j].size(); ++e) {
        valid = window[j][e].is_number() && std::isfinite(window[j][e].get<double>()) && window[j][e].get<double>() >= 0;
      }
    }
    if (!valid) throw CheckpointError(where + "expert_load_window is not [MoE block][E] loads >= 0");
    loads = window.get<ExpertLoads>();
  }
  return placements;
}

// The latest checkpoint of run_dir (`file` names it), refused when it holds another model; with
// `any_batch` a checkpoint of another batch is taken too (the benchmark: the parameters do not
// depend on it, a resumed run's data order does).
LoadedCheckpoint read_latest_checkpoint(const TrainConfig& c, int R, int rank, fs::path& file, bool any_batch = false) {
  const std::optional<fs::path> latest = latest_checkpoint(checkpoints_dir(c));
  if (!latest) {
    throw CheckpointError("--resume: no checkpoint in " + checkpoints_dir(c).string() +
                          "; start the run without --resume (or check --run-dir)");
  }
  file = *latest;
  const cuda::ParameterSpan& last = cuda::parameter_layout(one_gpu(gpu_config(c, R, rank))).back();
  const int64_t whole_parameters = last.offset + last.rows * last.cols;  // the one-GPU model's
  LoadedCheckpoint checkpoint = load_checkpoint(*latest, checkpoint_arrays(whole_parameters));
  json wanted = model_json(c);
  if (any_batch) wanted.erase("batch");
  const std::string changed = differences(checkpoint.header.model_config, wanted);
  if (!changed.empty()) {
    throw CheckpointError(latest->string() + " was trained with another model: " + changed +
                          "; resume with the same settings, or start a new run");
  }
  return checkpoint;
}

RunInputs load_inputs(const TrainConfig& c, int R, int rank) {
  validate(c);
  check_placement(c, R);
  if (R > 1 && c.micro_batches > 1) {
    throw TrainConfigError("--micro-batches " + std::to_string(c.micro_batches) +
                           ": allowed on one GPU only (the expert-parallel layer keeps no micro-batches)");
  }
  if (c.batch % R != 0) {
    throw TrainConfigError("batch = " + std::to_string(c.batch) + " sequences cannot be shared by " + std::to_string(R) +
                           " ranks; the global batch must be a multiple of the ranks");
  }
  RunInputs inputs;
  try {
    inputs.corpus = load_corpus(c.data, {.load_tags = false});
  } catch (const TextCorpusError& error) {
    throw TextCorpusError(std::string(error.what()) +
                          (c.data == "notebooks_data/brown" ? " (fetch the Brown corpus with ./moe data)" : ""));
  }
  // Both splits must hold a sequence of S + 1 bytes (the samplers say which does not).
  BatchSampler(inputs.corpus, Split::train, int(c.batch), int(c.model.seq_len), c.data_seed);
  BatchSampler(inputs.corpus, Split::validation, int(c.batch), int(c.model.seq_len), kValidationSeed);
  if (c.resume) {
    const LoadedCheckpoint& checkpoint =
        inputs.checkpoint.emplace(read_latest_checkpoint(c, R, rank, inputs.checkpoint_file));
    inputs.placements = saved_placements(checkpoint, c, R, inputs.loads);
    const int64_t target = c.stop_after > 0 ? c.stop_after : c.steps;
    if (checkpoint.header.step >= target) {
      throw CheckpointError(inputs.checkpoint_file.string() + " is at step " + std::to_string(checkpoint.header.step) +
                            ": the run already reached step " + std::to_string(target) +
                            "; nothing to resume (a longer run is a new run: --steps sets its schedule)");
    }
  } else {
    // RunWriter names its C++ option; the user types the flag.
    if (!c.overwrite && (fs::exists(fs::path(c.run_dir) / "run.json") || fs::exists(fs::path(c.run_dir) / "events.jsonl"))) {
      throw TrainConfigError("refusing to overwrite the existing run at " + c.run_dir +
                             "; pick a new --run-dir, pass --resume to continue it or --overwrite to replace it");
    }
    // A path to a run directory that is a file is a run directory itself: refuse it the same way.
    if (fs::exists(c.run_dir) && !fs::is_directory(c.run_dir)) {
      throw TrainConfigError("--run-dir " + c.run_dir + " is a file, not a directory");
    }
    check_output_path("--run-dir", fs::path(c.run_dir) / "run.json", {{"--data", c.data}});
  }
  return inputs;
}

}  // namespace

void check_inputs(const TrainConfig& config, int ranks) { load_inputs(config, ranks, 0); }

// ---- [SECTION] train ----

namespace {

std::vector<ByteBatch> validation_batches(const TextCorpus& corpus, const TrainConfig& c) {
  BatchSampler sampler(corpus, Split::validation, int(c.batch), int(c.model.seq_len), kValidationSeed);
  std::vector<ByteBatch> batches;
  for (int64_t i = 0; i < c.eval_batches; ++i) batches.push_back(sampler.next());
  return batches;
}

// One training run between the steps of train(): the model, the data, the run record, and the ring
// of per-step losses and step times that the host reads only every log_every steps (a read is a
// host synchronisation; between two, the GPU runs ahead). Each member function is one named step.
class TrainingRun {
 public:
  TrainingRun(const TrainConfig& c, std::ostream& rank_log, cuda::ModelRanks* ranks, RunInputs inputs,
              cudaStream_t stream)
      : c_(c),
        view_(ranks),
        R_(view_.size()),
        inputs_(std::move(inputs)),
        log_(view_.root() ? rank_log : quiet_),
        N_r_(int(c.batch) / R_),
        first_sequence_(view_.rank() * N_r_),
        T_(c.batch * c.model.seq_len),
        sampler_(inputs_.corpus, Split::train, int(c.batch), int(c.model.seq_len), c.data_seed),
        validation_(validation_batches(inputs_.corpus, c)),
        stream_(stream),
        model_(std::make_unique<cuda::ModelGpu>(gpu_config(c, R_, view_.rank(), inputs_.placements),
                                                optimizer_settings(c), stream, ranks)),
        last_step_(c.stop_after > 0 ? c.stop_after : c.steps),
        lr_schedule_(schedule(c)),
        peak_(peak_bf16_flops(device_name()) * R_),  // all ranks' GPUs together
        model_flops_(flops_per_token(c.model)),
        uploader_(N_r_, c.model.seq_len, stream),
        ring_rows_(c.log_every),
        loss_ring_(size_t(ring_rows_ * 4)),
        ring_lr_(size_t(ring_rows_)),
        step_end_(size_t(ring_rows_ + 1)),
        plain_step_(size_t(ring_rows_ + 1), false),
        progress_(log_, {.total_steps = last_step_, .terminal = &log_ == &std::cout && stdout_is_terminal(),
                         .plain_every_seconds = 5}),
        micro_tokens_(model_->config().batch * c.model.seq_len),
        validation_losses_(validation_.size() * size_t(c.micro_batches) * 4) {
    result_.unigram_bits_per_byte = unigram_bits_per_byte(inputs_.corpus.train.bytes, inputs_.corpus.validation.bytes);
    for (cudaEvent_t& event : step_end_) CUDA_CHECK(cudaEventCreate(&event));
  }
  ~TrainingRun() {
    for (cudaEvent_t event : step_end_) cudaEventDestroy(event);
  }
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  int64_t step() const { return step_; }
  int64_t last_step() const { return last_step_; }

  // The model initialised and a new run record, or both restored from the checkpoint. Nothing is
  // written before the config, the data and the checkpoint have all been accepted.
  void start_or_resume() {
    if (inputs_.checkpoint) {
      resume(*inputs_.checkpoint);
      inputs_.checkpoint.reset();  // three copies of the parameters: free them before training
    } else {
      start();
    }
    result_.first_step = step_;
    ring_first_ = step_;
    log_start();
    CUDA_CHECK(cudaEventRecord(step_end_[0], stream_));
  }

  // One step: forward, backward and the optimizer on this rank's share of the global batch, the
  // losses into the ring, and, every record_every steps, the phases and the routing into the record.
  void train_step() {
    const bool record = (step_ + 1) % c_.record_every == 0 || step_ == 0;
    evaluate_now_ = (step_ + 1) % c_.eval_every == 0 || step_ + 1 == last_step_;
    checkpoint_now_ = (step_ + 1) % c_.checkpoint_every == 0 || step_ + 1 == last_step_;
    // Not after the schedule's last step; after --stop-after's it does, as the whole run would.
    rebalance_now_ = eplb() && (step_ + 1) % c_.rebalance_every == 0 && step_ + 1 < c_.steps;
    const int64_t row = step_ - ring_first_;
    const double lr = learning_rate(lr_schedule_, step_);
    ring_lr_[size_t(row)] = lr;

    const ByteBatch batch = sampler_.next();  // the global batch: every rank draws the same
    const auto [tokens, targets] = uploader_.upload(share_of(batch, first_sequence_, N_r_));
    const double origin_us = writer_ ? writer_->elapsed_us() : 0.0;
    if (record) model_->set_phase_timer(&timer_);
    forward_backward(*model_, c_.cuda_graph && !record, tokens, targets);
    if (eplb()) {  // the counts are on the host after each forward's count exchange
      add_expert_load(*model_, loads_);
      ++load_steps_;
    }
    model_->step(float(lr));
    if (record) model_->set_phase_timer(nullptr);
    uploader_.release_current();
    CUDA_CHECK(cudaMemcpyAsync(loss_ring_.data() + row * 4, step_losses(*model_), 4 * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(step_end_[size_t(row + 1)], stream_));
    // A plain step: nothing but training in it, and the host did not stop to wait just before it
    // (then the GPU would have idled while the host enqueued the step's first kernels).
    plain_step_[size_t(row + 1)] = !record && !evaluate_now_ && !checkpoint_now_ && !rebalance_now_ && !host_waited_;
    host_waited_ = record || evaluate_now_ || checkpoint_now_ || rebalance_now_;
    ++step_;
    tokens_seen_ += T_;
    if (record) record_step(batch, origin_us);
  }

  // After a step: read the ring when it is full or a validation or checkpoint follows, evaluate,
  // save. Returns false when a stop signal ends the run here (after a checkpoint).
  bool after_step() {
    if (step_ - ring_first_ == ring_rows_ || evaluate_now_ || checkpoint_now_ || rebalance_now_) {
      flush(step_);
      host_waited_ = true;
    }
    if (evaluate_now_) {
      result_.validation_loss = evaluate();
      result_.validation_bits_per_byte = result_.validation_loss / kLn2;
      if (writer_) {
        writer_->append(step_event(step_, {{"val_loss", result_.validation_loss},
                                           {"val_bits_per_byte", result_.validation_bits_per_byte}}));
      }
      CUDA_CHECK(cudaEventRecord(step_end_[0], stream_));  // the next step's time starts after evaluation
    }
    if (rebalance_now_) {  // before the checkpoint of the same step, which then holds the new placement
      rebalance();
      CUDA_CHECK(cudaEventRecord(step_end_[0], stream_));
    }
    if (checkpoint_now_) {
      save(c_, *model_, step_, tokens_seen_, sampler_, view_, loads_);
      CUDA_CHECK(cudaEventRecord(step_end_[0], stream_));
    }
    // One GPU stops after the step in which the signal came; several stop at an agreed flush.
    if (step_ < last_step_ && (view_.ranks() == nullptr ? stop_signal() != 0 : stop_agreed_)) {
      if (!checkpoint_now_) {
        flush(step_);
        save(c_, *model_, step_, tokens_seen_, sampler_, view_, loads_);
      }
      result_.stopped_by_signal = stop_signal() != 0 ? stop_signal() : SIGTERM;  // another rank's signal
      return false;
    }
    return true;
  }

  // The summary: the figures of the run into the result, the record and the log.
  TrainResult finish(std::chrono::steady_clock::time_point wall_start) {
    progress_.finish();
    result_.steps_done = step_;
    if (result_.stopped_by_signal != 0) {
      log_ << "stopped by " << signal_name(result_.stopped_by_signal) << " after step " << step_ << " of "
           << last_step_ << "; checkpoint " << checkpoint_path(checkpoints_dir(c_), step_).string() << "\n";
      return result_;  // no summary: the run is not over, a resume continues it
    }
    result_.median_step_ms = median(plain_step_ms_);
    result_.tokens_per_second = result_.median_step_ms > 0 ? double(T_) / (result_.median_step_ms * 1e-3) : 0;
    result_.mfu = peak_ > 0 ? model_flops_ * result_.tokens_per_second / peak_ : 0;
    result_.dropped_fraction = routed_ > 0 ? double(dropped_) / double(routed_) : 0;
    result_.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();

    if (writer_) writer_->append(to_event(TableEvent{
        .name = "summary",
        .columns = {"steps", "val_loss", "val_bits_per_byte", "unigram_bits_per_byte", "median_step_ms",
                    "tokens_per_s", "mfu", "dropped_fraction"},
        .rows = {{step_, result_.validation_loss, result_.validation_bits_per_byte, result_.unigram_bits_per_byte,
                  result_.median_step_ms, result_.tokens_per_second, result_.mfu, result_.dropped_fraction}}}));
    log_ << "done at step " << step_ << ": validation " << fixed(result_.validation_loss, 4) << " nats/byte = "
         << fixed(result_.validation_bits_per_byte, 3) << " bits/byte (unigram baseline "
         << fixed(result_.unigram_bits_per_byte, 3) << "), median step " << fixed(result_.median_step_ms, 2)
         << " ms, " << format_rate(result_.tokens_per_second) << " tokens/s";
    if (peak_ > 0) log_ << ", MFU " << fixed(100 * result_.mfu, 1) << "%";
    if (c_.model.formulation != Formulation::dropless && c_.model.moe_layers != MoeLayers::none) {
      log_ << ", dropped " << fixed(100 * result_.dropped_fraction, 2) << "% of routed tokens (recorded steps)";
    }
    log_ << "; run record " << c_.run_dir << "\n";
    return result_;
  }

 private:
  bool eplb() const { return c_.placement == "eplb" && R_ > 1 && c_.model.moe_layers != MoeLayers::none; }

  // --placement eplb, every rebalance_every steps: each MoE block's experts placed again by the
  // loads of the steps since the last plan, then moved there with their AdamW moments
  // (replace_model). The log and the run record get each block's busiest rank over the mean rank,
  // expected from those loads, under the old placement and the new; the record ("placement" table,
  // a row per MoE block) also each rank's experts, from which the viewer shows the replicas.
  void rebalance() {
    std::vector<dist::ExpertPlacement> planned = plan_placements(c_, R_, loads_);
    TableEvent table{.name = "placement",
                     .columns = {"step", "layer", "rank_max_over_mean_before", "rank_max_over_mean_after",
                                 "replicas", "experts_of_rank"}};
    const std::vector<int64_t> layers = moe_blocks(c_.model);
    double before = 0, after = 0;
    bool changed = false;
    for (size_t j = 0; j < planned.size(); ++j) {
      const dist::ExpertPlacement old = cuda::expert_placement(model_->config(), int64_t(j));
      const double b = rank_max_over_mean(old, loads_[j]), a = rank_max_over_mean(planned[j], loads_[j]);
      before += b / double(planned.size());
      after += a / double(planned.size());
      changed = changed || old.fingerprint() != planned[j].fingerprint();
      json experts_of_rank = json::array();
      for (int r = 0; r < R_; ++r) experts_of_rank.push_back(planned[j].experts_of(r));
      table.rows.push_back({step_, layers[j], b, a, planned[j].slots() - planned[j].experts(), experts_of_rank});
    }
    std::ostringstream line;
    line << "step " << step_ << ": experts placed by the loads of the last " << load_steps_ << " steps (EPLB, "
         << c_.redundant_slots << " spare slot" << (c_.redundant_slots == 1 ? "" : "s")
         << " a rank): busiest rank / mean, expected, " << fixed(before, 3) << " -> " << fixed(after, 3)
         << " (mean over the MoE blocks)" << (changed ? "" : "; the placement is unchanged");
    progress_.print(line.str());
    if (writer_) writer_->append(to_event(table));
    if (changed) model_ = replace_model(std::move(model_), std::move(planned), c_, view_, stream_);
    loads_.clear();
    load_steps_ = 0;
  }

  void resume(const LoadedCheckpoint& checkpoint) {
    model_->upload_weights(local_part(checkpoint.array("weights"), model_->config()));
    model_->upload_optimizer_state({checkpoint.header.optimizer_step,
                                   local_part(checkpoint.array("adam_m"), model_->config()),
                                   local_part(checkpoint.array("adam_v"), model_->config())});
    sampler_.set_state(checkpoint.header.sampler_state);
    loads_ = inputs_.loads;  // the load window the checkpoint was saved with (--placement eplb)
    load_steps_ = loads_.empty() ? 0 : checkpoint.header.step % c_.rebalance_every;
    step_ = checkpoint.header.step;
    tokens_seen_ = checkpoint.header.tokens_seen;
    if (view_.ranks() != nullptr) view_.ranks()->barrier();  // every rank has read it before rank 0 edits the run
    if (view_.root()) writer_.emplace(RunWriter::resume_at_step(c_.run_dir, step_));
    log_ << "resumed " << c_.run_dir << " at step " << step_ << " from "
         << inputs_.checkpoint_file.filename().string() << "\n";
  }

  void start() {
    model_->upload_weights(local_part(initial_weights(c_), model_->config()));
    const RunInfo info = run_info();
    if (view_.ranks() != nullptr) view_.ranks()->barrier();  // every rank has looked before rank 0 writes
    std::string failure;
    if (view_.root()) {
      try {
        if (c_.overwrite) fs::remove_all(checkpoints_dir(c_));
        writer_.emplace(RunWriter::create(c_.run_dir, info, c_.overwrite ? OnExisting::overwrite : OnExisting::refuse));
      } catch (const std::exception& error) {
        failure = error.what();
      }
    }
    view_.agree("creating the run directory", failure);
  }

  // run.json of a new run: the model, the config, the data and the devices.
  RunInfo run_info() const {
    RunInfo info;
    info.kind = RunKind::train;
    info.name = c_.name.empty() ? fs::path(c_.run_dir).filename().string() : c_.name;
    if (c_.model.moe_layers != MoeLayers::none) info.moe_config = moe_layer_config(c_.model, c_.batch);
    info.model = model_json(c_);
    info.model["layers"] = c_.model.num_layers;
    info.formulation = c_.model.moe_layers == MoeLayers::none ? "dense" : std::string(to_string(c_.model.formulation));
    info.devices = {device_name()};
    if (view_.ranks() != nullptr) {
      info.world_size = R_;
      info.devices.assign(size_t(R_), device_name());
      info.extra["ranks"] = view_.ranks()->description();
    }
    info.extra["train_config"] = to_json(c_);
    info.extra["data"] = inputs_.corpus.source;
    json genres = json::array();
    for (const Genre& g : inputs_.corpus.genres) genres.push_back(g.name);
    info.extra["genres"] = genres;
    info.extra["unigram_bits_per_byte"] = result_.unigram_bits_per_byte;
    info.extra["parameters"] = total_parameters(c_.model);
    info.extra["active_parameters"] = active_parameters(c_.model);
    info.extra["flops_per_token"] = flops_per_token(c_.model);
    return info;
  }

  void log_start() {
    log_ << "training " << (c_.name.empty() ? c_.run_dir : c_.name) << ": " << total_parameters(c_.model) / 1e6
         << "M parameters (" << active_parameters(c_.model) / 1e6 << "M active per byte), T = " << T_
         << " bytes per step, steps " << step_ << " -> " << last_step_ << ", data " << inputs_.corpus.source;
    if (view_.ranks() != nullptr) {
      log_ << "; " << view_.ranks()->description() << ", " << N_r_ << " sequences a rank, the experts of each MoE block ";
      if (eplb()) {
        log_ << "placed by load (EPLB, " << c_.redundant_slots << " spare slots a rank, planned every "
             << c_.rebalance_every << " steps)";
      } else if (!inputs_.placements.empty()) {
        log_ << "where the checkpoint placed them";
      } else {
        log_ << (c_.model.num_experts % R_ == 0 ? "E / R = " + std::to_string(c_.model.num_experts / R_) + " a rank"
                                                : std::string("in id order, ") + std::to_string(c_.model.num_experts / R_) +
                                                      " or " + std::to_string(c_.model.num_experts / R_ + 1) + " a rank");
      }
    }
    if (c_.micro_batches > 1) {
      log_ << "; " << c_.micro_batches << " micro-batches of " << model_->config().batch
           << " sequences a step, the experts' weight gradients as one product over them";
    }
    if (model_->lanes() > 1) {
      log_ << "; two micro-batches overlapped (--overlap " << (c_.overlap.has_value() ? "on" : "auto") << ")";
    }
    log_ << "\n";
  }

  // The phases' spans, the routing and, on several ranks, the pipelining degrees of a recorded step.
  void record_step(const ByteBatch& batch, double origin_us) {
    RunWriter* const out = writer_ ? &*writer_ : nullptr;
    const std::vector<cuda::TimedPhase> phases = record_spans(timer_, step_, origin_us, view_, out);
    // With micro-batches the layers hold the last micro-batch's routing: its sequences are recorded.
    const int N_m = int(model_->config().batch);
    const ByteBatch recorded = c_.micro_batches > 1 ? share_of(batch, int(c_.micro_batches - 1) * N_m, N_m) : batch;
    const RoutingSummary summary = record_routing(c_, &inputs_.corpus, *model_, recorded, step_, view_, out, phases);
    routed_ += summary.routed;
    dropped_ += summary.dropped;
    // On several ranks: each MoE block's pipelining degree, when it changed (the adaptive trials).
    if (out != nullptr) {
      const TableEvent pipelining = pipelining_table(*model_, step_);
      if (!pipelining.rows.empty() && pipelining.rows != recorded_pipelining_) {
        recorded_pipelining_ = pipelining.rows;
        out->append(to_event(pipelining));
      }
    }
  }

  // Steps ring_first + 1 .. through_step: their losses (the mean over the ranks), times and rates
  // into the record and the progress line. A stop signal on any rank is agreed on here.
  void flush(int64_t through_step) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const int64_t rows = through_step - ring_first_;
    std::vector<double> ring;  // [rows][loss, lm, aux, z], the mean over the ranks
    for (float value : loss_ring_.download()) ring.push_back(value);
    ring.resize(size_t(rows * 4));
    ring.push_back(stop_signal() != 0 ? 1.0 : 0.0);  // a stop signal on any rank stops every rank here
    ring = view_.mean(std::move(ring));
    stop_agreed_ = ring.back() > 0;
    ring.pop_back();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = ring_first_ + r + 1;
      const double* l = &ring[size_t(r * 4)];
      result_.losses.push_back(l[0]);
      std::vector<std::pair<std::string, double>> metrics = {
          {"loss", l[0]}, {"lm_loss", l[1]}, {"aux_loss", l[2]}, {"z_loss", l[3]}, {"lr", ring_lr_[size_t(r)]}};
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, step_end_[size_t(r)], step_end_[size_t(r + 1)]));
      if (plain_step_[size_t(r + 1)]) plain_step_ms_.push_back(ms);
      metrics.push_back({"step_ms", ms});
      if (r + 1 == rows) {  // the rates once per flush: a step event stays short (~150 bytes)
        metrics.push_back({"tokens_per_s", double(T_) / (ms * 1e-3)});
        if (peak_ > 0) metrics.push_back({"mfu", model_flops_ * double(T_) / (ms * 1e-3) / peak_});
        metrics.push_back({"grad_norm", model_->read_grad_norm()});
      }
      if (writer_) writer_->append(step_event(s, metrics));
    }
    if (rows > 0) {
      progress_.update(through_step, tokens_seen_, ring[size_t((rows - 1) * 4)],
                       {{"lr", fixed(ring_lr_[size_t(rows - 1)] * 1e3, 3) + "e-3"}});
    }
    std::swap(step_end_[0], step_end_[size_t(rows)]);
    ring_first_ = through_step;
  }

  // The validation loss, nats per byte: each batch's losses are copied on the device, one read at
  // the end. With micro-batches the model holds one micro-batch: each batch is M forwards of N / M.
  double evaluate() {
    const int64_t M = c_.micro_batches;
    for (size_t i = 0; i < validation_.size(); ++i) {
      const auto [tokens, targets] = uploader_.upload(share_of(validation_[i], first_sequence_, N_r_));
      for (int64_t m = 0; m < M; ++m) {
        model_->forward(tokens + m * micro_tokens_, targets + m * micro_tokens_);
        CUDA_CHECK(cudaMemcpyAsync(validation_losses_.data() + (i * size_t(M) + size_t(m)) * 4, model_->losses().data(),
                                   4 * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      }
      uploader_.release_current();
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::vector<float> losses = validation_losses_.download();
    double sum = 0;
    for (size_t i = 0; i < validation_.size() * size_t(M); ++i) sum += losses[i * 4 + 1];  // the language-model part
    return view_.mean({sum / double(validation_.size() * size_t(M))})[0];
  }

  const TrainConfig& c_;
  const RankView view_;
  const int R_;
  RunInputs inputs_;
  NullStream quiet_;
  std::ostream& log_;  // rank 0's log; quiet on the others
  const int N_r_, first_sequence_;  // this rank's share of each batch
  const int64_t T_;                 // bytes a step, all ranks
  BatchSampler sampler_;
  const std::vector<ByteBatch> validation_;
  const cudaStream_t stream_;
  std::unique_ptr<cuda::ModelGpu> model_;  // rebuilt when --placement eplb moves the experts
  ExpertLoads loads_;  // --placement eplb: each expert's routed slots since the last plan
  int64_t load_steps_ = 0;  // the steps loads_ counts
  TrainResult result_;
  int64_t step_ = 0, tokens_seen_ = 0;
  std::optional<RunWriter> writer_;  // rank 0's
  const int64_t last_step_;
  const ScheduleConfig lr_schedule_;
  const double peak_;
  const double model_flops_;
  BatchUploader uploader_;
  // The ring of per-step losses {loss, lm, aux, z}: one device copy per step, read every log_every.
  const int64_t ring_rows_;
  DeviceBuffer<float> loss_ring_;
  std::vector<double> ring_lr_;
  int64_t ring_first_ = 0;  // the ring's row 0 holds step ring_first_ + 1
  // Step-end events: the GPU time between two consecutive ends is one step's time.
  std::vector<cudaEvent_t> step_end_;
  std::vector<bool> plain_step_;  // no evaluation / recording in it
  std::vector<double> plain_step_ms_;
  bool host_waited_ = true;  // the host synchronised since the last step was enqueued
  bool evaluate_now_ = false, checkpoint_now_ = false, rebalance_now_ = false;  // the current step's
  bool stop_agreed_ = false;  // set by flush on every rank alike
  cuda::PhaseTimer timer_;
  ProgressLine progress_;
  int64_t routed_ = 0, dropped_ = 0;
  std::vector<std::vector<json>> recorded_pipelining_;  // the last pipelining table written
  const int64_t micro_tokens_;
  DeviceBuffer<float> validation_losses_;
};

}  // namespace

TrainResult train(const TrainConfig& c, std::ostream& rank_log, cuda::ModelRanks* ranks) {
  const auto wall_start = std::chrono::steady_clock::now();
  check_cuda_graph(c, ranks);
  const RankView view(ranks);
  RunInputs inputs = load_inputs(c, view.size(), view.rank());
  if (const std::string why = cuda::why_no_gpu(); !why.empty()) throw std::runtime_error("no GPU: " + why);

  const OwnedStream stream;
  TrainingRun run(c, rank_log, ranks, std::move(inputs), stream.get());
  run.start_or_resume();
  while (run.step() < run.last_step()) {
    run.train_step();
    if (!run.after_step()) break;
  }
  return run.finish(wall_start);
}

// ---- [SECTION] benchmark ----

namespace {

// The routing of the last forward into `result`: each MoE block's slots by source rank and expert,
// and the busiest expert's and the busiest rank's rows over their means, all ranks' tokens together
// (a rank's rows: those its slots of the model's placement computed). Collective on several ranks; synchronises (the
// downloads).
void record_routing_balance(const TrainConfig& c, const cuda::ModelGpu& model, const RankView& view,
                            BenchmarkResult& result) {
  const int64_t E = c.model.num_experts, R = view.size();
  int64_t moe_block = 0;
  for (int64_t layer = 0; layer < c.model.num_layers; ++layer) {
    const cuda::MoeBlockFfn* moe = model.moe_ffn(layer);
    if (moe == nullptr) continue;
    const std::vector<int32_t> top = local_top_experts(model, layer);  // [T_r, K]
    std::vector<int32_t> counts(size_t(E), 0);
    for (int32_t expert : top) ++counts[size_t(expert)];
    const std::vector<int32_t> all = R > 1 ? view.ranks()->host_all_gather(counts) : counts;  // [R][E]
    std::vector<int64_t> rows(size_t(E), 0), rank_rows(size_t(R), 0);
    for (size_t i = 0; i < all.size(); ++i) rows[i % size_t(E)] += all[i];
    // Each source's rows of expert e over e's replicas, by the placement's routing rule.
    const dist::ExpertPlacement placement = cuda::expert_placement(model.config(), moe_block++);
    for (int source = 0; source < int(R); ++source) {
      for (int64_t e = 0; e < E; ++e) {
        const std::vector<int64_t>& replicas = placement.replicas(e);
        for (size_t i = 0; i < replicas.size(); ++i) {
          const int64_t n = all[size_t(source) * size_t(E) + size_t(e)];
          rank_rows[size_t(placement.slot_rank(replicas[i]))] += placement.piece(source, e, n, int64_t(i)).count;
        }
      }
    }
    const auto max_over_mean = [](const std::vector<int64_t>& values) {
      const double sum = std::accumulate(values.begin(), values.end(), 0.0);
      return sum > 0 ? double(*std::max_element(values.begin(), values.end())) * double(values.size()) / sum : 0.0;
    };
    result.expert_max_over_mean.push_back(max_over_mean(rows));
    result.rank_max_over_mean.push_back(max_over_mean(rank_rows));
    std::vector<std::vector<int64_t>>& tokens = result.routing_tokens.emplace_back(size_t(R));
    for (size_t r = 0; r < size_t(R); ++r) tokens[r].assign(all.begin() + ptrdiff_t(r * E), all.begin() + ptrdiff_t((r + 1) * E));
  }
}

}  // namespace

BenchmarkResult benchmark(const TrainConfig& config, std::ostream& rank_log, cuda::ModelRanks* ranks) {
  TrainConfig c = config;
  c.run_dir = c.run_dir.empty() ? "unused" : c.run_dir;
  validate(c);
  check_placement(c, ranks != nullptr ? ranks->size() : 1);
  if (c.benchmark_steps < 1) throw TrainConfigError("benchmark: benchmark_steps must be >= 1");
  check_cuda_graph(c, ranks);
  const RankView view(ranks);
  const int R = view.size();
  if (c.batch % R != 0) {
    throw TrainConfigError("batch = " + std::to_string(c.batch) + " sequences cannot be shared by " + std::to_string(R) +
                           " ranks; the global batch must be a multiple of the ranks");
  }
  NullStream quiet;
  std::ostream& log = view.root() ? rank_log : quiet;
  const int N_r = int(c.batch) / R, first_sequence = view.rank() * N_r;
  const int64_t N = c.batch, S = c.model.seq_len, T = N * S;  // T: all ranks' tokens
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
  std::optional<LoadedCheckpoint> checkpoint;
  fs::path file;
  std::vector<dist::ExpertPlacement> placements;  // a resumed run's, on as many ranks
  ExpertLoads loads;                              // --placement eplb: the warm-up steps' loads
  if (c.resume) {
    checkpoint = read_latest_checkpoint(c, R, view.rank(), file, /*any_batch=*/true);
    placements = saved_placements(*checkpoint, c, R, loads);
    loads.clear();  // the plan below counts the warm-up steps alone
  }
  auto model = std::make_unique<cuda::ModelGpu>(gpu_config(c, R, view.rank(), placements), optimizer_settings(c),
                                                stream, ranks);
  int64_t step = 0;
  if (checkpoint) {
    model->upload_weights(local_part(checkpoint->array("weights"), model->config()));
    model->upload_optimizer_state({checkpoint->header.optimizer_step,
                                   local_part(checkpoint->array("adam_m"), model->config()),
                                   local_part(checkpoint->array("adam_v"), model->config())});
    step = checkpoint->header.step;
    result.weights = file.string() + " (step " + std::to_string(step) + ")";
    checkpoint.reset();
  } else {
    model->upload_weights(local_part(initial_weights(c), model->config()));
    result.weights = "the initial weights";
  }
  const bool eplb = c.placement == "eplb" && R > 1 && c.model.moe_layers != MoeLayers::none;
  BatchUploader uploader(N_r, S, stream);
  const ScheduleConfig lr_schedule = schedule(c);
  bool timing_phases = false;
  auto one_step = [&] {
    const auto [tokens, targets] = uploader.upload(share_of(next_batch(), first_sequence, N_r));
    forward_backward(*model, c.cuda_graph && !timing_phases, tokens, targets);
    if (eplb) add_expert_load(*model, loads);
    model->step(float(learning_rate(lr_schedule, step++)));
    uploader.release_current();
  };

  // Untimed steps: benchmark_warmup of them, and at least a second's worth (clock_warm_up.h).
  // On several ranks a count, the same on all (a time would differ between ranks, and so would the
  // number of collective steps).
  if (view.ranks() != nullptr) {
    for (int64_t i = 0; i < std::max<int64_t>(c.benchmark_warmup, 20); ++i) one_step();
  } else {
    cuda::warm_up_clock(stream, static_cast<int>(c.benchmark_warmup), 1000.0, one_step);
  }
  // --placement eplb: the experts placed by the warm-up steps' loads, then a few steps more untimed.
  if (eplb) {
    std::vector<dist::ExpertPlacement> planned = plan_placements(c, R, loads);
    for (size_t j = 0; j < planned.size(); ++j) {
      const dist::ExpertPlacement old = cuda::expert_placement(model->config(), int64_t(j));
      result.planned_rank_max_over_mean.push_back({rank_max_over_mean(old, loads[j]), rank_max_over_mean(planned[j], loads[j])});
      result.placements.push_back(planned[j].describe());
    }
    const auto moved = std::chrono::steady_clock::now();
    model = replace_model(std::move(model), std::move(planned), c, view, stream);
    result.rebalance_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - moved).count();
    for (int64_t i = 0; i < 5; ++i) one_step();
  }
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
  if (!std::isfinite(model->read_loss())) throw std::runtime_error("benchmark: the loss is not finite");

  result.median_step_ms = median(step_ms);
  result.min_step_ms = *std::min_element(step_ms.begin(), step_ms.end());
  result.tokens_per_second = double(T) / (result.median_step_ms * 1e-3);
  const double peak = peak_bf16_flops(result.device);
  result.mfu = peak > 0 ? result.flops_per_token * result.tokens_per_second / (peak * R) : 0;

  // One more step with the phase timer: where the time goes (events add a little of their own).
  cuda::PhaseTimer timer;
  model->set_phase_timer(&timer);
  timing_phases = true;
  one_step();
  timing_phases = false;
  model->set_phase_timer(nullptr);
  record_routing_balance(c, *model, view, result);
  // --benchmark-kernel-trace: 10 more steps, every kernel timed on the GPU by CUPTI (after the timed
  // steps, so the tracer's small cost per launch stays out of them).
  if (c.benchmark_kernel_trace) {
    result.traced_steps = 10;
    CUDA_CHECK(cudaDeviceSynchronize());
    bench::KernelTrace trace;
    trace.take();  // nothing before the traced steps
    for (int64_t i = 0; i < result.traced_steps; ++i) one_step();
    CUDA_CHECK(cudaDeviceSynchronize());
    result.kernels = bench::kernel_shares(trace.take(), result.traced_steps, 56);
  }
  // The model's own phases (depth 0) tile the step; the MoE layers' phases (router, plan,
  // dispatch, expert_compute, combine and their backward) nest inside "moe" / "backward_moe" (with
  // micro-batches also "backward_moe_weight_gradients") and are listed as "moe/<name>", each summed
  // over the layers.
  std::map<std::string, double> by_name;
  std::vector<std::string> order;
  double total = 0, moe = 0;
  for (const cuda::TimedPhase& phase : timer.collect()) {
    const std::string name = phase.depth == 0 ? phase.name : "moe/" + phase.name;
    if (!by_name.count(name)) order.push_back(name);
    by_name[name] += phase.duration_us * 1e-3;
    if (phase.depth == 0) total += phase.duration_us * 1e-3;
    if (name == "moe" || name == "backward_moe" || name == "backward_moe_weight_gradients") moe += phase.duration_us * 1e-3;
    if (phase.stream == 0 && cuda::is_exposed_communication(phase.name)) {
      result.exposed_communication_ms += phase.duration_us * 1e-3;
    }
  }
  for (const std::string& name : order) result.phase_ms.push_back({name, by_name[name]});
  result.moe_share = total > 0 ? moe / total : 0;

  log << "benchmark on " << result.device
      << (view.ranks() != nullptr ? " x " + std::to_string(R) + " (" + view.ranks()->description() + ")" : "")
      << (overlaps(c, int(R)) ? ", two micro-batches overlapped" : "") << " (" << result.data << "): T = " << T
      << " bytes per step, " << c.benchmark_steps << " steps after " << c.benchmark_warmup << " warm-up, from " << result.weights << "\n"
      << "  median step " << fixed(result.median_step_ms, 3) << " ms (min " << fixed(result.min_step_ms, 3)
      << "), " << format_rate(result.tokens_per_second) << " tokens/s, MFU " << fixed(100 * result.mfu, 1)
      << "% (" << fixed(result.flops_per_token / 1e6, 1) << " MFLOP per token)\n  phases of one timed step:";
  for (const auto& [name, ms] : result.phase_ms) log << " " << name << " " << fixed(ms, 3);
  log << " ms; MoE share " << fixed(100 * result.moe_share, 1) << "%";
  if (view.ranks() != nullptr) {
    // Its share of the median step (not of the phases' sum: with two micro-batches both lanes' phases
    // run side by side and add up to about twice the step).
    log << "; exposed communication " << fixed(result.exposed_communication_ms, 3) << " ms ("
        << fixed(result.median_step_ms > 0 ? 100 * result.exposed_communication_ms / result.median_step_ms : 0.0, 1)
        << "% of the median step)";
  }
  log << "\n";
  if (!result.expert_max_over_mean.empty()) {
    log << "  routing of that step, busiest / mean, per MoE block: expert";
    for (double ratio : result.expert_max_over_mean) log << " " << fixed(ratio, 2);
    if (R > 1) {
      log << "; rank";
      for (double ratio : result.rank_max_over_mean) log << " " << fixed(ratio, 2);
    }
    log << "\n";
  }
  if (eplb) {
    log << "  experts placed by the warm-up steps' loads (EPLB, " << c.redundant_slots
        << " spare slots a rank; moved in " << fixed(result.rebalance_seconds, 2)
        << " s): busiest rank / mean, expected, per MoE block:";
    for (const auto& [before, after] : result.planned_rank_max_over_mean) log << " " << fixed(before, 2) << " -> " << fixed(after, 2);
    log << "\n";
  }
  if (!result.kernels.empty()) {
    double launches = 0, gpu_ms = 0;
    for (const bench::KernelShare& k : result.kernels) launches += k.launches_per_step, gpu_ms += k.ms_per_step;
    log << "  kernels a step (means over " << result.traced_steps << " traced steps): " << fixed(launches, 0)
        << " launches, " << fixed(gpu_ms, 3) << " ms of GPU time against the " << fixed(result.median_step_ms, 3)
        << " ms median step; the most time first:\n";
    for (size_t i = 0; i < result.kernels.size() && i < 24; ++i) {
      log << "    " << fixed(result.kernels[i].ms_per_step, 3) << " ms " << fixed(result.kernels[i].launches_per_step, 1)
          << " x  " << result.kernels[i].name << "\n";
    }
  }
  const TableEvent pipelining = pipelining_table(*model, c.benchmark_warmup + c.benchmark_steps + 1 + result.traced_steps);
  if (!pipelining.rows.empty()) log << "  pipelining degree of the MoE blocks: " << pipelining_line(pipelining) << "\n";

  if (!c.benchmark_json.empty() && view.root()) {
    json out = {{"device", result.device}, {"ranks", R}, {"date", utc_now_iso8601()}, {"data", result.data},
                {"config", to_json(c)}, {"overlap", overlaps(c, int(R))}, {"tokens_per_step", T},
                {"median_step_ms", result.median_step_ms},
                {"min_step_ms", result.min_step_ms}, {"step_ms", step_ms},
                {"tokens_per_second", result.tokens_per_second}, {"mfu", result.mfu},
                {"flops_per_token", result.flops_per_token}, {"moe_share", result.moe_share},
                {"exposed_communication_ms", result.exposed_communication_ms}, {"weights", result.weights},
                {"routing_expert_max_over_mean", result.expert_max_over_mean},
                {"routing_rank_max_over_mean", result.rank_max_over_mean},
                {"routing_tokens", result.routing_tokens}};
    for (const auto& [name, ms] : result.phase_ms) out["phase_ms"][name] = ms;
    if (eplb) {
      out["placement"] = {{"planned_rank_max_over_mean", result.planned_rank_max_over_mean},
                          {"placements", result.placements}, {"rebalance_seconds", result.rebalance_seconds}};
    }
    if (!pipelining.rows.empty()) out["pipelining"] = {{"columns", pipelining.columns}, {"rows", pipelining.rows}};
    if (!result.kernels.empty()) {
      out["kernel_trace"] = {{"traced_steps", result.traced_steps}, {"kernels", json::array()}};
      for (const bench::KernelShare& k : result.kernels) {
        out["kernel_trace"]["kernels"].push_back(
            {{"name", k.name}, {"ms_per_step", k.ms_per_step}, {"launches_per_step", k.launches_per_step}});
      }
    }
    std::ofstream file(c.benchmark_json);
    file << out.dump(2) << "\n";
    if (!file) throw std::runtime_error("benchmark: cannot write " + c.benchmark_json);
  }
  return result;
}

}  // namespace moe::train
