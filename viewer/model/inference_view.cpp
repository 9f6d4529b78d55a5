// inference_view.cpp: the expert cache over decode steps, per-block hit rate and prefetch
// accuracy, and the modes-side-by-side rows (inference_view.h).
#include "inference_view.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace moe::viewer {

namespace {
// A block's column holds at most this many cells; a prefill of a large batch could ask for
// thousands of lookups, which no screen shows one by one.
constexpr int64_t kMaxCacheRows = 64;

const nlohmann::json* find_path(const nlohmann::json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

int64_t int_field(const nlohmann::json& object, const char* key, int64_t fallback) {
  const nlohmann::json* v = find_path(object, key);
  return v != nullptr && v->is_number_integer() ? v->get<int64_t>() : fallback;
}

std::string text_field(const nlohmann::json& object, const char* key) {
  const nlohmann::json* v = find_path(object, key);
  if (v == nullptr) return {};
  if (v->is_string()) return v->get<std::string>();
  if (v->is_boolean()) return v->get<bool>() ? "true" : "false";
  return v->is_number() ? v->dump() : std::string();
}
}  // namespace

const char* cache_cell_name(CacheCell cell) {
  switch (cell) {
    case CacheCell::empty: return "empty";
    case CacheCell::prefetched_used: return "prefetched and used";
    case CacheCell::hit: return "hit";
    case CacheCell::miss: return "miss";
    case CacheCell::on_host: return "computed on the host";
    case CacheCell::prefetched_wasted: return "prefetched and wasted";
  }
  return "?";
}

void CacheOutcomes::add(const CacheOutcomes& other) {
  chosen += other.chosen;
  resident_hits += other.resident_hits;
  prefetched_used += other.prefetched_used;
  misses += other.misses;
  on_host += other.on_host;
  // Unknown (-1) anywhere makes the sum unknown.
  prefetch_copies = prefetch_copies < 0 || other.prefetch_copies < 0 ? -1 : prefetch_copies + other.prefetch_copies;
  bytes += other.bytes;
  stall_us += other.stall_us;
  host_us += other.host_us;
}

int64_t CacheOutcomes::prefetched_wasted() const {
  return prefetch_copies < 0 ? -1 : std::max<int64_t>(0, prefetch_copies - prefetched_used);
}

double CacheOutcomes::hit_rate() const {
  if (on_gpu() <= 0) return std::numeric_limits<double>::quiet_NaN();
  return static_cast<double>(resident_hits + prefetched_used) / static_cast<double>(on_gpu());
}

double CacheOutcomes::prefetch_accuracy() const {
  if (prefetch_copies <= 0) return std::numeric_limits<double>::quiet_NaN();
  return static_cast<double>(prefetched_used) / static_cast<double>(prefetch_copies);
}

Rgba cache_cell_color(CacheCell cell) {
  switch (cell) {
    case CacheCell::empty: return {30, 30, 36, 255};
    case CacheCell::prefetched_used: return {70, 140, 255, 255};
    case CacheCell::hit: return {80, 200, 110, 255};
    case CacheCell::miss: return {235, 40, 40, 255};
    case CacheCell::on_host: return {175, 95, 235, 255};
    case CacheCell::prefetched_wasted: return {245, 170, 40, 255};
  }
  return kNoDataColor;
}

Image cache_image(const CacheTimeline& view) {
  Image image;
  image.width = static_cast<int64_t>(view.steps.size());
  image.height = static_cast<int64_t>(view.layers.size()) * view.rows_per_block;
  image.rgba.reserve(static_cast<size_t>(image.width * image.height * 4));
  for (const CacheCell cell : view.cells) {
    const Rgba c = cache_cell_color(cell);
    image.rgba.insert(image.rgba.end(), {c.r, c.g, c.b, c.a});
  }
  return image;
}

int64_t offloaded_expert_bytes(const RunModel& run) {
  const nlohmann::json& config = run.summary.moe_config;
  const int64_t D = int_field(config, "model_dim", 0), H = int_field(config, "hidden_dim", 0);
  if (D <= 0 || H <= 0) return 0;
  const int64_t w1_columns = text_field(config, "activation") == "swiglu" ? 2 * H : H;  // [gate | up]
  constexpr int64_t kBf16Bytes = 2;
  return (D * w1_columns + H * D) * kBf16Bytes;
}

CacheTimeline build_cache_timeline(const RunModel& run, int64_t first_step) {
  CacheTimeline view;
  view.expert_bytes = offloaded_expert_bytes(run);
  view.wasted_known = view.expert_bytes > 0;
  if (!view.wasted_known) view.note = "run.json has no moe_config with model_dim and hidden_dim: one expert's bytes are unknown";

  // One block at one step, the events in step order (a repeated (step, block) adds up).
  std::map<std::pair<int64_t, int64_t>, CacheOutcomes> outcomes;  // (step, layer)
  std::map<int64_t, size_t> layer_index;
  std::map<int64_t, size_t> step_index;
  for (const OffloadRecord& o : run.offloads) {
    if (o.step < first_step) continue;
    layer_index.emplace(o.layer, 0);
    step_index.emplace(o.step, 0);
    if (!o.experts.empty()) view.has_chosen_experts = true;
    if (!o.on_host.empty()) view.has_on_host = true;
    CacheOutcomes c;
    c.on_host = static_cast<int64_t>(o.on_host.size());
    c.chosen = o.hits + o.misses + c.on_host;
    c.misses = o.misses;
    c.stall_us = o.stall_us;
    c.host_us = o.host_us;
    c.bytes = o.bytes.value_or(0);
    c.prefetched_used = o.prefetched_used.value_or(0);
    c.resident_hits = o.hits - c.prefetched_used;
    c.prefetch_copies = -1;
    auto fail = [&](const std::string& why) {
      if (view.wasted_known) view.note = why;
      view.wasted_known = false;
    };
    if (c.resident_hits < 0) {
      c.resident_hits = 0;
      fail("step " + std::to_string(o.step) + ", layer " + std::to_string(o.layer) + ": prefetched_used exceeds hits");
    } else if (!o.prefetched_used || !o.bytes) {
      fail("the offload events have no prefetched_used and bytes (offload_bench --record-dir and "
           "moe_generate --run-dir write them)");
    } else if (view.expert_bytes > 0) {
      const int64_t copies = *o.bytes / view.expert_bytes;
      if (copies * view.expert_bytes != *o.bytes) {
        fail("step " + std::to_string(o.step) + ", layer " + std::to_string(o.layer) + ": " + std::to_string(*o.bytes) +
             " bytes copied is not a whole number of experts of " + std::to_string(view.expert_bytes) + " bytes");
      } else if (copies < o.misses) {
        fail("step " + std::to_string(o.step) + ", layer " + std::to_string(o.layer) + ": fewer expert copies than misses");
      } else {
        c.prefetch_copies = copies - o.misses;
      }
    }
    auto [it, inserted] = outcomes.try_emplace({o.step, o.layer}, c);
    if (!inserted) it->second.add(c);
  }
  if (outcomes.empty()) {
    view.wasted_known = false;
    return view;
  }
  for (auto& [layer, index] : layer_index) {
    index = view.layers.size();
    view.layers.push_back(layer);
  }
  for (auto& [step, index] : step_index) {
    index = view.steps.size();
    view.steps.push_back(step);
  }
  // With one event not derivable, no event's wasted copies are shown: a view that shows them for
  // some blocks only would read as "no waste" elsewhere.
  if (!view.wasted_known)
    for (auto& [key, c] : outcomes) c.prefetch_copies = -1;

  // At one step, wasted are the copies made ahead that this step did not choose.
  auto cells_of = [&](const CacheOutcomes& c) {
    return c.prefetched_used + c.resident_hits + c.misses + c.on_host + std::max<int64_t>(0, c.prefetched_wasted());
  };
  for (const auto& [key, c] : outcomes) view.rows_per_block = std::max(view.rows_per_block, cells_of(c));
  if (view.rows_per_block > kMaxCacheRows) {
    view.rows_per_block = kMaxCacheRows;
    if (view.note.empty()) view.note = "more than " + std::to_string(kMaxCacheRows) + " cells in a block at one step: the rest are not drawn";
  }
  const size_t rows = view.layers.size() * static_cast<size_t>(view.rows_per_block);
  view.cells.assign(rows * view.steps.size(), CacheCell::empty);
  view.per_block.assign(view.layers.size(), CacheOutcomes{});
  for (const auto& [key, c] : outcomes) {
    const size_t column = step_index[key.first], block = layer_index[key.second];
    view.per_block[block].add(c);
    size_t row = block * static_cast<size_t>(view.rows_per_block);
    const size_t end = row + static_cast<size_t>(view.rows_per_block);
    auto fill = [&](CacheCell cell, int64_t count) {
      for (int64_t i = 0; i < count && row < end; ++i, ++row) view.cells[row * view.steps.size() + column] = cell;
    };
    fill(CacheCell::prefetched_used, c.prefetched_used);
    fill(CacheCell::hit, c.resident_hits);
    fill(CacheCell::miss, c.misses);
    fill(CacheCell::on_host, c.on_host);
    fill(CacheCell::prefetched_wasted, std::max<int64_t>(0, c.prefetched_wasted()));
  }
  for (const CacheOutcomes& b : view.per_block) view.total.add(b);
  return view;
}

std::string decode_model_key(const RunModel& run) {
  const nlohmann::json& extra = run.summary.extra;
  const nlohmann::json& config = run.summary.moe_config;
  // offload_bench names its model by scale (random weights); moe_generate by its checkpoint.
  std::string weights = text_field(extra, "scale");
  if (weights.empty()) weights = text_field(extra, "weights");
  if (weights.empty()) weights = text_field(run.summary.model, "weights");
  std::string key;
  for (const std::string& part : {text_field(extra, "program"), weights, "D=" + text_field(config, "model_dim"),
                                  "H=" + text_field(config, "hidden_dim"), "E=" + text_field(config, "num_experts"),
                                  "K=" + text_field(config, "top_k")}) {
    if (part.empty()) continue;
    if (!key.empty()) key += ' ';
    key += part;
  }
  return key;
}

DecodeModeRow decode_mode_row(const RunModel& run, int64_t first_step) {
  DecodeModeRow row;
  row.label = run.label;
  row.mode = text_field(run.summary.extra, "mode");
  if (row.mode.empty()) row.mode = "?";
  row.model = decode_model_key(run);
  row.cache_slots = int_field(run.summary.extra, "cache_slots", -1);
  const CacheTimeline cache = build_cache_timeline(run, first_step);
  row.outcomes = cache.total;
  row.decode_steps = static_cast<int64_t>(cache.steps.size());
  row.stall_us_per_step = row.decode_steps > 0 ? row.outcomes.stall_us / static_cast<double>(row.decode_steps) : 0;
  row.host_us_per_step = row.decode_steps > 0 ? row.outcomes.host_us / static_cast<double>(row.decode_steps) : 0;
  // A step's time: from its first span's start to its last span's end, every stream.
  std::map<int64_t, std::pair<double, double>> extent;  // step -> (start, end)
  for (const SpanRecord& s : run.spans) {
    if (s.step < first_step) continue;
    auto [it, inserted] = extent.try_emplace(s.step, s.start_us, s.start_us + s.duration_us);
    if (!inserted) {
      it->second.first = std::min(it->second.first, s.start_us);
      it->second.second = std::max(it->second.second, s.start_us + s.duration_us);
    }
  }
  std::vector<double> times;
  for (const auto& [step, span] : extent) times.push_back(span.second - span.first);
  if (!times.empty()) {
    std::sort(times.begin(), times.end());
    const size_t n = times.size();
    row.median_step_us = n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  }
  return row;
}

bool is_stall_span(const std::string& name) { return name.rfind("wait_for_copy", 0) == 0; }

}  // namespace moe::viewer
