// checkpoint.h: save and resume a training run: one versioned file with a JSON header and named
// float32 arrays, guarded by a checksum, replaced atomically.
//
// What a resumed run needs to continue the same loss curve: the fp32 master weights and AdamW's
// m and v (named flat arrays), the step, the tokens seen, the optimizer's step (AdamW's bias
// correction), the learning-rate schedule's position, the batch sampler's state (so the next batch
// is the one the interrupted run would have drawn), the seeds, the model config and the run-record
// directory to keep appending to.
//
// The file, all integers little-endian:
//   magic      8 bytes  "MOECKPT\0"
//   version    uint32   kCheckpointFormatVersion
//   reserved   uint32   0
//   header     uint64 length, then that many bytes of JSON (the fields below, and for each array
//                       its name, its length in floats and its offset in the data section)
//   data       the arrays' float32 values, one after another, in header order
//   checksum   uint64   64-bit FNV-1a over every byte before it
// A truncated or corrupted file fails the checksum (or the size check before it); a bad write
// never replaces the last good checkpoint, because save_checkpoint writes "<path>.tmp" in the same
// directory, fsyncs it, and renames it over <path> (a rename within a directory is atomic), then
// fsyncs the directory so the rename itself survives a power cut.
//
//   moe::CheckpointHeader header;  header.step = 1000;  header.model_config = config_json;  ...
//   moe::save_checkpoint(moe::checkpoint_path(dir, 1000), header,
//                        {{"weights", masters}, {"adam_m", m}, {"adam_v", v}});
//   moe::LoadedCheckpoint loaded = moe::load_checkpoint(*moe::latest_checkpoint(dir),
//                        {{"weights", masters.size()}, {"adam_m", m.size()}, {"adam_v", v.size()}});
//   cmake --build build --target moe_common   (tests: ctest --test-dir build -R checkpoint)
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fnv1a.h"  // fnv1a_64: the checksum of the file format

namespace moe {

// The one error type of checkpoint reading and writing; the message names the file and the fault.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr uint32_t kCheckpointFormatVersion = 1;

// Everything in a checkpoint except the arrays.
struct CheckpointHeader {
  nlohmann::json model_config = nlohmann::json::object();  // as the caller wrote it
  int64_t step = 0;                // training steps completed
  int64_t tokens_seen = 0;         // training tokens consumed
  int64_t optimizer_step = 0;      // AdamW's t (bias correction); may differ from step
  int64_t schedule_step = 0;       // position in the warm-up + cosine learning-rate schedule
  uint64_t sampler_state = 0;      // BatchSampler::state() of the training sampler
  uint64_t validation_sampler_state = 0;  // BatchSampler::state() of the validation sampler
  uint64_t model_seed = 0;         // the seed the weights were initialised with
  uint64_t data_seed = 0;          // the seed the training sampler started from
  std::string run_directory;       // the run record this run appends to ("" if none)
  nlohmann::json extra = nlohmann::json::object();  // free-form; round-trips unchanged
};

// One array to save: a view, so the master weights are not copied before writing.
struct CheckpointArrayView {
  std::string name;
  std::span<const float> values;
};

// One array the caller expects to load, with its length in floats for this model.
struct CheckpointArraySpec {
  std::string name;
  uint64_t floats = 0;
};

struct LoadedCheckpoint {
  std::filesystem::path path;
  uint32_t format_version = 0;
  CheckpointHeader header;
  std::vector<std::string> names;           // in file order
  std::vector<std::vector<float>> arrays;   // arrays[i] is named names[i]

  // The array of that name; throws CheckpointError if the file has none.
  const std::vector<float>& array(const std::string& name) const;
};

// For the tests: make a save fail part-way, as a full disk or a crash would.
struct CheckpointWriteOptions {
  // Throw CheckpointError after this many bytes of the temporary file are written.
  std::optional<uint64_t> fail_after_bytes;
};

// Writes <path>.tmp, fsyncs it, renames it over <path>, fsyncs the directory. On any failure the
// temporary file is removed, <path> is untouched, and CheckpointError is thrown.
// Array names must be unique and non-empty.
void save_checkpoint(const std::filesystem::path& path, const CheckpointHeader& header,
                     const std::vector<CheckpointArrayView>& arrays,
                     const CheckpointWriteOptions& options = {});

// Reads and validates a checkpoint: magic, format version, size, checksum, header fields, and the
// arrays against `expected` (the same set of names, each with the expected length; the order
// does not matter). Throws CheckpointError naming the file and the first fault found.
LoadedCheckpoint load_checkpoint(const std::filesystem::path& path,
                                 const std::vector<CheckpointArraySpec>& expected);

// As above, accepting whatever arrays the file holds (for tools that inspect a checkpoint).
LoadedCheckpoint load_checkpoint(const std::filesystem::path& path);

// ---- a directory of checkpoints ----
// Checkpoints of one run live in one directory as "checkpoint_<step, 8 digits>.ckpt", so their
// names sort by step.

std::filesystem::path checkpoint_path(const std::filesystem::path& directory, int64_t step);

// The checkpoint with the highest step in `directory`, or nothing if it has none (or no directory).
// It only looks at names; load_checkpoint validates the file.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& directory);

// Removes all but the `keep` highest-step checkpoints of `directory` (keep >= 1); returns what it
// removed. Files that do not match the checkpoint name pattern are never touched.
std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& directory, int keep);


}  // namespace moe
