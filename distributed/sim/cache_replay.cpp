// sim/cache_replay.cpp: a recorded offloaded-decoding run through the expert cache's eviction code,
// and its decode steps' times (see cache_replay.h).
#include "sim/cache_replay.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "offload/cache_policy.h"  // ExpertSlotMap, CachePolicy
#include "run_record.h"            // RunReader

namespace moe::sim {

using moe::cuda::CachePolicy;
using moe::cuda::ExpertSlotMap;

// ---- [SECTION] reading the record ----

int64_t OffloadTrace::minimum_slots() const {
  size_t most = 1;
  for (const std::vector<OffloadBlockRecord>& step : steps) {
    for (const OffloadBlockRecord& block : step) most = std::max(most, block.experts.size());
  }
  return static_cast<int64_t>(most);
}

namespace {

// An expert's bytes in bf16: w1 [D, W1] and w2 [H, D], W1 = H (GeLU) or 2H (SwiGLU's gate and up).
size_t expert_bytes_of(const nlohmann::json& moe_config) {
  const auto D = moe_config.value("model_dim", int64_t{0}), H = moe_config.value("hidden_dim", int64_t{0});
  const int64_t W1 = moe_config.value("activation", std::string("gelu")) == "swiglu" ? 2 * H : H;
  return static_cast<size_t>(2 * (D * W1 + H * D));
}

std::vector<int32_t> ids_of(const nlohmann::json& event, const char* field) {
  std::vector<int32_t> ids;
  if (event.contains(field) && event[field].is_array()) {
    for (const nlohmann::json& id : event[field]) ids.push_back(id.get<int32_t>());
  }
  return ids;
}

}  // namespace

OffloadTrace read_offload_trace(const std::filesystem::path& run_dir) {
  const std::string where = "--offload-trace " + run_dir.string() + ": ";
  RunRecord record;
  try {
    record = RunReader::load(run_dir);
  } catch (const std::exception& error) {
    throw std::invalid_argument(where + "not a readable run record: " + error.what());
  }
  const nlohmann::json& info = record.info;
  const nlohmann::json extra = info.value("extra", nlohmann::json::object());
  const nlohmann::json moe_config = info.value("moe_config", nlohmann::json::object());
  OffloadTrace trace;
  trace.source = run_dir.string();
  trace.mode = extra.value("mode", std::string());
  if (trace.mode == "gpu_only") {
    throw std::invalid_argument(where + "a gpu_only run: every expert is resident, there is no cache to replay");
  }
  trace.policy = extra.value("cache_policy", extra.value("policy", std::string("lru")));
  trace.cache_slots = extra.value("cache_slots", int64_t{0});
  trace.batch = extra.value("batch", int64_t{1});
  trace.experts = moe_config.value("num_experts", int64_t{0});
  trace.top_k = moe_config.value("top_k", int64_t{0});
  trace.expert_bytes = expert_bytes_of(moe_config);

  // The offload events by step and layer; the spans by step.
  std::map<int64_t, std::map<int64_t, OffloadBlockRecord>> by_step;
  std::map<int64_t, std::vector<RecordedSpan>> spans;
  for (const nlohmann::json& event : record.events) {
    const std::string type = event.value("type", "");
    const int64_t step = event.value("step", int64_t{-1});
    if (type == "offload") {
      OffloadBlockRecord block;
      block.layer = event.value("layer", int64_t{0});
      block.experts = ids_of(event, "experts");
      block.prefetched = ids_of(event, "prefetched");
      block.hits = event.value("hits", int64_t{0});
      block.misses = event.value("misses", int64_t{0});
      block.prefetched_used = event.value("prefetched_used", int64_t{0});
      block.bytes = event.value("bytes", int64_t{0});
      block.stall_us = event.value("stall_us", 0.0);
      if (!event.contains("experts")) {
        throw std::invalid_argument(where + "step " + std::to_string(step) + "'s offload event has no \"experts\" (recorded before the ids were kept)");
      }
      by_step[step][block.layer] = std::move(block);
    } else if (type == "span") {
      spans[step].push_back({event.value("stream", int64_t{0}), event.value("name", std::string()),
                             event.value("start_us", 0.0), event.value("duration_us", 0.0)});
    }
  }
  if (by_step.empty()) throw std::invalid_argument(where + "no offload events: not a recorded offloaded-decoding run");
  if (trace.cache_slots < 1 || trace.experts < 1 || trace.expert_bytes == 0) {
    throw std::invalid_argument(where + "run.json lacks extra.cache_slots, moe_config.num_experts or the expert's shape");
  }
  try {
    moe::cuda::cache_policy_from_string(trace.policy);  // the cache's own names
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(where + error.what());
  }
  for (const auto& [layer, block] : by_step.begin()->second) trace.layers.push_back(layer);
  int64_t expected_step = 0;
  for (auto& [step, blocks] : by_step) {
    if (step != expected_step++) {
      throw std::invalid_argument(where + "the offload events jump to step " + std::to_string(step) + " from step " +
                                  std::to_string(expected_step - 2) + ": the replay needs every step from 0 on");
    }
    if (blocks.size() != trace.layers.size()) {
      throw std::invalid_argument(where + "step " + std::to_string(step) + " has " + std::to_string(blocks.size()) +
                                  " offload events, step 0 has " + std::to_string(trace.layers.size()));
    }
    std::vector<OffloadBlockRecord> row;
    for (auto& [layer, block] : blocks) {
      for (const std::vector<int32_t>* ids : {&block.experts, &block.prefetched}) {
        for (const int32_t id : *ids) {
          if (id < 0 || id >= trace.experts) {
            throw std::invalid_argument(where + "step " + std::to_string(step) + " layer " + std::to_string(layer) +
                                        " names expert " + std::to_string(id) + ", outside [0, E=" +
                                        std::to_string(trace.experts) + ")");
          }
        }
      }
      row.push_back(std::move(block));
    }
    trace.steps.push_back(std::move(row));
    trace.spans.push_back(std::move(spans[step]));
  }
  return trace;
}

// ---- [SECTION] the replay ----

std::string to_string(ReplayPolicy policy) {
  switch (policy) {
    case ReplayPolicy::lru: return "lru";
    case ReplayPolicy::lfu: return "lfu";
    case ReplayPolicy::next_use: return "next_use";
    case ReplayPolicy::belady: return "belady";
  }
  return "?";
}

ReplayPolicy replay_policy_from_string(const std::string& name) {
  if (name == "lru") return ReplayPolicy::lru;
  if (name == "lfu") return ReplayPolicy::lfu;
  if (name == "next_use") return ReplayPolicy::next_use;
  if (name == "belady") return ReplayPolicy::belady;
  throw std::invalid_argument("policy '" + name + "' is not one of: lru, lfu, next_use, belady");
}

double CacheReplay::hit_rate(size_t first) const {
  int64_t hits = 0, all = 0;
  for (size_t s = first; s < steps.size(); ++s) {
    for (const ReplayedBlock& block : steps[s].blocks) {
      hits += block.hits;
      all += block.hits + block.misses;
    }
  }
  return all > 0 ? static_cast<double>(hits) / static_cast<double>(all) : 0.0;
}

int64_t CacheReplay::misses(size_t first) const {
  int64_t count = 0;
  for (size_t s = first; s < steps.size(); ++s) {
    for (const ReplayedBlock& block : steps[s].blocks) count += block.misses;
  }
  return count;
}

namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

// The expert cache's host side as ExpertCache drives it, minus the bytes: an ExpertSlotMap, which
// slots hold an unused prefetch, and for Belady each resident expert's next use. acquire, prefetch
// and release make the same ExpertSlotMap calls in the same order as ExpertCache's
// (cuda/offload/expert_cache.cpp) on purpose: the recorded runs' counts, equal block by block
// (tests/sim/test_cache_replay.cpp), are the check that they still do.
class Replayer {
 public:
  Replayer(const OffloadTrace& trace, int64_t slots, ReplayPolicy policy, const std::vector<bool>& held_blocks)
      : trace_(trace),
        held_blocks_(held_blocks),
        policy_(policy),
        // Belady's victims are chosen here; the map keeps the rest of the bookkeeping.
        map_(slots, trace.blocks(), trace.experts, map_policy(policy)),
        prefetched_unused_(static_cast<size_t>(slots), false) {
    if (policy == ReplayPolicy::belady) plan_next_uses();
  }

  void acquire(int64_t block, const std::vector<int32_t>& experts, ReplayedStep& step) {
    ReplayedBlock& counts = step.blocks[static_cast<size_t>(block)];
    map_.visit(block, experts);
    std::vector<int64_t> held(experts.size(), -1);
    // Hits first and pinned at once, so that no miss of this block evicts one of them.
    for (size_t i = 0; i < experts.size(); ++i) {
      const std::optional<int64_t> slot = map_.find(block, experts[i]);
      if (!slot) continue;
      held[i] = *slot;
      map_.pin(*slot);
      map_.record_use(*slot);
      ++counts.hits;
      if (prefetched_unused_[static_cast<size_t>(*slot)]) {
        ++counts.prefetched_used;
        prefetched_unused_[static_cast<size_t>(*slot)] = false;
      }
      used(block, experts[i], i);
    }
    for (size_t i = 0; i < experts.size(); ++i) {
      if (held[i] >= 0) continue;
      const int64_t victim = choose_victim().value();  // the trace's minimum_slots guarantees one
      copy_into(victim, block, experts[i], block, /*on_demand=*/true, step);
      held[i] = victim;
      map_.pin(victim);
      map_.record_use(victim);
      used(block, experts[i], i);
    }
    held_ = std::move(held);
    position_ += static_cast<int64_t>(experts.size());
  }

  void prefetch(int64_t block, const std::vector<int32_t>& experts, int64_t issued_in, ReplayedStep& step) {
    std::vector<int64_t> hinted;
    for (const int32_t expert : experts) {
      std::optional<int64_t> slot = map_.find(block, expert);
      if (slot) {
        map_.touch(*slot);
      } else {
        slot = choose_victim();
        if (!slot) {
          ++step.blocks[static_cast<size_t>(block)].prefetch_dropped;
          continue;
        }
        copy_into(*slot, block, expert, issued_in, /*on_demand=*/false, step);
      }
      map_.pin(*slot);
      hinted.push_back(*slot);
    }
    for (const int64_t slot : hinted) map_.unpin(slot);
  }

  void release() {
    for (const int64_t slot : held_) map_.unpin(slot);
    held_.clear();
  }

 private:
  static CachePolicy map_policy(ReplayPolicy policy) {
    if (policy == ReplayPolicy::lfu) return CachePolicy::lfu;
    if (policy == ReplayPolicy::next_use) return CachePolicy::next_use;
    return CachePolicy::lru;  // Belady's victims are chosen by the replay; LRU only breaks nothing
  }

  std::optional<int64_t> choose_victim() const {
    if (policy_ != ReplayPolicy::belady) return map_.choose_victim();
    std::optional<int64_t> victim;
    int64_t farthest = -1;
    for (int64_t slot = 0; slot < map_.slots(); ++slot) {
      const moe::cuda::ExpertKey key = map_.holder(slot);
      if (key.block < 0) return slot;  // empty: nothing to evict
      if (map_.pinned(slot)) continue;
      const int64_t next = next_use_of_[key_of(key.block, key.expert)];
      if (next > farthest) victim = slot, farthest = next;
    }
    return victim;
  }

  void copy_into(int64_t slot, int64_t block, int32_t expert, int64_t issued_in, bool on_demand, ReplayedStep& step) {
    map_.assign(slot, block, expert);
    prefetched_unused_[static_cast<size_t>(slot)] = !on_demand;
    ReplayedBlock& counts = step.blocks[static_cast<size_t>(block)];
    counts.bytes += static_cast<int64_t>(trace_.expert_bytes);
    ++(on_demand ? counts.misses : counts.prefetched);
    step.copies.push_back({issued_in, block, expert, on_demand});
  }

  size_t key_of(int64_t block, int32_t expert) const {
    return static_cast<size_t>(block * trace_.experts + expert);
  }

  // Belady: every acquired expert in request order gets a position; next_use_[p] is the position
  // of the same (block, expert)'s next request, kNever when there is none.
  void plan_next_uses() {
    std::vector<std::pair<int64_t, int32_t>> requests;
    for (const std::vector<OffloadBlockRecord>& step : trace_.steps) {
      for (size_t j = 0; j < step.size(); ++j) {
        if (held_blocks_[j]) continue;  // never acquired: on the GPU for good
        for (const int32_t e : step[j].experts) requests.emplace_back(static_cast<int64_t>(j), e);
      }
    }
    next_use_.assign(requests.size(), kNever);
    std::vector<int64_t> seen(static_cast<size_t>(trace_.blocks() * trace_.experts), kNever);
    for (size_t p = requests.size(); p-- > 0;) {
      const size_t key = key_of(requests[p].first, requests[p].second);
      next_use_[p] = seen[key];
      seen[key] = static_cast<int64_t>(p);
    }
    next_use_of_.assign(seen.size(), kNever);
  }

  // The i-th expert of the acquire at position_ was used: its next use is the one after.
  void used(int64_t block, int32_t expert, size_t i) {
    if (policy_ == ReplayPolicy::belady) {
      next_use_of_[key_of(block, expert)] = next_use_[static_cast<size_t>(position_) + i];
    }
  }

  const OffloadTrace& trace_;
  const std::vector<bool>& held_blocks_;  // [M] blocks held on the GPU, which the cache never sees
  ReplayPolicy policy_;
  ExpertSlotMap map_;
  std::vector<bool> prefetched_unused_;  // [slots] filled by prefetch, not acquired since
  std::vector<int64_t> held_;            // the acquired block's slots, until release
  int64_t position_ = 0;                 // requests acquired so far
  std::vector<int64_t> next_use_;        // [requests]
  std::vector<int64_t> next_use_of_;     // [M * E] the next request of a resident expert
};

}  // namespace

CacheReplay replay(const OffloadTrace& trace, int64_t slots, ReplayPolicy policy, bool prefetch,
                   const std::vector<int64_t>& held) {
  if (prefetch && policy == ReplayPolicy::belady) {
    throw std::invalid_argument("replay: Belady's policy is the floor of demand fetching; replay it without prefetch");
  }
  if (slots < trace.minimum_slots()) {
    throw std::invalid_argument("cache of " + std::to_string(slots) + " slots is below the minimum of " +
                                std::to_string(trace.minimum_slots()) + " for " + trace.source +
                                ": one acquire there asks for that many experts at once");
  }
  const auto M = static_cast<size_t>(trace.blocks());
  std::vector<bool> held_blocks(M, false);
  const std::string allowed = "; allowed: MoE block indices from 0 to " + std::to_string(trace.blocks() - 1) +
                              ", each once, fewer than all " + std::to_string(trace.blocks());
  for (const int64_t block : held) {
    if (block < 0 || block >= trace.blocks() || held_blocks[static_cast<size_t>(block)]) {
      throw std::invalid_argument("held MoE block " + std::to_string(block) +
                                  (block >= 0 && block < trace.blocks() ? " twice" : "") + allowed);
    }
    held_blocks[static_cast<size_t>(block)] = true;
  }
  if (held.size() >= M) throw std::invalid_argument("held MoE blocks: all " + std::to_string(M) + allowed);
  CacheReplay result{slots, policy, prefetch, {}};
  Replayer cache(trace, slots, policy, held_blocks);
  for (const std::vector<OffloadBlockRecord>& recorded : trace.steps) {
    ReplayedStep step;
    step.blocks.resize(M);
    if (prefetch && !held_blocks[0] && !recorded[0].prefetched.empty()) {
      cache.prefetch(0, recorded[0].prefetched, -1, step);
    }
    for (size_t j = 0; j < M; ++j) {
      const auto block = static_cast<int64_t>(j);
      if (held_blocks[j]) {
        step.blocks[j].hits += static_cast<int64_t>(recorded[j].experts.size());  // on the GPU already
      } else {
        cache.acquire(block, recorded[j].experts, step);
      }
      if (prefetch && j + 1 < M && !held_blocks[j + 1] && !recorded[j + 1].prefetched.empty()) {
        cache.prefetch(block + 1, recorded[j + 1].prefetched, block, step);
      }
      if (!held_blocks[j]) cache.release();
    }
    result.steps.push_back(std::move(step));
  }
  return result;
}

CacheReplay replay_recorded(const OffloadTrace& trace) {
  return replay(trace, trace.cache_slots, replay_policy_from_string(trace.policy), /*prefetch=*/true);
}

std::string first_difference(const OffloadTrace& trace, const CacheReplay& replay) {
  for (size_t s = 0; s < trace.steps.size() && s < replay.steps.size(); ++s) {
    for (size_t j = 0; j < trace.steps[s].size(); ++j) {
      const OffloadBlockRecord& r = trace.steps[s][j];
      const ReplayedBlock& p = replay.steps[s].blocks[j];
      const std::pair<const char*, std::pair<int64_t, int64_t>> counts[] = {
          {"hits", {r.hits, p.hits}}, {"misses", {r.misses, p.misses}},
          {"prefetched_used", {r.prefetched_used, p.prefetched_used}}, {"bytes", {r.bytes, p.bytes}}};
      for (const auto& [name, values] : counts) {
        if (values.first == values.second) continue;
        return "step " + std::to_string(s) + " block " + std::to_string(j) + " (layer " + std::to_string(r.layer) +
               "): " + name + " " + std::to_string(values.first) + " recorded, " + std::to_string(values.second) +
               " replayed";
      }
    }
  }
  if (trace.steps.size() != replay.steps.size()) return "the replay has another number of steps than the record";
  return "";
}

// ---- [SECTION] decode step times ----

namespace {

// offload_bench's median: the mean of the middle two of an even count.
double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Where block j's acquire meets the compute stream, from the step's start: its "wait_for_copy m<j>"
// span, else (a wait under 1 us is not drawn) the start of the block's moe phase.
std::vector<double> acquire_times(const std::vector<RecordedSpan>& spans, double origin, size_t blocks) {
  std::vector<double> at(blocks, -1);
  size_t moe_phase = 0;
  for (const RecordedSpan& span : spans) {
    if (span.stream == 0 && span.name == "moe" && moe_phase < blocks) {
      if (at[moe_phase] < 0) at[moe_phase] = span.start_us - origin;
      ++moe_phase;
    }
  }
  for (const RecordedSpan& span : spans) {
    if (span.stream != 2 || span.name.rfind("wait_for_copy m", 0) != 0) continue;
    const size_t j = std::stoul(span.name.substr(15));
    if (j < blocks) at[j] = span.start_us - origin;
  }
  return at;
}

}  // namespace

double StepTimePrediction::error() const {
  return median_measured_us > 0 ? median_predicted_us / median_measured_us - 1 : 0.0;
}

double measured_copy_gbs(const OffloadTrace& trace) {
  double bytes = 0, us = 0;
  for (size_t s = 0; s < trace.steps.size(); ++s) {
    for (const RecordedSpan& span : trace.spans[s]) {
      if (span.stream == 1) us += span.duration_us;
    }
    for (const OffloadBlockRecord& block : trace.steps[s]) bytes += static_cast<double>(block.bytes);
  }
  return us > 0 ? bytes / (us * 1e-6) / 1e9 : 0.0;
}

StepTimePrediction predict_step_times(const OffloadTrace& trace, const CacheReplay& replay, double copy_gbs) {
  if (!(copy_gbs > 0)) throw std::invalid_argument("predict_step_times: the copies' bandwidth must be > 0 GB/s");
  StepTimePrediction prediction;
  prediction.copy_gbs = copy_gbs;
  const double copy_us = static_cast<double>(trace.expert_bytes) / (copy_gbs * 1e3);
  const auto M = static_cast<size_t>(trace.blocks());
  std::vector<double> measured, predicted;
  for (size_t s = 1; s < trace.steps.size() && s < replay.steps.size(); ++s) {
    double origin = std::numeric_limits<double>::infinity(), end = -origin;
    for (const RecordedSpan& span : trace.spans[s]) {
      if (span.stream != 0) continue;
      origin = std::min(origin, span.start_us);
      end = std::max(end, span.start_us + span.duration_us);
    }
    if (!(end > origin)) continue;  // no compute spans: nothing to time
    const std::vector<double> acquire_at = acquire_times(trace.spans[s], origin, M);

    StepTime time;
    time.step = static_cast<int64_t>(s);
    time.measured_us = end - origin;
    // The compute stream's clock runs as recorded, shifted by how much longer (or shorter) the
    // predicted stalls so far were than the measured ones.
    double shift = 0, copy_free = 0;
    std::map<std::pair<int64_t, int32_t>, double> landed;  // (block, expert) copied this step -> when
    size_t next_copy = 0;
    const std::vector<ReplayedCopy>& copies = replay.steps[s].copies;
    auto issue = [&](int64_t issued_in, double at) {  // the copies this acquire (or the step's start) issued
      for (; next_copy < copies.size() && copies[next_copy].issued_in == issued_in; ++next_copy) {
        copy_free = std::max(copy_free, at) + copy_us;
        landed[{copies[next_copy].block, copies[next_copy].expert}] = copy_free;
      }
    };
    issue(-1, 0);
    for (size_t j = 0; j < M; ++j) {
      const OffloadBlockRecord& block = trace.steps[s][j];
      const double at = (acquire_at[j] >= 0 ? acquire_at[j] : 0) + shift;
      issue(static_cast<int64_t>(j), at);  // the misses, then the next block's prefetch
      double ready = at;
      for (const int32_t e : block.experts) {
        const auto copy = landed.find({static_cast<int64_t>(j), e});
        if (copy != landed.end()) ready = std::max(ready, copy->second);
      }
      const double stall = ready - at;
      time.measured_stall_us += block.stall_us;
      time.predicted_stall_us += stall;
      shift += stall - block.stall_us;
    }
    time.predicted_us = time.measured_us + shift;
    measured.push_back(time.measured_us);
    predicted.push_back(time.predicted_us);
    prediction.steps.push_back(time);
  }
  prediction.median_measured_us = median(measured);
  prediction.median_predicted_us = median(predicted);
  return prediction;
}

}  // namespace moe::sim
