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
// everything, O(operations x R). Spans (start, end) are kept for the ranks asked for, which is what
// a simulated run record shows.
//
// Dimension legend: R ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::sim {

enum Stream : int { kCompute = 0, kExchange = 1, kCopy = 2, kStreams = 3 };
const char* stream_name(int stream);  // "compute", "exchange", "copy"

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

  double end_us(Op op, int64_t rank) const;
  // Ends the step: every stream of every rank waits for the step's slowest end (the next step
  // starts after the optimizer, on all ranks). Returns the step's duration.
  double finish_step();

  // Per rank, the time its compute stream was busy in the last finished step.
  const std::vector<double>& compute_busy_us() const { return last_compute_busy_; }
  // Per rank, the time its compute stream waited for an exchange-stream or collective operation in
  // the last finished step: the exposed communication (waits for a slower rank included).
  const std::vector<double>& exposed_communication_us() const { return last_exposed_; }
  double now_us() const { return step_start_; }

  std::vector<SimSpan> take_spans();

 private:
  Op place(const std::string& name, int stream, const std::vector<double>& duration_us, bool collective,
           const std::vector<Op>& after);

  int64_t ranks_;
  std::vector<double> stream_free_;  // [R][kStreams]
  std::vector<std::vector<double>> end_;  // [op][R]
  std::vector<bool> communicates_;       // [op]: on the exchange stream or a collective
  std::vector<double> compute_busy_, exposed_, last_compute_busy_, last_exposed_;  // [R]
  std::vector<bool> keep_;                // [R]
  std::vector<SimSpan> spans_;
  double step_start_ = 0;
};

}  // namespace moe::sim
