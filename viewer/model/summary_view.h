// summary_view.h: the run-summary panel's comparison table, prepared apart from drawing.
//
// A training run ends with a "table" event named "summary" (steps, validation loss and bits per
// byte, median step time, tokens/s, MFU, dropped fraction). With several runs open, the panel
// puts those rows under each other, one row per run, so 16 runs compare at a glance instead of in
// 16 columns side by side.
//   TableComparison c = compare_tables({&dropless, &dense}, "summary");
// Built into moe_viewer_model; tested by tests/viewer/test_real_runs.cpp.
#pragma once

#include <string>
#include <vector>

#include "run_model.h"  // RunModel, TableRecord

namespace moe::viewer {

struct TableComparison {
  std::string name;
  std::vector<std::string> columns;            // "run", then every column of the tables, first seen first
  std::vector<std::vector<std::string>> rows;  // one per row of each run's table; "" where a run lacks a column
  int runs = 0;                                // how many runs have a table of this name
};

// The tables named `name` of the runs, one under the other.
TableComparison compare_tables(const std::vector<const RunModel*>& runs, const std::string& name);

// Orders the rows by one column: as numbers where both cells read as numbers, else as text; an
// empty cell sorts last either way.
void sort_rows(TableComparison& table, size_t column, bool ascending);

// The table names that at least two of the runs have, in first-seen order.
std::vector<std::string> shared_table_names(const std::vector<const RunModel*>& runs);

}  // namespace moe::viewer
