// lesson08_quality.cpp: lesson 08, dropless vs token dropping in a small trained language model
// (MegaBlocks' Figure 2, small). Reads the training runs that lessons/08_experiment.sh recorded on
// a GPU (shipped in notebooks_data/runs/train_*), groups them by formulation, and prints the
// validation loss at equal steps, the time per step and the tokens dropped, with the spread over
// seeds. Runs on any machine: it reads run records, it trains nothing, so that the quality claim
// behind dropless computation can be checked without a GPU.
//
//   build/lessons/lesson08_quality --out runs/lesson08_quality --overwrite   the shipped runs
//   build/lessons/lesson08_quality --runs runs/lesson08  runs of your own (08_experiment.sh --out)
// Lesson text: lessons/08_quality.md.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "command_line.h"        // CLI::App: the lesson's own flag
#include "lesson_support.h"      // parse_options, create_lesson_run, Table, finish
#include "run_record.h"          // RunReader
#include "train/train_config.h"  // TrainConfig, apply_json: the settings the runs were trained with

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// One training run as the lesson needs it.
struct Run {
  std::string directory;
  std::string variant;   // "dropless", "dropping cf 1.0", "padded", "dense", ...
  int order = 0;         // table order
  int64_t seed = 0;
  std::map<int64_t, double> val_bits;  // step -> validation bits per byte
  double median_step_ms = 0;
  double dropped_fraction = 0;
  json train;  // the settings it was trained with (train_config in run.json)
};

// The variant's label, from the settings the run was trained with.
std::pair<std::string, int> variant_of(const json& train) {
  if (train.value("moe_layers", "") == "none") return {"dense (same active FLOPs)", 4};
  const std::string formulation = train.value("formulation", "?");
  std::string label = formulation;
  if (train.value("pregated", false)) label += " pre-gated";
  if (formulation == "dropping") {
    char cf[32];  // "cf 1.0", "cf 1.5", "cf 1.25"
    const double factor = train.value("capacity_factor", 0.0);
    std::snprintf(cf, sizeof(cf), factor == std::round(factor) ? " cf %.1f" : " cf %.3g", factor);
    return {label + cf, train.value("capacity_factor", 0.0) < 1.25 ? 1 : 2};
  }
  if (formulation == "padded") return {label + " (C = T, nothing dropped)", 3};
  return {label, label == "dropless" ? 0 : 5};
}

// The lesson compares formulations of one model: the settings below must agree. Of the runs found,
// the model most of them share is compared; a run trained with other sizes or for other steps (e.g.
// notebooks_data/runs/train_throughput_preset_300steps) is left out, with a line saying so.
json model_of(const json& train) {
  json model = json::object();
  for (const char* key : {"model_dim", "num_layers", "num_heads", "seq_len", "num_experts", "top_k",
                          "expert_hidden_dim", "dense_hidden_dim", "batch", "steps", "learning_rate"}) {
    model[key] = train.value(key, json());
  }
  return model;
}

std::vector<Run> load_runs(const fs::path& directory) {
  std::vector<Run> runs;
  if (!fs::is_directory(directory)) return runs;
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.is_directory() && entry.path().filename().string().rfind("train_", 0) == 0) paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<json> models;
  for (const fs::path& path : paths) {
    const moe::RunRecord record = moe::RunReader::load(path);
    if (record.info.value("kind", "") != "train") continue;
    const json train = record.info.value("extra", json::object()).value("train_config", json::object());
    Run run;
    run.directory = path.string();
    run.train = train;
    std::tie(run.variant, run.order) = variant_of(train);
    run.seed = train.value("seed", int64_t{0});
    for (const json& event : record.events) {
      if (event["type"] == "step" && event.contains("val_bits_per_byte") && event["val_bits_per_byte"].is_number()) {
        run.val_bits[event["step"].get<int64_t>()] = event["val_bits_per_byte"].get<double>();
      }
      if (event["type"] == "table" && event.value("name", "") == "summary" && !event["rows"].empty()) {
        const json& columns = event["columns"];
        const json& row = event["rows"][0];
        for (size_t i = 0; i < columns.size(); ++i) {
          if (columns[i] == "median_step_ms") run.median_step_ms = row[i].get<double>();
          if (columns[i] == "dropped_fraction") run.dropped_fraction = row[i].get<double>();
        }
      }
    }
    if (run.val_bits.empty()) continue;
    runs.push_back(run);
    models.push_back(model_of(train));
  }
  // The model most runs share (the first of them on a tie), and only its runs.
  size_t best = 0, best_count = 0;
  for (size_t i = 0; i < models.size(); ++i) {
    const size_t count = size_t(std::count(models.begin(), models.end(), models[i]));
    if (count > best_count) best = i, best_count = count;
  }
  std::vector<Run> kept;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (models[i] == models[best]) {
      kept.push_back(runs[i]);
    } else {
      std::printf("(left out: %s, trained with another model or schedule than the other runs)\n",
                  fs::path(runs[i].directory).filename().c_str());
    }
  }
  return kept;
}

struct Spread {
  double mean = 0, low = 0, high = 0;
  int count = 0;
};
Spread spread(const std::vector<double>& values) {
  Spread s;
  if (values.empty()) return s;
  s.count = int(values.size());
  s.low = *std::min_element(values.begin(), values.end());
  s.high = *std::max_element(values.begin(), values.end());
  for (double v : values) s.mean += v / double(values.size());
  return s;
}
std::string format(const Spread& s, int digits) {
  char text[96];
  if (s.count > 1) {
    std::snprintf(text, sizeof(text), "%.*f [%.*f, %.*f]", digits, s.mean, digits, s.low, digits, s.high);
  } else {
    std::snprintf(text, sizeof(text), "%.*f", digits, s.mean);
  }
  return text;
}

// ---- the runs ----

// The runs in `directory`, or empty after saying why on stderr (a record that cannot be read, or
// no training run at all).
std::vector<Run> load_or_explain(const fs::path& runs_directory) {
  std::vector<Run> runs;
  try {
    runs = load_runs(runs_directory);
  } catch (const std::exception& error) {
    std::cerr << "lesson08_quality: " << error.what() << "\n";
    return {};
  }
  if (runs.empty()) {
    std::cerr << "lesson08_quality: no training runs (train_*) in " << runs_directory
              << "; the shipped ones are in notebooks_data/runs, or record your own with "
                 "lessons/08_experiment.sh on a GPU\n";
    return {};
  }
  return runs;
}

// The steps at which the lesson compares the runs: 250, 500, 1000 and the last step every run
// evaluated, those that the runs have.
struct Checkpoints {
  std::vector<int64_t> steps;
  int64_t last_common = INT64_MAX;
};

Checkpoints checkpoints_of(const std::vector<Run>& runs) {
  Checkpoints c;
  for (const Run& run : runs) c.last_common = std::min(c.last_common, run.val_bits.rbegin()->first);
  for (int64_t step : {int64_t{250}, int64_t{500}, int64_t{1000}, c.last_common}) {
    if (step <= c.last_common && std::find(c.steps.begin(), c.steps.end(), step) == c.steps.end() &&
        runs.front().val_bits.count(step)) {
      c.steps.push_back(step);
    }
  }
  return c;
}

// ---- the table ----

// Prints the validation bits per byte of each variant at the checkpoints; returns each variant's
// spread over seeds at the last common step, by table order.
std::map<int, Spread> show_variants(moe::RunWriter& writer, const std::vector<Run>& runs, const Checkpoints& at) {
  // Group by variant; compare at the last step every run of the group evaluated.
  std::map<int, std::vector<const Run*>> groups;
  for (const Run& run : runs) groups[run.order].push_back(&run);
  const json& model = runs.front().train;
  std::printf("Lesson 08: the same byte-level transformer (D=%lld, L=%lld, E=%lld experts of H=%lld, top-%lld) "
              "trained for the same %lld steps,\nonce per formulation and seed. Validation bits per byte (lower is "
              "better; mean [min, max] over seeds):\n\n",
              (long long)model.value("model_dim", 0), (long long)model.value("num_layers", 0),
              (long long)model.value("num_experts", 0), (long long)model.value("expert_hidden_dim", 0),
              (long long)model.value("top_k", 0), (long long)model.value("steps", 0));
  std::vector<std::string> columns = {"formulation", "seeds"};
  for (int64_t step : at.steps) columns.push_back("val bits/byte @" + std::to_string(step));
  columns.insert(columns.end(), {"step ms", "tokens dropped"});
  moe::lessons::Table table("lesson08: validation bits per byte at equal steps", columns);

  std::map<int, Spread> final_bits;
  for (const auto& [order, members] : groups) {
    std::vector<json> row = {members.front()->variant, int64_t(members.size())};
    for (int64_t step : at.steps) {
      std::vector<double> values;
      for (const Run* run : members) {
        if (run->val_bits.count(step)) values.push_back(run->val_bits.at(step));
      }
      row.push_back(format(spread(values), 3));
      if (step == at.last_common) final_bits[order] = spread(values);
    }
    std::vector<double> ms, dropped;
    for (const Run* run : members) {
      ms.push_back(run->median_step_ms);
      dropped.push_back(100 * run->dropped_fraction);
    }
    row.push_back(format(spread(ms), 2));
    row.push_back(format(spread(dropped), 2) + "%");
    table.add_row(row);
  }
  moe::lessons::show(writer, table);
  return final_bits;
}

}  // namespace

int main(int argc, char** argv) {
  // --runs DIR is this lesson's own option; the rest are every lesson's (lesson_support.h).
  fs::path runs_directory = "notebooks_data/runs";
  const moe::lessons::LessonOptions options = moe::lessons::parse_options(
      argc, argv, "lesson08_quality", "runs/lesson08_quality",
      [&](CLI::App& app) {
        app.add_option("--runs", runs_directory, "the training runs to compare")->type_name("DIR")->capture_default_str();
      });
  // The lesson draws nothing: it reads runs recorded with their own seeds (08_experiment.sh
  // --seeds), so --seed only lands in the run record. Saying so beats a flag that silently does nothing.
  if (options.seed != moe::lessons::LessonOptions{}.seed) {
    std::cerr << "lesson08_quality: --seed " << options.seed
              << " changes nothing here: the lesson draws no random numbers, it reads recorded training runs "
                 "(their seeds are 08_experiment.sh --seeds); the value is kept in the run record only\n";
  }

  const std::vector<Run> runs = load_or_explain(runs_directory);
  if (runs.empty()) return 2;
  // The MoE layer of the compared runs, for the lesson's own run record.
  moe::train::TrainConfig trained = moe::train::preset("default");
  try {
    moe::train::apply_json(trained, runs.front().train, runs.front().directory + "/run.json");
  } catch (const std::exception& error) {
    std::cerr << "lesson08_quality: " << error.what() << "\n";
    return 2;
  }
  moe::RunWriter writer = moe::lessons::create_lesson_run(
      options, "lesson08_quality", "08", moe::moe_layer_config(trained.model, trained.batch),
      {"reads GPU training runs from " + runs_directory.string()});

  const Checkpoints at = checkpoints_of(runs);
  std::map<int, Spread> final_bits = show_variants(writer, runs, at);

  // The claim of MegaBlocks' Figure 2: at equal steps, dropless beats token dropping at cf 1.0.
  if (!final_bits.count(0) || !final_bits.count(1)) {
    moe::lessons::finish(writer, "lesson08", false,
                         "the runs lack a dropless or a dropping cf 1.0 model: nothing to compare");
    return 1;
  }
  const Spread& dropless = final_bits[0];
  const Spread& dropping = final_bits[1];
  const bool separated = dropless.high < dropping.low;  // every seed of one below every seed of the other
  char message[256];
  std::snprintf(message, sizeof(message),
                "dropless %.3f vs dropping cf 1.0 %.3f bits/byte at step %lld (%d vs %d seeds%s)", dropless.mean,
                dropping.mean, (long long)at.last_common, dropless.count, dropping.count,
                separated ? ", no overlap between seeds" : ", the seeds' ranges overlap");
  std::printf("\n");
  moe::lessons::finish(writer, "lesson08", dropless.mean < dropping.mean, message);
  return dropless.mean < dropping.mean ? 0 : 1;
}
