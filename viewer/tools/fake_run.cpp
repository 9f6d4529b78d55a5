// fake_run.cpp: moe_fake_run, writes a SYNTHETIC run record (made-up numbers, labelled so in
// run.json and in the viewer) for the viewer's tests, its smoothness check and live-mode demos.
//
//   build/viewer/moe_fake_run --out /tmp/runs/big --steps 10000 --experts 64 --layers 8 --ranks 4
//   build/viewer/moe_fake_run --out /tmp/runs/live --steps 600 --live-ms 50 &   # then follow it:
//   build/viewer/moe_viewer --follow /tmp/runs/live
// Options: --out DIR (required) --steps N --experts E --layers L --ranks R --top-k K --tokens T
//          --capacity-factor F (0 = dropless) --hot-expert e --live-ms MS --seed S --name NAME
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "synthetic_run.h"

int main(int argc, char** argv) {
  moe::viewer::SyntheticRunOptions o;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("usage: moe_fake_run --out DIR [--steps N] [--experts E (1..4096)] [--layers L] [--ranks R]\n"
                  "         [--top-k K] [--tokens T] [--capacity-factor F (0 = dropless)] [--hot-expert e]\n"
                  "         [--live-ms MS] [--seed S] [--name NAME]\n"
                  "  writes a SYNTHETIC run record (made-up numbers) for the viewer's tests and demos\n");
      return 0;
    }
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "moe_fake_run: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (arg == "--out") out = next();
      else if (arg == "--steps") o.steps = std::stoll(next());
      else if (arg == "--experts") o.experts = std::stoll(next());
      else if (arg == "--layers") o.layers = std::stoll(next());
      else if (arg == "--ranks") o.ranks = std::stoll(next());
      else if (arg == "--top-k") o.top_k = std::stoll(next());
      else if (arg == "--tokens") o.tokens_per_step = std::stoll(next());
      else if (arg == "--capacity-factor") o.capacity_factor = std::stod(next());
      else if (arg == "--hot-expert") o.hot_expert = std::stoll(next());
      else if (arg == "--live-ms") o.live_delay_ms = std::stoll(next());
      else if (arg == "--seed") o.seed = std::stoull(next());
      else if (arg == "--name") o.name = next();
      else {
        std::fprintf(stderr, "moe_fake_run: unknown flag %s (see --help)\n", arg.c_str());
        return 2;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "moe_fake_run: %s %s: allowed: a number\n", arg.c_str(), argv[i]);
      return 2;
    }
  }
  // One line naming the flag and what it allows, as the user typed it.
  const char* bad = out.empty()                           ? "--out DIR is required"
                    : o.steps < 0                         ? "--steps: allowed: 0 or more"
                    : o.experts < 1 || o.experts > 4096   ? "--experts: allowed: 1 to 4096"
                    : o.layers < 1                        ? "--layers: allowed: 1 or more"
                    : o.ranks < 1                         ? "--ranks: allowed: 1 or more"
                                                          : nullptr;
  if (bad != nullptr) {
    std::fprintf(stderr, "moe_fake_run: %s (see --help)\n", bad);
    return 2;
  }
  try {
    moe::viewer::write_synthetic_run(out, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_fake_run: %s\n", e.what());
    return 1;
  }
  std::printf("moe_fake_run: wrote a SYNTHETIC run (%lld steps x %lld experts x %lld layers, %lld ranks) to %s\n",
              static_cast<long long>(o.steps), static_cast<long long>(o.experts), static_cast<long long>(o.layers),
              static_cast<long long>(o.ranks), out.c_str());
  return 0;
}
