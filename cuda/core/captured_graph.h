// core/captured_graph.h: CapturedGraph, the work a function enqueues on a stream, captured once into
// a CUDA graph and instantiated, then replayed with one launch. The training step
// (ModelGpu::forward_backward_graph) and the decode step (InferenceModelGpu) replay theirs this way:
// hundreds of kernel launches become one, and the host's launch cost leaves the step.
// What a replay does is what the capture enqueued, with the same arguments: anything that changes
// between steps must be read from device memory (a step's inputs, a decoder's position).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <utility>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

class CapturedGraph {
 public:
  // Captures what `enqueue()` puts on `stream` (not the legacy default stream, which cannot be
  // captured) and instantiates it. If enqueue throws, the capture is ended first, so that the stream
  // is usable again, and the exception goes on.
  template <typename Enqueue>
  static std::unique_ptr<CapturedGraph> capture(cudaStream_t stream, Enqueue&& enqueue) {
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      std::forward<Enqueue>(enqueue)();
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    std::unique_ptr<CapturedGraph> captured(new CapturedGraph());
    const cudaError_t instantiated = cudaGraphInstantiate(&captured->exec_, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_CHECK(instantiated);
    return captured;
  }

  void launch(cudaStream_t stream) const { CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

 private:
  CapturedGraph() = default;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moe::cuda
