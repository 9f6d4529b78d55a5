// summary_view.cpp: tables of several runs under each other (summary_view.h).
#include "summary_view.h"

#include <algorithm>
#include <map>
#include <optional>

#include "parse_number.h"  // parse_real: a cell is a number only when the whole of it is one

namespace moe::viewer {

TableComparison compare_tables(const std::vector<const RunModel*>& runs, const std::string& name) {
  TableComparison out;
  out.name = name;
  out.columns.push_back("run");
  for (const RunModel* run : runs)
    for (const TableRecord& t : run->tables)
      if (t.name == name)
        for (const std::string& c : t.columns)
          if (std::find(out.columns.begin(), out.columns.end(), c) == out.columns.end()) out.columns.push_back(c);
  for (const RunModel* run : runs) {
    bool has = false;
    for (const TableRecord& t : run->tables) {
      if (t.name != name) continue;
      has = true;
      for (const auto& cells : t.rows) {
        std::vector<std::string> row(out.columns.size());
        row[0] = run->label;
        for (size_t c = 0; c < cells.size() && c < t.columns.size(); ++c) {
          const auto at = std::find(out.columns.begin(), out.columns.end(), t.columns[c]);
          row[static_cast<size_t>(at - out.columns.begin())] = cells[c];
        }
        out.rows.push_back(std::move(row));
      }
    }
    out.runs += has ? 1 : 0;
  }
  return out;
}

void sort_rows(TableComparison& table, size_t column, bool ascending) {
  auto number = [](const std::string& text, double& value) {
    const std::optional<double> read = parse_real(text);
    if (read) value = *read;
    return read.has_value();
  };
  std::stable_sort(table.rows.begin(), table.rows.end(), [&](const auto& a, const auto& b) {
    const std::string& x = column < a.size() ? a[column] : std::string();
    const std::string& y = column < b.size() ? b[column] : std::string();
    if (x.empty() || y.empty()) return !x.empty() && y.empty();  // empty cells last
    double u = 0, v = 0;
    if (number(x, u) && number(y, v)) return ascending ? u < v : u > v;
    return ascending ? x < y : x > y;
  });
}

std::vector<std::string> shared_table_names(const std::vector<const RunModel*>& runs) {
  std::vector<std::string> order;
  std::map<std::string, int> count;
  for (const RunModel* run : runs) {
    std::vector<std::string> seen_here;
    for (const TableRecord& t : run->tables) {
      if (std::find(seen_here.begin(), seen_here.end(), t.name) != seen_here.end()) continue;
      seen_here.push_back(t.name);
      if (count[t.name]++ == 0) order.push_back(t.name);
    }
  }
  std::vector<std::string> shared;
  for (const std::string& n : order)
    if (count[n] >= 2) shared.push_back(n);
  return shared;
}

}  // namespace moe::viewer
