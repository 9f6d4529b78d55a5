// main.cpp: moe_viewer, the Dear ImGui + GLFW viewer of run records: replays recorded runs,
// follows live ones, compares runs side by side, and writes headless screenshots.
//
//   build/viewer/moe_viewer runs/lesson01_routing runs/lesson02_formulations   # open two runs
//   build/viewer/moe_viewer --open-all                          # every run under runs/ and notebooks_data/runs/
//   build/viewer/moe_viewer --follow notebooks_data/runs/tiny   # a run still being written
//   xvfb-run -a build/viewer/moe_viewer runs/lesson01_routing --panel routing --screenshot routing.png
//                                                               # headless: render, write a PNG, exit
// Options:
//   RUN_DIR ...          runs to open (loaded whole)
//   --follow RUN_DIR     a run to follow live (new steps appear within a second)
//   --runs-dir DIR       a folder of runs for the run list (repeatable; default runs/ and notebooks_data/runs/)
//   --open-all           open every run of the run list
//   --panel NAME         the panel to show first: summary curves routing tokens topology alltoall offload
//   --step N --layer N   the step and layer to show (--layer also picks the all-to-all panel's
//                        byte matrix and load across ranks, which otherwise sum the layers)
//   --curve-steps LO:HI  the steps the training curves show (default: all; e.g. 500:2000 leaves out the
//                        first fall of the loss, so the formulations' differences fill the plot)
//   --screenshot FILE    render hidden, write FILE.png after --frames frames (default 3), exit
//   --regions FILE       with --screenshot: the named regions' rectangles as JSON (for tests)
//   --frames N           frames to render in screenshot mode; prints frame-time figures
//   --width W --height H the window size (default 1600 x 1000)
//   --scrub              with --screenshot: move the step across the run, one position per frame, so
//                        the frame times include re-preparing the per-step views
// Problems with a run (corrupt, truncated, unknown schema version) are printed here and shown in
// the window; the viewer keeps going. A RUN_DIR that does not exist or cannot be read is bad usage:
// a message naming it and exit status 2, before any window opens.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>  // access

#include <imgui.h>
#include <imgui_impl_glfw.h>
#include <imgui_impl_opengl3.h>
#include <GLFW/glfw3.h>  // includes the system OpenGL header

#include "command_line.h"  // CLI::App, parse_command_line, whole_number
#include "panels.h"
#include "screenshot.h"
#include "viewer_state.h"

using namespace moe::viewer;

namespace {

struct Options {
  std::vector<std::string> runs, follow, run_folders;
  bool open_all = false, scrub = false;
  std::string panel, screenshot, regions;
  long long step = -1;
  double curve_lo = 0, curve_hi = -1;  // --curve-steps; lo > hi: fit
  int layer = 0, frames = 3, width = 1600, height = 1000;
  bool layer_given = false;
};

// The flags into `o`; the exit status when the viewer should stop here (--help, a bad flag or value).
std::optional<int> ParseOptions(int argc, char** argv, Options& o) {
  std::string curve_steps;
  CLI::App app{"moe_viewer: training, lesson and inference runs, live or finished (details: the top of viewer/app/main.cpp)",
               "moe_viewer"};
  // allow_extra_args(false): one value per --follow / --runs-dir, so RUN_DIRs after them stay runs to open.
  app.add_option("RUN_DIR", o.runs, "runs to open (loaded whole)");
  app.add_option("--follow", o.follow, "a run to follow live (new steps appear within a second)")->allow_extra_args(false);
  app.add_option("--runs-dir", o.run_folders,
                 "a folder of runs for the run list (repeatable; default runs/ and notebooks_data/runs/)")
      ->allow_extra_args(false);
  app.add_flag("--open-all", o.open_all, "open every run of the run list");
  app.add_option("--panel", o.panel, "the panel to show first: summary curves routing tokens topology alltoall offload");
  app.add_option("--step", o.step, "the step to show")->check(moe::whole_number(0, 1LL << 53));
  auto* layer = app.add_option("--layer", o.layer,
                               "the layer to show (also picks the all-to-all panel's byte matrix and load across ranks, "
                               "which otherwise sum the layers)")
                    ->check(moe::whole_number(0, 1023));
  app.add_option("--curve-steps", curve_steps,
                 "LO:HI, the steps the training curves show (default: all; e.g. 500:2000 leaves out the first fall of "
                 "the loss, so the formulations' differences fill the plot)")
      ->check(CLI::Validator(
          [](const std::string& text) {
            double lo = 0, hi = 0;
            const bool ok = std::sscanf(text.c_str(), "%lf:%lf", &lo, &hi) == 2 && hi > lo;
            return ok ? std::string() : text + ": allowed: LO:HI with LO < HI";
          },
          ""));
  app.add_option("--screenshot", o.screenshot, "render hidden, write FILE.png after --frames frames, exit");
  app.add_option("--regions", o.regions, "with --screenshot: the named regions' rectangles as JSON (for tests)");
  app.add_option("--frames", o.frames, "frames to render in screenshot mode; prints frame-time figures")
      ->capture_default_str()->check(moe::whole_number(1, 100000));
  app.add_option("--width", o.width, "the window's width")->capture_default_str()->check(moe::whole_number(200, 8192));
  app.add_option("--height", o.height, "the window's height")->capture_default_str()->check(moe::whole_number(200, 8192));
  app.add_flag("--scrub", o.scrub,
               "with --screenshot: move the step across the run, one position per frame, so the frame times include "
               "re-preparing the per-step views");
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return exit_status;
  o.layer_given = layer->count() > 0;
  if (!curve_steps.empty()) std::sscanf(curve_steps.c_str(), "%lf:%lf", &o.curve_lo, &o.curve_hi);
  // A run to open must be there before any window opens, so a mistyped path fails headless too.
  // (--follow may name a run not started yet: it waits for it.)
  for (const std::string& dir : o.runs) {
    std::error_code error;
    const char* problem = !std::filesystem::exists(dir, error)       ? "does not exist"
                          : !std::filesystem::is_directory(dir, error) ? "is not a directory"
                          : ::access(dir.c_str(), R_OK | X_OK) != 0    ? "cannot be read (permission denied)"
                                                                       : nullptr;
    if (problem) {
      std::fprintf(stderr, "moe_viewer: RUN_DIR %s %s; a run is a directory holding run.json and events.jsonl\n",
                   dir.c_str(), problem);
      return moe::kExitBadInput;
    }
  }
  if (!o.panel.empty() && o.panel != "all" &&
      std::none_of(std::begin(kPanels), std::end(kPanels), [&](const PanelEntry& p) { return o.panel == p.name; })) {
    std::fprintf(stderr, "moe_viewer: unknown panel '%s'; panels: all", o.panel.c_str());
    for (const PanelEntry& p : kPanels) std::fprintf(stderr, " %s", p.name);
    std::fprintf(stderr, "\n");
    return moe::kExitBadInput;
  }
  return std::nullopt;
}

// One frame of the whole window: the runs panel on the left, the panels as tabs on the right.
// With a single --panel in screenshot mode, that panel fills the window.
void DrawFrame(ViewerState& state, const std::string& only_panel) {
  const ImVec2 display = ImGui::GetIO().DisplaySize;
  const ImGuiWindowFlags fixed = ImGuiWindowFlags_NoMove | ImGuiWindowFlags_NoResize | ImGuiWindowFlags_NoCollapse |
                                 ImGuiWindowFlags_NoBringToFrontOnFocus;
  const bool alone = state.screenshot && !only_panel.empty() && only_panel != "all";
  const float runs_width = alone ? 0.0f : 300.0f;
  state.regions.clear();
  if (!alone) {
    ImGui::SetNextWindowPos(ImVec2(0, 0));
    ImGui::SetNextWindowSize(ImVec2(runs_width, display.y));
    ImGui::Begin("Runs", nullptr, fixed);
    ShowRunsPanel(state);
    ImGui::End();
  }
  ImGui::SetNextWindowPos(ImVec2(runs_width, 0));
  ImGui::SetNextWindowSize(ImVec2(display.x - runs_width, display.y));
  ImGui::Begin("MoE run viewer", nullptr, fixed);
  if (ImGui::BeginTabBar("panels")) {
    for (const PanelEntry& panel : kPanels) {
      if (alone && only_panel != panel.name) continue;
      const ImGuiTabItemFlags flags = state.selected_panel == panel.name ? ImGuiTabItemFlags_SetSelected : 0;
      if (ImGui::BeginTabItem(panel.title, nullptr, flags)) {
        ImGui::BeginChild(panel.name);
        state.current_panel = panel.name;  // ForEachShownRun draws the runs holding its data first
        panel.show(state);
        ImGui::EndChild();
        ImGui::EndTabItem();
      }
    }
    ImGui::EndTabBar();
  }
  state.selected_panel.clear();
  ImGui::End();
}

void GlfwError(int code, const char* description) { std::fprintf(stderr, "moe_viewer: GLFW error %d: %s\n", code, description); }

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (const std::optional<int> exit_status = ParseOptions(argc, argv, options)) return *exit_status;
  ViewerState state;
  state.screenshot = !options.screenshot.empty();
  for (const std::string& f : options.run_folders) state.run_folders.emplace_back(f);
  if (state.run_folders.empty()) state.run_folders = {"runs", "notebooks_data/runs"};
  refresh_run_list(state);
  for (const std::string& dir : options.runs) open_run(state, dir, false);
  for (const std::string& dir : options.follow) open_run(state, dir, true);
  if (options.open_all)
    for (const RunEntry& e : state.listed_runs)
      if (std::none_of(state.runs.begin(), state.runs.end(), [&](const auto& r) { return r->model.dir == e.dir; }))
        open_run(state, e.dir, false);
  if (state.runs.empty()) std::fprintf(stderr, "moe_viewer: no run opened; the run list shows %zu runs\n", state.listed_runs.size());
  if (options.step >= 0) {
    state.step = options.step;
    state.follow_latest = false;
  }
  state.layer = options.layer;
  if (options.layer_given) state.alltoall_layer = options.layer;
  if (options.curve_hi > options.curve_lo) state.plots["curves_steps"] = {options.curve_lo, options.curve_hi, false};
  state.scrub = options.scrub && state.screenshot;
  state.selected_panel = options.panel == "all" ? "" : options.panel;

  glfwSetErrorCallback(GlfwError);
  if (!glfwInit()) {
    std::fprintf(stderr, "moe_viewer: cannot open a display (no X server?). For headless screenshots run it under "
                         "xvfb-run -a, e.g.: xvfb-run -a moe_viewer RUN_DIR --screenshot out.png\n");
    return 1;
  }
  glfwWindowHint(GLFW_CONTEXT_VERSION_MAJOR, 3);
  glfwWindowHint(GLFW_CONTEXT_VERSION_MINOR, 0);
  if (state.screenshot) glfwWindowHint(GLFW_VISIBLE, GLFW_FALSE);
  GLFWwindow* window = glfwCreateWindow(options.width, options.height, "MoE run viewer", nullptr, nullptr);
  if (!window) {
    std::fprintf(stderr, "moe_viewer: cannot create an OpenGL 3.0 window\n");
    glfwTerminate();
    return 1;
  }
  glfwMakeContextCurrent(window);
  glfwSwapInterval(state.screenshot ? 0 : 1);  // screenshot frames are timed: no vsync wait

  IMGUI_CHECKVERSION();
  ImGui::CreateContext();
  ImGui::GetIO().IniFilename = nullptr;  // the layout is fixed; leave no imgui.ini behind
  ImGui::StyleColorsDark();
  ImGui_ImplGlfw_InitForOpenGL(window, true);
  ImGui_ImplOpenGL3_Init("#version 130");

  std::vector<double> frame_ms, build_ms;  // whole frame; building the draw lists alone (CPU)
  int status = 0;
  for (int frame = 0; !glfwWindowShouldClose(window); ++frame) {
    glfwPollEvents();
    // Live runs: read what was appended, four times a second (new steps show within a second);
    // a run that has more to read than one poll's share (RunModel::poll reads at most 16 MiB)
    // is read on every frame until it has caught up, so the window keeps drawing meanwhile.
    const double now = glfwGetTime();
    for (auto& run : state.runs)
      if (run->model.live() && (now - run->last_poll > 0.25 || !run->model.caught_up())) {
        run->model.poll();
        run->last_poll = now;
      }
    if (state.scrub && state.first_step() <= state.last_step()) {
      state.follow_latest = false;
      state.step = state.first_step() + (state.last_step() - state.first_step()) * frame / std::max(1, options.frames - 1);
    }
    state.settle_step();
    const auto start = std::chrono::steady_clock::now();
    ImGui_ImplOpenGL3_NewFrame();
    ImGui_ImplGlfw_NewFrame();
    ImGui::NewFrame();
    DrawFrame(state, options.panel);
    ImGui::Render();
    const auto built = std::chrono::steady_clock::now();
    int width = 0, height = 0;
    glfwGetFramebufferSize(window, &width, &height);
    glViewport(0, 0, width, height);
    glClearColor(0.08f, 0.08f, 0.1f, 1.0f);
    glClear(GL_COLOR_BUFFER_BIT);
    ImGui_ImplOpenGL3_RenderDrawData(ImGui::GetDrawData());
    if (state.screenshot) {
      glFinish();  // count the rendering itself, not just its submission
      frame_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      build_ms.push_back(std::chrono::duration<double, std::milli>(built - start).count());
      if (frame + 1 >= options.frames) {
        const std::string problem = write_screenshot(options.screenshot, width, height);
        if (!problem.empty()) {
          std::fprintf(stderr, "moe_viewer: %s\n", problem.c_str());
          status = 1;
        } else {
          std::printf("moe_viewer: wrote %s (%d x %d)\n", options.screenshot.c_str(), width, height);
        }
        if (!options.regions.empty()) {
          const std::string regions_problem = write_regions(options.regions, state.regions, width, height);
          if (!regions_problem.empty()) std::fprintf(stderr, "moe_viewer: %s\n", regions_problem.c_str()), status = 1;
        }
        break;
      }
    }
    glfwSwapBuffers(window);
  }
  if (frame_ms.size() > 1) {
    // The first frame builds and uploads the textures; the rest show the steady state. "build" is
    // the viewer's own CPU work (panels, draw lists); the rest is OpenGL rasterising them, which
    // under Xvfb is Mesa's llvmpipe on the CPU, and on a real GPU close to nothing.
    auto median_p90 = [](std::vector<double> v) {
      v.erase(v.begin());
      std::sort(v.begin(), v.end());
      return std::pair<double, double>(v[v.size() / 2], v[v.size() * 9 / 10]);
    };
    const auto [frame_median, frame_p90] = median_p90(frame_ms);
    const auto [build_median, build_p90] = median_p90(build_ms);
    std::printf("moe_viewer: %zu frames after the first: frame median %.2f ms (p90 %.2f), of which building the "
                "panels median %.2f ms (p90 %.2f); first frame %.1f ms\n",
                frame_ms.size() - 1, frame_median, frame_p90, build_median, build_p90, frame_ms.front());
  }
  state.textures.clear();  // GL textures go before the context
  ImGui_ImplOpenGL3_Shutdown();
  ImGui_ImplGlfw_Shutdown();
  ImGui::DestroyContext();
  glfwDestroyWindow(window);
  glfwTerminate();
  return status;
}
