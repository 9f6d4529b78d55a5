// fake_run.cpp: moe_fake_run, writes a SYNTHETIC run record (made-up numbers, labelled so in
// run.json and in the viewer) for the viewer's tests, its smoothness check and live-mode demos.
//
//   build/viewer/moe_fake_run --out /tmp/runs/big --steps 10000 --experts 64 --layers 8 --ranks 4
//   build/viewer/moe_fake_run --out /tmp/runs/live --steps 600 --live-ms 50 &   # then follow it:
//   build/viewer/moe_viewer --follow /tmp/runs/live
// Options: --out DIR (required) --overwrite --steps N --experts E --layers L --ranks R --top-k K
//          --tokens T --capacity-factor F (0 = dropless) --hot-expert e --live-ms MS --seed S --name NAME
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "program_exit.h"  // run_program, UsageError, check_output_path
#include "synthetic_run.h"

namespace {

int fake_run(int argc, char** argv) {
  moe::viewer::SyntheticRunOptions o;
  std::string out;
  bool overwrite = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("usage: moe_fake_run --out DIR [--overwrite] [--steps N] [--experts E (1..4096)] [--layers L]\n"
                  "         [--ranks R] [--top-k K (1..E)] [--tokens T] [--capacity-factor F (0 = dropless)]\n"
                  "         [--hot-expert e] [--live-ms MS] [--seed S] [--name NAME]\n"
                  "  writes a SYNTHETIC run record (made-up numbers) for the viewer's tests and demos\n");
      return 0;
    }
    if (arg == "--overwrite") {
      overwrite = true;
      continue;
    }
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw moe::UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--out") out = next();
    else if (arg == "--steps") o.steps = moe::whole_integer(arg, next());
    else if (arg == "--experts") o.experts = moe::whole_integer(arg, next());
    else if (arg == "--layers") o.layers = moe::whole_integer(arg, next());
    else if (arg == "--ranks") o.ranks = moe::whole_integer(arg, next());
    else if (arg == "--top-k") o.top_k = moe::whole_integer(arg, next());
    else if (arg == "--tokens") o.tokens_per_step = moe::whole_integer(arg, next());
    else if (arg == "--capacity-factor") o.capacity_factor = moe::finite_number(arg, next());
    else if (arg == "--hot-expert") o.hot_expert = moe::whole_integer(arg, next());
    else if (arg == "--live-ms") o.live_delay_ms = moe::whole_integer(arg, next());
    else if (arg == "--seed") o.seed = static_cast<uint64_t>(moe::whole_integer(arg, next()));
    else if (arg == "--name") o.name = next();
    else throw moe::UsageError("unknown flag " + arg + " (see --help)");
  }
  // One line naming the flag and what it allows, as the user typed it.
  const std::string top_k_allowed = "--top-k: allowed: 1 to E (E = " + std::to_string(o.experts) + ")";
  const char* bad = out.empty()                           ? "--out DIR is required"
                    : o.steps < 0                         ? "--steps: allowed: 0 or more"
                    : o.experts < 1 || o.experts > 4096   ? "--experts: allowed: 1 to 4096"
                    : o.layers < 1                        ? "--layers: allowed: 1 or more"
                    : o.ranks < 1                         ? "--ranks: allowed: 1 or more"
                    : o.top_k < 1 || o.top_k > o.experts  ? top_k_allowed.c_str()
                                                          : nullptr;
  if (bad != nullptr) throw moe::UsageError(std::string(bad) + " (see --help)");
  moe::check_output_path("--out", std::filesystem::path(out) / "run.json");
  if (!overwrite && (std::filesystem::exists(std::filesystem::path(out) / "run.json") ||
                     std::filesystem::exists(std::filesystem::path(out) / "events.jsonl"))) {
    throw moe::UsageError("refusing to overwrite the existing run at " + out + "; pass --overwrite to replace it");
  }
  moe::viewer::write_synthetic_run(out, o);
  std::printf("moe_fake_run: wrote a SYNTHETIC run (%lld steps x %lld experts x %lld layers, %lld ranks) to %s\n",
              static_cast<long long>(o.steps), static_cast<long long>(o.experts), static_cast<long long>(o.layers),
              static_cast<long long>(o.ranks), out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return moe::run_program("moe_fake_run", [&] { return fake_run(argc, argv); }); }
