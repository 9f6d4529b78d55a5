// clock_warm_up.h: the warm-up before a timed GPU measurement, by time as well as by runs.
//
// A GPU is not a fixed-speed machine. nvidia-smi sampled while moe_bench ran on an H200 (2026-11-22,
// notebooks_data/bench/clocks_3_warmup_runs_h200_2026-11-22.txt and clocks_1s_warmup_h200_2026-11-22.txt) showed three
// states: after idle the SM clock sits at 1440-1485 MHz for the first half second of load; then it
// runs at 1965-1980 MHz; after a few seconds of tensor-core work the card reaches its 700 W limit,
// where the software power cap holds it at about 1400-1750 MHz, now and then below 1000. With only a
// few warm-up runs, a short workload is timed on the way up (the forward first, on the low clock),
// and its figures move from run to run. Warming up for at least a second of load puts every
// measurement in the sustained state that a training run lives in.
#pragma once

#include <cuda_runtime.h>

#include <chrono>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

// Runs `work` (which enqueues on `stream`) `runs` times, then more until the GPU has been busy for
// at least `min_ms` of wall time; returns with the stream drained.
template <class Work>
void warm_up_clock(cudaStream_t stream, int runs, double min_ms, Work&& work) {
  const auto begin = std::chrono::steady_clock::now();
  const auto busy_ms = [&] {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  };
  for (int i = 0; i < runs; ++i) work();
  while (busy_ms() < min_ms) {
    for (int i = 0; i < 4; ++i) work();
  }
}

}  // namespace moe::cuda
