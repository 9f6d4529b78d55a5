// safetensors.cpp: the safetensors format, written atomically and read with every check (see
// safetensors.h).
#include "safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "checked_size.h"    // checked_product, checked_multiply
#include "file_io.h"         // AtomicFileWriter
#include "untrusted_json.h"  // parse_untrusted_json, json_excerpt

namespace moe {

// The data section is copied to and from memory as it is: both ends must be little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; this host is not");

namespace {

// The reference implementation's limit on the header: a length beyond it is a corrupt file, not a
// header worth allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  Dtype dtype;
  std::string_view name;
  size_t size;
};
constexpr DtypeName kDtypes[] = {
    {Dtype::boolean, "BOOL", 1}, {Dtype::u8, "U8", 1},   {Dtype::i8, "I8", 1},     {Dtype::f8_e5m2, "F8_E5M2", 1},
    {Dtype::f8_e4m3, "F8_E4M3", 1}, {Dtype::i16, "I16", 2}, {Dtype::u16, "U16", 2}, {Dtype::f16, "F16", 2},
    {Dtype::bf16, "BF16", 2},    {Dtype::i32, "I32", 4}, {Dtype::u32, "U32", 4},   {Dtype::f32, "F32", 4},
    {Dtype::i64, "I64", 8},      {Dtype::u64, "U64", 8}, {Dtype::f64, "F64", 8},
};

[[noreturn]] void fail(const std::string& source, const std::string& message) {
  throw SafetensorsError(source + ": " + message);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// elements(shape) x size in bytes, or nothing when it does not fit in 63 bits (checked_size.h).
std::optional<uint64_t> byte_count(const std::vector<int64_t>& shape, size_t size) {
  const std::optional<int64_t> elements = checked_product(shape);
  const std::optional<int64_t> bytes = elements ? checked_multiply(*elements, static_cast<int64_t>(size)) : std::nullopt;
  if (!bytes) return std::nullopt;
  return static_cast<uint64_t>(*bytes);
}

// ---- the header ----

// "<8-byte length><JSON, padded with spaces to a multiple of 8>" for these tensors, back to back.
std::string encode_header(const std::vector<TensorView>& tensors, const std::map<std::string, std::string>& metadata,
                          const std::string& source) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorView& tensor : tensors) {
    const std::string label = "tensor '" + tensor.name + "'";
    if (tensor.name.empty()) fail(source, "a tensor has an empty name");
    if (tensor.name == "__metadata__") fail(source, "'__metadata__' is reserved for the metadata");
    if (!names.insert(tensor.name).second) fail(source, "two tensors are named '" + tensor.name + "'");
    for (int64_t extent : tensor.shape) {
      if (extent < 0) fail(source, label + " has shape " + shape_text(tensor.shape) + " with a negative extent");
    }
    const std::optional<uint64_t> bytes = byte_count(tensor.shape, dtype_size(tensor.dtype));
    if (!bytes || *bytes != tensor.bytes.size()) {
      fail(source, label + " has " + std::to_string(tensor.bytes.size()) + " bytes; " +
                                     std::string(to_string(tensor.dtype)) + " x shape " + shape_text(tensor.shape) +
                                     " needs " + (bytes ? std::to_string(*bytes) : "more than 2^63 - 1"));
    }
    header[tensor.name] = {{"dtype", std::string(to_string(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + *bytes}}};
    offset += *bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& error) {
    fail(source, std::string("a name or metadata entry is not valid UTF-8: ") + error.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string out(8, '\0');
  const uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);
  return out + text;
}

TensorInfo parse_entry(const std::string& source, const std::string& name, const nlohmann::json& entry) {
  const std::string label = "tensor '" + name + "'";
  if (!entry.is_object()) {
    fail(source, label + " is " + json_excerpt(entry) + "; expected an object with dtype, shape, data_offsets");
  }
  TensorInfo info;
  info.name = name;
  if (!entry.contains("dtype") || !entry["dtype"].is_string()) fail(source, label + " has no dtype string");
  try {
    info.dtype = parse_dtype(entry["dtype"].get<std::string>());
  } catch (const SafetensorsError& error) {
    fail(source, label + ": " + error.what());
  }
  if (!entry.contains("shape") || !entry["shape"].is_array()) fail(source, label + " has no shape array");
  for (const nlohmann::json& extent : entry["shape"]) {
    if (!extent.is_number_unsigned()) {
      fail(source, label + " has shape " + json_excerpt(entry["shape"]) + "; expected integers >= 0");
    }
    info.shape.push_back(extent.get<int64_t>());
  }
  const nlohmann::json& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : nlohmann::json();
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
    fail(source, label + " has data_offsets " + json_excerpt(offsets) + "; expected [begin, end], integers >= 0");
  }
  info.begin = offsets[0].get<uint64_t>();
  info.end = offsets[1].get<uint64_t>();
  if (info.end < info.begin) fail(source, label + " has data_offsets " + json_excerpt(offsets) + " with end before begin");
  const std::optional<uint64_t> bytes = byte_count(info.shape, dtype_size(info.dtype));
  if (!bytes || *bytes != info.end - info.begin) {
    fail(source, label + " has data_offsets " + json_excerpt(offsets) + " (" + std::to_string(info.end - info.begin) + " bytes); " +
                     std::string(to_string(info.dtype)) + " x shape " + shape_text(info.shape) + " needs " +
                     (bytes ? std::to_string(*bytes) : "more than 2^63 - 1") + " bytes");
  }
  return info;
}

// ---- conversions ----

double half_to_double(uint16_t bits) {  // IEEE 754 binary16
  const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double value;
  if (exponent == 0) {
    value = std::ldexp(mantissa, -24);  // subnormal
  } else if (exponent == 0x1f) {
    value = mantissa ? std::nan("") : INFINITY;
  } else {
    value = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -value : value;
}

double bfloat16_to_double(uint16_t bits) {  // the top half of a float32
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  return std::bit_cast<float>(widened);
}

template <typename T>
T read_as(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

template <typename T>
TensorView typed_view(std::string name, std::vector<int64_t> shape, std::span<const T> values, Dtype dtype) {
  return {std::move(name), dtype, std::move(shape), std::as_bytes(values)};
}

}  // namespace

// ---- dtypes ----

std::string_view to_string(Dtype dtype) {
  for (const DtypeName& entry : kDtypes) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "unknown";
}

Dtype parse_dtype(std::string_view name) {
  for (const DtypeName& entry : kDtypes) {
    if (entry.name == name) return entry.dtype;
  }
  std::string known;
  for (const DtypeName& entry : kDtypes) known += (known.empty() ? "" : ", ") + std::string(entry.name);
  throw SafetensorsError("unknown dtype '" + std::string(name) + "'; known: " + known);
}

size_t dtype_size(Dtype dtype) {
  for (const DtypeName& entry : kDtypes) {
    if (entry.dtype == dtype) return entry.size;
  }
  return 0;
}

int64_t TensorInfo::elements() const {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

// ---- writing ----

TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const float> values) {
  return typed_view(std::move(name), std::move(shape), values, Dtype::f32);
}
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const double> values) {
  return typed_view(std::move(name), std::move(shape), values, Dtype::f64);
}
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const int32_t> values) {
  return typed_view(std::move(name), std::move(shape), values, Dtype::i32);
}
TensorView tensor_view(std::string name, std::vector<int64_t> shape, std::span<const int64_t> values) {
  return typed_view(std::move(name), std::move(shape), values, Dtype::i64);
}

std::string encode_safetensors(const std::vector<TensorView>& tensors, const std::map<std::string, std::string>& metadata) {
  std::string out = encode_header(tensors, metadata, "encode_safetensors");
  for (const TensorView& tensor : tensors) {
    out.append(reinterpret_cast<const char*>(tensor.bytes.data()), tensor.bytes.size());
  }
  return out;
}

void save_safetensors(const std::filesystem::path& path, const std::vector<TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata, const SafetensorsWriteOptions& options) {
  const std::string header = encode_header(tensors, metadata, path.string());
  try {
    AtomicFileWriter file(path, options.fail_after_bytes);
    file.write(header.data(), header.size());
    for (const TensorView& tensor : tensors) file.write(tensor.bytes.data(), tensor.bytes.size());
    file.commit();
  } catch (const FileWriteError& error) {
    throw SafetensorsError(error.what());
  }
}

// ---- reading ----

SafetensorsFile SafetensorsFile::load(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) fail(path.string(), "no such file");
  const uint64_t size = std::filesystem::file_size(path, error);
  if (error) fail(path.string(), "cannot read its size: " + error.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path.string(), std::string("cannot open: ") + std::strerror(errno));
  std::string bytes(size, '\0');
  if (!in.read(bytes.data(), static_cast<std::streamsize>(size))) fail(path.string(), "read failed");
  return parse(std::move(bytes), path.string());
}

SafetensorsFile SafetensorsFile::parse(std::string bytes, std::string source) {
  SafetensorsFile file;
  file.source_ = std::move(source);
  file.file_ = std::move(bytes);
  const std::string& s = file.source_;
  const uint64_t size = file.file_.size();
  if (size < 8) {
    fail(s, "is " + std::to_string(size) + " bytes long; a safetensors file starts with an 8-byte header length");
  }
  uint64_t header_length = 0;
  std::memcpy(&header_length, file.file_.data(), 8);
  if (header_length > kMaxHeaderBytes) {
    fail(s, "header length " + std::to_string(header_length) + " is beyond the format's limit of " +
                std::to_string(kMaxHeaderBytes) + " bytes (not a safetensors file, or a corrupt one)");
  }
  if (header_length > size - 8) {
    fail(s, "the header claims " + std::to_string(header_length) + " bytes, but only " + std::to_string(size - 8) +
                " follow its length (truncated file?)");
  }
  file.data_start_ = 8 + header_length;
  const uint64_t data_size = size - file.data_start_;

  nlohmann::json header;
  const std::string why = parse_untrusted_json(std::string_view(file.file_.data() + 8, static_cast<size_t>(header_length)), header);
  if (!why.empty()) fail(s, "header: " + why);
  if (!header.is_object()) fail(s, "header is JSON but not an object: " + json_excerpt(header, 80));

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(s, "__metadata__ is " + json_excerpt(entry) + "; expected an object of strings");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) fail(s, "__metadata__ entry '" + key + "' is " + json_excerpt(value) + "; expected a string");
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    TensorInfo info = parse_entry(s, name, entry);
    if (info.end > data_size) {
      fail(s, "tensor '" + name + "' has data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                  "] out of range: the data section has " + std::to_string(data_size) + " bytes");
    }
    file.tensors_.push_back(std::move(info));
  }

  // In data order, every byte of the data section in exactly one tensor.
  std::sort(file.tensors_.begin(), file.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : file.tensors_) {
    if (info.begin < covered) {
      fail(s, "tensors '" + previous->name + "' [" + std::to_string(previous->begin) + ", " +
                  std::to_string(previous->end) + ") and '" + info.name + "' [" + std::to_string(info.begin) + ", " +
                  std::to_string(info.end) + ") overlap");
    }
    if (info.begin > covered) {
      fail(s, "bytes [" + std::to_string(covered) + ", " + std::to_string(info.begin) +
                  ") of the data section belong to no tensor (the format allows no holes)");
    }
    covered = info.end;
    if (info.end > info.begin) previous = &info;
  }
  if (covered != data_size) {
    fail(s, "bytes [" + std::to_string(covered) + ", " + std::to_string(data_size) +
                ") of the data section belong to no tensor (the format allows no holes)");
  }
  return file;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors_.begin(), tensors_.end(), [&](const TensorInfo& info) { return info.name == name; });
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  for (const TensorInfo& info : tensors_) {
    if (info.name == name) return info;
  }
  fail(source_, "has no tensor named '" + name + "'");
}

std::span<const std::byte> SafetensorsFile::bytes(const std::string& name) const {
  const TensorInfo& tensor = info(name);
  const auto* data = reinterpret_cast<const std::byte*>(file_.data()) + data_start_;
  return {data + tensor.begin, data + tensor.end};
}

std::vector<double> SafetensorsFile::to_double(const std::string& name) const {
  const TensorInfo& tensor = info(name);
  const std::span<const std::byte> raw = bytes(name);
  const size_t size = dtype_size(tensor.dtype);
  std::vector<double> values(static_cast<size_t>(tensor.elements()));
  for (size_t i = 0; i < values.size(); ++i) {
    const std::byte* p = raw.data() + i * size;
    switch (tensor.dtype) {
      case Dtype::boolean: values[i] = read_as<uint8_t>(p) != 0; break;
      case Dtype::u8: values[i] = read_as<uint8_t>(p); break;
      case Dtype::i8: values[i] = read_as<int8_t>(p); break;
      case Dtype::i16: values[i] = read_as<int16_t>(p); break;
      case Dtype::u16: values[i] = read_as<uint16_t>(p); break;
      case Dtype::f16: values[i] = half_to_double(read_as<uint16_t>(p)); break;
      case Dtype::bf16: values[i] = bfloat16_to_double(read_as<uint16_t>(p)); break;
      case Dtype::i32: values[i] = read_as<int32_t>(p); break;
      case Dtype::u32: values[i] = read_as<uint32_t>(p); break;
      case Dtype::f32: values[i] = read_as<float>(p); break;
      case Dtype::i64: values[i] = static_cast<double>(read_as<int64_t>(p)); break;
      case Dtype::u64: values[i] = static_cast<double>(read_as<uint64_t>(p)); break;
      case Dtype::f64: values[i] = read_as<double>(p); break;
      case Dtype::f8_e5m2:
      case Dtype::f8_e4m3:
        fail(source_, "tensor '" + name + "' is " + std::string(to_string(tensor.dtype)) +
                          "; 8-bit floats are read as bytes only (SafetensorsFile::bytes)");
    }
  }
  return values;
}

std::vector<float> SafetensorsFile::to_float(const std::string& name) const {
  const std::vector<double> values = to_double(name);
  return {values.begin(), values.end()};
}

}  // namespace moe
