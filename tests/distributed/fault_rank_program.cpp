// fault_rank_program.cpp: collectives in a loop over the MPI backend, with one rank made to fail
// mid-step, so a test can show that the job then ends (and says why) instead of hanging.
//
//   mpirun -np 3 build/tests/distributed/fault_rank_program --fault kill --fault-rank 1 --fault-step 5
//   mpirun -np 3 build/tests/distributed/fault_rank_program --fault stop --collective-timeout 5
//   mpirun -np 2 build/tests/distributed/fault_rank_program --backend nccl --fault stop   (a GPU per rank)
//   (as root, OpenMPI also wants --allow-run-as-root; more ranks than cores, --oversubscribe)
//
// Each step is what a training step's communication looks like: over MPI, an all-gather of per-rank
// counts, an all-to-all-v of uneven blocks, an all-reduce of a gradient; over NCCL (--backend nccl,
// where the build has it), an all-reduce of a device buffer that the host then waits for through
// nccl_wait.h, where a GPU-side hang shows. Each result is checked. At step s, rank k fails in one
// of three ways (--fault):
//   kill  raise(SIGKILL): the rank dies. OpenMPI's mpirun sees it and ends the job, naming the rank
//         and the signal ("... rank 1 ... exited on signal 9 (Killed)").
//   stop  raise(SIGSTOP): the rank stops without dying; nothing tells the launcher. Its peers wait
//         in the step's first collective until the watchdog (distributed/watchdog.h) ends them, and
//         mpirun then ends the job, the stopped rank included.
//   skip  the rank leaves the loop without calling the step's collectives and goes on to the end of
//         the run, a barrier over MPI, as a rank does that returned early on an error only it saw: its peers
//         wait in the step's all-gather, it waits in the barrier, and every rank's watchdog ends it.
//         (Not MPI_Finalize: OpenMPI 4.1.4's mpirun can hang in its own teardown, in
//         PMIx_server_finalize, when a job aborts while a rank waits in MPI_Finalize.)
// Without a fault every step runs and rank 0 prints "PASS ranks=R steps=N" (exit 0). Over NCCL with
// fewer GPUs than ranks, rank 0 prints "SKIP needs one GPU per rank ..." and every rank exits 0.
// --pid-dir DIR writes DIR/rank<r>.pid, so a test can kill a rank that the launcher left behind
// (tests/distributed/run_fault.cmake). Tests: ctest --test-dir build -R FaultRank
#include <mpi.h>
#include <unistd.h>  // getpid

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_communicator.h"
#include "comm/watchdog.h"

#if MOE_FAULT_PROGRAM_NCCL
#include <cuda_runtime.h>

#include "comm/nccl_communicator.h"  // NcclCommunicator::wait: the host's wait under the watchdog
#endif

namespace {

using namespace moe::dist;

enum class Fault { none, kill, stop, skip };

struct Options {
  bool nccl = false;  // --backend nccl
  Fault fault = Fault::none;
  int fault_rank = 1;
  int fault_step = 5;
  int steps = 20;
  int step_ms = 10;  // a pause between steps, as a step's compute would be
  double collective_timeout_s = std::chrono::duration<double>(kDefaultCollectiveTimeout).count();
  std::string pid_dir;
  bool help = false;
};

const char* usage() {
  return "usage: fault_rank_program [--backend mpi|nccl] [--fault none|kill|stop|skip] [--fault-rank K] [--fault-step S]\n"
         "                          [--steps N] [--step-ms MS] [--collective-timeout SECONDS] [--pid-dir DIR]\n"
         "  Collectives in a loop (over MPI, or over NCCL on one GPU per rank); rank K fails at step S:\n"
         "    kill   raise(SIGKILL): the launcher ends the job and names the rank\n"
         "    stop   raise(SIGSTOP): the peers' watchdog ends them after the collective timeout\n"
         "    skip   leave the loop without calling the step's collectives, wait in the final barrier\n"
         "  --backend             mpi (host buffers, default) or nccl (one GPU per rank)\n"
         "  --collective-timeout  the watchdog's deadline for one collective (default 30)\n"
         "  --pid-dir             write DIR/rank<r>.pid for a test to clean up after\n"
         "  Without a fault, rank 0 prints PASS ranks=R steps=N.\n";
}

int parse_int(const std::string& flag, const std::string& value, int lowest) {
  size_t used = 0;
  int parsed = 0;
  try {
    parsed = std::stoi(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || parsed < lowest) {
    throw std::invalid_argument(flag + " " + value + ": expected an integer >= " + std::to_string(lowest));
  }
  return parsed;
}

Options parse_options(int argc, char** argv) {
  Options options;
  const std::vector<std::string> flags_with_values = {"--backend", "--fault",   "--fault-rank",         "--fault-step",
                                                      "--steps",   "--step-ms", "--collective-timeout", "--pid-dir"};
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help") {
      options.help = true;
      continue;
    }
    if (std::find(flags_with_values.begin(), flags_with_values.end(), flag) == flags_with_values.end()) {
      throw std::invalid_argument("unknown flag " + flag);
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--backend") {
      if (value != "mpi" && value != "nccl") throw std::invalid_argument("--backend " + value + ": expected mpi or nccl");
      options.nccl = value == "nccl";
#if !MOE_FAULT_PROGRAM_NCCL
      if (options.nccl) throw std::invalid_argument("--backend nccl: this build has no NCCL");
#endif
    } else if (flag == "--fault") {
      if (value == "none") options.fault = Fault::none;
      else if (value == "kill") options.fault = Fault::kill;
      else if (value == "stop") options.fault = Fault::stop;
      else if (value == "skip") options.fault = Fault::skip;
      else throw std::invalid_argument("--fault " + value + ": expected none, kill, stop or skip");
    } else if (flag == "--fault-rank") {
      options.fault_rank = parse_int(flag, value, 0);
    } else if (flag == "--fault-step") {
      options.fault_step = parse_int(flag, value, 0);
    } else if (flag == "--steps") {
      options.steps = parse_int(flag, value, 1);
    } else if (flag == "--step-ms") {
      options.step_ms = parse_int(flag, value, 0);
    } else if (flag == "--collective-timeout") {
      char* end = nullptr;
      options.collective_timeout_s = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(options.collective_timeout_s > 0)) {
        throw std::invalid_argument("--collective-timeout " + value + ": expected seconds > 0");
      }
    } else if (flag == "--pid-dir") {
      options.pid_dir = value;
    }
  }
  return options;
}

// ---- one step's collectives, each checked ----

// Rank p sends (p + q + step) % 3 elements to rank q, each the value 1000 p + q.
int64_t block_count(int from, int to, int step) { return (from + to + step) % 3; }

// Returns an empty string, or what was wrong.
std::string run_mpi_step(Communicator& world, int step) {
  const int R = world.size(), me = world.rank();

  const std::vector<int64_t> counts = all_gather<int64_t>(world, static_cast<int64_t>(me + step));
  for (int p = 0; p < R; ++p) {
    if (counts[p] != p + step) return "all_gather: rank " + std::to_string(p) + "'s entry is wrong";
  }

  std::vector<int64_t> send_counts(R), recv_counts(R);
  for (int q = 0; q < R; ++q) send_counts[q] = block_count(me, q, step);
  for (int p = 0; p < R; ++p) recv_counts[p] = block_count(p, me, step);
  const std::vector<int64_t> send_offsets = exclusive_prefix_sum(send_counts);
  const std::vector<int64_t> recv_offsets = exclusive_prefix_sum(recv_counts);
  std::vector<int32_t> send(static_cast<size_t>(send_offsets[R - 1] + send_counts[R - 1]));
  std::vector<int32_t> recv(static_cast<size_t>(recv_offsets[R - 1] + recv_counts[R - 1]), -1);
  for (int q = 0; q < R; ++q) {
    for (int64_t i = 0; i < send_counts[q]; ++i) send[static_cast<size_t>(send_offsets[q] + i)] = 1000 * me + q;
  }
  all_to_all_v<int32_t>(world, send, send_counts, send_offsets, recv, recv_counts, recv_offsets);
  for (int p = 0; p < R; ++p) {
    for (int64_t i = 0; i < recv_counts[p]; ++i) {
      if (recv[static_cast<size_t>(recv_offsets[p] + i)] != 1000 * p + me) {
        return "all_to_all_v: the block from rank " + std::to_string(p) + " is wrong";
      }
    }
  }

  std::vector<double> gradient = {1.0 + me, 0.5 * step};
  all_reduce_sum<double>(world, gradient);
  if (gradient[0] != R * (R + 1) / 2.0 || gradient[1] != 0.5 * step * R) return "all_reduce_sum: wrong sum";
  return {};
}

#if MOE_FAULT_PROGRAM_NCCL
// ---- the NCCL backend: a device all-reduce per step, then the host's wait ----

class NcclSteps {
 public:
  static constexpr int64_t kElements = 1 << 16;

  NcclSteps(Communicator& bootstrap, CollectiveWatchdog& watchdog) {
    check(cudaSetDevice(bootstrap.rank()), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaMalloc(&device_, kElements * sizeof(float)), "cudaMalloc");
    // Pinned: a copy from pageable memory would block the host outside the armed wait.
    check(cudaMallocHost(&host_, kElements * sizeof(float)), "cudaMallocHost");
    nccl_ = std::make_unique<NcclCommunicator>(bootstrap, stream_, &watchdog);
  }
  ~NcclSteps() {
    nccl_.reset();
    cudaFreeHost(host_);
    cudaFree(device_);
    cudaStreamDestroy(stream_);
  }

  // Every rank contributes rank + step to each element: the sum is R (R - 1) / 2 + R step.
  std::string run(int step) {
    const int R = nccl_->size();
    for (int64_t i = 0; i < kElements; ++i) host_[i] = static_cast<float>(nccl_->rank() + step);
    check(cudaMemcpyAsync(device_, host_, kElements * sizeof(float), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    nccl_->all_reduce_sum(device_, device_, kElements, DataType::float32);
    check(cudaMemcpyAsync(host_, device_, kElements * sizeof(float), cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
    nccl_->wait(stream_, "all_reduce_sum (ncclAllReduce), the host's wait for the stream");
    const float expected = static_cast<float>(R * (R - 1) / 2 + R * step);
    for (int64_t i = 0; i < kElements; ++i) {
      if (host_[i] != expected) return "all_reduce_sum: element " + std::to_string(i) + " is wrong";
    }
    return {};
  }

 private:
  static void check(cudaError_t result, const char* call) {
    if (result != cudaSuccess) throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(result));
  }

  cudaStream_t stream_ = nullptr;
  float* device_ = nullptr;  // [kElements]
  float* host_ = nullptr;    // [kElements], pinned
  std::unique_ptr<NcclCommunicator> nccl_;
};

int visible_gpus() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  return devices;
}
#endif

void write_pid(const std::string& dir, int rank) {
  std::ofstream file(dir + "/rank" + std::to_string(rank) + ".pid");
  file << getpid() << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "fault_rank_program: %s\n%s", error.what(), usage());
    return 2;
  }
  if (options.help) {
    std::printf("%s", usage());
    return 0;
  }

  MpiEnvironment mpi(argc, argv);
  const int rank = mpi.world_rank(), ranks = mpi.world_size();
  if (!options.pid_dir.empty()) write_pid(options.pid_dir, rank);
  if (options.fault != Fault::none && options.fault_rank >= ranks) {
    if (rank == 0) std::fprintf(stderr, "fault_rank_program: --fault-rank %d: expected a rank < R = %d\n", options.fault_rank, ranks);
    return 2;
  }

  // The watchdog first: it must outlive the communicators that arm it.
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.collective_timeout_s * 1000.0));
  CollectiveWatchdog watchdog(rank, ranks, timeout);
  bool skipped = false;
  int failures = 0;
  {
    const auto world = MpiCommunicator::world(&watchdog);
    std::function<std::string(int)> run_step = [&world](int step) { return run_mpi_step(*world, step); };
#if MOE_FAULT_PROGRAM_NCCL
    std::unique_ptr<NcclSteps> nccl_steps;
    if (options.nccl) {
      if (visible_gpus() < ranks) {  // every rank sees the same devices: every rank skips
        if (rank == 0) std::printf("SKIP needs one GPU per rank: %d GPU(s) for %d ranks\n", visible_gpus(), ranks);
        return 0;
      }
      nccl_steps = std::make_unique<NcclSteps>(*world, watchdog);
      run_step = [&nccl_steps](int step) { return nccl_steps->run(step); };
    }
#endif
    for (int step = 0; step < options.steps; ++step) {
      if (options.fault != Fault::none && rank == options.fault_rank && step == options.fault_step) {
        const char* what = options.fault == Fault::kill   ? "raising SIGKILL"
                           : options.fault == Fault::stop ? "raising SIGSTOP"
                                                          : "leaving the loop without calling the collectives";
        std::printf("rank %d: step %d: %s (the fault)\n", rank, step, what);
        std::fflush(stdout);
        if (options.fault == Fault::kill) std::raise(SIGKILL);
        if (options.fault == Fault::stop) std::raise(SIGSTOP);
        skipped = true;
        world->barrier();  // the end of the run (over MPI); the peers are still in this step
        break;
      }
      const std::string wrong = run_step(step);
      if (!wrong.empty()) {
        std::fprintf(stderr, "FAIL rank %d step %d: %s\n", rank, step, wrong.c_str());
        ++failures;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(options.step_ms));
    }
    if (!skipped) {
      int64_t failed_ranks = failures > 0 ? 1 : 0;
      all_reduce_sum<int64_t>(*world, std::span<int64_t>(&failed_ranks, 1));
      if (rank == 0) {
        std::printf("%s ranks=%d steps=%d failed_ranks=%lld\n", failed_ranks == 0 ? "PASS" : "FAIL", ranks,
                    options.steps, static_cast<long long>(failed_ranks));
      }
      failures = static_cast<int>(failed_ranks);
    }
  }
  return failures > 0 ? 1 : 0;
}
