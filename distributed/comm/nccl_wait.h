// nccl_wait.h: the host's wait for NCCL work, under the watchdog (watchdog.h).
//
// NCCL enqueues a collective on a stream and returns at once, so a peer that died or stopped does not
// show where the collective is called: it shows where the host waits for that stream, and
// cudaStreamSynchronize then never returns (the NCCL kernel spins, waiting for data that never
// comes). wait_for waits by polling instead, so that it can also look at NCCL's own view:
//   - cudaStreamQuery / cudaEventQuery: done, still running, or a CUDA error (thrown);
//   - ncclCommGetAsyncError between polls: NCCL reports a peer's closed connection or a network error
//     there, asynchronously; the watchdog then ends the process at once (its abort hooks call
//     ncclCommAbort, which also stops the spinning kernel), without waiting for the timeout;
//   - the wait is armed on the watchdog with `what`, so a wait past the timeout (a peer stopped, its
//     connection still open) ends the process with the watchdog's line.
// A wait that finds the work already done arms nothing: one query, as cheap as the synchronise.
// The first polls spin (a wait of a few microseconds costs no sleep), later ones sleep 50 us.
//
// Every host wait on NCCL work goes through here: NcclCommunicator::wait and barrier, and the
// device exchange's read-backs (device_exchange.cpp: DeviceExchange::wait, the NCCL host adapter).
//   mpirun -np 2 build/tests/distributed/test_distributed_nccl_communicator     (one GPU per rank)
#pragma once

#include <cuda_runtime.h>  // cudaStream_t, cudaEvent_t
#include <nccl.h>          // ncclComm_t

#include <string_view>

#include "comm/watchdog.h"  // CollectiveWatchdog

namespace moe::dist {

// Returns once every piece of work enqueued on `stream` so far has completed. `communicator`: the
// NCCL communicator whose work the stream carries (its asynchronous errors are checked), or null.
// `watchdog`: arms the wait and ends the process on an asynchronous error; null: no deadline, and an
// asynchronous error is thrown as std::runtime_error (the communicator must then be aborted, which
// NcclCommunicator's destructor does when it finds the error).
void wait_for(cudaStream_t stream, std::string_view what, ncclComm_t communicator, CollectiveWatchdog* watchdog);

// The same for the work recorded before `event` (cudaEventRecord).
void wait_for(cudaEvent_t event, std::string_view what, ncclComm_t communicator, CollectiveWatchdog* watchdog);

}  // namespace moe::dist
