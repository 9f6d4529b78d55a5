// file_io.h: the file operations the record formats in common/ share: one way to replace a file
// durably and atomically, and a size-capped read.
//
// AtomicFileWriter: a reader (the viewer, a notebook, a resumed run) sees the old file or the new
// one, never half of one, and a failed or interrupted write never costs the previous file. The
// steps, and why each is there:
//   1. write "<path>.tmp" in the target's own directory: a rename is atomic only within one file
//      system, and the same directory guarantees that;
//   2. fsync the temporary before the rename: otherwise the file system may make the rename durable
//      first, and a crash soon after leaves <path> naming data that never reached the disk (an empty
//      or partial file where the good one was);
//   3. close it and rename it over <path>: the name moves from the old contents to the new in one step;
//   4. fsync the directory: the rename is a change to the directory, and only this makes the new
//      name itself survive a power cut (best effort: some file systems refuse to open a directory).
// Until commit() returns, any failure, or a writer destroyed uncommitted because the caller's own
// code threw, removes the temporary and leaves <path> as it was. The writer throws FileWriteError
// naming the file and the fault; each format rethrows it as its own error type (RecordError,
// CheckpointError, SafetensorsError).
//
//   moe::AtomicFileWriter file(path);
//   file.write(header.data(), header.size());
//   file.write(values.data(), values.size() * sizeof(float));
//   file.commit();
//
// write_file_atomically: the same for bytes already in memory (run.json, .npy, trace files).
// read_file_capped: reads a whole file, refusing one larger than a limit with a message that
// names the file, its size and the limit, so a wrong path cannot exhaust memory.
// Both throw moe::RecordError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moe {

// What AtomicFileWriter throws; the message names the file and the fault.
class FileWriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class AtomicFileWriter {
 public:
  // Creates "<path>.tmp". fail_after_bytes is for the tests: write throws once this many bytes have
  // reached the temporary file, as a full disk or a crash part-way would.
  explicit AtomicFileWriter(std::filesystem::path path, std::optional<uint64_t> fail_after_bytes = std::nullopt);
  ~AtomicFileWriter();  // removes the temporary unless commit() succeeded
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* bytes, size_t size);
  // fsync, close, rename over <path>, fsync the directory. Call once, after the last write.
  void commit();

 private:
  std::filesystem::path path_;
  std::filesystem::path temporary_;  // path_ + ".tmp"
  std::optional<uint64_t> fail_after_bytes_;
  int fd_ = -1;
  uint64_t written_ = 0;
  bool committed_ = false;
};

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

std::string read_file_capped(const std::filesystem::path& path, uint64_t max_bytes);

}  // namespace moe
