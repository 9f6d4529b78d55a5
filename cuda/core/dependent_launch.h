// dependent_launch.h: programmatic dependent launch (PDL, compute capability 9.0 and later) for the
// short kernels of a layer step (router, plan, topology, permutes). Included by the .cu files.
//
// Why: the work outside the expert FFN is a chain of short kernels (a few us each), each waiting for
// the one before it. Between two kernels of a stream the GPU drains the first grid, signals its
// completion and only then launches the next one. A kernel launched with launch_dependent() is
// launched as soon as every block of the kernel before it has exited, and waits in
// wait_for_previous_grid() until that kernel has completed and its writes are visible: its launch
// overlaps the other kernel's end instead of following it. Measured on an H200 (moe_bench,
// 2026-11-22, T=16384 D=1024 H=4096 E=64 K=1): the router, plan, topology and un-permute back to
// back took 0.069 ms before, 0.062 ms with it and without the memset the plan no longer needs.
//
// The rule that keeps it correct: a dependent kernel calls wait_for_previous_grid() before it
// touches global memory that other kernels write or read. Here it is the first statement of each,
// so everything after it is ordered exactly as a plain launch would be; and as every kernel waits
// for the one before, which waited for the one before it, the order is transitive.
// The kernels here never let their dependents launch before their blocks exit (PTX
// griddepcontrol.launch_dependents). Tried, at the start of each: 0.060 ms, but the model's padded,
// pre-gated steps no longer matched the CPU reference and a training run stopped with
// cudaErrorInvalidAddressSpace. The kernels after ours include cuBLAS's, which may be launched
// dependent too and then cannot be assumed to wait before their first read.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

// Blocks until the grid before this one on the stream has completed and its memory is visible.
// A no-op in a kernel that was launched plainly.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), allowed to be launched while the kernel
// before it on `stream` finishes (cudaLaunchAttributeProgrammaticStreamSerialization). The kernel
// must call wait_for_previous_grid() before its first access to memory another kernel touches.
template <typename... Parameters, typename... Arguments>
void launch_dependent(void (*kernel)(Parameters...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                      Arguments&&... arguments) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Arguments>(arguments)...));
}

}  // namespace moe::cuda
