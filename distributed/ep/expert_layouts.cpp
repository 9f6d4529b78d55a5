// expert_layouts.cpp: Tutel's parallelism switching on CPU ranks, three layouts over one storage
// (see expert_layouts.h).
//
// Sections: ---- settings ----  ---- placement ----  ---- gathering weights, returning gradients ----
//           ---- forward ----  ---- backward ----  ---- the cost model ----  ---- measurement ----
#include "ep/expert_layouts.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "comm/all_to_all_2dh.h"            // HierarchicalAllToAll (its node size, in the layouts fingerprint)
#include "comm/rank_agreement.h"            // check_on_every_rank, check_same_on_every_rank
#include "fnv1a.h"                  // fnv1a_64_words: the candidates' fingerprint
#include "reference_cpu/checks.h"      // check_shape, check_finite
#include "reference_cpu/expert_ffn.h"  // expert_ffn_forward / backward

namespace moe::dist {

using ref::IndexVector;
using ref::Matrix;

LayoutTraffic& LayoutTraffic::operator+=(const LayoutTraffic& other) {
  weight_elements += other.weight_elements;
  token_elements += other.token_elements;
  messages += other.messages;
  return *this;
}


namespace {

// Settings that must agree first (the same outcome on every rank), then this rank's own inputs.
void check_layout_inputs(Communicator& comm, const MoeConfig& config, const Matrix& x,
                         const ExpertParallelWeights& stored, const ExpertLayoutOptions& options) {
  check_same_on_every_rank(comm, "expert layouts: the MoE configs", config_fingerprint(config));
  const ExpertParallelOptions& ep = options.expert_parallel;
  const uint64_t layout_fingerprint =
      (static_cast<uint64_t>(static_cast<uint32_t>(options.r)) << 40) ^
      (static_cast<uint64_t>(static_cast<uint32_t>(ep.pipeline_chunks)) << 8) ^
      static_cast<uint64_t>(ep.hierarchical ? ep.hierarchical->ranks_per_node() : 0);
  check_same_on_every_rank(comm, "expert layouts: the layouts (r, pipeline_chunks, 2DH node size)",
                           layout_fingerprint);
  validate(config);
  check_layout(config, comm.size(), options.r);
  if (options.r != 1 && (ep.pipeline_chunks != 1 || ep.hierarchical)) {
    throw std::invalid_argument("expert layout " + layout_name(options.r) + ": pipeline_chunks = " +
                                std::to_string(ep.pipeline_chunks) + (ep.hierarchical ? " with" : " without") +
                                " the 2DH exchange; the d-chunk pipeline and the 2DH exchange belong to the "
                                "expert-parallel layout (r = 1); other layouts take d = 1, flat");
  }
  // Shapes of x and the stored weights (at r = 1 expert_parallel_forward checks them itself).
  if (options.r != 1) check_expert_parallel_inputs(comm, config, x, stored, {});
}

// A slice config: the experts' products over hidden units [h0, h0 + width) are the layer's with
// H = width (the activation pairs gate column i with up column i, so a column slice is exact).
MoeConfig slice_config(const MoeConfig& config, int64_t width) {
  MoeConfig slice = config;
  slice.hidden_dim = width;
  return slice;
}

// ---- gathering weights, returning gradients ----

// The columns of W1 [D, w1_columns] that feed hidden units [h0, h0 + width): those columns, and for
// SwiGLU the same columns of the up half too (gate slice, then up slice: the slice config's layout).
Matrix w1_slice(const MoeConfig& config, const Matrix& w1, int64_t h0, int64_t width) {
  if (config.activation == Activation::gelu) return w1.middleCols(h0, width);
  Matrix slice(w1.rows(), 2 * width);
  slice.leftCols(width) = w1.middleCols(h0, width);
  slice.rightCols(width) = w1.middleCols(config.hidden_dim + h0, width);
  return slice;
}

void add_w1_slice(const MoeConfig& config, Matrix& w1, const Matrix& slice, int64_t h0, int64_t width) {
  if (config.activation == Activation::gelu) {
    w1.middleCols(h0, width) += slice;
    return;
  }
  w1.middleCols(h0, width) += slice.leftCols(width);
  w1.middleCols(config.hidden_dim + h0, width) += slice.rightCols(width);
}

void append(std::vector<double>& buffer, const Matrix& m) {  // row-major, as Matrix stores it
  buffer.insert(buffer.end(), m.data(), m.data() + m.size());
}

Matrix read_matrix(const std::vector<double>& buffer, int64_t& offset, int64_t rows, int64_t cols) {
  Matrix m = Eigen::Map<const Matrix>(buffer.data() + offset, rows, cols);
  offset += rows * cols;
  return m;
}

void count_sent(LayoutTraffic& traffic, int64_t LayoutTraffic::*field, const std::vector<int64_t>& counts,
                int self, int64_t scale) {
  for (size_t p = 0; p < counts.size(); ++p) {
    if (static_cast<int>(p) == self || counts[p] == 0) continue;
    traffic.*field += counts[p] * scale;
    ++traffic.messages;
  }
}

// One all-to-all-v of packed weight elements (send_counts[p] of `send` to rank p, recv_counts[q]
// from rank q, packed in rank order), counted in traffic.weight_elements.
std::vector<double> exchange_weights(Communicator& comm, const std::vector<double>& send,
                                     const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts,
                                     LayoutTraffic& traffic) {
  std::vector<double> received(static_cast<size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0})),
                               std::numeric_limits<double>::quiet_NaN());
  comm.all_to_all_v(send.data(), send_counts, exclusive_prefix_sum(send_counts), received.data(), recv_counts,
                    exclusive_prefix_sum(recv_counts), DataType::float64);
  count_sent(traffic, &LayoutTraffic::weight_elements, send_counts, comm.rank(), 1);
  return received;
}

// Forward: each rank receives the slices it computes from the ranks that store them, in one
// all-to-all-v (its own slices included, copied by the backend). The stored copies are only read.
GatheredExperts gather_experts(Communicator& comm, const MoeConfig& config, const Placement& place,
                               const ExpertParallelWeights& stored, LayoutTraffic& traffic) {
  const int R = comm.size(), me = comm.rank();
  const int64_t D = config.model_dim, width = place.hidden_width(), E_r = place.stored_per_rank;
  const MoeConfig slice = slice_config(config, width);
  const int64_t per_expert = D * w1_columns(slice) + width * D;

  std::vector<double> send;
  std::vector<int64_t> send_counts(R, 0), recv_counts(R, 0);
  for (int p = 0; p < R; ++p) {
    for (int64_t j = 0; j < E_r; ++j) {
      if (!place.computes(p, me * E_r + j)) continue;
      append(send, w1_slice(config, stored.w1[j], place.hidden_begin(p), width));
      append(send, stored.w2[j].middleRows(place.hidden_begin(p), width));
      send_counts[p] += per_expert;
    }
  }
  for (int q = 0; q < R; ++q) {
    for (int64_t j = 0; j < E_r; ++j) recv_counts[q] += place.computes(me, q * E_r + j) ? per_expert : 0;
  }
  const std::vector<double> received = exchange_weights(comm, send, send_counts, recv_counts, traffic);

  GatheredExperts gathered;
  gathered.first_expert = place.first_expert(me);
  gathered.hidden_begin = place.hidden_begin(me);
  gathered.hidden_width = width;
  gathered.w1.resize(place.computed_experts());
  gathered.w2.resize(place.computed_experts());
  int64_t offset = 0;
  for (int q = 0; q < R; ++q) {  // source after source, each source's experts in id order
    for (int64_t j = 0; j < E_r; ++j) {
      const int64_t e = q * E_r + j;
      if (!place.computes(me, e)) continue;
      gathered.w1[e - gathered.first_expert] = read_matrix(received, offset, D, w1_columns(slice));
      gathered.w2[e - gathered.first_expert] = read_matrix(received, offset, width, D);
    }
  }
  return gathered;
}

// Backward: the gradients of the computed slices go back to the storing ranks, which add them into
// their experts' whole gradients: disjoint slices when r > 1; with r = 0, R whole gradients of each
// expert, summed in rank order (a reduce-scatter as an all-to-all and a sum).
void return_expert_gradients(Communicator& comm, const MoeConfig& config, const Placement& place,
                             const std::vector<Matrix>& d_w1,  // [computed] x [D, w1_columns of the slice]
                             const std::vector<Matrix>& d_w2,  // [computed] x [width, D]
                             ExpertLayoutGradients& grads, LayoutTraffic& traffic) {
  const int R = comm.size(), me = comm.rank();
  const int64_t D = config.model_dim, width = place.hidden_width(), E_r = place.stored_per_rank;
  const MoeConfig slice = slice_config(config, width);
  const int64_t per_expert = D * w1_columns(slice) + width * D;
  const int64_t first = place.first_expert(me);

  std::vector<double> send;
  std::vector<int64_t> send_counts(R, 0), recv_counts(R, 0);
  for (int q = 0; q < R; ++q) {
    for (int64_t j = 0; j < E_r; ++j) {
      const int64_t e = q * E_r + j;
      if (!place.computes(me, e)) continue;
      append(send, d_w1[e - first]);
      append(send, d_w2[e - first]);
      send_counts[q] += per_expert;
    }
  }
  for (int p = 0; p < R; ++p) {
    for (int64_t j = 0; j < E_r; ++j) recv_counts[p] += place.computes(p, me * E_r + j) ? per_expert : 0;
  }
  const std::vector<double> received = exchange_weights(comm, send, send_counts, recv_counts, traffic);

  int64_t offset = 0;
  for (int p = 0; p < R; ++p) {
    for (int64_t j = 0; j < E_r; ++j) {
      if (!place.computes(p, me * E_r + j)) continue;
      const Matrix w1 = read_matrix(received, offset, D, w1_columns(slice));
      add_w1_slice(config, grads.w1[j], w1, place.hidden_begin(p), width);
      grads.w2[j].middleRows(place.hidden_begin(p), width) += read_matrix(received, offset, width, D);
    }
  }
}

// The rows this rank computes: its experts (or slices) over the rows received, ordered
// [expert][source rank][token] (global token order), with the formulation's padding.
ref::DispatchPlan plan_computed_experts(const MoeConfig& config, const Placement& place,
                                        const RoutingOnRanks& routing, int me) {
  const int R = place.ranks;
  const int64_t E = config.num_experts, first = place.first_expert(me);
  const std::vector<int64_t>& kept = routing.kept_per_rank_expert;
  const auto received_rows = [&](int q, int64_t j) {
    return place.receives(me, q, first + j) ? kept[q * E + first + j] : int64_t{0};
  };
  // r > 1: every slice of the expert computes its C rows. r = 0: the expert's rows are spread over
  // the ranks; its storing rank adds the padding up to C, once.
  const auto padded_rows = [&](int64_t j, int64_t arrived) {
    const int64_t e = first + j;
    if (place.r != 0) return routing.capacity;
    int64_t kept_everywhere = 0;
    for (int q = 0; q < R; ++q) kept_everywhere += kept[q * E + e];
    return arrived + (place.owner(e) == me ? routing.capacity - kept_everywhere : 0);
  };
  return plan_received_rows(config, routing.capacity, R, place.computed_experts(), received_rows, padded_rows);
}

// Rows out and back: r = 0 keeps every row at home (no exchange); r > 1 exchanges flat.
Matrix move_rows(Communicator& comm, int r, const Matrix& send, const std::vector<int64_t>& send_rows,
                 const std::vector<int64_t>& recv_rows, int64_t cols, LayoutTraffic& traffic) {
  if (r == 0) return send;
  count_sent(traffic, &LayoutTraffic::token_elements, send_rows, comm.rank(), cols);
  return exchange_rows(comm, nullptr, send, send_rows, recv_rows, cols);
}

// What FastMoE's layer sent in one direction of its exchanges (forward and backward send the same).
LayoutTraffic expert_parallel_traffic(const ExpertParallelForward& forward, int me, int64_t D) {
  LayoutTraffic traffic;
  for (const ExpertParallelChunk& chunk : forward.chunks) {
    count_sent(traffic, &LayoutTraffic::token_elements, chunk.send_rows, me, D);  // dispatch
    count_sent(traffic, &LayoutTraffic::token_elements, chunk.recv_rows, me, D);  // combine
  }
  return traffic;
}

}  // namespace

// ---- forward ----

ExpertLayoutForward expert_layout_forward(Communicator& comm, const MoeConfig& config, const Matrix& x,
                                          const ExpertParallelWeights& stored, const ExpertLayoutOptions& options) {
  check_layout_inputs(comm, config, x, stored, options);
  const int R = comm.size(), me = comm.rank();
  const int64_t D = config.model_dim, E = config.num_experts, K = config.top_k;
  ExpertLayoutForward f;
  f.r = options.r;

  if (options.r == 1) {  // FastMoE's layer as it is
    f.expert_parallel = expert_parallel_forward(comm, config, x, stored, options.expert_parallel);
    f.y = f.expert_parallel.y;
    f.aux_loss = f.expert_parallel.aux_loss;
    f.z_loss = f.expert_parallel.z_loss;
    f.kept_per_rank_expert = f.expert_parallel.kept_per_rank_expert;
    f.dropped_slots = f.expert_parallel.dropped_slots;
    f.traffic = expert_parallel_traffic(f.expert_parallel, me, D);
    return f;
  }

  const Placement place = placement_of(config, R, options.r);
  f.routing = route_on_ranks(comm, config, x, stored.gate_weights);
  const RoutingOnRanks& routing = f.routing;
  const int64_t T_r = routing.local_tokens;
  f.aux_loss = routing.router.aux_loss;
  f.z_loss = routing.router.z_loss;
  f.kept_per_rank_expert = routing.kept_per_rank_expert;
  f.dropped_slots = routing.dropped_slots;

  // ---- the weights this rank computes with, gathered for this step ----
  f.experts = gather_experts(comm, config, place, stored, f.traffic);

  // ---- dispatch, as the tokens' rank: each kept slot to every rank computing its expert ----
  f.send_rows.assign(R, 0);
  f.slot_kept.assign(T_r * K, 0);
  for (int p = 0; p < R; ++p) {
    for (int64_t e = place.first_expert(p); e < place.first_expert(p) + place.computed_experts(); ++e) {
      if (!place.receives(p, me, e)) continue;
      const int64_t kept = routing.kept_per_rank_expert[me * E + e];
      for (int64_t i = 0; i < kept; ++i) {
        const int32_t slot = routing.routed_slots[routing.routed_offsets[e] + i];
        f.sent_slots.push_back(slot);
        f.slot_kept[slot] = 1;
      }
      f.send_rows[p] += kept;
    }
  }
  Matrix send(static_cast<int64_t>(f.sent_slots.size()), D);
  for (size_t i = 0; i < f.sent_slots.size(); ++i) send.row(i) = x.row(f.sent_slots[i] / K);
  f.recv_rows.assign(R, 0);
  for (int q = 0; q < R; ++q) {
    for (int64_t e = place.first_expert(me); e < place.first_expert(me) + place.computed_experts(); ++e) {
      if (place.receives(me, q, e)) f.recv_rows[q] += routing.kept_per_rank_expert[q * E + e];
    }
  }
  const Matrix received = move_rows(comm, f.r, send, f.send_rows, f.recv_rows, D, f.traffic);

  // ---- the computed experts (or their H slices) over the rows received ----
  f.expert_plan = plan_computed_experts(config, place, routing, me);
  const ref::DispatchPlan& plan = f.expert_plan;
  f.permuted_x = rows_in_plan_order(plan, received);
  ref::ExpertActivations experts = ref::expert_ffn_forward(slice_config(config, f.experts.hidden_width), plan,
                                                           f.permuted_x, f.experts.w1, f.experts.w2);
  f.pre_activation = std::move(experts.pre_activation);
  f.hidden = std::move(experts.hidden);
  f.expert_out = std::move(experts.out);

  // ---- the way back: each computing rank's (partial) output, summed at the token's rank ----
  const Matrix back = rows_in_received_order(plan, f.expert_out, received.rows());
  const Matrix returned = move_rows(comm, f.r, back, f.recv_rows, f.send_rows, D, f.traffic);
  f.slot_expert_out = Matrix::Zero(T_r * K, D);
  for (size_t i = 0; i < f.sent_slots.size(); ++i) f.slot_expert_out.row(f.sent_slots[i]) += returned.row(i);

  // ---- the weighted combine; a dropped slot adds zero ----
  f.y = Matrix::Zero(T_r, D);
  for (int64_t t = 0; t < T_r; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      if (f.slot_kept[t * K + k]) f.y.row(t) += routing.router.combine_weights(t, k) * f.slot_expert_out.row(t * K + k);
    }
  }
  return f;
}

// ---- backward ----

ExpertLayoutGradients expert_layout_backward(Communicator& comm, const MoeConfig& config, const Matrix& x,
                                             const ExpertParallelWeights& stored,
                                             const ExpertLayoutForward& forward, const Matrix& dy) {
  const int R = comm.size(), me = comm.rank();
  const int64_t D = config.model_dim, H = config.hidden_dim, K = config.top_k;
  check_same_on_every_rank(comm, "expert layouts backward: the MoE configs", config_fingerprint(config));
  check_same_on_every_rank(comm, "expert layouts backward: the forward passes' layouts r",
                           static_cast<uint64_t>(static_cast<uint32_t>(forward.r)));
  ExpertLayoutGradients grads;

  if (forward.r == 1) {
    ExpertParallelGradients ep = expert_parallel_backward(comm, config, x, stored, forward.expert_parallel, dy);
    grads.x = std::move(ep.x);
    grads.gate_weights = std::move(ep.gate_weights);
    grads.w1 = std::move(ep.w1);
    grads.w2 = std::move(ep.w2);
    grads.traffic = expert_parallel_traffic(forward.expert_parallel, me, D);
    return grads;
  }

  const Placement place = placement_of(config, R, forward.r);
  const int64_t T_r = forward.routing.local_tokens;
  check_on_every_rank(comm, "expert layouts backward: bad input", [&] {
    ref::check_shape("x", x, T_r, D, "[T_r, D] as in the forward pass");
    ref::check_shape("dy", dy, T_r, D, "[T_r, D]");
    ref::check_finite("dy", dy);
    if (static_cast<int64_t>(stored.w1.size()) != place.stored_per_rank ||
        static_cast<int64_t>(forward.experts.w1.size()) != place.computed_experts()) {
      throw std::invalid_argument("the forward pass does not belong to these weights and this communicator");
    }
  });

  // ---- combine: y[t] = sum_k w[t, k] out(t, k) ----
  const ref::RouterOutput& router = forward.routing.router;
  Matrix d_slot_out = Matrix::Zero(T_r * K, D);
  Matrix d_combine = Matrix::Zero(T_r, K);
  for (int64_t t = 0; t < T_r; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = t * K + k;
      if (!forward.slot_kept[slot]) continue;  // dropped: nothing flows back through it
      d_slot_out.row(slot) = router.combine_weights(t, k) * dy.row(t);
      d_combine(t, k) = dy.row(t).dot(forward.slot_expert_out.row(slot));
    }
  }

  // ---- output gradients out to every computing rank, the experts' backward there ----
  Matrix send(static_cast<int64_t>(forward.sent_slots.size()), D);
  for (size_t i = 0; i < forward.sent_slots.size(); ++i) send.row(i) = d_slot_out.row(forward.sent_slots[i]);
  const Matrix received = move_rows(comm, forward.r, send, forward.send_rows, forward.recv_rows, D, grads.traffic);
  const ref::DispatchPlan& plan = forward.expert_plan;
  Matrix d_expert_out = rows_in_plan_order(plan, received);  // padding rows get no gradient
  const ref::ExpertActivations activations{forward.pre_activation, forward.hidden, forward.expert_out};
  const ref::ExpertGradients experts =
      ref::expert_ffn_backward(slice_config(config, forward.experts.hidden_width), plan, forward.permuted_x,
                               forward.experts.w1, forward.experts.w2, activations, d_expert_out);

  // ---- the slices' weight gradients back to the storing ranks ----
  for (int64_t j = 0; j < place.stored_per_rank; ++j) {
    grads.w1.push_back(Matrix::Zero(D, w1_columns(config)));
    grads.w2.push_back(Matrix::Zero(H, D));
  }
  return_expert_gradients(comm, config, place, experts.w1, experts.w2, grads, grads.traffic);

  // ---- the (partial) input gradients back home, summed over the slices ----
  const Matrix back = rows_in_received_order(plan, experts.permuted_x, received.rows());
  const Matrix returned = move_rows(comm, forward.r, back, forward.recv_rows, forward.send_rows, D, grads.traffic);
  grads.x = Matrix::Zero(T_r, D);
  for (size_t i = 0; i < forward.sent_slots.size(); ++i) grads.x.row(forward.sent_slots[i] / K) += returned.row(i);

  grads.gate_weights = router_backward_on_ranks(comm, config, x, router, forward.routing.tokens, d_combine,
                                                stored.gate_weights, grads.x);
  return grads;
}

// ---- measurement ----

LayoutChoice measure_layouts(Communicator& comm, const MoeConfig& config, const Matrix& x, const Matrix& dy,
                             const ExpertParallelWeights& stored, std::span<const int> candidates, int timed_calls) {
  uint64_t fingerprint = fnv1a_64_words({static_cast<uint64_t>(timed_calls)});  // the call count, then the candidates
  for (int r : candidates) fingerprint = fnv1a_64_words({static_cast<uint64_t>(r)}, fingerprint);
  check_same_on_every_rank(comm, "measure_layouts: the candidates and timed_calls", fingerprint);
  if (candidates.empty() || timed_calls < 1) {
    throw std::invalid_argument("measure_layouts: " + std::to_string(candidates.size()) + " candidates, timed_calls = " +
                                std::to_string(timed_calls) + "; expected at least one candidate and timed_calls >= 1");
  }
  LayoutChoice choice;
  choice.by = "measurement";
  choice.candidates.assign(candidates.begin(), candidates.end());
  std::sort(choice.candidates.begin(), choice.candidates.end());
  for (int r : choice.candidates) {
    ExpertLayoutOptions options;
    options.r = r;
    auto call = [&] {
      const ExpertLayoutForward forward = expert_layout_forward(comm, config, x, stored, options);
      expert_layout_backward(comm, config, x, stored, forward, dy);
    };
    call();  // untimed: first touches of the buffers
    std::vector<double> mine;
    for (int i = 0; i < timed_calls; ++i) {
      comm.barrier();  // the ranks start each call together
      const auto start = std::chrono::steady_clock::now();
      call();
      mine.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    }
    const std::vector<double> all = all_gather<double>(comm, mine);  // [R, timed_calls]
    std::vector<double> slowest(timed_calls, 0.0);
    for (int p = 0; p < comm.size(); ++p) {
      for (int i = 0; i < timed_calls; ++i) slowest[i] = std::max(slowest[i], all[p * timed_calls + i]);
    }
    std::sort(slowest.begin(), slowest.end());
    choice.measured_us.push_back(slowest[timed_calls / 2]);
  }
  size_t best = 0;
  for (size_t i = 1; i < choice.measured_us.size(); ++i) {
    if (choice.measured_us[i] < choice.measured_us[best]) best = i;
  }
  choice.r = choice.candidates[best];
  return choice;
}

}  // namespace moe::dist
