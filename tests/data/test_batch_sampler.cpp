// test_batch_sampler.cpp: [batch, sequence + 1] windows: shapes, every window a slice of one
// document of its split with that document's genre, the same batches for the same seed (and after
// restoring the state), every valid start reachable, and a sequence too long for the split.
//   ctest --test-dir build -R BatchSampler
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>

#include "batch_sampler.h"
#include "brown_corpus.h"  // convert_brown, for windows over the hand-made Brown sample
#include "text_corpus.h"

namespace moe {
namespace {

// Documents of 12, 5 and 20 bytes over two genres; the 5-byte one is too short for sequence 8.
TextCorpus small_corpus() {
  TextCorpus corpus;
  corpus.source = "test";
  corpus.genres = {{"news", "a", ""}, {"humor", "r", ""}};
  corpus.train.bytes = "abcdefghijk\nlmno\nABCDEFGHIJKLMNOPQRS\n";
  corpus.train.documents = {{"d0", 0, 0, 12}, {"d1", 1, 12, 17}, {"d2", 1, 17, 37}};
  corpus.validation.bytes = "0123456789\n";
  corpus.validation.documents = {{"d3", 0, 0, 11}};
  return corpus;
}

void check_windows(const TextCorpus& corpus, Split split, const ByteBatch& batch) {
  const CorpusSplit& part = corpus.split(split);
  const size_t window = static_cast<size_t>(batch.sequence) + 1;
  ASSERT_EQ(batch.bytes.size(), static_cast<size_t>(batch.batch) * window);
  ASSERT_EQ(batch.offsets.size(), static_cast<size_t>(batch.batch));
  ASSERT_EQ(batch.genres.size(), static_cast<size_t>(batch.batch));
  for (size_t row = 0; row < static_cast<size_t>(batch.batch); ++row) {
    const uint64_t offset = batch.offsets[row];
    ASSERT_LE(offset + window, part.bytes.size());  // never past the split's end
    const CorpusDocument& document = corpus.document_at(split, offset);
    EXPECT_LE(offset + window, document.end) << "window crosses out of document " << document.id;
    EXPECT_EQ(batch.genres[row], document.genre);
    EXPECT_EQ(std::string(batch.bytes.begin() + static_cast<long>(row * window),
                          batch.bytes.begin() + static_cast<long>((row + 1) * window)),
              part.bytes.substr(offset, window));
  }
}

TEST(BatchSampler, ShapesAndWindowsInsideOneDocument) {
  const TextCorpus corpus = small_corpus();
  BatchSampler sampler(corpus, Split::train, /*batch=*/16, /*sequence=*/8, /*seed=*/7);
  for (int step = 0; step < 50; ++step) {
    const ByteBatch batch = sampler.next();
    EXPECT_EQ(batch.batch, 16);
    EXPECT_EQ(batch.sequence, 8);
    check_windows(corpus, Split::train, batch);
  }
  BatchSampler validation(corpus, Split::validation, 4, 8, 7);
  check_windows(corpus, Split::validation, validation.next());
}

TEST(BatchSampler, EveryValidStartIsDrawnAndNoOther) {
  // sequence 8 -> windows of 9 bytes: d0 offers starts 0..3, d1 none, d2 starts 17..28.
  const TextCorpus corpus = small_corpus();
  BatchSampler sampler(corpus, Split::train, 64, 8, 3);
  std::set<uint64_t> starts;
  for (int step = 0; step < 40; ++step) {
    for (uint64_t offset : sampler.next().offsets) starts.insert(offset);
  }
  std::set<uint64_t> expected;
  for (uint64_t s = 0; s <= 3; ++s) expected.insert(s);
  for (uint64_t s = 17; s <= 28; ++s) expected.insert(s);
  EXPECT_EQ(starts, expected);
}

TEST(BatchSampler, SameSeedSameBatches) {
  const TextCorpus corpus = small_corpus();
  BatchSampler a(corpus, Split::train, 8, 4, 42), b(corpus, Split::train, 8, 4, 42), c(corpus, Split::train, 8, 4, 43);
  bool differs = false;
  for (int step = 0; step < 10; ++step) {
    const ByteBatch x = a.next(), y = b.next(), z = c.next();
    EXPECT_EQ(x.bytes, y.bytes);
    EXPECT_EQ(x.offsets, y.offsets);
    EXPECT_EQ(x.genres, y.genres);
    differs = differs || x.offsets != z.offsets;
  }
  EXPECT_TRUE(differs) << "seeds 42 and 43 gave the same 10 batches";
}

TEST(BatchSampler, PinnedOffsetsForSeedOne) {
  // splitmix64 is exact integer arithmetic: these offsets are the same on every machine and
  // standard library. A change here changes every recorded run's batches.
  const TextCorpus corpus = small_corpus();
  BatchSampler sampler(corpus, Split::train, 6, 8, 1);
  const ByteBatch batch = sampler.next();
  BatchSampler again(corpus, Split::train, 6, 8, 1);
  EXPECT_EQ(again.next().offsets, batch.offsets);
  std::string printed;
  for (uint64_t offset : batch.offsets) printed += std::to_string(offset) + " ";
  EXPECT_EQ(printed, "1 20 27 24 22 0 ");  // also computed by a 15-line Python splitmix64
}

TEST(BatchSampler, RestoredStateContinuesTheSameBatches) {
  const TextCorpus corpus = small_corpus();
  BatchSampler sampler(corpus, Split::train, 4, 8, 9);
  sampler.next();
  const uint64_t saved = sampler.state();
  const ByteBatch expected = sampler.next();
  BatchSampler resumed(corpus, Split::train, 4, 8, 0);
  resumed.set_state(saved);
  EXPECT_EQ(resumed.next().offsets, expected.offsets);
}

TEST(BatchSampler, WindowsOverTheBrownSampleNeverLeaveTheirDocument) {
  std::string provenance;
  const TextCorpus corpus = convert_brown(MOE_BROWN_SAMPLE_DIR, {}, provenance);
  for (Split split : {Split::train, Split::validation}) {
    BatchSampler sampler(corpus, split, 32, 40, 5);
    for (int step = 0; step < 20; ++step) check_windows(corpus, split, sampler.next());
  }
}

TEST(BatchSampler, SequenceLongerThanTheSplitIsAnError) {
  const TextCorpus corpus = small_corpus();
  try {
    BatchSampler sampler(corpus, Split::validation, 4, 11, 1);  // 12 bytes needed, 11 there
    ADD_FAILURE() << "no TextCorpusError";
  } catch (const TextCorpusError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("sequence length 11"), std::string::npos) << message;
    EXPECT_NE(message.find("validation split"), std::string::npos) << message;
    EXPECT_NE(message.find("--seq-len"), std::string::npos) << message;  // the flag as moe_train spells it
  }
  try {
    BatchSampler sampler(corpus, Split::train, 4, 20, 1);  // 21 bytes; the longest document has 20
    ADD_FAILURE() << "no TextCorpusError";
  } catch (const TextCorpusError& e) {
    EXPECT_NE(std::string(e.what()).find("longest has 20 bytes"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(BatchSampler(corpus, Split::train, 4, 19, 1));  // exactly one window fits
  EXPECT_THROW(BatchSampler(corpus, Split::train, 0, 8, 1), TextCorpusError);
  EXPECT_THROW(BatchSampler(corpus, Split::train, 4, 0, 1), TextCorpusError);
}

}  // namespace
}  // namespace moe
