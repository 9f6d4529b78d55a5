// device_exchange.cpp: collectives over device buffers on either backend (see device_exchange.h).
//
// Sections: ---- helpers ----  ---- host collectives over NCCL ----  ---- DeviceExchange ----
#include "comm/device_exchange.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#if MOE_HAVE_NCCL
#include "comm/nccl_communicator.h"  // NcclCommunicator: set_stream, stream
#endif

namespace moe::dist {

// ---- helpers ----

namespace {

void check_cuda(cudaError_t result, std::string_view call) {
  if (result == cudaSuccess) return;
  throw std::runtime_error("DeviceExchange: " + std::string(call) + " failed: " + cudaGetErrorString(result));
}

// The elements a rank touches in an all-to-all-v buffer: up to the end of its last block.
int64_t extent(std::span<const int64_t> counts, std::span<const int64_t> offsets) {
  int64_t end = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] > 0) end = std::max(end, offsets[p] + counts[p]);
  }
  return end;
}

}  // namespace

// ---- host collectives over NCCL ----

#if MOE_HAVE_NCCL
namespace {

// Host buffers in, host buffers out, over an NCCL communicator: each call copies its input to
// device scratch, runs the NCCL collective on the communicator's stream, copies the result back
// and waits. Small messages only (agreement checks, settings), so the round trip does not matter.
class HostOverNccl final : public Communicator {
 public:
  explicit HostOverNccl(NcclCommunicator& nccl) : nccl_(nccl) {}

  int rank() const override { return nccl_.rank(); }
  int size() const override { return nccl_.size(); }
  std::string_view backend() const override { return "nccl"; }

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                    void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                    DataType type) override {
    check_all_to_all_arguments(*this, send_counts, send_offsets, recv_counts, recv_offsets);
    const size_t width = element_size(type);
    const size_t send_bytes = static_cast<size_t>(extent(send_counts, send_offsets)) * width;
    const size_t recv_bytes = static_cast<size_t>(extent(recv_counts, recv_offsets)) * width;
    char* device_send = send_scratch_.reserve(send_bytes);
    char* device_recv = recv_scratch_.reserve(recv_bytes);
    copy(device_send, send, send_bytes, cudaMemcpyHostToDevice);
    nccl_.all_to_all_v(device_send, send_counts, send_offsets, device_recv, recv_counts, recv_offsets, type);
    for (size_t p = 0; p < recv_counts.size(); ++p) {  // block by block: gaps of recv stay as they were
      if (recv_counts[p] == 0) continue;
      const size_t offset = static_cast<size_t>(recv_offsets[p]) * width;
      copy(static_cast<char*>(recv) + offset, device_recv + offset, static_cast<size_t>(recv_counts[p]) * width,
           cudaMemcpyDeviceToHost);
    }
    finish();
  }

  void all_reduce_sum(const void* send, void* recv, int64_t count, DataType type) override {
    check_count("all_reduce_sum", count);
    const size_t bytes = static_cast<size_t>(count) * element_size(type);
    through_device(send, bytes, recv, bytes, [&](const void* from, void* to) {
      nccl_.all_reduce_sum(from, to, count, type);
    });
  }

  void all_gather(const void* send, void* recv, int64_t count, DataType type) override {
    check_count("all_gather", count);
    const size_t bytes = static_cast<size_t>(count) * element_size(type);
    through_device(send, bytes, recv, bytes * static_cast<size_t>(size()), [&](const void* from, void* to) {
      nccl_.all_gather(from, to, count, type);
    });
  }

  void broadcast(void* buffer, int64_t count, DataType type, int root) override {
    check_count("broadcast", count);
    check_root(*this, root);
    const size_t bytes = static_cast<size_t>(count) * element_size(type);
    char* device = send_scratch_.reserve(bytes);
    copy(device, buffer, bytes, cudaMemcpyHostToDevice);
    nccl_.broadcast(device, count, type, root);
    copy(buffer, device, bytes, cudaMemcpyDeviceToHost);
    finish();
  }

  void barrier() override { nccl_.barrier(); }

  using Communicator::split;
  std::unique_ptr<Communicator> split(int, int) override {
    throw std::logic_error("DeviceExchange::host(): split the NCCL communicator itself, not its host view");
  }

 private:
  void copy(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) {
    if (bytes > 0) check_cuda(cudaMemcpyAsync(to, from, bytes, kind, nccl_.stream()), "cudaMemcpyAsync");
  }
  // Host send [send_bytes] into device scratch, collective(device send, device recv), and the
  // device recv [recv_bytes] back into host recv.
  template <typename Collective>
  void through_device(const void* send, size_t send_bytes, void* recv, size_t recv_bytes, Collective collective) {
    char* device_send = send_scratch_.reserve(send_bytes);
    char* device_recv = recv_scratch_.reserve(recv_bytes);
    copy(device_send, send, send_bytes, cudaMemcpyHostToDevice);
    collective(device_send, device_recv);
    copy(recv, device_recv, recv_bytes, cudaMemcpyDeviceToHost);
    finish();
  }
  // Under the communicator's watchdog, if it has one: a peer that never joins ends the job.
  void finish() { nccl_.wait(nccl_.stream(), "DeviceExchange::host() over NCCL"); }

  // Whole 256-byte units (cudaMalloc's alignment): under compute-sanitizer, NCCL 2.28's AllGather
  // (LL protocol) read 4 bytes past the end of a 118-byte receive buffer of an odd byte count.
  static constexpr size_t kScratchUnit = 256;

  NcclCommunicator& nccl_;
  GrownBuffer send_scratch_{GrownBuffer::Memory::device, "DeviceExchange", kScratchUnit};
  GrownBuffer recv_scratch_{GrownBuffer::Memory::device, "DeviceExchange", kScratchUnit};
};

}  // namespace
#endif

// ---- DeviceExchange ----

// NCCL enqueues on the communicator's stream: for one call, that is the caller's stream.
class DeviceExchange::StreamScope {
 public:
#if MOE_HAVE_NCCL
  StreamScope(NcclCommunicator* nccl, cudaStream_t stream) : nccl_(nccl), previous_(nccl->stream()) {
    nccl_->set_stream(stream);
  }
  ~StreamScope() { nccl_->set_stream(previous_); }

 private:
  NcclCommunicator* nccl_;
  cudaStream_t previous_;
#else
  StreamScope(NcclCommunicator*, cudaStream_t) {}
#endif
};

DeviceExchange::DeviceExchange(Communicator& communicator) : communicator_(communicator) {
  if (communicator.backend() == "nccl") {
#if MOE_HAVE_NCCL
    nccl_ = dynamic_cast<NcclCommunicator*>(&communicator);
#endif
    if (nccl_ == nullptr) {
      throw std::invalid_argument("DeviceExchange: the communicator says \"nccl\" but is not this build's "
                                  "NcclCommunicator (was the project built with NCCL?)");
    }
    device_pointers_ = true;
  } else if (communicator.backend() != "mpi") {
    throw std::invalid_argument("DeviceExchange: backend \"" + std::string(communicator.backend()) +
                                "\"; expected \"nccl\" (device buffers) or \"mpi\" (host buffers, staged)");
  }
}

// Over NCCL the wait polls the stream and NCCL's asynchronous errors under the watchdog
// (nccl_wait.h), so a peer that died mid-exchange ends the job instead of hanging this host.
void DeviceExchange::wait(cudaStream_t stream) {
#if MOE_HAVE_NCCL
  if (nccl_ != nullptr) {
    nccl_->wait(stream, "DeviceExchange: the host's wait for the stream (the count read-back)");
    ++host_waits_;
    return;
  }
#endif
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  ++host_waits_;
}

void DeviceExchange::wait_for_event(cudaEvent_t event, std::string_view what) {
#if MOE_HAVE_NCCL
  if (nccl_ != nullptr) {
    nccl_->wait(event, what);
    return;
  }
#endif
  (void)what;
  check_cuda(cudaEventSynchronize(event), "cudaEventSynchronize");
}

DeviceExchange::~DeviceExchange() = default;

char* DeviceExchange::stage_to_host(GrownBuffer& stage, const void* from, size_t bytes, cudaStream_t stream) {
  char* host = stage.reserve(bytes);
  if (bytes > 0) check_cuda(cudaMemcpyAsync(host, from, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  wait(stream);
  return host;
}

void DeviceExchange::stage_to_device(void* to, const char* from, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) check_cuda(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  wait(stream);
}

Communicator& DeviceExchange::host() {
  if (!device_pointers_) return communicator_;
#if MOE_HAVE_NCCL
  if (!host_adapter_) host_adapter_ = std::make_unique<HostOverNccl>(*nccl_);
#endif
  return *host_adapter_;
}

void DeviceExchange::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                  std::span<const int64_t> send_offsets, void* recv,
                                  std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                                  DataType type, cudaStream_t stream) {
  check_all_to_all_arguments(communicator_, send_counts, send_offsets, recv_counts, recv_offsets);
  if (device_pointers_) {
    StreamScope scope(nccl_, stream);
    communicator_.all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, type);
    return;
  }
  const size_t width = element_size(type);
  const size_t send_bytes = static_cast<size_t>(extent(send_counts, send_offsets)) * width;
  const size_t recv_bytes = static_cast<size_t>(extent(recv_counts, recv_offsets)) * width;
  char* send_host = stage_to_host(send_stage_, send, send_bytes, stream);
  char* recv_host = recv_stage_.reserve(recv_bytes);
  communicator_.all_to_all_v(send_host, send_counts, send_offsets, recv_host, recv_counts, recv_offsets, type);
  for (size_t p = 0; p < recv_counts.size(); ++p) {  // block by block: gaps of recv stay as they were
    if (recv_counts[p] == 0) continue;
    const size_t offset = static_cast<size_t>(recv_offsets[p]) * width;
    check_cuda(cudaMemcpyAsync(static_cast<char*>(recv) + offset, recv_host + offset,
                               static_cast<size_t>(recv_counts[p]) * width, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync");
  }
  wait(stream);  // the staging is free again
}

template <typename Collective>
void DeviceExchange::device_or_staged(const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                                      cudaStream_t stream, Collective collective) {
  if (device_pointers_) {
    StreamScope scope(nccl_, stream);
    collective(send, recv);
    return;
  }
  char* send_host = stage_to_host(send_stage_, send, send_bytes, stream);
  char* recv_host = recv_stage_.reserve(recv_bytes);
  collective(send_host, recv_host);
  stage_to_device(recv, recv_host, recv_bytes, stream);
}

void DeviceExchange::all_reduce_sum(const void* send, void* recv, int64_t count, DataType type,
                                    cudaStream_t stream) {
  check_count("all_reduce_sum", count);
  const size_t bytes = static_cast<size_t>(count) * element_size(type);
  device_or_staged(send, bytes, recv, bytes, stream, [&](const void* from, void* to) {
    communicator_.all_reduce_sum(from, to, count, type);
  });
}

void DeviceExchange::all_gather(const void* send, void* recv, int64_t count, DataType type, cudaStream_t stream) {
  check_count("all_gather", count);
  const size_t bytes = static_cast<size_t>(count) * element_size(type);
  device_or_staged(send, bytes, recv, bytes * static_cast<size_t>(size()), stream, [&](const void* from, void* to) {
    communicator_.all_gather(from, to, count, type);
  });
}

void DeviceExchange::all_gather_to_host(const void* send, void* recv, int64_t count, DataType type,
                                        cudaStream_t stream) {
  start_all_gather_to_host(send, count, type, stream);
  finish_all_gather_to_host(recv);
}

void DeviceExchange::start_all_gather_to_host(const void* send, int64_t count, DataType type, cudaStream_t stream) {
  check_count("all_gather_to_host", count);
  if (pending_gather_.started) {
    throw std::logic_error("DeviceExchange::start_all_gather_to_host: the last one was not finished");
  }
  const size_t bytes = static_cast<size_t>(count) * element_size(type);
  const size_t all_bytes = bytes * static_cast<size_t>(size());
  char* gathered = gather_host_.reserve(all_bytes);  // pinned: the device copies straight into it
  if (device_pointers_) {
    char* gathered_device = gather_device_.reserve(all_bytes);
    {
      StreamScope scope(nccl_, stream);
      communicator_.all_gather(send, gathered_device, count, type);
    }
    if (all_bytes > 0) {
      check_cuda(cudaMemcpyAsync(gathered, gathered_device, all_bytes, cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync");
    }
  } else {
    char* send_host = stage_to_host(send_stage_, send, bytes, stream);  // the host waits here
    communicator_.all_gather(send_host, gathered, count, type);
  }
  pending_gather_ = PendingGather{gathered, all_bytes, stream, true};
}

void DeviceExchange::finish_all_gather_to_host(void* recv) {
  if (!pending_gather_.started) {
    throw std::logic_error("DeviceExchange::finish_all_gather_to_host without a start_all_gather_to_host");
  }
  const PendingGather pending = pending_gather_;
  pending_gather_ = PendingGather{};
  if (device_pointers_) wait(pending.stream);
  std::copy(pending.gathered, pending.gathered + pending.bytes, static_cast<char*>(recv));
}

}  // namespace moe::dist
