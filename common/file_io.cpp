// file_io.cpp: atomic writes and size-capped reads (see file_io.h).
#include "file_io.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <system_error>

#include "record_error.h"

namespace moe {

namespace {

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};
using FileHandle = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  std::filesystem::path temporary = path;
  temporary += ".tmp";
  {
    FileHandle file(std::fopen(temporary.c_str(), "wb"));
    if (!file) {
      throw RecordError("cannot write " + temporary.string() + ": " + std::strerror(errno));
    }
    if (std::fwrite(bytes.data(), 1, bytes.size(), file.get()) != bytes.size() ||
        std::fflush(file.get()) != 0) {
      throw RecordError("writing " + temporary.string() + " failed: " + std::strerror(errno));
    }
    std::FILE* raw = file.release();
    if (std::fclose(raw) != 0) {
      throw RecordError("closing " + temporary.string() + " failed: " + std::strerror(errno));
    }
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    std::filesystem::remove(temporary, error);
    throw RecordError("cannot rename " + temporary.string() + " to " + path.string());
  }
}

std::string read_file_capped(const std::filesystem::path& path, uint64_t max_bytes) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw RecordError(path.string() + ": no such file");
  }
  FileHandle file(std::fopen(path.c_str(), "rb"));
  if (!file) throw RecordError("cannot open " + path.string() + ": " + std::strerror(errno));
  // Read in chunks until EOF rather than trusting the size up front: the file may be growing.
  std::string bytes;
  char chunk[1 << 16];
  for (;;) {
    size_t got = std::fread(chunk, 1, sizeof chunk, file.get());
    if (got == 0) break;
    if (bytes.size() + got > max_bytes) {
      throw RecordError(path.string() + " is larger than the limit of " + std::to_string(max_bytes) +
                        " bytes; raise ReadOptions::max_file_bytes if this file is expected");
    }
    if (bytes.empty()) {
      auto size = std::filesystem::file_size(path, error);
      if (!error && size <= max_bytes) bytes.reserve(size);
    }
    bytes.append(chunk, got);
  }
  if (std::ferror(file.get())) throw RecordError("reading " + path.string() + " failed");
  return bytes;
}

}  // namespace moe
