// fuzz_target.h: what the readers' libFuzzer targets (fuzz_checkpoint.cpp, fuzz_safetensors.cpp,
// fuzz_npy.cpp, fuzz_config.cpp) share: a scratch file for readers that take a path, and a check
// that aborts (libFuzzer then reports the input). A reader refusing an input with its documented
// exception is the expected outcome; any other exception escapes and is reported as a finding.
// Built only with -DMOE_BUILD_FUZZERS=ON under clang (tests/common/CMakeLists.txt).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace moe::fuzz {

inline void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz: check failed: %s\n", what);
    std::abort();
  }
}

// `bytes` written to this process's scratch file (in /dev/shm where there is one), for readers
// that read a path; the same file every input.
inline const std::filesystem::path& scratch_file(std::string_view bytes, const char* name) {
  static const std::filesystem::path path = [&] {
    const std::filesystem::path base =
        std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    return base / (std::string(name) + "_" + std::to_string(getpid()));
  }();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

}  // namespace moe::fuzz
