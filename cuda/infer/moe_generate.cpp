// moe_generate.cpp: the command-line program that writes text with a trained byte-level MoE model on
// the GPU: load a moe_train run's latest checkpoint or a model.safetensors file, prefill the prompt
// (the same prompt for every sequence of the batch, each with its own sampling seed), then decode
// byte by byte with a KV cache, every MoE block's experts served by the chosen mode: all resident
// (gpu_only) or streamed from pinned host memory into an expert cache (on_demand, prefetch_all,
// pregated, speculative; offload/offloaded_experts.h), optionally with the misses computed on the
// host (--host-experts misses|auto; offload/host_expert_choice.h), or with the cache's slot table on
// the GPU (--slot-table device; offload/device_slot_cache.h), and with chosen MoE blocks kept on the GPU
// (--resident-blocks 0; offload/resident_blocks.h). Where nothing in a decode step waits on
// the host (gpu_only, --slot-table device), each step is one CUDA graph launch (--graph off: launched).
//
//   cmake --build build --target moe_train moe_generate
//   build/cuda/train/moe_train --run-dir runs/train
//   build/cuda/infer/moe_generate --checkpoint runs/train --prompt "The jury said"
//   build/cuda/infer/moe_generate --help
//   build/cuda/infer/moe_generate --checkpoint runs/train --mode on_demand --run-dir runs/generate_on_demand
//   build/cuda/infer/moe_generate --checkpoint runs/pregated --mode pregated --slot-table device
//
// With --run-dir, a run record (kind "infer", notebooks_data/README.md) for the viewer's offload
// panel: per step an `offload` event per MoE block and spans on the compute and copy streams
// (infer/offload_recording.h says where each time comes from), with either slot table.
//
// Sequence 0 is printed as it is produced (flushed byte by byte), the others at the end; a summary
// (times, the experts each MoE block used, the prefetches' accuracy, the expert cache's hits and
// stalls) goes to stderr. Exit status: 0 done or --help; 2 bad flags or bad input (the message
// says which); 1 a failure on the GPU.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.h"                // CLI::App, parse_command_line, whole_number, finite_number
#include "core/cuda_check.h"             // CudaError
#include "core/device_info.h"            // gpu_available, why_no_gpu, current_device
#include "program_exit.h"                // check_output_path
#include "infer/expert_schedule.h"       // ExpertSchedule, parse_expert_schedule
#include "infer/generate.h"              // generate
#include "infer/inference_model.h"       // InferenceModelGpu
#include "infer/offload_recording.h"     // RecordedExpertSource
#include "infer/weights_file.h"          // load_weights_checkpoint, load_weights_safetensors, pinned_experts
#include "offload/device_slot_cache.h"   // DeviceSlotCache
#include "offload/offloaded_experts.h"   // OffloadedExperts, OffloadOptions
#include "offload/pinned_expert_store.h" // PinnedExpertStore
#include "offload/resident_blocks.h"     // ResidentBlocks, parse_resident_blocks
#include "offload/resident_experts.h"    // ResidentExperts

namespace {

using namespace moe::cuda;

constexpr const char* kDescription =
    "usage: moe_generate (--checkpoint PATH | --weights FILE) [--prompt TEXT | --prompt-file FILE] [options]\n"
    "  Writes text with a trained byte-level MoE model on the GPU: prefill, then one byte per sequence per\n"
    "  step with a KV cache. Sequence 0 is printed as it is produced, the others at the end.";

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::optional<std::string> checkpoint, weights, prompt, prompt_file;
  int64_t max_new_bytes = 200;
  int64_t batch = 1;
  SamplingSettings sampling{0.8, 0, 1};
  ExpertSchedule mode = ExpertSchedule::gpu_only;
  int64_t cache_experts = 0;  // 0: the default
  CachePolicy cache_policy = CachePolicy::lru;
  HostExperts host_experts = HostExperts::off;
  int host_threads = 0;  // 0: every hardware thread
  bool graph = true;     // --graph: the decode step as one CUDA graph where it applies
  bool device_slots = false;  // --slot-table device
  std::string resident_blocks;  // --resident-blocks: MoE blocks kept on the GPU ("" none), checked with the model
  std::optional<std::string> run_dir;
};

// The flags into `o`; the exit status when the program should stop here (--help, a bad flag).
std::optional<int> parse(const std::vector<std::string>& arguments, Options& o) {
  std::string mode, cache_policy, host_experts, graph, slot_table;
  CLI::App app{kDescription, "moe_generate"};
  app.add_option("--checkpoint", o.checkpoint,
                 "a moe_train run directory (its latest checkpoint), its checkpoints/ folder, or one checkpoint file");
  app.add_option("--weights", o.weights, "a model.safetensors (moe_export_weights --checkpoint RUN --out FILE)");
  app.add_option("--prompt", o.prompt, "the prompt's bytes (default: \"The \")");
  app.add_option("--prompt-file", o.prompt_file, "the prompt: every byte of FILE");
  app.add_option("--max-new-bytes", o.max_new_bytes, "bytes to generate per sequence (prompt + N - 1 <= the context)")
      ->capture_default_str()->check(moe::whole_number(1));
  app.add_option("--batch", o.batch, "sequences decoded together: the same prompt, seeds seed, seed+1, ...")
      ->capture_default_str()->check(moe::whole_number(1));
  app.add_option("--temperature", o.sampling.temperature, "0 = greedy; > 0 samples from softmax(logits / T)")
      ->capture_default_str()->check(moe::finite_number());
  app.add_option("--top-k", o.sampling.top_k, "sample among the K most likely bytes; 0 = all 256")
      ->capture_default_str()->check(moe::whole_number(0));
  app.add_option("--seed", o.sampling.seed, "sequence n draws from mt19937_64(S + n)")->capture_default_str()
      ->check(moe::whole_number(0));
  app.add_option("--mode", mode,
                 "where the experts live and when they are fetched (default gpu_only): gpu_only, every expert resident "
                 "on the GPU; on_demand, pinned host memory, a block's chosen experts copied after its gate; "
                 "prefetch_all, ... and every expert of the next MoE block copied during this one; pregated, ... the "
                 "experts this block's pre-gate chose for the next (a model trained with moe_train --pregated); "
                 "speculative, ... the next block's gate applied to this block's hidden state");
  app.add_option("--cache-experts", o.cache_experts,
                 "expert cache slots for the modes other than gpu_only (default: two MoE blocks' worth, 2E, or all "
                 "experts if fewer)")
      ->check(moe::whole_number(1));
  app.add_option("--cache-policy", cache_policy, "the expert cache's eviction: lru | lfu | next_use (default lru)");
  app.add_option("--host-experts", host_experts,
                 "experts not on the GPU computed on the host instead of copied, in the offloading modes: off "
                 "(default), misses (every one), auto (a cost model from the PCIe and host rates measured at "
                 "start-up picks per expert and step). Not bit for bit gpu_only's: equal within bf16 rounding");
  app.add_option("--host-threads", o.host_threads, "threads of the host experts (default: every hardware thread)")
      ->check(moe::whole_number(1));
  app.add_option("--slot-table", slot_table,
                 "where the offloading modes keep their expert cache's slot table: host (default; each MoE block's "
                 "routing is read back and the host picks the copies) or device (a kernel plans the copies from the "
                 "routing on the GPU and SMs copy the experts: no host wait inside a step, which can then be one CUDA "
                 "graph; LRU, no --host-experts; with --run-dir the steps run launched, their counts read back after each)");
  app.add_option("--resident-blocks", o.resident_blocks,
                 "MoE blocks whose experts stay on the GPU in an offloading mode, e.g. 0 (m_0: no pre-gate announces "
                 "its experts, so its misses are always copied on demand); the other blocks use the expert cache. "
                 "Default: none");
  app.add_option("--graph", graph,
                 "on (default): where nothing inside a decode step waits on the host (gpu_only, or --slot-table "
                 "device), each step is one CUDA graph launch (captured on the second step; the same bits); off: "
                 "every kernel launched. A --run-dir run always runs launched");
  app.add_option("--run-dir", o.run_dir,
                 "also write a run record there (kind infer: offload events and copy / compute spans per step, for "
                 "the viewer); an existing record in DIR is replaced");
  if (const std::optional<int> exit_status = moe::parse_command_line(app, arguments)) return exit_status;
  if (!cache_policy.empty()) {
    try {
      o.cache_policy = cache_policy_from_string(cache_policy);
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string("--cache-policy: ") + error.what());
    }
  }
  if (!mode.empty()) {
    try {
      o.mode = parse_expert_schedule(mode);
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string("--mode: ") + error.what());
    }
  }
  if (!graph.empty()) {
    if (graph != "on" && graph != "off") throw BadInput("--graph: '" + graph + "'; allowed: on, off");
    o.graph = graph == "on";
  }
  if (!slot_table.empty()) {
    if (slot_table != "host" && slot_table != "device") {
      throw BadInput("--slot-table: '" + slot_table + "'; allowed: host, device");
    }
    o.device_slots = slot_table == "device";
  }
  if (!host_experts.empty()) {
    try {
      o.host_experts = parse_host_experts(host_experts);
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string("--host-experts: ") + error.what());
    }
  }
  if (o.host_experts != HostExperts::off && o.mode == ExpertSchedule::gpu_only) {
    throw BadInput("--host-experts " + std::string(to_string(o.host_experts)) +
                   " needs an offloading --mode (on_demand, prefetch_all, pregated, speculative): with gpu_only every "
                   "expert is on the GPU");
  }
  if (!o.resident_blocks.empty()) {
    if (o.mode == ExpertSchedule::gpu_only) {
      throw BadInput("--resident-blocks needs an offloading --mode (with gpu_only every block is resident)");
    }
    try {  // the list's form now; its blocks against the model's once it is loaded
      (void)parse_resident_blocks(o.resident_blocks, std::numeric_limits<int64_t>::max());
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string("--resident-blocks: ") + error.what());
    }
  }
  if (o.device_slots) {
    const std::string refused = "--slot-table device ";
    if (o.mode == ExpertSchedule::gpu_only) {
      throw BadInput(refused + "needs an offloading --mode (with gpu_only every expert is on the GPU)");
    }
    if (o.host_experts != HostExperts::off) {
      throw BadInput(refused + "cannot be combined with --host-experts (the host would need each block's routing)");
    }
    if (o.cache_policy != CachePolicy::lru) {
      throw BadInput(refused + "evicts least recently used only (--cache-policy lru)");
    }
  }
  if (o.host_threads != 0) {
    try {
      check_cpu_expert_threads(o.host_threads);
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string("--host-threads: ") + error.what());
    }
  }
  if (o.checkpoint.has_value() == o.weights.has_value()) {
    throw BadInput("give one of --checkpoint PATH or --weights FILE (--help)");
  }
  if (o.prompt && o.prompt_file) throw BadInput("give --prompt or --prompt-file, not both (--help)");
  try {
    validate(o.sampling);
    if (o.run_dir) moe::check_output_path("--run-dir", std::filesystem::path(*o.run_dir) / "run.json");
  } catch (const std::invalid_argument& error) {
    throw BadInput(error.what());
  }
  return std::nullopt;
}

std::vector<int32_t> prompt_bytes(const Options& o) {
  std::string text = o.prompt.value_or("The ");
  if (o.prompt_file) {
    std::ifstream file(*o.prompt_file, std::ios::binary);
    if (!file) throw BadInput(*o.prompt_file + ": cannot read the prompt file");
    text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  if (text.empty()) throw BadInput("the prompt is empty; it needs at least one byte");
  std::vector<int32_t> bytes;
  for (char c : text) bytes.push_back(static_cast<unsigned char>(c));
  return bytes;
}

// The host-expert cost model's GPU time per MoE block, as offload_bench takes it: this model's
// gpu_only decode step (every expert resident, one CUDA graph a step) over its MoE blocks, the median
// of up to 8 steps after 2 warm-up steps on the run's own prompt, before the run. Needs the experts
// in free GPU memory for the while (half of what is free, at most); 0 when they do not fit or the
// context leaves fewer than 4 decode steps, and the cost model then counts the copy engine's queue
// too long (offload/host_expert_choice.h).
double measure_gpu_block_ms(const ModelGpuConfig& config, std::span<const float> weights,
                            const PinnedExpertStore& store, const std::vector<int32_t>& prompt) {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t steps = std::min<int64_t>(10, config.seq_len - int64_t(prompt.size()));
  if (store.shape().total_bytes() > free_bytes / 2 || steps < 4) return 0;
  ResidentExperts resident(store);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<double> times;
  {
    InferenceModelGpu model(config, weights, resident, ExpertSchedule::gpu_only, stream);
    model.set_decode_graph(true);
    model.prefill(std::vector<std::vector<int32_t>>(size_t(config.batch), prompt));
    const std::vector<int32_t> next(size_t(config.batch), prompt.back());
    for (int64_t step = 0; step < steps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      model.decode_step(next);  // returns the logits to the host: the step has run
      if (step >= 2) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return times[times.size() / 2] / double(store.shape().blocks);
}

int run(const std::vector<std::string>& arguments) {
  Options o;
  if (const std::optional<int> exit_status = parse(arguments, o)) return *exit_status;
  const std::vector<int32_t> prompt = prompt_bytes(o);

  InferenceWeights loaded;
  try {
    loaded = o.checkpoint ? load_weights_checkpoint(*o.checkpoint) : load_weights_safetensors(*o.weights);
  } catch (const std::invalid_argument& error) {
    throw BadInput(error.what());
  }
  ModelGpuConfig config = loaded.config;
  config.batch = o.batch;
  try {
    validate_for_inference(config);
    check_schedule(config, o.mode);
  } catch (const std::invalid_argument& error) {
    throw BadInput(std::string(error.what()) + " (--mode)");
  }
  const int64_t P = int64_t(prompt.size()), S = config.seq_len;
  if (P + o.max_new_bytes - 1 > S) {
    throw BadInput("the prompt has " + std::to_string(P) + " bytes; with --max-new-bytes " +
                   std::to_string(o.max_new_bytes) + " it needs " + std::to_string(P + o.max_new_bytes - 1) +
                   " positions, and the model's context holds S = " + std::to_string(S) +
                   " (a shorter prompt or fewer bytes)");
  }

  // Everything the user named is checked; the rest needs the GPU (pinned memory included).
  if (!gpu_available()) {
    std::fprintf(stderr, "moe_generate: no GPU: %s\n", why_no_gpu().c_str());
    return 1;
  }

  // The experts: resident, or in pinned host memory behind an expert cache.
  const bool has_experts = config.moe_layers != moe::MoeLayers::none;
  std::optional<PinnedExpertStore> store;
  std::unique_ptr<ExpertSource> source;
  OffloadedExperts* offloaded = nullptr;
  DeviceSlotCache* device_cache = nullptr;
  if (has_experts) store.emplace(pinned_experts(config, loaded.weights));
  if (has_experts && o.mode != ExpertSchedule::gpu_only) {
    const int64_t E = config.moe.num_experts, all = store->shape().blocks * E;
    const int64_t slots = o.cache_experts > 0 ? o.cache_experts : std::min(2 * E, all);
    const int64_t tokens = o.batch * P;  // the prefill's tokens: the largest acquire
    try {
      if (o.device_slots) {
        auto cache = std::make_unique<DeviceSlotCache>(*store, DeviceSlotCacheOptions{slots, tokens, config.moe.top_k});
        device_cache = cache.get();
        source = std::move(cache);
      } else {
        OffloadOptions options;
        options.cache_slots = slots;
        options.policy = o.cache_policy;
        options.max_tokens_per_step = tokens;
        options.top_k = config.moe.top_k;
        options.host_experts = o.host_experts;
        options.host_threads = o.host_threads;
        if (o.host_experts == HostExperts::cost_model) {
          options.gpu_block_ms = measure_gpu_block_ms(config, loaded.weights, *store, prompt);
        }
        auto cache = std::make_unique<OffloadedExperts>(*store, options);
        offloaded = cache.get();
        source = std::move(cache);
      }
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string(error.what()) + " (--cache-experts)");
    }
  } else if (has_experts) {
    source = std::make_unique<ResidentExperts>(*store);
  }
  // --resident-blocks: those blocks on the GPU, the cache serving the others.
  std::unique_ptr<ResidentBlocks> resident_blocks;
  if (!o.resident_blocks.empty()) {
    if (!has_experts) throw BadInput("--resident-blocks: this model has no MoE blocks");
    try {
      const std::vector<int64_t> blocks = parse_resident_blocks(o.resident_blocks, store->shape().blocks);
      resident_blocks = std::make_unique<ResidentBlocks>(*store, blocks, *source);
    } catch (const std::invalid_argument& error) {
      throw BadInput(std::string("--resident-blocks: ") + error.what());
    }
  }
  // A dense model reads no experts; the resident source of an empty store would do, but none is needed.
  struct NoExperts : ExpertSource {
    bool needs_experts_on_host() const override { return false; }
    ExpertTables acquire(int64_t, std::span<const int32_t>, cudaStream_t) override {
      throw std::logic_error("a dense model has no experts");
    }
    void release(int64_t, cudaStream_t) override {}
  };
  if (!source) source = std::make_unique<NoExperts>();
  ExpertSource& served = resident_blocks ? static_cast<ExpertSource&>(*resident_blocks) : *source;

  // --run-dir: the source wrapped so that each step's copies, waits and phases are timed.
  std::optional<moe::RunWriter> writer;
  std::unique_ptr<RecordedExpertSource> recorded;
  if (o.run_dir) {
    moe::RunInfo info;
    info.kind = moe::RunKind::infer;
    info.name = std::filesystem::path(*o.run_dir).filename().string();
    if (has_experts) info.moe_config = config.moe;
    info.model = {{"layers", config.num_layers}, {"model_dim", config.model_dim}, {"heads", config.num_heads},
                  {"seq_len", S}, {"pregated", config.pregated},
                  {"moe_blocks", config.moe_layers == moe::MoeLayers::none ? "none"
                                 : config.moe_layers == moe::MoeLayers::every_block ? "every_block" : "every_other_block"}};
    info.devices = {current_device().name};
    info.extra = {{"program", "moe_generate"}, {"weights", loaded.source.string()}, {"mode", std::string(to_string(o.mode))},
                  {"batch", o.batch}, {"prompt_bytes", P}, {"max_new_bytes", o.max_new_bytes},
                  {"cache_slots", offloaded != nullptr ? offloaded->cache().slots() : device_cache != nullptr ? device_cache->slots() : 0},
                  {"slot_table", device_cache != nullptr ? "device" : "host"},
                  {"resident_blocks", resident_blocks ? resident_blocks->blocks() : std::vector<int64_t>{}},
                  {"cache_policy", to_string(o.cache_policy)}, {"host_experts", std::string(to_string(o.host_experts))},
                  {"temperature", o.sampling.temperature},
                  {"top_k", o.sampling.top_k}, {"seed", o.sampling.seed},
                  {"steps", "step 0 is the prefill, then one decode step per generated byte"}};
    try {
      writer.emplace(moe::RunWriter::create(*o.run_dir, info, moe::OnExisting::overwrite));
    } catch (const moe::RecordError& error) {
      throw BadInput(std::string("--run-dir: ") + error.what());
    }
    recorded = device_cache != nullptr ? std::make_unique<RecordedExpertSource>(served, *device_cache, *writer)
                                       : std::make_unique<RecordedExpertSource>(served, offloaded, *writer);
  }
  ExpertSource& model_source = recorded ? static_cast<ExpertSource&>(*recorded) : served;
  // A stream of the model's own (the legacy default stream cannot be captured into a graph),
  // destroyed after the model.
  struct OwnedStream {
    cudaStream_t stream = nullptr;
    OwnedStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
    ~OwnedStream() { cudaStreamDestroy(stream); }
  } owned_stream;
  const cudaStream_t stream = owned_stream.stream;
  InferenceModelGpu model(config, loaded.weights, model_source, o.mode, stream);
  model.set_decode_graph(o.graph);
  if (recorded) model.set_phase_timer(&recorded->phase_timer());
  std::fprintf(stderr,
               "moe_generate: %s on %s: D=%lld L=%lld S=%lld, MoE %s E=%lld K=%lld%s, mode %s, batch %lld, "
               "temperature %g, top-k %lld, seed %llu\n",
               loaded.source.string().c_str(), current_device().name.c_str(), (long long)config.model_dim,
               (long long)config.num_layers, (long long)S,
               config.moe_layers == moe::MoeLayers::none ? "none" : config.moe_layers == moe::MoeLayers::every_block ? "every block" : "every other block",
               (long long)config.moe.num_experts, (long long)config.moe.top_k, config.pregated ? ", pre-gated" : "",
               std::string(to_string(o.mode)).c_str(), (long long)o.batch, o.sampling.temperature,
               (long long)o.sampling.top_k, (unsigned long long)o.sampling.seed);

  // Sequence 0 as it comes, byte by byte.
  std::fwrite(std::string(prompt.begin(), prompt.end()).data(), 1, prompt.size(), stdout);
  std::fflush(stdout);
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point first = start, last = start;
  if (recorded) recorded->begin_step(stream);
  const Generation generation =
      generate(model, std::vector<std::vector<int32_t>>(size_t(o.batch), prompt), o.max_new_bytes, o.sampling,
               [&](int64_t step, const std::vector<int32_t>& bytes) {
                 std::fputc(bytes[0], stdout);
                 std::fflush(stdout);
                 (step == 0 ? first : last) = Clock::now();
                 if (recorded) {  // step `step` has run (0: the prefill); the next one is fed this byte
                   recorded->end_step();
                   if (step + 1 < o.max_new_bytes) recorded->begin_step(stream);
                 }
               });
  if (recorded) {
    recorded->write(generation.steps, model.moe_blocks());
    std::string text(prompt.begin(), prompt.end());
    for (int32_t byte : generation.bytes[0]) text.push_back(static_cast<char>(byte));
    for (char& c : text) {  // JSON strings are UTF-8: other bytes are shown as '?'
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\n') || static_cast<unsigned char>(c) >= 0x7f) c = '?';
    }
    writer->append({{"type", "table"}, {"name", "generated text"}, {"columns", {"sequence", "text"}},
                    {"rows", {{0, text}}}});
    writer->close();
    std::fprintf(stderr, "moe_generate: run record in %s (%lld steps)\n", o.run_dir->c_str(),
                 (long long)recorded->steps_kept());
  }
  std::fputc('\n', stdout);
  for (int64_t n = 1; n < o.batch; ++n) {
    std::printf("--- sequence %lld (seed %llu) ---\n", (long long)n, (unsigned long long)(o.sampling.seed + n));
    std::string text(prompt.begin(), prompt.end());
    for (int32_t byte : generation.bytes[size_t(n)]) text.push_back(static_cast<char>(byte));
    std::printf("%s\n", text.c_str());
  }
  std::fflush(stdout);

  // ---- the summary ----
  const double prefill_ms = std::chrono::duration<double, std::milli>(first - start).count();
  const int64_t decode_steps = o.max_new_bytes - 1;
  const double decode_ms = decode_steps > 0 ? std::chrono::duration<double, std::milli>(last - first).count() : 0.0;
  std::fprintf(stderr,
               "moe_generate: prefill %lld x %lld bytes %.2f ms; %lld decode steps %.3f ms each (%.0f bytes/s, %s)\n",
               (long long)o.batch, (long long)P, prefill_ms, (long long)decode_steps,
               decode_steps > 0 ? decode_ms / double(decode_steps) : 0.0,
               decode_ms > 0 ? 1e3 * double(decode_steps * o.batch) / decode_ms : 0.0,
               model.decode_graph_applies() ? "one CUDA graph a step" : "launched");
  // What each MoE block used over the decode steps, and how often the schedule's prefetches were used.
  for (size_t j = 0; j < model.moe_blocks().size(); ++j) {
    int64_t used = 0, prefetched = 0, prefetched_used = 0;
    for (size_t step = 1; step < generation.steps.size(); ++step) {
      const MoeBlockStep& b = generation.steps[step].moe[j];
      used += int64_t(b.experts.size());
      prefetched += int64_t(b.prefetched.size());
      for (int32_t e : b.prefetched) prefetched_used += std::binary_search(b.experts.begin(), b.experts.end(), e);
    }
    std::fprintf(stderr, "  MoE block %lld (layer %lld): %.2f experts per step", (long long)j,
                 (long long)model.moe_blocks()[j], decode_steps > 0 ? double(used) / double(decode_steps) : 0.0);
    if (prefetched > 0) {
      std::fprintf(stderr, ", prefetch accuracy %.3f (%lld of %lld used)", double(prefetched_used) / double(prefetched),
                   (long long)prefetched_used, (long long)prefetched);
    }
    std::fputc('\n', stderr);
  }
  if (resident_blocks) {
    std::string list;
    for (const int64_t block : resident_blocks->blocks()) list += (list.empty() ? "" : ",") + std::to_string(block);
    std::fprintf(stderr, "  resident MoE blocks %s: %s of experts on the GPU, never copied (the cache below serves "
                 "the others)\n", list.c_str(), gigabytes(double(resident_blocks->device_bytes())).c_str());
  }
  if (device_cache != nullptr) {
    const BlockOffloadStatistics total = device_cache->statistics().total();
    std::fprintf(stderr,
                 "  expert cache, slot table on the device: %lld slots, hits %lld, misses %lld (hit rate %.3f), "
                 "%lld prefetched (%lld used, %lld dropped), %s copied\n",
                 (long long)device_cache->slots(), (long long)total.hits, (long long)total.misses, total.hit_rate(),
                 (long long)total.prefetched, (long long)total.prefetched_used, (long long)total.prefetch_dropped,
                 gigabytes(double(total.bytes_copied)).c_str());
  }
  if (offloaded != nullptr) {
    const BlockOffloadStatistics total = offloaded->statistics().total();
    std::fprintf(stderr,
                 "  expert cache: %lld slots (%s), hits %lld, misses %lld (hit rate %.3f), %s copied at %.1f GB/s, "
                 "stalls %.2f ms\n",
                 (long long)offloaded->cache().slots(), to_string(o.cache_policy).c_str(), (long long)total.hits,
                 (long long)total.misses, total.hit_rate(), gigabytes(double(total.bytes_copied)).c_str(),
                 total.copy_gb_per_s(), total.stall_ms);
    if (o.host_experts != HostExperts::off) {
      int64_t on_host = 0;
      double host_ms = 0;
      for (size_t step = 1; step < generation.steps.size(); ++step) {
        for (const MoeBlockStep& b : generation.steps[step].moe) on_host += int64_t(b.on_host.size()), host_ms += b.host_ms;
      }
      const HostExpertCosts& costs = offloaded->host_costs();
      std::fprintf(stderr, "  host experts (%s, %d threads): %lld computed on the host in the decode steps, %.2f ms",
                   std::string(to_string(o.host_experts)).c_str(), offloaded->host_threads(), (long long)on_host,
                   host_ms);
      if (!costs.host_ms.empty()) {
        std::fprintf(stderr, "; measured at start-up: a copy %.3f ms, the host %.3f ms at one row, a block's round trip "
                     "to the host %.3f ms, the GPU's time per MoE block %.3f ms%s", costs.copy_ms, costs.host_ms[0],
                     costs.host_block_ms, costs.gpu_block_ms,
                     costs.gpu_block_ms > 0 ? " (the gpu_only step over the MoE blocks)" : " (not measured: the experts do not fit beside the cache, or the context is too short)");
      }
      std::fputc('\n', stderr);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const BadInput& error) {
    std::fprintf(stderr, "moe_generate: %s\n", error.what());
    return 2;
  } catch (const moe::SafetensorsError& error) {  // names the file and the fault
    std::fprintf(stderr, "moe_generate: %s\n", error.what());
    return 2;
  } catch (const moe::CheckpointError& error) {  // names the file and the fault
    std::fprintf(stderr, "moe_generate: %s\n", error.what());
    return 2;
  } catch (const std::exception& error) {  // CudaError, CublasError, out of memory: a failure on the GPU
    std::fprintf(stderr, "moe_generate: %s\n", error.what());
    return 1;
  }
}
