// mpi_communicator.h: the MPI backend of the communicator, over host buffers. It runs the
// expert-parallel layer on CPU-only ranks (CI, lessons) and on several ranks that share one GPU,
// where NCCL refuses to run. Its timings are those of shared memory between processes, not of a
// GPU interconnect.
//
//   mpirun -np 4 build/tests/distributed/test_distributed_communicator
//   (as root, OpenMPI also wants --allow-run-as-root; more ranks than cores, --oversubscribe)
//
// Every communicator owns a duplicate of the MPI communicator it is given (MPI_Comm_dup), so its
// collectives never match a message of the caller's own MPI traffic. MPI's error handler stays
// MPI_ERRORS_ARE_FATAL: a failed transfer ends every rank of the job, it never leaves peers waiting.
// A peer that stops without a failed transfer (it was stopped, or never calls the collective) is
// what the watchdog is for: given one, every blocking collective is armed with its name
// (watchdog.h), so a rank left waiting ends the job after the watchdog's timeout.
#pragma once

#include <mpi.h>

#include "comm/communicator.h"
#include "comm/watchdog.h"  // CollectiveWatchdog

namespace moe::dist {

// MPI_Init_thread on construction, MPI_Finalize on destruction: one per process, created first in
// main and destroyed after every MpiCommunicator. It asks for MPI_THREAD_FUNNELED: the process may
// have other threads (the watchdog's), but only the main thread calls MPI.
class MpiEnvironment {
 public:
  MpiEnvironment(int& argc, char**& argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  int world_rank() const;  // this process's rank in MPI_COMM_WORLD
  int world_size() const;  // R: every process of the launch
};

class MpiCommunicator final : public Communicator {
 public:
  // A duplicate of MPI_COMM_WORLD: every process of the launch. With a watchdog, every blocking
  // collective of this communicator and of its splits is armed; the watchdog must outlive them.
  static std::unique_ptr<MpiCommunicator> world(CollectiveWatchdog* watchdog = nullptr);
  // Duplicates `communicator` (the caller keeps its own handle).
  explicit MpiCommunicator(MPI_Comm communicator, CollectiveWatchdog* watchdog = nullptr);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  MPI_Comm handle() const { return communicator_; }
  CollectiveWatchdog* watchdog() const { return watchdog_; }

  // This rank's place among the ranks of its host (MPI_COMM_TYPE_SHARED): a program picks its GPU
  // as host_rank().rank modulo the host's GPUs. Collective.
  struct HostRank {
    int rank = 0;   // among the ranks of this host
    int ranks = 1;  // ranks on this host
  };
  HostRank host_rank() const;

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                    std::span<const int64_t> send_offsets, void* recv,
                    std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                    DataType type) override;
  void all_reduce_sum(const void* send, void* recv, int64_t count, DataType type) override;
  void all_gather(const void* send, void* recv, int64_t count, DataType type) override;
  void broadcast(void* buffer, int64_t count, DataType type, int root) override;
  void barrier() override;
  using Communicator::split;
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  struct Adopt {};
  MpiCommunicator(MPI_Comm owned, CollectiveWatchdog* watchdog, Adopt);  // takes `owned` (a split's) as is
  void adopt(MPI_Comm owned);

  MPI_Comm communicator_ = MPI_COMM_NULL;
  CollectiveWatchdog* watchdog_ = nullptr;  // not owned; may be null
  int rank_ = 0;
  int size_ = 1;
  MPI_Op bfloat16_sum_ = MPI_OP_NULL;  // MPI has no bf16: a user operation adds the bit patterns
  MPI_Op uint8_sum_ = MPI_OP_NULL;     // wrapping byte sum (see mpi_communicator.cpp)
};

}  // namespace moe::dist
