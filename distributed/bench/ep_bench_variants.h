// ep_bench_variants.h: the rows of ep_bench, one small description each (nccl-tests keeps one file
// per collective; so does this folder), handed to the harness (ep_bench_harness.h):
//   count_exchange     the layer's count exchange alone: each rank's routing summary gathered to
//                      every host; its time is the host synchronisation a forward pays
//   alltoall           raw all-to-all of the same bytes, through the communicator's all_to_all_v
//                      with equal counts (NCCL: grouped send / recv), the first row as in nccl-tests
//   dispatch+combine   the EP layer with identity experts: routing, count exchange, the rows to the
//                      experts' ranks and back, the combine; size = the bytes a rank dispatches
//   ... 2dh G=N        the same two through Tutel's 2DH all-to-all, nodes of G ranks (--nodes-of)
//   ep_layer d=N       the layer's training step (forward, backward, SGD on the experts), at each degree
//   ep_layer adaptive  the layer choosing d itself (pipeline_chunks = kAdaptivePipelineChunks): its
//                      trials run before the timing; the row times its choice
//   ep_layer r=N       (--layouts) the layer's step in Tutel's layout r (0: data-parallel experts,
//                      r > 1: sharded over r ranks along H; r = 1: the d=1 step again, beside them)
//   ep_layer eplb1 ... (--placements) the d=1 step with the experts placed by load: plain, EPLB
//                      with 1 or 2 spare slots a rank, the busiest expert shadowed (stored on every
//                      rank), and shadow_step: the experts worth shadowing chosen each step and broadcast
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ep_bench_harness.h"
#include "ep/expert_parallel_gpu.h"  // PipelineChoice
#include "moe_config.h"           // MoeConfig

namespace moe::dist::bench {

// The runs after a row's timing that time the layer's phases (Variant::phases).
constexpr int kPhaseRuns = 5;

// A row whose exchanges run flat or, with ranks_per_node G > 1, through Tutel's 2DH all-to-all over
// nodes of G ranks: its context, G, and its name (`base`, with " 2dh G=<G>" after it for 2DH).
class ExchangeVariant : public Variant {
 public:
  ExchangeVariant(BenchContext& ctx, int ranks_per_node, std::string base)
      : ctx_(ctx), ranks_per_node_(ranks_per_node), base_(std::move(base)) {}
  std::string name() const override {
    return ranks_per_node_ > 1 ? base_ + " 2dh G=" + std::to_string(ranks_per_node_) : base_;
  }

 protected:
  BenchContext& ctx_;
  int ranks_per_node_ = 0;

 private:
  std::string base_;
};

std::unique_ptr<Variant> make_count_exchange_variant(BenchContext& ctx);
// ranks_per_node G > 1: through the 2DH all-to-all; 0: flat.
std::unique_ptr<Variant> make_alltoall_variant(BenchContext& ctx, int ranks_per_node = 0);
std::unique_ptr<Variant> make_dispatch_combine_variant(BenchContext& ctx, int ranks_per_node = 0);

// The layer rows share one problem: inputs, weights, and the single-GPU layer's output on all
// ranks' tokens (the check), made once. Its shape is the options' --layer, scaled down (with a
// line in `messages`) where ranks share a GPU or it would not fit in the GPU's memory.
struct LayerProblem;
std::shared_ptr<LayerProblem> make_layer_problem(BenchContext& ctx, std::vector<std::string>& messages);
// pipeline_chunks = kAdaptivePipelineChunks: the layer's own trials run in prepare(), and `choice`
// (when given) receives what they chose and measured.
std::unique_ptr<Variant> make_layer_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem,
                                            int pipeline_chunks, std::shared_ptr<PipelineChoice> choice = nullptr);
// The layer at d = 1 with the experts placed by `placement`: plain, eplb1, eplb2, shadow or shadow_step
// (variant_layer.cpp); `note` receives the placement and the rows each rank computed.
std::unique_ptr<Variant> make_placement_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem,
                                                const std::string& placement, std::shared_ptr<std::string> note);
// The layer at d = 1 in Tutel's layout r (set_layout); r = 1 is the d = 1 row's step.
std::unique_ptr<Variant> make_layout_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem, int layout);
// The layer at d = 1 as two micro-batches of T_r / 2 tokens, overlapped in the language model's
// schedule (variant_layer.cpp): the d = 1 row's step with and without overlap.
std::unique_ptr<Variant> make_overlap_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem);
struct LayerSummary {
  MoeConfig config;  // T = all ranks' tokens
  int64_t tokens_per_rank = 0;
  std::string description;  // "T=... per rank (T=... in all), D=..., ..."
};
LayerSummary layer_summary(const LayerProblem& problem);

}  // namespace moe::dist::bench
