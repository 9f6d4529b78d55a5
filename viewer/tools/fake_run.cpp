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

#include "command_line.h"  // CLI::App, parse_command_line, whole_number, finite_number
#include "moe_config.h"    // kMaxCapacityFactor
#include "program_exit.h"  // run_program, UsageError, check_output_path
#include "synthetic_run.h"

namespace {

int fake_run(int argc, char** argv) {
  moe::viewer::SyntheticRunOptions o;
  std::string out;
  bool overwrite = false;
  CLI::App app{"moe_fake_run: writes a SYNTHETIC run record (made-up numbers) for the viewer's tests and demos",
               "moe_fake_run"};
  app.add_option("--out", out, "the run record's directory (required)")->type_name("DIR");
  app.add_flag("--overwrite", overwrite, "replace a run record already in DIR");
  // Numbers are read whole here; their ranges, some of which depend on each other (K <= E), are
  // checked below with the flag in the message.
  app.add_option("--steps", o.steps, "steps (0 or more)")->capture_default_str()->check(moe::whole_number());
  app.add_option("--experts", o.experts, "E (1..4096)")->capture_default_str()->check(moe::whole_number());
  app.add_option("--layers", o.layers, "L")->capture_default_str()->check(moe::whole_number());
  app.add_option("--ranks", o.ranks, "R")->capture_default_str()->check(moe::whole_number());
  app.add_option("--top-k", o.top_k, "K (1..E)")->capture_default_str()->check(moe::whole_number());
  app.add_option("--tokens", o.tokens_per_step, "T per step")->capture_default_str()->check(moe::whole_number());
  app.add_option("--capacity-factor", o.capacity_factor, "F (0 = dropless)")->capture_default_str()
      ->check(moe::finite_number(0, moe::kMaxCapacityFactor));
  app.add_option("--hot-expert", o.hot_expert, "e: the expert that gets most tokens")->capture_default_str()
      ->check(moe::whole_number());
  app.add_option("--live-ms", o.live_delay_ms, "MS between steps, as a live run writes them")->capture_default_str()
      ->check(moe::whole_number());
  app.add_option("--seed", o.seed, "S")->capture_default_str()->check(moe::whole_number(0));
  app.add_option("--name", o.name, "the run's name");
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
  // One line naming the flag and what it allows, as the user typed it.
  const std::string top_k_allowed = "--top-k: allowed: 1 to E (E = " + std::to_string(o.experts) + ")";
  const char* bad = out.empty()                           ? "--out DIR is required"
                    : o.steps < 0                         ? "--steps: allowed: 0 or more"
                    : o.experts < 1 || o.experts > 4096   ? "--experts: allowed: 1 to 4096"
                    : o.layers < 1                        ? "--layers: allowed: 1 or more"
                    : o.ranks < 1                         ? "--ranks: allowed: 1 or more"
                    : o.tokens_per_step < 1 || o.tokens_per_step > moe::kMaxTokens
                        ? "--tokens: allowed: 1 to 16777216 (moe_config.h's limit)"
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
