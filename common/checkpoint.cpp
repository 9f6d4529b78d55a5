// checkpoint.cpp: the checkpoint file format, written through AtomicFileWriter (file_io.h), and its
// validation (see checkpoint.h).
#include "checkpoint.h"

#include <algorithm>
#include <limits>
#include <bit>
#include <cerrno>
#include <cstdio>  // snprintf
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "file_io.h"  // AtomicFileWriter
#include "untrusted_json.h"  // parse_untrusted_json, json_excerpt

namespace moe {

// The arrays are written as the host's float32 bytes; the format says little-endian.
static_assert(std::endian::native == std::endian::little, "checkpoint format is little-endian");

namespace {

constexpr char kMagic[8] = {'M', 'O', 'E', 'C', 'K', 'P', 'T', '\0'};
constexpr uint64_t kPreambleBytes = 8 + 4 + 4 + 8;  // magic, version, reserved, header length
constexpr uint64_t kChecksumBytes = 8;
// A header is a few kB; a larger length field means a corrupt file, not a bigger model.
constexpr uint64_t kMaxHeaderBytes = 64ull << 20;

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw CheckpointError(path.string() + ": " + what);
}

// sampler states and seeds use all 64 bits; JSON readers outside C++ (JavaScript in particular)
// keep only 53, so they travel as hex strings.
std::string to_hex(uint64_t value) {
  char text[19];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

uint64_t from_hex(const std::filesystem::path& path, const nlohmann::json& header, const char* key) {
  if (!header.contains(key) || !header[key].is_string()) {
    fail(path, std::string("header field \"") + key + "\" is missing or not a hex string");
  }
  const std::string text = header[key].get<std::string>();
  if (text.size() != 18 || text.compare(0, 2, "0x") != 0 ||
      text.find_first_not_of("0123456789abcdef", 2) != std::string::npos) {
    fail(path, std::string("header field \"") + key + "\" is not a 64-bit hex string: " + text);
  }
  return std::stoull(text.substr(2), nullptr, 16);
}

// A count of the header: an integer from 0 to 2^63 - 1 (a larger one would read back negative).
int64_t read_int(const std::filesystem::path& path, const nlohmann::json& header, const char* key) {
  if (!header.contains(key) || !header[key].is_number_integer()) {
    fail(path, std::string("header field \"") + key + "\" is missing or not an integer");
  }
  const nlohmann::json& value = header[key];
  if (value.is_number_unsigned() ? value.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())
                                 : value.get<int64_t>() < 0) {
    fail(path, std::string("header field \"") + key + "\" is " + json_excerpt(value) + "; allowed: 0 to " +
                   std::to_string(std::numeric_limits<int64_t>::max()));
  }
  return value.get<int64_t>();
}

template <typename T>
void put_le(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

template <typename T>
T get_le(const char* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

nlohmann::json header_to_json(const CheckpointHeader& header,
                              const std::vector<CheckpointArrayView>& arrays) {
  nlohmann::json json;
  json["model_config"] = header.model_config;
  json["step"] = header.step;
  json["tokens_seen"] = header.tokens_seen;
  json["optimizer_step"] = header.optimizer_step;
  json["schedule_step"] = header.schedule_step;
  json["sampler_state"] = to_hex(header.sampler_state);
  json["validation_sampler_state"] = to_hex(header.validation_sampler_state);
  json["model_seed"] = to_hex(header.model_seed);
  json["data_seed"] = to_hex(header.data_seed);
  json["run_directory"] = header.run_directory;
  json["extra"] = header.extra;
  nlohmann::json list = nlohmann::json::array();
  uint64_t offset = 0;  // in floats, from the start of the data section
  for (const CheckpointArrayView& array : arrays) {
    list.push_back({{"name", array.name}, {"floats", array.values.size()}, {"offset", offset}});
    offset += array.values.size();
  }
  json["arrays"] = list;
  return json;
}

}  // namespace

const std::vector<float>& LoadedCheckpoint::array(const std::string& name) const {
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return arrays[i];
  }
  fail(path, "has no array named " + name);
}

// ---- writing ----

void save_checkpoint(const std::filesystem::path& path, const CheckpointHeader& header,
                     const std::vector<CheckpointArrayView>& arrays,
                     const CheckpointWriteOptions& options) {
  std::set<std::string> seen;
  for (const CheckpointArrayView& array : arrays) {
    if (array.name.empty()) fail(path, "an array to save has an empty name");
    if (!seen.insert(array.name).second) fail(path, "two arrays to save are named " + array.name);
  }
  if (!header.model_config.is_object()) fail(path, "model_config to save is not a JSON object");

  const std::string header_text = header_to_json(header, arrays).dump();
  std::string preamble(kMagic, sizeof kMagic);
  put_le<uint32_t>(preamble, kCheckpointFormatVersion);
  put_le<uint32_t>(preamble, 0);
  put_le<uint64_t>(preamble, header_text.size());

  try {
    AtomicFileWriter file(path, options.fail_after_bytes);
    // The checksum covers every byte before it, so it is summed over exactly what is written.
    uint64_t checksum = kFnv1aOffsetBasis;
    const auto write_summed = [&](const void* bytes, size_t size) {
      checksum = fnv1a_64(bytes, size, checksum);
      file.write(bytes, size);
    };
    write_summed(preamble.data(), preamble.size());
    write_summed(header_text.data(), header_text.size());
    for (const CheckpointArrayView& array : arrays) {
      write_summed(array.values.data(), array.values.size_bytes());
    }
    file.write(&checksum, sizeof checksum);
    file.commit();
  } catch (const FileWriteError& error) {
    throw CheckpointError(error.what());
  }
}

// ---- reading ----

namespace {

LoadedCheckpoint load_checkpoint_impl(const std::filesystem::path& path,
                                      const std::vector<CheckpointArraySpec>* expected) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) fail(path, "no such checkpoint file");
  std::ifstream file(path, std::ios::binary);
  if (!file) fail(path, std::string("cannot open: ") + std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) fail(path, "read failed");

  // Magic and version first: a file of another kind, or of a newer format, should say so rather
  // than report a checksum mismatch.
  if (std::memcmp(bytes.data(), kMagic, std::min(bytes.size(), sizeof kMagic)) != 0) {
    fail(path, "not a checkpoint (the file does not start with MOECKPT)");
  }
  if (bytes.size() < kPreambleBytes + kChecksumBytes) {
    fail(path, "truncated: " + std::to_string(bytes.size()) + " bytes is shorter than any checkpoint");
  }
  LoadedCheckpoint loaded;
  loaded.path = path;
  loaded.format_version = get_le<uint32_t>(bytes.data() + 8);
  if (loaded.format_version != kCheckpointFormatVersion) {
    fail(path, "unknown format version " + std::to_string(loaded.format_version) +
                   "; this reader supports " + std::to_string(kCheckpointFormatVersion));
  }
  const uint64_t stored_checksum = get_le<uint64_t>(bytes.data() + bytes.size() - kChecksumBytes);
  if (fnv1a_64(bytes.data(), bytes.size() - kChecksumBytes) != stored_checksum) {
    fail(path, "checksum mismatch: the file is corrupt or truncated");
  }

  // The checksum matched, so what follows guards against a bad writer, not bad bytes; still,
  // no length is trusted before it is checked against the file's size.
  const uint64_t header_bytes = get_le<uint64_t>(bytes.data() + 16);
  const uint64_t body_bytes = bytes.size() - kPreambleBytes - kChecksumBytes;
  if (header_bytes > kMaxHeaderBytes || header_bytes > body_bytes) {
    fail(path, "header length " + std::to_string(header_bytes) + " does not fit in the file");
  }
  nlohmann::json header;
  const std::string why = parse_untrusted_json(
      std::string_view(reinterpret_cast<const char*>(bytes.data()) + kPreambleBytes, static_cast<size_t>(header_bytes)), header);
  if (!why.empty()) fail(path, "the header: " + why);
  if (!header.is_object()) fail(path, "the header is not a JSON object");

  CheckpointHeader& out = loaded.header;
  if (!header.contains("model_config") || !header["model_config"].is_object()) {
    fail(path, "header field \"model_config\" is missing or not an object");
  }
  out.model_config = header["model_config"];
  out.step = read_int(path, header, "step");
  out.tokens_seen = read_int(path, header, "tokens_seen");
  out.optimizer_step = read_int(path, header, "optimizer_step");
  out.schedule_step = read_int(path, header, "schedule_step");
  out.sampler_state = from_hex(path, header, "sampler_state");
  out.validation_sampler_state = from_hex(path, header, "validation_sampler_state");
  out.model_seed = from_hex(path, header, "model_seed");
  out.data_seed = from_hex(path, header, "data_seed");
  if (!header.contains("run_directory") || !header["run_directory"].is_string()) {
    fail(path, "header field \"run_directory\" is missing or not a string");
  }
  out.run_directory = header["run_directory"].get<std::string>();
  out.extra = header.value("extra", nlohmann::json::object());

  if (!header.contains("arrays") || !header["arrays"].is_array()) {
    fail(path, "header field \"arrays\" is missing or not a list");
  }
  const uint64_t data_floats = (body_bytes - header_bytes) / sizeof(float);
  if ((body_bytes - header_bytes) % sizeof(float) != 0) {
    fail(path, "the data section is not a whole number of floats");
  }
  const char* data = bytes.data() + kPreambleBytes + header_bytes;
  uint64_t next_offset = 0;
  std::set<std::string> seen;
  for (const nlohmann::json& entry : header["arrays"]) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("floats") || !entry["floats"].is_number_unsigned() ||
        !entry.contains("offset") || !entry["offset"].is_number_unsigned()) {
      fail(path, "an entry of \"arrays\" lacks a name, floats or offset: " + json_excerpt(entry));
    }
    const std::string name = entry["name"].get<std::string>();
    const uint64_t floats = entry["floats"].get<uint64_t>();
    const uint64_t offset = entry["offset"].get<uint64_t>();
    if (!seen.insert(name).second) fail(path, "two arrays are named " + name);
    if (offset != next_offset || floats > data_floats - offset) {
      fail(path, "array " + name + " (offset " + std::to_string(offset) + ", " +
                     std::to_string(floats) + " floats) does not lie where the layout says");
    }
    next_offset = offset + floats;
    loaded.names.push_back(name);
    loaded.arrays.emplace_back(floats);
    if (floats > 0) {  // an empty array's data() may be null, which memcpy must not get
      std::memcpy(loaded.arrays.back().data(), data + offset * sizeof(float), floats * sizeof(float));
    }
  }
  if (next_offset != data_floats) {
    fail(path, "the data section holds " + std::to_string(data_floats) + " floats, the arrays " +
                   std::to_string(next_offset));
  }

  if (expected) {
    for (const CheckpointArraySpec& spec : *expected) {
      const auto found = std::find(loaded.names.begin(), loaded.names.end(), spec.name);
      if (found == loaded.names.end()) fail(path, "has no array named " + spec.name);
      const uint64_t floats = loaded.arrays[static_cast<size_t>(found - loaded.names.begin())].size();
      if (floats != spec.floats) {
        fail(path, "array " + spec.name + " has " + std::to_string(floats) + " floats, expected " +
                       std::to_string(spec.floats) + " for this model");
      }
    }
    for (const std::string& name : loaded.names) {
      const bool wanted = std::any_of(expected->begin(), expected->end(),
                                      [&](const CheckpointArraySpec& spec) { return spec.name == name; });
      if (!wanted) fail(path, "has an array " + name + " this model does not expect");
    }
  }
  return loaded;
}

}  // namespace

LoadedCheckpoint load_checkpoint(const std::filesystem::path& path,
                                 const std::vector<CheckpointArraySpec>& expected) {
  return load_checkpoint_impl(path, &expected);
}

LoadedCheckpoint load_checkpoint(const std::filesystem::path& path) {
  return load_checkpoint_impl(path, nullptr);
}

// ---- a directory of checkpoints ----

namespace {

// The checkpoints of `directory` by step; names that do not match the pattern are left out.
std::map<int64_t, std::filesystem::path> list_checkpoints(const std::filesystem::path& directory) {
  static const std::regex pattern(R"(checkpoint_(\d{8,18})\.ckpt)");
  std::map<int64_t, std::filesystem::path> found;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file(error) && std::regex_match(name, match, pattern)) {
      found[std::stoll(match[1].str())] = entry.path();
    }
  }
  return found;
}

}  // namespace

std::filesystem::path checkpoint_path(const std::filesystem::path& directory, int64_t step) {
  char name[48];
  std::snprintf(name, sizeof name, "checkpoint_%08lld.ckpt", static_cast<long long>(step));
  return directory / name;
}

std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& directory) {
  const auto found = list_checkpoints(directory);
  if (found.empty()) return std::nullopt;
  return found.rbegin()->second;
}

std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& directory, int keep) {
  if (keep < 1) throw CheckpointError(directory.string() + ": keep must be at least 1");
  const auto found = list_checkpoints(directory);
  std::vector<std::filesystem::path> removed;
  int to_remove = static_cast<int>(found.size()) - keep;
  for (auto it = found.begin(); to_remove > 0; ++it, --to_remove) {
    std::error_code error;
    if (std::filesystem::remove(it->second, error)) removed.push_back(it->second);
  }
  return removed;
}

}  // namespace moe
