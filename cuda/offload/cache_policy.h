// offload/cache_policy.h: the expert cache's bookkeeping on the host: which (block, expert) each GPU
// slot holds, which slots a block is using right now, and which slot to fill next (LRU, LFU or the
// expected next use).
//
// Plain C++ with no CUDA call, built as its own library (moe_cache_policy) on every machine: the
// eviction rules are tested without a GPU (tests/offload/test_cache_policy.cpp, CudaOffloadPolicy.*),
// and moe_sim replays recorded runs through them (distributed/sim/cache_replay.h). expert_cache.h
// moves the bytes; this file only decides where they go.
//
// Pre-gated MoE (Hwang et al., ISCA 2024) keeps a few expert slots on the GPU and streams the rest
// from host memory; which experts stay resident between tokens is the cache policy:
//   lru  evict the slot used longest ago. Decoding touches the same popular experts token after
//        token, so recency is a good guess of the next use.
//   lfu  evict the expert chosen least often over the whole run (counts survive eviction, so an
//        expert that is popular overall comes back to a high rank); ties go to the least recent.
//   next_use
//        Belady's rule (evict what is wanted farthest in the future; with the future known, no policy
//        copies less) with the future estimated. A decoding step visits the M MoE blocks in order,
//        so an expert of block b is next wanted when the decoder comes back to b, d block visits
//        from now (d = M for the block being visited: its unchosen experts wait a whole step), and
//        at each later visit of b with the probability p that b chooses it: expected
//        d + M (1/p - 1) visits. p is a moving average over b's visits (each visit weighs
//        kChosenRateWeight), so it follows an expert that has just become popular; an expert never
//        chosen (a wrong prefetch) goes first; ties go to the least recent.
//        When a step's experts do not fit in the cache, LRU evicts the block visited longest ago,
//        which is the block visited next: the worst victim. This rule keeps the next blocks' experts
//        and gives up the ones the decoder has just finished with, as Belady's does.
// Either way a slot that a block is using (pinned: between acquire and release) is never evicted,
// and an empty slot is always filled before anything is evicted.
//
// Dimension legend: E experts per MoE block, K top-k.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moe::cuda {

enum class CachePolicy { lru, lfu, next_use };

std::string to_string(CachePolicy policy);                  // "lru", "lfu", "next_use"
CachePolicy cache_policy_from_string(std::string_view name);  // std::invalid_argument on others

// The fewest slots a cache may have: the most experts one MoE block can need at once, when every
// routed slot of a step picks a different expert: min(E, tokens_per_step * K). In decoding,
// tokens_per_step is the batch (one token per sequence); in a prefill it is batch * prompt length.
int64_t minimum_cache_slots(int64_t experts, int64_t tokens_per_step, int64_t top_k);

// Throws std::invalid_argument, naming the minimum and the sizes, when `slots` < `minimum_slots`.
void check_cache_size(int64_t slots, int64_t minimum_slots, int64_t experts, int64_t tokens_per_step,
                      int64_t top_k, size_t expert_bytes);

// A cache size given in MB (10^6 bytes) as whole slots, rounded down.
int64_t cache_slots_in_megabytes(double megabytes, size_t expert_bytes);

struct ExpertKey {
  int64_t block = -1;   // -1: the slot is empty
  int32_t expert = -1;
};

class ExpertSlotMap {
 public:
  ExpertSlotMap(int64_t slots, int64_t blocks, int64_t experts, CachePolicy policy);

  int64_t slots() const { return static_cast<int64_t>(holder_.size()); }
  CachePolicy policy() const { return policy_; }

  // The slot that holds (block, expert), if any.
  std::optional<int64_t> find(int64_t block, int32_t expert) const;
  ExpertKey holder(int64_t slot) const { return holder_.at(static_cast<size_t>(slot)); }

  // The slot to fill next: the lowest empty slot if there is one, else the unpinned slot the policy
  // ranks lowest; nothing when every slot is pinned. A linear scan: caches hold tens to hundreds of
  // slots, and a miss costs a PCIe copy of megabytes next to it.
  std::optional<int64_t> choose_victim() const;

  // Puts (block, expert) into `slot`, forgetting what it held. Its recency becomes "now".
  void assign(int64_t slot, int64_t block, int32_t expert);

  // A block's acquire, before its hits and misses are looked up: the block being visited now, and
  // the experts it chose (each id once, in [0, E)), for next_use's estimates. Every policy takes
  // the call. Throws std::invalid_argument for a block or id out of range; nothing changes then.
  void visit(int64_t block, std::span<const int32_t> chosen);
  // A block chose the slot's expert: recency "now", and its expert's use count + 1 (LFU's rank).
  void record_use(int64_t slot);
  // A hint that the slot is about to be used (a prefetch): recency only, no use counted.
  void touch(int64_t slot);

  // Pinned slots are never chosen as victims. Pins count, so nested holders unpin independently.
  void pin(int64_t slot);
  void unpin(int64_t slot);
  bool pinned(int64_t slot) const { return pins_.at(static_cast<size_t>(slot)) > 0; }
  int64_t pinned_slots() const;

  // How often (block, expert) was chosen over the run (LFU's count).
  uint64_t use_count(int64_t block, int32_t expert) const;
  // next_use's estimate of the probability that a visit of `block` chooses `expert`.
  double chosen_rate(int64_t block, int32_t expert) const;
  // next_use's rank: the expected block visits until (block, expert) is wanted again, from the
  // block visited last; +infinity for an expert never chosen.
  double expected_visits_to_next_use(int64_t block, int32_t expert) const;

  // The weight of one visit in next_use's moving average of an expert's chosen rate: about the
  // last 1/kChosenRateWeight visits of its block count.
  static constexpr double kChosenRateWeight = 0.25;

 private:
  size_t key_index(int64_t block, int32_t expert) const;
  void check_slot(int64_t slot) const;

  CachePolicy policy_;
  int64_t blocks_;
  int64_t experts_;
  std::vector<ExpertKey> holder_;      // [slots]
  std::vector<int32_t> pins_;          // [slots]
  std::vector<uint64_t> last_use_;     // [slots] clock tick of the last use or load
  std::vector<int64_t> slot_of_;       // [blocks * E] -> slot, or -1 when not resident
  std::vector<uint64_t> use_counts_;   // [blocks * E] uses over the run
  uint64_t clock_ = 0;
  // next_use: the block visited last (-1 before the first visit), each block's visits, and each
  // expert's chosen rate as of its block's visit rate_visit_ (it decays by 1 - kChosenRateWeight a
  // visit after that).
  int64_t position_ = -1;
  std::vector<int64_t> visits_;        // [blocks]
  std::vector<double> chosen_rate_;    // [blocks * E]
  std::vector<int64_t> rate_visit_;    // [blocks * E]
};

}  // namespace moe::cuda
