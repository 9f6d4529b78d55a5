# run_fault.cmake: one row of the rank-failure test (tests/distributed/CMakeLists.txt). Launches
# fault_rank_program with one rank made to fail and checks that the whole job ends in time, with the
# exit status expected, and that its output names the fault.
#
#   cmake -DCOMMAND="mpiexec|-n|3|prog" -DARGS="--fault|stop" -DEXPECT_EXIT=nonzero
#         -DEXPECT_OUTPUT="regex" -DMAX_SECONDS=60 -DSCRATCH=dir -P run_fault.cmake
# COMMAND and ARGS are '|'-separated lists ('|' survives ctest's command line, ';' does not).
# EXPECT_EXIT: zero or nonzero. EXPECT_OUTPUT (and EXPECT_OUTPUT_ALSO, where given): regular
# expressions that stdout + stderr must match. PROGRAM: the name of the ranks' program, for the
# clean-up below (default fault_rank_program). SKIP_OUTPUT: output that makes the row a skip, the
# program having said why (default "SKIP needs one GPU per rank"). The same driver runs the
# stopped-rank rows, whose COMMAND launches stop_rank.sh.
#
# It never hangs: the launcher runs under coreutils' `timeout` (MAX_SECONDS + 15, then SIGKILL) and
# under execute_process's own TIMEOUT; each rank writes its pid to SCRATCH, and any rank of this
# program still alive once the launcher has returned (a stopped rank the launcher left behind) is
# killed with SIGKILL, which ends a stopped process too, and fails the row.
if(NOT PROGRAM)
  set(PROGRAM fault_rank_program)
endif()
if(NOT SKIP_OUTPUT)
  set(SKIP_OUTPUT "SKIP needs one GPU per rank")
endif()
string(REPLACE "|" ";" command "${COMMAND}")
string(REPLACE "|" ";" arguments "${ARGS}")
file(REMOVE_RECURSE "${SCRATCH}")
file(MAKE_DIRECTORY "${SCRATCH}")

math(EXPR launcher_limit "${MAX_SECONDS} + 15")
find_program(timeout_program timeout)
set(outer)
if(timeout_program)
  set(outer ${timeout_program} --kill-after=5 ${launcher_limit})
endif()
math(EXPR last_resort "${launcher_limit} + 10")

string(TIMESTAMP started "%s%f" UTC)  # microseconds
execute_process(COMMAND ${outer} ${command} ${arguments} --pid-dir ${SCRATCH}
                RESULT_VARIABLE exit_status
                OUTPUT_VARIABLE out
                ERROR_VARIABLE err
                TIMEOUT ${last_resort})
string(TIMESTAMP ended "%s%f" UTC)
math(EXPR elapsed_ms "(${ended} - ${started}) / 1000")
math(EXPR whole "${elapsed_ms} / 1000")
math(EXPR tenths "(${elapsed_ms} % 1000) / 100")
set(seconds "${whole}.${tenths}")

# Ranks left behind: alive, and still this program (a pid can be reused once its process is gone).
execute_process(COMMAND sleep 1)
set(left_behind)
file(GLOB pid_files "${SCRATCH}/rank*.pid")
foreach(pid_file ${pid_files})
  file(STRINGS "${pid_file}" pid LIMIT_COUNT 1)
  get_filename_component(rank_name "${pid_file}" NAME_WE)
  if(pid AND EXISTS "/proc/${pid}/cmdline")
    file(READ "/proc/${pid}/cmdline" rank_command)
    if(rank_command MATCHES "${PROGRAM}")
      execute_process(COMMAND kill -KILL ${pid})
      list(APPEND left_behind "${rank_name} (pid ${pid})")
    endif()
  endif()
endforeach()

set(shown "${command} ${arguments}")
string(REPLACE ";" " " shown "${shown}")
message("ran: ${shown}\nexit: ${exit_status}\nseconds: ${seconds}\nstdout:\n${out}\nstderr:\n${err}")

if("${out}\n${err}" MATCHES "${SKIP_OUTPUT}")  # CTest's SKIP_REGULAR_EXPRESSION counts it skipped
  message("SKIP (the program says why above)")
  return()
endif()
if(left_behind)
  message(FATAL_ERROR "FAIL still running after the launcher returned, killed now: ${left_behind}")
endif()
if(elapsed_ms GREATER_EQUAL "${MAX_SECONDS}000")
  message(FATAL_ERROR "FAIL the job took ${seconds} s; expected it to end within ${MAX_SECONDS} s")
endif()
if(EXPECT_EXIT STREQUAL "zero" AND NOT "${exit_status}" STREQUAL "0")
  message(FATAL_ERROR "FAIL exit ${exit_status}, expected 0")
endif()
if(EXPECT_EXIT STREQUAL "nonzero" AND "${exit_status}" STREQUAL "0")
  message(FATAL_ERROR "FAIL exit 0, expected a non-zero status")
endif()
if(NOT "${out}\n${err}" MATCHES "${EXPECT_OUTPUT}")
  message(FATAL_ERROR "FAIL the output does not match '${EXPECT_OUTPUT}'")
endif()
if(EXPECT_OUTPUT_ALSO AND NOT "${out}\n${err}" MATCHES "${EXPECT_OUTPUT_ALSO}")
  message(FATAL_ERROR "FAIL the output does not match '${EXPECT_OUTPUT_ALSO}'")
endif()
message("PASS exit=${exit_status} seconds=${seconds} limit=${MAX_SECONDS}")
