// viewer_test_support.h: a fresh temporary folder per test, and small run-writing helpers.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "../common/temp_dir.h"  // moe::testing::TempDir

namespace moe::viewer::testing {

using moe::testing::TempDir;  // a fresh folder per test (tests/common/temp_dir.h)

inline void write_text(const std::filesystem::path& file, const std::string& text) {
  std::filesystem::create_directories(file.parent_path());
  std::ofstream(file, std::ios::binary) << text;
}

inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline const char* kRunJson = R"({"schema_version":1,"kind":"train","name":"t","start_time":"2026-11-22T00:00:00.000Z"})";

}  // namespace moe::viewer::testing
