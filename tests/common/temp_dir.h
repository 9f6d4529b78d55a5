// temp_dir.h: a fresh, empty directory per test, removed when the test ends.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>  // getpid

#include <chrono>
#include <filesystem>
#include <string>

namespace moe::testing {

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string name = std::string(info ? info->test_suite_name() : "suite") + "_" +
                             (info ? info->name() : "test");
    // The process id too: tests of the same name may run at once in two processes (ctest -j).
    const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = std::filesystem::temp_directory_path() /
            ("moe_common_" + name + "_" + std::to_string(::getpid()) + "_" + std::to_string(stamp));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace moe::testing
