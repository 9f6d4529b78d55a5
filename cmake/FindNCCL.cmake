# FindNCCL.cmake: locate NCCL (header nccl.h, library libnccl) and define the target NCCL::nccl.
#
# NCCL ships outside the CUDA Toolkit's CMake config, so we look for it by hand: in NCCL_ROOT or
# $NCCL_HOME if set, then beside the CUDA Toolkit, then in the system paths.
#   find_package(NCCL)  ->  NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION, NCCL::nccl

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl
  HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _match "${_nccl_version_lines}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
