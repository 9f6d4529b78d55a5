// npy.cpp: NumPy .npy serialisation and a strict, crash-free parser (see npy.h).
//
// The file: 6 magic bytes "\x93NUMPY", major and minor version bytes, the header length
// (2 bytes little-endian in 1.0, 4 bytes in 2.0 / 3.0), then the header, a Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// padded with spaces and a final '\n' so the data starts at a multiple of 64 bytes, then the data.
#include "npy.h"

#include <cctype>
#include <limits>

#include "checked_size.h"  // checked_product
#include "file_io.h"       // write_file_atomically, read_file_capped

namespace moe {

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";

struct Dtype {
  std::string_view name;
  int64_t item_size;
};
constexpr Dtype kDtypes[] = {{"<f4", 4}, {"<f8", 8}, {"<i4", 4}, {"<i8", 8}, {"|u1", 1}, {"<u2", 2}};
constexpr std::string_view kDtypeList = "<f4, <f8, <i4, <i8, |u1, <u2";

// Element count in checked arithmetic (checked_size.h); -1 if a dimension is negative or the
// product does not fit.
int64_t checked_count(const std::vector<int64_t>& shape) { return checked_product(shape).value_or(-1); }

// A tiny parser for the one Python literal form numpy writes in the header.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& source) : text_(text), source_(source) {}

  void parse(std::string& descr, bool& fortran_order, std::vector<int64_t>& shape) {
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    for (;;) {
      skip_space();
      if (peek() == '}') break;
      const std::string key = parse_string();
      expect(':');
      if (key == "descr") {
        descr = parse_string();
        have_descr = true;
      } else if (key == "fortran_order") {
        fortran_order = parse_bool();
        have_order = true;
      } else if (key == "shape") {
        shape = parse_tuple();
        have_shape = true;
      } else {
        fail("unexpected key '" + key + "' (a .npy header has descr, fortran_order, shape)");
      }
      skip_space();
      if (peek() == ',') {
        ++position_;
        continue;
      }
      if (peek() != '}') fail("expected ',' or '}'");
    }
    ++position_;
    skip_space();
    if (position_ != text_.size()) fail("unexpected text after the header dict");
    if (!have_descr || !have_order || !have_shape) {
      fail("the header must have 'descr', 'fortran_order' and 'shape'");
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw RecordError(source_ + ": bad .npy header at byte " + std::to_string(position_) + ": " + what);
  }
  char peek() const { return position_ < text_.size() ? text_[position_] : '\0'; }
  void skip_space() {
    while (position_ < text_.size() && (text_[position_] == ' ' || text_[position_] == '\n' ||
                                        text_[position_] == '\t' || text_[position_] == '\r')) {
      ++position_;
    }
  }
  void expect(char c) {
    skip_space();
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++position_;
  }
  std::string parse_string() {
    skip_space();
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail("expected a quoted string");
    const size_t end = text_.find(quote, position_ + 1);
    if (end == std::string_view::npos) fail("unterminated string");
    std::string value(text_.substr(position_ + 1, end - position_ - 1));
    position_ = end + 1;
    return value;
  }
  bool parse_bool() {
    skip_space();
    if (text_.substr(position_, 4) == "True") {
      position_ += 4;
      return true;
    }
    if (text_.substr(position_, 5) == "False") {
      position_ += 5;
      return false;
    }
    fail("expected True or False");
  }
  std::vector<int64_t> parse_tuple() {
    std::vector<int64_t> values;
    expect('(');
    for (;;) {
      skip_space();
      if (peek() == ')') break;
      if (!std::isdigit(static_cast<unsigned char>(peek()))) fail("expected a dimension (an integer >= 0)");
      int64_t value = 0;
      while (std::isdigit(static_cast<unsigned char>(peek()))) {
        if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) fail("dimension too large");
        value = value * 10 + (peek() - '0');
        ++position_;
      }
      values.push_back(value);
      if (values.size() > 64) fail("more than 64 dimensions");
      skip_space();
      if (peek() == ',') {
        ++position_;
      } else if (peek() != ')') {
        fail("expected ',' or ')' in shape");
      }
    }
    ++position_;
    return values;
  }

  std::string_view text_;
  const std::string& source_;
  size_t position_ = 0;
};

}  // namespace

int64_t npy_item_size(std::string_view dtype) {
  for (const Dtype& known : kDtypes) {
    if (known.name == dtype) return known.item_size;
  }
  throw RecordError("unsupported .npy dtype '" + std::string(dtype) + "'; supported: " +
                    std::string(kDtypeList));
}

int64_t NpyArray::element_count() const { return checked_count(shape); }

std::string serialize_npy(const NpyArray& array) {
  const int64_t item_size = npy_item_size(array.dtype);
  const int64_t count = checked_count(array.shape);
  if (count < 0) throw RecordError("npy: invalid shape (a negative or overflowing dimension)");
  if (static_cast<uint64_t>(count) * static_cast<uint64_t>(item_size) != array.data.size()) {
    throw RecordError("npy: data holds " + std::to_string(array.data.size()) + " bytes but shape and dtype " +
                      array.dtype + " need " + std::to_string(count * item_size));
  }
  std::string header = "{'descr': '" + array.dtype + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < array.shape.size(); ++i) {
    header += std::to_string(array.shape[i]);
    if (i + 1 < array.shape.size() || array.shape.size() == 1) header += ",";  // (3,) is a 1-tuple
    if (i + 1 < array.shape.size()) header += " ";
  }
  header += "), }";
  // Pad so that magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  if (header.size() > 65535) throw RecordError("npy: header too long for format 1.0");

  std::string bytes(kMagic);
  bytes += '\x01';
  bytes += '\x00';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(array.data.data()), array.data.size());
  return bytes;
}

void write_npy(const std::filesystem::path& path, const NpyArray& array) {
  write_file_atomically(path, serialize_npy(array));
}

NpyArray parse_npy(std::string_view bytes, const std::string& source) {
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic) {
    throw RecordError(source + ": not a .npy file (bad magic; expected \\x93NUMPY)");
  }
  if (bytes.size() < 8) throw RecordError(source + ": truncated .npy file (no version bytes)");
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  if (minor != 0 || major < 1 || major > 3) {
    throw RecordError(source + ": unsupported .npy format version " + std::to_string(major) + "." +
                      std::to_string(minor) + "; supported: 1.0, 2.0, 3.0");
  }
  const size_t length_bytes = major == 1 ? 2 : 4;
  if (bytes.size() < 8 + length_bytes) throw RecordError(source + ": truncated .npy header length");
  uint64_t header_length = 0;
  for (size_t i = 0; i < length_bytes; ++i) {
    header_length |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
  }
  const uint64_t data_offset = 8 + length_bytes + header_length;
  if (data_offset > bytes.size()) {
    throw RecordError(source + ": truncated .npy header: it says " + std::to_string(header_length) +
                      " bytes but the file has " + std::to_string(bytes.size() - 8 - length_bytes));
  }

  NpyArray array;
  bool fortran_order = false;
  HeaderParser(bytes.substr(8 + length_bytes, header_length), source)
      .parse(array.dtype, fortran_order, array.shape);
  int64_t item_size = 0;
  try {
    item_size = npy_item_size(array.dtype);
  } catch (const RecordError& e) {
    throw RecordError(source + ": " + e.what());
  }
  if (fortran_order) {
    throw RecordError(source + ": fortran_order True is not supported (write the array C-contiguous, "
                               "e.g. np.ascontiguousarray)");
  }
  const int64_t count = checked_count(array.shape);
  const uint64_t available = bytes.size() - data_offset;
  if (count < 0 || static_cast<uint64_t>(count) > available / static_cast<uint64_t>(item_size)) {
    throw RecordError(source + ": .npy data is shorter than the shape says (" + std::to_string(available) +
                      " bytes present)");
  }
  const uint64_t expected = static_cast<uint64_t>(count) * static_cast<uint64_t>(item_size);
  if (available != expected) {
    throw RecordError(source + ": .npy data has " + std::to_string(available) + " bytes but shape and dtype " +
                      array.dtype + " need " + std::to_string(expected) + " (extra bytes at the end)");
  }
  array.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(data_offset), bytes.end());
  return array;
}

NpyArray read_npy(const std::filesystem::path& path, uint64_t max_bytes) {
  return parse_npy(read_file_capped(path, max_bytes), path.string());
}

}  // namespace moe
