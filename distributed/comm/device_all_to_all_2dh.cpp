// device_all_to_all_2dh.cpp: Tutel's 2DH all-to-all over GPU buffers (see device_all_to_all_2dh.h).
#include "comm/device_all_to_all_2dh.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "comm/rank_agreement.h"  // check_same_on_every_rank

namespace moe::dist {

namespace {

void check_cuda(cudaError_t result, const char* call) {
  if (result == cudaSuccess) return;
  throw std::runtime_error(std::string("DeviceHierarchicalAllToAll: ") + call + " failed: " + cudaGetErrorString(result));
}

}  // namespace

DeviceHierarchicalAllToAll::DeviceHierarchicalAllToAll(DeviceExchange& world, int ranks_per_node)
    : world_(world), ranks_per_node_(ranks_per_node) {
  check_same_on_every_rank(world.host(), "DeviceHierarchicalAllToAll: ranks_per_node (G)",
                           static_cast<uint64_t>(ranks_per_node));
  const int R = world.size(), G = ranks_per_node;
  if (G < 1 || R % G != 0) {  // the same G on every rank: every rank throws
    throw std::invalid_argument("DeviceHierarchicalAllToAll: ranks_per_node G = " + std::to_string(G) +
                                " must be >= 1 and divide the number of ranks R = " + std::to_string(R) +
                                " (a node is a group of G consecutive ranks)");
  }
  nodes_ = R / G;
  // NCCL: ncclCommSplit; MPI: MPI_Comm_split. Both collective over the world's ranks, in this order.
  node_communicator_ = world.communicator().split(/*color=*/world.rank() / G);
  across_communicator_ = world.communicator().split(/*color=*/world.rank() % G);
  node_ = std::make_unique<DeviceExchange>(*node_communicator_);
  across_ = std::make_unique<DeviceExchange>(*across_communicator_);
}

DeviceHierarchicalAllToAll::~DeviceHierarchicalAllToAll() = default;

int64_t DeviceHierarchicalAllToAll::host_waits() const { return node_->host_waits() + across_->host_waits(); }

void DeviceHierarchicalAllToAll::reserve(std::span<const int64_t> counts, DataType type) {
  const std::vector<int64_t> no_offsets(static_cast<size_t>(world_.size()), 0);
  const HierarchicalSteps steps =
      plan_hierarchical_all_to_all(counts, world_.size(), ranks_per_node_, world_.rank(), no_offsets, no_offsets);
  const size_t width = element_size(type);
  stage1_send_.reserve(static_cast<size_t>(steps.stage1_send_elements) * width);
  stage1_recv_.reserve(static_cast<size_t>(steps.stage1_recv_elements) * width);
  stage2_send_.reserve(static_cast<size_t>(steps.stage1_recv_elements) * width);
  stage2_recv_.reserve(static_cast<size_t>(steps.stage2_recv_elements) * width);
}

void DeviceHierarchicalAllToAll::all_to_all_v(const void* send, std::span<const int64_t> send_offsets, void* recv,
                                              std::span<const int64_t> recv_offsets, std::span<const int64_t> counts,
                                              DataType type, cudaStream_t stream) {
  const HierarchicalSteps steps =
      plan_hierarchical_all_to_all(counts, world_.size(), ranks_per_node_, world_.rank(), send_offsets, recv_offsets);
  const size_t width = element_size(type);
  auto run = [&](const std::vector<BlockCopy>& copies, const void* from, void* to) {
    for (const BlockCopy& copy : copies) {
      check_cuda(cudaMemcpyAsync(static_cast<char*>(to) + copy.to * width,
                                 static_cast<const char*>(from) + copy.from * width,
                                 static_cast<size_t>(copy.count) * width, cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync");
    }
  };
  // A step that moves nothing is skipped, its input serving as its output.
  const void* stage1_in = send;
  if (!steps.gather_is_identity) {
    char* gathered = stage1_send_.reserve(static_cast<size_t>(steps.stage1_send_elements) * width);
    run(steps.gather, send, gathered);
    stage1_in = gathered;
  }
  char* stage1_out = stage1_recv_.reserve(static_cast<size_t>(steps.stage1_recv_elements) * width);
  node_->all_to_all_v(stage1_in, steps.stage1_send_counts, steps.stage1_send_offsets, stage1_out,
                      steps.stage1_recv_counts, steps.stage1_recv_offsets, type, stream);
  const void* stage2_in = stage1_out;
  if (!steps.align_is_identity) {
    char* aligned = stage2_send_.reserve(static_cast<size_t>(steps.stage1_recv_elements) * width);
    run(steps.align, stage1_out, aligned);
    stage2_in = aligned;
  }
  void* stage2_out = recv;
  if (!steps.place_is_identity) stage2_out = stage2_recv_.reserve(static_cast<size_t>(steps.stage2_recv_elements) * width);
  across_->all_to_all_v(stage2_in, steps.stage2_send_counts, steps.stage2_send_offsets, stage2_out,
                        steps.stage2_recv_counts, steps.stage2_recv_offsets, type, stream);
  if (!steps.place_is_identity) run(steps.place, stage2_out, recv);
}

}  // namespace moe::dist
