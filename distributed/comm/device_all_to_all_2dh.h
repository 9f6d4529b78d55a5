// device_all_to_all_2dh.h: Tutel's two-dimensional hierarchical all-to-all (2DH; Hwang et al.,
// MLSys 2023) over GPU buffers, on either backend of DeviceExchange: the token exchanges of the
// expert-parallel layer on the GPU with options.hierarchical_ranks_per_node = G.
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_parallel_gpu_nccl   (one GPU per rank)
//   mpirun -np 2 build/distributed/bench/ep_bench --backend nccl --nodes-of 2
//
// The ranks form nodes of G consecutive ranks (N = R / G). One call moves the same bytes as a flat
// all-to-all-v, in two stages (all_to_all_2dh.h says why: at scale a flat exchange sends R - 1
// small messages across nodes, 2DH sends N - 1 messages each G times larger):
//   gather    this rank's blocks reordered by the destination's local index (device copies);
//   stage 1   all-to-all-v within the node (NVLink on a real node);
//   align     [source local index][destination node] -> [destination node][source local index]
//             (Tutel's stride copy), so each node's blocks leave as one merged message;
//   stage 2   all-to-all-v across nodes among the ranks with the same local index;
//   place     the blocks, now in source-rank order, at the caller's offsets (skipped when the
//             caller's layout is packed in source order, as the layer's is: stage 2 writes there).
// Unlike HierarchicalAllToAll::all_to_all_v, the counts come from the caller as the whole R x R
// matrix, which the layer already knows from its count exchange: no count exchange of its own, and
// so no wait of the host on NCCL (the copies and both stages are enqueued on the stream). The steps
// are plan_hierarchical_all_to_all's (tested on CPU ranks against the flat exchange); the copies are
// cudaMemcpyAsync per block (3 R at most: few for the R of one or two hosts; a kernel would batch
// them at larger R).
//
// On NCCL the two sub-communicators come from ncclCommSplit; on MPI from MPI_Comm_split, each stage
// then staged through host memory as DeviceExchange stages (two host waits per stage).
// G = 1 or G = R is the flat exchange with extra copies (correct, never faster).
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <memory>
#include <span>

#include "comm/all_to_all_2dh.h"   // plan_hierarchical_all_to_all, HierarchicalSteps
#include "comm/communicator.h"     // Communicator, DataType
#include "comm/device_exchange.h"  // DeviceExchange
#include "comm/grown_buffer.h"     // GrownBuffer

namespace moe::dist {

class DeviceHierarchicalAllToAll {
 public:
  // Collective over world's ranks: splits them into nodes of G consecutive ranks and into the
  // groups of ranks with the same local index. Throws std::invalid_argument on every rank unless
  // 1 <= G divides R, or when ranks pass different G.
  DeviceHierarchicalAllToAll(DeviceExchange& world, int ranks_per_node);
  ~DeviceHierarchicalAllToAll();
  DeviceHierarchicalAllToAll(const DeviceHierarchicalAllToAll&) = delete;
  DeviceHierarchicalAllToAll& operator=(const DeviceHierarchicalAllToAll&) = delete;

  int ranks_per_node() const { return ranks_per_node_; }  // G
  int nodes() const { return nodes_; }                     // N = R / G

  // Device send and recv; counts [R * R] in elements, counts[s * R + t] from rank s to rank t, the
  // same matrix on every rank; offsets [R] are this rank's, as in DeviceExchange::all_to_all_v (its
  // send counts are row rank(), its receive counts column rank()). Ordered on `stream`.
  void all_to_all_v(const void* send, std::span<const int64_t> send_offsets, void* recv,
                    std::span<const int64_t> recv_offsets, std::span<const int64_t> counts, DataType type,
                    cudaStream_t stream);

  // Grows the staging buffers for a call with these counts now, so that the call itself allocates
  // nothing (cudaMalloc and cudaFree may wait for the device).
  void reserve(std::span<const int64_t> counts, DataType type);

  // Waits of the host on the GPU in the stages (the MPI backend's staging), since construction.
  int64_t host_waits() const;

 private:
  DeviceExchange& world_;
  int ranks_per_node_ = 1;
  int nodes_ = 1;
  std::unique_ptr<Communicator> node_communicator_, across_communicator_;
  std::unique_ptr<DeviceExchange> node_, across_;  // device collectives over them
  // The stages' device scratch (a step that moves nothing uses none).
  GrownBuffer stage1_send_{GrownBuffer::Memory::device, "DeviceHierarchicalAllToAll"};
  GrownBuffer stage1_recv_{GrownBuffer::Memory::device, "DeviceHierarchicalAllToAll"};
  GrownBuffer stage2_send_{GrownBuffer::Memory::device, "DeviceHierarchicalAllToAll"};
  GrownBuffer stage2_recv_{GrownBuffer::Memory::device, "DeviceHierarchicalAllToAll"};
};

}  // namespace moe::dist
