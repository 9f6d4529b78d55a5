// batch_sampler.cpp: windows of one document, drawn uniformly over the valid starts (see batch_sampler.h).
#include "batch_sampler.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace moe {

BatchSampler::BatchSampler(const TextCorpus& corpus, Split split, int batch, int sequence, uint64_t seed)
    : corpus_(corpus), split_(split), batch_(batch), sequence_(sequence), state_(seed) {
  if (batch <= 0 || sequence <= 0) {
    throw TextCorpusError("batch (" + std::to_string(batch) + ") and sequence (" + std::to_string(sequence) +
                          ") must be positive");
  }
  const CorpusSplit& part = corpus.split(split);
  const uint64_t window = static_cast<uint64_t>(sequence) + 1;
  // Document i offers end - begin - sequence starts; prefix sums let one uniform number pick
  // a document (binary search) and a start inside it.
  starts_before_.assign(1, 0);
  uint64_t longest = 0;
  for (const CorpusDocument& document : part.documents) {
    const uint64_t length = document.end - document.begin;
    longest = std::max(longest, length);
    starts_before_.push_back(starts_before_.back() + (length >= window ? length - window + 1 : 0));
  }
  if (starts_before_.back() == 0) {
    throw TextCorpusError("sequence length " + std::to_string(sequence) + " (+1 target byte) is longer than " +
                          (part.documents.size() == 1 ? std::string("the ") + split_name(split) + " split"
                                                      : "every document of the " + std::string(split_name(split)) +
                                                            " split (the longest has " + std::to_string(longest) +
                                                            " bytes)") +
                          " of " + corpus.source + " (" + std::to_string(part.bytes.size()) +
                          " bytes): use a shorter --seq-len or more text");
  }
}

uint64_t BatchSampler::next_random() {
  // splitmix64 (Steele, Lea, Flood 2014): one add and a bijective mix; every seed is a good seed.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t BatchSampler::uniform_below(uint64_t bound) {
  // Reject the top partial range of 2^64 so that every value below bound is equally likely.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  for (;;) {
    const uint64_t value = next_random();
    if (value < limit) return value % bound;
  }
}

ByteBatch BatchSampler::next() {
  const CorpusSplit& part = corpus_.split(split_);
  const size_t window = static_cast<size_t>(sequence_) + 1;
  ByteBatch out;
  out.batch = batch_;
  out.sequence = sequence_;
  out.bytes.resize(static_cast<size_t>(batch_) * window);
  out.offsets.resize(static_cast<size_t>(batch_));
  out.genres.resize(static_cast<size_t>(batch_));
  for (int row = 0; row < batch_; ++row) {
    const uint64_t pick = uniform_below(starts_before_.back());
    // The document whose range of starts holds pick: the last i with starts_before_[i] <= pick.
    const size_t document = static_cast<size_t>(
        std::upper_bound(starts_before_.begin(), starts_before_.end(), pick) - starts_before_.begin() - 1);
    const CorpusDocument& chosen = part.documents[document];
    const uint64_t offset = chosen.begin + (pick - starts_before_[document]);
    std::memcpy(out.bytes.data() + static_cast<size_t>(row) * window, part.bytes.data() + offset, window);
    out.offsets[static_cast<size_t>(row)] = offset;
    out.genres[static_cast<size_t>(row)] = chosen.genre;
  }
  return out;
}

}  // namespace moe
