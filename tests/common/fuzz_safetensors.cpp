// fuzz_safetensors.cpp: the libFuzzer target of the safetensors reader (common/safetensors.h) and
// of the model weights file built on it (common/model_weights_file.h, what moe_generate --weights
// loads). Each input is parsed from memory, every tensor's values converted, then loaded again from
// a file as model weights (the model config of __metadata__, its limits and its parameter count
// against the tensors' bytes). Refusals are SafetensorsError; anything else is a finding.
//
//   cmake --build build-fuzz --target fuzz_safetensors fuzz_reader_seeds   (configured as in fuzz_checkpoint.cpp)
//   build-fuzz/tests/common/fuzz_reader_seeds build-fuzz/fuzz_readers
//   build-fuzz/tests/common/fuzz_safetensors -runs=1000000 -max_len=8192 -rss_limit_mb=2048 build-fuzz/fuzz_readers/safetensors
// CTest runs it bounded as CommonFuzzSafetensors.
#include <cstdint>
#include <string>

#include "fuzz_target.h"  // scratch_file, check
#include "model_weights_file.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    const moe::SafetensorsFile file = moe::SafetensorsFile::parse(bytes, "fuzz.safetensors");
    for (const moe::TensorInfo& info : file.tensors()) {
      moe::fuzz::check(info.end - info.begin == file.bytes(info.name).size(), "a tensor's bytes are its data_offsets");
      if (info.dtype == moe::Dtype::f8_e5m2 || info.dtype == moe::Dtype::f8_e4m3) continue;  // not converted
      moe::fuzz::check(file.to_double(info.name).size() == static_cast<size_t>(info.elements()),
                       "a tensor converts to as many values as its shape holds");
    }
  } catch (const moe::SafetensorsError&) {
  }
  try {
    const moe::LoadedWeights weights =
        moe::load_flat_weights_safetensors(moe::fuzz::scratch_file(bytes, "fuzz_safetensors"));
    moe::fuzz::check(static_cast<int64_t>(weights.flat.size()) == moe::parameter_count(weights.config),
                     "loaded weights are the model's parameter count");
  } catch (const moe::SafetensorsError&) {
  }
  return 0;
}
