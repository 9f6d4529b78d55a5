# run_program.cmake: one row of the command-line table (tests/programs/CMakeLists.txt). Runs a
# program and checks its exit status and what it printed, so every program meets one convention:
# --help prints usage on stdout and exits 0; a bad flag or value prints a line naming it on stderr
# and exits 2.
#
#   cmake -DCOMMAND="mpiexec|-n|1|prog" -DARGS="--model-dim|100" -DEXPECT_EXIT=2
#         -DEXPECT_STDERR="--model-dim 100" -P run_program.cmake
# COMMAND and ARGS are '|'-separated lists ('|' survives ctest's command line, ';' does not).
# EXPECT_STDOUT_NONEMPTY=ON asks for some usage text on stdout; EXPECT_STDERR, a literal fragment
# of the error message.
string(REPLACE "|" ";" command "${COMMAND}")
string(REPLACE "|" ";" arguments "${ARGS}")
execute_process(COMMAND ${command} ${arguments}
                RESULT_VARIABLE exit_status
                OUTPUT_VARIABLE out
                ERROR_VARIABLE err
                TIMEOUT 60)
set(shown "${command} ${arguments}")
string(REPLACE ";" " " shown "${shown}")
message("ran: ${shown}\nexit: ${exit_status}\nstdout:\n${out}\nstderr:\n${err}")
if(NOT "${exit_status}" STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "FAIL exit ${exit_status}, expected ${EXPECT_EXIT}")
endif()
if(EXPECT_STDOUT_NONEMPTY AND "${out}" STREQUAL "")
  message(FATAL_ERROR "FAIL nothing on stdout, expected the usage")
endif()
if(DEFINED EXPECT_STDERR)
  string(FIND "${err}" "${EXPECT_STDERR}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "FAIL stderr does not contain '${EXPECT_STDERR}'")
  endif()
endif()
message("PASS exit ${exit_status}")
