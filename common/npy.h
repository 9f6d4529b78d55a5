// npy.h: write and read NumPy .npy files, the format every notebook opens with np.load(path).
//
// Tensors a lesson or test wants to look at are written as .npy (format version 1.0, little-endian,
// C order). Supported dtypes:
//   '<f4' float   '<f8' double   '<i4' int32_t   '<i8' int64_t   '|u1' uint8_t
//   '<u2' uint16_t, also used for bfloat16 as raw bits: numpy has no bfloat16, so a bf16 tensor
//         is stored as its 16-bit patterns; in Python: np.load(p).view(ml_dtypes.bfloat16), or
//         (np.load(p).astype(np.uint32) << 16).view(np.float32) for exact float32 values.
//
//   moe::write_npy("notebooks_data/x.npy", values, {T, D});   // std::vector<float> values [T, D]
//   moe::NpyArray x = moe::read_npy("notebooks_data/x.npy");
//   std::vector<float> back = x.values<float>();              // throws if the dtype is not '<f4'
//
// Writes are atomic (temp file + rename). The reader also reads format versions 2.0 and 3.0
// (numpy writes those only for huge headers) and rejects, with a moe::RecordError naming the file
// and the problem: bad magic, truncated header, an unsupported version or dtype, fortran_order
// True, and data shorter or longer than the shape says. It never crashes on arbitrary bytes.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "record_error.h"  // RecordError

namespace moe {

static_assert(std::endian::native == std::endian::little,
              "npy.h copies bytes as they are in memory: it assumes a little-endian host");

// The dtype string of a C++ element type ('<f4' for float, ...); fails to compile for others.
template <typename T>
constexpr std::string_view npy_dtype_of() {
  if constexpr (std::is_same_v<T, float>) return "<f4";
  else if constexpr (std::is_same_v<T, double>) return "<f8";
  else if constexpr (std::is_same_v<T, int32_t>) return "<i4";
  else if constexpr (std::is_same_v<T, int64_t>) return "<i8";
  else if constexpr (std::is_same_v<T, uint8_t>) return "|u1";
  else if constexpr (std::is_same_v<T, uint16_t>) return "<u2";  // also bfloat16 raw bits
  else static_assert(sizeof(T) == 0, "no .npy dtype for this element type");
}

// Bytes per element of a supported dtype string; throws RecordError for others.
int64_t npy_item_size(std::string_view dtype);

struct NpyArray {
  std::string dtype;           // one of the dtypes above
  std::vector<int64_t> shape;  // {} for a 0-d array (one element)
  std::vector<uint8_t> data;   // element_count() * item size bytes, C order, little-endian

  int64_t element_count() const;  // product of shape (1 for 0-d, 0 if any dimension is 0)

  // A copy of the elements as T; throws RecordError if T's dtype is not this array's.
  template <typename T>
  std::vector<T> values() const {
    if (dtype != npy_dtype_of<T>()) {
      throw RecordError("npy: asked for dtype " + std::string(npy_dtype_of<T>()) +
                        " but the array holds " + dtype);
    }
    std::vector<T> out(data.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), data.data(), out.size() * sizeof(T));
    return out;
  }
};

// An NpyArray from typed values; throws RecordError if values.size() != product of shape.
template <typename T>
NpyArray make_npy(const std::vector<T>& values, std::vector<int64_t> shape) {
  NpyArray array{std::string(npy_dtype_of<T>()), std::move(shape), {}};
  if (array.element_count() != static_cast<int64_t>(values.size())) {
    throw RecordError("npy: " + std::to_string(values.size()) + " values do not fill shape of " +
                      std::to_string(array.element_count()) + " elements");
  }
  array.data.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(array.data.data(), values.data(), array.data.size());
  return array;
}

// The whole file's bytes: magic, version 1.0, header padded to 64 bytes, data.
std::string serialize_npy(const NpyArray& array);
void write_npy(const std::filesystem::path& path, const NpyArray& array);

template <typename T>
void write_npy(const std::filesystem::path& path, const std::vector<T>& values, std::vector<int64_t> shape) {
  write_npy(path, make_npy(values, std::move(shape)));
}

// Parses a whole .npy file from memory; `source` names it in error messages.
NpyArray parse_npy(std::string_view bytes, const std::string& source = "<memory>");
// Reads a .npy file; files over max_bytes (default 4 GiB) are refused.
NpyArray read_npy(const std::filesystem::path& path, uint64_t max_bytes = uint64_t{4} << 30);

}  // namespace moe
