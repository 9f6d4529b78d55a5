// run_model.cpp: RunModel, events of a run record -> typed series for the panels (run_model.h).
#include "run_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include "record_error.h"  // RecordError
#include "curves_view.h"   // sample_spacing
#include "run_record.h"    // RunReader, parse_run_record

namespace moe::viewer {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// An event the viewer cannot use; caught in ingest(), which skips the event with a warning.
struct SkipEvent : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int64_t get_int(const json& event, const char* field, int64_t fallback, int64_t lo, int64_t hi) {
  auto it = event.find(field);
  if (it == event.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) throw SkipEvent(std::string("'") + field + "' is not an integer");
  const int64_t value = it->is_number_unsigned() && it->get<uint64_t>() > uint64_t(INT64_MAX)
                            ? INT64_MAX : it->get<int64_t>();
  if (value < lo || value > hi)
    throw SkipEvent(std::string("'") + field + "' = " + std::to_string(value) + " is outside [" +
                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return value;
}

double get_double(const json& event, const char* field, double fallback) {
  auto it = event.find(field);
  if (it == event.end() || it->is_null()) return fallback;
  if (!it->is_number()) throw SkipEvent(std::string("'") + field + "' is not a number");
  return it->get<double>();
}

std::string get_string(const json& event, const char* field) {
  auto it = event.find(field);
  if (it == event.end() || !it->is_string()) return {};
  return it->get<std::string>();
}

// A JSON array of non-negative integers, at most max_size long.
std::vector<int64_t> get_counts(const json& value, const char* field, size_t max_size) {
  if (value.is_null()) return {};
  if (!value.is_array()) throw SkipEvent(std::string("'") + field + "' is not an array");
  if (value.size() > max_size)
    throw SkipEvent(std::string("'") + field + "' has " + std::to_string(value.size()) +
                    " entries, more than the viewer's limit of " + std::to_string(max_size));
  std::vector<int64_t> out;
  out.reserve(value.size());
  for (const json& v : value) {
    if (!v.is_number_integer()) throw SkipEvent(std::string("'") + field + "' holds a non-integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX / 4))
      throw SkipEvent(std::string("'") + field + "' holds a count too large to be real");
    const int64_t n = v.get<int64_t>();
    if (n < 0 || n > INT64_MAX / 4)
      throw SkipEvent(std::string("'") + field + "' holds " + std::to_string(n));
    out.push_back(n);
  }
  return out;
}

std::vector<int64_t> get_counts(const json& event, const char* field) {
  auto it = event.find(field);
  if (it == event.end()) return {};
  return get_counts(*it, field, static_cast<size_t>(kMaxExperts));
}

std::string cell_text(const json& cell) {
  if (cell.is_string()) return cell.get<std::string>();
  if (cell.is_number_float()) {
    char buffer[64];
    std::snprintf(buffer, sizeof buffer, "%.6g", cell.get<double>());
    return buffer;
  }
  if (cell.is_null()) return "-";
  return cell.dump();
}

constexpr int64_t kStepLimit = int64_t{1} << 53;  // steps must survive a trip through double

template <class Record>
const Record* closest_at_or_before(const std::vector<Record>& records, int64_t step, int64_t layer) {
  const Record* best = nullptr;
  const Record* first = nullptr;
  for (const Record& r : records) {
    if (r.layer != layer) continue;
    if (!first || r.step < first->step) first = &r;
    if (r.step <= step && (!best || r.step >= best->step)) best = &r;
  }
  return best ? best : first;
}

}  // namespace

std::string odd_run_file(const fs::path& dir) {
  for (const char* name : {"run.json", "events.jsonl"}) {
    const fs::path file = dir / name;
    std::error_code ec;
    const fs::file_status st = fs::status(file, ec);  // follows links: a link to a file is fine
    const char* what = nullptr;
    switch (st.type()) {
      case fs::file_type::fifo: what = "a named pipe"; break;
      case fs::file_type::directory: what = "a directory"; break;
      case fs::file_type::socket: what = "a socket"; break;
      case fs::file_type::block: what = "a block device"; break;
      case fs::file_type::character: what = "a character device"; break;
      case fs::file_type::unknown: what = "of unknown type"; break;
      default: break;  // regular, absent (the reader says what is missing), or unreadable
    }
    if (what)
      return file.string() + " is not a regular file (" + what + "): the viewer reads run records from files";
  }
  return "";
}

// ---- statistics ----

RoutingStats routing_stats(const std::vector<int64_t>& tokens, const std::vector<int64_t>& dropped) {
  RoutingStats s;
  const size_t E = tokens.size();
  if (E == 0) return s;
  double total = 0, largest = 0;
  for (int64_t t : tokens) {
    total += static_cast<double>(t);
    largest = std::max(largest, static_cast<double>(t));
  }
  s.total_tokens = total;
  if (total <= 0) return s;
  const double mean = total / static_cast<double>(E);
  double variance = 0, entropy = 0;
  for (int64_t t : tokens) {
    const double d = static_cast<double>(t) - mean;
    variance += d * d;
    const double p = static_cast<double>(t) / total;
    if (p > 0) entropy -= p * std::log(p);
  }
  variance /= static_cast<double>(E);
  s.max_over_mean = largest / mean;
  s.coefficient_of_variation = std::sqrt(variance) / mean;
  s.routing_entropy = E > 1 ? entropy / std::log(static_cast<double>(E)) : 1.0;
  double total_dropped = 0;
  for (int64_t d : dropped) total_dropped += static_cast<double>(d);
  s.dropped_fraction = std::clamp(total_dropped / total, 0.0, 1.0);
  return s;
}

const RoutingRow* LayerRouting::row_at_or_before(int64_t step) const {
  if (rows.empty()) return nullptr;
  auto it = std::upper_bound(rows.begin(), rows.end(), step,
                             [](int64_t s, const RoutingRow& r) { return s < r.step; });
  if (it == rows.begin()) return &rows.front();
  return &*(it - 1);
}

// ---- curves at bounded memory ----

namespace {

// The bucket of width `width` that holds `step`.
double bucket_of(double step, double width) { return std::floor(step / width); }

// Of the points [first, last) of one bucket, the indices of the lowest and the highest value, in
// step order; second == first when one point says all (a single point, or all NaN).
std::pair<size_t, size_t> bucket_extremes(const Series& series, size_t first, size_t last) {
  size_t low = first, high = first;
  bool any = false;
  for (size_t j = first; j < last; ++j) {
    const double v = series.values[j];
    if (std::isnan(v)) continue;  // NaN compares false both ways: never an extreme
    if (!any || v < series.values[low]) low = j;
    if (!any || v > series.values[high]) high = j;
    any = true;
  }
  return {std::min(low, high), std::max(low, high)};
}

}  // namespace

void halve_min_max(Series& series) {
  series.bucket_steps = series.bucket_steps > 0 ? series.bucket_steps * 2 : 2;
  const double width = series.bucket_steps;
  const size_t n = std::min(series.steps.size(), series.values.size());
  size_t out = 0;
  for (size_t first = 0; first < n;) {
    // The run of points in the same bucket; written back in place (out never passes first).
    const double bucket = bucket_of(series.steps[first], width);
    size_t last = first + 1;
    while (last < n && bucket_of(series.steps[last], width) == bucket) ++last;
    const auto [a, b] = bucket_extremes(series, first, last);
    const double step_a = series.steps[a], value_a = series.values[a];
    const double step_b = series.steps[b], value_b = series.values[b];
    series.steps[out] = step_a;
    series.values[out++] = value_a;
    if (b != a) {
      series.steps[out] = step_b;
      series.values[out++] = value_b;
    }
    first = last;
  }
  series.steps.resize(out);
  series.values.resize(out);
}

void add_sample(Series& series, double step, double value, size_t max_points) {
  const bool in_order = series.steps.empty() || step > series.steps.back();
  if (in_order && series.bucket_steps > 0 &&
      bucket_of(series.steps.back(), series.bucket_steps) == bucket_of(step, series.bucket_steps)) {
    // The sample joins the last bucket, whose one or two points are the series' tail.
    size_t first = series.steps.size() - 1;
    if (first > 0 && bucket_of(series.steps[first - 1], series.bucket_steps) == bucket_of(step, series.bucket_steps)) --first;
    series.steps.push_back(step);
    series.values.push_back(value);
    const auto [a, b] = bucket_extremes(series, first, series.steps.size());
    const double step_a = series.steps[a], value_a = series.values[a];
    const double step_b = series.steps[b], value_b = series.values[b];
    series.steps.resize(first);
    series.values.resize(first);
    series.steps.push_back(step_a);
    series.values.push_back(value_a);
    if (b != a) {
      series.steps.push_back(step_b);
      series.values.push_back(value_b);
    }
    return;
  }
  if (in_order) {
    series.steps.push_back(step);
    series.values.push_back(value);
  } else {
    auto pos = std::lower_bound(series.steps.begin(), series.steps.end(), step);
    const auto i = pos - series.steps.begin();
    if (pos != series.steps.end() && *pos == step) {
      series.values[static_cast<size_t>(i)] = value;  // the same step written again: keep the last
      return;
    } else {
      series.steps.insert(pos, step);
      series.values.insert(series.values.begin() + i, value);
    }
  }
  if (series.steps.size() > std::max<size_t>(max_points, 8)) {
    if (series.bucket_steps == 0) series.recorded_spacing = sample_spacing(series);
    // Down to half, so the next widening is max_points / 2 samples away (amortised O(1) a sample).
    while (series.steps.size() > std::max<size_t>(max_points, 8) / 2) halve_min_max(series);
  }
}

// ---- construction ----

RunModel::RunModel() = default;
RunModel::RunModel(RunModel&&) noexcept = default;
RunModel& RunModel::operator=(RunModel&&) noexcept = default;
RunModel::~RunModel() = default;

RunModel RunModel::load(const fs::path& dir, uint64_t read_block_bytes) {
  RunModel model;
  model.dir = dir;
  model.label = dir.filename().string();
  // Checked before reading: a named pipe would block the read until a writer comes.
  model.error = odd_run_file(dir);
  if (!model.error.empty()) {
    ++model.version;
    return model;
  }
  // One streaming pass: each event is turned into the model's compact series as it is parsed,
  // and its JSON dropped, so memory is what the model keeps, never the file or its events.
  try {
    RunReader reader(dir, ReadOptions{.read_block_bytes = read_block_bytes});
    model.ingest_info(reader.info());
    const auto take = [&model](const json& event) { model.ingest(event); };
    const auto bad_line = [&model](const std::string& message) { model.note_bad_line(message); };
    do reader.poll_each(take, uint64_t{64} << 20, bad_line); while (!reader.caught_up());
    if (std::string warning = reader.finish_last_line(take); !warning.empty()) model.warn(std::move(warning));
  } catch (const RecordError& e) {
    model.error = e.what();
  } catch (const std::exception& e) {
    model.error = dir.string() + ": " + e.what();
  }
  ++model.version;
  return model;
}

RunModel RunModel::from_text(std::string_view run_json_text, std::string_view events_text,
                             const std::string& source) {
  RunModel model;
  model.label = source;
  try {
    RunRecord record = parse_run_record(run_json_text, events_text, source,
                                        [&model](const std::string& message) { model.note_bad_line(message); });
    model.ingest_info(record.info);
    for (const json& event : record.events) model.ingest(event);
    for (std::string& w : record.warnings) model.warn(std::move(w));
  } catch (const RecordError& e) {
    model.error = e.what();
  } catch (const std::exception& e) {
    model.error = source + ": " + e.what();
  }
  ++model.version;
  return model;
}

RunModel RunModel::follow(const fs::path& dir) {
  RunModel model;
  model.dir = dir;
  model.label = dir.filename().string();
  model.waiting_for = "run.json";
  model.poll();
  return model;
}

bool RunModel::caught_up() const { return !reader_ || reader_->caught_up(); }

int64_t RunModel::poll(uint64_t max_bytes) {
  if (!error.empty()) return 0;
  if (!reader_) {
    if (waiting_for.empty()) return 0;  // a loaded run: nothing to follow
    std::error_code ec;
    if (!fs::exists(dir / "run.json", ec)) return 0;  // not started yet: try again later
    error = odd_run_file(dir);
    if (!error.empty()) {
      waiting_for.clear();
      ++version;
      return 0;
    }
    try {
      reader_ = std::make_unique<RunReader>(dir);
      ingest_info(reader_->info());
      waiting_for.clear();
      ++version;
    } catch (const std::exception& e) {
      error = e.what();
      reader_.reset();
      waiting_for.clear();
      return 0;
    }
  }
  // events.jsonl may appear (or be replaced) as a named pipe after the run started: opening one
  // would block until a writer comes, so it is checked on each poll.
  if (const std::string odd = odd_run_file(dir); !odd.empty()) {
    error = odd + " (live following stopped; reopen the run)";
    reader_.reset();
    ++version;
    return 0;
  }
  try {
    const int64_t bad_before = bad_lines;
    const int64_t events = reader_->poll_each([this](const json& event) { ingest(event); }, max_bytes,
                                              [this](const std::string& message) { note_bad_line(message); });
    // A followed run that was partial looks again at run.json once it has read everything: the
    // writer marks the run finished there when it closes.
    if (partial && reader_->caught_up()) {
      try {
        RunReader fresh(dir);
        if (!run_is_partial(fresh.info())) partial = false, ++version;
      } catch (const std::exception&) {
        // run.json being replaced right now: the next poll looks again
      }
    }
    if (events > 0 || bad_lines != bad_before) ++version;
    return events;
  } catch (const std::exception& e) {
    error = std::string(e.what()) + " (live following stopped; reopen the run)";
    reader_.reset();
    ++version;
    return 0;
  }
}

void RunModel::note_bad_line(const std::string& message) {
  ++bad_lines;
  warn(message);
}

void RunModel::warn(std::string message) {
  if (warnings.size() < kMaxWarnings) warnings.push_back(std::move(message));
  else ++warnings_not_kept;
}

bool RunModel::keep_another(const std::string& type, size_t kept) {
  if (kept < max_records_per_kind) return true;
  if (records_not_kept[type]++ == 0)
    warn("more than " + std::to_string(max_records_per_kind) + " " + type +
         " events: the later ones are counted, not kept (memory stays bounded)");
  return false;
}

void RunModel::note_step(int64_t step) {
  if (!has_steps()) {
    first_step = last_step = step;
  } else {
    first_step = std::min(first_step, step);
    last_step = std::max(last_step, step);
  }
}

bool run_is_partial(const json& run_json) {
  if (!run_json.is_object()) return false;
  auto it = run_json.find("finished");
  return it != run_json.end() && it->is_boolean() && !it->get<bool>();
}

void RunModel::ingest_info(const json& info) {
  has_info = true;
  RunSummary& s = summary;
  if (!info.is_object()) return;
  partial = run_is_partial(info);
  s.name = get_string(info, "name");
  s.kind = get_string(info, "kind");
  s.formulation = get_string(info, "formulation");
  s.start_time = get_string(info, "start_time");
  s.git_commit = get_string(info, "git_commit");
  if (auto it = info.find("world_size"); it != info.end() && it->is_number_integer())
    s.world_size = it->get<int64_t>();
  if (auto it = info.find("devices"); it != info.end() && it->is_array())
    for (const json& d : *it)
      if (d.is_string()) s.devices.push_back(d.get<std::string>());
  if (auto it = info.find("moe_config"); it != info.end()) s.moe_config = *it;
  if (s.formulation.empty() && s.moe_config.is_object()) {
    auto f = s.moe_config.find("formulation");
    if (f != s.moe_config.end() && f->is_string()) s.formulation = f->get<std::string>();
  }
  if (auto it = info.find("model"); it != info.end()) s.model = *it;
  if (auto it = info.find("extra"); it != info.end()) {
    s.extra = *it;
    if (it->is_object()) {
      auto flag = [&](const char* name) {
        auto found = it->find(name);
        return found != it->end() && found->is_boolean() && found->get<bool>();
      };
      s.synthetic = flag("synthetic");
      s.simulated = flag("simulated");
    }
  }
  if (!s.name.empty()) label = s.name;
}

void RunModel::ingest(const json& event) {
  ++events_total;
  try {
    ingest_or_throw(event);
  } catch (const std::exception& e) {  // SkipEvent, or a json type error from a field we missed
    ++events_skipped;
    std::string type = event.is_object() && event.contains("type") && event["type"].is_string()
                           ? event["type"].get<std::string>() : "?";
    warn("event " + std::to_string(events_total) + " (" + type + ") skipped: " + e.what());
  }
}

void RunModel::ingest_or_throw(const json& event) {
  if (!event.is_object()) throw SkipEvent("not a JSON object");
  const std::string type = get_string(event, "type");
  const bool has_step = event.contains("step");
  const int64_t step = get_int(event, "step", 0, -kStepLimit, kStepLimit);

  // Records other than the curves' are kept up to kMaxRecordsPerKind of each kind.
  const size_t kept = type == "routing"    ? static_cast<size_t>(routing_rows_)
                      : type == "topology" ? topologies.size()
                      : type == "span"     ? spans.size()
                      : type == "alltoall" ? alltoalls.size()
                      : type == "offload"  ? offloads.size()
                      : type == "tokens"   ? token_samples.size()
                      : type == "table"    ? tables.size()
                      : type == "verdict"  ? verdicts.size()
                                           : 0;
  if (!keep_another(type, kept)) {
    ++events_by_type[type];
    if (has_step) note_step(step);
    return;
  }

  if (type == "step") {
    for (auto it = event.begin(); it != event.end(); ++it) {
      if (it.key() == "type" || it.key() == "step") continue;
      if (!it->is_number() && !it->is_null()) continue;  // a label, not a metric
      const double value = it->is_null() ? std::numeric_limits<double>::quiet_NaN() : it->get<double>();
      if (std::abs(value) > kMaxPlotValue) {
        // Plotted, such a value would make the axis span overflow and hide the whole curve.
        if (values_beyond_plot[it.key()]++ == 0) {
          char text[96];
          std::snprintf(text, sizeof text, "%g, beyond the plotting range (|value| <= %g)", value, kMaxPlotValue);
          warn("step metric '" + it.key() + "' at step " + std::to_string(step) + " is " + text +
               ": such values are left out of the curve and counted");
        }
        continue;
      }
      add_sample(step_metrics[it.key()], static_cast<double>(step), value, max_curve_points);
    }
  } else if (type == "routing") {
    const int64_t layer = get_int(event, "layer", 0, 0, kMaxLayers - 1);
    RoutingRow row;
    row.step = step;
    row.tokens_per_expert = get_counts(event, "tokens_per_expert");
    row.dropped_per_expert = get_counts(event, "dropped_per_expert");
    if (!row.dropped_per_expert.empty() && row.dropped_per_expert.size() != row.tokens_per_expert.size())
      throw SkipEvent("dropped_per_expert has " + std::to_string(row.dropped_per_expert.size()) +
                      " entries, tokens_per_expert " + std::to_string(row.tokens_per_expert.size()));
    for (size_t e = 0; e < row.dropped_per_expert.size(); ++e)
      row.dropped_per_expert[e] = std::min(row.dropped_per_expert[e], row.tokens_per_expert[e]);
    if (event.contains("capacity")) row.capacity = get_int(event, "capacity", 0, 0, INT64_MAX / 4);
    if (auto it = event.find("tokens_per_expert_by_genre"); it != event.end() && it->is_object()) {
      if (static_cast<int64_t>(it->size()) > kMaxGenres) throw SkipEvent("more genres than the viewer's limit");
      for (auto g = it->begin(); g != it->end(); ++g)
        row.tokens_per_expert_by_genre[g.key()] = get_counts(*g, "tokens_per_expert_by_genre", kMaxExperts);
    }
    row.stats = routing_stats(row.tokens_per_expert, row.dropped_per_expert);
    LayerRouting& lr = routing[layer];
    lr.layer = layer;
    lr.num_experts = std::max<int64_t>(lr.num_experts, static_cast<int64_t>(row.tokens_per_expert.size()));
    ++routing_rows_;
    if (lr.rows.empty() || step > lr.rows.back().step) {
      lr.rows.push_back(std::move(row));
    } else {
      auto pos = std::lower_bound(lr.rows.begin(), lr.rows.end(), step,
                                  [](const RoutingRow& r, int64_t s) { return r.step < s; });
      if (pos != lr.rows.end() && pos->step == step) *pos = std::move(row);
      else lr.rows.insert(pos, std::move(row));
    }
  } else if (type == "topology") {
    TopologyRecord t;
    t.step = step;
    t.layer = get_int(event, "layer", 0, 0, kMaxLayers - 1);
    t.block_size = get_int(event, "block_size", 0, 1, int64_t{1} << 20);
    t.block_rows = get_int(event, "block_rows", 0, 0, int64_t{1} << 32);
    t.block_cols = get_int(event, "block_cols", 0, 0, int64_t{1} << 32);
    t.nnz = get_int(event, "nnz", 0, 0, int64_t{1} << 52);
    t.padding_rows = get_int(event, "padding_rows", 0, 0, int64_t{1} << 52);
    t.rows_per_expert = get_counts(event, "rows_per_expert");
    topologies.push_back(std::move(t));
  } else if (type == "span") {
    SpanRecord s;
    s.step = step;
    s.rank = get_int(event, "rank", 0, 0, kMaxRanks - 1);
    s.stream = get_int(event, "stream", 0, 0, 1 << 20);
    s.stream_name = get_string(event, "stream_name");
    s.name = get_string(event, "name");
    s.start_us = get_double(event, "start_us", 0);
    s.duration_us = get_double(event, "duration_us", 0);
    if (!std::isfinite(s.start_us) || !std::isfinite(s.duration_us) || s.duration_us < 0 ||
        std::abs(s.start_us) > 1e15 || s.duration_us > 1e15)
      throw SkipEvent("start_us / duration_us are not finite non-negative times");
    spans.push_back(std::move(s));
  } else if (type == "alltoall") {
    AllToAllRecord a;
    a.step = step;
    a.layer = get_int(event, "layer", -1, -1, kMaxLayers - 1);
    a.rank = get_int(event, "rank", 0, 0, kMaxRanks - 1);
    a.name = get_string(event, "name");
    a.duration_us = get_double(event, "duration_us", 0);
    if (!std::isfinite(a.duration_us) || a.duration_us < 0) throw SkipEvent("duration_us is not a time");
    if (event.contains("start_us")) a.start_us = get_double(event, "start_us", 0);
    auto it = event.find("bytes");
    if (it == event.end() || !it->is_array()) throw SkipEvent("'bytes' is not an array");
    const size_t R = it->size();
    if (R > static_cast<size_t>(kMaxRanks)) throw SkipEvent("'bytes' has more ranks than the viewer's limit");
    a.ranks = static_cast<int64_t>(R);
    a.bytes.reserve(R * R);
    for (const json& row : *it) {
      std::vector<int64_t> r = get_counts(row, "bytes", static_cast<size_t>(kMaxRanks));
      if (r.size() != R) throw SkipEvent("'bytes' is not square");
      a.bytes.insert(a.bytes.end(), r.begin(), r.end());
    }
    if (has_info && a.ranks != summary.world_size && alltoall_wrong_size++ == 0)
      warn("alltoall event at step " + std::to_string(step) + ": a " + std::to_string(a.ranks) + " x " +
           std::to_string(a.ranks) + " byte matrix in a run of " + std::to_string(summary.world_size) +
           " ranks (run.json world_size); drawn as recorded, such events are counted");
    alltoalls.push_back(std::move(a));
  } else if (type == "offload") {
    OffloadRecord o;
    o.step = step;
    o.layer = get_int(event, "layer", 0, 0, kMaxLayers - 1);
    o.hits = get_int(event, "hits", 0, 0, INT64_MAX / 4);
    o.misses = get_int(event, "misses", 0, 0, INT64_MAX / 4);
    o.stall_us = get_double(event, "stall_us", 0);
    if (!std::isfinite(o.stall_us) || o.stall_us < 0) throw SkipEvent("stall_us is not a time");
    o.prefetched = get_counts(event, "prefetched");
    o.experts = get_counts(event, "experts");
    o.on_host = get_counts(event, "on_host");
    o.host_us = get_double(event, "host_us", 0);
    if (!std::isfinite(o.host_us) || o.host_us < 0) throw SkipEvent("host_us is not a time");
    if (event.contains("prefetched_used")) o.prefetched_used = get_int(event, "prefetched_used", 0, 0, INT64_MAX / 4);
    if (event.contains("bytes")) o.bytes = get_int(event, "bytes", 0, 0, INT64_MAX / 4);
    offloads.push_back(std::move(o));
  } else if (type == "tokens") {
    TokensRecord t;
    t.step = step;
    t.layer = get_int(event, "layer", 0, 0, kMaxLayers - 1);
    t.text = get_string(event, "text");
    if (t.text.size() > kMaxSampleBytes) throw SkipEvent("text longer than the viewer's limit");
    auto it = event.find("experts");
    if (it == event.end() || !it->is_array()) throw SkipEvent("'experts' is not an array");
    if (it->size() > kMaxSampleBytes) throw SkipEvent("'experts' longer than the viewer's limit");
    for (const json& choice : *it) t.experts.push_back(get_counts(choice, "experts", 64));
    if (t.experts.size() != t.text.size())
      warn("tokens sample at step " + std::to_string(step) + ": " + std::to_string(t.text.size()) +
           " bytes of text but " + std::to_string(t.experts.size()) + " expert lists");
    token_samples.push_back(std::move(t));
  } else if (type == "table") {
    TableRecord t;
    t.name = get_string(event, "name");
    if (auto it = event.find("columns"); it != event.end() && it->is_array())
      for (const json& c : *it) t.columns.push_back(cell_text(c));
    if (auto it = event.find("rows"); it != event.end() && it->is_array())
      for (const json& row : *it) {
        std::vector<std::string> cells;
        if (row.is_array())
          for (const json& c : row) cells.push_back(cell_text(c));
        t.rows.push_back(std::move(cells));
      }
    tables.push_back(std::move(t));
  } else if (type == "verdict") {
    auto it = event.find("pass");
    verdicts.push_back({it != event.end() && it->is_boolean() && it->get<bool>(), get_string(event, "message")});
  }
  ++events_by_type[type.empty() ? "?" : type];
  if (has_step) note_step(step);
}

// ---- queries ----

int64_t RunModel::num_experts() const {
  int64_t E = 0;
  for (const auto& [layer, lr] : routing) E = std::max(E, lr.num_experts);
  return E;
}

Series RunModel::routing_stat_series(int64_t layer, std::string_view stat) const {
  Series out;
  auto it = routing.find(layer);
  if (it == routing.end()) return out;
  out.steps.reserve(it->second.rows.size());
  out.values.reserve(it->second.rows.size());
  for (const RoutingRow& r : it->second.rows) {
    double v = 0;
    if (stat == "max_over_mean") v = r.stats.max_over_mean;
    else if (stat == "coefficient_of_variation") v = r.stats.coefficient_of_variation;
    else if (stat == "dropped_fraction") v = r.stats.dropped_fraction;
    else if (stat == "routing_entropy") v = r.stats.routing_entropy;
    out.steps.push_back(static_cast<double>(r.step));
    out.values.push_back(v);
  }
  return out;
}

const TopologyRecord* RunModel::topology_at(int64_t step, int64_t layer) const {
  return closest_at_or_before(topologies, step, layer);
}

const TokensRecord* RunModel::tokens_at(int64_t step, int64_t layer) const {
  return closest_at_or_before(token_samples, step, layer);
}

}  // namespace moe::viewer
