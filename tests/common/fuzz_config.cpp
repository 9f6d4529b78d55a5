// fuzz_config.cpp: the libFuzzer target of the config readers (common/config_json.h, what a
// program's --config, a checkpoint and a weights file's __metadata__ go through): the text is parsed
// with the nesting cap (untrusted_json.h), then read as a model config and as an MoE layer config.
// An accepted config must be within the limits (model_config.h, moe_config.h) and survive a round
// trip through its JSON form. Refusals are std::invalid_argument (the model config) and RecordError
// (the MoE config); anything else is a finding.
//
//   cmake --build build-fuzz --target fuzz_config fuzz_reader_seeds   (configured as in fuzz_checkpoint.cpp)
//   build-fuzz/tests/common/fuzz_reader_seeds build-fuzz/fuzz_readers
//   build-fuzz/tests/common/fuzz_config -runs=1000000 -max_len=2048 -rss_limit_mb=2048 build-fuzz/fuzz_readers/config
// CTest runs it bounded as CommonFuzzConfig.
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include <nlohmann/json.hpp>

#include "config_json.h"
#include "fuzz_target.h"       // check
#include "parameter_layout.h"  // parameter_count
#include "untrusted_json.h"    // parse_untrusted_json

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json json;
  if (!moe::parse_untrusted_json(std::string_view(reinterpret_cast<const char*>(data), size), json).empty()) return 0;
  try {
    const moe::ModelConfig config = moe::model_config_from_json(json);
    moe::fuzz::check(moe::parameter_count(config) <= moe::kMaxParameters, "the parameter count is within the limit");
    moe::fuzz::check(moe::model_config_to_json(moe::model_config_from_json(moe::model_config_to_json(config))) ==
                         moe::model_config_to_json(config),
                     "a model config survives a round trip");
  } catch (const std::invalid_argument&) {
  }
  try {
    const moe::MoeConfig layer = json.get<moe::MoeConfig>();
    moe::fuzz::check(layer.tokens <= moe::kMaxTokens && layer.num_experts <= moe::kMaxExperts,
                     "an MoE config is within the limits");
    moe::fuzz::check(nlohmann::json(nlohmann::json(layer).get<moe::MoeConfig>()) == nlohmann::json(layer),
                     "an MoE config survives a round trip");
  } catch (const moe::RecordError&) {
  }
  return 0;
}
