// sample_text.h: a small generated English-like text with structure to learn (sentences of a tiny
// grammar, seeded), for the training tests: about `bytes` bytes written to `file`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace moe::testing {

inline void write_sample_text(const std::filesystem::path& file, int64_t bytes = 40000) {
  const char* subjects[] = {"the cat", "a dog", "my old friend", "the teacher", "every child", "our neighbour"};
  const char* verbs[] = {"sees", "likes", "follows", "draws", "remembers", "finds"};
  const char* objects[] = {"the red ball", "a small house", "the river", "an open door", "the garden", "a letter"};
  std::ostringstream text;
  uint64_t state = 12345;
  auto next = [&](int n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return int((state >> 33) % uint64_t(n));
  };
  while (text.tellp() < bytes) {
    text << subjects[next(6)] << ' ' << verbs[next(6)] << ' ' << objects[next(6)] << (next(4) == 0 ? ".\n" : ". ");
  }
  std::ofstream(file) << text.str();
}

}  // namespace moe::testing
