// safetensors.h: read and write the safetensors format (Hugging Face), the file of named tensors
// that PyTorch, JAX, numpy and the inference engines all read: a JSON header and the raw tensors.
// Model weights for inference travel in it (reference_cpu/model_safetensors.h).
//
// The format, all integers little-endian:
//   N        8 bytes, uint64: the header's length in bytes
//   header   N bytes of UTF-8 JSON, one object:
//              {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//               "__metadata__": {"<key>": "<string value>", ...}}          (optional)
//            begin and end are byte offsets into the data section; end - begin is exactly
//            elements(shape) x the dtype's size; a shape of [] is a scalar.
//   data     the tensors' bytes, row-major, little-endian. Every byte belongs to exactly one
//            tensor: no overlaps, no holes, nothing after the last tensor (the format forbids
//            holes so that a file cannot hide a second payload).
// The writer puts the tensors in the order given, back to back, and pads the header with spaces
// so that the data starts at a multiple of 8 bytes, as the reference implementation does.
//
// Reading checks all of the above and throws SafetensorsError naming the file and the fault:
// shorter than 8 bytes or than the header claims, a header that is not JSON (or not an object),
// an unknown dtype, a shape or data_offsets of the wrong form, offsets outside the data section,
// overlapping, leaving holes or not matching dtype x shape, and a lookup of a missing tensor.
//
//   moe::save_safetensors("w.safetensors", {moe::tensor_view("w", {2, 3}, std::span<const float>(v))},
//                         {{"format", "pt"}});
//   moe::SafetensorsFile file = moe::SafetensorsFile::load("w.safetensors");
//   std::vector<double> w = file.to_double("w");   // any floating or integer dtype, converted
//   cmake --build build --target moe_common   (tests: ctest --test-dir build -R Safetensors)
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// The one error type of safetensors reading and writing; the message names the file and the fault.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The format's dtypes. Every one can be read, written and looked up as bytes; to_double converts
// all but the two 8-bit floats.
enum class Dtype { boolean, u8, i8, f8_e5m2, f8_e4m3, i16, u16, f16, bf16, i32, u32, f32, i64, u64, f64 };

std::string_view to_string(Dtype dtype);  // the header's name: "F32", "BF16", "BOOL", ...
// Throws SafetensorsError listing the known names when `name` is none of them.
Dtype parse_dtype(std::string_view name);
size_t dtype_size(Dtype dtype);  // bytes per element

// ---- writing ----

// One tensor to write: a view of its bytes, so weights are not copied before writing.
struct TensorView {
  std::string name;
  Dtype dtype = Dtype::f32;
  std::vector<int64_t> shape;       // [] for a scalar
  std::span<const std::byte> bytes; // elements(shape) x dtype_size(dtype), row-major, little-endian
};

// Views of typed arrays, with the dtype that matches the element type.
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const float> values);
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const double> values);
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const int32_t> values);
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const int64_t> values);

// The whole file as bytes. Names must be unique, non-empty and not "__metadata__"; each view's size
// must match its dtype and shape. Throws SafetensorsError naming the tensor otherwise.
std::string encode_safetensors(const std::vector<TensorView>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

// For the tests: make a save fail part-way, as a full disk or a crash would.
struct SafetensorsWriteOptions {
  std::optional<uint64_t> fail_after_bytes;  // throw after this many bytes of the temporary file
};

// Writes "<path>.tmp" in the same directory, fsyncs it, renames it over <path> and fsyncs the
// directory: a reader sees the old file or the new one, never half of one. On failure the
// temporary file is removed, <path> is untouched, and SafetensorsError is thrown.
void save_safetensors(const std::filesystem::path& path, const std::vector<TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      const SafetensorsWriteOptions& options = {});

// ---- reading ----

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
  int64_t elements() const;  // the product of shape (1 for a scalar)
};

class SafetensorsFile {
 public:
  // Reads and checks the whole file.
  static SafetensorsFile load(const std::filesystem::path& path);
  // Checks bytes already in memory; `source` names them in errors.
  static SafetensorsFile parse(std::string bytes, std::string source);

  const std::string& source() const { return source_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
  bool contains(const std::string& name) const;

  // Throw SafetensorsError "<source> has no tensor named <name>" for a missing tensor.
  const TensorInfo& info(const std::string& name) const;
  std::span<const std::byte> bytes(const std::string& name) const;
  // The values converted to double (to float): every dtype but F8_E5M2 and F8_E4M3. 64-bit
  // integers beyond 2^53 lose their low bits, as any conversion to double does.
  std::vector<double> to_double(const std::string& name) const;
  std::vector<float> to_float(const std::string& name) const;

 private:
  std::string source_;
  std::string file_;          // every byte of the file
  uint64_t data_start_ = 0;   // 8 + N
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
};

}  // namespace moe
