// moe_train.cpp: train the tiny byte-level MoE transformer on one GPU, or time its steps.
//
//   ./build/cuda/train/moe_train                                   the default run on the Brown corpus
//   ./build/cuda/train/moe_train --formulation dropping --capacity-factor 1.0 --run-dir runs/cf1
//   ./build/cuda/train/moe_train --run-dir runs/cf1 --resume        continue from its last checkpoint
//   ./build/cuda/train/moe_train --data book.txt --steps 500        any text file
//   ./build/cuda/train/moe_train --preset throughput --benchmark-steps 30   tokens/s and MFU only
//   ./build/cuda/train/moe_train --help                            every setting and its default
// The run record goes to --run-dir (default runs/train); open it, also while it runs, with
// viewer/open.sh runs/train. Settings: train_config.h; the loop: trainer.h.
// Ctrl-C (SIGINT) or SIGTERM ends training after the current step with a checkpoint; the program
// prints the command that resumes it and exits 130 / 143 (common/stop_signal.h).
// Exit status: 0 done, 2 bad usage or input, 1 a failure while running (common/program_exit.h).
#include <iostream>
#include <string>
#include <vector>

#include "checkpoint.h"          // CheckpointError: a bad checkpoint is bad input
#include "core/device_info.h"    // why_no_gpu
#include "program_exit.h"        // run_program
#include "stop_signal.h"         // install_stop_handlers, exit_status_for_signal
#include "text_corpus.h"         // TextCorpusError: bad data is bad input
#include "train/train_config.h"  // parse_arguments, help_text
#include "train/trainer.h"       // train, benchmark

namespace {

// The command that continues a stopped run: the same arguments with --resume (and without
// --overwrite, which would start it again).
std::string resume_command(const std::vector<std::string>& arguments) {
  std::string command = "moe_train";
  bool resume = false;
  for (const std::string& argument : arguments) {
    if (argument == "--overwrite") continue;
    resume = resume || argument == "--resume";
    command += " " + argument;
  }
  return resume ? command : command + " --resume";
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> arguments(argv + 1, argv + argc);
  for (const std::string& argument : arguments) {
    if (argument == "--help" || argument == "-h") {
      std::cout << "usage: moe_train [--preset NAME] [--config FILE.json] [--setting value ...]\n"
                << moe::train::help_text(moe::train::preset("default"));
      return 0;
    }
  }
  return moe::run_program<moe::TextCorpusError, moe::CheckpointError>("moe_train", [&] {
    const moe::train::TrainConfig config = moe::train::parse_arguments(arguments);
    moe::train::validate(config);
    if (config.benchmark_steps > 0) {
      if (const std::string why = moe::cuda::why_no_gpu(); !why.empty()) throw std::runtime_error("no GPU: " + why);
      moe::train::benchmark(config, std::cout);
      return 0;
    }
    moe::install_stop_handlers();
    const moe::train::TrainResult result = moe::train::train(config, std::cout);
    if (result.stopped_by_signal != 0) {
      std::cerr << "moe_train: stopped by " << moe::signal_name(result.stopped_by_signal) << " after step "
                << result.steps_done << "; continue with: " << resume_command(arguments) << "\n";
      return moe::exit_status_for_signal(result.stopped_by_signal);
    }
    return 0;
  });
}
