# check_wgmma_pipelined.cmake: fails if ptxas serialises the wgmma of any kernel in SOURCE.
#
# When ptxas cannot prove that a wgmma.mma_async is issued by the whole warpgroup together (a
# branch around it on a value it does not know to be uniform, say), or cannot keep its accumulators
# in flight, it waits for each wgmma before issuing the next and says so only in its verbose
# report: "ptxas info : (C7518) Potential Performance Loss: wgmma.mma_async instructions are
# serialized due to ...". Every result stays correct; the kernels just lose their overlap. An `if`
# around the wgmma of block_sparse_wgmma_ws.cuh does this to every block-sparse product (H200,
# 2026-11-22: forward 0.83x dense with it, 0.88x without at D=1024; 0.83x and 1.05x at D=4096;
# cuda/dev/sdd.cu, version 18). This test compiles SOURCE for sm_90a with -Xptxas -v and fails on
# any C751x.
#
# Run by ctest (tests/cuda/CMakeLists.txt) as:
#   cmake -DNVCC=... -DSOURCE=... -DINCLUDES="dir;dir" -DOUTPUT=... -P check_wgmma_pipelined.cmake
foreach(variable NVCC SOURCE INCLUDES OUTPUT)
  if(NOT DEFINED ${variable})
    message(FATAL_ERROR "check_wgmma_pipelined.cmake: -D${variable}=... is required")
  endif()
endforeach()
set(include_flags)
foreach(directory ${INCLUDES})
  list(APPEND include_flags "-I${directory}")
endforeach()
execute_process(
  COMMAND ${NVCC} -std=c++20 -O3 -DNDEBUG -DMOE_CUDA_HAS_SM90A=1 --expt-relaxed-constexpr
          --generate-code=arch=compute_90a,code=sm_90a -Xptxas -v ${include_flags} -c ${SOURCE} -o ${OUTPUT}
  RESULT_VARIABLE result
  OUTPUT_VARIABLE out
  ERROR_VARIABLE report)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "nvcc failed on ${SOURCE} (exit ${result}):\n${report}")
endif()
string(REGEX MATCHALL "[^\n]*\\(C751[0-9]\\)[^\n]*" serialized "${report}")
list(LENGTH serialized count)
if(count GREATER 0)
  string(REPLACE ";" "\n" lines "${serialized}")
  message(FATAL_ERROR "${count} kernel(s) of ${SOURCE} have their wgmma serialised by ptxas:\n${lines}")
endif()
message(STATUS "${SOURCE}: no kernel has its wgmma serialised (ptxas -v shows no C751x)")
