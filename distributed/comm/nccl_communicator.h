// nccl_communicator.h: the NCCL backend of the communicator, over device buffers: the real path on
// several GPUs, within a node (NVLink) and across nodes. Built only where CMake finds CUDA and NCCL
// (MOE_HAVE_NCCL).
//   mpirun -np 2 build/tests/distributed/test_distributed_nccl_communicator     (one GPU per rank)
//
// MPI brings the processes up; the NCCL communicator is made from it: rank 0 draws the
// ncclUniqueId and broadcasts it over the bootstrap communicator (the MPI backend), then every rank
// joins. One GPU per rank: set the rank's device (cudaSetDevice) before constructing, and keep it
// current while calling. NCCL refuses two ranks on one device ("Duplicate GPU detected"); ranks that
// share a GPU use the MPI backend instead.
//
// Every collective is enqueued on the communicator's stream and returns before the data has moved,
// as NCCL does: the caller orders its kernels on that stream (or waits on it). barrier() is the one
// call that waits on the host: an all-reduce of one element, then wait() on the stream.
//
// When a rank dies or stops (watchdog.h): given a watchdog, the calls that can block the host
// (ncclCommInitRank, ncclCommSplit, the enqueue calls, which may set up connections to peers, and
// ncclCommDestroy) are armed with their names, and the communicator registers ncclCommAbort as an
// abort hook. A hang on the GPU shows where the host waits for the stream: wait() does that
// through nccl_wait.h (polling the stream and NCCL's asynchronous error under the watchdog), and
// any caller that waits on this communicator's work should use it instead of cudaStreamSynchronize.
// The destructor aborts instead of destroying a communicator that saw an asynchronous error.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t
#include <nccl.h>

#include "comm/communicator.h"
#include "comm/watchdog.h"  // CollectiveWatchdog

namespace moe::dist {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over bootstrap: every rank of it joins one NCCL communicator, with its rank and
  // size, on the current device, enqueuing on `stream` (0: the legacy default stream). With a
  // watchdog (it must outlive this communicator and its splits), see the file comment.
  NcclCommunicator(Communicator& bootstrap, cudaStream_t stream, CollectiveWatchdog* watchdog = nullptr);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  ncclComm_t handle() const { return communicator_; }
  cudaStream_t stream() const { return stream_; }
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  CollectiveWatchdog* watchdog() const { return watchdog_; }

  // The host waits for the work enqueued so far on `stream` (or recorded before `event`), which
  // carries this communicator's collectives: nccl_wait.h's wait_for with this communicator and its
  // watchdog. `what` names the wait in the watchdog's message.
  void wait(cudaStream_t stream, std::string_view what) const;
  void wait(cudaEvent_t event, std::string_view what) const;

  // All buffers are device pointers; counts, offsets and roots are host values.
  void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                    std::span<const int64_t> send_offsets, void* recv,
                    std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                    DataType type) override;
  void all_reduce_sum(const void* send, void* recv, int64_t count, DataType type) override;
  void all_gather(const void* send, void* recv, int64_t count, DataType type) override;
  void broadcast(void* buffer, int64_t count, DataType type, int root) override;
  void barrier() override;
  using Communicator::split;
  // ncclCommSplit (NCCL >= 2.18): the new communicator shares this one's device and stream.
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  NcclCommunicator(ncclComm_t owned, cudaStream_t stream, CollectiveWatchdog* watchdog);  // a split's
  void init_members();

  ncclComm_t communicator_ = nullptr;
  cudaStream_t stream_ = nullptr;
  CollectiveWatchdog* watchdog_ = nullptr;  // not owned; may be null
  uint64_t abort_hook_ = 0;                 // its ncclCommAbort on the watchdog, 0 without one
  int rank_ = 0;
  int size_ = 1;
  float* barrier_scratch_ = nullptr;  // [1] on the device: what barrier() all-reduces
};

}  // namespace moe::dist
