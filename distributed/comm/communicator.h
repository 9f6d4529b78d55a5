// communicator.h: the collectives that expert parallelism needs, as one small interface with one
// backend per transport. One process per rank (`mpirun -np R program`); every call is collective
// over the communicator's ranks, in the same order on every rank.
//
//   all_to_all_v   FastMoE's token exchange: each rank sends a different number of rows to each peer
//   all_reduce_sum gradients of replicated parameters (the router, and the dense model around it)
//   all_gather     the R x E routing counts; token counts per rank
//   broadcast      settings and seeds from rank 0 (and, for NCCL, its unique id)
//   barrier        the end of a phase
//   split          sub-groups: Tutel's "nodes" of G ranks for the 2D hierarchical all-to-all
//
// Backends (one file each):
//   mpi_communicator.h   MPI over host buffers: CPU-only ranks, and several ranks sharing one GPU
//                        (NCCL refuses two ranks on one device: "Duplicate GPU detected")
//   nccl_communicator.h  NCCL over device buffers, enqueued on the stream the communicator holds
//                        (built where CMake finds CUDA and NCCL; the same calls, so a layer written
//                        against this interface runs on either)
// Buffers are raw pointers because they live in host memory for one backend and device memory for
// the other; counts, offsets and roots are always host values. Counts and offsets are in elements
// of `type`, never bytes, as in MPI and NCCL.
//
// Argument errors (a negative count, spans of the wrong length) are thrown as std::invalid_argument
// before any communication, on the rank that made them; a peer that made no error then waits in
// the collective. Checks that must fail on every rank together live in rank_agreement.h.
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k,
// C capacity, B block size, L layers, R ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace moe::dist {

// Element types of the collectives: those of NCCL's ncclDataType_t that the project moves.
// bfloat16 is carried as its raw 16-bit pattern (uint16_t on the host, as in common/npy.h); its
// sum rounds each partial sum to bf16, to nearest even, as NCCL does.
enum class DataType { uint8, int32, int64, float32, float64, bfloat16 };

size_t element_size(DataType type);
std::string_view to_string(DataType type);

// The DataType of a C++ element type: uint8_t, int32_t, int64_t, float, double, and uint16_t for
// bf16 bit patterns.
template <typename Element>
constexpr DataType data_type_of() {
  if constexpr (std::is_same_v<Element, uint8_t>) return DataType::uint8;
  else if constexpr (std::is_same_v<Element, int32_t>) return DataType::int32;
  else if constexpr (std::is_same_v<Element, int64_t>) return DataType::int64;
  else if constexpr (std::is_same_v<Element, float>) return DataType::float32;
  else if constexpr (std::is_same_v<Element, double>) return DataType::float64;
  else if constexpr (std::is_same_v<Element, uint16_t>) return DataType::bfloat16;
  else static_assert(sizeof(Element) == 0, "no DataType for this element type");
}

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;  // R
  virtual std::string_view backend() const = 0;  // "mpi", "nccl"

  // Rank p receives send_counts[p] elements from send + send_offsets[p]; this rank receives
  // recv_counts[p] elements from rank p at recv + recv_offsets[p]. All four arrays have size()
  // entries; a count may be 0. recv_counts[p] must equal what rank p sends here (the caller
  // learns it beforehand: FastMoE's count exchange).
  virtual void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                            std::span<const int64_t> send_offsets, void* recv,
                            std::span<const int64_t> recv_counts,
                            std::span<const int64_t> recv_offsets, DataType type) = 0;

  // recv[i] = sum over ranks of send[i], on every rank; send == recv works in place.
  virtual void all_reduce_sum(const void* send, void* recv, int64_t count, DataType type) = 0;

  // recv [size() * count]: rank p's `count` elements at recv + p * count, on every rank.
  // send == recv + rank() * count works in place.
  virtual void all_gather(const void* send, void* recv, int64_t count, DataType type) = 0;

  // root's `count` elements of buffer, copied into buffer on every other rank.
  virtual void broadcast(void* buffer, int64_t count, DataType type, int root) = 0;

  virtual void barrier() = 0;

  // Collective: ranks that pass the same color (>= 0) form one new communicator, ranked by key,
  // then by rank here. The new communicator is independent of this one (its own traffic).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  std::unique_ptr<Communicator> split(int color) { return split(color, rank()); }
};

// ---- argument checks shared by the backends ----

// Throws unless counts and offsets are size() long, counts >= 0 and offsets >= 0.
void check_all_to_all_arguments(const Communicator& communicator, std::span<const int64_t> send_counts,
                                std::span<const int64_t> send_offsets,
                                std::span<const int64_t> recv_counts,
                                std::span<const int64_t> recv_offsets);
void check_count(std::string_view what, int64_t count);
void check_root(const Communicator& communicator, int root);

// offsets[p] = counts[0] + ... + counts[p-1]: the packed layout, peer after peer.
std::vector<int64_t> exclusive_prefix_sum(std::span<const int64_t> counts);

// ---- typed calls over host spans (bounds checked) ----

// Packed or not: each peer's block is [offset, offset + count) of its span, checked to fit.
template <typename Element>
void all_to_all_v(Communicator& communicator, std::span<const Element> send,
                  std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                  std::span<Element> recv, std::span<const int64_t> recv_counts,
                  std::span<const int64_t> recv_offsets) {
  check_all_to_all_arguments(communicator, send_counts, send_offsets, recv_counts, recv_offsets);
  for (size_t p = 0; p < send_counts.size(); ++p) {
    if (send_offsets[p] + send_counts[p] > static_cast<int64_t>(send.size()) ||
        recv_offsets[p] + recv_counts[p] > static_cast<int64_t>(recv.size())) {
      throw std::invalid_argument("all_to_all_v: the block of peer " + std::to_string(p) +
                                  " runs past the end of the send or receive span");
    }
  }
  communicator.all_to_all_v(send.data(), send_counts, send_offsets, recv.data(), recv_counts,
                            recv_offsets, data_type_of<Element>());
}

template <typename Element>
void all_reduce_sum(Communicator& communicator, std::span<Element> data) {  // in place
  communicator.all_reduce_sum(data.data(), data.data(), static_cast<int64_t>(data.size()),
                              data_type_of<Element>());
}

// Every rank's `mine`, rank after rank; every rank passes the same number of elements.
template <typename Element>
std::vector<Element> all_gather(Communicator& communicator, std::span<const Element> mine) {
  std::vector<Element> all(mine.size() * static_cast<size_t>(communicator.size()));
  communicator.all_gather(mine.data(), all.data(), static_cast<int64_t>(mine.size()),
                          data_type_of<Element>());
  return all;
}

template <typename Element>
std::vector<Element> all_gather(Communicator& communicator, const Element& mine) {
  return all_gather(communicator, std::span<const Element>(&mine, 1));
}

template <typename Element>
void broadcast(Communicator& communicator, std::span<Element> data, int root) {
  communicator.broadcast(data.data(), static_cast<int64_t>(data.size()), data_type_of<Element>(), root);
}

}  // namespace moe::dist
