#!/usr/bin/env bash
# open.sh: opens the viewer on every bundled run (runs/ from the lesson tour, notebooks_data/runs/).
# With a display it opens the window; without one (a server, CI) it renders each panel headless
# under xvfb-run and writes the PNGs to OUT_DIR.
#   viewer/open.sh [BUILD_DIR] [OUT_DIR]      (defaults: build, runs/screenshots)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${1:-build}"
out_dir="${2:-runs/screenshots}"
viewer="$build_dir/viewer/moe_viewer"
if [ ! -x "$viewer" ]; then
  echo "open.sh: $viewer is not built (the viewer needs libglfw3-dev libimgui-dev libstb-dev libgl-dev: ./moe build)" >&2
  exit 1
fi
runs=(--runs-dir runs --runs-dir notebooks_data/runs --open-all)
if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]; then
  exec "$viewer" "${runs[@]}"
fi
if ! command -v xvfb-run >/dev/null; then
  echo "open.sh: no display and no xvfb-run (Debian package xvfb): cannot render" >&2
  exit 1
fi
mkdir -p "$out_dir"
echo "open.sh: no display: writing one headless screenshot per panel to $out_dir/"
for panel in summary curves routing tokens topology alltoall offload; do
  xvfb-run -a "$viewer" "${runs[@]}" --panel "$panel" --screenshot "$out_dir/$panel.png" --width 1400 --height 900 2>/dev/null | grep wrote
done
