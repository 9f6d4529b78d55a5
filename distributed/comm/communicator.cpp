// communicator.cpp: element types and the argument checks every backend shares (see communicator.h).
#include "comm/communicator.h"

namespace moe::dist {

size_t element_size(DataType type) {
  switch (type) {
    case DataType::uint8: return 1;
    case DataType::int32: return 4;
    case DataType::int64: return 8;
    case DataType::float32: return 4;
    case DataType::float64: return 8;
    case DataType::bfloat16: return 2;
  }
  throw std::invalid_argument("element_size: unknown DataType");
}

std::string_view to_string(DataType type) {
  switch (type) {
    case DataType::uint8: return "uint8";
    case DataType::int32: return "int32";
    case DataType::int64: return "int64";
    case DataType::float32: return "float32";
    case DataType::float64: return "float64";
    case DataType::bfloat16: return "bfloat16";
  }
  return "unknown";
}

void check_count(std::string_view what, int64_t count) {
  if (count < 0) {
    throw std::invalid_argument(std::string(what) + ": count = " + std::to_string(count) +
                                "; expected a count >= 0");
  }
}

void check_root(const Communicator& communicator, int root) {
  if (root < 0 || root >= communicator.size()) {
    throw std::invalid_argument("broadcast: root = " + std::to_string(root) + "; expected 0 <= root < R = " +
                                std::to_string(communicator.size()));
  }
}

void check_all_to_all_arguments(const Communicator& communicator, std::span<const int64_t> send_counts,
                                std::span<const int64_t> send_offsets,
                                std::span<const int64_t> recv_counts,
                                std::span<const int64_t> recv_offsets) {
  const size_t R = static_cast<size_t>(communicator.size());
  const std::span<const int64_t> arrays[] = {send_counts, send_offsets, recv_counts, recv_offsets};
  const char* names[] = {"send_counts", "send_offsets", "recv_counts", "recv_offsets"};
  for (int i = 0; i < 4; ++i) {
    if (arrays[i].size() != R) {
      throw std::invalid_argument(std::string("all_to_all_v: ") + names[i] + " has " +
                                  std::to_string(arrays[i].size()) + " entries; expected one per rank, R = " +
                                  std::to_string(R));
    }
    for (size_t p = 0; p < R; ++p) {
      if (arrays[i][p] < 0) {
        throw std::invalid_argument(std::string("all_to_all_v: ") + names[i] + "[" + std::to_string(p) +
                                    "] = " + std::to_string(arrays[i][p]) + "; expected >= 0");
      }
    }
  }
}

std::vector<int64_t> exclusive_prefix_sum(std::span<const int64_t> counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t p = 1; p < counts.size(); ++p) offsets[p] = offsets[p - 1] + counts[p - 1];
  return offsets;
}

}  // namespace moe::dist
