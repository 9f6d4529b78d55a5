#!/bin/sh
# fuzz_seed_corpus.sh OUT_DIR [RUNS_DIR]: seeds the corpus of fuzz_run_record (fuzz_run_record.cpp)
# from the recorded runs (default notebooks_data/runs): for each run, the first two lines of each
# event type, one file each (events under the target's fixed run.json), and the run's run.json, a
# form feed and its first 40 lines (a whole small run). Run from the repository root:
#   tests/viewer/fuzz_seed_corpus.sh build-fuzz/fuzz_corpus
set -eu
out=${1:?usage: fuzz_seed_corpus.sh OUT_DIR [RUNS_DIR]}
runs=${2:-notebooks_data/runs}
mkdir -p "$out"
for run in "$runs"/*/; do
  name=$(basename "$run")
  [ -f "$run/events.jsonl" ] || continue
  # Lines of each type, two each: seed_<run>_<type>_<n>.
  awk -v out="$out" -v name="$name" '
    { type = "other"; if (match($0, /"type":"[a-z_]+"/)) type = substr($0, RSTART + 8, RLENGTH - 9) }
    seen[type] < 2 { seen[type]++; file = out "/seed_" name "_" type "_" seen[type]; print > file; close(file) }
  ' "$run/events.jsonl"
  if [ -f "$run/run.json" ]; then
    { cat "$run/run.json"; printf '\f'; head -n 40 "$run/events.jsonl"; } > "$out/seed_${name}_run"
  fi
done
echo "fuzz_seed_corpus.sh: $(ls "$out" | wc -l) files in $out"
