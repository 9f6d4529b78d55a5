// moe_bench.cpp: the expert FFN of an MoE layer, y = gelu(x W1) W2 per expert in bf16 (or SwiGLU:
// y = (silu(x W1_gate) * (x W1_up)) W2, W1 = [W1_gate | W1_up] [D, 2H]), timed in every formulation
// this project has, against dense cuBLAS doing the same useful math in the same run.
//
// Build: cmake -S . -B build-bench -G Ninja -DMOE_ENABLE_VIEWER=OFF && cmake --build build-bench --target moe_bench
// Run:   build-bench/cuda/bench/moe_bench                      (the reference shapes)
//        build-bench/cuda/bench/moe_bench --shapes small       (a quick shape, with a CPU-oracle check)
//        build-bench/cuda/bench/moe_bench --activation both    (SwiGLU rows beside GeLU's, same shapes)
//        build-bench/cuda/bench/moe_bench --micro-batches 4 --shapes 16384,1024,4096,64,1 --routing zipf
//                                                      (the layer over 4 micro-batches, one weight-gradient
//                                                      product: gradient accumulation, variant_micro_batches.cpp)
//        build-bench/cuda/bench/moe_bench --routing-from notebooks_data/runs/train_dropless_seed1
//            --shapes 8192,4096,14336,8,2                      (a real run's routing, on a shape of its E)
//        options: --shapes baselines|small|all|T,D,H,E,K  --routing both|uniform|zipf
//                 --routing-from RUN_DIR[@STEP]  (adds "captured": the shares of the run's most
//                 imbalanced MoE layer at STEP, default its last recorded step; shapes of its E only)
//                 --only NAME[,NAME...]  --out FILE  --warmup 3  --warmup-ms 1000  --repeat 20  --seed 1234
//                 --activation gelu|swiglu|both (the experts' activation; default gelu)
//                 --rows layer|gathered|permuted (how the block-sparse SDD reads x)
//                 --stream-k on|off (the block-sparse DSDs' stream-K tail, cuda/moe/tile_schedule.h)
//                 --gradient-pairs on|off (the block-sparse weight gradients in clusters of two tiles)
//                 --block-row-pairs rule|everywhere (pairs of block rows where the rule takes them, or
//                 at every shape: set_block_row_pairs_everywhere)
//                 --timing synced|pipelined (each timed run from an idle GPU, or back to back)
//                 --kernel-trace (after timing each formulation, `repeat` more runs back to back
//                 under CUPTI: every kernel's time in place and the GPU's idle gaps between them)
//                 --micro-batches M (the whole layer over M micro-batches of T tokens instead of
//                 the formulations table; T is one micro-batch's, dense cuBLAS runs M*T*K rows)
// The result file's fields are explained in notebooks_data/bench/README.md.
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k, C capacity,
// B block size; rows = T*K routed slots, slot = t*K + k.
//
// Formulations (names as in the table and the JSON):
//   block_sparse_B128, _B64  dropless MegaBlocks FFN on our block-sparse kernels (block_sparse.h); the
//                            plan and topology are built on the GPU from top_experts, as in a real
//                            layer; x's rows are gathered by the SDD where the layer does
//                            (gathering_pays), else permuted by the GPU kernel into a copy
//   grouped_cublas           dropless, cuBLAS grouped GEMM on the exact per-expert row counts
//   padded_max               every expert padded to C = the largest count, one batched GEMM [E, C, D]
//   dropping_cf1.00, _cf1.25 C = ceil(cf * T*K / E), tokens past C dropped, batched GEMM [E, C, D]
//   dense_cublas             one [T*K, D] x [D, W1] GEMM, the activation, one [T*K, H] x [H, D] GEMM: the same
//                            useful FLOPs with no routing at all, the ceiling to compare with
// Useful TFLOP/s counts 2*rows*D*(W1 + H) (forward) and 3x that (forward + backward) for the rows that
// are really computed for a token: padding rows and dropped tokens count as zero. W1 = H for GeLU
// (4*rows*D*H, two products), 2H for SwiGLU (6*rows*D*H, three products: gate, up, down), so the two
// activations' TFLOP/s compare directly; "vs gelu" is a SwiGLU row's TFLOP/s over the GeLU row of the
// same shape, routing and formulation (the 5% target: vs gelu >= 0.95).
// SwiGLU runs the same formulations: dropless as two SDDs over W1's halves with silu(gate) * up in
// the second's epilogue (block_sparse.h); cuBLAS as one [rows, D] x [D, 2H] product per group, then
// the fused pass swiglu_forward / swiglu_backward (moe/activation.h).
//
// Correctness first: before each formulation is timed, its forward output and input gradient (and,
// where no token is dropped, two experts' weight gradients) are compared slot by slot with the
// grouped cuBLAS path, on fresh random inputs, with outputs poisoned (NaN) before the run. On small
// shapes the dropless output is also compared with the CPU reference (moe::ref::expert_ffn_forward).
// The last line is one verdict, PASS or FAIL (exit code 1).
//
// The files, in nccl-tests' shape (one harness, one small file per variant):
//   moe_bench.cpp                  main: every shape, activation and routing handed to a variant
//   moe_bench_harness.{h,cpp}      options, random inputs, timing, checks, report and verdict
//   moe_bench_variants.h           the variants main hands work to:
//     variant_formulations.cpp     the formulations table of one shape, routing and activation
//     variant_micro_batches.cpp    the layer over micro-batches (--micro-batches M)
//   expert_ffn_cublas.{h,cpp}      the cuBLAS expert FFN (grouped, padded / dropping batched, dense)
//   expert_ffn_block_sparse.h      the block-sparse expert FFN's and the router's buffers
#include <cuda_runtime.h>

#include <exception>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/device_info.h"    // fail_without_gpu
#include "core/gemm.h"           // CublasHandle
#include "expert_ffn_cublas.h"   // CublasFfn::bytes
#include "moe/block_sparse.h"    // set_stream_k_tail, set_weight_gradient_pairs, set_block_row_pairs_everywhere
#include "moe_bench_harness.h"   // Options, Report, fits, ShapeInputs, the report and the verdict
#include "moe_bench_variants.h"  // run_formulations, run_micro_batches

// ---------------------------------------------------------------------------------------------
// [SECTION] main
// ---------------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  using namespace moe::bench;
  Options options;
  try {
    options = parse_options(argc, argv);
    moe::cuda::set_stream_k_tail(options.stream_k);
    moe::cuda::set_weight_gradient_pairs(options.gradient_pairs);
    moe::cuda::set_block_row_pairs_everywhere(options.pairs_everywhere);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "moe_bench: %s\n", error.what());
    return 2;
  }
  if (const std::optional<int> no_gpu = moe::cuda::fail_without_gpu()) return *no_gpu;
  Report report;
  try {
    cudaStream_t stream;
    // A blocking stream: the synchronous copies and memsets on the legacy default stream (uploads,
    // poisoning, downloads) stay ordered with the work on it.
    CUDA_CHECK(cudaStreamCreate(&stream));
    moe::cuda::CublasHandle cublas;
    cublas.set_stream(stream);
    for (const Shape& shape : options.shapes) {
      std::printf("== %s\n", shape.name().c_str());
      for (moe::Activation activation : options.activations) {
        const std::string what = shape.name() + " " + std::string(moe::to_string(activation));
        if (options.micro_batches > 0) {  // the layer over micro-batches: its own inputs, per routing
          for (Routing routing : options.routings) {
            if (routing == Routing::captured && int64_t(options.captured->tokens_per_expert.size()) != shape.E) continue;
            try {
              run_micro_batches(shape, routing, activation, options, cublas, stream, report);
            } catch (const std::exception& error) {
              record_fact(what + " " + std::string(moe::bench::to_string(routing)) + " micro-batches", false,
                          std::string("threw: ") + error.what());
            }
            CUDA_CHECK(cudaStreamSynchronize(stream));
          }
          continue;
        }
        // Weights and token tensors for the shape, plus the smallest section (the exact-rows cuBLAS paths).
        const size_t rows = size_t(shape.T) * shape.K;
        if (!fits(ShapeInputs::bytes(shape, activation) + CublasFfn::bytes(rows, shape.D, shape.H, activation, shape.E),
                  what, report)) {
          continue;
        }
        const ShapeInputs inputs(shape, activation, options.seed);
        for (Routing routing : options.routings) {
          if (routing == Routing::captured && int64_t(options.captured->tokens_per_expert.size()) != shape.E) {
            std::printf("captured routing: E = %zu, this shape E = %d: not timed\n",
                        options.captured->tokens_per_expert.size(), shape.E);
            continue;
          }
          try {
            run_formulations(shape, routing, inputs, options, cublas, stream, report);
          } catch (const std::exception& error) {  // e.g. a routing that cannot give K distinct experts
            record_fact(what + " " + std::string(moe::bench::to_string(routing)), false,
                        std::string("threw: ") + error.what());
          }
        }
        CUDA_CHECK(cudaStreamSynchronize(stream));
      }  // each shape's and activation's buffers are freed here, before the next allocates
    }
    finish_measurements(report);
    print_table(report);
    const json doc = report_json(report, options, cublas.get());
    const std::filesystem::path out(options.out);
    if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
    std::ofstream(out) << doc.dump(1) << "\n";
    std::printf("wrote %s\n", options.out.c_str());
    CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& error) {
    record_fact("moe_bench", false, std::string("stopped: ") + error.what());
  }
  return verdict();
}
