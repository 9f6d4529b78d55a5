// test_expert_parallel_plan.cpp: the exchange plan of the expert-parallel layer on the GPU
// (distributed/expert_parallel_plan.h) and its two index rules (expert_parallel_index.h), on CPU
// ranks. The rows that each rank's experts compute, chunk after chunk, must be exactly the rows the
// single-device dispatch plan (reference_cpu/dispatch.h) gives those experts, in the same order,
// with the same slots dropped, in every formulation, for d = 1, 2, 3, 4, 8, with uneven shards, a
// rank without tokens and experts that receive nothing. The rows really travel: the test moves the
// global slot ids through the MPI backend with the plan's counts and offsets, then applies the same
// index functions the GPU kernels apply. And a fault every rank sees the same way (T_r that do not
// add up to T, E % R != 0) is the same error on every rank. Tutel's layouts: r = 0 (each rank's
// experts compute exactly its own kept slots of every expert, in token order) and r > 1 (every rank
// of a group computes every row of its group's experts, the single-device plan's rows), with the
// r > 1 results coming home into r disjoint blocks that match what was sent. Placements (r = 1):
// E not divisible by R, EPLB's replicas, an expert on every rank with its rows split, and a
// shadowed one; each replica computes exactly the rows the placement's routing rule gives it.
//   ctest --test-dir build -R DistributedExpertParallelPlan
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_plan
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "ep/expert_parallel_index.h"
#include "ep/expert_parallel_plan.h"
#include "mpi_test_support.h"
#include "reference_cpu/dispatch.h"

namespace moe::dist {
namespace {

using testing::mix;
using testing::shared_seed;
using testing::world;

MoeConfig plan_config(Formulation formulation) {
  MoeConfig config;
  config.tokens = 37;
  config.model_dim = 8;
  config.hidden_dim = 8;
  config.num_experts = 12;  // divides R = 1, 2, 3, 4
  config.top_k = 2;
  config.formulation = formulation;
  config.capacity_factor = 0.75;  // C = ceil(0.75 * 37 * 2 / 12) = 5: dropping really drops
  config.block_size = 4;
  return config;
}

// K distinct experts per token from a seed every rank shares; `favoured` >= 0 sends every token's
// first choice there (the other experts then see only second choices).
ref::IndexMatrix routing(const MoeConfig& config, uint64_t seed, int favoured = -1) {
  ref::IndexMatrix top(config.tokens, config.top_k);
  std::mt19937_64 generator(seed);
  for (int64_t t = 0; t < config.tokens; ++t) {
    std::vector<int32_t> experts(config.num_experts);
    for (int64_t e = 0; e < config.num_experts; ++e) experts[e] = static_cast<int32_t>(e);
    std::shuffle(experts.begin(), experts.end(), generator);
    if (favoured >= 0) std::iter_swap(experts.begin(), std::find(experts.begin(), experts.end(), favoured));
    for (int64_t k = 0; k < config.top_k; ++k) top(t, k) = experts[k];
  }
  return top;
}

// The whole exchange on this rank: global slot ids out, through the plan's rows, to the experts.
void check_exchange(const MoeConfig& config, const ref::IndexMatrix& top, const std::vector<int64_t>& shards,
                    int chunks, int layout = 1, const ExpertPlacement* placement = nullptr) {
  Communicator& comm = world();
  const int R = comm.size(), rank = comm.rank();
  const int64_t E = config.num_experts, K = config.top_k;
  int64_t offset = 0;
  for (int p = 0; p < rank; ++p) offset += shards[p];
  const int64_t T_r = shards[rank];

  // ---- route locally: this rank's slots grouped by expert, token order inside ----
  std::vector<int64_t> routed_here(E, 0);
  for (int64_t t = 0; t < T_r; ++t) {
    for (int64_t k = 0; k < K; ++k) ++routed_here[top(offset + t, k)];
  }
  std::vector<int32_t> routed_offsets(E + 1, 0), routed_slots(T_r * K);
  for (int64_t e = 0; e < E; ++e) routed_offsets[e + 1] = routed_offsets[e] + static_cast<int32_t>(routed_here[e]);
  {
    std::vector<int32_t> cursor(routed_offsets.begin(), routed_offsets.end() - 1);
    for (int64_t slot = 0; slot < T_r * K; ++slot) {
      routed_slots[cursor[top(offset + slot / K, slot % K)]++] = static_cast<int32_t>(slot);
    }
  }

  // ---- the count exchange, and the plan ----
  const std::vector<int64_t> tokens_per_rank = all_gather<int64_t>(comm, T_r);
  const std::vector<int64_t> routed = all_gather<int64_t>(comm, routed_here);
  const ExchangePlan plan(config, R, rank, chunks, tokens_per_rank, routed, layout, placement);
  // The units this rank computes (E_r experts from rank E_r at r = 1 without a placement); named E_r below.
  const int64_t E_r = plan.computed_experts(), first_expert = plan.first_computed_expert();
  EXPECT_EQ(E_r, placement ? placement->slots_of(rank) : layout == 0 ? E : layout > 1 ? layout * E / R : E / R);
  EXPECT_EQ(plan.tokens(), config.tokens);
  EXPECT_EQ(plan.token_offset(), offset);

  // What a rank sends to p in chunk c is what p receives from it.
  for (int c = 0; c < chunks; ++c) {
    const std::vector<int64_t> sent = all_gather<int64_t>(comm, plan.send_rows(c));      // [R (sender), R]
    const std::vector<int64_t> received = all_gather<int64_t>(comm, plan.recv_rows(c));  // [R (receiver), R]
    for (int s = 0; s < R; ++s) {
      for (int p = 0; p < R; ++p) EXPECT_EQ(sent[s * R + p], received[p * R + s]) << "chunk " << c;
    }
  }

  // ---- the send order (build_send_order's rule): global slot ids in send order ----
  std::vector<int32_t> segment_begin, segment_send_row;
  for (int64_t e = 0; e < E; ++e) {
    for (int k = 0; k <= plan.segments(); ++k) segment_begin.push_back(static_cast<int32_t>(plan.segment_begin(e, k)));
    for (int k = 0; k < plan.segments(); ++k) segment_send_row.push_back(static_cast<int32_t>(plan.segment_send_row(e, k)));
  }
  if (!placement) {
    EXPECT_EQ(plan.segments(), chunks);
  }
  std::vector<int64_t> send(plan.rows_sent(), -1);
  std::vector<int32_t> slot_send_row(T_r * K, -2);
  for (int64_t i = 0; i < T_r * K; ++i) {
    const int32_t slot = routed_slots[i];
    const int32_t expert = top(offset + slot / K, slot % K);
    const int row = send_row_of(static_cast<int>(i - routed_offsets[expert]), expert, segment_begin.data(),
                                segment_send_row.data(), plan.segments());
    slot_send_row[slot] = row;
    if (row >= 0) {
      ASSERT_LT(row, plan.rows_sent());
      EXPECT_EQ(send[row], -1) << "two slots in send row " << row;
      send[row] = (offset + slot / K) * K + slot % K;
    }
  }
  EXPECT_EQ(std::count(send.begin(), send.end(), -1), 0) << "send rows that no slot fills";

  // ---- every chunk through the MPI backend, then the experts' row map (build_expert_rows' rule) ----
  std::vector<std::vector<int64_t>> expert_slots(E_r);  // global slots in row order, over the chunks
  for (int c = 0; c < chunks; ++c) {
    std::vector<int64_t> received(plan.rows_received(c), -7);
    const std::span<const int64_t> chunk_send(send.data() + plan.chunk_send_begin(c),
                                              plan.chunk_send_begin(c + 1) - plan.chunk_send_begin(c));
    all_to_all_v<int64_t>(comm, chunk_send, plan.send_rows(c), plan.send_row_offsets(c), received, plan.recv_rows(c),
                          plan.recv_row_offsets(c));
    std::vector<int32_t> row_offsets, arrived_before, block_start;
    for (int64_t j = 0; j <= E_r; ++j) row_offsets.push_back(static_cast<int32_t>(plan.row_offset(c, j)));
    for (int64_t j = 0; j < E_r; ++j) {
      for (int s = 0; s <= R; ++s) arrived_before.push_back(static_cast<int32_t>(plan.arrived_before(c, j, s)));
    }
    for (int s = 0; s < R; ++s) {
      for (int64_t j = 0; j < E_r; ++j) block_start.push_back(static_cast<int32_t>(plan.block_start(c, s, j)));
    }
    std::vector<int> uses(received.size(), 0);
    for (int64_t j = 0; j < E_r; ++j) {
      int64_t padding = 0;
      for (int64_t row = plan.row_offset(c, j); row < plan.row_offset(c, j + 1); ++row) {
        const int source = received_row_of(static_cast<int>(row), row_offsets.data(), arrived_before.data(),
                                           block_start.data(), static_cast<int>(E_r), R);
        if (source < 0) {
          ++padding;
          continue;
        }
        EXPECT_EQ(padding, 0) << "a padding row before a real row of local expert " << j;
        ++uses[source];
        const int64_t global_slot = received[source];
        EXPECT_EQ(top(global_slot / K, global_slot % K), plan.unit_expert(first_expert + j)) << "a row of another expert";
        expert_slots[j].push_back(global_slot);
      }
      if (config.formulation == Formulation::dropless) {
        EXPECT_LT(padding, config.block_size);
      } else {
        EXPECT_EQ(plan.row_offset(c, j + 1) - plan.row_offset(c, j), plan.padded_rows(c));
      }
    }
    EXPECT_EQ(received_row_of(static_cast<int>(plan.total_rows(c)), row_offsets.data(), arrived_before.data(),
                              block_start.data(), static_cast<int>(E_r), R),
              -1);
    for (size_t i = 0; i < uses.size(); ++i) EXPECT_EQ(uses[i], 1) << "received row " << i << " used " << uses[i];

    // ---- and back: rank p's results land in their own block, the rows this rank sent p ----
    const int64_t sent_here = plan.chunk_send_begin(c + 1) - plan.chunk_send_begin(c);
    std::vector<int64_t> returned(static_cast<size_t>(sent_here * plan.copies()), -9);
    all_to_all_v<int64_t>(comm, received, plan.recv_rows(c), plan.recv_row_offsets(c), returned, plan.send_rows(c),
                          plan.return_row_offsets(c));
    std::vector<int> filled(returned.size(), 0);
    for (int p = 0; p < R; ++p) {
      for (int64_t i = 0; i < plan.send_rows(c)[p]; ++i) {
        const int64_t at = plan.return_row_offsets(c)[p] + i;
        ASSERT_LT(at, static_cast<int64_t>(returned.size()));
        ++filled[at];
        EXPECT_EQ(returned[at], send[plan.chunk_send_begin(c) + plan.send_row_offsets(c)[p] + i]) << "from rank " << p;
      }
    }
    for (size_t i = 0; i < filled.size(); ++i) EXPECT_EQ(filled[i], 1) << "returned row " << i;
    if (plan.copies() > 1) {  // the rule sum_partial_rows reads them by: every copy of every row
      const int r = plan.copies(), groups = R / r;
      std::vector<int32_t> group_begin;
      for (int g = 0; g < groups; ++g) group_begin.push_back(static_cast<int32_t>(plan.send_row_offsets(c)[g * r]));
      group_begin.push_back(static_cast<int32_t>(sent_here));
      for (int64_t u = 0; u < sent_here; ++u) {
        for (int copy = 0; copy < r; ++copy) {
          const size_t at = partial_row_of(static_cast<int>(u), copy, group_begin.data(), groups, r);
          ASSERT_LT(at, returned.size());
          EXPECT_EQ(returned[at], send[plan.chunk_send_begin(c) + u]) << "copy " << copy << " of row " << u;
        }
      }
    }
  }

  // ---- against the single-device plan of all T tokens ----
  // With a placement, a unit gets the piece of each source's kept slots of its expert that the
  // routing rule gives its replica (ExpertPlacement::piece), source after source.
  const ref::DispatchPlan reference = ref::plan_dispatch(config, top);
  std::vector<int64_t> first_token(R + 1, 0);
  for (int p = 0; p < R; ++p) first_token[p + 1] = first_token[p] + shards[p];
  for (int64_t j = 0; j < E_r; ++j) {
    const int64_t unit = first_expert + j, e = plan.unit_expert(unit);
    const std::vector<int64_t>& replicas = plan.placement().replicas(e);
    const int64_t replica = layout == 1 ? std::find(replicas.begin(), replicas.end(), unit) - replicas.begin() : 0;
    std::vector<int64_t> expected;  // r = 0: only this rank's own slots
    std::vector<int64_t> seen(R, 0);  // each source's kept slots of e so far
    for (int64_t row = reference.row_offsets[e]; row < reference.row_offsets[e + 1]; ++row) {
      const int64_t slot = reference.row_slot[row];
      if (slot < 0) continue;
      const int source = static_cast<int>(std::upper_bound(first_token.begin(), first_token.end(), slot / K) - first_token.begin()) - 1;
      const int64_t index = seen[source]++;
      if (layout == 0 && source != rank) continue;
      const ExpertPlacement::Piece piece =
          layout == 1 ? plan.placement().piece(source, e, plan.kept(source, e), replica) : ExpertPlacement::Piece{0, index + 1};
      if (index >= piece.first && index < piece.first + piece.count) expected.push_back(slot);
    }
    EXPECT_EQ(expert_slots[j], expected) << "the rows of unit " << unit << " (expert " << e << ")";
    if (chunks == 1 && layout != 0 && !plan.placement().replicated()) {  // the GPU computes dropping as padded: C rows an expert, as MoeLayerGpu does
      const int64_t rows = config.formulation == Formulation::dropping ? reference.capacity : reference.rows_per_expert[e];
      EXPECT_EQ(plan.row_offset(0, j + 1) - plan.row_offset(0, j), rows) << "expert " << e;
    }
  }
  for (int64_t slot = 0; slot < T_r * K; ++slot) {
    const bool dropped_here = slot_send_row[slot] < 0;
    EXPECT_EQ(dropped_here, reference.slot_row[offset * K + slot] < 0) << "slot " << slot;
  }
  EXPECT_EQ(plan.dropped_slots(), reference.dropped_slots);
}

std::vector<int64_t> even_shards(int64_t tokens, int ranks) {
  std::vector<int64_t> shards(ranks, tokens / ranks);
  for (int p = 0; p < tokens % ranks; ++p) ++shards[p];
  return shards;
}

const Formulation kFormulations[] = {Formulation::dropless, Formulation::padded, Formulation::dropping};

TEST(ExpertParallelPlan, EveryExpertComputesTheSingleDevicePlansRows) {
  for (Formulation formulation : kFormulations) {
    for (int chunks : {1, 2, 3, 4, 8}) {
      const MoeConfig config = plan_config(formulation);
      const uint64_t seed = shared_seed();
      SCOPED_TRACE(std::string(to_string(formulation)) + " d=" + std::to_string(chunks) + " seed " +
                   std::to_string(seed));
      check_exchange(config, routing(config, seed), even_shards(config.tokens, world().size()), chunks);
    }
  }
}

// Placements of their own (layout r = 1): E not divisible by R, EPLB from the routing's own counts,
// the favoured expert on every rank (rows split over the copies) and shadowed (rows kept at home).
TEST(ExpertParallelPlan, EveryPlacementComputesTheRowsItsRoutingRuleGives) {
  const int R = world().size();
  for (Formulation formulation : {Formulation::dropless, Formulation::dropping}) {
    for (int chunks : {1, 3}) {
      MoeConfig config = plan_config(formulation);
      const uint64_t seed = shared_seed();
      SCOPED_TRACE(std::string(to_string(formulation)) + " d=" + std::to_string(chunks) + " seed " +
                   std::to_string(seed));
      const ref::IndexMatrix top = routing(config, seed, /*favoured=*/5);
      std::vector<double> load(config.num_experts, 0.0);
      for (int64_t t = 0; t < config.tokens; ++t) {
        for (int64_t k = 0; k < config.top_k; ++k) load[top(t, k)] += 1;
      }
      std::vector<ExpertPlacement> placements;
      if (config.num_experts - (config.num_experts + R - 1) / R >= 1) placements.push_back(eplb_placement(load, R, 1));
      placements.push_back(contiguous_placement(config.num_experts, R).with_shadowed({5}));
      std::vector<std::vector<int64_t>> held;
      for (int r = 0; r < R; ++r) {
        std::vector<int64_t> mine = contiguous_placement(config.num_experts, R).experts_of(r);
        if (std::find(mine.begin(), mine.end(), 5) == mine.end()) mine.push_back(5);
        held.push_back(mine);
      }
      placements.emplace_back(config.num_experts, held);
      for (const ExpertPlacement& placement : placements) {
        SCOPED_TRACE(placement.describe());
        check_exchange(config, top, even_shards(config.tokens, R), chunks, 1, &placement);
      }
      // E = 13: no R > 1 divides it.
      MoeConfig odd = config;
      odd.num_experts = 13;
      const ExpertPlacement uneven = contiguous_placement(13, R);
      SCOPED_TRACE(uneven.describe());
      check_exchange(odd, routing(odd, seed), even_shards(odd.tokens, R), chunks, 1, &uneven);
    }
  }
}

TEST(ExpertParallelPlan, UnevenShardsARankWithoutTokensAndIdleExperts) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    for (int chunks : {1, 4}) {
      const MoeConfig config = plan_config(formulation);
      const uint64_t seed = shared_seed();
      SCOPED_TRACE(std::string(to_string(formulation)) + " d=" + std::to_string(chunks) + " seed " +
                   std::to_string(seed));
      std::vector<int64_t> shards(R, 0);  // every token on the last rank; the others hold none
      shards[R - 1] = config.tokens;
      check_exchange(config, routing(config, seed, /*favoured=*/5), shards, chunks);
      // Top-1 onto one expert: every other expert, and every other rank's experts, receive nothing.
      MoeConfig top1 = config;
      top1.top_k = 1;
      ref::IndexMatrix top = ref::IndexMatrix::Constant(top1.tokens, 1, 5);
      check_exchange(top1, top, even_shards(top1.tokens, R), chunks);
    }
  }
}

TEST(ExpertParallelPlan, EveryLayoutComputesTheSingleDevicePlansRows) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = plan_config(formulation);
    std::vector<int> layouts{0};
    for (int r = 2; r <= R; ++r) {
      if (R % r == 0 && config.hidden_dim % r == 0) layouts.push_back(r);
    }
    for (int layout : layouts) {
      const uint64_t seed = shared_seed();
      SCOPED_TRACE(std::string(to_string(formulation)) + " r=" + std::to_string(layout) + " seed " +
                   std::to_string(seed));
      check_exchange(config, routing(config, seed), even_shards(config.tokens, R), 1, layout);
      std::vector<int64_t> shards(R, 0);  // every token on the last rank
      shards[R - 1] = config.tokens;
      check_exchange(config, routing(config, seed, /*favoured=*/5), shards, 1, layout);
      MoeConfig top1 = config;  // top-1 onto one expert: the others receive nothing
      top1.top_k = 1;
      check_exchange(top1, ref::IndexMatrix::Constant(top1.tokens, 1, 5), even_shards(top1.tokens, R), 1, layout);
    }
  }
}

// The packed H-slices of the experts (pack_expert_slices, unpack_expert_slices): every element of
// every stored expert once, slice s holding W1's columns and W2's rows [s H_c, (s + 1) H_c).
TEST(ExpertParallelPlan, LayoutSlicesHoldEveryWeightOnce) {
  const int D = 6, H = 8, experts = 3;
  for (int slices : {1, 2, 4}) {
    SCOPED_TRACE("slices " + std::to_string(slices));
    const int H_c = H / slices;
    const size_t per_expert = size_t(2) * D * H;
    std::vector<int> w1_uses(size_t(experts) * D * H, 0), w2_uses(size_t(experts) * H * D, 0);
    for (size_t i = 0; i < size_t(experts) * per_expert; ++i) {
      const SliceElement at = slice_element(i, experts, D, H, slices);
      // Where i sits in [slices, E_r, P_c], and what that place must hold.
      const size_t block = size_t(2) * D * H_c, k = i % block;
      ASSERT_EQ(at.slice, int(i / block / experts));
      ASSERT_EQ(at.expert, int(i / block % experts));
      if (k < size_t(D) * H_c) {
        ASSERT_TRUE(at.in_w1);
        EXPECT_EQ(at.offset, (k / H_c) * H + at.slice * H_c + k % H_c) << "W1 [D, H_c] slice, element " << k;
        ++w1_uses[at.expert * D * H + at.offset];
      } else {
        ASSERT_FALSE(at.in_w1);
        const size_t k2 = k - size_t(D) * H_c;
        EXPECT_EQ(at.offset, (at.slice * H_c + k2 / D) * D + k2 % D) << "W2 [H_c, D] slice, element " << k2;
        ++w2_uses[at.expert * H * D + at.offset];
      }
    }
    EXPECT_EQ(std::count(w1_uses.begin(), w1_uses.end(), 1), static_cast<long>(w1_uses.size()));
    EXPECT_EQ(std::count(w2_uses.begin(), w2_uses.end(), 1), static_cast<long>(w2_uses.size()));
  }
}

TEST(ExpertParallelPlan, TokensThatDoNotAddUpAreTheSameErrorOnEveryRank) {
  const MoeConfig config = plan_config(Formulation::dropless);
  const int R = world().size();
  std::vector<int64_t> tokens(R, 1), routed(static_cast<size_t>(R) * config.num_experts, 0);
  for (int p = 0; p < R; ++p) routed[p * config.num_experts] = config.top_k;
  try {
    ExchangePlan plan(config, R, world().rank(), 1, tokens, routed);
    FAIL() << "expected an error: the ranks hold " << R << " tokens, T = " << config.tokens;
  } catch (const std::invalid_argument& error) {
    EXPECT_THAT(error.what(), ::testing::HasSubstr("config.tokens says T = 37"));
  }
  if (R > 1) {
    MoeConfig odd = config;
    odd.num_experts = R + 1;  // divisible by R only at R = 1
    const std::vector<int64_t> odd_routed(static_cast<size_t>(R) * odd.num_experts, 0);
    try {
      ExchangePlan plan(odd, R, world().rank(), 1, tokens, odd_routed);
      FAIL() << "expected an error: E = " << odd.num_experts << " over R = " << R << " ranks";
    } catch (const std::invalid_argument& error) {
      EXPECT_THAT(error.what(), ::testing::HasSubstr("is not divisible by R"));
    }
  }
}

}  // namespace
}  // namespace moe::dist
