// device_exchange.h: collectives over GPU buffers on either backend of the communicator, the one
// mechanism by which the expert-parallel layer on the GPU (expert_parallel_gpu.h) and ep_bench move
// device data between ranks.
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_parallel_gpu
//
// The two backends take different memory (communicator.h): NCCL takes device pointers and enqueues
// on a stream; MPI takes host buffers and returns when the data has moved. DeviceExchange hides
// exactly that difference and nothing else:
//   nccl  the device pointers go straight to NCCL, enqueued on the stream of the call (the
//         communicator's own stream is set for the call and put back after);
//   mpi   staged: device -> pinned host (cudaMemcpyAsync on the stream, then the host waits for
//         it), the MPI collective on the pinned buffers, pinned host -> device on the stream (and
//         the host waits again, so the staging buffers are free for the next call). This is how
//         several ranks share one GPU, which NCCL refuses ("Duplicate GPU detected"); its timings
//         are those of two PCIe copies and shared memory between processes, not of an interconnect.
// So with NCCL a call returns at once and the stream carries the dependency; with MPI the call
// returns after the data is in place. Either way, work enqueued on the same stream afterwards sees
// the result, and the caller must not touch `recv` on another stream without an event.
//
// host(): the same collectives over HOST buffers, on either backend (for the checks every rank must
// agree on, rank_agreement.h, and the R x E routing counts): the MPI communicator itself, or over
// NCCL an adapter that stages through a small device buffer.
//
// Counts and offsets are in elements of `type` and are host values, as in communicator.h.
// Dimension legend: R ranks.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "comm/communicator.h"  // Communicator, DataType
#include "comm/grown_buffer.h"  // GrownBuffer

namespace moe::dist {

class NcclCommunicator;  // nccl_communicator.h, where the build has NCCL

class DeviceExchange {
 public:
  // Takes the backend from communicator.backend(): "nccl" (then it must be a NcclCommunicator, in a
  // build with NCCL) or "mpi". The MPI mode touches no CUDA API until its first device collective,
  // so host() works on a machine without a GPU.
  explicit DeviceExchange(Communicator& communicator);
  ~DeviceExchange();
  DeviceExchange(const DeviceExchange&) = delete;
  DeviceExchange& operator=(const DeviceExchange&) = delete;

  int rank() const { return communicator_.rank(); }
  int size() const { return communicator_.size(); }  // R
  std::string_view backend() const { return communicator_.backend(); }
  // Whether device data goes through host memory (the MPI backend).
  bool staged() const { return !device_pointers_; }
  Communicator& communicator() { return communicator_; }
  // Collectives over host buffers on this backend (see the file comment).
  Communicator& host();

  // ---- collectives over device buffers, ordered on `stream` ----
  // As Communicator::all_to_all_v, with send and recv in device memory.
  void all_to_all_v(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                    void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                    DataType type, cudaStream_t stream);
  void all_reduce_sum(const void* send, void* recv, int64_t count, DataType type, cudaStream_t stream);
  void all_gather(const void* send, void* recv, int64_t count, DataType type, cudaStream_t stream);

  // Device `send` [count] from every rank into HOST `recv` [R * count], rank after rank; returns
  // when recv holds them. One wait of the host on `stream` on either backend: the layer's one
  // host synchronisation per forward (FastMoE's count read-back).
  void all_gather_to_host(const void* send, void* recv, int64_t count, DataType type, cudaStream_t stream);
  // all_gather_to_host in two calls, so that the caller can enqueue other work (another
  // micro-batch's routing) before the host waits: start enqueues the all-gather and the copy to the
  // host on `stream` (NCCL; under MPI it runs the staged exchange whole), finish waits for `stream`
  // (and so for whatever was enqueued on it since) and copies the R * count elements into `recv`.
  // Nothing else may run on this exchange between the two.
  void start_all_gather_to_host(const void* send, int64_t count, DataType type, cudaStream_t stream);
  void finish_all_gather_to_host(void* recv);

  // The host waits for `event` (work of the caller's that may sit behind this exchange's NCCL
  // calls): over NCCL under the communicator's watchdog (nccl_wait.h), else cudaEventSynchronize.
  // Not counted in host_waits(): the caller's own wait, not one of the exchange's.
  void wait_for_event(cudaEvent_t event, std::string_view what);

  // How many times the calls above made the host wait for the GPU, since construction.
  int64_t host_waits() const { return host_waits_; }

 private:
  class StreamScope;
  void wait(cudaStream_t stream);  // cudaStreamSynchronize, counted
  // The MPI staging: device `from` [bytes] into the pinned `stage`, then the host waits for it.
  char* stage_to_host(GrownBuffer& stage, const void* from, size_t bytes, cudaStream_t stream);
  // Back: pinned `from` [bytes] to device `to`, then the host waits (the staging is free again).
  void stage_to_device(void* to, const char* from, size_t bytes, cudaStream_t stream);
  // all_reduce_sum and all_gather: collective(send, recv) on the device buffers under NCCL (on
  // `stream`); under MPI on the staging, send [send_bytes] there and recv [recv_bytes] back.
  template <typename Collective>
  void device_or_staged(const void* send, size_t send_bytes, void* recv, size_t recv_bytes, cudaStream_t stream,
                        Collective collective);

  Communicator& communicator_;
  NcclCommunicator* nccl_ = nullptr;  // the same communicator, when its backend is NCCL
  bool device_pointers_ = false;
  // MPI: the pinned staging buffers.
  GrownBuffer send_stage_{GrownBuffer::Memory::pinned_host, "DeviceExchange"};
  GrownBuffer recv_stage_{GrownBuffer::Memory::pinned_host, "DeviceExchange"};
  GrownBuffer gather_device_{GrownBuffer::Memory::device, "DeviceExchange"};  // NCCL: all_gather_to_host's device scratch
  GrownBuffer gather_host_{GrownBuffer::Memory::pinned_host, "DeviceExchange"};  // all_gather_to_host's result
  struct PendingGather {
    const char* gathered = nullptr;  // gather_host_'s R * count elements
    size_t bytes = 0;
    cudaStream_t stream = nullptr;   // NCCL: what finish waits for
    bool started = false;
  };
  PendingGather pending_gather_;
  std::unique_ptr<Communicator> host_adapter_;  // NCCL: host collectives through device memory
  int64_t host_waits_ = 0;
};

}  // namespace moe::dist
