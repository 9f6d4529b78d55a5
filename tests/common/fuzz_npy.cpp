// fuzz_npy.cpp: the libFuzzer target of the .npy reader (common/npy.h). Each input is parsed; an
// accepted array must hold exactly its shape's bytes and survive a round trip (serialize_npy, then
// parse_npy again, gives the same dtype, shape and data). Refusals are RecordError; anything else is
// a finding.
//
//   cmake --build build-fuzz --target fuzz_npy fuzz_reader_seeds   (configured as in fuzz_checkpoint.cpp)
//   build-fuzz/tests/common/fuzz_reader_seeds build-fuzz/fuzz_readers
//   build-fuzz/tests/common/fuzz_npy -runs=1000000 -max_len=1024 -rss_limit_mb=2048 build-fuzz/fuzz_readers/npy
// CTest runs it bounded as CommonFuzzNpy.
#include <cstdint>
#include <string_view>

#include "fuzz_target.h"  // check
#include "npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moe::NpyArray array = moe::parse_npy(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.npy");
    const int64_t count = array.element_count();
    moe::fuzz::check(count >= 0, "an accepted shape has an element count");
    moe::fuzz::check(static_cast<uint64_t>(count) * static_cast<uint64_t>(moe::npy_item_size(array.dtype)) ==
                         array.data.size(),
                     "an accepted array holds exactly its shape's bytes");
    const moe::NpyArray again = moe::parse_npy(moe::serialize_npy(array), "round trip");
    moe::fuzz::check(again.dtype == array.dtype && again.shape == array.shape && again.data == array.data,
                     "an array survives a round trip");
  } catch (const moe::RecordError&) {
  }
  return 0;
}
