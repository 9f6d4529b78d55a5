// offload/host_expert_choice.h: which of an MoE block's missing experts to compute on the host
// instead of copying them to the GPU, the three-way choice of an offloading decoder: an expert in a
// GPU slot is a hit (computed there); a missing one is either copied over PCIe into a slot and
// computed on the GPU, or computed on the host from the pinned weights (cpu_expert.h) while the GPU
// runs the rest. Fiddler (Kamahori et al., 2024) makes the same choice per expert; llama.cpp's
// --cpu-moe makes it once for all experts.
//
// The two ways for a missing expert use two different resources that run side by side: the copy
// engine (the block's copies go one after another over PCIe) and the host's cores (its experts go
// one after another, each on every thread). A block waits for the slower of the two, so the choice
// is the split of the misses that makes the larger sum smallest:
//
//   given n misses, each with its rows r_e this step,
//   copy(e) = copy_ms                  (bytes / the PCIe rate: the same for every expert)
//   host(e) = host_ms(r_e)             (the host's FFN on r_e rows: measured, grows with r_e)
//   choose S minimizing max( copy_backlog + sum_{e not in S} copy(e),
//                            host_backlog + [S not empty] host_block + sum_{e in S} host(e) )
//
// host_block is what a block pays once for taking the host path at all: its rows read back to the
// host, the host's threads woken from their sleep, the computed rows sent up. At small experts it
// outweighs the experts themselves (a Switch-like expert is 0.2 ms on the host, as long as its copy).
//
// The backlogs are the work each resource already has before this block's misses: the copies
// still queued on the copy engine (prefetches, the previous block's misses), and the host experts
// it will compute first (with a pre-gate a block's split is chosen one block ahead, before the host
// computes the block in between). They make the choice a list schedule over the blocks: a lone
// miss goes to whichever resource frees first, so consecutive blocks alternate between the two
// even when one of them is a little slower per expert.
//
// Since every copy costs the same, the best S of each size k is the k experts with the fewest rows
// (the cheapest on the host), so trying k = 0..n over the experts sorted by host(e) finds the
// optimum exactly (host_block is the same for every k >= 1). Ties go to the smaller k: a copied expert also fills the cache for later steps.
// The GPU's own expert time is not in the sum: in this engine the GPU runs a block's expert kernels
// over every chosen expert either way (a host expert's rows are replaced afterwards, see
// moe/moe_layer.h: ReplacedRows), so it costs the same on both sides.
//
// Plain C++, no CUDA: tested on any machine (tests/offload/test_host_expert_choice.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moe::cuda {

// When a decoder computes experts on the host:
//   off     never: every miss is copied (the Pre-gated MoE modes as published)
//   misses  every expert that is not in a GPU slot when its block needs it (llama.cpp --cpu-moe,
//           for the experts the cache does not hold)
//   auto    the cost model above, per block and step
enum class HostExperts { off, misses, cost_model };

std::string_view to_string(HostExperts mode);  // "off", "misses", "auto"
// Throws std::invalid_argument listing the allowed words.
HostExperts parse_host_experts(std::string_view text);

// The cost model's inputs, measured when the decoder starts (offloaded_experts.h: measure_host_expert_costs).
struct HostExpertCosts {
  double copy_ms = 0;            // one expert from pinned host memory into a GPU slot
  std::vector<double> host_ms;   // [r - 1]: the host's FFN of one expert on r rows, r = 1 .. size()
  // The GPU's own work between two MoE blocks (attention, the dense parts, the experts in its
  // slots), which the copy engine runs beside: a decoder's gpu_only step over its MoE blocks.
  // 0 when not known; the backlogs (below) then count the copy engine's queue too long.
  double gpu_block_ms = 0;
  // What a block pays once when it computes any expert on the host: the round trip of its rows
  // (read back, computed rows up) and waking the host's threads. 0 when not known.
  double host_block_ms = 0;

  // host_ms at `rows` >= 1: the table's value, or beyond it a straight line through its last two
  // points (one point: proportional to rows). Throws std::invalid_argument for rows < 1 or an empty
  // table.
  double host_ms_at(int64_t rows) const;
};

// The misses' split. misses: expert ids (any order); rows[i] >= 1: misses[i]'s rows. Returns the
// ids to compute on the host, ascending. Throws std::invalid_argument when the spans' sizes differ,
// a row count is < 1, or copy_ms is not > 0 with the cost model.
struct Backlogs {
  double copy_ms = 0;  // the copy engine's queued work
  double host_ms = 0;  // the host's queued work
};
std::vector<int32_t> choose_host_experts(HostExperts mode, std::span<const int32_t> misses,
                                         std::span<const int64_t> rows, const HostExpertCosts& costs,
                                         Backlogs backlogs = {});

// The predicted time until both resources have finished the block's misses with that split:
// max(copy backlog + copies, host backlog + host work), in ms (what the cost model minimizes); the
// host work holds host_block_ms when the split puts any expert on the host.
double predicted_miss_ms(std::span<const int32_t> misses, std::span<const int64_t> rows,
                         std::span<const int32_t> on_host, const HostExpertCosts& costs, Backlogs backlogs = {});

}  // namespace moe::cuda
