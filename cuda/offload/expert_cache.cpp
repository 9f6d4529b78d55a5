// offload/expert_cache.cpp: GPU expert slots filled on a copy stream (see expert_cache.h).
#include "offload/expert_cache.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

// ---- statistics ----

namespace {

using Statistics = BlockOffloadStatistics;
// Every counter of BlockOffloadStatistics, the one list that add and subtract walk: the counts, then the times.
constexpr int64_t Statistics::* kCounts[] = {&Statistics::acquires,         &Statistics::hits,
                                             &Statistics::misses,           &Statistics::prefetched,
                                             &Statistics::prefetched_used,  &Statistics::prefetch_dropped,
                                             &Statistics::bytes_copied,     &Statistics::copies_timed};
constexpr double Statistics::* kTimes[] = {&Statistics::copy_ms, &Statistics::stall_ms, &Statistics::acquire_host_ms,
                                           &Statistics::host_wait_ms};
static_assert(sizeof(Statistics) == std::size(kCounts) * sizeof(int64_t) + std::size(kTimes) * sizeof(double),
              "a counter of BlockOffloadStatistics is missing from kCounts or kTimes");

// Applies op(counter of into, the same counter of from) to every counter.
template <class Op>
void for_each_counter(Statistics& into, const Statistics& from, Op op) {
  for (auto counter : kCounts) op(into.*counter, from.*counter);
  for (auto counter : kTimes) op(into.*counter, from.*counter);
}

}  // namespace

void BlockOffloadStatistics::add(const BlockOffloadStatistics& other) {
  for_each_counter(*this, other, [](auto& into, auto from) { into += from; });
}

void BlockOffloadStatistics::subtract(const BlockOffloadStatistics& other) {
  for_each_counter(*this, other, [](auto& into, auto from) { into -= from; });
}

double BlockOffloadStatistics::hit_rate() const {
  const int64_t chosen = hits + misses;
  return chosen > 0 ? static_cast<double>(hits) / static_cast<double>(chosen) : 0.0;
}

double BlockOffloadStatistics::prefetch_accuracy() const {
  return prefetched > 0 ? static_cast<double>(prefetched_used) / static_cast<double>(prefetched) : 0.0;
}

double BlockOffloadStatistics::copy_gb_per_s() const {
  return copy_ms > 0 ? static_cast<double>(bytes_copied) / (copy_ms * 1e-3) / 1e9 : 0.0;
}

BlockOffloadStatistics OffloadStatistics::total() const {
  BlockOffloadStatistics sum;
  for (const BlockOffloadStatistics& block : blocks) sum.add(block);
  return sum;
}

// ---- construction ----

namespace {
// The slot count, once it is known to hold the most experts one step may need.
int64_t checked_slots(const PinnedExpertStore& store, int64_t slots, int64_t tokens_per_step, int64_t top_k) {
  const int64_t experts = store.shape().experts;
  check_cache_size(slots, minimum_cache_slots(experts, tokens_per_step, top_k), experts, tokens_per_step, top_k,
                   store.expert_bytes());
  return slots;
}
}  // namespace

ExpertCache::ExpertCache(const PinnedExpertStore& store, int64_t slots, CachePolicy policy,
                         int64_t tokens_per_step, int64_t top_k, bool time_copies)
    : store_(store),
      slot_map_(checked_slots(store, slots, tokens_per_step, top_k), store.shape().blocks, store.shape().experts,
                policy),
      time_copies_(time_copies) {
  pool_ = DeviceBuffer<bf16>(static_cast<size_t>(slots * store.shape().expert_elements()));
  // Non-blocking: the copy stream never synchronises with the legacy default stream, so a copy runs
  // beside whatever the model computes.
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  copied_.resize(static_cast<size_t>(slots));
  for (cudaEvent_t& event : copied_) CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  waited_by_.assign(static_cast<size_t>(slots), std::nullopt);
  last_use_.assign(static_cast<size_t>(slots), -1);
  prefetched_unused_.assign(static_cast<size_t>(slots), false);
  const auto blocks = static_cast<size_t>(store.shape().blocks);
  held_.resize(blocks);
  acquired_.assign(blocks, false);
  statistics_.resize(blocks);
}

ExpertCache::~ExpertCache() {
  // Let the last copies land before their events, stream and slots go. No throw from a destructor.
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  for (const TimedSpan& span : pending_copies_) {
    cudaEventDestroy(span.start);
    cudaEventDestroy(span.end);
  }
  for (const TimedSpan& span : pending_stalls_) {
    cudaEventDestroy(span.start);
    cudaEventDestroy(span.end);
  }
  for (cudaEvent_t event : free_timing_events_) cudaEventDestroy(event);
  for (cudaEvent_t event : release_events_) cudaEventDestroy(event);
  for (cudaEvent_t event : copied_) cudaEventDestroy(event);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
}

// ---- input checks ----

void ExpertCache::validate(int64_t block, std::span<const int32_t> experts) const {
  const ExpertShape& shape = store_.shape();
  if (block < 0 || block >= shape.blocks) {
    throw std::invalid_argument("expert cache: MoE block " + std::to_string(block) + " is outside [0, " +
                                std::to_string(shape.blocks) + ")");
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] < 0 || experts[i] >= shape.experts) {
      throw std::invalid_argument("expert cache: block " + std::to_string(block) + " asks for expert " +
                                  std::to_string(experts[i]) + ", outside [0, E=" + std::to_string(shape.experts) + ")");
    }
    if (i > 0 && experts[i] <= experts[i - 1]) {
      throw std::invalid_argument("expert cache: block " + std::to_string(block) +
                                  "'s experts must be sorted and unique, got " + std::to_string(experts[i - 1]) +
                                  " then " + std::to_string(experts[i]));
    }
  }
}

const bf16* ExpertCache::slot(int64_t slot) const {
  if (slot < 0 || slot >= slots()) {
    throw std::invalid_argument("expert cache: slot " + std::to_string(slot) + " outside [0, " +
                                std::to_string(slots()) + ")");
  }
  return pool_.data() + slot * store_.shape().expert_elements();
}

// ---- events ----

cudaEvent_t ExpertCache::take_timing_event() {
  if (!free_timing_events_.empty()) {
    cudaEvent_t event = free_timing_events_.back();
    free_timing_events_.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreate(&event));  // with timing
  return event;
}

void ExpertCache::harvest_timings(bool wait) {
  auto harvest = [&](std::deque<TimedSpan>& pending) {
    while (!pending.empty()) {
      const TimedSpan& span = pending.front();
      if (wait) {
        CUDA_CHECK(cudaEventSynchronize(span.end));
      } else {
        const cudaError_t status = cudaEventQuery(span.end);
        if (status == cudaErrorNotReady) return;
        CUDA_CHECK(status);
      }
      float milliseconds = 0;
      CUDA_CHECK(cudaEventElapsedTime(&milliseconds, span.start, span.end));
      BlockOffloadStatistics& block = statistics_[static_cast<size_t>(span.block)];
      if (span.is_copy) {
        block.copy_ms += milliseconds;
        ++block.copies_timed;
      } else {
        block.stall_ms += milliseconds;
      }
      free_timing_events_.push_back(span.start);
      free_timing_events_.push_back(span.end);
      pending.pop_front();
    }
  };
  harvest(pending_copies_);
  harvest(pending_stalls_);
}

int ExpertCache::take_release_event() {
  if (!free_release_events_.empty()) {
    const int index = free_release_events_.back();
    free_release_events_.pop_back();
    return index;
  }
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  release_events_.push_back(event);
  release_event_slots_.push_back(0);
  return static_cast<int>(release_events_.size()) - 1;
}

void ExpertCache::drop_release_event(int index) {
  if (index < 0) return;
  if (--release_event_slots_[static_cast<size_t>(index)] == 0) free_release_events_.push_back(index);
}

// ---- copies ----

void ExpertCache::copy_into(int64_t slot, int64_t block, int32_t expert, CopyKind kind) {
  const auto s = static_cast<size_t>(slot);
  ++copies_enqueued_;
  // read -> write: the slot's last readers (enqueued on a compute stream before release) finish
  // before the copy engine overwrites it. A GPU-side wait; the event's record is captured now.
  if (last_use_[s] >= 0) {
    CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, release_events_[static_cast<size_t>(last_use_[s])], 0));
    drop_release_event(last_use_[s]);
    last_use_[s] = -1;
  }
  TimedSpan span{block, true, nullptr, nullptr};
  if (time_copies_) {
    span.start = take_timing_event();
    CUDA_CHECK(cudaEventRecord(span.start, copy_stream_));
  }
  // From pinned memory the copy is truly asynchronous: the copy engine reads the host pages
  // directly while the host goes on.
  CUDA_CHECK(cudaMemcpyAsync(pool_.data() + slot * store_.shape().expert_elements(), store_.expert(block, expert),
                             store_.expert_bytes(), cudaMemcpyHostToDevice, copy_stream_));
  CUDA_CHECK(cudaEventRecord(copied_[s], copy_stream_));  // write -> read: what compute waits on
  waited_by_[s].reset();
  if (time_copies_) {
    span.end = take_timing_event();
    CUDA_CHECK(cudaEventRecord(span.end, copy_stream_));
    pending_copies_.push_back(span);
  }
  slot_map_.assign(slot, block, expert);
  prefetched_unused_[s] = kind == CopyKind::prefetch;
  BlockOffloadStatistics& statistics = statistics_[static_cast<size_t>(block)];
  statistics.bytes_copied += static_cast<int64_t>(store_.expert_bytes());
  if (kind == CopyKind::on_demand) {
    ++statistics.misses;
  } else {
    ++statistics.prefetched;
  }
}

// ---- acquire, wait, release, prefetch ----

void ExpertCache::acquire(int64_t block, std::span<const int32_t> experts, std::span<const bf16*> slot_addresses) {
  validate(block, experts);
  const auto b = static_cast<size_t>(block);
  if (acquired_[b]) {
    throw std::logic_error("expert cache: acquire(block " + std::to_string(block) +
                           ") while the block is still acquired: release it first");
  }
  if (slot_addresses.size() != experts.size()) {
    throw std::invalid_argument("expert cache: slot_addresses has " + std::to_string(slot_addresses.size()) +
                                " entries for " + std::to_string(experts.size()) + " experts");
  }
  const int64_t free_slots = slots() - slot_map_.pinned_slots();
  if (static_cast<int64_t>(experts.size()) > free_slots) {
    throw std::invalid_argument("expert cache: block " + std::to_string(block) + " needs " +
                                std::to_string(experts.size()) + " experts at once but only " +
                                std::to_string(free_slots) + " of the cache's " + std::to_string(slots()) +
                                " slots are not held by other blocks; size the cache with minimum_cache_slots");
  }
  harvest_timings(false);
  BlockOffloadStatistics& statistics = statistics_[b];
  ++statistics.acquires;
  std::vector<int64_t>& held = held_[b];
  held.assign(experts.size(), -1);
  slot_map_.visit(block, experts);
  // Hits first and pinned at once, so that no miss of this block evicts one of them.
  for (size_t i = 0; i < experts.size(); ++i) {
    const std::optional<int64_t> slot = slot_map_.find(block, experts[i]);
    if (!slot) continue;
    held[i] = *slot;
    slot_map_.pin(*slot);
    slot_map_.record_use(*slot);
    ++statistics.hits;
    if (prefetched_unused_[static_cast<size_t>(*slot)]) {
      ++statistics.prefetched_used;
      prefetched_unused_[static_cast<size_t>(*slot)] = false;
    }
  }
  // Misses: on demand, into the policy's victims (never a pinned slot; the check above guarantees one).
  for (size_t i = 0; i < experts.size(); ++i) {
    if (held[i] >= 0) continue;
    const int64_t victim = slot_map_.choose_victim().value();
    copy_into(victim, block, experts[i], CopyKind::on_demand);
    held[i] = victim;
    slot_map_.pin(victim);
    slot_map_.record_use(victim);
  }
  for (size_t i = 0; i < experts.size(); ++i) slot_addresses[i] = slot(held[i]);
  acquired_[b] = true;
}

void ExpertCache::wait_for_copies(int64_t block, cudaStream_t compute) {
  validate(block, {});
  const auto b = static_cast<size_t>(block);
  if (!acquired_[b]) {
    throw std::logic_error("expert cache: wait_for_copies(block " + std::to_string(block) + ") before acquire");
  }
  TimedSpan stall{block, false, nullptr, nullptr};
  for (const int64_t slot : held_[b]) {
    const auto s = static_cast<size_t>(slot);
    if (waited_by_[s] == compute) continue;  // this stream already waited for the slot's last copy
    if (time_copies_ && stall.start == nullptr) {
      stall.start = take_timing_event();
      CUDA_CHECK(cudaEventRecord(stall.start, compute));
    }
    CUDA_CHECK(cudaStreamWaitEvent(compute, copied_[s], 0));
    waited_by_[s] = compute;
  }
  if (stall.start != nullptr) {
    stall.end = take_timing_event();
    CUDA_CHECK(cudaEventRecord(stall.end, compute));
    pending_stalls_.push_back(stall);
  }
}

void ExpertCache::release(int64_t block, cudaStream_t compute) {
  validate(block, {});
  const auto b = static_cast<size_t>(block);
  if (!acquired_[b]) {
    throw std::logic_error("expert cache: release(block " + std::to_string(block) + ") without acquire");
  }
  std::vector<int64_t>& held = held_[b];
  if (!held.empty()) {
    const int event = take_release_event();
    CUDA_CHECK(cudaEventRecord(release_events_[static_cast<size_t>(event)], compute));
    for (const int64_t slot : held) {
      const auto s = static_cast<size_t>(slot);
      drop_release_event(last_use_[s]);  // a later point on the stream supersedes the earlier one
      last_use_[s] = event;
      ++release_event_slots_[static_cast<size_t>(event)];
      slot_map_.unpin(slot);
    }
  }
  held.clear();
  acquired_[b] = false;
}

void ExpertCache::prefetch(int64_t block, std::span<const int32_t> experts) {
  validate(block, experts);
  harvest_timings(false);
  BlockOffloadStatistics& statistics = statistics_[static_cast<size_t>(block)];
  // Each expert of this hint is pinned while the hint is followed, so that a hint larger than the
  // free slots (prefetch-all with a small cache) does not evict its own first copies.
  std::vector<int64_t> hinted;
  for (const int32_t expert : experts) {
    std::optional<int64_t> slot = slot_map_.find(block, expert);
    if (slot) {
      slot_map_.touch(*slot);  // resident: keep it so, no copy, not counted as prefetched
    } else {
      slot = slot_map_.choose_victim();
      if (!slot) {
        ++statistics.prefetch_dropped;
        continue;
      }
      copy_into(*slot, block, expert, CopyKind::prefetch);
    }
    slot_map_.pin(*slot);
    hinted.push_back(*slot);
  }
  for (const int64_t slot : hinted) slot_map_.unpin(slot);
}

// ---- statistics ----

OffloadStatistics ExpertCache::statistics() {
  harvest_timings(true);
  return OffloadStatistics{statistics_};
}

void ExpertCache::reset_statistics() {
  harvest_timings(true);
  std::fill(statistics_.begin(), statistics_.end(), BlockOffloadStatistics{});
}

void ExpertCache::record_host_time(int64_t block, double acquire_ms, double wait_ms) {
  validate(block, {});
  statistics_[static_cast<size_t>(block)].acquire_host_ms += acquire_ms;
  statistics_[static_cast<size_t>(block)].host_wait_ms += wait_ms;
}

}  // namespace moe::cuda
