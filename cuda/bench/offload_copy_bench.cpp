// offload_copy_bench.cpp: how fast experts cross PCIe through the expert cache, beside the plain
// pinned host-to-device bandwidth measured in the same run.
//
// Pre-gated MoE (Hwang et al., ISCA 2024) hides expert copies behind compute only when they run at
// the link's rate: an expert of a GeLU FFN is 4*D*H bytes (9.4 MB at D=768, H=3072; 235 MB at
// D=4096, H=14336), 0.17 ms and 4.3 ms at 55 GB/s. This program measures, with CUDA events:
//   pinned_copy       one cudaMemcpyAsync of --big-mib MiB from pinned memory: the ceiling
//   raw_expert        one cudaMemcpyAsync of one expert's bytes: what the size alone costs
//   cache_1_expert    OffloadedExperts::acquire of one missing expert (decoding, batch 1, top-1):
//                     the copy, the wait before overwriting an evicted slot, the table upload and
//                     the compute stream's wait, from the compute stream's point of view
//   cache_N_experts   the same with N missing experts per acquire (a larger batch)
// The rows take turns: --rounds rounds, in each every row runs --warmup untimed then --repeat timed
// runs back to back; a row's figure is the median of its rounds x repeat runs (4 x 5 = 20), so
// that a neighbour's PCIe traffic on a shared machine touches every row alike. Printed: GB/s and
// the ratio to pinned_copy (the target: expert copies at >= 90% of it). The cache rows walk a cycle
// of twice the cache's experts, so every expert of every acquire is a miss; one more acquire of
// each is compared byte for byte with the store (the verdict line).
//
// Build: cmake -S . -B build-offload -G Ninja -DMOE_ENABLE_VIEWER=OFF && cmake --build build-offload --target offload_copy_bench
// Run:   build-offload/cuda/bench/offload_copy_bench [--rounds 4] [--repeat 5] [--warmup 3] [--big-mib 1024] [--out FILE.json]
// Pinned host memory: --big-mib MiB + 32 experts of 9.4 MB + 8 of 235 MB (about 3.2 GB by default).
//
// Dimension legend: D model width, H expert hidden width, E experts per MoE block.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.h"                 // CLI::App, parse_command_line, whole_number
#include "core/bench_support.h"           // median, utc_now, write_results
#include "core/cuda_check.h"              // CUDA_CHECK
#include "core/device_buffer.h"           // DeviceBuffer
#include "core/device_info.h"             // fail_without_gpu, current_device
#include "offload/offloaded_experts.h"    // OffloadedExperts, OffloadOptions
#include "offload/pinned_expert_store.h"  // PinnedExpertStore, ExpertShape
#include "program_exit.h"                  // check_output_path

namespace {

using moe::cuda::bf16;
using moe::cuda::median;
using moe::cuda::utc_now;
using nlohmann::json;

constexpr double kTargetRatio = 0.90;

struct Options {
  int rounds = 4;
  int repeat = 5;
  int warmup = 3;
  int64_t big_mib = 1024;
  std::string out;
};

// The flags into `options`; the exit status when the program should stop here (--help, a bad flag).
std::optional<int> parse_options(int argc, char** argv, Options& options) {
  CLI::App app{"offload_copy_bench: expert copies through the expert cache beside the pinned host-to-device bandwidth",
               "offload_copy_bench"};
  const int most = std::numeric_limits<int>::max();
  app.add_option("--rounds", options.rounds, "rounds over all rows, interleaved")->capture_default_str()
      ->check(moe::whole_number(1, most));
  app.add_option("--repeat", options.repeat, "timed runs per row and round; the median of rounds x repeat is reported")
      ->capture_default_str()->check(moe::whole_number(1, most));
  app.add_option("--warmup", options.warmup, "untimed runs of a row before its timed runs in each round")
      ->capture_default_str()->check(moe::whole_number(0, most));
  app.add_option("--big-mib", options.big_mib, "the size of the one big pinned copy, the ceiling")->capture_default_str()
      ->check(moe::whole_number(1, most));
  app.add_option("--out", options.out, "also write the results as JSON, with the device and the date");
  return moe::parse_command_line(app, argc, argv);
}

// A row of the table: one kind of run, enqueued on the compute stream and timed in every round.
struct Row {
  std::string name;
  std::string shape;                  // "D=768 H=3072", or the big copy's size
  int64_t bytes = 0;                  // per run
  std::function<void(int)> enqueue;   // run i of the row (cache rows walk their cycle with i)
  int first_warmup = 0;               // warm-up runs before the first round
  moe::cuda::OffloadedExperts* source = nullptr;  // cache rows: the source whose copies are timed
  int runs = 0;                       // runs enqueued so far, warm-up included
  std::vector<double> times;          // ms of every timed run of every round
  int64_t copy_bytes = 0;             // cache rows: bytes and GPU time of their timed runs' copies
  double copy_ms = 0;

  double median_ms() const { return median(times); }
  double gb_per_s() const { return static_cast<double>(bytes) / (median_ms() * 1e-3) / 1e9; }
  double copy_events_gb_per_s() const {
    return copy_ms > 0 ? static_cast<double>(copy_bytes) / (copy_ms * 1e-3) / 1e9 : 0.0;
  }
};

// ---- timing ----

// `warmup` untimed runs, then `repeat` runs back to back on `stream`, each between two events
// recorded there; one host wait at the end. Appends the times to row.times.
void time_row(Row& row, int warmup, int repeat, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) row.enqueue(row.runs++);
  if (row.source != nullptr) row.source->reset_statistics();  // count the timed runs' copies only
  std::vector<cudaEvent_t> events(static_cast<size_t>(2 * repeat));
  for (cudaEvent_t& event : events) CUDA_CHECK(cudaEventCreate(&event));
  for (int i = 0; i < repeat; ++i) {
    CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(2 * i)], stream));
    row.enqueue(row.runs++);
    CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(2 * i + 1)], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int i = 0; i < repeat; ++i) {
    float milliseconds = 0;
    CUDA_CHECK(cudaEventElapsedTime(&milliseconds, events[static_cast<size_t>(2 * i)], events[static_cast<size_t>(2 * i + 1)]));
    row.times.push_back(milliseconds);
  }
  for (cudaEvent_t event : events) CUDA_CHECK(cudaEventDestroy(event));
  if (row.source != nullptr) {
    const moe::cuda::BlockOffloadStatistics statistics = row.source->statistics().total();
    if (statistics.hits != 0) throw std::logic_error(row.name + ": an acquire hit the cache; every one should miss");
    row.copy_bytes += statistics.bytes_copied;
    row.copy_ms += statistics.copy_ms;
  }
}

// ---- expert copies through the cache ----

// One MoE block of 2N experts and a cache of N slots. Run i of a row of p experts per acquire takes
// experts [i*p mod 2N, + p): a cycle twice the cache's size, so under LRU every expert of every
// acquire is a miss, copied on demand into a slot an earlier acquire used.
struct CacheBench {
  int64_t slots;                                  // N
  std::unique_ptr<moe::cuda::PinnedExpertStore> store;
  std::vector<std::unique_ptr<moe::cuda::OffloadedExperts>> sources;  // one per row, empty slots each

  std::vector<int32_t> experts_of(int run, int64_t per_acquire) const {
    std::vector<int32_t> experts(static_cast<size_t>(per_acquire));
    const int64_t first = (run * per_acquire) % (2 * slots);
    for (int64_t j = 0; j < per_acquire; ++j) experts[static_cast<size_t>(j)] = static_cast<int32_t>(first + j);
    return experts;
  }
};

// The slots behind the tables of `experts` hold the store's bytes exactly.
bool slots_match_store(const moe::cuda::PinnedExpertStore& store, moe::cuda::ExpertTables tables,
                       const std::vector<int32_t>& experts, cudaStream_t stream) {
  const int64_t experts_per_block = store.shape().experts;
  std::vector<const bf16*> w1(static_cast<size_t>(experts_per_block));
  CUDA_CHECK(cudaMemcpyAsync(w1.data(), tables.w1, w1.size() * sizeof(const bf16*), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned char> slot(store.expert_bytes());
  for (const int32_t e : experts) {
    CUDA_CHECK(cudaMemcpyAsync(slot.data(), w1[static_cast<size_t>(e)], slot.size(), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    if (std::memcmp(slot.data(), store.expert(0, e), slot.size()) != 0) return false;
  }
  return true;
}

void print_row(const Row& row, double pinned_gb_per_s) {
  std::printf("%-18s %-16s %12.1f %10.3f %9.1f %7.3f", row.name.c_str(), row.shape.c_str(),
              static_cast<double>(row.bytes) / 1e6, row.median_ms(), row.gb_per_s(), row.gb_per_s() / pinned_gb_per_s);
  if (row.copy_events_gb_per_s() > 0) std::printf(" %16.1f", row.copy_events_gb_per_s());
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    if (const std::optional<int> exit_status = parse_options(argc, argv, options)) return *exit_status;
    if (!options.out.empty()) moe::check_output_path("--out", options.out);  // before the timings, not after
  } catch (const std::exception& error) {
    std::fprintf(stderr, "offload_copy_bench: %s\n", error.what());
    return 2;
  }
  if (const std::optional<int> no_gpu = moe::cuda::fail_without_gpu()) return *no_gpu;
  try {
    const moe::cuda::DeviceInfo device = moe::cuda::current_device();
    std::printf("offload_copy_bench on %s, %s: %d rounds of every row, %d timed runs each after %d warm-up runs; "
                "medians of %d runs\n", device.name.c_str(), utc_now("%Y-%m-%d").c_str(), options.rounds,
                options.repeat, options.warmup, options.rounds * options.repeat);
    cudaStream_t compute = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));

    // The ceiling: one big copy from pinned memory.
    const size_t big_bytes = static_cast<size_t>(options.big_mib) << 20;
    moe::cuda::check_pinned_request(big_bytes, moe::cuda::host_memory_available());
    unsigned char* pinned = nullptr;
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&pinned), big_bytes, cudaHostAllocDefault));
    std::memset(pinned, 1, big_bytes);
    moe::cuda::DeviceBuffer<unsigned char> device_buffer(big_bytes);
    std::vector<Row> rows;
    Row big;
    big.name = "pinned_copy";
    big.shape = std::to_string(options.big_mib) + " MiB";
    big.bytes = static_cast<int64_t>(big_bytes);
    big.enqueue = [&](int) {
      CUDA_CHECK(cudaMemcpyAsync(device_buffer.data(), pinned, big_bytes, cudaMemcpyHostToDevice, compute));
    };
    rows.push_back(big);

    struct ExpertSize {
      int64_t d_model, hidden, slots;
    };
    const ExpertSize sizes[] = {{768, 3072, 16}, {4096, 14336, 4}};
    std::vector<CacheBench> caches;
    caches.reserve(std::size(sizes));
    for (const ExpertSize& size : sizes) {
      const moe::cuda::ExpertShape shape{1, 2 * size.slots, size.d_model, size.hidden, 0};
      caches.push_back(CacheBench{size.slots, std::make_unique<moe::cuda::PinnedExpertStore>(
                                                  moe::cuda::PinnedExpertStore::random(shape, 2024)), {}});
      CacheBench& cache = caches.back();
      const std::string shape_name = "D=" + std::to_string(size.d_model) + " H=" + std::to_string(size.hidden);
      const size_t expert_bytes = cache.store->expert_bytes();
      if (expert_bytes <= big_bytes) {
        Row raw;
        raw.name = "raw_expert";
        raw.shape = shape_name;
        raw.bytes = static_cast<int64_t>(expert_bytes);
        raw.enqueue = [&, expert_bytes](int) {
          CUDA_CHECK(cudaMemcpyAsync(device_buffer.data(), pinned, expert_bytes, cudaMemcpyHostToDevice, compute));
        };
        rows.push_back(raw);
      }
      for (const int64_t per_acquire : {int64_t{1}, size.slots}) {
        moe::cuda::OffloadOptions offload;
        offload.cache_slots = size.slots;
        offload.max_tokens_per_step = size.slots;
        offload.top_k = 1;
        cache.sources.push_back(std::make_unique<moe::cuda::OffloadedExperts>(*cache.store, offload));
        moe::cuda::OffloadedExperts* source = cache.sources.back().get();
        Row row;
        row.name = per_acquire == 1 ? "cache_1_expert" : "cache_" + std::to_string(per_acquire) + "_experts";
        row.shape = shape_name;
        row.bytes = per_acquire * static_cast<int64_t>(expert_bytes);
        row.source = source;
        // Once round the whole cycle first: every expert's pages have been read by the copy engine
        // before the timed runs, as after a decoder's first tokens.
        row.first_warmup = static_cast<int>(2 * size.slots / per_acquire);
        const CacheBench* bench = &cache;
        row.enqueue = [bench, source, per_acquire, compute](int run) {
          const std::vector<int32_t> experts = bench->experts_of(run, per_acquire);
          source->acquire(0, experts, compute);
          source->release(0, compute);
        };
        rows.push_back(row);
      }
    }

    // Rows interleaved round by round: the machine's PCIe is shared, and a neighbour's traffic
    // lasting seconds then touches every row, not one.
    for (int round = 0; round < options.rounds; ++round) {
      for (Row& row : rows) {
        time_row(row, round == 0 ? std::max(options.warmup, row.first_warmup) : options.warmup, options.repeat, compute);
      }
    }
    // The check: one more acquire of each cache row (a miss for each expert), its slots against the store.
    bool bytes_match = true;
    for (Row& row : rows) {
      if (row.source == nullptr) continue;
      const int64_t per_acquire = row.bytes / static_cast<int64_t>(row.source->store().expert_bytes());
      const CacheBench& cache = *std::find_if(caches.begin(), caches.end(), [&](const CacheBench& c) {
        return c.store.get() == &row.source->store();
      });
      const std::vector<int32_t> experts = cache.experts_of(row.runs++, per_acquire);
      const moe::cuda::ExpertTables tables = row.source->acquire(0, experts, compute);
      bytes_match = bytes_match && slots_match_store(row.source->store(), tables, experts, compute);
      row.source->release(0, compute);
    }
    const double pinned_gb_per_s = rows.front().gb_per_s();

    // ratio: GB/s over pinned_copy's. copy-event GB/s: the cache's own events around each copy, so
    // the copies alone, without the slot-reuse waits and the compute stream's view.
    std::printf("%-18s %-16s %12s %10s %9s %7s %16s\n", "row", "shape", "MB per run", "ms", "GB/s", "ratio",
                "copy-event GB/s");
    for (const Row& row : rows) print_row(row, pinned_gb_per_s);
    double worst_ratio = 1e9;
    for (const Row& row : rows) {
      if (row.name.rfind("cache_", 0) == 0) worst_ratio = std::min(worst_ratio, row.gb_per_s() / pinned_gb_per_s);
    }
    const bool target_met = worst_ratio >= kTargetRatio;
    std::printf("expert copies through the cache: at worst %.3f of the pinned bandwidth (%.1f GB/s), target >= %.2f: %s\n",
                worst_ratio, pinned_gb_per_s, kTargetRatio, target_met ? "met" : "NOT met");

    if (!options.out.empty()) {
      json doc;
      doc["program"] = "offload_copy_bench";
      doc["date_utc"] = utc_now("%Y-%m-%dT%H:%M:%SZ");
      doc["device"] = {{"name", device.name},
                       {"compute_capability", device.compute_capability},
                       {"multiprocessors", device.multiprocessors},
                       {"global_memory_bytes", device.global_memory_bytes}};
      doc["method"] = {{"rounds", options.rounds},
                       {"warmup", options.warmup},
                       {"repeat", options.repeat},
                       {"statistic", "median of CUDA-event times of rounds x repeat runs; in each round every row "
                                     "in turn, its runs back to back on one non-blocking stream"}};
      doc["pinned_gb_per_s"] = pinned_gb_per_s;
      json rows_json = json::array();
      for (const Row& row : rows) {
        rows_json.push_back({{"name", row.name},
                             {"shape", row.shape},
                             {"bytes", row.bytes},
                             {"median_ms", row.median_ms()},
                             {"gb_per_s", row.gb_per_s()},
                             {"ratio_to_pinned", row.gb_per_s() / pinned_gb_per_s},
                             {"copy_events_gb_per_s", row.copy_events_gb_per_s()},
                             {"timed_runs", row.times.size()}});
      }
      doc["rows"] = rows_json;
      doc["target_ratio"] = kTargetRatio;
      doc["worst_cache_ratio"] = worst_ratio;
      doc["target_met"] = target_met;
      doc["bytes_match_store"] = bytes_match;
      moe::cuda::write_results(options.out, doc);
    }
    CUDA_CHECK(cudaStreamDestroy(compute));
    CUDA_CHECK(cudaFreeHost(pinned));
    if (!bytes_match) {
      std::printf("FAIL the slots after the cache's copies differ from the pinned store\n");
      return 1;
    }
    std::printf("PASS every checked slot equals the pinned store byte for byte\n");
    return 0;
  } catch (const std::exception& error) {
    std::printf("FAIL %s\n", error.what());
    return 1;
  }
}
