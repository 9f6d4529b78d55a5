// phase_timer.h: names the phases of a layer on the GPU timeline, twice over: an NVTX range (so
// Nsight Systems shows the same phases as the viewer) and a pair of CUDA events (so a program can
// write the phases' times into its run record as "span" events).
//
//   PhaseTimer timer;                 // one per stream
//   layer.set_phase_timer(&timer);    // the layer calls begin()/end() around each phase
//   ... forward, backward ...
//   for (const auto& phase : timer.collect()) ...   // waits for the events, returns the spans
//
// Phases nest: a model's "moe" phase holds the layer's own router, plan, dispatch, ... phases.
// Each phase knows its depth (0 for the outermost), so a reader can sum one level without
// counting a nested phase twice.
//
// Timing never synchronises the host during the work: events are recorded on the stream and read
// only in collect(). A layer without a timer (the default) records nothing.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "run_events.h"  // is_exposed_communication

namespace moe::cuda {

struct TimedPhase {
  std::string name;
  double start_us = 0;     // from the first phase's start
  double duration_us = 0;
  int depth = 0;           // 0: outermost; 1: inside one open phase; ...
  int stream = 0;          // which stream it ran on: 0 for the first phase's, 1, 2, ... for others in order seen
  std::string stream_name; // what name_stream() called that stream; empty if nothing did
};

// Which phases are communication their stream could not hide: moe::is_exposed_communication
// (common/run_events.h), one rule for ep_bench, the trainer and the viewer.
using moe::is_exposed_communication;

class PhaseTimer {
 public:
  PhaseTimer() = default;
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  void begin(const char* name, cudaStream_t stream);  // opens an NVTX range, records a start event
  void end(cudaStream_t stream);  // ends the innermost open phase: records its end event, closes the range
  // Waits for the recorded events and returns every phase since the last collect(), in order.
  std::vector<TimedPhase> collect();
  // Names a stream for the phases that run on it (TimedPhase::stream_name), until named again: a
  // model's micro-batch streams, a layer's exchange stream.
  void name_stream(cudaStream_t stream, std::string name);

 private:
  struct Pending {
    std::string name;
    cudaEvent_t start = nullptr, stop = nullptr;
    int depth = 0;
    int stream = 0;
  };
  std::vector<cudaStream_t> streams_;  // in the order first seen since the last collect()
  std::vector<std::pair<cudaStream_t, std::string>> stream_names_;  // name_stream()'s
  std::vector<Pending> pending_;  // in the order they began
  std::vector<size_t> open_;      // indices into pending_ of the phases begun and not yet ended
};

}  // namespace moe::cuda
