// program_exit.h: the one way a program ends on an error. It prints one line, `program: message`,
// on stderr and exits with a status a script can act on:
//   2  bad usage or bad input (a flag, a value, a data, config or checkpoint file): fix the command
//   1  a failure while running (no GPU, a full disk, a failed collective)
// run_program runs a program's body and turns whatever it throws into that line and status, so no
// exception reaches std::terminate (an abort and a core dump, which a user reads as a crash).
// std::invalid_argument and its kin (UsageError, moe::train::TrainConfigError) are bad input; a
// program names the other error types that mean bad input for it, e.g. the data file's.
//
//   int main(int argc, char** argv) {
//     return moe::run_program<moe::TextCorpusError>("moe_train", [&] { ...; return 0; });
//   }
// check_output_path: the check of an output path before the work starts, with the flag in its message;
// given the program's inputs, it also refuses an output that is one of them, or lies inside an
// input directory (a run): an output never overwrites what the program reads.
// A program's flags are read by command_line.h, which ends bad usage the same way.
// Tests: ctest -R ProgramExit; tests/programs/ holds every program to the convention.
#pragma once

#include <unistd.h>  // access

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <algorithm>  // mismatch
#include <vector>
#include <string>

namespace moe {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// Bad usage or input where no more specific error type fits; the message names the flag as typed.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Throws UsageError unless the file `path` (named by `flag`) could be written: it must not be a
// directory, and its nearest existing ancestor must be a directory this process may write into.
// For an output directory, pass a file in it (run_dir / "run.json"). Creates nothing, so a program
// can check its outputs before hours of work (or a GPU).
// An input of a program, by the flag (or argument) that names it: a file, or a directory it reads.
struct ProgramInput {
  std::string flag;
  std::filesystem::path path;
};

inline void check_output_path(const std::string& flag, const std::filesystem::path& path,
                              const std::vector<ProgramInput>& inputs = {}) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path out = fs::weakly_canonical(fs::absolute(path, error), error);
  for (const ProgramInput& input : inputs) {
    if (input.path.empty()) continue;  // an input the program was not given
    const fs::path in = fs::weakly_canonical(fs::absolute(input.path, error), error);
    if (out == in) {
      throw UsageError(flag + " " + path.string() + ": is the input " + input.flag + " itself; write the output elsewhere");
    }
    const auto [in_end, out_at] = std::mismatch(in.begin(), in.end(), out.begin(), out.end());
    if (fs::is_directory(in, error) && in_end == in.end()) {
      throw UsageError(flag + " " + path.string() + ": inside the input " + input.flag + " " + input.path.string() +
                       "; write the output elsewhere");
    }
  }
  if (fs::is_directory(path, error)) throw UsageError(flag + " " + path.string() + ": a directory, not a file");
  fs::path existing = fs::absolute(path, error).parent_path();
  while (!fs::exists(existing, error) && existing != existing.parent_path()) existing = existing.parent_path();
  if (!fs::is_directory(existing, error)) {
    throw UsageError(flag + " " + path.string() + ": cannot be created, " + existing.string() + " is not a directory");
  }
  if (access(existing.c_str(), W_OK | X_OK) != 0) {
    throw UsageError(flag + " " + path.string() + ": cannot be created in " + existing.string() + " (" +
                     std::strerror(errno) + ")");
  }
}

template <typename... BadInputErrors, typename Body>
int run_program(const char* program, Body&& body) {
  try {
    return body();
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "%s: %s\n", program, error.what());
    return kExitBadInput;
  } catch (const std::exception& error) {
    const bool bad_input = (... || (dynamic_cast<const BadInputErrors*>(&error) != nullptr));
    std::fprintf(stderr, "%s: %s\n", program, error.what());
    return bad_input ? kExitBadInput : kExitFailure;
  } catch (...) {
    std::fprintf(stderr, "%s: an unknown error\n", program);
    return kExitFailure;
  }
}

}  // namespace moe
