// sim/cost_model.cpp: the cost of each piece of the layer on the simulated cluster (cost_model.h).
#include "sim/cost_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace moe::sim {

namespace {

constexpr double kBytesPerUsPerGBs = 1e3;  // 1 GB/s moves 1000 bytes a microsecond
// What each launch moves for each expert it computes, a parameter: its bf16 weight read forward and
// again backward (2 + 2) and its fp32 gradient written (4).
constexpr double kLaunchBytesPerParameter = 8.0;

double padded(double rows, int64_t block) {
  const double B = static_cast<double>(block);
  return std::ceil(rows / B - 1e-9) * B;
}

}  // namespace

void check_layout(const LayerSpec& layer, int64_t ranks) {
  const int64_t r = layer.layout;
  if (r == 0 || r == 1) return;
  if (r < 0 || r > ranks || ranks % r != 0 || layer.hidden_dim % r != 0) {
    throw std::invalid_argument("layout r = " + std::to_string(r) + " on R = " + std::to_string(ranks) + " ranks with H = " +
                                std::to_string(layer.hidden_dim) + ": allowed r = 0, 1, or r dividing R and H");
  }
}

double LayerSpec::capacity_rows(int64_t ranks) const {
  if (capacity_factor <= 0) return 0;
  return std::ceil(capacity_factor * static_cast<double>(tokens_per_rank * ranks * top_k) / static_cast<double>(experts));
}

LayerSpec layer_spec_of(const MoeConfig& c) {
  return {.tokens_per_rank = c.tokens, .model_dim = c.model_dim, .hidden_dim = c.hidden_dim, .experts = c.num_experts,
          .top_k = c.top_k, .block_size = c.block_size,
          .capacity_factor = c.formulation == Formulation::dropless ? 0.0 : c.capacity_factor};
}

MoeConfig moe_config_of(const LayerSpec& layer) {
  return {.tokens = layer.tokens_per_rank, .model_dim = layer.model_dim, .hidden_dim = layer.hidden_dim,
          .num_experts = layer.experts, .top_k = layer.top_k,
          .formulation = layer.capacity_factor > 0 ? Formulation::dropping : Formulation::dropless,
          .capacity_factor = layer.capacity_factor > 0 ? layer.capacity_factor : 1.0, .block_size = layer.block_size};
}

CostModel::CostModel(const Calibration& calibration, const Cluster& cluster, const LayerSpec& layer)
    : calibration_(calibration), cluster_(cluster), layer_(layer) {
  if (layer.chunks < 1) throw std::invalid_argument("the pipelining degree d must be >= 1");
  check_placement(layer.experts, cluster.ranks());
  check_layout(layer, cluster.ranks());
  // The NVLink curve: the largest host size measured that fits in a node (else the smallest).
  for (const AllToAllCurve& curve : calibration_.all_to_all) {
    if (curve.ranks <= std::max<int64_t>(cluster.gpus_per_node, 2)) intra_curve_ = &curve;
  }
  if (intra_curve_ == nullptr) intra_curve_ = &calibration_.all_to_all.front();
  // The experts' time on one GPU at d = 1, 2, 4 fits t(d) = A + d B: A is the products' FLOPs at
  // the GPU's rate, B what every launch costs again for its experts (reading each expert's
  // weights, writing its gradients, the last partial wave of its tiles); least squares over the d
  // measured (one d: B = 0).
  const LayerShape& c = calibration_.layer;
  std::vector<std::pair<double, double>> points;  // (d, the experts' time)
  for (const auto& [d, phases] : calibration_.layer_phases_us) {
    const auto experts = phases.find("ep_experts");
    if (experts != phases.end() && experts->second > 0) points.emplace_back(static_cast<double>(d), experts->second);
  }
  if (points.empty()) throw std::invalid_argument("the calibration has no ep_experts phase for the layer on one GPU");
  double per_launch = 0, fixed = points.front().second;
  if (points.size() >= 2) {
    double mean_d = 0, mean_t = 0;
    for (const auto& [d, t] : points) {
      mean_d += d / static_cast<double>(points.size());
      mean_t += t / static_cast<double>(points.size());
    }
    double covariance = 0, variance = 0;
    for (const auto& [d, t] : points) {
      covariance += (d - mean_d) * (t - mean_t);
      variance += (d - mean_d) * (d - mean_d);
    }
    per_launch = std::max(0.0, covariance / variance);
    fixed = mean_t - per_launch * mean_d;
  }
  const double rows = static_cast<double>(c.tokens_per_rank * c.top_k) / static_cast<double>(c.experts);
  const double flops = 12.0 * static_cast<double>(c.model_dim * c.hidden_dim) * padded(rows, c.block_size) * static_cast<double>(c.experts);
  products_flops_per_us_ = flops / fixed;
  // B's per-expert part: what re-reading the experts' weights and adding their gradients costs
  // (kLaunchBytesPerParameter a parameter, 2 D H parameters an expert) at the HBM rate, at most B;
  // without that rate, all of B.
  const double expert_bytes = kLaunchBytesPerParameter * 2.0 * static_cast<double>(c.model_dim * c.hidden_dim);
  const double bytes_us = calibration_.device_copy_gbs > 0
                              ? static_cast<double>(c.experts) * expert_bytes / (calibration_.device_copy_gbs * kBytesPerUsPerGBs)
                              : per_launch;
  const double per_experts = std::min(per_launch, bytes_us);
  launch_us_per_expert_ = per_experts / static_cast<double>(c.experts);
  launch_us_fixed_ = per_launch - per_experts;
}

double CostModel::phase_d1(const char* name) const {
  const std::map<std::string, double>& phases = calibration_.layer_phases_us.at(1);
  const auto it = phases.find(name);
  return it == phases.end() ? 0.0 : it->second;
}

double CostModel::per_token_width(double tokens) const {
  const LayerShape& c = calibration_.layer;
  return tokens * static_cast<double>(layer_.model_dim) / static_cast<double>(c.tokens_per_rank * c.model_dim);
}

double CostModel::route_us(double tokens) const { return phase_d1("ep_route") * per_token_width(tokens); }
double CostModel::permute_us(double tokens) const { return phase_d1("ep_permute") * per_token_width(tokens); }
double CostModel::combine_us(double tokens) const { return phase_d1("ep_combine") * per_token_width(tokens); }
double CostModel::combine_backward_us(double tokens) const { return phase_d1("ep_combine_backward") * per_token_width(tokens); }
double CostModel::router_backward_us(double tokens) const { return phase_d1("ep_router_backward") * per_token_width(tokens); }

double CostModel::unnamed_us(double tokens) const {
  double named = 0;
  for (const auto& [name, us] : calibration_.layer_phases_us.at(1)) named += us;
  return std::max(0.0, calibration_.layer_step_us.at(1) - named) * per_token_width(tokens);
}

double CostModel::sgd_us() const {
  const LayerShape& c = calibration_.layer;
  const double here = static_cast<double>(layer_.experts / cluster_.ranks()) * static_cast<double>(layer_.model_dim * layer_.hidden_dim);
  return phase_d1("sgd_experts") * here / static_cast<double>(c.experts * c.model_dim * c.hidden_dim);
}

double CostModel::experts_us(const std::vector<double>& rows_of_experts, int64_t chunks, bool backward) const {
  if (rows_of_experts.empty()) return 0;
  double computed = 0;
  for (double rows : rows_of_experts) computed += padded(rows / static_cast<double>(chunks), layer_.block_size);
  const LayerShape& c = calibration_.layer;
  const double width = static_cast<double>(layer_.model_dim * computed_hidden());
  // Forward: two products of 2 D H FLOPs a row; backward twice that (the input's and the weights'
  // gradients). The launch cost splits the same way: the weights read forward; read again and a
  // gradient written backward.
  const double share = backward ? 2.0 / 3.0 : 1.0 / 3.0;
  const double products = share * 12.0 * width * computed / products_flops_per_us_;
  const double launch = share * (launch_us_per_expert_ * static_cast<double>(rows_of_experts.size()) + launch_us_fixed_) *
                        width / static_cast<double>(c.model_dim * c.hidden_dim);
  return products + launch;
}

int64_t CostModel::computed_hidden() const { return layer_.layout > 1 ? layer_.hidden_dim / layer_.layout : layer_.hidden_dim; }

double CostModel::layout_weights_us(bool backward) const {
  const int64_t R = cluster_.ranks(), G = std::min(cluster_.gpus_per_node, R), r = layer_.layout;
  if (r == 1 || R == 1) return 0;
  const double expert_parameters = 2.0 * static_cast<double>(layer_.model_dim * layer_.hidden_dim);
  const double stored = static_cast<double>(layer_.experts / R) * expert_parameters;  // a rank's E / R experts
  const double bytes_per_parameter = backward ? 4.0 : 2.0;  // fp32 gradients back, bf16 weights out
  if (r == 0) {
    // Forward: every rank's experts to every other rank. Backward: a ring all-reduce of all E.
    const double egress = backward ? 2.0 * static_cast<double>(R - 1) / static_cast<double>(R) * static_cast<double>(R) * stored
                                   : static_cast<double>(R - 1) * stored;
    const double near = egress * static_cast<double>(G - 1) / static_cast<double>(R - 1);
    return std::max(intra_node_us(near * bytes_per_parameter, G - 1),
                    inter_node_us((egress - near) * bytes_per_parameter, R - G));
  }
  // r > 1: (r - 1) / r of the rank's experts to the other ranks of its group, consecutive ranks.
  const double egress = static_cast<double>(r - 1) / static_cast<double>(r) * stored * bytes_per_parameter;
  return r <= G ? intra_node_us(egress, r - 1) : std::max(intra_node_us(egress * static_cast<double>(G - 1) / static_cast<double>(r - 1), G - 1),
                                                          inter_node_us(egress * static_cast<double>(r - G) / static_cast<double>(r - 1), r - G));
}

double CostModel::shadow_weights_us(const StepLoad& load, bool backward) const {
  if (load.shadowed_this_step.empty()) return 0;
  const int64_t R = load.ranks, G = std::min(cluster_.gpus_per_node, R), per_rank = load.experts_per_rank();
  const double expert_bytes = (backward ? 4.0 : 2.0) * 2.0 * static_cast<double>(layer_.model_dim * computed_hidden());
  std::vector<double> stored(static_cast<size_t>(R), 0.0);  // shadowed experts each rank stores
  for (int64_t e : load.shadowed_this_step) stored[static_cast<size_t>(e / per_rank)] += 1;
  double slowest = 0;
  for (int64_t r = 0; r < R; ++r) {
    // Forward: r sends its own to every peer, receives every peer's; backward the reverse, the same bytes.
    double near_out = 0, far_out = 0, near_in = 0, far_in = 0;
    for (int64_t t = 0; t < R; ++t) {
      if (t == r) continue;
      const bool near = cluster_.same_node(r, t);
      (near ? near_out : far_out) += stored[static_cast<size_t>(r)] * expert_bytes;
      (near ? near_in : far_in) += stored[static_cast<size_t>(t)] * expert_bytes;
    }
    slowest = std::max({slowest, intra_node_us(std::max(near_out, near_in), G - 1), inter_node_us(std::max(far_out, far_in), R - G)});
  }
  return slowest;
}

double CostModel::replica_all_reduce_us(const StepLoad& load) const {
  if (load.replicas == 0) return 0;
  const double expert_bytes = 4.0 * 2.0 * static_cast<double>(layer_.model_dim * layer_.hidden_dim);  // fp32 W1 and W2
  double slowest = 0;
  for (int64_t r = 0; r < load.ranks; ++r) {
    double bytes = 0;
    for (int64_t e : load.slot_experts[static_cast<size_t>(r)]) {
      const double n = static_cast<double>(load.holders[static_cast<size_t>(e)]);
      if (n > 1) bytes += 2.0 * (n - 1) / n * expert_bytes;
    }
    // Over NVLink inside a node; where the cluster spans nodes, priced at the NIC (the groups of
    // the hottest experts reach across them).
    slowest = std::max(slowest, cluster_.nodes > 1 ? inter_node_us(bytes, 1) : intra_node_us(bytes, 1));
  }
  return slowest;
}

double CostModel::intra_node_us(double egress_bytes, int64_t peers) const {
  if (peers <= 0 || egress_bytes <= 0) return 0;
  const double Rc = static_cast<double>(intra_curve_->ranks);
  const double bytes_per_rank = egress_bytes * Rc / (Rc - 1);  // the curve's x: a rank's bytes, self share included
  const double extra_peers = std::max<double>(0.0, static_cast<double>(peers) - (Rc - 1));
  return intra_curve_->curve.at(bytes_per_rank) + calibration_.intra_node_per_peer_us * extra_peers;
}

double CostModel::inter_node_us(double egress_bytes, int64_t peers) const {
  if (peers <= 0 || egress_bytes <= 0) return 0;
  const InterNode& n = calibration_.inter_node;
  return n.latency_us + egress_bytes / (n.nic_gbs * n.efficiency * kBytesPerUsPerGBs) + n.per_peer_us * static_cast<double>(peers);
}

double CostModel::flat_us(const StepLoad& load, double fraction, bool back) const {
  const int64_t R = load.ranks, G = std::min(cluster_.gpus_per_node, R);
  const double bytes = fraction * layer_.bytes_per_row();
  double slowest = 0;
  for (int64_t r = 0; r < R; ++r) {
    double near_out = 0, near_in = 0, far_out = 0, far_in = 0;
    for (int64_t t = 0; t < R; ++t) {
      if (t == r) continue;
      const double out = back ? load.sent(t, r) : load.sent(r, t);
      const double in = back ? load.sent(r, t) : load.sent(t, r);
      (cluster_.same_node(r, t) ? near_out : far_out) += out;
      (cluster_.same_node(r, t) ? near_in : far_in) += in;
    }
    const double near = intra_node_us(std::max(near_out, near_in) * bytes, G - 1);
    const double far = inter_node_us(std::max(far_out, far_in) * bytes, R - G);
    slowest = std::max(slowest, std::max(near, far));
  }
  return slowest;
}

double CostModel::hierarchical_us(const StepLoad& load, double fraction, bool back) const {
  const int64_t R = load.ranks, G = cluster_.gpus_per_node, N = cluster_.nodes;
  if (N == 1 || G == 1) return flat_us(load, fraction, back);
  const double bytes = fraction * layer_.bytes_per_row();
  auto sent = [&](int64_t s, int64_t t) { return back ? load.sent(t, s) : load.sent(s, t); };
  // Phase 1, inside the node: rank (n, i) hands local peer (n, j) every row bound for local index j.
  // Phase 2, between nodes: (n, j) sends node m's share, gathered from its whole node, to (m, j).
  std::vector<double> node_to_rank(static_cast<size_t>(N * R), 0.0);  // [n][t]: rows node n sends to rank t
  double phase1 = 0, copies = 0;
  for (int64_t r = 0; r < R; ++r) {
    double out = 0, in = 0, total = 0;
    for (int64_t t = 0; t < R; ++t) {
      const double rows = sent(r, t);
      total += rows;
      node_to_rank[static_cast<size_t>(cluster_.node_of(r) * R + t)] += rows;
      if (cluster_.local_index(t) != cluster_.local_index(r)) out += rows;
    }
    // What (n, j) receives in phase 1: from each local peer (n, i), i != j, its rows for index j.
    const int64_t n = cluster_.node_of(r), j = cluster_.local_index(r);
    for (int64_t i = 0; i < G; ++i) {
      if (i == j) continue;
      for (int64_t m = 0; m < N; ++m) in += sent(n * G + i, m * G + j);
    }
    phase1 = std::max(phase1, intra_node_us(std::max(out, in) * bytes, G - 1));
    if (calibration_.device_copy_gbs > 0) copies = std::max(copies, 2.0 * total * bytes / (calibration_.device_copy_gbs * kBytesPerUsPerGBs));
  }
  double phase2 = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = cluster_.node_of(r), j = cluster_.local_index(r);
    double out = 0, in = 0;
    for (int64_t m = 0; m < N; ++m) {
      if (m == n) continue;
      out += node_to_rank[static_cast<size_t>(n * R + m * G + j)];
      in += node_to_rank[static_cast<size_t>(m * R + r)];
    }
    phase2 = std::max(phase2, inter_node_us(std::max(out, in) * bytes, N - 1));
  }
  return phase1 + phase2 + copies;
}

double CostModel::all_to_all_us(const StepLoad& load, double fraction, bool back) const {
  if (load.ranks == 1) {
    // One GPU: the exchange is a local copy; the one-GPU layer timed its four of them (the
    // forward's two and their backward twins) as ep_dispatch + ep_combine_exchange.
    const LayerShape& c = calibration_.layer;
    const double copy_us = (phase_d1("ep_dispatch") + phase_d1("ep_combine_exchange")) / 4.0;
    const double rows = load.sent(0, 0) * fraction;
    return copy_us * rows * static_cast<double>(layer_.model_dim) / static_cast<double>(c.tokens_per_rank * c.top_k * c.model_dim);
  }
  return layer_.all_to_all == AllToAllKind::hierarchical ? hierarchical_us(load, fraction, back) : flat_us(load, fraction, back);
}

double CostModel::exchange_kernels_us(const StepLoad& load, double fraction, bool back) const {
  const int64_t R = load.ranks;
  if (R == 1) return 0;
  double largest = 0;
  for (int64_t r = 0; r < R; ++r) {
    double out = 0, in = 0;
    for (int64_t t = 0; t < R; ++t) {
      if (t == r) continue;
      out += back ? load.sent(t, r) : load.sent(r, t);
      in += back ? load.sent(r, t) : load.sent(t, r);
    }
    largest = std::max(largest, std::max(out, in));
  }
  const int64_t peers = std::max<int64_t>(1, std::min(cluster_.gpus_per_node, R) - 1);
  return intra_node_us(largest * fraction * layer_.bytes_per_row(), peers);
}

double CostModel::beside_exchange_us(double experts_us, double exchange_kernels_us) const {
  return experts_us + calibration_.overlap_contention.sigma * std::min(experts_us, exchange_kernels_us);
}

double CostModel::uniform_all_to_all_us(double bytes_per_rank) const {
  const int64_t R = cluster_.ranks();
  const StepLoad load = step_load_from_shares(std::vector<double>(static_cast<size_t>(R), 1.0 / static_cast<double>(R)), R,
                                              bytes_per_rank / layer_.bytes_per_row());
  return all_to_all_us(load, 1.0, false);
}

double CostModel::count_exchange_us() const {
  const int64_t R = cluster_.ranks(), G = std::min(cluster_.gpus_per_node, R);
  if (R == 1) return phase_d1("ep_count_exchange");
  const std::map<int64_t, double>& measured = calibration_.count_exchange_us;
  if (measured.empty()) throw std::invalid_argument("the calibration has no count exchange at R >= 2");
  auto it = measured.upper_bound(G);  // the largest host size measured <= G, else the smallest
  if (it != measured.begin()) --it;
  const double intra = it->second + calibration_.intra_node_per_peer_us * std::max<double>(0.0, static_cast<double>(G - it->first));
  const double inter = cluster_.nodes > 1 ? inter_node_us(1.0, R - G) : 0.0;
  return std::max(intra, inter);
}

double CostModel::small_all_reduce_us() const {
  return cluster_.ranks() == 1 ? phase_d1("ep_router_all_reduce") : count_exchange_us();
}

}  // namespace moe::sim
