// record_error.h: the one error type of the run-record, .npy and trace code in common/.
//
// Readers of run records and .npy files throw moe::RecordError (and nothing else) for anything
// wrong with what they read: a missing file, a corrupt line, a wrong field type, an unknown schema
// version, a file over the size limit. The message always names the file and, where it applies,
// the line and the field, so a user can open the file and see the problem.
//   try { auto run = moe::load_run("notebooks_data/runs/x"); }
//   catch (const moe::RecordError& e) { std::fprintf(stderr, "%s\n", e.what()); }
#pragma once

#include <stdexcept>

namespace moe {

class RecordError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moe
