// expert_parallel_gpu.h: FastMoE's expert-parallel MoE layer on the GPU (He et al., 2021), with
// Tutel's pipelining of the exchange against the experts (Hwang et al., MLSys 2023). One process
// per rank, one GPU per rank (NCCL) or several ranks on one GPU (MPI, staged through host memory).
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_parallel_gpu          (ranks may share a GPU)
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_parallel_gpu_nccl     (one GPU per rank)
//   mpirun -np 2 build/distributed/bench/ep_bench --backend nccl
//   mpirun -np 2 build/lessons/lesson06_expert_parallelism --gpu
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_layouts_gpu    (Tutel's layouts r)
//
// Dimension legend: T tokens (all ranks together), T_r this rank's, D model width, H expert hidden
// width, E experts, K top-k, C capacity, B block size, R ranks, E_r = E / R experts a rank, d chunks;
// Tutel's layout r, E_c the experts a rank computes in it (E_r, E at r = 0, r E_r at r > 1) and
// H_c their hidden columns (H, H / r at r > 1).
//
// Placement and the rules of the exchange are those of the CPU reference (expert_parallel_cpu.h,
// expert_parallel_plan.h): tokens sharded in token order (rank r holds T_r of them, any T_r >= 0),
// rank r owns experts [r E_r, (r + 1) E_r) by default, or the slots of options.placement
// (expert_placement.h: any E over any R, replicated and shadowed experts; layout r = 1 only). The
// router is replicated, each rank holds only its own slots' W1 and W2 (addressed through per-expert
// pointer tables, as MoeLayerGpu's). A replicated expert's rows split over its replicas by the
// placement's routing rule, and its weight gradients are summed over its replicas after the
// backward (one fp32 all-reduce of the replicated experts over all ranks, zeros where a rank holds
// none of them), so every replica gets the expert's whole gradient.
//
// Shadowing decided per step (options.shadow_per_step; FasterMoE, He et al., PPoPP 2022). Once the
// count exchange has given every rank the R x E counts, every rank computes the same set S =
// worth_shadowing(placement, counts): the experts whose rows crossing ranks would carry more bytes
// than moving the expert does. The step then runs over placement.with_shadowed(S): each expert of S
// is on every rank and takes only its own rank's rows, so none of them travel. Its storing rank
// sends its bf16 W1 and W2 to every other rank (one all-to-all-v of the packed experts, before the
// experts run; the step's slot tables point at the copies), and after the backward each other rank
// sends its fp32 gradient of it back (the reverse all-to-all-v), where it is added to the storing
// rank's own, in rank order. Nothing outside the step changes: the caller keeps only its stored
// experts and their gradients. last_step().shadowed lists S. Same results as without shadowing
// within fp32 summation order (each rank's rows of a shadowed expert are summed on their own rank,
// then across ranks).
//
// Forward, reusing cuda/'s launchers (moe/router.h, dispatch.h, topology.h, permute.h,
// block_sparse.h) on this rank's T_r tokens:
//   1. route locally     router logits (cuBLAS), fused softmax + top-K + combine weights, and the
//                        stable sort of the T_r K slots by expert (the dispatch plan's routed_slots);
//   2. count exchange    one all-gather of each rank's routing summary (T_r, the E routed counts,
//                        its router statistics), read back to the host: THE ONE HOST
//                        SYNCHRONISATION of a forward, as in FastMoE, which reads the counts back to
//                        size its buffers. Every rank then knows the R x E count matrix and computes
//                        the same ExchangePlan (capacity over all T tokens, chunks, offsets);
//   3. dispatch          gather the kept slots' rows into send order (permute_tokens over a view of
//                        the send order), all-to-all-v of the bf16 rows (DeviceExchange);
//   4. local experts     over exactly the rows received: their plan (rows per local expert, B-rounded
//                        or the capacity's share) comes from the received counts, the row map from a
//                        small kernel, then permute_tokens, and the dropless block-sparse FFN over the
//                        topology of the E_r local experts (padded / dropping: cuBLAS batched GEMMs
//                        over [E_r, C_c, D], as MoeLayerGpu computes them);
//   5. combine exchange  the expert outputs, back in the order received, all-to-all-v home;
//   6. weighted combine  y[t] = sum_k w[t, k] out(t, k) (unpermute_and_combine; dropped slots add 0).
// Backward mirrors it: combine_backward at home, the output gradients' rows to the experts, the
// block-sparse (or batched) backward, d(input rows) back home, the un-gather and the router
// backward; expert weight gradients stay on their rank, the router weight gradient is all-reduced
// only when options.all_reduce_router_gradient (data parallel; otherwise each rank's part).
// The router losses are global: f_e from the count matrix, P_e and the z-loss from the summaries.
//
// Host synchronisation: exactly one wait of the host per forward (the count read-back) on the NCCL
// backend, none in the backward. On the MPI backend every exchange also waits twice (before MPI
// reads the staged rows, and after they are back on the device): 1 + 4 d waits in a forward, 4 d
// (+ 2 for the router's all-reduce) in a backward; with the 2DH exchange each exchange is two staged
// stages, 1 + 8 d and 8 d (+ 2). last_step() counts them; ep_bench prints them. Buffers that depend
// on the counts grow when a forward needs more (cudaMalloc, which itself synchronises) and are kept.
//
// Tutel's pipelining, options.pipeline_chunks = d: the rows of every expert in d chunks (the rule
// of expert_parallel_plan.h); chunk c + 1's all-to-all runs on the layer's exchange stream while
// chunk c's experts run on the caller's stream (events order them). On NCCL the two overlap on
// the GPU. On MPI the exchange is the host's (the host blocks in MPI while the GPU runs the
// enqueued experts), so the schedule is the same but its timings are not an interconnect's.
// d = 2, 4 and 8 give y, dx and the router gradient bit for bit equal to d = 1 wherever the expert
// products compute a row the same way whatever the other rows are (the portable mma.sync kernels:
// B = 64, or a GPU without sm_90a; the tests check it at B = 64). On Hopper at B = 128 the DSD's
// stream-K tail splits the k-loop of whichever tiles fall in its last round, which depends on the
// row count, and cuBLAS may pick another kernel for another row count: equal within bf16 rounding
// there. The expert weight gradients are one product over every chunk's rows, after the last
// chunk's input-row gradients are on their way home (so the product runs while they travel; at any
// d, d = 1 included): the dropless DSᵀD and DDS walk each expert's rows through all chunks
// (MicroBatchTopology, moe/topology.h), so they equal d = 1 within fp32 rounding (the same sum with
// each chunk's rows padded to B on its own), not bit for bit.
//
// Tutel's adaptive pipelining, options.pipeline_chunks = kAdaptivePipelineChunks: the layer picks d
// itself, by measurement, for each shape it sees (the ranks' T_r; the config is fixed). The first
// forward + backward steps of a new shape are trials: each candidate d of kAdaptiveCandidates runs
// kTrialStepsPerCandidate steps, timed with CUDA events on the caller's stream from the start of the
// forward to its end plus the backward's (a forward without backward: the forward alone); a
// candidate's time is its best step (its first may include the buffers' growth). After the last
// trial every rank gathers every rank's times and keeps, for each candidate, the slowest rank's,
// then every rank picks the same fastest d (ties: the smaller). d = 1 is a candidate, so the choice
// is never slower than d = 1 beyond the noise of the measurement. A step's times are read at the
// next forward, after its count exchange has waited on the stream anyway, so the trials add no wait
// of the host on the GPU beyond one small gather of the times when a shape's trials end. Results
// mean the same at every d (above), so the trials are ordinary steps. last_step().pipeline tells the
// candidates, their times and the choice; last_step().pipeline_chunks the d of the last forward.
// Chunk c's own buffers keep the largest size any candidate gave it: chunk 0 d = 1's, chunk 1 half
// of it, chunks 2-3 a quarter, 4-7 an eighth: about 2.5 times d = 1's received rows. The weight
// gradients' four operands (the experts' input rows, their outputs, hidden, d_pre) sit in the slots
// of one buffer each, d slots of the largest chunk: about d = 1's rows at every d.
//
// Tutel's 2DH exchange, options.hierarchical_ranks_per_node = G > 1 (G divides R): every token
// exchange (rows out, results back, in both passes) goes through DeviceHierarchicalAllToAll
// (device_all_to_all_2dh.h): within nodes of G consecutive ranks, then one merged message per node
// across nodes. The R x R counts of each chunk come from the plan every rank already computed, so
// the 2DH needs no count exchange of its own. It only moves bytes: y, dx and every gradient are bit
// for bit those of the flat exchange (tested). G = 0 or 1: the flat all-to-all.
//
// Tutel's parallelism switching, set_layout(r) before a forward (expert_layouts.h has the CPU
// reference of the same rules; expert_layout_choice_gpu.h chooses r). The storage never changes:
// each rank stores E_r whole experts (ExpertParallelGpuWeights, rank q experts [q E_r, (q+1) E_r)),
// and a layout gathers what it computes from the storing ranks for one step into its own buffers,
// kept until the backward, then sums the gradients back onto the storing ranks in fp32, so the
// caller's gradients always have the storage's shape and switching r between calls moves no
// parameter and changes no result (tested bit for bit against a fresh layer). Routing, the count
// exchange, the capacity over all T tokens, the global aux and z losses, the send order, the local
// experts' plan, the combine and the router backward are the same code in every layout: the
// ExchangePlan takes r and says which ranks compute expert e for source rank s.
//   r = 1  the layer above, unchanged (FastMoE; its pipelining and 2DH apply only here).
//   r = 0  data-parallel experts: an all-gather of every rank's packed [E_r, 2 D H] bf16 experts
//          gives every rank all E; each computes all E on its own kept slots (dropless: B-rounded
//          per rank; padded: each expert to the most rows any expert got on this rank), its rows
//          copied, never exchanged. Backward: the E experts' fp32 gradients all-reduced, each rank
//          keeping its stored experts' (the Communicator has no reduce-scatter: twice its bytes).
//   r > 1  (r divides R and H; dropless: H / r a multiple of B) groups of r consecutive ranks; rank
//          g r + i computes columns [i H/r, (i+1) H/r) of W1 and those rows of W2 for the r E_r
//          experts of its group, gathered by an all-to-all inside the group. Each kept slot's row
//          goes to all r ranks of its group (they read one block of the send buffer); the r partial
//          outputs come back into r blocks and are summed at home (sum_partial_rows) before the
//          weighted combine; in the backward the output gradient goes to the r ranks and their
//          partial dx rows are summed the same way; the slices' fp32 gradients go back to their
//          storing rank by the reverse all-to-all.
// What a rank sends a step, in elements (P_e = 2 D H; n_out, n_in token rows out and in, a row to r
// ranks counted r times): r = 0 weights (R - 1) E_r P_e bf16 + 2 (R - 1) E_r P_e fp32 (the ring
// all-reduce), no token; r = 1 tokens 2 (n_out + n_in) D bf16; r > 1 weights (r - 1) E_r P_e / r
// bf16 + as many fp32, tokens 2 (n_out + n_in) D bf16. It holds for the step besides its storage:
// r = 0 all E experts (E P_e bf16 + E P_e fp32 gradients), r > 1 its slices (r E_r P_e / r = E_r P_e
// of each), kept per layout after first use so that switching back allocates nothing.
// last_step().layout, weight_elements_sent and layout_choice tell the last forward's r and how it
// was chosen. Not built for r != 1: d > 1 (and adaptive d), the 2DH exchange, identity experts; a
// set_layout asking for them, an r that is not valid, or ranks asking for different r is a
// std::invalid_argument on every rank (check_gpu_layout).
//
// Supported: GeLU, no jitter (as MoeLayerGpu), E <= 256 and K <= 8 (the router), dropless with
// B = 64 or 128 and D, H multiples of B; padded and dropping (dropping computed as padded with C, as
// MoeLayerGpu does; C counted over all T tokens). Anything else is a std::invalid_argument on every
// rank at construction. Not built: SwiGLU (the block-sparse FFN has it; the single-GPU oracle
// does not), the SDD gathering its rows from the receive buffer (MoeLayerGpu's gathers_rows).
//
// Collective: every rank constructs, and calls forward and backward, with the same config and
// options, in the same order. Settings are compared across ranks at construction, and a bad
// local_tokens in a forward travels in the count exchange, so both fail on every rank together.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"            // Communicator
#include "core/bf16.h"               // bf16
#include "core/device_buffer.h"      // DeviceBuffer
#include "core/gemm.h"               // CublasHandle
#include "core/phase_timer.h"        // PhaseTimer
#include "comm/device_all_to_all_2dh.h"   // DeviceHierarchicalAllToAll
#include "comm/device_exchange.h"         // DeviceExchange
#include "ep/layout_choice.h"     // LayoutChoice, LayoutCostModel, check_layout, choose_layout: Tutel's layouts r
#include "ep/expert_parallel_plan.h"    // ExchangePlan
#include "moe/dispatch.h"            // DispatchPlanBuffers
#include "moe/router.h"              // RouterWorkspace
#include "moe/topology.h"            // TopologyBuffers
#include "moe_config.h"              // MoeConfig

namespace moe::dist {

using cuda::bf16;

struct ExpertParallelGpuWeights {  // device memory, owned by the caller
  const bf16* gate_weights = nullptr;  // [D, E] the router, the same on every rank
  const bf16* const* w1 = nullptr;     // device array [slots] -> [D, H], this rank's slots in the placement's
                                       // order (experts_of(rank)); by default E_r, experts r E_r + j
  const bf16* const* w2 = nullptr;     // device array [slots] -> [H, D]
};

struct ExpertParallelGpuGradients {  // device memory, owned by the caller; overwritten, not accumulated
  float* dx = nullptr;              // [T_r, D]
  float* d_gate_weights = nullptr;  // [D, E] summed over ranks when all_reduce_router_gradient
  float* const* d_w1 = nullptr;     // device array [slots] -> [D, H], this rank's slots
  float* const* d_w2 = nullptr;     // device array [slots] -> [H, D]
};

// What the local experts do with the rows they receive.
enum class ExpertCompute {
  ffn,       // the expert FFN (the layer)
  identity,  // send every row back unchanged: the exchange alone (ep_bench's dispatch + combine);
             // y[t] = sum_k w[t, k] x[t], no expert weights read, none of their gradients written
};

// pipeline_chunks = kAdaptivePipelineChunks: the layer measures these degrees for each new shape and
// keeps the fastest (see the file comment).
constexpr int kAdaptivePipelineChunks = 0;
constexpr std::array<int, 4> kAdaptiveCandidates{1, 2, 4, 8};
constexpr int kTrialStepsPerCandidate = 2;

// The most chunks d a layer splits its rows into: the bound every check of d and every flag that sets
// it (moe_train_distributed --pipeline-chunks, ep_bench --pipeline-chunks) holds to.
constexpr int kMaxPipelineChunks = 64;

struct ExpertParallelGpuOptions {
  int pipeline_chunks = 1;                 // d in [1, kMaxPipelineChunks]: Tutel's pipelining degree; 1 is
                                           // FastMoE's; kAdaptivePipelineChunks (0): chosen by measurement
  bool all_reduce_router_gradient = true;  // sum d_gate_weights over ranks (data-parallel router)
  // Sum each replicated expert's weight gradients over its replicas at the end of backward();
  // false: the caller does, through sum_over_replicas (a model sums them once a step, with its
  // other gradients, off the compute stream).
  bool sum_replica_gradients = true;
  ExpertCompute experts = ExpertCompute::ffn;
  int hierarchical_ranks_per_node = 0;     // G: 0 or 1 the flat exchange; G > 1 dividing R: Tutel's 2DH
  // Where the experts live (the layer keeps a copy); nullptr: E / R a rank in id order. Any other
  // placement takes layout r = 1, and dropless or dropping when it has replicas.
  const ExpertPlacement* placement = nullptr;
  // FasterMoE's shadowing, decided per step (see the file comment): after the count exchange the
  // experts worth_shadowing picks from this step's counts are broadcast to every rank and computed
  // there on each rank's own rows, their gradients summed back onto the storing rank. Layout r = 1,
  // the FFN experts, dropless or dropping, and a placement without replicas.
  bool shadow_per_step = false;
};

// The adaptive choice of d for one shape (every rank holds the same).
struct PipelineChoice {
  bool adaptive = false;        // options.pipeline_chunks == kAdaptivePipelineChunks
  std::vector<int> candidates;  // kAdaptiveCandidates; empty when not adaptive
  std::vector<double> times_ms; // per candidate: the slowest rank's best forward + backward; < 0 until agreed
  int chosen = 0;               // the d kept; 0 while the trials run
};

// What the last forward did, on the host (every rank knows the whole count matrix).
struct ExpertParallelGpuStep {
  int64_t tokens = 0;        // T
  int64_t token_offset = 0;  // this rank's first global token
  int64_t local_tokens = 0;  // T_r
  int64_t capacity = 0;      // C; 0 when dropless
  std::vector<int64_t> routed_per_rank_expert;  // [R, E] before dropping (the count exchange)
  std::vector<int64_t> kept_per_rank_expert;    // [R, E]
  int64_t dropped_slots = 0;                    // all ranks
  int64_t rows_sent = 0;      // token rows this rank sent (and got back), all chunks; r > 1: r per kept slot
  int64_t rows_received = 0;  // token rows this rank's experts received, all chunks
  double aux_loss = 0.0;      // global, unscaled: E sum_e f_e P_e
  double z_loss = 0.0;        // global, unscaled: mean over all T tokens of logsumexp^2
  int host_synchronisations = 0;           // of the last forward (see the file comment)
  int backward_host_synchronisations = 0;  // of the last backward
  int pipeline_chunks = 1;                 // d of the last forward (a trial's while adaptive trials run)
  int hierarchical_ranks_per_node = 0;     // G of the exchanges (0: flat)
  PipelineChoice pipeline;                 // the adaptive choice for the last forward's shape
  int layout = 1;                          // Tutel's r of the last forward (set_layout)
  int64_t weight_elements_sent = 0;        // expert weights this rank sent for it (r = 0, r > 1, shadowing)
  std::vector<int64_t> shadowed;           // the experts shadowed in this step, ascending (shadow_per_step)
  LayoutChoice layout_choice;              // how r was chosen (set_layout's `why`); by = "" when set by hand
};

// The layouts r this layer can take for `config` on R ranks with `options` (ascending): those of
// expert_layouts.h (0, 1, every r > 1 dividing R and H), and, for r != 1, only where the options
// are d = 1, the flat exchange and the FFN experts, and for dropless with r > 1 where H / r is a
// multiple of B (the block-sparse FFN tiles each rank's H / r columns by B).
std::vector<int> valid_gpu_layouts(const MoeConfig& config, const ExpertParallelGpuOptions& options, int ranks);
// Throws std::invalid_argument saying why, unless r is one of valid_gpu_layouts().
void check_gpu_layout(const MoeConfig& config, const ExpertParallelGpuOptions& options, int ranks, int r);

class ExpertParallelGpu {
 public:
  // Collective. config.tokens is T, all ranks' tokens together (as in the CPU reference);
  // max_local_tokens bounds T_r, for the buffers of this rank's tokens. Checks the settings on every
  // rank (the same config and options everywhere, E % R == 0, the supported set above) before
  // touching the GPU, so a bad setting is a std::invalid_argument on every rank, even without a GPU
  // on the MPI backend. The current device is this rank's (cudaSetDevice before constructing).
  ExpertParallelGpu(Communicator& communicator, const MoeConfig& config, int64_t max_local_tokens,
                    const ExpertParallelGpuOptions& options = {});
  ~ExpertParallelGpu();
  ExpertParallelGpu(const ExpertParallelGpu&) = delete;
  ExpertParallelGpu& operator=(const ExpertParallelGpu&) = delete;

  // y [T_r, D] for this rank's x [T_r, D]. Collective; 0 <= local_tokens <= max_local_tokens, and
  // the ranks' local_tokens add up to config.tokens (else std::invalid_argument on every rank).
  void forward(const bf16* x,  // [T_r, D]
               int64_t local_tokens, const ExpertParallelGpuWeights& weights,
               bf16* y,  // [T_r, D]
               cudaStream_t stream);
  // forward() in three calls, for a caller that overlaps two micro-batches (cuda/model/model.h),
  // each enqueuing on the same stream:
  //   forward_route    routing and the count exchange: the forward's host wait, and all of its
  //                    router losses (last_step() is complete when it returns)
  //   forward_experts  the rows out to the experts' ranks, and the experts
  //   forward_combine  the rows back, and the weighted combine into y
  // Between them the caller enqueues the other micro-batch's stages, so that the exchanges reach
  // the communicator in the order out A, out B, back A, back B: each runs while the other
  // micro-batch's experts do. x, y and the weights stay valid until forward_combine. (With d > 1
  // every chunk goes out in forward_experts and comes back in forward_combine; forward() keeps
  // Tutel's order, chunk c back as soon as chunk c + 1 is out.)
  void forward_route(const bf16* x, int64_t local_tokens, const ExpertParallelGpuWeights& weights, bf16* y,
                     cudaStream_t stream);
  // forward_route in two calls, so that the caller can enqueue the other micro-batch's routing
  // before the host waits for this one's counts:
  //   forward_send_counts     routing, and the count exchange enqueued (its all-gather and the copy
  //                           of the counts to the host, on `stream`)
  //   forward_receive_counts  the host waits for the counts (the forward's host wait), then the
  //                           plan and the router losses, as forward_route
  // The same stream for both, and nothing else enqueued on it between them (the host waits for it).
  void forward_send_counts(const bf16* x, int64_t local_tokens, const ExpertParallelGpuWeights& weights, bf16* y,
                           cudaStream_t stream);
  void forward_receive_counts(cudaStream_t stream);
  void forward_experts(cudaStream_t stream);
  void forward_combine(cudaStream_t stream);

  // Gradients of L = sum over ranks of sum(dy .* y) + aux_loss_coef * aux + z_loss_coef * z for the
  // last forward (same x and weights). Collective.
  void backward(const bf16* x,  // [T_r, D] as given to forward
                const ExpertParallelGpuWeights& weights,
                const bf16* dy,  // [T_r, D]
                const ExpertParallelGpuGradients& gradients, cudaStream_t stream);
  // backward() in two calls, as the forward's stages: backward_experts sends dy's rows out and runs
  // the experts' backward; backward_combine brings dx's rows back and runs the router's backward.
  // The arguments stay valid until backward_combine.
  void backward_experts(const bf16* x, const ExpertParallelGpuWeights& weights, const bf16* dy,
                        const ExpertParallelGpuGradients& gradients, cudaStream_t stream);
  void backward_combine(cudaStream_t stream);
  // A placement with replicas: each replicated expert's weight gradients (this rank's slots, as
  // given to backward) summed over its replicas, one fp32 all-reduce of the replicated experts over
  // all ranks (zeros where a rank holds none of them). backward() calls it when
  // options.sum_replica_gradients; a caller that sets that false calls it itself, once it has
  // added up what it sums (collective: every rank, in the same order among the communicator's
  // other calls). Nothing where no expert is replicated.
  void sum_over_replicas(const ExpertParallelGpuGradients& gradients, cudaStream_t stream);

  // Tutel's layout r for the next forward and its backward: 0 data-parallel experts, 1 expert
  // parallel (the default; FastMoE's layer above), r > 1 experts sharded over r ranks along H (see
  // the file comment). The stored experts never move, so switching changes no result. Collective:
  // every rank passes the same r, else std::invalid_argument on every rank, as for a bad r.
  void set_layout(int r, const LayoutChoice& why = {});
  int layout() const { return layout_; }

  const MoeConfig& config() const { return config_; }
  const ExpertParallelGpuOptions& options() const { return options_; }
  int64_t experts_per_rank() const { return experts_per_rank_; }
  const ExpertPlacement& placement() const { return placement_; }
  int64_t local_slots() const { return placement_.slots_of(rank_); }
  DeviceExchange& exchange() { return *exchange_; }
  const ExchangePlan& plan() const;  // of the last forward
  const ExpertParallelGpuStep& last_step() const { return step_; }
  // Names the layer's phases (route, count exchange, dispatch, experts, combine, and the backward's)
  // on the timeline, as MoeLayerGpu does; null stops. Phases on the exchange stream are timed there,
  // the stream named `exchange_stream_name` (the timeline's row).
  void set_phase_timer(cuda::PhaseTimer* timer, const std::string& exchange_stream_name = kExchangeRow) {
    timer_ = timer;
    if (timer != nullptr) timer->name_stream(exchange_stream_, exchange_stream_name);
  }
  // The adaptive choices made so far, by shape (the ranks' T_r); empty when d is fixed.
  const std::map<std::vector<int64_t>, PipelineChoice>& pipeline_choices() const { return choices_; }

  // ---- what the last forward computed, on the device (tests, ep_bench's checks) ----
  const cuda::DeviceBuffer<int>& top_experts() const { return router_.top_experts; }            // [T_r, K] used
  const cuda::DeviceBuffer<float>& combine_weights() const { return router_.combine_weights; }  // [T_r, K] used
  const bf16* sent_rows() const { return send_x_.data(); }        // [rows_sent, D] in send order
  const bf16* returned_rows() const { return returned_.data(); }  // [rows_sent, D] the experts' outputs

 private:
  struct Chunk;
  struct Tables;
  struct Trial;
  struct LayoutBuffers;
  struct Shadows;

  void route(const bf16* x, int64_t local_tokens, const bf16* gate_weights, cudaStream_t stream);
  void upload_tables(cudaStream_t stream);
  void reserve_buffers();
  void prepare_experts(int chunk, const ExpertParallelGpuWeights& weights, cudaStream_t stream);
  // Chunk c's expert work and the sizes of its products (D, H_c, E_c, its received rows), with
  // chunk = nullptr where chunk c computes nothing (identity experts, or no rows received).
  struct ChunkWork {
    Chunk* chunk = nullptr;
    int D = 0, H = 0, E_c = 0, rows = 0;
  };
  ChunkWork chunk_work(int c);
  void experts_forward(int chunk, const ExpertParallelGpuWeights& weights, cudaStream_t stream);
  void experts_backward(int chunk, const ExpertParallelGpuWeights& weights, const ExpertParallelGpuGradients& gradients,
                        bool first_with_rows, cudaStream_t stream);
  // r = 0 and r > 1: the experts this rank computes, gathered from their storing ranks into the
  // layout's buffers (the forward); their gradients summed back onto the storing ranks (the backward).
  LayoutBuffers& layout_buffers();
  ExpertParallelGpuWeights gather_expert_weights(const ExpertParallelGpuWeights& stored, cudaStream_t stream);
  void return_expert_gradients(const ExpertParallelGpuGradients& gradients, cudaStream_t stream);
  // shadow_per_step: this step's shadowed experts (choose_shadows, from the counts), their weights
  // broadcast from the storing ranks and the step's slot tables (shadow_weights, the forward), and
  // the other ranks' gradients of them added onto the storing rank's (return_shadow_gradients).
  void choose_shadows(const std::vector<int64_t>& routed, cudaStream_t stream);
  ExpertParallelGpuWeights shadow_weights(const ExpertParallelGpuWeights& stored, cudaStream_t stream);
  ExpertParallelGpuGradients shadow_gradient_tables(const ExpertParallelGpuGradients& stored, cudaStream_t stream);
  void return_shadow_gradients(cudaStream_t stream);  // into the stored tables shadow_gradient_tables made
  bool shadowing() const;  // whether the last forward shadowed any expert
  void sum_partials(bf16* out, cudaStream_t stream);  // r > 1: partials_ -> one row a kept slot, in send order
  // The d-chunk pipeline shared by forward and backward: `out` rows in send order go to the experts,
  // `work(c)` runs on `stream` once chunk c arrived, its rows come back into `back` in send order.
  // pipeline_out sends and computes every chunk; with bring_back, in Tutel's order (chunk c back
  // once chunk c + 1 is out), else none comes back before pipeline_back. pipeline_back brings back
  // what is still out and makes `stream` wait for the rows.
  // The stages behind forward(), backward() and their staged calls; bring_back: Tutel's order
  // within pipeline_out (the one-call forms), else every chunk comes back in the later stage.
  void forward_out(cudaStream_t stream, bool bring_back);
  void forward_back(cudaStream_t stream, bool brought_back);
  void backward_out(const bf16* x, const ExpertParallelGpuWeights& weights, const bf16* dy,
                    const ExpertParallelGpuGradients& gradients, cudaStream_t stream, bool bring_back);
  void backward_back(cudaStream_t stream, bool brought_back);
  template <typename Work>
  void pipeline_out(const bf16* out, bf16* back, cudaStream_t stream, bool bring_back, Work&& work);
  void pipeline_back(bf16* back, cudaStream_t stream, bool brought_back);
  void send_chunk(int chunk, const bf16* out);
  void bring_back_chunk(int chunk, bf16* back);
  void wait_for_exchange(cudaEvent_t exchanged, const char* phase, cudaStream_t stream);
  const bf16* chunk_result(int chunk) const;  // what chunk c sends home
  cuda::DevicePlan home_view(int64_t local_tokens) const;
  cuda::DevicePlan expert_view(int chunk) const;
  // The token rows of chunk c: out to the experts' ranks (forward = true), or back home.
  void exchange_chunk(int chunk, bool forward, const bf16* send, bf16* recv, cudaStream_t stream);
  void hierarchical_counts();  // the 2DH's R x R counts of every chunk, from the plan
  // Adaptive pipelining: the d of this forward, for the shape `tokens_per_rank`.
  int choose_pipeline_chunks(const std::vector<int64_t>& tokens_per_rank);
  void finish_trial_step();  // reads the last trial step's time, agrees when a shape's trials end

  MoeConfig config_;
  ExpertParallelGpuOptions options_;
  int64_t max_local_tokens_ = 0;
  int64_t experts_per_rank_ = 0;  // E / R: the layouts' stored experts
  int rank_ = 0;
  ExpertPlacement placement_;
  ExpertPlacement step_placement_;     // the last forward's: placement_ with its shadowed experts
  std::unique_ptr<Shadows> shadows_;   // shadow_per_step's buffers, kept between steps
  // The replicated experts' gradient sums: [n, D H] W1 then [n, H D] W2, n replicated experts in id
  // order; this rank's slots that hold one (replica_slot_) and its row there (replica_row_).
  cuda::DeviceBuffer<float> replica_sums_;
  cuda::DeviceBuffer<int> replica_slot_, replica_row_;
  int replicated_experts_ = 0, local_replicas_ = 0;
  int max_chunks_ = 1;  // chunks' buffers and events: d, or the largest adaptive candidate
  std::unique_ptr<DeviceExchange> exchange_;
  std::unique_ptr<DeviceHierarchicalAllToAll> hierarchical_;  // when G > 1
  // 2DH: [2 d][R * R] elements; [c]: rank s sends rank t in chunk c, [d + c]: the same rows back
  std::vector<std::vector<int64_t>> chunk_counts_;
  MoeConfig local_experts_config_;  // E = E_c, H = H_c: what the block-sparse FFN and the topology see
  int layout_ = 1;                  // Tutel's r
  LayoutChoice layout_choice_;      // how it was chosen
  std::map<int, std::unique_ptr<LayoutBuffers>> layout_buffers_;  // by r != 1, made at first use, kept
  ExpertParallelGpuWeights computed_weights_;  // of the last forward: the caller's (r = 1) or the gathered
  cuda::DeviceBuffer<bf16> partials_;          // r > 1: [r rows_sent, D] the r partial rows of each slot
  cudaStream_t exchange_stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // [2 d + 2]: start, arrived[c], computed[c], returned
  cudaEvent_t tables_uploaded_ = nullptr;
  std::unique_ptr<cuda::CublasHandle> cublas_;  // made after the settings are checked: no GPU before

  // ---- this rank's tokens (sized by max_local_tokens) ----
  cuda::RouterBuffers router_;  // its statistics (expert_fraction, ..., z_loss) over this rank's tokens alone
  std::unique_ptr<cuda::RouterWorkspace> router_workspace_;
  std::unique_ptr<cuda::DispatchPlanBuffers> home_plan_;  // for T_r slots; rebuilt when T_r changes
  int64_t home_plan_tokens_ = 0;
  cuda::DeviceBuffer<int32_t> summary_;  // [routing_summary_words(E)]
  std::vector<int32_t> summaries_;       // [R, routing_summary_words(E)] on the host
  cuda::DeviceBuffer<int> send_slot_, slot_send_row_;  // [T*K] the send order (expert_parallel_kernels.h)
  cuda::DeviceBuffer<bf16> send_x_, returned_, d_send_, returned_dx_;  // [T*K, D] rows in send order
  cuda::DeviceBuffer<float> d_combine_weights_, d_logits_;  // [T, K] [T, E]
  cuda::DeviceBuffer<bf16> d_logits_bf16_;                  // [T, E]

  // ---- the exchange plan of the last forward, and its tables on the device ----
  std::unique_ptr<ExchangePlan> plan_;
  std::unique_ptr<Tables> tables_;

  // ---- the local experts, one set of buffers per chunk (the backward needs each chunk's) ----
  std::vector<std::unique_ptr<Chunk>> chunks_;
  // The weight gradients' operands of the chunks that received rows, chunk k's in slot k of one
  // buffer each, slots of `rows` rows (dropless: R B, R the chunks' common bound on block rows), so
  // that one DSᵀD and one DDS walk all of them (expert_weight_gradients).
  struct Slots {
    int count = 0;     // the chunks with rows in the last forward
    int64_t rows = 0;  // rows a slot
    cuda::DeviceBuffer<bf16> permuted_x, expert_out, hidden, d_pre_activation;  // [count rows, D or H_c]
    int64_t topology_tokens = 0, topology_experts = 0, topology_hidden = 0;     // the chunks' topologies' sizes
    std::unique_ptr<cuda::MicroBatchTopology> walk;                              // dropless, count > 1
    int64_t walk_tokens = 0, walk_experts = 0, walk_hidden = 0;                 // what the walk was made for
  };
  Slots slots_;
  void expert_weight_gradients(const ExpertParallelGpuGradients& gradients, cudaStream_t stream);

  // ---- adaptive pipelining ----
  std::map<std::vector<int64_t>, PipelineChoice> choices_;  // by the ranks' T_r
  std::map<std::vector<int64_t>, std::unique_ptr<Trial>> trials_;
  // Timing events on the caller's stream, two sets: a forward records into one while the trial step
  // of the forward before is read from the other.
  struct StepEvents {
    cudaEvent_t forward_start = nullptr, forward_end = nullptr, backward_start = nullptr, backward_end = nullptr;
  };
  std::array<StepEvents, 2> step_events_;
  int current_step_events_ = 0;      // the set of the last forward (and its backward)
  bool trial_step_pending_ = false;  // the last forward was a trial step, not yet read
  bool trial_step_has_backward_ = false;
  int trial_step_events_ = 0;        // its set
  std::vector<int64_t> trial_step_shape_;
  int trial_step_candidate_ = 0;

  ExpertParallelGpuStep step_;
  cuda::PhaseTimer* timer_ = nullptr;
  bool forward_done_ = false;
  // Between the stages of a forward (forward_route .. forward_combine) or a backward: what the
  // later stages read. stage: 4 after forward_send_counts, 1 after forward_route (or
  // forward_receive_counts), 2 after forward_experts; 3 after backward_experts; 0 between calls.
  struct Staged {
    int stage = 0;
    const bf16* x = nullptr;
    bf16* y = nullptr;
    ExpertParallelGpuWeights weights;
    ExpertParallelGpuGradients gradients, computed_gradients;
    int first_with_rows = -1;
    int64_t waits_before = 0;
    bool trial_step = false;
  };
  Staged staged_;
  void expect_stage(int stage, const char* call) const;
};

}  // namespace moe::dist
