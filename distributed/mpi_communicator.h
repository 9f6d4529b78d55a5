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
#pragma once

#include <mpi.h>

#include "communicator.h"

namespace moe::dist {

// MPI_Init on construction, MPI_Finalize on destruction: one per process, created first in main
// and destroyed after every MpiCommunicator.
class MpiEnvironment {
 public:
  MpiEnvironment(int& argc, char**& argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
};

class MpiCommunicator final : public Communicator {
 public:
  // A duplicate of MPI_COMM_WORLD: every process of the launch.
  static std::unique_ptr<MpiCommunicator> world();
  // Duplicates `communicator` (the caller keeps its own handle).
  explicit MpiCommunicator(MPI_Comm communicator);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  MPI_Comm handle() const { return communicator_; }

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
  MpiCommunicator(MPI_Comm owned, Adopt);  // takes `owned` (from a split) without duplicating it
  void adopt(MPI_Comm owned);

  MPI_Comm communicator_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  MPI_Op bfloat16_sum_ = MPI_OP_NULL;  // MPI has no bf16: a user operation adds the bit patterns
  MPI_Op uint8_sum_ = MPI_OP_NULL;     // wrapping byte sum (see mpi_communicator.cpp)
};

}  // namespace moe::dist
