// file_io.cpp: the atomic, durable file writer and size-capped reads (see file_io.h).
#include "file_io.h"

#include <fcntl.h>   // open
#include <unistd.h>  // write, fsync, close

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <system_error>
#include <utility>

#include "record_error.h"

namespace moe {

namespace {

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw FileWriteError(path.string() + ": " + what);
}

void sync_directory(const std::filesystem::path& directory) {
  const int fd = ::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some file systems do not allow opening a directory
  ::fsync(fd);
  ::close(fd);
}

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};
using FileHandle = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

// ---- writing ----

AtomicFileWriter::AtomicFileWriter(std::filesystem::path path, std::optional<uint64_t> fail_after_bytes)
    : path_(std::move(path)), temporary_(path_.string() + ".tmp"), fail_after_bytes_(fail_after_bytes) {
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(temporary_, std::string("cannot create: ") + std::strerror(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) {
    std::error_code ignored;
    std::filesystem::remove(temporary_, ignored);
  }
}

void AtomicFileWriter::write(const void* bytes, size_t size) {
  const char* next = static_cast<const char*>(bytes);
  bool simulate_failure = false;
  if (fail_after_bytes_ && written_ + size > *fail_after_bytes_) {
    size = static_cast<size_t>(*fail_after_bytes_ - written_);
    simulate_failure = true;
  }
  while (size > 0) {
    const ssize_t got = ::write(fd_, next, size);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(temporary_, std::string("write failed: ") + std::strerror(errno));
    }
    next += got;
    size -= static_cast<size_t>(got);
    written_ += static_cast<uint64_t>(got);
  }
  if (simulate_failure) {
    fail(temporary_, "simulated write failure after " + std::to_string(*fail_after_bytes_) + " bytes");
  }
}

void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) fail(temporary_, std::string("fsync failed: ") + std::strerror(errno));
  if (::close(std::exchange(fd_, -1)) != 0) {
    fail(temporary_, std::string("close failed: ") + std::strerror(errno));
  }
  std::error_code error;
  std::filesystem::rename(temporary_, path_, error);
  if (error) fail(path_, "cannot rename " + temporary_.string() + " over it: " + error.message());
  committed_ = true;
  sync_directory(path_.parent_path());
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  try {
    AtomicFileWriter file(path);
    file.write(bytes.data(), bytes.size());
    file.commit();
  } catch (const FileWriteError& error) {
    throw RecordError(error.what());
  }
}

// ---- reading ----

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
