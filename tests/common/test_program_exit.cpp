// test_program_exit.cpp: how a program ends on an error (common/program_exit.h): 2 for bad usage or
// input, 1 for a failure while running, one `program: message` line; outputs checked before the work.
//   ctest --test-dir build -R ProgramExit
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "checkpoint.h"  // CheckpointError, a bad-input type a program may name
#include "program_exit.h"
#include "temp_dir.h"

namespace {

TEST(ProgramExit, BadInputIsTwoFailureIsOneSuccessPassesThrough) {
  EXPECT_EQ(moe::run_program("p", [] { return 0; }), 0);
  EXPECT_EQ(moe::run_program("p", [] { return 3; }), 3);
  EXPECT_EQ(moe::run_program("p", []() -> int { throw moe::UsageError("--steps abc: not an integer"); }), 2);
  EXPECT_EQ(moe::run_program("p", []() -> int { throw std::runtime_error("disk full"); }), 1);
  EXPECT_EQ(moe::run_program("p", []() -> int { throw 42; }), 1);
  // A type the program names as bad input: 2; the same error in a program that does not: 1.
  EXPECT_EQ(moe::run_program<moe::CheckpointError>("p", []() -> int { throw moe::CheckpointError("bad magic"); }), 2);
  EXPECT_EQ(moe::run_program("p", []() -> int { throw moe::CheckpointError("bad magic"); }), 1);
}

TEST(ProgramExit, PrintsProgramColonMessage) {
  testing::internal::CaptureStderr();
  moe::run_program("moe_x", []() -> int { throw moe::UsageError("--steps abc: not an integer"); });
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "moe_x: --steps abc: not an integer\n");
}

TEST(ProgramExit, OutputPathUnderAFileOrThatIsADirectoryIsRefusedWithoutCreatingAnything) {
  moe::testing::TempDir dir;
  const std::filesystem::path file = dir.path() / "a_file";
  std::ofstream(file) << "x";
  moe::check_output_path("--out", dir.path() / "new" / "deeper" / "out.json");  // parents to create: fine
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "new"));
  try {
    moe::check_output_path("--out", file / "out.json");
    ADD_FAILURE() << "an output under a regular file was accepted";
  } catch (const moe::UsageError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("--out " + (file / "out.json").string()), std::string::npos) << message;
    EXPECT_NE(message.find("is not a directory"), std::string::npos) << message;
  }
  try {
    moe::check_output_path("--out", dir.path());
    ADD_FAILURE() << "a directory was accepted as an output file";
  } catch (const moe::UsageError& error) {
    EXPECT_NE(std::string(error.what()).find("a directory, not a file"), std::string::npos) << error.what();
  }
}

TEST(ProgramExit, AnOutputThatIsAnInputOrInsideAnInputDirectoryIsRefused) {
  moe::testing::TempDir dir;
  const std::filesystem::path input = dir.path() / "weights.ckpt", run = dir.path() / "run";
  std::ofstream(input) << "x";
  std::filesystem::create_directories(run);
  const std::vector<moe::ProgramInput> inputs{{"--checkpoint", input}, {"RUN_DIR", run}, {"--unused", ""}};
  moe::check_output_path("--out", dir.path() / "model.safetensors", inputs);  // beside them: fine
  moe::check_output_path("--out", dir.path() / "run_2" / "t.json", inputs);    // a name that only starts alike
  auto refusal = [&](const std::filesystem::path& out) {
    try {
      moe::check_output_path("--out", out, inputs);
    } catch (const moe::UsageError& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(input).find("is the input --checkpoint itself"), std::string::npos);
  EXPECT_NE(refusal(dir.path() / "." / "weights.ckpt").find("is the input --checkpoint itself"), std::string::npos);
  EXPECT_NE(refusal(run / "events.jsonl").find("inside the input RUN_DIR"), std::string::npos);
  EXPECT_NE(refusal(run / "sub" / ".." / "t.json").find("inside the input RUN_DIR"), std::string::npos);
  EXPECT_EQ(std::ifstream(input).get(), 'x');  // nothing written
}

}  // namespace
