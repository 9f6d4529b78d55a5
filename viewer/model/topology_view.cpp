// topology_view.cpp: block-sparse topology picture and formulation comparison (topology_view.h).
#include "topology_view.h"

#include <algorithm>
#include <cmath>

namespace moe::viewer {

TopologyPicture topology_picture(const TopologyRecord& t, const std::vector<int64_t>& tokens,
                                 std::optional<int64_t> capacity) {
  TopologyPicture p;
  p.block_size = t.block_size;
  p.block_rows = t.block_rows;
  p.nnz = t.nnz;
  p.padding_rows = t.padding_rows;
  p.capacity = capacity;
  const int64_t E = static_cast<int64_t>(t.rows_per_expert.size());
  if (t.block_size <= 0) {
    p.problem = "block_size is 0";
    return p;
  }
  // Each block row holds one expert's rows and that expert's H/B blocks: nnz / block_rows.
  p.cols_per_expert = t.block_rows > 0 ? t.nnz / t.block_rows : 0;
  p.block_cols = E > 0 && p.cols_per_expert > 0 ? p.cols_per_expert * E : t.block_cols;
  if (E == 0) {
    p.problem = "the topology event has no rows_per_expert: blocks cannot be placed per expert";
    p.valid = true;
    return p;
  }
  p.have_tokens = static_cast<int64_t>(tokens.size()) == E;
  int64_t block_row = 0, rows_total = 0;
  for (int64_t e = 0; e < E; ++e) {
    ExpertBlocks b;
    b.expert = e;
    b.rows = t.rows_per_expert[e];
    b.first_block_row = block_row;
    b.block_rows = (b.rows + t.block_size - 1) / t.block_size;
    b.first_block_col = e * p.cols_per_expert;
    b.block_cols = p.cols_per_expert;
    if (p.have_tokens) {
      b.tokens = tokens[e];
      b.padding_rows = std::max<int64_t>(0, b.rows - b.tokens);
    }
    block_row += b.block_rows;
    rows_total += b.rows;
    p.experts.push_back(b);
  }
  if (block_row != t.block_rows || rows_total % t.block_size != 0)
    p.problem = "rows_per_expert (" + std::to_string(rows_total) + " rows, " + std::to_string(block_row) +
                " block rows) does not match block_rows = " + std::to_string(t.block_rows);
  p.valid = true;

  p.dropless.rows_per_expert = t.rows_per_expert;
  p.dropless.computed_rows = rows_total;
  if (!p.have_tokens) {
    if (p.problem.empty()) p.problem = "no routing event at this step: tokens per expert unknown";
    return p;
  }
  for (int64_t n : tokens) p.dropless.token_rows += n;
  if (!capacity) {
    if (p.problem.empty()) p.problem = "capacity unknown (no capacity and no capacity_factor): padded and dropping not shown";
    return p;
  }
  const int64_t C = *capacity;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = std::min(tokens[e], C);
    p.padded.rows_per_expert.push_back(C);
    p.padded.computed_rows += C;
    p.padded.token_rows += kept;
    p.padded.dropped_tokens += tokens[e] - kept;
    p.dropping.rows_per_expert.push_back(kept);
    p.dropping.computed_rows += kept;
    p.dropping.token_rows += kept;
    p.dropping.dropped_tokens += tokens[e] - kept;
  }
  return p;
}

std::optional<int64_t> capacity_for(const RunModel& run, const RoutingRow* row) {
  if (row && row->capacity) return row->capacity;
  if (!row || row->tokens_per_expert.empty()) return std::nullopt;
  const auto& config = run.summary.moe_config;
  if (!config.is_object()) return std::nullopt;
  auto cf = config.find("capacity_factor");
  if (cf == config.end() || !cf->is_number()) return std::nullopt;
  const double factor = cf->get<double>();
  if (!(factor > 0) || factor > 1e6) return std::nullopt;
  const double E = static_cast<double>(row->tokens_per_expert.size());
  return static_cast<int64_t>(std::ceil(factor * row->stats.total_tokens / E));
}

}  // namespace moe::viewer
