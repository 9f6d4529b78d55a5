// mpi_communicator.cpp: the MPI backend over host buffers (see mpi_communicator.h).
#include "comm/mpi_communicator.h"

#include <climits>
#include <cstring>
#include <vector>

namespace moe::dist {

namespace {

void check_mpi(int code, std::string_view call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string(call) + " failed: " + std::string(text, static_cast<size_t>(length)));
}

// MPI counts and displacements are C ints (OpenMPI 4.1 has no large-count MPI_Alltoallv_c).
int as_mpi_int(int64_t value, std::string_view what) {
  if (value > INT_MAX) {
    throw std::invalid_argument(std::string(what) + " = " + std::to_string(value) +
                                " elements; the MPI backend takes at most INT_MAX (2^31 - 1) per call");
  }
  return static_cast<int>(value);
}

std::vector<int> as_mpi_ints(std::span<const int64_t> values, std::string_view what) {
  std::vector<int> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = as_mpi_int(values[i], what);
  return out;
}

// bf16 travels as MPI_UINT16_T; only the sum needs to know that the bits are a number.
MPI_Datatype mpi_type(DataType type) {
  switch (type) {
    case DataType::uint8: return MPI_UINT8_T;
    case DataType::int32: return MPI_INT32_T;
    case DataType::int64: return MPI_INT64_T;
    case DataType::float32: return MPI_FLOAT;
    case DataType::float64: return MPI_DOUBLE;
    case DataType::bfloat16: return MPI_UINT16_T;
  }
  throw std::invalid_argument("mpi_type: unknown DataType");
}

float bfloat16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

uint16_t float_to_bfloat16(float value) {  // round to nearest, ties to even; NaN stays NaN
  uint32_t word;
  std::memcpy(&word, &value, sizeof word);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x0040u);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

// inout[i] = bf16(float(in[i]) + float(inout[i])): each partial sum rounded to bf16, as NCCL does.
void bfloat16_sum(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = float_to_bfloat16(bfloat16_to_float(a[i]) + bfloat16_to_float(b[i]));
}

// inout[i] = in[i] + inout[i] modulo 256, as C and NCCL add bytes. OpenMPI 4.1's vectorised MPI_SUM
// (its "avx" op component) saturates 8-bit integers instead: 250 + 250 gives 255 once a buffer is
// long enough to take the vector path (OpenMPI 4.1.4, 64 elements).
void uint8_sum(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const uint8_t*>(in);
  auto* b = static_cast<uint8_t*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = static_cast<uint8_t>(a[i] + b[i]);
}

}  // namespace

// ---- environment ----

MpiEnvironment::MpiEnvironment(int& argc, char**& argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) throw std::logic_error("MpiEnvironment: MPI is already initialised in this process");
  // FUNNELED, not SINGLE: the watchdog's thread exists, though it never calls MPI.
  int provided = MPI_THREAD_SINGLE;
  check_mpi(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
}

MpiEnvironment::~MpiEnvironment() { MPI_Finalize(); }

int MpiEnvironment::world_rank() const {
  int rank = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  return rank;
}

int MpiEnvironment::world_size() const {
  int size = 1;
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  return size;
}

// ---- communicator ----

std::unique_ptr<MpiCommunicator> MpiCommunicator::world(CollectiveWatchdog* watchdog) {
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, watchdog);
}

MpiCommunicator::MpiCommunicator(MPI_Comm communicator, CollectiveWatchdog* watchdog) : watchdog_(watchdog) {
  MPI_Comm duplicate = MPI_COMM_NULL;
  {
    const auto armed = arm(watchdog_, "MPI_Comm_dup");  // collective: waits for every rank
    check_mpi(MPI_Comm_dup(communicator, &duplicate), "MPI_Comm_dup");
  }
  adopt(duplicate);
}

MpiCommunicator::MpiCommunicator(MPI_Comm owned, CollectiveWatchdog* watchdog, Adopt) : watchdog_(watchdog) {
  adopt(owned);
}

void MpiCommunicator::adopt(MPI_Comm owned) {
  communicator_ = owned;
  check_mpi(MPI_Comm_rank(communicator_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(communicator_, &size_), "MPI_Comm_size");
  check_mpi(MPI_Op_create(&bfloat16_sum, /*commute=*/1, &bfloat16_sum_), "MPI_Op_create");
  check_mpi(MPI_Op_create(&uint8_sum, /*commute=*/1, &uint8_sum_), "MPI_Op_create");
}

MpiCommunicator::~MpiCommunicator() {
  if (bfloat16_sum_ != MPI_OP_NULL) MPI_Op_free(&bfloat16_sum_);
  if (uint8_sum_ != MPI_OP_NULL) MPI_Op_free(&uint8_sum_);
  if (communicator_ != MPI_COMM_NULL) MPI_Comm_free(&communicator_);
}

void MpiCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                   std::span<const int64_t> send_offsets, void* recv,
                                   std::span<const int64_t> recv_counts,
                                   std::span<const int64_t> recv_offsets, DataType type) {
  check_all_to_all_arguments(*this, send_counts, send_offsets, recv_counts, recv_offsets);
  const std::vector<int> sc = as_mpi_ints(send_counts, "all_to_all_v: send count");
  const std::vector<int> so = as_mpi_ints(send_offsets, "all_to_all_v: send offset");
  const std::vector<int> rc = as_mpi_ints(recv_counts, "all_to_all_v: receive count");
  const std::vector<int> ro = as_mpi_ints(recv_offsets, "all_to_all_v: receive offset");
  const auto armed = arm(watchdog_, "all_to_all_v (MPI_Alltoallv)");
  check_mpi(MPI_Alltoallv(send, sc.data(), so.data(), mpi_type(type), recv, rc.data(), ro.data(),
                          mpi_type(type), communicator_),
            "MPI_Alltoallv");
}

void MpiCommunicator::all_reduce_sum(const void* send, void* recv, int64_t count, DataType type) {
  check_count("all_reduce_sum", count);
  const MPI_Op op = type == DataType::bfloat16 ? bfloat16_sum_ : type == DataType::uint8 ? uint8_sum_ : MPI_SUM;
  const void* source = send == recv ? MPI_IN_PLACE : send;
  const auto armed = arm(watchdog_, "all_reduce_sum (MPI_Allreduce)");
  check_mpi(MPI_Allreduce(source, recv, as_mpi_int(count, "all_reduce_sum: count"), mpi_type(type), op,
                          communicator_),
            "MPI_Allreduce");
}

void MpiCommunicator::all_gather(const void* send, void* recv, int64_t count, DataType type) {
  check_count("all_gather", count);
  const int n = as_mpi_int(count, "all_gather: count");
  as_mpi_int(count * size_, "all_gather: count * R");
  // In place when this rank's block already sits where it belongs in recv (MPI wants MPI_IN_PLACE).
  const auto* own_block = static_cast<const char*>(recv) + static_cast<size_t>(rank_) * count * element_size(type);
  const void* source = send == own_block ? MPI_IN_PLACE : send;
  const auto armed = arm(watchdog_, "all_gather (MPI_Allgather)");
  check_mpi(MPI_Allgather(source, n, mpi_type(type), recv, n, mpi_type(type), communicator_), "MPI_Allgather");
}

void MpiCommunicator::broadcast(void* buffer, int64_t count, DataType type, int root) {
  check_count("broadcast", count);
  check_root(*this, root);
  const auto armed = arm(watchdog_, "broadcast (MPI_Bcast)");
  check_mpi(MPI_Bcast(buffer, as_mpi_int(count, "broadcast: count"), mpi_type(type), root, communicator_),
            "MPI_Bcast");
}

void MpiCommunicator::barrier() {
  const auto armed = arm(watchdog_, "barrier (MPI_Barrier)");
  check_mpi(MPI_Barrier(communicator_), "MPI_Barrier");
}

MpiCommunicator::HostRank MpiCommunicator::host_rank() const {
  MPI_Comm local = MPI_COMM_NULL;
  MPI_Comm_split_type(communicator_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
  HostRank place;
  MPI_Comm_rank(local, &place.rank);
  MPI_Comm_size(local, &place.ranks);
  MPI_Comm_free(&local);
  return place;
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  if (color < 0) {
    throw std::invalid_argument("split: color = " + std::to_string(color) + "; expected a color >= 0");
  }
  MPI_Comm part = MPI_COMM_NULL;
  {
    const auto armed = arm(watchdog_, "split (MPI_Comm_split)");
    check_mpi(MPI_Comm_split(communicator_, color, key, &part), "MPI_Comm_split");
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(part, watchdog_, Adopt{}));
}

}  // namespace moe::dist
