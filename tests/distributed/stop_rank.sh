#!/bin/bash
# stop_rank.sh: runs a multi-rank program with one of its ranks stopped by SIGSTOP mid-run, for the
# stopped-rank rows of tests/distributed/CMakeLists.txt (under run_fault.cmake). mpiexec launches
# this script as every rank's program; it writes the rank's pid where run_fault.cmake looks for it
# and replaces itself with the program, so the pid is the program's. On the chosen rank a
# background watcher sends SIGSTOP to that pid once the condition holds:
#   file:NAME     once SCRATCH/NAME exists (e.g. the run record a lesson opens after its first collective)
#   after:SECONDS that many seconds after the rank started
#
#   mpiexec -n 2 bash stop_rank.sh RANK WHEN PROGRAM [ARGS...] --pid-dir SCRATCH
# (run_fault.cmake appends --pid-dir SCRATCH; it is not passed on to the program.) The rank is read
# from OpenMPI's OMPI_COMM_WORLD_RANK, else from PMI_RANK (MPICH).
set -eu
stop_rank=$1 when=$2
shift 2
arguments=("$@")
count=${#arguments[@]}
if (( count < 3 )) || [[ ${arguments[count - 2]} != --pid-dir ]]; then
  echo "stop_rank.sh: usage: stop_rank.sh RANK file:NAME|after:SECONDS PROGRAM [ARGS...] --pid-dir SCRATCH" >&2
  exit 2
fi
scratch=${arguments[count - 1]}
unset 'arguments[count - 1]' 'arguments[count - 2]'
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-}}
if [[ -z $rank ]]; then
  echo "stop_rank.sh: neither OMPI_COMM_WORLD_RANK nor PMI_RANK is set: run it under mpiexec" >&2
  exit 2
fi
echo $$ > "$scratch/rank$rank.pid"
case $when in
  file:* | after:*) ;;
  *) echo "stop_rank.sh: $when: expected file:NAME or after:SECONDS" >&2; exit 2 ;;
esac
# The watcher outlives this shell (exec keeps the pid, $$); it ends on its own when the rank does.
watch() {
  case $when in
    file:*) while [[ ! -e $scratch/${when#file:} ]] && kill -0 $$ 2>/dev/null; do sleep 0.02; done ;;
    after:*) sleep "${when#after:}" ;;
  esac
  if kill -0 $$ 2>/dev/null; then
    echo "stop_rank.sh: SIGSTOP to rank $rank (pid $$)" >&2
    kill -STOP $$
  fi
}
if [[ $rank == "$stop_rank" ]]; then
  watch </dev/null >/dev/null &
fi
exec "${arguments[@]}"
