// moe_bench_variants.h: the variants moe_bench's main hands to the harness, one file each:
//   variant_formulations.cpp   the formulations table of one shape, routing and activation
//   variant_micro_batches.cpp  the layer over micro-batches (--micro-batches M)
// Each runs its checks first, then times its rows into the Report (moe_bench_harness.h).
//   cmake --build build --target moe_bench
#pragma once

#include <cuda_runtime.h>

#include "core/gemm.h"          // CublasHandle
#include "moe_bench_harness.h"  // Shape, Routing, Options, ShapeInputs, Report

namespace moe::bench {

void run_formulations(const Shape& shape, Routing routing, const ShapeInputs& inputs, const Options& options,
                      moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report);

void run_micro_batches(const Shape& shape, Routing routing, moe::Activation activation, const Options& options,
                       moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report);

}  // namespace moe::bench
