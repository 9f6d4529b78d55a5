// offload/offloaded_experts.cpp: the offloading ExpertSource (see offloaded_experts.h).
#include "offload/offloaded_experts.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

int64_t cache_slots_of(const OffloadOptions& options, size_t expert_bytes) {
  const bool in_slots = options.cache_slots != 0;
  const bool in_megabytes = options.cache_megabytes != 0;
  if (in_slots == in_megabytes) {
    throw std::invalid_argument("offloaded experts: give the expert cache's size in slots or in MB (exactly one), got " +
                                std::to_string(options.cache_slots) + " slots and " +
                                std::to_string(options.cache_megabytes) + " MB");
  }
  if (in_slots) {
    if (options.cache_slots < 0) {
      throw std::invalid_argument("offloaded experts: cache_slots must be > 0, got " +
                                  std::to_string(options.cache_slots));
    }
    return options.cache_slots;
  }
  return cache_slots_in_megabytes(options.cache_megabytes, expert_bytes);
}

namespace {
double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

namespace {
CpuExpertShape cpu_shape_of(const ExpertShape& shape) {
  const bool swiglu = shape.w1_width() == 2 * shape.hidden;
  return CpuExpertShape{shape.d_model, shape.hidden, swiglu ? CpuExpertActivation::swiglu : CpuExpertActivation::gelu};
}

template <typename Work>
double median_ms(int repeats, Work&& work) {
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) times.push_back(work());
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}
}  // namespace

HostExpertCosts measure_host_expert_costs(const PinnedExpertStore& store, CpuExpert& expert, int64_t max_rows) {
  if (max_rows < 1) throw std::invalid_argument("measure_host_expert_costs: max_rows must be >= 1");
  HostExpertCosts costs;
  const size_t bytes = store.expert_bytes();
  const int64_t experts = store.shape().blocks * store.shape().experts;
  DeviceBuffer<bf16> target(static_cast<size_t>(store.shape().expert_elements()));
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, end = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&end));
  int64_t next = 0;
  auto copy_one = [&] {  // the next expert of the store into the GPU buffer, on the stream
    const int64_t e = next++ % experts;
    CUDA_CHECK(cudaMemcpyAsync(target.data(), store.expert(e / store.shape().experts, int32_t(e % store.shape().experts)),
                               bytes, cudaMemcpyHostToDevice, stream));
  };
  // One expert over PCIe, timed on the GPU: the median of 5.
  costs.copy_ms = median_ms(5, [&] {
    CUDA_CHECK(cudaEventRecord(start, stream));
    copy_one();
    CUDA_CHECK(cudaEventRecord(end, stream));
    CUDA_CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
    return double(ms);
  });
  // The host's FFN by rows, measured as it runs in a decode step: beside a copy of another expert
  // (both read host memory), the median of 3 after one untimed call (the workers awake, the pages
  // touched). Expert 0 of block 0 is read each time: larger than the caches at the sizes where the
  // choice matters, so each call reads it from memory.
  const int64_t D = store.shape().d_model;
  const auto* weights = reinterpret_cast<const uint16_t*>(store.expert(0, 0));
  const std::span<const uint16_t> w(weights, static_cast<size_t>(store.shape().expert_elements()));
  for (int64_t rows = 1; rows <= max_rows; ++rows) {
    std::vector<float> x(static_cast<size_t>(rows * D), 0.01f), y(x.size());
    expert.forward(w, x, rows, y);
    costs.host_ms.push_back(median_ms(3, [&] {
      copy_one();
      const auto begin = std::chrono::steady_clock::now();
      expert.forward(w, x, rows, y);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
      CUDA_CHECK(cudaStreamSynchronize(stream));
      return ms;
    }));
  }
  // What a block pays once for the host path (host_block_ms): its rows' round trip, a read-back and
  // an upload each waited for, as the decoder does; and waking the host's threads after a pause as
  // long as a few decode blocks (2 ms). The wake-up is the pool's, not the expert's: it is timed on
  // a tiny expert with as many threads, woken against awake (at the real expert's size the
  // difference would drown in the call's own spread).
  {
    std::vector<float> x(static_cast<size_t>(max_rows * D), 0.01f), y(x.size());
    DeviceBuffer<float> rows_on_gpu(x.size());
    const double round_trip = median_ms(5, [&] {
      const auto begin = std::chrono::steady_clock::now();
      CUDA_CHECK(cudaMemcpyAsync(x.data(), rows_on_gpu.data(), x.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaMemcpyAsync(rows_on_gpu.data(), y.data(), y.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    });
    const CpuExpertShape tiny_shape{8, 64, CpuExpertActivation::gelu};
    CpuExpert tiny(tiny_shape, expert.threads());
    const std::vector<uint16_t> tiny_weights(static_cast<size_t>(tiny_shape.weight_elements()), 0);
    std::vector<float> tiny_x(8, 0.01f), tiny_y(8);
    auto tiny_call = [&](bool after_pause) {
      if (after_pause) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const auto begin = std::chrono::steady_clock::now();
      tiny.forward(tiny_weights, tiny_x, 1, tiny_y);
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    };
    const double awake = median_ms(5, [&] { return tiny_call(false); });
    const double woken = median_ms(5, [&] { return tiny_call(true); });
    costs.host_block_ms = round_trip + std::max(woken - awake, 0.0);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaStreamDestroy(stream);
  return costs;
}

OffloadedExperts::OffloadedExperts(const PinnedExpertStore& store, const OffloadOptions& options)
    : store_(store),
      cache_(store, cache_slots_of(options, store.expert_bytes()), options.policy, options.max_tokens_per_step,
             options.top_k, options.time_copies),
      poison_(static_cast<size_t>(store.shape().expert_elements())),
      experts_(store.shape().experts) {
  const int64_t blocks = store.shape().blocks;
  // The table ring. A block's tables are read twice after acquire returns, both later on the GPU:
  // the staging pair by the table copy when the compute stream reaches it, the device pair by the
  // block's kernels until release. Rewriting either sooner would change a table under work in
  // flight, so an entry is reused only once the event recorded at its release has completed.
  // Two decoding steps of entries (2 * blocks) make that wait a formality: a decoding host reads
  // each block's routing back from the GPU, so it never runs more than one block ahead.
  const int64_t entries = 2 * blocks;
  ring_.resize(static_cast<size_t>(entries));
  for (TableEntry& entry : ring_) CUDA_CHECK(cudaEventCreateWithFlags(&entry.released, cudaEventDisableTiming));
  const size_t table_values = static_cast<size_t>(entries * 2 * experts_);
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&staging_), table_values * sizeof(const bf16*),
                           cudaHostAllocDefault));
  device_tables_ = DeviceBuffer<const bf16*>(table_values);
  entry_of_block_.assign(static_cast<size_t>(blocks), -1);
  host_block_pending_ms_.assign(static_cast<size_t>(blocks), 0.0);
  slot_addresses_.resize(static_cast<size_t>(experts_));
  // 0xFF bytes are bf16 0xFFFF: a NaN. The legacy-stream memset must finish before any non-blocking
  // stream reads the poison: wait once, here.
  poison_.fill_bytes(0xFF);
  CUDA_CHECK(cudaDeviceSynchronize());
  host_mode_ = options.host_experts;
  if (host_mode_ != HostExperts::off) {
    const int threads = options.host_threads == 0 ? int(std::max(1u, std::thread::hardware_concurrency()))
                                                  : options.host_threads;
    cpu_ = std::make_unique<CpuExpert>(cpu_shape_of(store.shape()), threads);  // checks the thread count
    costs_ = options.costs;
    if (host_mode_ == HostExperts::cost_model && costs_.host_ms.empty()) {
      // Rows a step can give one expert: the tokens of a decode step (a prefill's are extrapolated).
      costs_ = measure_host_expert_costs(store, *cpu_, std::clamp<int64_t>(options.max_tokens_per_step, 1, 8));
      costs_.gpu_block_ms = options.gpu_block_ms;
    }
  }
}

OffloadedExperts::~OffloadedExperts() {
  // Tables still being read or copied must not be freed under the GPU. No throw from a destructor.
  cudaDeviceSynchronize();
  for (TableEntry& entry : ring_) cudaEventDestroy(entry.released);
  if (staging_ != nullptr) cudaFreeHost(staging_);
}

int64_t OffloadedExperts::take_table_entry(double& host_wait_ms) {
  const auto entries = static_cast<int64_t>(ring_.size());
  int64_t index = next_entry_;
  while (ring_[static_cast<size_t>(index)].holder >= 0) index = (index + 1) % entries;  // entries > blocks
  next_entry_ = (index + 1) % entries;
  TableEntry& entry = ring_[static_cast<size_t>(index)];
  if (entry.recorded) {
    const cudaError_t status = cudaEventQuery(entry.released);
    if (status == cudaErrorNotReady) {
      const auto start = std::chrono::steady_clock::now();
      CUDA_CHECK(cudaEventSynchronize(entry.released));  // the host ran two steps ahead of the GPU
      host_wait_ms += milliseconds_since(start);
    } else {
      CUDA_CHECK(status);
    }
  }
  return index;
}

ExpertTables OffloadedExperts::acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) {
  const auto start = std::chrono::steady_clock::now();
  // The cache checks the input before it changes anything; then the copies of the misses are on
  // their way while the tables are written.
  cache_.validate(block, experts);  // sorted, unique, in [0, E): at most E of them
  const std::span<const bf16*> addresses(slot_addresses_.data(), experts.size());
  // The caller waited on the GPU before this block: for the copies the last block waited for, and
  // for the GPU's own work in between.
  host_clock_ms_ = std::max(host_clock_ms_ + costs_.gpu_block_ms, gpu_waits_until_ms_);
  cache_.acquire(block, experts, addresses);
  count_copies();
  gpu_waits_until_ms_ = copy_clock_ms_;  // the block's kernels wait for every copy enqueued so far

  double host_wait_ms = 0;
  const int64_t index = take_table_entry(host_wait_ms);
  TableEntry& entry = ring_[static_cast<size_t>(index)];
  entry.holder = block;
  entry_of_block_[static_cast<size_t>(block)] = index;

  const bf16** w1 = staging_ + index * 2 * experts_;  // [E]
  const bf16** w2 = w1 + experts_;                    // [E]
  const int64_t w1_elements = store_.shape().w1_elements();
  for (int64_t e = 0; e < experts_; ++e) {
    w1[e] = poison_.data();
    w2[e] = poison_.data() + w1_elements;
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    w1[experts[i]] = addresses[i];
    w2[experts[i]] = addresses[i] + w1_elements;
  }
  const bf16** device = device_tables_.data() + index * 2 * experts_;
  // On the compute stream: ordered after every earlier reader of this entry and before the block's
  // kernels; it runs while the compute stream would otherwise wait for the copies below.
  CUDA_CHECK(cudaMemcpyAsync(device, w1, static_cast<size_t>(2 * experts_) * sizeof(const bf16*),
                             cudaMemcpyHostToDevice, compute));
  cache_.wait_for_copies(block, compute);
  cache_.record_host_time(block, milliseconds_since(start), host_wait_ms);
  return ExpertTables{device, device + experts_};
}

void OffloadedExperts::count_copies() {
  const int64_t enqueued = cache_.copies_enqueued();
  if (enqueued == copies_counted_) return;
  copy_clock_ms_ = std::max(copy_clock_ms_, host_clock_ms_) + double(enqueued - copies_counted_) * costs_.copy_ms;
  copies_counted_ = enqueued;
}

void OffloadedExperts::release(int64_t block, cudaStream_t compute) {
  cache_.release(block, compute);  // checks the block and that it was acquired
  const int64_t index = entry_of_block_[static_cast<size_t>(block)];
  TableEntry& entry = ring_[static_cast<size_t>(index)];
  CUDA_CHECK(cudaEventRecord(entry.released, compute));
  entry.recorded = true;
  entry.holder = -1;
  entry_of_block_[static_cast<size_t>(block)] = -1;
}

void OffloadedExperts::prefetch(int64_t block, std::span<const int32_t> experts) {
  cache_.prefetch(block, experts);
  count_copies();
}

ExpertSource::HostPick OffloadedExperts::choose_host_experts(int64_t block, std::span<const int32_t> experts,
                                                             std::span<const int64_t> rows, bool chosen_ahead) {
  if (host_mode_ == HostExperts::off) return {};
  cache_.validate(block, experts);
  if (rows.size() != experts.size()) {
    throw std::invalid_argument("offloaded experts: " + std::to_string(experts.size()) + " experts but " +
                                std::to_string(rows.size()) + " row counts");
  }
  std::vector<int32_t> misses;
  std::vector<int64_t> miss_rows;
  for (size_t i = 0; i < experts.size(); ++i) {
    if (!cache_.slot_map().find(block, experts[i])) {
      misses.push_back(experts[i]);
      miss_rows.push_back(rows[i]);
    }
  }
  HostPick pick;
  if (!chosen_ahead) host_clock_ms_ = std::max(host_clock_ms_, gpu_waits_until_ms_);
  const Backlogs backlogs{std::max(copy_clock_ms_ - host_clock_ms_, 0.0), host_pending_ms_};
  pick.experts = moe::cuda::choose_host_experts(host_mode_, misses, miss_rows, costs_, backlogs);
  if (!costs_.host_ms.empty()) {
    for (size_t i = 0; i < misses.size(); ++i) {
      if (std::binary_search(pick.experts.begin(), pick.experts.end(), misses[i])) {
        pick.host_ms += costs_.host_ms_at(miss_rows[i]);
      }
    }
    if (!pick.experts.empty()) {  // the block's round trip to the host, paid once
      pick.host_ms += costs_.host_block_ms;
      host_block_pending_ms_[static_cast<size_t>(block)] = costs_.host_block_ms;
    }
  }
  host_pending_ms_ += pick.host_ms;
  return pick;
}

void OffloadedExperts::host_forward(int64_t block, int32_t expert, std::span<const float> x, int64_t rows,
                                    std::span<float> y) {
  if (!cpu_) throw std::logic_error("offloaded experts: host experts are off (OffloadOptions::host_experts)");
  const std::span<const uint16_t> weights(reinterpret_cast<const uint16_t*>(store_.expert(block, expert)),
                                          static_cast<size_t>(store_.shape().expert_elements()));
  cpu_->forward(weights, x, rows, y);
  if (!costs_.host_ms.empty()) {
    double& round_trip = host_block_pending_ms_[static_cast<size_t>(block)];  // the block's first host expert pays it
    const double predicted = costs_.host_ms_at(rows) + round_trip;
    round_trip = 0;
    host_clock_ms_ += predicted;
    host_pending_ms_ = std::max(host_pending_ms_ - predicted, 0.0);
  }
}

}  // namespace moe::cuda
