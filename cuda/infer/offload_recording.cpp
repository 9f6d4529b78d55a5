// infer/offload_recording.cpp: RecordedExpertSource (see offload_recording.h).
#include "infer/offload_recording.h"

#include <algorithm>

#include "core/cuda_check.h"  // CUDA_CHECK
#include "run_events.h"       // OffloadEvent, SpanEvent, to_event

namespace moe::cuda {

RecordedExpertSource::RecordedExpertSource(ExpertSource& inner, OffloadedExperts* offloaded, RunWriter& writer)
    : inner_(inner), offloaded_(offloaded), writer_(writer) {
  CUDA_CHECK(cudaEventCreate(&step_start_));
}

RecordedExpertSource::RecordedExpertSource(DeviceSlotCache& device, RunWriter& writer)
    : RecordedExpertSource(device, device, writer) {}

RecordedExpertSource::RecordedExpertSource(ExpertSource& inner, DeviceSlotCache& device, RunWriter& writer)
    : RecordedExpertSource(inner, nullptr, writer) {
  device_ = &device;
}

RecordedExpertSource::~RecordedExpertSource() {
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
  if (step_start_ != nullptr) cudaEventDestroy(step_start_);
}

cudaEvent_t RecordedExpertSource::take_event() {
  if (events_used_ == events_.size()) {
    cudaEvent_t event = nullptr;
    CUDA_CHECK(cudaEventCreate(&event));
    events_.push_back(event);
  }
  return events_[events_used_++];
}

int64_t RecordedExpertSource::missing(int64_t block, std::span<const int32_t> experts) const {
  if (offloaded_ == nullptr || inner_.resident(block)) return 0;
  const ExpertSlotMap& map = offloaded_->cache().slot_map();
  return std::count_if(experts.begin(), experts.end(), [&](int32_t e) { return !map.find(block, e).has_value(); });
}

ExpertTables RecordedExpertSource::acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) {
  if (offloaded_ == nullptr || inner_.resident(block)) return inner_.acquire(block, experts, compute);
  const std::string suffix = " m" + std::to_string(block);
  const bool copies = missing(block, experts) > 0;
  Marked wait{"wait_for_copy" + suffix, 2, take_event(), take_event()};
  Marked copy{"copy" + suffix, 1, copies ? take_event() : nullptr, copies ? take_event() : nullptr};
  const cudaStream_t copy_stream = offloaded_->cache().copy_stream();
  CUDA_CHECK(cudaEventRecord(wait.start, compute));
  if (copies) CUDA_CHECK(cudaEventRecord(copy.start, copy_stream));
  const ExpertTables tables = inner_.acquire(block, experts, compute);
  if (copies) CUDA_CHECK(cudaEventRecord(copy.end, copy_stream));
  CUDA_CHECK(cudaEventRecord(wait.end, compute));
  marked_.push_back(wait);
  if (copies) marked_.push_back(copy);
  return tables;
}

void RecordedExpertSource::release(int64_t block, cudaStream_t compute) { inner_.release(block, compute); }

void RecordedExpertSource::prefetch(int64_t block, std::span<const int32_t> experts) {
  if (offloaded_ == nullptr || missing(block, experts) == 0) {
    inner_.prefetch(block, experts);
    return;
  }
  const cudaStream_t copy_stream = offloaded_->cache().copy_stream();
  Marked copy{"prefetch m" + std::to_string(block), 1, take_event(), take_event()};
  CUDA_CHECK(cudaEventRecord(copy.start, copy_stream));
  inner_.prefetch(block, experts);
  CUDA_CHECK(cudaEventRecord(copy.end, copy_stream));
  marked_.push_back(copy);
}

ExpertTables RecordedExpertSource::acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                                     cudaStream_t compute) {
  if (device_ == nullptr || inner_.resident(block)) return inner_.acquire_on_device(block, top_experts, slots, compute);
  Marked plan{"plan + copy m" + std::to_string(block), 2, take_event(), take_event()};
  CUDA_CHECK(cudaEventRecord(plan.start, compute));
  const ExpertTables tables = inner_.acquire_on_device(block, top_experts, slots, compute);
  CUDA_CHECK(cudaEventRecord(plan.end, compute));
  marked_.push_back(plan);
  return tables;
}

void RecordedExpertSource::prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                              cudaStream_t compute) {
  inner_.prefetch_on_device(block, top_experts, slots, compute);
  if (device_ == nullptr || inner_.resident(block)) return;
  // The copies start at the fork, the last work the call enqueued on `compute`, and end with the
  // cache's stream.
  Marked copy{"prefetch m" + std::to_string(block), 1, take_event(), take_event()};
  CUDA_CHECK(cudaEventRecord(copy.start, compute));
  CUDA_CHECK(cudaEventRecord(copy.end, device_->copy_stream()));
  marked_.push_back(copy);
}

void RecordedExpertSource::begin_step(cudaStream_t compute) {
  events_used_ = 0;
  marked_.clear();
  timer_.collect();  // drop phases of unrecorded work
  step_origin_us_ = writer_.elapsed_us();
  CUDA_CHECK(cudaEventRecord(step_start_, compute));
}

void RecordedExpertSource::end_step() {
  Step step;
  step.origin_us = step_origin_us_;
  // The compute stream's phases, placed from the step's start.
  for (const TimedPhase& phase : timer_.collect()) {
    if (phase.depth == 0) step.spans.push_back({phase.name, 0, phase.start_us, phase.duration_us});
  }
  CUDA_CHECK(cudaEventSynchronize(step_start_));
  for (const Marked& m : marked_) {
    CUDA_CHECK(cudaEventSynchronize(m.end));
    float start_ms = 0, duration_ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&start_ms, step_start_, m.start));
    CUDA_CHECK(cudaEventElapsedTime(&duration_ms, m.start, m.end));
    if (m.stream == 2 && duration_ms < 1e-3f) continue;  // no wait worth drawing (under 1 us)
    step.spans.push_back({m.name, m.stream, 1e3 * start_ms, 1e3 * duration_ms});
  }
  if (offloaded_ != nullptr || device_ != nullptr) {
    // Waits for the step's copies (the host table), or reads the GPU's counters after them.
    const OffloadStatistics now = offloaded_ != nullptr ? offloaded_->statistics() : device_->statistics();
    step.blocks = now.blocks;
    for (size_t j = 0; j < now.blocks.size() && j < previous_.blocks.size(); ++j) {
      step.blocks[j].subtract(previous_.blocks[j]);
    }
    previous_ = now;
  }
  steps_.push_back(std::move(step));
}

BlockOffloadStatistics RecordedExpertSource::steps_total(size_t first) const {
  BlockOffloadStatistics total;
  for (size_t i = first; i < steps_.size(); ++i) {
    for (const BlockOffloadStatistics& b : steps_[i].blocks) total.add(b);
  }
  return total;
}

void RecordedExpertSource::write(const std::vector<StepResult>& results, const std::vector<int64_t>& moe_layers) {
  const size_t steps = std::min(results.size(), steps_.size());
  for (size_t i = 0; i < steps; ++i) {
    const Step& step = steps_[i];
    const StepResult& result = results[i];
    for (size_t j = 0; j < result.moe.size() && j < moe_layers.size(); ++j) {
      const MoeBlockStep& block = result.moe[j];
      OffloadEvent event;
      event.step = int64_t(i);
      event.layer = moe_layers[j];
      event.prefetched.assign(block.prefetched.begin(), block.prefetched.end());
      int64_t prefetched_used = 0, bytes = 0;
      if (j < step.blocks.size() && !inner_.resident(int64_t(j))) {
        const BlockOffloadStatistics& b = step.blocks[j];
        event.hits = b.hits;
        event.misses = b.misses;
        event.stall_us = std::max(0.0, 1e3 * b.stall_ms);
        prefetched_used = b.prefetched_used;
        bytes = b.bytes_copied;
      } else {  // the block is resident: each chosen expert is a hit
        event.hits = int64_t(block.experts.size());
      }
      nlohmann::json line = to_event(event);
      line["prefetched_used"] = prefetched_used;
      line["bytes"] = bytes;
      line["experts"] = block.experts;
      line["on_host"] = block.on_host;
      line["host_us"] = 1e3 * block.host_ms;
      writer_.append(line);
    }
    for (const Span& span : step.spans) {
      static const char* const kStreamNames[] = {"compute", "copy", "compute waits"};
      writer_.append(to_event(SpanEvent{.step = int64_t(i), .rank = 0, .stream = span.stream,
                                        .stream_name = kStreamNames[span.stream], .name = span.name,
                                        .start_us = step.origin_us + span.start_us,
                                        .duration_us = span.duration_us}));
    }
  }
}

}  // namespace moe::cuda
