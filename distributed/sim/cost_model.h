// sim/cost_model.h: how long each piece of the expert-parallel layer takes on the simulated
// cluster, from the calibration alone.
//
// The model, piece by piece (every constant comes from the calibration file):
//   - routing, permuting, combining, the router's backward and what no phase names: the one-GPU
//     layer's phase medians, scaled by tokens x width (T D);
//   - the experts: the one-GPU layer's experts at d = 1, 2, 4 fit t(d) = A + d B, the FLOPs at the
//     GPU's rate (A) and a cost that each launch pays again (B). B splits into what the experts'
//     own bytes explain, paid for each expert a rank holds (each launch reads an expert's bf16 W1
//     and W2 forward and again backward and writes its fp32 gradients: 8 bytes a parameter at the
//     HBM rate), and the rest, paid once a launch whatever the experts (the tiles' last partial
//     wave, the kernels' start, the later chunks' gradients added into the first's): a rank of 8
//     experts takes about as long as one of 16 on the same rows (lessons/09_simulator.measured.md). Rows are
//     padded to the block size B, as the block-sparse kernels pad them; backward = 2 x forward,
//     every part;
//   - the experts' SGD: the one-GPU figure, scaled by the parameters a rank holds;
//   - an exchange beside the experts (Tutel's chunks, two micro-batches): the two kernels share one
//     GPU, and the experts lose sigma of the time the exchange's kernels run beside them
//     (calibration.h's overlap_contention, measured: about 1 on an NVLink host, they take turns);
//   - an all-to-all inside a node: the measured NCCL curve (time against bytes a rank at R_c
//     ranks), read at the bytes that leave the GPU, plus a per-peer cost for more peers than R_c - 1;
//   - between nodes: latency + bytes / (NIC x efficiency) + a per-peer cost (published figures);
//     a flat all-to-all runs its NVLink and its NIC parts at once, and ends with its slowest rank;
//   - Tutel's 2D hierarchical all-to-all (2DH): first inside each node (rows grouped by the local
//     index of their destination), then between nodes among the GPUs of one local index (N - 1
//     peers, G x larger messages), with a local reorder of the rows before and after (HBM copies);
//   - the count exchange and the router's all-reduce: the measured small all-to-all at R_c, the
//     per-peer cost beyond it, and the inter-node latency when there are nodes.
//
// Tests: ctest -R SimCostModel (hand-computed cases). Dimension legend: T tokens a rank, D model
// width, H expert hidden width, E experts, K top-k, B block size, R ranks, G GPUs a node, N nodes,
// d pipelining degree.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_config.h"       // MoeConfig
#include "sim/calibration.h"  // Calibration
#include "sim/cluster.h"      // Cluster
#include "sim/step_load.h"    // StepLoad

namespace moe::sim {

enum class AllToAllKind { flat, hierarchical };

struct LayerSpec {
  int64_t tokens_per_rank = 16384;  // T
  int64_t model_dim = 2048;         // D
  int64_t hidden_dim = 8192;        // H
  int64_t experts = 32;             // E, all ranks together
  int64_t top_k = 2;                // K
  int64_t block_size = 128;         // B
  double capacity_factor = 0;       // 0: dropless; else C = capacity_factor T R K / E rows an expert
  int64_t chunks = 1;               // d, Tutel's pipelining degree
  AllToAllKind all_to_all = AllToAllKind::flat;
  bool overlap = false;             // two micro-batches, one's exchanges under the other's compute
  int64_t redundant_slots = 0;      // S: replicas of the hottest experts a rank may hold (step_load.h)
  bool shadow_per_step = false;     // FasterMoE's shadowing, decided from each step's counts (step_load.h)
  int64_t layout = 1;               // Tutel's r: 1 expert parallel; 0 every rank computes every expert
                                    // (their weights gathered, their gradients all-reduced); r > 1
                                    // experts sharded along H over groups of r ranks (step_load.h)

  double capacity_rows(int64_t ranks) const;  // C, or 0 when dropless
  double bytes_per_row() const { return 2.0 * static_cast<double>(model_dim); }  // bf16
};

// Throws std::invalid_argument unless r is 0, 1, or divides R and H (layouts r > 1 shard H over r).
void check_layout(const LayerSpec& layer, int64_t ranks);

// The layer of an MoE layer's config (its T is the tokens a rank), and the config of a layer: the
// run records and the language model speak MoeConfig.
LayerSpec layer_spec_of(const MoeConfig& config);
MoeConfig moe_config_of(const LayerSpec& layer);

class CostModel {
 public:
  CostModel(const Calibration& calibration, const Cluster& cluster, const LayerSpec& layer);

  // Phases of one rank handling `tokens` tokens (their T K rows): microseconds.
  double route_us(double tokens) const;
  double permute_us(double tokens) const;
  double combine_us(double tokens) const;
  double combine_backward_us(double tokens) const;
  double router_backward_us(double tokens) const;
  double unnamed_us(double tokens) const;  // what the one-GPU step spends outside every phase
  double sgd_us() const;                   // the experts' SGD on one rank's E / R experts
  // The replicated experts' fp32 weight gradients summed over their holders (a ring all-reduce in
  // each expert's group, every group at once), the slowest rank's time; 0 without replicas.
  double replica_all_reduce_us(const StepLoad& load) const;
  // Shadowing decided per step (StepLoad::shadowed_this_step): each storing rank sends its shadowed
  // experts' bf16 weights to every other rank before the experts run (backward = false), and each
  // other rank sends its fp32 gradients of them back after the backward (true): an all-to-all of
  // P = 2 D H elements an expert, the slowest rank's time. 0 when nothing is shadowed.
  double shadow_weights_us(const StepLoad& load, bool backward) const;
  // Tutel's layouts r != 1: the experts' weights a rank gathers before its forward (bf16) and their
  // gradients sent back after its backward (fp32): r = 0 an all-gather of every rank's experts and
  // an all-reduce of all E experts' gradients; r > 1 an all-to-all inside the group of r ranks,
  // (r - 1) / r of the rank's E / R experts each way. 0 at r = 1.
  double layout_weights_us(bool backward) const;
  int64_t computed_hidden() const;  // H, or H / r at r > 1: the width of the experts a rank computes

  // The experts of one rank: rows_of_experts[i] rows for its i-th expert, split into `chunks`
  // launches; the time of ONE launch (forward, or backward = 2 x forward FLOPs).
  double experts_us(const std::vector<double>& rows_of_experts, int64_t chunks, bool backward) const;
  double products_tflops() const { return products_flops_per_us_ / 1e6; }  // A's rate
  double launch_us_per_expert() const { return launch_us_per_expert_; }     // B's per-expert part / E, forward + backward
  double launch_us_fixed() const { return launch_us_fixed_; }               // B's part paid once a launch

  // One exchange of `load` (its rows x fraction, D-wide bf16), out (s -> t) or back (t -> s).
  double all_to_all_us(const StepLoad& load, double fraction, bool back) const;
  // The same, for uniform traffic of bytes_per_rank a rank (ep_bench's raw all-to-all rows).
  double uniform_all_to_all_us(double bytes_per_rank) const;
  double count_exchange_us() const;
  double small_all_reduce_us() const;

  // What an exchange's kernels take of the GPU: its largest egress (or ingress) at NVLink's
  // measured rate, whether the bytes stay in the node or leave it through the NIC (between nodes
  // the kernels move the same bytes, slower; that contention is assumed, not measured). 0 at R = 1.
  double exchange_kernels_us(const StepLoad& load, double fraction, bool back) const;
  // An experts launch of experts_us with exchanges whose kernels take exchange_kernels_us running
  // beside it: experts_us + sigma min(experts_us, exchange_kernels_us).
  double beside_exchange_us(double experts_us, double exchange_kernels_us) const;
  double overlap_contention() const { return calibration_.overlap_contention.sigma; }

  // Pieces the validation and the tests look at.
  double intra_node_us(double egress_bytes, int64_t peers) const;
  double inter_node_us(double egress_bytes, int64_t peers) const;

  const Cluster& cluster() const { return cluster_; }
  const LayerSpec& layer() const { return layer_; }

 private:
  double phase_d1(const char* name) const;  // the one-GPU phase at d = 1, 0 if not measured
  double per_token_width(double tokens) const;  // tokens x D over the calibration's T x D
  double flat_us(const StepLoad& load, double fraction, bool back) const;
  double hierarchical_us(const StepLoad& load, double fraction, bool back) const;

  Calibration calibration_;
  Cluster cluster_;
  LayerSpec layer_;
  const AllToAllCurve* intra_curve_ = nullptr;      // the host size closest to G from below
  double products_flops_per_us_ = 0;  // the experts' products, padded rows counted
  double launch_us_per_expert_ = 0;   // at the calibration's D H; scaled by D H
  double launch_us_fixed_ = 0;        // at the calibration's D H; scaled by D H
};

}  // namespace moe::sim
