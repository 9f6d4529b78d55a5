// topology_view.h: the sparse-topology panel's data: which B x B blocks of a step's block-sparse
// matrix exist for each expert, where the padding rows are, and what the padded and dropping
// formulations would compute for the same routed tokens.
//
// In the dropless formulation (MegaBlocks) the hidden activations of all experts form one matrix
// [rows, E*H] tiled in B x B blocks; each expert's rows are rounded up to a multiple of B, so
// block row r belongs to one expert e, whose nonzero blocks are its own H/B block columns.
// Padded (GShard/Tutel) gives every expert C rows; dropping computes min(tokens, C) rows and
// drops the rest.
//   TopologyPicture p = topology_picture(*run.topology_at(step, 0), bars.tokens, capacity);
// Built into moe_viewer_model; tested by tests/viewer/test_views.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "run_model.h"  // TopologyRecord, RunModel

namespace moe::viewer {

struct ExpertBlocks {
  int64_t expert = 0;
  int64_t first_block_row = 0, block_rows = 0;  // the block rows this expert fills
  int64_t first_block_col = 0, block_cols = 0;  // its H/B block columns
  int64_t rows = 0;          // rows after padding (a multiple of B)
  int64_t tokens = -1;       // routed tokens (-1: unknown, no routing event at this step)
  int64_t padding_rows = -1; // rows - tokens (-1: unknown)
};

// Rows one formulation computes for the same routed tokens.
struct FormulationRows {
  int64_t computed_rows = 0;  // rows that go through the expert FFN
  int64_t token_rows = 0;     // of those, rows holding a real token
  int64_t dropped_tokens = 0; // tokens not computed at all
  std::vector<int64_t> rows_per_expert;  // [E]
};

struct TopologyPicture {
  bool valid = false;
  std::string problem;       // why the picture is incomplete, "" = fine
  int64_t block_size = 0;    // B
  int64_t block_rows = 0;
  int64_t block_cols = 0;    // the matrix's width in blocks (E * H / B)
  int64_t cols_per_expert = 0;  // H / B
  int64_t nnz = 0;
  int64_t padding_rows = 0;
  std::vector<ExpertBlocks> experts;
  FormulationRows dropless, padded, dropping;
  bool have_tokens = false;
  std::optional<int64_t> capacity;  // C used for padded / dropping
};

// tokens_per_expert may be empty (unknown); capacity may be absent (then padded and dropping
// are left empty and `problem` says so).
TopologyPicture topology_picture(const TopologyRecord& topology, const std::vector<int64_t>& tokens_per_expert,
                                 std::optional<int64_t> capacity);

// C for a step: the routing row's own capacity, else ceil(capacity_factor * routed / E) from the
// run's moe_config. Absent when neither is known (a dropless run with no capacity factor).
std::optional<int64_t> capacity_for(const RunModel& run, const RoutingRow* row);

}  // namespace moe::viewer
