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
// call that waits on the host: an all-reduce of one element, then cudaStreamSynchronize.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t
#include <nccl.h>

#include "communicator.h"

namespace moe::dist {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over bootstrap: every rank of it joins one NCCL communicator, with its rank and
  // size, on the current device, enqueuing on `stream` (0: the legacy default stream).
  NcclCommunicator(Communicator& bootstrap, cudaStream_t stream);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  ncclComm_t handle() const { return communicator_; }
  cudaStream_t stream() const { return stream_; }
  void set_stream(cudaStream_t stream) { stream_ = stream; }

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
  NcclCommunicator(ncclComm_t owned, cudaStream_t stream);  // adopts a communicator from a split
  void init_members();

  ncclComm_t communicator_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  float* barrier_scratch_ = nullptr;  // [1] on the device: what barrier() all-reduces
};

}  // namespace moe::dist
