// batch_sampler.h: seeded [batch, sequence + 1] byte windows for next-byte prediction.
//
// Each window is sequence + 1 consecutive bytes of one document of one split: the model reads
// bytes [0, sequence) and predicts bytes [1, sequence + 1). A window never crosses a document
// boundary, so it never crosses the train/validation boundary either, and it has exactly one genre
// (the per-genre expert load of a run record counts each window under that genre).
// Windows are drawn uniformly over every position where one fits: a document of n bytes offers
// n - sequence starts, so long documents are drawn more often, as they would be by a uniform
// draw over the stream.
// The random numbers are the project's own (splitmix64 and rejection sampling), not
// std::uniform_int_distribution, whose output differs between standard libraries: the same seed
// gives the same batches on every machine, which a resumed run and the tests rely on.
//
//   moe::BatchSampler sampler(corpus, moe::Split::train, /*batch=*/64, /*sequence=*/256, /*seed=*/1);
//   moe::ByteBatch batch = sampler.next();  // batch.bytes [64, 257], batch.genres [64]
//   cmake --build build --target moe_common   (tests: ctest --test-dir build -R batch_sampler)
#pragma once

#include <cstdint>
#include <vector>

#include "text_corpus.h"  // TextCorpus, Split, TextCorpusError

namespace moe {

struct ByteBatch {
  int batch = 0;
  int sequence = 0;
  std::vector<uint8_t> bytes;     // [batch, sequence + 1]
  std::vector<uint64_t> offsets;  // [batch] where each window starts in the split
  std::vector<int> genres;        // [batch] index into TextCorpus::genres
};

class BatchSampler {
 public:
  // Throws TextCorpusError if batch or sequence is not positive, or if no document of the split
  // holds sequence + 1 bytes (the message gives the longest document and the split's size).
  BatchSampler(const TextCorpus& corpus, Split split, int batch, int sequence, uint64_t seed);

  ByteBatch next();

  // The generator's state, for a checkpoint: a sampler restored with set_state continues with
  // the batches the saved one would have drawn.
  uint64_t state() const { return state_; }
  void set_state(uint64_t state) { state_ = state; }

 private:
  uint64_t next_random();                 // splitmix64
  uint64_t uniform_below(uint64_t bound);  // uniform in [0, bound), bound > 0

  const TextCorpus& corpus_;
  Split split_;
  int batch_;
  int sequence_;
  uint64_t state_;
  std::vector<uint64_t> starts_before_;  // [documents + 1] window starts in documents before i
};

}  // namespace moe
