// sim/layer_step.cpp: the layer's step as timeline operations (layer_step.h).
#include "sim/layer_step.h"

#include <string>
#include <vector>

namespace moe::sim {

// One micro-batch's share of the step: its load, its tokens, and the durations its operations take.
struct LayerMicroBatch {
  std::string suffix;       // "" alone, ".0" / ".1" with overlap
  int stream = kCompute;    // its compute stream: kCompute, kCompute2 for the second micro-batch
  double tokens = 0;        // a rank's tokens
  std::vector<double> experts_forward_us, experts_backward_us;  // [R] one launch of d
  double out_us = 0, back_us = 0;  // one exchange of one chunk
  double out_kernels_us = 0, back_kernels_us = 0;  // what its kernels take of the GPU (cost_model.h)
  Op last;                  // the last operation issued for it
};

namespace {

using MicroBatch = LayerMicroBatch;

MicroBatch micro_batch(const CostModel& model, const StepLoad& load, int parts, int index) {
  const LayerSpec& layer = model.layer();
  const StepLoad halved = parts == 1 ? StepLoad{} : scaled(load, 1.0 / parts);
  const StepLoad& part = parts == 1 ? load : halved;  // R x E a step: no copy of the whole
  MicroBatch m;
  if (parts > 1) m.suffix = '.' + std::to_string(index);
  m.stream = index == 0 ? kCompute : kCompute2;
  m.tokens = static_cast<double>(layer.tokens_per_rank) / parts;
  for (int64_t r = 0; r < part.ranks; ++r) {
    const std::vector<double> rows = part.expert_rows_of(r);
    m.experts_forward_us.push_back(model.experts_us(rows, layer.chunks, false));
    m.experts_backward_us.push_back(model.experts_us(rows, layer.chunks, true));
  }
  const double fraction = 1.0 / static_cast<double>(layer.chunks);
  m.out_us = model.all_to_all_us(part, fraction, false);
  m.back_us = model.all_to_all_us(part, fraction, true);
  m.out_kernels_us = model.exchange_kernels_us(part, fraction, false);
  m.back_kernels_us = model.exchange_kernels_us(part, fraction, true);
  return m;
}

// The exchanges and experts of every micro-batch's d chunks in Tutel's order, one unit (a chunk of
// a micro-batch) after another: unit i + 1 goes out before unit i comes back, so that its exchange
// runs while unit i's experts do; with two micro-batches, the second's rows travel while the first's
// experts run, and the first's come back while the second's do. Each micro-batch's chunks go out
// once its own work before (its `last`) is done; `last` becomes its last chunk's way back.
// A unit's experts share the GPU with the exchanges beside them, the next unit's way out and the
// previous unit's way back, and take longer for it (CostModel::beside_exchange_us).
void pipeline(Timeline& timeline, const CostModel& model, std::vector<MicroBatch>& batches, int64_t chunks, bool backward) {
  const std::string out_name = backward ? "gradient_out" : "dispatch";
  const std::string back_name = backward ? "gradient_back" : "combine_exchange";
  const std::string experts_name = backward ? "experts_backward" : "experts_forward";
  std::vector<MicroBatch*> units;
  for (MicroBatch& m : batches) {
    for (int64_t c = 0; c < chunks; ++c) units.push_back(&m);
  }
  std::vector<Op> after;  // each micro-batch's work before its rows go out
  for (const MicroBatch& m : batches) after.push_back(m.last);
  auto send = [&](const MicroBatch& m) {
    return timeline.collective(out_name + m.suffix, kExchange, m.out_us, {after[static_cast<size_t>(&m - batches.data())]});
  };
  Op out = send(*units.front());
  for (size_t i = 0; i < units.size(); ++i) {
    MicroBatch& m = *units[i];
    const double beside = (i + 1 < units.size() ? units[i + 1]->out_kernels_us : 0.0) + (i > 0 ? units[i - 1]->back_kernels_us : 0.0);
    std::vector<double> experts_us = backward ? m.experts_backward_us : m.experts_forward_us;
    for (double& us : experts_us) us = model.beside_exchange_us(us, beside);
    const Op experts = timeline.local(experts_name + m.suffix, m.stream, experts_us, {out});
    if (i + 1 < units.size()) out = send(*units[i + 1]);
    m.last = timeline.collective(back_name + m.suffix, kExchange, m.back_us, {experts});
  }
}

}  // namespace

LayerStepOps::LayerStepOps(Timeline& timeline, const CostModel& model, const StepLoad& load)
    : timeline_(timeline), model_(model), load_(load) {
  const int parts = model.layer().overlap ? 2 : 1;
  for (int i = 0; i < parts; ++i) batches_.push_back(micro_batch(model, load, parts, i));
}

LayerStepOps::~LayerStepOps() = default;

namespace {
std::vector<Op> lasts(const std::vector<MicroBatch>& batches) {
  std::vector<Op> out;
  for (const MicroBatch& m : batches) out.push_back(m.last);
  return out;
}
// Micro-batch i's own work before (none when `before` is empty).
std::vector<Op> before_of(const std::vector<Op>& before, size_t i) {
  return i < before.size() ? std::vector<Op>{before[i]} : std::vector<Op>{};
}
}  // namespace

std::vector<Op> LayerStepOps::forward(const std::vector<Op>& before) {
  Timeline& timeline = timeline_;
  const CostModel& model = model_;
  const LayerSpec& layer = model.layer();
  const double count_us = model.count_exchange_us();
  // Tutel's layouts r != 1: the experts this rank computes, gathered from their storing ranks.
  std::vector<Op> gathered;
  if (layer.layout != 1) gathered.push_back(timeline.collective("gather_experts", kCompute, model.layout_weights_us(false), before));
  // Each micro-batch's routing and count exchange; then, for each, the host waits for its counts
  // (the all-to-all-v's sizes), and its permute follows.
  std::vector<Op> counts;
  for (size_t i = 0; i < batches_.size(); ++i) {
    MicroBatch& m = batches_[i];
    std::vector<Op> after = before_of(before, i);
    after.insert(after.end(), gathered.begin(), gathered.end());
    const Op route = timeline.local("route" + m.suffix, m.stream, model.route_us(m.tokens), after);
    counts.push_back(timeline.collective("count_exchange" + m.suffix, m.stream, count_us, {route}));
  }
  for (size_t i = 0; i < batches_.size(); ++i) {
    MicroBatch& m = batches_[i];
    timeline.host_waits_for(counts[i]);
    m.last = timeline.local("permute" + m.suffix, m.stream, model.permute_us(m.tokens), {counts[i]});
    // Shadowing decided per step: the shadowed experts' weights to every rank, before the experts.
    if (!load_.shadowed_this_step.empty()) {
      m.last = timeline.collective("shadow_experts" + m.suffix, m.stream, model.shadow_weights_us(load_, false), {m.last});
    }
  }
  pipeline(timeline, model, batches_, layer.chunks, false);
  for (MicroBatch& m : batches_) {
    // At r > 1 each slot's r partial rows are summed first: r rows read for each one combined.
    const double partial_rows = layer.layout > 1 ? static_cast<double>(layer.layout) : 1.0;
    m.last = timeline.local("combine" + m.suffix, m.stream, model.combine_us(m.tokens) * partial_rows, {m.last});
  }
  return lasts(batches_);
}

std::vector<Op> LayerStepOps::backward(const std::vector<Op>& before) {
  Timeline& timeline = timeline_;
  const CostModel& model = model_;
  for (size_t i = 0; i < batches_.size(); ++i) {
    MicroBatch& m = batches_[i];
    std::vector<Op> after = before_of(before, i);
    after.push_back(m.last);
    m.last = timeline.local("combine_backward" + m.suffix, m.stream, model.combine_backward_us(m.tokens), after);
  }
  pipeline(timeline, model, batches_, model.layer().chunks, true);
  for (MicroBatch& m : batches_) {
    if (!load_.shadowed_this_step.empty()) {  // the copies' gradients back to the storing ranks
      m.last = timeline.collective("return_shadow_gradients" + m.suffix, m.stream, model.shadow_weights_us(load_, true), {m.last});
    }
    m.last = timeline.local("router_backward" + m.suffix, m.stream, model.router_backward_us(m.tokens), {m.last});
  }
  return lasts(batches_);
}

Op LayerStepOps::update(const LayerUpdate& what) {
  Timeline& timeline = timeline_;
  const CostModel& model = model_;
  const LayerSpec& layer = model.layer();
  const int stream = what.stream;
  // The expert gradients are complete after the last of these (the SGD waits for it).
  Op gradients_done = what.router_all_reduce ? timeline.collective("router_all_reduce", stream, model.small_all_reduce_us(), lasts(batches_))
                                             : timeline.local("backward_done", stream, 0.0, lasts(batches_));
  if (load_.replicas > 0) {  // the replicas' gradients summed, so that they stay one expert
    gradients_done = timeline.collective("replica_all_reduce", stream, model.replica_all_reduce_us(load_), {gradients_done});
  }
  if (layer.layout != 1) {  // layouts r != 1: the gradients back onto the storing ranks
    gradients_done = timeline.collective("return_expert_gradients", stream, model.layout_weights_us(true), {gradients_done});
  }
  // SGD on each rank's expert slots: its E / R experts and its replicas (any layout: the stored ones).
  std::vector<double> sgd_us;
  for (int64_t r = 0; r < load_.ranks; ++r) {
    const double slots = load_.replicas > 0 ? static_cast<double>(load_.expert_rows_of(r).size()) : static_cast<double>(load_.experts_per_rank());
    sgd_us.push_back(model.sgd_us() * slots / static_cast<double>(load_.experts_per_rank()));
  }
  // Two micro-batches: the second's expert gradients (a buffer of their own) are added to the
  // first's before the SGD. Both passes are bound by memory: the SGD moves 8 bytes a parameter
  // (bf16 weight read and written, fp32 gradient read), the sum 12 (two fp32 read, one written).
  if (layer.overlap) {
    std::vector<double> sum_us;
    for (double us : sgd_us) sum_us.push_back(1.5 * us);
    gradients_done = timeline.local("sum_micro_batch_gradients", stream, sum_us, {gradients_done});
  }
  if (what.sgd) gradients_done = timeline.local("sgd_experts", stream, sgd_us, {gradients_done});
  // The layer's time no phase names, on the first micro-batch's compute stream.
  timeline.local("unnamed", kCompute, model.unnamed_us(static_cast<double>(layer.tokens_per_rank)), {batches_.front().last});
  return gradients_done;
}

void issue_layer_step(Timeline& timeline, const CostModel& model, const StepLoad& load) {
  LayerStepOps ops(timeline, model, load);
  ops.forward();
  ops.backward();
  ops.update({});
}

}  // namespace moe::sim
