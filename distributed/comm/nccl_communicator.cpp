// nccl_communicator.cpp: the NCCL backend over device buffers (see nccl_communicator.h).
#include "comm/nccl_communicator.h"

#include <cstring>
#include <string>
#include <vector>

#include "comm/nccl_wait.h"  // wait_for: the host's wait on the stream, under the watchdog

namespace moe::dist {

namespace {

void check_cuda(cudaError_t result, std::string_view call) {
  if (result == cudaSuccess) return;
  throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(result));
}

void check_nccl(ncclResult_t result, std::string_view call, ncclComm_t communicator) {
  if (result == ncclSuccess) return;
  std::string message = std::string(call) + " failed: " + ncclGetErrorString(result);
  const char* detail = ncclGetLastError(communicator);
  if (detail && *detail) message += std::string(" (") + detail + ")";
  throw std::runtime_error(message);
}

ncclDataType_t nccl_type(DataType type) {
  switch (type) {
    case DataType::uint8: return ncclUint8;
    case DataType::int32: return ncclInt32;
    case DataType::int64: return ncclInt64;
    case DataType::float32: return ncclFloat32;
    case DataType::float64: return ncclFloat64;
    case DataType::bfloat16: return ncclBfloat16;
  }
  throw std::invalid_argument("nccl_type: unknown DataType");
}

}  // namespace

NcclCommunicator::NcclCommunicator(Communicator& bootstrap, cudaStream_t stream, CollectiveWatchdog* watchdog)
    : stream_(stream), watchdog_(watchdog) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (bootstrap.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr);
  bootstrap.broadcast(&id, static_cast<int64_t>(sizeof id), DataType::uint8, 0);  // host bytes
  {
    const auto armed = arm(watchdog_, "ncclCommInitRank");  // returns once every rank has joined
    check_nccl(ncclCommInitRank(&communicator_, bootstrap.size(), id, bootstrap.rank()), "ncclCommInitRank",
               nullptr);
  }
  init_members();
}

NcclCommunicator::NcclCommunicator(ncclComm_t owned, cudaStream_t stream, CollectiveWatchdog* watchdog)
    : communicator_(owned), stream_(stream), watchdog_(watchdog) {
  init_members();
}

void NcclCommunicator::init_members() {
  check_nccl(ncclCommUserRank(communicator_, &rank_), "ncclCommUserRank", communicator_);
  check_nccl(ncclCommCount(communicator_, &size_), "ncclCommCount", communicator_);
  check_cuda(cudaMalloc(&barrier_scratch_, sizeof(float)), "cudaMalloc");
  check_cuda(cudaMemset(barrier_scratch_, 0, sizeof(float)), "cudaMemset");
  if (watchdog_ != nullptr) {
    // ncclCommAbort stops this communicator's kernels and frees its resources without waiting for
    // the peers, the one safe end for a communicator whose peer is gone.
    const ncclComm_t communicator = communicator_;
    abort_hook_ = watchdog_->add_abort_hook(
        "the NCCL communicator (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")",
        [communicator] { ncclCommAbort(communicator); });
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (watchdog_ != nullptr && abort_hook_ != 0) watchdog_->remove_abort_hook(abort_hook_);
  if (barrier_scratch_) cudaFree(barrier_scratch_);
  if (!communicator_) return;
  // After an asynchronous error NCCL's rule is to abort: destroying would wait for peers that are gone.
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(communicator_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
    ncclCommAbort(communicator_);
    return;
  }
  const auto armed = arm(watchdog_, "ncclCommDestroy");
  ncclCommDestroy(communicator_);
}

void NcclCommunicator::wait(cudaStream_t stream, std::string_view what) const {
  wait_for(stream, what, communicator_, watchdog_);
}

void NcclCommunicator::wait(cudaEvent_t event, std::string_view what) const {
  wait_for(event, what, communicator_, watchdog_);
}

void NcclCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                    std::span<const int64_t> send_offsets, void* recv,
                                    std::span<const int64_t> recv_counts,
                                    std::span<const int64_t> recv_offsets, DataType type) {
  check_all_to_all_arguments(*this, send_counts, send_offsets, recv_counts, recv_offsets);
  const size_t width = element_size(type);
  const auto* from = static_cast<const char*>(send);
  auto* to = static_cast<char*>(recv);
  // NCCL has no all-to-all-v: point-to-point sends and receives in one group, which NCCL schedules
  // together (nccl-tests' alltoall.cu does the same). Empty blocks post nothing.
  // ncclGroupEnd may wait on the host, for the peers' side of a connection it sets up.
  const auto armed = arm(watchdog_, "all_to_all_v (ncclGroupEnd of ncclSend / ncclRecv)");
  check_nccl(ncclGroupStart(), "ncclGroupStart", communicator_);
  for (int p = 0; p < size_; ++p) {
    if (send_counts[p] > 0) {
      check_nccl(ncclSend(from + send_offsets[p] * width, static_cast<size_t>(send_counts[p]), nccl_type(type), p,
                          communicator_, stream_),
                 "ncclSend", communicator_);
    }
    if (recv_counts[p] > 0) {
      check_nccl(ncclRecv(to + recv_offsets[p] * width, static_cast<size_t>(recv_counts[p]), nccl_type(type), p,
                          communicator_, stream_),
                 "ncclRecv", communicator_);
    }
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd", communicator_);
}

void NcclCommunicator::all_reduce_sum(const void* send, void* recv, int64_t count, DataType type) {
  check_count("all_reduce_sum", count);
  const auto armed = arm(watchdog_, "all_reduce_sum (ncclAllReduce)");
  check_nccl(ncclAllReduce(send, recv, static_cast<size_t>(count), nccl_type(type), ncclSum, communicator_, stream_),
             "ncclAllReduce", communicator_);
}

void NcclCommunicator::all_gather(const void* send, void* recv, int64_t count, DataType type) {
  check_count("all_gather", count);
  const auto armed = arm(watchdog_, "all_gather (ncclAllGather)");
  check_nccl(ncclAllGather(send, recv, static_cast<size_t>(count), nccl_type(type), communicator_, stream_),
             "ncclAllGather", communicator_);
}

void NcclCommunicator::broadcast(void* buffer, int64_t count, DataType type, int root) {
  check_count("broadcast", count);
  check_root(*this, root);
  const auto armed = arm(watchdog_, "broadcast (ncclBroadcast)");
  check_nccl(ncclBroadcast(buffer, buffer, static_cast<size_t>(count), nccl_type(type), root, communicator_, stream_),
             "ncclBroadcast", communicator_);
}

void NcclCommunicator::barrier() {
  all_reduce_sum(barrier_scratch_, barrier_scratch_, 1, DataType::float32);
  wait(stream_, "barrier (ncclAllReduce, then the host's wait for the stream)");
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  if (color < 0) {
    throw std::invalid_argument("split: color = " + std::to_string(color) + "; expected a color >= 0");
  }
  ncclComm_t part = nullptr;
  {
    const auto armed = arm(watchdog_, "split (ncclCommSplit)");  // collective: waits for every rank
    check_nccl(ncclCommSplit(communicator_, color, key, &part, nullptr), "ncclCommSplit", communicator_);
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(part, stream_, watchdog_));
}

}  // namespace moe::dist
