// topology.cpp: builds the BCSR topology and its transpose indices (see topology.h).
#include "topology.h"

#include <stdexcept>
#include <string>

namespace moe::ref {

BlockSparseTopology make_topology(const MoeConfig& config, const DispatchPlan& plan) {
  validate(config);
  if (config.formulation != Formulation::dropless || plan.formulation != Formulation::dropless) {
    throw std::invalid_argument(
        "make_topology: formulation is " + std::string(to_string(plan.formulation)) +
        "; the block-sparse topology exists only for the dropless formulation");
  }
  const int64_t B = config.block_size, E = config.num_experts, H = config.hidden_dim;
  const int64_t blocks_per_expert = H / B;

  BlockSparseTopology topology;
  topology.block_size = B;
  topology.block_rows = plan.total_rows / B;
  topology.block_cols = E * blocks_per_expert;

  // ---- BCSR, row-major: block row r of expert e owns block columns e*H/B .. (e+1)*H/B - 1 ----
  topology.offsets.assign(topology.block_rows + 1, 0);
  topology.block_row_expert.assign(topology.block_rows, -1);
  topology.block_row_tokens.assign(topology.block_rows, 0);
  for (int64_t row = 0; row < topology.block_rows * B; ++row) {
    if (plan.row_slot[row] >= 0) ++topology.block_row_tokens[row / B];
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = plan.row_offsets[e] / B; r < plan.row_offsets[e + 1] / B; ++r) {
      topology.block_row_expert[r] = static_cast<int32_t>(e);
      for (int64_t j = 0; j < blocks_per_expert; ++j) {
        topology.row_indices.push_back(static_cast<int32_t>(r));
        topology.column_indices.push_back(static_cast<int32_t>(e * blocks_per_expert + j));
      }
      topology.offsets[r + 1] = static_cast<int32_t>(topology.row_indices.size());
    }
  }
  topology.nnz = static_cast<int64_t>(topology.row_indices.size());

  // ---- transpose: a stable counting sort of the block ids by block column ----
  topology.column_offsets.assign(topology.block_cols + 1, 0);
  for (int32_t c : topology.column_indices) ++topology.column_offsets[c + 1];
  for (int64_t c = 0; c < topology.block_cols; ++c) {
    topology.column_offsets[c + 1] += topology.column_offsets[c];
  }
  topology.transpose_indices.assign(topology.nnz, -1);
  IndexVector cursor(topology.column_offsets.begin(), topology.column_offsets.end() - 1);
  for (int64_t block = 0; block < topology.nnz; ++block) {
    topology.transpose_indices[cursor[topology.column_indices[block]]++] = static_cast<int32_t>(block);
  }
  return topology;
}

}  // namespace moe::ref
