// routing_view.cpp: heatmaps, bars and genre loads of the routing panel (routing_view.h).
#include "routing_view.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moe::viewer {

namespace {
void fill_load(const std::vector<int64_t>& tokens, int64_t E, float* out, int64_t stride) {
  double total = 0;
  for (int64_t t : tokens) total += static_cast<double>(t);
  const double mean = E > 0 ? total / static_cast<double>(E) : 0;
  for (int64_t e = 0; e < E; ++e) {
    const bool have = e < static_cast<int64_t>(tokens.size());
    out[e * stride] = !have ? std::numeric_limits<float>::quiet_NaN()
                      : mean > 0 ? static_cast<float>(static_cast<double>(tokens[e]) / mean) : 0.0f;
  }
}

// The routing row of `layer` recorded at or before `step`; null where the run has no such layer or
// no row that early.
const RoutingRow* row_at_or_before(const RunModel& run, int64_t layer, int64_t step) {
  auto it = run.routing.find(layer);
  return it == run.routing.end() ? nullptr : it->second.row_at_or_before(step);
}
}  // namespace

Matrix step_expert_load(const LayerRouting& layer, int64_t max_columns) {
  const int64_t E = layer.num_experts;
  const int64_t n = static_cast<int64_t>(layer.rows.size());
  Matrix out;
  if (E <= 0 || n <= 0 || max_columns <= 0) return out;
  out.rows = E;
  out.cols = std::min(n, max_columns);
  out.values.assign(static_cast<size_t>(out.rows * out.cols), 0.0f);
  // Reduce while filling: column c is the mean load factor over its bucket of steps, so a
  // 10,000-step layer never becomes a 10,000-column matrix.
  std::vector<float> one(static_cast<size_t>(E));
  for (int64_t c = 0; c < out.cols; ++c) {
    const Bucket b = bucket_range(n, out.cols, c);
    std::vector<double> sum(static_cast<size_t>(E), 0.0);
    std::vector<int64_t> count(static_cast<size_t>(E), 0);
    for (int64_t i = b.first; i < b.last; ++i) {
      fill_load(layer.rows[static_cast<size_t>(i)].tokens_per_expert, E, one.data(), 1);
      for (int64_t e = 0; e < E; ++e)
        if (!std::isnan(one[e])) { sum[e] += one[e]; ++count[e]; }
    }
    for (int64_t e = 0; e < E; ++e)
      out.values[static_cast<size_t>(e * out.cols + c)] =
          count[e] ? static_cast<float>(sum[e] / count[e]) : std::numeric_limits<float>::quiet_NaN();
  }
  return out;
}

Matrix layer_expert_load(const RunModel& run, int64_t step, std::vector<int64_t>* layers) {
  Matrix out;
  const int64_t E = run.num_experts();
  if (E <= 0 || run.routing.empty()) return out;
  out.rows = static_cast<int64_t>(run.routing.size());
  out.cols = E;
  out.values.assign(static_cast<size_t>(out.rows * out.cols), std::numeric_limits<float>::quiet_NaN());
  int64_t r = 0;
  for (const auto& [layer, lr] : run.routing) {
    if (layers) layers->push_back(layer);
    if (const RoutingRow* row = lr.row_at_or_before(step))
      fill_load(row->tokens_per_expert, E, &out.values[static_cast<size_t>(r * E)], 1);
    ++r;
  }
  return out;
}

ExpertBars expert_bars(const RunModel& run, int64_t layer, int64_t step) {
  ExpertBars bars;
  const RoutingRow* row = row_at_or_before(run, layer, step);
  if (!row) return bars;
  bars.valid = true;
  bars.step = row->step;
  bars.tokens = row->tokens_per_expert;
  bars.dropped = row->dropped_per_expert;
  bars.dropped.resize(bars.tokens.size(), 0);
  bars.capacity = row->capacity.value_or(-1);
  bars.stats = row->stats;
  bars.mean = bars.tokens.empty() ? 0 : row->stats.total_tokens / static_cast<double>(bars.tokens.size());
  return bars;
}

std::map<std::string, std::vector<double>> genre_load(const RunModel& run, int64_t layer, int64_t step) {
  std::map<std::string, std::vector<double>> out;
  const RoutingRow* row = row_at_or_before(run, layer, step);
  if (!row) return out;
  for (const auto& [genre, counts] : row->tokens_per_expert_by_genre) {
    double total = 0;
    for (int64_t c : counts) total += static_cast<double>(c);
    std::vector<double>& fractions = out[genre];
    for (int64_t c : counts) fractions.push_back(total > 0 ? static_cast<double>(c) / total : 0.0);
  }
  return out;
}

GenreTable genre_table(const RunModel& run, int64_t layer, int64_t step) {
  GenreTable table;
  const RoutingRow* row = row_at_or_before(run, layer, step);
  if (!row || row->tokens_per_expert_by_genre.empty()) return table;
  table.valid = true;
  table.step = row->step;
  table.tokens_per_expert = row->tokens_per_expert;
  int64_t E = static_cast<int64_t>(row->tokens_per_expert.size());
  for (const auto& [genre, counts] : row->tokens_per_expert_by_genre) E = std::max<int64_t>(E, static_cast<int64_t>(counts.size()));
  table.num_experts = E;
  table.expert_totals.assign(static_cast<size_t>(E), 0);
  for (const auto& [genre, counts] : row->tokens_per_expert_by_genre) {
    std::vector<int64_t> padded = counts;
    padded.resize(static_cast<size_t>(E), 0);  // a short list: the missing experts got none of it
    int64_t total = 0;
    for (size_t e = 0; e < padded.size(); ++e) {
      total += padded[e];
      table.expert_totals[e] += padded[e];
    }
    std::vector<double> fractions(padded.size(), 0.0);
    for (size_t e = 0; e < padded.size(); ++e)
      fractions[e] = total > 0 ? static_cast<double>(padded[e]) / static_cast<double>(total) : 0.0;
    table.genres.push_back(genre);
    table.counts.push_back(std::move(padded));
    table.genre_tokens.push_back(total);
    table.fractions.push_back(std::move(fractions));
  }
  return table;
}

}  // namespace moe::viewer
