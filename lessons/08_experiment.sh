#!/usr/bin/env bash
# 08_experiment.sh: the training runs behind lesson 08, on one GPU: the default model (moe_train's
# "default" preset: D=256, L=4, E=8 experts of H=512, top-2, 2000 steps on the Brown corpus)
# trained once per formulation and seed:
#   dropless         every routed token computed (MegaBlocks' block-sparse layer)
#   dropping cf 1.0  capacity C = T*K/E per expert; tokens past it skip the expert (residual only)
#   dropping cf 1.5  C = 1.5 T*K/E
#   padded           C = T (cf = E/K): nothing is ever dropped, every expert computes T rows
#   dense            no experts: a dense FFN of H_dense = K*H, the same active FLOPs per token
# About 10 s a run on an H200. Each run's record goes to OUT/train_<variant>_seed<s>; the final
# checkpoint (115 MB) is removed, the record (~0.5 MB) kept. Then lesson08_quality reads them.
#
#   lessons/08_experiment.sh [--build-dir build] [--out notebooks_data/runs] [--seeds "1 2 3"]
#                            [--data notebooks_data/brown] [--steps 2000]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=build
out=notebooks_data/runs
seeds="1 2 3"
data=notebooks_data/brown
steps=2000
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    *) echo "08_experiment.sh: unknown argument '$1'; allowed: --build-dir DIR, --out DIR, --seeds \"1 2 3\", --data PATH, --steps N" >&2; exit 2 ;;
  esac
done
train="$build_dir/cuda/train/moe_train"
[ -x "$train" ] || { echo "08_experiment.sh: $train is not built (./moe build on a machine with CUDA)" >&2; exit 1; }

variants=(
  "dropless|--formulation dropless"
  "dropping_cf1.0|--formulation dropping --capacity-factor 1.0"
  "dropping_cf1.5|--formulation dropping --capacity-factor 1.5"
  "padded|--formulation padded --capacity-factor 4.0"
  "dense|--moe-layers none"
)
for seed in $seeds; do
  for variant in "${variants[@]}"; do
    name="${variant%%|*}"
    flags="${variant#*|}"
    dir="$out/train_${name}_seed${seed}"
    echo "== $name, seed $seed -> $dir"
    # shellcheck disable=SC2086  # flags are words
    "$train" --data "$data" --steps "$steps" $flags --seed "$seed" --data-seed "$((100 + seed))" \
      --record-every 100 --checkpoint-every "$steps" --run-dir "$dir" --name "lesson08 $name seed $seed" --overwrite
    rm -rf "$dir/checkpoints"
  done
done
"$build_dir/lessons/lesson08_quality" --runs "$out" --out runs/lesson08_quality --overwrite
