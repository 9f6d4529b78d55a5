// test_checkpoint.cpp: the checkpoint file: a round trip (every header field, arrays bit-exact, a
// restored sampler drawing the same next batch), truncation at every offset and byte flips all
// detected, wrong array names and lengths, an unknown version, a missing file, a failed write that
// leaves the previous checkpoint intact, keep-the-last-N, and resuming from the latest checkpoint.
//   ctest --test-dir build -R Checkpoint
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "batch_sampler.h"
#include "checkpoint.h"
#include "temp_dir.h"
#include "text_corpus.h"

namespace moe {
namespace {

using moe::testing::TempDir;

std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<float> random_floats(size_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(generator);
  return values;
}

// The error message of loading `path` with `expected`, or "" if it loaded.
std::string load_error(const std::filesystem::path& path, const std::vector<CheckpointArraySpec>& expected) {
  try {
    load_checkpoint(path, expected);
  } catch (const CheckpointError& error) {
    return error.what();
  }
  return "";
}

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

// A small model's training state: three arrays of an awkward length, every header field set.
struct TrainingState {
  CheckpointHeader header;
  std::vector<float> weights, adam_m, adam_v;

  explicit TrainingState(size_t floats = 257)
      : weights(random_floats(floats, 1)), adam_m(random_floats(floats, 2)), adam_v(random_floats(floats, 3)) {
    header.model_config = {{"d_model", 64}, {"experts", 4}, {"top_k", 2}, {"moe", "dropless"}};
    header.step = 1234;
    header.tokens_seen = 1234LL * 64 * 256;
    header.optimizer_step = 1230;
    header.schedule_step = 1234;
    header.sampler_state = 0xfedcba9876543210ull;  // all 64 bits, past JSON's 53-bit doubles
    header.validation_sampler_state = 42;
    header.model_seed = 7;
    header.data_seed = std::numeric_limits<uint64_t>::max();
    header.run_directory = "notebooks_data/runs/dropless";
    header.extra = {{"note", "resumed once"}, {"best_val_loss", 1.5}};
    // Values a float round trip through text would spoil: bit-exact means these survive too (as
    // many as the weights hold).
    const float special[] = {std::numeric_limits<float>::denorm_min(), -0.0f, std::numeric_limits<float>::infinity(),
                             0.1f};
    for (size_t i = 0; i < weights.size() && i < std::size(special); ++i) weights[i] = special[i];
  }
  std::vector<CheckpointArrayView> views() const {
    return {{"weights", weights}, {"adam_m", adam_m}, {"adam_v", adam_v}};
  }
  std::vector<CheckpointArraySpec> specs() const {
    return {{"weights", weights.size()}, {"adam_m", adam_m.size()}, {"adam_v", adam_v.size()}};
  }
};

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(Checkpoint, RoundTripKeepsEveryFieldAndArraysBitExact) {
  TempDir dir;
  TrainingState state;
  const auto path = dir.path() / "a.ckpt";
  save_checkpoint(path, state.header, state.views());
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "a.ckpt.tmp"));

  const LoadedCheckpoint loaded = load_checkpoint(path, state.specs());
  EXPECT_EQ(loaded.format_version, kCheckpointFormatVersion);
  const CheckpointHeader& header = loaded.header;
  EXPECT_EQ(header.model_config, state.header.model_config);
  EXPECT_EQ(header.step, state.header.step);
  EXPECT_EQ(header.tokens_seen, state.header.tokens_seen);
  EXPECT_EQ(header.optimizer_step, state.header.optimizer_step);
  EXPECT_EQ(header.schedule_step, state.header.schedule_step);
  EXPECT_EQ(header.sampler_state, state.header.sampler_state);
  EXPECT_EQ(header.validation_sampler_state, state.header.validation_sampler_state);
  EXPECT_EQ(header.model_seed, state.header.model_seed);
  EXPECT_EQ(header.data_seed, state.header.data_seed);
  EXPECT_EQ(header.run_directory, state.header.run_directory);
  EXPECT_EQ(header.extra, state.header.extra);
  EXPECT_EQ(loaded.names, (std::vector<std::string>{"weights", "adam_m", "adam_v"}));
  EXPECT_TRUE(bit_equal(loaded.array("weights"), state.weights));
  EXPECT_TRUE(bit_equal(loaded.array("adam_m"), state.adam_m));
  EXPECT_TRUE(bit_equal(loaded.array("adam_v"), state.adam_v));
  EXPECT_TRUE(std::signbit(loaded.array("weights")[1]));

  // Expected arrays may be listed in any order; the generic loader takes whatever is there.
  EXPECT_NO_THROW(load_checkpoint(path, {{"adam_v", 257}, {"weights", 257}, {"adam_m", 257}}));
  EXPECT_EQ(load_checkpoint(path).arrays.size(), 3u);
  EXPECT_THROW(loaded.array("nope"), CheckpointError);
}

TEST(Checkpoint, EmptyArraysAndNoArraysRoundTrip) {
  TempDir dir;
  const auto path = dir.path() / "empty.ckpt";
  save_checkpoint(path, CheckpointHeader{}, {{"nothing", {}}});
  EXPECT_EQ(load_checkpoint(path, {{"nothing", 0}}).array("nothing").size(), 0u);
  save_checkpoint(path, CheckpointHeader{}, {});
  EXPECT_TRUE(load_checkpoint(path, {}).names.empty());
}

TEST(Checkpoint, RestoredSamplerDrawsTheSameNextBatch) {
  TempDir dir;
  const TextCorpus corpus = small_corpus();
  BatchSampler original(corpus, Split::train, 4, 8, /*seed=*/11);
  for (int i = 0; i < 5; ++i) original.next();  // some training happened

  CheckpointHeader header;
  header.sampler_state = original.state();
  header.data_seed = 11;
  save_checkpoint(dir.path() / "s.ckpt", header, {});
  const ByteBatch expected = original.next();

  const LoadedCheckpoint loaded = load_checkpoint(dir.path() / "s.ckpt", {});
  BatchSampler restored(corpus, Split::train, 4, 8, loaded.header.data_seed);
  restored.set_state(loaded.header.sampler_state);
  const ByteBatch next = restored.next();
  EXPECT_EQ(next.bytes, expected.bytes);
  EXPECT_EQ(next.offsets, expected.offsets);
}

// Files of ~1 kB in these two, so trying every offset stays fast.
TEST(Checkpoint, TruncationAtEveryOffsetIsDetected) {
  TempDir dir;
  TrainingState state(/*floats=*/37);
  const auto good = dir.path() / "good.ckpt";
  save_checkpoint(good, state.header, state.views());
  const std::string bytes = read_bytes(good);
  const auto cut = dir.path() / "cut.ckpt";
  for (size_t size = 0; size < bytes.size(); ++size) {
    write_bytes(cut, bytes.substr(0, size));
    const std::string error = load_error(cut, state.specs());
    ASSERT_FALSE(error.empty()) << "a file cut to " << size << " of " << bytes.size() << " bytes loaded";
    ASSERT_NE(error.find(cut.string()), std::string::npos) << error;
  }
  // The message for a cut in the body says what happened.
  write_bytes(cut, bytes.substr(0, bytes.size() / 2));
  EXPECT_NE(load_error(cut, state.specs()).find("checksum mismatch: the file is corrupt or truncated"),
            std::string::npos);
  // So does one with bytes appended.
  write_bytes(cut, bytes + "x");
  EXPECT_NE(load_error(cut, state.specs()).find("checksum mismatch"), std::string::npos);
}

// A checkpoint file of `good`'s preamble (magic, version, reserved) and the header `header`, its
// length and its checksum made right: what a bad writer could produce, which no checksum stops.
std::string checkpoint_with_header(const std::string& good, const std::string& header) {
  std::string bytes = good.substr(0, 16);
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>((length >> (8 * i)) & 0xff);
  bytes += header;
  const uint64_t checksum = fnv1a_64(bytes.data(), bytes.size());
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>((checksum >> (8 * i)) & 0xff);
  return bytes;
}

// The bytes of a small checkpoint saved from `state`, whose preamble the tests below reuse.
std::string good_checkpoint_bytes(const TempDir& dir, const TrainingState& state) {
  const auto good = dir.path() / "good.ckpt";
  save_checkpoint(good, state.header, state.views());
  return read_bytes(good);
}

TEST(Checkpoint, ADeeplyNestedHeaderWithAGoodChecksumIsRefused) {
  // A header of 100000 nested arrays: the nesting limit must stop it (serialising it for a message
  // would exhaust the stack).
  TempDir dir;
  TrainingState state(/*floats=*/3);
  const std::string good = good_checkpoint_bytes(dir, state);
  const auto deep = dir.path() / "deep.ckpt";
  write_bytes(deep, checkpoint_with_header(good, std::string(100000, '[') + std::string(100000, ']')));
  const std::string error = load_error(deep, state.specs());
  EXPECT_NE(error.find("JSON nested deeper than 64 levels"), std::string::npos) << error;
  EXPECT_NE(error.find(deep.string()), std::string::npos) << error;
}

TEST(Checkpoint, ACountBeyondWhatItsIntegerHoldsIsRefused) {
  // "step": 2^64 - 1 would read back as -1; a negative count is no count either.
  TempDir dir;
  TrainingState state(/*floats=*/3);
  const std::string good = good_checkpoint_bytes(dir, state);
  const auto odd = dir.path() / "odd.ckpt";
  for (const char* step : {"18446744073709551615", "-1"}) {
    const std::string header = std::string(R"({"model_config":{},"step":)") + step +
                               R"(,"tokens_seen":0,"optimizer_step":0,"schedule_step":0})";
    write_bytes(odd, checkpoint_with_header(good, header));
    const std::string error = load_error(odd, {});
    EXPECT_NE(error.find("header field \"step\" is " + std::string(step) + "; allowed: 0 to 9223372036854775807"),
              std::string::npos) << error;
  }
}

TEST(Checkpoint, EveryFlippedByteIsDetected) {
  TempDir dir;
  TrainingState state(/*floats=*/37);
  const auto good = dir.path() / "good.ckpt";
  save_checkpoint(good, state.header, state.views());
  const std::string bytes = read_bytes(good);
  const auto bad = dir.path() / "bad.ckpt";
  std::mt19937 generator(5);
  for (size_t position = 0; position < bytes.size(); ++position) {
    std::string corrupt = bytes;
    corrupt[position] = static_cast<char>(corrupt[position] ^ (1 << (generator() % 8)));
    write_bytes(bad, corrupt);
    ASSERT_FALSE(load_error(bad, state.specs()).empty()) << "a flipped bit at byte " << position << " loaded";
  }
  // Several random bytes overwritten at once.
  for (int trial = 0; trial < 200; ++trial) {
    std::string corrupt = bytes;
    bool changed = false;
    for (int k = 0; k < 4; ++k) {
      const size_t position = generator() % bytes.size();
      const char value = static_cast<char>(generator());
      changed |= corrupt[position] != value;
      corrupt[position] = value;
    }
    if (!changed) continue;
    write_bytes(bad, corrupt);
    ASSERT_FALSE(load_error(bad, state.specs()).empty()) << "random corruption " << trial << " loaded";
  }
}

TEST(Checkpoint, WrongArrayNamesAndLengthsAreRejected) {
  TempDir dir;
  TrainingState state;
  const auto path = dir.path() / "a.ckpt";
  save_checkpoint(path, state.header, state.views());
  EXPECT_NE(load_error(path, {{"weights", 257}, {"adam_m", 256}, {"adam_v", 257}})
                .find("array adam_m has 257 floats, expected 256 for this model"),
            std::string::npos);
  EXPECT_NE(load_error(path, {{"weights", 257}, {"adam_m", 257}, {"adam_v", 257}, {"ema", 257}})
                .find("has no array named ema"),
            std::string::npos);
  EXPECT_NE(load_error(path, {{"weights", 257}, {"adam_m", 257}}).find("has an array adam_v this model does not expect"),
            std::string::npos);
}

TEST(Checkpoint, UnknownVersionMissingFileAndOtherFilesAreRejected) {
  TempDir dir;
  TrainingState state;
  const auto path = dir.path() / "a.ckpt";
  save_checkpoint(path, state.header, state.views());
  std::string bytes = read_bytes(path);
  bytes[8] = 3;  // the version field, little-endian
  write_bytes(path, bytes);
  EXPECT_NE(load_error(path, state.specs()).find("unknown format version 3; this reader supports 1"),
            std::string::npos);

  const std::string missing = load_error(dir.path() / "missing.ckpt", state.specs());
  EXPECT_NE(missing.find("missing.ckpt"), std::string::npos);
  EXPECT_NE(missing.find("no such checkpoint file"), std::string::npos);
  EXPECT_FALSE(load_error(dir.path(), state.specs()).empty());  // a directory

  write_bytes(dir.path() / "text.ckpt", "{\"step\": 1}\n this is JSON, not a checkpoint");
  EXPECT_NE(load_error(dir.path() / "text.ckpt", state.specs()).find("not a checkpoint"), std::string::npos);
}

TEST(Checkpoint, BadArraysToSaveAreRejected) {
  TempDir dir;
  const std::vector<float> values(4, 1.0f);
  EXPECT_THROW(save_checkpoint(dir.path() / "x.ckpt", {}, {{"a", values}, {"a", values}}), CheckpointError);
  EXPECT_THROW(save_checkpoint(dir.path() / "x.ckpt", {}, {{"", values}}), CheckpointError);
  CheckpointHeader header;
  header.model_config = 5;
  EXPECT_THROW(save_checkpoint(dir.path() / "x.ckpt", header, {}), CheckpointError);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "x.ckpt"));
}

TEST(Checkpoint, FailedWriteLeavesThePreviousCheckpointIntact) {
  TempDir dir;
  TrainingState state;
  const auto path = dir.path() / "a.ckpt";
  save_checkpoint(path, state.header, state.views());
  const std::string before = read_bytes(path);

  TrainingState newer;
  newer.header.step = 2000;
  newer.weights = random_floats(257, 99);
  for (uint64_t fail_after : {uint64_t{0}, uint64_t{10}, uint64_t{100}, uint64_t{before.size() - 1}}) {
    CheckpointWriteOptions options;
    options.fail_after_bytes = fail_after;
    EXPECT_THROW(save_checkpoint(path, newer.header, newer.views(), options), CheckpointError);
    EXPECT_EQ(read_bytes(path), before) << "fail after " << fail_after;
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "a.ckpt.tmp"));
    EXPECT_EQ(load_checkpoint(path, state.specs()).header.step, 1234);
  }

  // A real failure too: the temporary file cannot be created (a directory holds its name; this
  // fails even for root, unlike a read-only directory).
  std::filesystem::create_directory(dir.path() / "a.ckpt.tmp");
  try {
    save_checkpoint(path, newer.header, newer.views());
    ADD_FAILURE() << "save over a blocked temporary name succeeded";
  } catch (const CheckpointError& error) {
    EXPECT_NE(std::string(error.what()).find("a.ckpt.tmp"), std::string::npos) << error.what();
  }
  EXPECT_EQ(read_bytes(path), before);
  std::filesystem::remove(dir.path() / "a.ckpt.tmp");

  // A directory that does not exist.
  EXPECT_THROW(save_checkpoint(dir.path() / "no" / "such" / "a.ckpt", newer.header, newer.views()),
               CheckpointError);

  // And the next save, with nothing in the way, replaces it.
  save_checkpoint(path, newer.header, newer.views());
  EXPECT_EQ(load_checkpoint(path, newer.specs()).header.step, 2000);
}

TEST(Checkpoint, LatestAndPruneKeepTheLastN) {
  TempDir dir;
  EXPECT_FALSE(latest_checkpoint(dir.path()).has_value());
  EXPECT_FALSE(latest_checkpoint(dir.path() / "absent").has_value());
  EXPECT_EQ(checkpoint_path(dir.path(), 42).filename(), "checkpoint_00000042.ckpt");

  for (int64_t step : {100, 200, 50, 1000, 300}) {
    CheckpointHeader header;
    header.step = step;
    save_checkpoint(checkpoint_path(dir.path(), step), header, {});
  }
  write_bytes(dir.path() / "notes.txt", "keep me");
  write_bytes(dir.path() / "checkpoint_latest.ckpt", "not a step name");
  EXPECT_EQ(*latest_checkpoint(dir.path()), checkpoint_path(dir.path(), 1000));

  const auto removed = prune_checkpoints(dir.path(), 2);
  EXPECT_EQ(removed.size(), 3u);
  EXPECT_FALSE(std::filesystem::exists(checkpoint_path(dir.path(), 50)));
  EXPECT_FALSE(std::filesystem::exists(checkpoint_path(dir.path(), 200)));
  EXPECT_TRUE(std::filesystem::exists(checkpoint_path(dir.path(), 300)));
  EXPECT_TRUE(std::filesystem::exists(checkpoint_path(dir.path(), 1000)));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "checkpoint_latest.ckpt"));
  EXPECT_THROW(prune_checkpoints(dir.path(), 0), CheckpointError);
}

// A toy "training run" whose whole state is in a checkpoint: parameters drift by the batches the
// sampler draws. Run 10 steps straight, or 4 steps, checkpoint, a fresh process resumes, 6 more:
// the two end states must be bit-identical.
struct ToyRun {
  const TextCorpus& corpus;
  BatchSampler sampler;
  std::vector<float> weights = std::vector<float>(16, 0.5f);
  std::vector<float> adam_m = std::vector<float>(16, 0.0f);
  int64_t step = 0;
  int64_t tokens = 0;

  explicit ToyRun(const TextCorpus& c) : corpus(c), sampler(c, Split::train, 2, 8, 3) {}
  void train_step() {
    const ByteBatch batch = sampler.next();
    for (size_t i = 0; i < weights.size(); ++i) {
      const float gradient = static_cast<float>(batch.bytes[i % batch.bytes.size()]) / 255.0f - weights[i];
      adam_m[i] = 0.9f * adam_m[i] + 0.1f * gradient;
      weights[i] += 0.01f * adam_m[i];
    }
    ++step;
    tokens += batch.batch * batch.sequence;
  }
  void save(const std::filesystem::path& path) const {
    CheckpointHeader header;
    header.step = step;
    header.tokens_seen = tokens;
    header.optimizer_step = step;
    header.schedule_step = step;
    header.sampler_state = sampler.state();
    save_checkpoint(path, header, {{"weights", weights}, {"adam_m", adam_m}});
  }
  void resume(const std::filesystem::path& path) {
    const LoadedCheckpoint loaded = load_checkpoint(path, {{"weights", 16}, {"adam_m", 16}});
    weights = loaded.array("weights");
    adam_m = loaded.array("adam_m");
    step = loaded.header.step;
    tokens = loaded.header.tokens_seen;
    sampler.set_state(loaded.header.sampler_state);
  }
};

TEST(Checkpoint, ResumedRunContinuesBitIdentically) {
  TempDir dir;
  const TextCorpus corpus = small_corpus();
  ToyRun straight(corpus);
  for (int i = 0; i < 10; ++i) straight.train_step();

  ToyRun first(corpus);
  for (int i = 0; i < 4; ++i) {
    first.train_step();
    first.save(checkpoint_path(dir.path(), first.step));
    prune_checkpoints(dir.path(), 2);
  }
  ToyRun resumed(corpus);
  resumed.resume(*latest_checkpoint(dir.path()));
  EXPECT_EQ(resumed.step, 4);
  while (resumed.step < 10) resumed.train_step();
  EXPECT_EQ(resumed.tokens, straight.tokens);
  EXPECT_TRUE(bit_equal(resumed.weights, straight.weights));
  EXPECT_TRUE(bit_equal(resumed.adam_m, straight.adam_m));
}

TEST(Checkpoint, Fnv1aMatchesPublishedValues) {
  // Test vectors of the FNV reference (Landon Curt Noll's fnv test suite).
  EXPECT_EQ(fnv1a_64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a_64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a_64("foobar", 6), 0x85944171f73967e8ull);
  // Continuing a hash equals hashing the concatenation.
  EXPECT_EQ(fnv1a_64("bar", 3, fnv1a_64("foo", 3)), fnv1a_64("foobar", 6));
}

}  // namespace
}  // namespace moe
