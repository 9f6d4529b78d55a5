// fuzz_checkpoint.cpp: the libFuzzer target of the checkpoint reader (common/checkpoint.h) and of
// the model config a checkpoint carries. The input is a checkpoint without its last 8 bytes: the
// target appends the valid FNV-1a checksum, so mutations reach the header and the arrays rather than
// stopping at the checksum. Then, as the programs that resume or export do: the model config is read
// (model_config_from_json, limits included) and its parameter count compared with "weights".
// Refusals are CheckpointError and std::invalid_argument; anything else is a finding.
//
//   CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DMOE_ENABLE_CUDA=OFF -DMOE_BUILD_FUZZERS=ON
//   cmake --build build-fuzz --target fuzz_checkpoint fuzz_reader_seeds
//   build-fuzz/tests/common/fuzz_reader_seeds build-fuzz/fuzz_readers
//   build-fuzz/tests/common/fuzz_checkpoint -runs=1000000 -max_len=4096 -rss_limit_mb=2048 build-fuzz/fuzz_readers/checkpoint
// CTest runs it bounded as CommonFuzzCheckpoint.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "checkpoint.h"
#include "config_json.h"       // model_config_from_json
#include "fuzz_target.h"       // scratch_file, check
#include "parameter_layout.h"  // parameter_count

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  const uint64_t checksum = moe::fnv1a_64(bytes.data(), bytes.size());
  bytes.append(reinterpret_cast<const char*>(&checksum), sizeof checksum);
  try {
    const moe::LoadedCheckpoint loaded = moe::load_checkpoint(moe::fuzz::scratch_file(bytes, "fuzz_checkpoint"));
    uint64_t floats = 0;
    for (const std::vector<float>& array : loaded.arrays) floats += array.size();
    moe::fuzz::check(floats * sizeof(float) <= bytes.size(), "the arrays fit in the file");
    const moe::ModelConfig config = moe::model_config_from_json(loaded.header.model_config);
    const int64_t count = moe::parameter_count(config);
    moe::fuzz::check(count >= 1 && count <= moe::kMaxParameters, "a valid config's parameter count is within the limit");
    (void)(loaded.names.empty() ? 0 : loaded.array(loaded.names.front()).size());
  } catch (const moe::CheckpointError&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
