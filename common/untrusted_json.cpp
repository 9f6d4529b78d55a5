// untrusted_json.cpp: see untrusted_json.h.
#include "untrusted_json.h"

#include <algorithm>

namespace moe {

int json_nesting_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

std::string parse_untrusted_json(std::string_view text, nlohmann::json& out) {
  if (json_nesting_depth(text) > kMaxJsonNesting) {
    return "JSON nested deeper than " + std::to_string(kMaxJsonNesting) + " levels";
  }
  try {
    out = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    std::string why = e.what();  // it quotes what it last read, which may be long
    if (why.size() > 240) why = why.substr(0, 240) + "...";
    return "not valid JSON (" + why + ")";
  }
  return "";
}

std::string json_excerpt(const nlohmann::json& value, size_t max_chars) {
  std::string text = value.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  if (text.size() > max_chars) text = text.substr(0, max_chars) + "...";
  return text;
}

}  // namespace moe
