#!/usr/bin/env bash
# gpu_suite.sh: everything the project checks and measures on a GPU machine, in one run.
#
#   cuda/scripts/gpu_suite.sh bundle        on a development machine: copy the header-only and
#                                           test dependencies the GPU machines lack (nlohmann-json,
#                                           CLI11, Eigen, GoogleTest) into .deps/ (ignored by git)
#   cuda/scripts/gpu_suite.sh run [STEPS]   on the GPU machine: build with .deps, then run STEPS
#                                           (default: tests sanitize lessons dev bench record; train
#                                           times the training step beside PyTorch, and attention's
#                                           fused and unfused cores beside SDPA; offload measures
#                                           the expert modes and records a run per mode; infer trains
#                                           briefly and generates in every mode; distributed runs
#                                           ep_bench over NCCL and over MPI; train_distributed trains
#                                           on two GPUs against one and kills a rank; calibrate
#                                           measures moe_sim's calibration and validates it;
#                                           overlap times the training step with and without
#                                           two-micro-batch overlap), logs in $OUT
# The GPU machines have no network and no Debian packages for these; .deps travels with the tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
# Logs go to one folder that is packed into $OUT/logs.tar.gz at the end (the device tool brings back
# only a few files); results (JSON) go to $OUT itself.
LOGS="$OUT/logs"
mkdir -p "$LOGS"
trap 'tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"' EXIT
trap 'exit 143' TERM  # a run ended by timeout still packs its logs (the EXIT trap above)

bundle() {
  rm -rf .deps && mkdir -p .deps/include .deps/share/cmake .deps/share/eigen3 .deps/lib/x86_64-linux-gnu/cmake
  cp -r /usr/include/nlohmann .deps/include/
  cp -r /usr/share/cmake/nlohmann_json .deps/share/cmake/
  cp -r /usr/include/CLI .deps/include/
  cp -r /usr/share/cmake/CLI11 .deps/share/cmake/
  cp -r /usr/include/eigen3 .deps/include/
  cp -r /usr/share/eigen3/cmake .deps/share/eigen3/
  cp -r /usr/include/gtest /usr/include/gmock .deps/include/
  cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest .deps/lib/x86_64-linux-gnu/cmake/
  cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a .deps/lib/x86_64-linux-gnu/
  du -sh .deps
}

build() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/device.txt"
  # -g on the host code (the same machine code, with line tables): a crash's backtrace names its line.
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS=-g -DCMAKE_PREFIX_PATH="$ROOT/.deps" \
        -DMOE_ENABLE_VIEWER=OFF > "$LOGS/configure.log" 2>&1 || { tail -30 "$LOGS/configure.log"; return 1; }
  cmake --build build-gpu -j "$(nproc)" > "$LOGS/build.log" 2>&1 || { grep -E "error|FAILED" "$LOGS/build.log" | head -40; return 1; }
  echo "build: ok"
}

# The functions and lines of a crashed program's backtrace (glibc's "program(+0xOFFSET)" frames, as
# OpenMPI prints them) in LOG, for the program BINARY.
symbolize() {
  local log=$1 binary=$2 offsets
  offsets=$(grep -oE "$(basename "$binary")\(\+0x[0-9a-f]+\)" "$log" | grep -oE "0x[0-9a-f]+" | awk '!seen[$0]++')
  [ -n "$offsets" ] || return 0
  echo "  backtrace of $(basename "$binary") (from $(basename "$log")):"
  # shellcheck disable=SC2086
  addr2line -f -C -i -e "$binary" $offsets | paste - - | sed 's/^/    /' | head -30
}

tests() {
  ctest --test-dir build-gpu --output-on-failure -j 4 > "$LOGS/ctest.log" 2>&1
  local rc=$?
  grep -E "tests passed|tests failed|Failed|\*\*\*" "$LOGS/ctest.log" | tail -25
  grep -c "Skipped" "$LOGS/ctest.log" | sed 's/^/skipped lines: /'
  return $rc
}

tests_parallel() {
  # The whole suite eight tests at a time, twice in a row: no test may depend on device-wide state
  # that the others change at the same time (free memory, clocks, other processes' streams).
  local rc=0 round
  for round in 1 2; do
    ctest --test-dir build-gpu --output-on-failure -j 8 ${TESTS_EXCLUDE:+-E "$TESTS_EXCLUDE"} \
      > "$LOGS/ctest_j8_round$round.log" 2>&1 || rc=1
    echo "ctest -j 8, round $round: $(grep -E 'tests passed|tests failed' "$LOGS/ctest_j8_round$round.log")" \
         "$(grep -E '^Total Test time' "$LOGS/ctest_j8_round$round.log")"
    grep -E "\(Failed\)|\*\*\*" "$LOGS/ctest_j8_round$round.log" | grep -v "Not Run (Disabled)" | head -10
  done
  return $rc
}

tests_regex() {
  # The tests whose names match $TESTS_REGEX (ctest -R), e.g. after a change to one part.
  ctest --test-dir build-gpu --output-on-failure -R "${TESTS_REGEX:?set TESTS_REGEX}" > "$LOGS/ctest_regex.log" 2>&1
  local rc=$?
  grep -E "tests passed|tests failed|Failed|\*\*\*|Skipped" "$LOGS/ctest_regex.log" | tail -25
  return $rc
}

tests_distributed() {
  # Only the multi-rank tests (label distributed: the layer over NCCL with one rank per GPU, over MPI
  # with ranks sharing one, training, the rank faults, lessons 06 and 07 on CPU ranks and --gpu).
  ctest --test-dir build-gpu --output-on-failure -L distributed > "$LOGS/ctest_distributed.log" 2>&1
  local rc=$?
  grep -E "tests passed|tests failed|Failed|\*\*\*|Skipped" "$LOGS/ctest_distributed.log" | tail -25
  # The layer's GPU test with one rank per GPU over NCCL, under memcheck. NCCL's start-up asks
  # cudaFuncGetAttributes of kernels that have no image for this GPU (error 209, 72 calls a rank on
  # an H200): API errors of NCCL's probing, not memory errors, so they are not reported.
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    timeout 200 mpirun --allow-run-as-root -x NCCL_NVLS_ENABLE=0 -np 2 compute-sanitizer --tool memcheck \
      --report-api-errors no --error-exitcode 9 build-gpu/tests/distributed/test_distributed_expert_parallel_gpu_nccl \
      > "$LOGS/sanitize_ep_gpu_nccl_np2.log" 2>&1
    echo "memcheck test_distributed_expert_parallel_gpu_nccl (2 GPUs): rc=$? $(grep -E 'ERROR SUMMARY' "$LOGS/sanitize_ep_gpu_nccl_np2.log" | sort | uniq -c | tr '\n' ' ')"
  fi
  return $rc
}

sanitize() {
  # memcheck and racecheck over every GPU test executable (one process each, all its tests).
  local rc=0
  for exe in build-gpu/tests/cuda/cuda_test_*; do
    [ -x "$exe" ] || continue
    for tool in memcheck racecheck; do
      timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$exe" > "$LOGS/sanitize_$(basename "$exe")_$tool.log" 2>&1
      local r=$?
      echo "sanitize $(basename "$exe") $tool: rc=$r $(grep -E 'ERROR SUMMARY' "$LOGS/sanitize_$(basename "$exe")_$tool.log" | tail -1)"
      [ $r -ne 0 ] && rc=1
    done
  done
  return $rc
}

lessons() {
  lessons/tour.sh build-gpu > "$LOGS/lessons.log" 2>&1
  local rc=$?
  grep -E "^(PASS|FAIL)" "$LOGS/lessons.log"
  return $rc
}

dev() {
  local rc=0
  for program in build-gpu/cuda/dev/dev_*; do
    [ -x "$program" ] && [ -f "$program" ] || continue
    "$program" > "$LOGS/$(basename "$program").log" 2>&1 || rc=1
    tail -12 "$LOGS/$(basename "$program").log"
  done
  # The SDD's versions on the two larger reference shapes (moe_bench --shapes baselines) too: TMA pays more where tiles run longer.
  if [ -x build-gpu/cuda/dev/dev_sdd ]; then
    for shape in "16384 2048 8192 64 2 128" "8192 4096 14336 8 2 128"; do
      # shellcheck disable=SC2086
      build-gpu/cuda/dev/dev_sdd $shape > "$LOGS/dev_sdd_${shape// /_}.log" 2>&1 || rc=1
      grep -E "^cuBLAS|^1[1-9] |^PASS|^FAIL" "$LOGS/dev_sdd_${shape// /_}.log"
    done
  fi
  return $rc
}

bench() {
  local rc=0
  if [ -x build-gpu/cuda/bench/moe_bench ]; then
    # under power_trace.py (the SM clock and power of each timed phase) where nvidia-smi is present
    local trace=()
    command -v nvidia-smi > /dev/null && trace=(python3 cuda/bench/power_trace.py --out "$OUT/power_trace.json" --)
    "${trace[@]}" build-gpu/cuda/bench/moe_bench --out "$OUT/moe_bench.json" > "$LOGS/moe_bench.log" 2>&1 || rc=1
    tail -75 "$LOGS/moe_bench.log"
  fi
  if [ -f cuda/bench/torch_baseline.py ]; then
    PYTHONUNBUFFERED=1 python3 cuda/bench/torch_baseline.py --out "$OUT/torch_baseline.json" > "$LOGS/torch_baseline.log" 2>&1 || rc=1
    tail -20 "$LOGS/torch_baseline.log"
  fi
  return $rc
}

train() {
  # The training step's speed at moe_train's "throughput" preset, each
  # formulation and a dense model of the same active FLOPs, and PyTorch's straightforward version of
  # the same model beside it (cuda/train/torch_train_baseline.py). Real text when the Brown corpus is
  # in notebooks_data/brown (carried: the GPU machines have no npm), else random bytes.
  local rc=0 program=build-gpu/cuda/train/moe_train
  [ -x "$program" ] || { echo "train: $program not built"; return 1; }
  # Each variant with its kernels launched one by one, and as one CUDA graph a step (--cuda-graph).
  for variant in "dropless:" "dense:--moe-layers none" "padded_cf1.0:--formulation padded --capacity-factor 1.0" \
                 "dropping_cf1.0:--formulation dropping --capacity-factor 1.0" "dropless_pregated:--pregated" \
                 "dropless_swiglu:--activation swiglu" "dropless_unfused_attention:--attention unfused"; do
    for graph in off on; do
      local name=${variant%%:*} flags=${variant#*:}
      [ "$graph" = on ] && name=${name}_graph
      # shellcheck disable=SC2086
      $program --preset throughput $flags --cuda-graph $graph --benchmark-steps 30 \
        --benchmark-json "$OUT/train_throughput_$name.json" > "$LOGS/train_throughput_$name.log" 2>&1 || rc=1
      echo "moe_train $name: $(grep 'median step' "$LOGS/train_throughput_$name.log")"
    done
  done
  for variant in "moe:" "dense:--dense"; do
    local name=${variant%%:*} flags=${variant#*:}
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 python3 cuda/train/torch_train_baseline.py $flags --out "$OUT/torch_train_$name.json" \
      > "$LOGS/torch_train_$name.log" 2>&1 || rc=1
    tail -1 "$LOGS/torch_train_$name.log"
  done
  # The attention of one block at the preset's shape: the fused core beside the unfused one, then
  # PyTorch's scaled_dot_product_attention timed the same way.
  build-gpu/cuda/bench/attention_bench --out "$OUT/attention_bench.json" > "$LOGS/attention_bench.log" 2>&1 || rc=1
  tail -9 "$LOGS/attention_bench.log"
  PYTHONUNBUFFERED=1 python3 cuda/bench/torch_attention_baseline.py --out "$OUT/torch_attention_baseline.json" \
    > "$LOGS/torch_attention_baseline.log" 2>&1 || rc=1
  tail -5 "$LOGS/torch_attention_baseline.log"
  return $rc
}

record() {
  # Recorded GPU runs for notebooks_data/runs/: one layer in each formulation, its routing, topology
  # and per-phase timeline over 5 forward + backward passes (run records only, no .npy).
  local rc=0 runs="$OUT/runs"
  mkdir -p "$runs"
  for formulation in dropless padded dropping; do
    build-gpu/cuda/tools/moe_layer_dump --formulation "$formulation" --tokens 4096 --model-dim 512 \
      --hidden-dim 1024 --experts 16 --top-k 2 --block-size 128 --capacity-factor 1.0 --steps 5 --no-npy \
      --out "$runs/gpu_layer_$formulation" > "$LOGS/record_$formulation.log" 2>&1 || rc=1
    tail -1 "$LOGS/record_$formulation.log"
  done
  tar czf "$OUT/runs.tar.gz" -C "$runs" . && rm -rf "$runs"
  return $rc
}

offload() {
  # Experts in pinned host memory (cuda/offload, cuda/infer): the copy engine against the pinned
  # bandwidth, every expert mode at the Switch-Base-like and large-expert scales beside PyTorch's
  # version of them, and one small recorded run per mode (Switch-Base-like, batch 1) for
  # notebooks_data/runs/, tarred as record's.
  local rc=0 runs="$OUT/runs_offload" day
  day=$(date -u +%Y-%m-%d)
  mkdir -p "$runs"
  build-gpu/cuda/bench/offload_copy_bench --out "$OUT/offload_copy_bench_$day.json" \
    > "$LOGS/offload_copy_bench.log" 2>&1 || rc=1
  tail -8 "$LOGS/offload_copy_bench.log"
  # PyTorch eager's version of the same model and modes first, on an idle host (its steps are host-bound).
  PYTHONUNBUFFERED=1 python3 cuda/bench/torch_offload_baseline.py --batches 1,8 \
    --out "$OUT/torch_offload_baseline_$day.json" > "$LOGS/torch_offload_baseline.log" 2>&1 || rc=1
  tail -6 "$LOGS/torch_offload_baseline.log"
  build-gpu/cuda/bench/offload_bench --out "$OUT/offload_bench_$day.json" > "$LOGS/offload_bench.log" 2>&1 || rc=1
  sed -n '/==== summary/,$p' "$LOGS/offload_bench.log"
  for mode in gpu_only on_demand prefetch_all pregated speculative; do
    build-gpu/cuda/bench/offload_bench --scales switch --batches 1 --modes "$mode" --warmup 2 --steps 16 \
      --record-dir "$runs/offload_$mode" > "$LOGS/offload_record_$mode.log" 2>&1 || rc=1
    echo "offload record $mode: $(tail -1 "$LOGS/offload_record_$mode.log")"
  done
  tar czf "$OUT/runs_offload.tar.gz" -C "$runs" . && rm -rf "$runs"
  return $rc
}

infer() {
  # Train the default preset briefly, self-gated and pre-gated, then generate in every mode with a
  # run record each, and each offloading mode again with its slot table on the GPU; the text must be
  # the same in every one (greedy, and bit-identical logits).
  local rc=0 runs="$OUT/runs_infer" data=notebooks_data/brown text
  [ -f "$data/train.txt" ] || data=README.md
  mkdir -p "$runs"
  for variant in "self:" "pregated:--pregated"; do
    local name=${variant%%:*} flags=${variant#*:}
    # shellcheck disable=SC2086
    build-gpu/cuda/train/moe_train --steps 300 --data "$data" --run-dir "$runs/train_$name" --overwrite $flags \
      > "$LOGS/infer_train_$name.log" 2>&1 || { rc=1; echo "infer: moe_train $name failed"; tail -5 "$LOGS/infer_train_$name.log"; continue; }
    echo "infer: trained $name ($(tail -1 "$LOGS/infer_train_$name.log"))"
    local modes="gpu_only on_demand prefetch_all speculative" first=""
    [ "$name" = pregated ] && modes="gpu_only on_demand prefetch_all pregated speculative"
    for mode in $modes; do
      text="$runs/generate_${name}_$mode.txt"
      build-gpu/cuda/infer/moe_generate --checkpoint "$runs/train_$name" --prompt "The jury said" \
        --max-new-bytes 64 --temperature 0 --mode "$mode" --run-dir "$runs/generate_${name}_$mode" \
        > "$text" 2> "$LOGS/infer_generate_${name}_$mode.log" || { rc=1; echo "infer: moe_generate $name $mode failed"; continue; }
      [ -z "$first" ] && first="$text"
      if cmp -s "$first" "$text"; then echo "infer: $name $mode: same text as $(basename "$first")"
      else echo "infer: $name $mode: TEXT DIFFERS from $(basename "$first")"; rc=1; fi
      [ "$mode" = gpu_only ] && continue
      # the same mode with the slot table on the GPU, as one CUDA graph a step (no run record)
      text="$runs/generate_${name}_${mode}_device.txt"
      build-gpu/cuda/infer/moe_generate --checkpoint "$runs/train_$name" --prompt "The jury said" \
        --max-new-bytes 64 --temperature 0 --mode "$mode" --slot-table device \
        > "$text" 2> "$LOGS/infer_generate_${name}_${mode}_device.log" || { rc=1; echo "infer: moe_generate $name $mode device failed"; continue; }
      if cmp -s "$first" "$text"; then echo "infer: $name $mode, slot table on the GPU: same text ($(grep -o "decode steps [0-9.]* ms each[^)]*)" "$LOGS/infer_generate_${name}_${mode}_device.log"))"
      else echo "infer: $name $mode, slot table on the GPU: TEXT DIFFERS from $(basename "$first")"; rc=1; fi
      [ "$mode" = pregated ] || continue
      # and recorded, for the viewer: the GPU's decisions, read back after each step (launched steps)
      text="$runs/generate_${name}_${mode}_device_recorded.txt"
      build-gpu/cuda/infer/moe_generate --checkpoint "$runs/train_$name" --prompt "The jury said" \
        --max-new-bytes 64 --temperature 0 --mode "$mode" --slot-table device --run-dir "$runs/generate_${name}_${mode}_device" \
        > "$text" 2> "$LOGS/infer_generate_${name}_${mode}_device_recorded.log" || { rc=1; echo "infer: moe_generate $name $mode device recorded failed"; continue; }
      if cmp -s "$first" "$text"; then echo "infer: $name $mode, slot table on the GPU, recorded: same text"
      else echo "infer: $name $mode, slot table on the GPU, recorded: TEXT DIFFERS from $(basename "$first")"; rc=1; fi
    done
    head -c 200 "$first"; echo
  done
  # The run records only (the checkpoints stay here: too large for the transfer).
  rm -rf "$runs"/train_*/checkpoints
  tar czf "$OUT/runs_infer.tar.gz" -C "$runs" . && rm -rf "$runs"
  return $rc
}

distributed() {
  # Expert parallelism on the GPUs (distributed/): ctest's tests step already ran its tests (one
  # rank per GPU over NCCL where two GPUs exist; ranks sharing one GPU over MPI). Here ep_bench:
  # over NCCL with one rank per GPU where there are two or more, and over MPI with two ranks on one
  # GPU (its timings are not an interconnect's: it checks the program).
  local rc=0 gpus mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0)
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$gpus" -ge 2 ]; then
    "${mpirun[@]}" -np 2 build-gpu/distributed/bench/ep_bench --backend nccl --nodes-of 2 --out "$OUT/ep_bench_nccl.json" \
      > "$LOGS/ep_bench_nccl.log" 2>&1 || rc=1
    tail -40 "$LOGS/ep_bench_nccl.log"
    # The layer's step with capacity factor 1.0 (Tutel's other published row), every degree and adaptive.
    "${mpirun[@]}" -np 2 build-gpu/distributed/bench/ep_bench --backend nccl --only layer --formulation dropping \
      --capacity-factor 1.0 --out "$OUT/ep_bench_nccl_cf1.json" > "$LOGS/ep_bench_nccl_cf1.log" 2>&1 || rc=1
    grep -E "^ ep_layer|^# (layer|the)|^PASS|^FAIL" "$LOGS/ep_bench_nccl_cf1.log"
    for lesson in lesson06_expert_parallelism lesson07_tutel; do
      "${mpirun[@]}" -np 2 build-gpu/lessons/$lesson --gpu --backend nccl --out "$OUT/runs_lessons_gpu/$lesson" \
        --overwrite > "$LOGS/${lesson}_gpu_nccl.log" 2>&1 || rc=1
      echo "$lesson --gpu (2 GPUs, NCCL): $(grep -E '^(PASS|FAIL)' "$LOGS/${lesson}_gpu_nccl.log" | tr '\n' ' ')"
      symbolize "$LOGS/${lesson}_gpu_nccl.log" build-gpu/lessons/$lesson
    done
  fi
  # (EP_SHARED_GPU=0 leaves out what follows where two GPUs are measured and the sharing was checked)
  if [ "${EP_SHARED_GPU:-1}" != 0 ] || [ "$gpus" -lt 2 ]; then
    distributed_shared_gpu || rc=1
  fi
  (cd "$OUT" && [ -d runs_lessons_gpu ] && tar czf runs_lessons_gpu.tar.gz runs_lessons_gpu && rm -rf runs_lessons_gpu)
  return $rc
}

distributed_shared_gpu() {
  local rc=0 mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0)
  CUDA_VISIBLE_DEVICES=0 "${mpirun[@]}" -np 2 build-gpu/distributed/bench/ep_bench --backend mpi -e 16M --warmup-ms 200 -n 5 \
    --pipeline-chunks 1,2 --nodes-of 2 --out "$OUT/ep_bench_mpi_one_gpu.json" > "$LOGS/ep_bench_mpi.log" 2>&1 || rc=1
  tail -4 "$LOGS/ep_bench_mpi.log"
  # Ranks sharing one GPU over MPI: the lessons' GPU path (lesson 07 at R = 4: 2DH with two nodes
  # of 2), the GPU layer's test at R = 4, and the multi-rank GPU tests under compute-sanitizer.
  CUDA_VISIBLE_DEVICES=0 "${mpirun[@]}" -np 2 build-gpu/lessons/lesson06_expert_parallelism --gpu --backend mpi \
    --out "$OUT/runs_lessons_gpu/lesson06_mpi" --overwrite > "$LOGS/lesson06_gpu_mpi.log" 2>&1 || rc=1
  echo "lesson06 --gpu (2 ranks, 1 GPU, MPI): $(grep -E '^(PASS|FAIL)' "$LOGS/lesson06_gpu_mpi.log" | tr '\n' ' ')"
  symbolize "$LOGS/lesson06_gpu_mpi.log" build-gpu/lessons/lesson06_expert_parallelism
  CUDA_VISIBLE_DEVICES=0 "${mpirun[@]}" -np 4 build-gpu/lessons/lesson07_tutel --gpu --backend mpi \
    --out "$OUT/runs_lessons_gpu/lesson07_mpi" --overwrite > "$LOGS/lesson07_gpu_mpi.log" 2>&1 || rc=1
  echo "lesson07 --gpu (4 ranks, 1 GPU, MPI): $(grep -E '^(PASS|FAIL)' "$LOGS/lesson07_gpu_mpi.log" | tr '\n' ' ')"
  CUDA_VISIBLE_DEVICES=0 timeout 300 "${mpirun[@]}" -np 4 build-gpu/tests/distributed/test_distributed_expert_parallel_gpu \
    > "$LOGS/ep_gpu_test_np4.log" 2>&1 || rc=1
  echo "test_distributed_expert_parallel_gpu at R = 4 on one GPU: $(grep -E 'PASS ranks|FAIL' "$LOGS/ep_gpu_test_np4.log" | tail -1)"
  # (the training test: one of its runs, the one that also records; memcheck slows every kernel)
  for test in test_distributed_expert_parallel_gpu "test_distributed_training --gtest_filter=*RecordsEveryRanks*"; do
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout 240 "${mpirun[@]}" -np 2 compute-sanitizer --tool memcheck --error-exitcode 9 \
      build-gpu/tests/distributed/$test > "$LOGS/sanitize_${test%% *}_np2.log" 2>&1
    echo "memcheck $test (2 ranks, 1 GPU): rc=$? $(grep -E 'ERROR SUMMARY' "$LOGS/sanitize_${test%% *}_np2.log" | sort | uniq -c | tr '\n' ' ')"
  done
  return $rc
}

train_distributed() {
  # The language model on two GPUs (distributed/train/moe_train_distributed, NCCL, one rank per GPU)
  # against one GPU in the same call: tokens/s at the same per-GPU batch (throughput preset: 64
  # sequences a GPU, so the two-GPU global batch is 128), the loss curve of the default preset on
  # the same global batch, and the two-GPU run's record (every rank's spans, all-to-all matrices).
  # Then a rank killed mid-run: how long the other takes to end. Without two GPUs: two ranks on one
  # GPU over MPI (a check, not an interconnect's timing).
  local rc=0 gpus runs="$OUT/runs_distributed" data=notebooks_data/brown
  local mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0)
  local one=build-gpu/cuda/train/moe_train two=build-gpu/distributed/train/moe_train_distributed backend=nccl
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$gpus" -ge 2 ] || backend=mpi
  [ -f "$data/train.txt" ] || data=README.md
  mkdir -p "$runs"
  $one --preset throughput --benchmark-steps 30 --benchmark-json "$OUT/train_throughput_1gpu.json" \
    > "$LOGS/train_distributed_bench_1.log" 2>&1 || rc=1
  echo "1 GPU : $(grep 'median step' "$LOGS/train_distributed_bench_1.log")"
  "${mpirun[@]}" -np 2 $two --backend $backend --preset throughput --batch 128 --benchmark-steps 30 \
    --benchmark-json "$OUT/train_throughput_2gpu_$backend.json" > "$LOGS/train_distributed_bench_2.log" 2>&1 || rc=1
  echo "2 ranks ($backend): $(grep 'median step' "$LOGS/train_distributed_bench_2.log")"
  tail -3 "$LOGS/train_distributed_bench_2.log"
  # The same with Tutel's pipelining degree chosen by measurement per MoE block's shape.
  "${mpirun[@]}" -np 2 $two --backend $backend --preset throughput --batch 128 --benchmark-steps 30 --pipeline-chunks 0 \
    --benchmark-json "$OUT/train_throughput_2gpu_${backend}_adaptive.json" > "$LOGS/train_distributed_bench_2_adaptive.log" 2>&1 || rc=1
  echo "2 ranks ($backend, --pipeline-chunks 0): $(grep 'median step' "$LOGS/train_distributed_bench_2_adaptive.log")"
  $one --preset default --steps 300 --data "$data" --run-dir "$runs/train_1gpu" --overwrite \
    > "$LOGS/train_distributed_curve_1.log" 2>&1 || rc=1
  echo "1 GPU  curve: $(tail -1 "$LOGS/train_distributed_curve_1.log")"
  "${mpirun[@]}" -np 2 $two --backend $backend --preset default --steps 300 --data "$data" \
    --run-dir "$runs/train_2gpu_$backend" --overwrite > "$LOGS/train_distributed_curve_2.log" 2>&1 || rc=1
  echo "2 ranks curve: $(tail -1 "$LOGS/train_distributed_curve_2.log")"
  # A rank killed mid-run (SIGKILL to the second rank's process after 15 s): seconds until mpirun ends.
  local pid
  "${mpirun[@]}" -np 2 $two --backend $backend --preset default --steps 100000 --data "$data" \
    --run-dir "$runs/killed" --overwrite > "$LOGS/train_distributed_killed.log" 2>&1 &
  local launcher=$!
  sleep 15
  pid=$(pgrep -f "moe_train_distributed.*runs_distributed/killed" | tail -1)
  kill -9 "$pid" 2>/dev/null
  local killed_at
  killed_at=$(date +%s.%N)
  timeout 120 tail --pid=$launcher -f /dev/null
  echo "killed rank pid $pid: mpirun ended $(awk -v now="$(date +%s.%N)" -v then="$killed_at" 'BEGIN { printf "%.1f", now - then }') s later ($(grep -ciE "signal 9|killed|watchdog" "$LOGS/train_distributed_killed.log") lines name it)"
  kill -9 $launcher 2>/dev/null
  rm -rf "$runs"/*/checkpoints "$runs/killed"
  tar czf "$OUT/runs_distributed.tar.gz" -C "$runs" . && rm -rf "$runs"
  return $rc
}

activation() {
  # SwiGLU experts beside GeLU: the expert layer at two reference shapes (useful TFLOP/s, the ratio
  # column "vs gelu") and the training step at the throughput preset.
  local rc=0 day
  day=$(date -u +%Y-%m-%d)
  build-gpu/cuda/bench/moe_bench --shapes 16384,2048,8192,64,2 --routing uniform --activation both \
    --only block_sparse_B128,grouped_cublas --out "$OUT/moe_bench_activation_$day.json" > "$LOGS/moe_bench_activation.log" 2>&1 || rc=1
  grep -E "swiglu|gelu|vs gelu|ratio" "$LOGS/moe_bench_activation.log" | tail -14
  for activation in gelu swiglu; do
    build-gpu/cuda/train/moe_train --preset throughput --activation $activation --benchmark-steps 30 \
      --benchmark-json "$OUT/train_throughput_$activation.json" > "$LOGS/train_throughput_$activation.log" 2>&1 || rc=1
    echo "moe_train throughput $activation: $(grep 'median step' "$LOGS/train_throughput_$activation.log")"
  done
  return $rc
}

micro_batches() {
  # Gradient accumulation: the tests, the dropless layer over M = 1, 2, 4 micro-batches of the first
  # reference shape under Zipf routing (one weight-gradient product, against dense cuBLAS on M*T*K
  # rows), and the training step at the throughput preset with 1 and 4 micro-batches.
  local rc=0 day m
  day=$(date -u +%Y-%m-%d)
  ctest --test-dir build-gpu -R 'CudaMicroBatches|CudaModelGpuMicroBatches|Trainer.MicroBatches' --output-on-failure \
    > "$LOGS/micro_batches_tests.log" 2>&1 || rc=1
  tail -5 "$LOGS/micro_batches_tests.log"
  for m in 1 2 4; do
    build-gpu/cuda/bench/moe_bench --micro-batches $m --shapes 16384,1024,4096,64,1 --routing zipf \
      --out "$OUT/moe_bench_micro_batches_${m}_$day.json" > "$LOGS/moe_bench_micro_batches_$m.log" 2>&1 || rc=1
    grep -E "layer_|dense_cublas|PASS|FAIL" "$LOGS/moe_bench_micro_batches_$m.log" | tail -10
  done
  for m in 1 4; do
    build-gpu/cuda/train/moe_train --preset throughput --micro-batches $m --benchmark-steps 30 \
      --benchmark-json "$OUT/train_throughput_micro_batches_$m.json" > "$LOGS/train_throughput_micro_batches_$m.log" 2>&1 || rc=1
    echo "moe_train throughput, $m micro-batches: $(grep 'median step' "$LOGS/train_throughput_micro_batches_$m.log")"
  done
  return $rc
}

scaling() {
  # Expert parallelism over every GPU of the machine (4 or 8; NCCL, one rank per GPU):
  # - the layer's weak scaling: forward + backward + the experts' SGD at T = 16384 tokens and 8
  #   experts per GPU (D=2048, H=8192, K=2, dropless), at R = 1, 2, 4 (, 8);
  # - the exchanges at R = all GPUs, flat beside 2DH with nodes of 2 (and of 4 where R = 8);
  # - Tutel's layouts at R = all GPUs on a small batch (T = 1024 a GPU) and the large one;
  # - the language model trained on all GPUs (throughput, and 300 recorded steps on Brown).
  local rc=0 gpus r runs="$OUT/runs_distributed" data=notebooks_data/brown
  local mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0)
  local ep=build-gpu/distributed/bench/ep_bench two=build-gpu/distributed/train/moe_train_distributed
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$gpus" -ge 4 ] || { echo "scaling: needs 4 or more GPUs, found $gpus"; return 1; }
  for r in 1 2 4 8; do
    [ "$r" -le "$gpus" ] || break
    "${mpirun[@]}" -np $r $ep --backend nccl --only layer --layer 16384,2048,8192,$((8 * r)),2 --pipeline-chunks 1,2,4 \
      --out "$OUT/ep_bench_scaling_r$r.json" > "$LOGS/ep_bench_scaling_r$r.log" 2>&1 || rc=1
    echo "R = $r:"; grep -E "^ ep_layer|^# the|^#   against|^(PASS|FAIL)" "$LOGS/ep_bench_scaling_r$r.log"
  done
  local nodes="--nodes-of 2"
  "${mpirun[@]}" -np $gpus $ep --backend nccl --only alltoall,dispatch $nodes --out "$OUT/ep_bench_exchange_r$gpus.json" \
    > "$LOGS/ep_bench_exchange_r$gpus.log" 2>&1 || rc=1
  tail -30 "$LOGS/ep_bench_exchange_r$gpus.log"
  if [ "$gpus" -ge 8 ]; then
    "${mpirun[@]}" -np $gpus $ep --backend nccl --only alltoall,dispatch --nodes-of 4 --out "$OUT/ep_bench_exchange_r${gpus}_nodes4.json" \
      > "$LOGS/ep_bench_exchange_r${gpus}_nodes4.log" 2>&1 || rc=1
    tail -20 "$LOGS/ep_bench_exchange_r${gpus}_nodes4.log"
  fi
  for t in 1024 16384; do
    "${mpirun[@]}" -np $gpus $ep --backend nccl --only layer --layouts --pipeline-chunks 1 --layer $t,2048,8192,$((8 * gpus)),2 \
      --out "$OUT/ep_bench_layouts_t${t}_r$gpus.json" > "$LOGS/ep_bench_layouts_t${t}_r$gpus.log" 2>&1 || rc=1
    echo "layouts, T = $t a GPU:"; grep -E "^ ep_layer|^# the|^#   (against|its)|^(PASS|FAIL)" "$LOGS/ep_bench_layouts_t${t}_r$gpus.log"
  done
  [ -f "$data/train.txt" ] || data=README.md
  mkdir -p "$runs"
  "${mpirun[@]}" -np $gpus $two --backend nccl --preset throughput --batch $((64 * gpus)) --benchmark-steps 30 \
    --benchmark-json "$OUT/train_throughput_${gpus}gpu_nccl.json" > "$LOGS/train_scaling_bench.log" 2>&1 || rc=1
  echo "$gpus ranks, throughput preset: $(grep 'median step' "$LOGS/train_scaling_bench.log")"
  "${mpirun[@]}" -np $gpus $two --backend nccl --preset default --steps 300 --data "$data" \
    --run-dir "$runs/train_expert_parallel_${gpus}gpu" --overwrite > "$LOGS/train_scaling_curve.log" 2>&1 || rc=1
  echo "$gpus ranks, default preset, 300 steps: $(tail -1 "$LOGS/train_scaling_curve.log")"
  (cd "$OUT" && tar czf runs_distributed.tar.gz runs_distributed && rm -rf runs_distributed)
  return $rc
}

calibrate() {
  # moe_sim's calibration of this machine kind (distributed/sim/calibration.h), and its validation:
  # - R = 1: the layer (T = 16384, D = 2048, H = 8192, E = 8, K = 2) at d = 1, 2, 4 with every phase,
  #   and dispatch + combine (identity experts) at 1, 16, 64, 256 MiB: the costs without a network;
  # - R = 2: the raw all-to-all and the count exchange (the calibration's network), and the layer
  #   at 8 experts a GPU and dispatch + combine, which the simulator then predicts;
  # - R = 4 where four GPUs exist: the same rows, predicted from the two-GPU calibration (hold-out);
  # - the language model's training step (throughput preset, 64 sequences a GPU), plain and with two
  #   micro-batches overlapped, at R = 1 (into the calibration), 2 and 4 (predicted), each from one
  #   checkpoint trained 300 steps on Brown (its
  #   routing as training's; from the initial weights a few steps collapse it), each benchmark
  #   writing its timed step's routing for the prediction. Needs the Brown corpus (./moe data; the
  #   GPU machines cannot fetch it: carry notebooks_data/brown's converted files).
  # The calibration and the validation table land in $OUT/sim/.
  local rc=0 gpus r files="" held=""
  local mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0)
  local ep=build-gpu/distributed/bench/ep_bench sim=build-gpu/distributed/sim/moe_sim
  local two=build-gpu/distributed/train/moe_train_distributed
  local kind device
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$gpus" -ge 2 ] || { echo "calibrate: needs 2 or more GPUs, found $gpus"; return 1; }
  mkdir -p "$OUT/sim"
  "${mpirun[@]}" -np 1 $ep --backend nccl --only layer,dispatch --layer 16384,2048,8192,8,2 --pipeline-chunks 1,2,4 \
    --out "$OUT/sim/ep_bench_r1.json" > "$LOGS/calibrate_r1.log" 2>&1 || rc=1
  grep -E "^ (ep_layer|dispatch)|^(PASS|FAIL)" "$LOGS/calibrate_r1.log"
  # The layer at the language model's MoE shape (throughput preset: D=512 H=1024 E=16 K=2), on one
  # GPU (into the calibration), on two (its d = 2 phases give that shape's overlap contention, the
  # rest is predicted) and on four (hold-out).
  for r in 1 2 4; do
    [ "$r" -le "$gpus" ] || break
    "${mpirun[@]}" -np $r $ep --backend nccl --only layer --layer 16384,512,1024,16,2 --pipeline-chunks 1,2 \
      --out "$OUT/sim/ep_bench_lm_layer_r$r.json" > "$LOGS/calibrate_lm_layer_r$r.log" 2>&1 || rc=1
    grep -E "^ ep_layer|^(PASS|FAIL)" "$LOGS/calibrate_lm_layer_r$r.log"
    [ "$r" -eq 1 ] || files="$files,$OUT/sim/ep_bench_lm_layer_r$r.json"
  done
  for r in 2 4; do
    [ "$r" -le "$gpus" ] || break
    "${mpirun[@]}" -np $r $ep --backend nccl --only alltoall,count,dispatch,layer --layer 16384,2048,8192,$((8 * r)),2 \
      --pipeline-chunks 1,2,4 --out "$OUT/sim/ep_bench_r$r.json" > "$LOGS/calibrate_r$r.log" 2>&1 || rc=1
    grep -E "^ (ep_layer|dispatch|alltoall|count)|^(PASS|FAIL)" "$LOGS/calibrate_r$r.log"
    files="$files,$OUT/sim/ep_bench_r$r.json"
  done
  [ -f notebooks_data/brown/index.json ] || { echo "calibrate: no Brown corpus in notebooks_data/brown (./moe data)"; return 1; }
  local checkpoint=/tmp/moe_calibrate_checkpoint
  rm -rf "$checkpoint"
  build-gpu/cuda/train/moe_train --preset throughput --batch 64 --steps 2000 --stop-after 300 --checkpoint-every 300 \
    --eval-every 1000 --record-every 100 --run-dir "$checkpoint" > "$LOGS/calibrate_checkpoint.log" 2>&1 || rc=1
  for r in 1 2 4; do
    [ "$r" -le "$gpus" ] || break
    # The plain step (--overlap off) and the step with two micro-batches overlapped (--overlap on);
    # the one-GPU overlapped step says what halving the batch costs.
    local overlap name
    for overlap in off on; do
      name=train_r$r
      [ "$overlap" = on ] && name=train_overlap_r$r
      "${mpirun[@]}" -np $r $two --backend nccl --preset throughput --steps 2000 --batch $((64 * r)) --resume --overlap $overlap \
        --run-dir "$checkpoint" --benchmark-steps 40 --benchmark-json "$OUT/sim/$name.json" \
        > "$LOGS/calibrate_$name.log" 2>&1 || rc=1
      echo "language model, R = $r, overlap $overlap: $(grep 'median step' "$LOGS/calibrate_$name.log")"
      [ "$r" -eq 1 ] || files="$files,$OUT/sim/$name.json"
    done
  done
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | grep -oE 'h100|h200|a100|b200' || echo gpu)
  kind="${device}x2_$(date -u +%F)"
  $sim --calibrate-from "$OUT/sim/ep_bench_r1.json,$OUT/sim/ep_bench_r2.json,$OUT/sim/train_r1.json,$OUT/sim/train_overlap_r1.json,$OUT/sim/ep_bench_lm_layer_r1.json,$OUT/sim/ep_bench_lm_layer_r2.json" \
    --calibration-out "$OUT/sim/calibration_$kind.json" || rc=1
  # Four-GPU runs: this machine's when it has four, else the kept ones of the same machine kind.
  [ "$gpus" -ge 4 ] || held=",notebooks_data/bench/ep_bench_exposed_r4_h200x4_2026-11-28.json,notebooks_data/bench/ep_bench_exposed_lm_layer_r4_h200x4_2026-11-28.json,notebooks_data/bench/train_brown_step300_r4_h200x4_2026-11-28.json"
  $sim --calibration "$OUT/sim/calibration_$kind.json" --validate "$OUT/sim/ep_bench_r1.json,$OUT/sim/train_r1.json,$OUT/sim/train_overlap_r1.json,$OUT/sim/ep_bench_lm_layer_r1.json$files$held" \
    --json "$OUT/sim/validation_$kind.json" | tee "$LOGS/calibrate_validation.log" || rc=1
  return $rc
}

overlap() {
  # The language model's step with and without two-micro-batch overlap (--overlap on / off), from a
  # checkpoint trained 300 steps on Brown (as calibrate's), plain and overlapped alternating, one GPU
  # and as many as the machine has up to two: distributed/measured.md's table.
  local rc=0 checkpoint=/tmp/moe_overlap_checkpoint gpus r name
  local mpirun=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE=0)
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  [ -f notebooks_data/brown/index.json ] || { echo "overlap: no Brown corpus in notebooks_data/brown (./moe data)"; return 1; }
  rm -rf "$checkpoint"
  build-gpu/cuda/train/moe_train --preset throughput --batch 64 --steps 2000 --stop-after 300 --checkpoint-every 300 \
    --eval-every 1000 --record-every 100 --run-dir "$checkpoint" > "$LOGS/overlap_checkpoint.log" 2>&1 || rc=1
  for r in 1 2; do
    [ "$r" -le "$gpus" ] || break
    for name in plain overlap plain_again overlap_again; do
      local flags=(--overlap off)
      [[ $name == overlap* ]] && flags=(--overlap on)
      "${mpirun[@]}" -np $r build-gpu/distributed/train/moe_train_distributed --backend nccl --preset throughput \
        --steps 2000 --batch $((64 * r)) --resume --run-dir "$checkpoint" --benchmark-steps 40 "${flags[@]}" \
        --benchmark-json "$OUT/train_overlap_r${r}_$name.json" > "$LOGS/overlap_r${r}_$name.log" 2>&1 || rc=1
      echo "R = $r, $name: $(grep 'median step' "$LOGS/overlap_r${r}_$name.log")"
    done
  done
  return $rc
}

case "${1:-}" in
  bundle) bundle ;;
  run)
    shift
    steps=${*:-tests sanitize lessons dev bench record}
    build || exit 1
    status=0
    for step in $steps; do
      echo "==== $step ===="
      "$step" || status=1
    done
    exit $status
    ;;
  *) echo "usage: cuda/scripts/gpu_suite.sh bundle | run [tests] [tests_parallel] [tests_regex] [tests_distributed] [sanitize] [lessons] [dev] [bench] [train] [record] [offload] [infer] [distributed] [activation] [micro_batches] [scaling] [calibrate] [overlap]" >&2; exit 2 ;;
esac
