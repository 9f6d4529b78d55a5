#!/usr/bin/env bash
# tour.sh: the lesson tour, the main job of `./moe demo`. Runs every built lesson in order on its
# bundled defaults, each printing its tables and one verdict line and writing a run record under
# runs/. Usage: lessons/tour.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${1:-build}"
mkdir -p runs

failed=0
for lesson in lesson01_routing lesson02_formulations lesson03_block_sparse lesson04_backward lesson05_offload; do
  program="$build_dir/lessons/$lesson"
  if [ ! -x "$program" ]; then
    echo "tour: $program is not built (run ./moe build)" >&2
    exit 1
  fi
  echo
  echo "==================== $lesson ===================="
  "$program" --out "runs/$lesson" --overwrite || failed=1
done

# Lessons 06 and 07 run on 4 CPU ranks under mpirun; they are built where CMake found MPI. OpenMPI
# wants --oversubscribe for more ranks than cores and, as root, --allow-run-as-root (what the
# top-level CMakeLists.txt passes CTest).
mpi_flags=()
if command -v mpirun >/dev/null && mpirun --version 2>&1 | grep -q -e "Open MPI" -e "OpenRTE"; then
  mpi_flags+=(--oversubscribe)
  [ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
fi
for lesson in lesson06_expert_parallelism lesson07_tutel; do
  program="$build_dir/lessons/$lesson"
  echo
  echo "==================== $lesson (mpirun -np 4) ===================="
  if ! command -v mpirun >/dev/null; then
    echo "tour: no mpirun here (sudo apt install openmpi-bin libopenmpi-dev, then rebuild): $lesson is left out"
  elif [ ! -x "$program" ]; then
    echo "tour: $program is not built (CMake found no MPI): $lesson is left out"
  else
    mpirun -np 4 ${mpi_flags[@]+"${mpi_flags[@]}"} "$program" --out "runs/$lesson" --overwrite || failed=1
  fi
done

# Lesson 08 reads the training runs recorded on a GPU (notebooks_data/runs/train_*).
echo
echo "==================== lesson08_quality ===================="
"$build_dir/lessons/lesson08_quality" --out runs/lesson08_quality --overwrite || failed=1

# Lesson 09 runs moe_sim's model on the calibration and measured runs in notebooks_data/sim and
# notebooks_data/bench; it also writes a simulated run, runs/lesson09_simulated_64gpus_zipf.
echo
echo "==================== lesson09_simulator ===================="
"$build_dir/lessons/lesson09_simulator" --out runs/lesson09_simulator --overwrite || failed=1

# The GPU path, where there is a GPU: one MoE layer on the GPU beside the CPU reference, forward
# and backward, dropless (block-sparse kernels) and padded (cuBLAS), with every tensor as .npy.
dump="$build_dir/cuda/tools/moe_layer_dump"
if [ -x "$dump" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  for formulation in dropless padded; do
    echo
    echo "==================== GPU layer vs CPU reference: $formulation ===================="
    "$dump" --formulation "$formulation" --out "runs/layer_dump_$formulation" || failed=1
  done
else
  echo
  echo "tour: no GPU here (or CUDA not built): the GPU layer check is left out"
fi

echo
if [ $failed -ne 0 ]; then
  echo "tour: FAIL (a lesson's verdict failed; see above)"
  exit 1
fi
echo "tour: PASS, run records written under runs/ (viewer/open.sh shows them; ./moe demo does it next)"
