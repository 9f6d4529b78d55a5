// infer/offload_recording.h: a run record of offloaded decoding, step by step, for the viewer's
// offload panel: per MoE block an `offload` event (hits, misses, stall_us, prefetched, and
// prefetched_used, bytes, and the experts computed on the host instead: on_host, host_us), and `span` events on the compute stream and the expert cache's copy
// stream. Used by moe_generate --run-dir and offload_bench --record-dir (cuda/bench/).
//
//   RecordedExpertSource recorded(inner, offloaded, writer);    // wraps the mode's ExpertSource
//   InferenceModelGpu model(config, weights, recorded, mode, stream);
//   model.set_phase_timer(&recorded.phase_timer());
//   recorded.begin_step(stream);  result = model.prefill(...);      recorded.end_step();
//   recorded.begin_step(stream);  result = model.decode_step(...);  recorded.end_step();  ...
//   recorded.write(results, model.moe_blocks());  // steps[0] the prefill, then the decode steps
//
// Where the times come from (all GPU times, from CUDA events):
//   compute  the decoding model's phases (embedding, attention, moe, dense_ffn, lm_head) from its
//            PhaseTimer, placed from the step's start (the first phase begins as the step does)
//   waits    "wait_for_copy m_j": an event on the compute stream before and after the source's
//            acquire, which enqueues the compute stream's waits for the block's copies (stream 2)
//   copy     "copy m_j" (copies acquire makes on demand) and "prefetch m_j" (copies prefetch
//            starts): events on the cache's copy stream (ExpertCache::copy_stream) before and after
//            the call, so a span covers the copies it enqueued, with their waits for evicted slots
// A span's start_us is the run clock at the step's start (RunWriter::elapsed_us, taken on the host
// as the step is enqueued) plus its GPU offset from an event recorded there.
// Counts come from OffloadedExperts::statistics(), read after each step (it waits for the step's
// copies; the caller's timing events around a step are recorded before end_step).
//
// A DeviceSlotCache (--slot-table device) is recorded too: its decisions are made on the GPU, and
// its per-block counters (hits, misses, prefetches, bytes) come back once a step, after it, with
// DeviceSlotCache::statistics(), the same counts the host table gives. Its spans: "plan + copy m_j"
// on the compute stream around acquire_on_device (the plan kernel, the copy kernel of the misses,
// the wait for a prefetch's copies), and "prefetch m_j" on the cache's stream (from the fork after
// the prefetch's plan to the end of its copies). Its stalls are not timed (stall_us 0). A recorded
// step runs launched, not as a graph: the phase timer's events cannot be captured.
//
// Dimension legend: E experts per MoE block, M the MoE blocks, N sequences.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/phase_timer.h"           // PhaseTimer
#include "infer/inference_model.h"      // StepResult
#include "offload/device_slot_cache.h"  // DeviceSlotCache
#include "offload/expert_source.h"      // ExpertSource
#include "offload/offloaded_experts.h"  // OffloadedExperts, OffloadStatistics
#include "run_record.h"                 // RunWriter

namespace moe::cuda {

class RecordedExpertSource : public ExpertSource {
 public:
  // inner: the mode's source (ResidentExperts, OffloadedExperts, or ResidentBlocks around one);
  // offloaded: the OffloadedExperts that is or is inside it, else nullptr (gpu_only: every chosen
  // expert counts as a hit, as in any resident block). Both and the writer must outlive this object.
  RecordedExpertSource(ExpertSource& inner, OffloadedExperts* offloaded, RunWriter& writer);
  // A slot table on the GPU: `device` is the source itself, or the cache inside `inner`
  // (ResidentBlocks around it).
  RecordedExpertSource(DeviceSlotCache& device, RunWriter& writer);
  RecordedExpertSource(ExpertSource& inner, DeviceSlotCache& device, RunWriter& writer);
  ~RecordedExpertSource() override;
  RecordedExpertSource(const RecordedExpertSource&) = delete;
  RecordedExpertSource& operator=(const RecordedExpertSource&) = delete;

  bool needs_experts_on_host() const override { return inner_.needs_experts_on_host(); }
  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override;
  void release(int64_t block, cudaStream_t compute) override;
  void prefetch(int64_t block, std::span<const int32_t> experts) override;
  bool plans_on_device() const override { return inner_.plans_on_device(); }
  bool resident(int64_t block) const override { return inner_.resident(block); }
  ExpertTables acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots, cudaStream_t compute) override;
  void prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots, cudaStream_t compute) override;
  HostPick choose_host_experts(int64_t block, std::span<const int32_t> experts, std::span<const int64_t> rows,
                               bool chosen_ahead) override {
    return inner_.choose_host_experts(block, experts, rows, chosen_ahead);
  }
  void host_forward(int64_t block, int32_t expert, std::span<const float> x, int64_t rows,
                    std::span<float> y) override {
    inner_.host_forward(block, expert, x, rows, y);
  }

  PhaseTimer& phase_timer() { return timer_; }

  // Around each step (prefill or decode step) on the model's stream.
  void begin_step(cudaStream_t compute);
  void end_step();  // waits for the step's events, keeps its spans and its statistics
  // Writes every kept step: results[i] is the StepResult of the i-th begin/end pair (step i).
  void write(const std::vector<StepResult>& results, const std::vector<int64_t>& moe_layers);
  int64_t steps_kept() const { return int64_t(steps_.size()); }
  // The counts of kept steps first.. summed over steps and MoE blocks (all zero for gpu_only).
  BlockOffloadStatistics steps_total(size_t first) const;

 private:
  struct Marked {  // two events on one stream and what they bracket
    std::string name;
    int64_t stream = 0;  // 0 compute, 1 copy, 2 compute waits
    cudaEvent_t start = nullptr, end = nullptr;
  };
  struct Span {
    std::string name;
    int64_t stream = 0;
    double start_us = 0, duration_us = 0;
  };
  struct Step {
    double origin_us = 0;  // run clock at the step's start
    std::vector<Span> spans;
    std::vector<BlockOffloadStatistics> blocks;  // [M] this step's counts (empty for gpu_only)
  };

  cudaEvent_t take_event();
  int64_t missing(int64_t block, std::span<const int32_t> experts) const;  // experts in no slot

  ExpertSource& inner_;
  OffloadedExperts* offloaded_;
  DeviceSlotCache* device_ = nullptr;
  RunWriter& writer_;
  PhaseTimer timer_;
  std::vector<cudaEvent_t> events_;  // reused every step
  size_t events_used_ = 0;
  cudaEvent_t step_start_ = nullptr;
  double step_origin_us_ = 0;
  std::vector<Marked> marked_;                  // this step's
  std::vector<cudaEvent_t> acquired_;           // [M] the compute event after each block's acquire
  OffloadStatistics previous_;                  // cumulative, at the last end_step
  std::vector<Step> steps_;
};

}  // namespace moe::cuda
