// kernel_trace.h: every kernel the GPU runs, with its start and end on the GPU's clock, recorded by
// CUPTI's activity API (the mechanism under Nsight Systems' CUDA trace) while the work runs at its
// normal pace. A benchmark's CUDA events say how long a whole layer step took; the trace says which
// kernels it was made of, how long each ran in place (warm L2, the clock of a busy GPU), and how
// long the GPU sat between them (launch gaps, host waits).
// Memsets are recorded too (named "memset"); copies are not. Used by moe_bench --kernel-trace; one
// KernelTrace at a time per process.
//
// The activity kind is CONCURRENT_KERNEL, which does not serialise kernels; CUPTI timestamps each
// one on the GPU, at a cost of well under a microsecond per launch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::bench {

struct KernelRecord {
  std::string name;  // demangled, namespaces dropped
  uint64_t start_ns = 0, end_ns = 0;
};

class KernelTrace {
 public:
  // Starts recording; throws std::runtime_error with CUPTI's message when it cannot (another tracer
  // such as ncu or nsys already attached, no CUPTI library).
  KernelTrace();
  ~KernelTrace();  // stops recording
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // The kernels that finished since the last take(), in order of their start. Synchronise the
  // device first: CUPTI hands over only the records of completed kernels.
  std::vector<KernelRecord> take();
};

// A demangled kernel name shortened for a table: the function's name and, for a template, the
// first argument that names a "...Problem" type (our block-sparse products), else the first
// `width` characters of the full name.
std::string short_kernel_name(const std::string& name, size_t width = 60);

// One traced layer step, repeated: the trace cut into `runs` equal runs of the same kernels.
struct KernelTraceSummary {
  struct Kernel {
    std::string name;
    double median_ms = 0;             // its duration over the runs
    double median_gap_before_ms = 0;  // GPU idle between the previous kernel's end and its start
  };
  std::vector<Kernel> kernels;  // in launch order
  int runs = 0;
  double median_span_ms = 0;   // from a run's first kernel's start to the next run's (or its own end)
  double sum_kernels_ms = 0;   // sum of the kernels' medians
  double sum_gaps_ms = 0;      // sum of the gaps' medians, the gap before the first kernel included
};

// The kernels of `steps` repeated steps grouped by short_kernel_name(name, width): each name's GPU
// time and launches per step, the most time first. Where summarize_runs follows one launch order,
// this tells which kernels a step's time is made of when the steps' launches differ.
struct KernelShare {
  std::string name;
  double ms_per_step = 0, launches_per_step = 0;
};
std::vector<KernelShare> kernel_shares(const std::vector<KernelRecord>& records, int64_t steps, size_t width = 48);

// Cuts `records` into `runs` runs of equally many kernels; throws std::invalid_argument when the
// count does not divide or the runs' kernel names differ (the trace holds something else too).
KernelTraceSummary summarize_runs(const std::vector<KernelRecord>& records, int runs);

}  // namespace moe::bench
