// sim/timeline.h: the simulator's clock. Every rank has a few streams (compute, exchange, copy), as
// a GPU has CUDA streams; a program is a list of operations issued in order, each on one stream of
// every rank, each waiting for its stream and for the operations it names. A collective (an
// all-to-all, an all-reduce) starts on all ranks together, once the last of them is ready, and ends
// together: that is how one slow rank (a straggler with a hot expert) delays every other rank.
//
//   Timeline timeline(R);
//   Op route = timeline.local("route", kCompute, route_us);          // route_us: [R]
//   Op out = timeline.collective("dispatch", kExchange, a2a_us, {route});
//   Op experts = timeline.local("experts", kCompute, experts_us, {out});
//   double step_us = timeline.finish_step();                          // the slowest rank's end
//
// Operations are placed as they are issued (list scheduling): issue order is the order the real
// program launches its kernels in, and an operation only names earlier ones, so one pass places
// everything. Where the program's host waits for the GPU (a copy of the counts read back before
// the all-to-all-v's sizes are known), host_waits_for(op) says so: nothing issued after it starts on
// that rank before op has ended there, on any stream.
//
// Two compute streams (kCompute, kCompute2: two micro-batches, each with its stream, as the
// two-micro-batch overlap runs them) share one GPU: an operation of either runs only where the GPU
// computes nothing else, in the first gap long enough after it is ready. So one micro-batch's work
// fills the time the other's stream waits for its rows, and the two never run faster than one.
//
// Dimension legend: R ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::sim {

enum Stream : int { kCompute = 0, kExchange = 1, kCopy = 2, kCompute2 = 3, kStreams = 4 };
const char* stream_name(int stream);  // "compute", "exchange", "copy", "compute 2"

struct Op {
  int index = -1;
};

struct SimSpan {
  int64_t rank = 0;
  int stream = 0;
  std::string name;
  double start_us = 0;
  double duration_us = 0;
};

class Timeline {
 public:
  explicit Timeline(int64_t ranks);

  int64_t ranks() const { return ranks_; }
  // Which ranks' spans to keep (all by default; a 1024-rank run keeps a few).
  void keep_spans_of(std::vector<int64_t> ranks);

  // One operation on every rank, rank r taking duration_us[r].
  Op local(const std::string& name, int stream, const std::vector<double>& duration_us, const std::vector<Op>& after = {});
  // The same duration on every rank.
  Op local(const std::string& name, int stream, double duration_us, const std::vector<Op>& after = {});
  // A collective: it starts when every rank is ready and lasts duration_us on all of them.
  Op collective(const std::string& name, int stream, double duration_us, const std::vector<Op>& after = {});

  // The host of each rank waits for op: every operation issued from now on starts after op's end
  // on that rank (the host could not launch it earlier), whatever it names.
  void host_waits_for(Op op);

  double end_us(Op op, int64_t rank) const;
  // Ends the step: every stream of every rank waits for the step's slowest end (the next step
  // starts after the optimizer, on all ranks). Returns the step's duration.
  double finish_step();

  // Per rank, the time its GPU computed in the last finished step (both compute streams).
  const std::vector<double>& compute_busy_us() const { return last_compute_busy_; }
  // Per rank, the rest of the last finished step: the GPU computing nothing, waiting for exchanges,
  // collectives and slower ranks (a collective on a compute stream is communication): the exposed
  // communication.
  const std::vector<double>& exposed_communication_us() const { return last_exposed_; }
  double now_us() const { return step_start_; }

  std::vector<SimSpan> take_spans();

 private:
  Op place(const std::string& name, int stream, const std::vector<double>& duration_us, bool collective,
           const std::vector<Op>& after);

  int64_t ranks_;
  // The first start >= ready at which rank r's GPU is free for duration_us (is_compute streams).
  double first_gap(size_t r, double ready, double duration_us) const;

  std::vector<double> stream_free_;  // [R][kStreams]
  std::vector<double> host_free_;    // [R]: when the host could launch the next operation
  std::vector<std::vector<std::pair<double, double>>> gpu_busy_;  // [R]: the compute streams' (start, end), by start
  std::vector<std::vector<double>> end_;  // [op][R]
  std::vector<double> compute_busy_, last_compute_busy_, last_exposed_;  // [R]
  std::vector<bool> keep_;                // [R]
  std::vector<SimSpan> spans_;
  double step_start_ = 0;
};

}  // namespace moe::sim
