// test_text_corpus.cpp: the corpus reader: genre and tag lookup at any byte, plain text files
// (--data FILE), the unigram baseline on a known text, and every bad input with its message.
//   ctest --test-dir build -R TextCorpus
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "file_io.h"       // write_file_atomically, read_file_capped
#include "npy.h"           // write_npy, to write bad tag spans
#include "temp_dir.h"
#include "text_corpus.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

// A corpus of three documents over two genres, written by hand so every offset is known.
TextCorpus three_documents() {
  TextCorpus corpus;
  corpus.source = "test";
  corpus.genres = {{"news", "a", "Press: reportage"}, {"humor", "r", "Humor"}};
  corpus.tag_names = {"at", "nn"};
  corpus.train.bytes = "the cat\n\nmy dog\n\n";  // [0, 9) news, [9, 17) humor
  corpus.train.documents = {{"ca01", 0, 0, 9}, {"cr01", 1, 9, 17}};
  corpus.train.tags = {{0, 3, 0}, {4, 3, 1}, {12, 3, 1}};
  corpus.validation.bytes = "a cow\n\n";
  corpus.validation.documents = {{"ca02", 0, 0, 7}};
  return corpus;
}

void expect_error(const std::function<void()>& action, const std::vector<std::string>& words) {
  try {
    action();
    ADD_FAILURE() << "no TextCorpusError";
  } catch (const TextCorpusError& e) {
    for (const std::string& word : words) EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
}

TEST(TextCorpus, GenreOfEveryByte) {
  const TextCorpus corpus = three_documents();
  for (uint64_t offset = 0; offset < 9; ++offset) EXPECT_EQ(corpus.genre_at(Split::train, offset), 0) << offset;
  for (uint64_t offset = 9; offset < 17; ++offset) EXPECT_EQ(corpus.genre_at(Split::train, offset), 1) << offset;
  EXPECT_EQ(corpus.document_at(Split::train, 9).id, "cr01");
  EXPECT_EQ(corpus.document_at(Split::train, 8).id, "ca01");
  EXPECT_EQ(corpus.genre_at(Split::validation, 6), 0);
  expect_error([&] { corpus.genre_at(Split::train, 17); }, {"17", "past the end", "train"});
  expect_error([&] { corpus.genre_at(Split::validation, 7); }, {"validation"});
}

TEST(TextCorpus, TagOfEveryByte) {
  const TextCorpus corpus = three_documents();
  const int expected[17] = {0, 0, 0, -1, 1, 1, 1, -1, -1, -1, -1, -1, 1, 1, 1, -1, -1};
  for (uint64_t offset = 0; offset < 17; ++offset) EXPECT_EQ(corpus.tag_at(Split::train, offset), expected[offset]) << offset;
  EXPECT_EQ(corpus.tag_at(Split::validation, 0), -1);  // no tags in that split
}

TEST(TextCorpus, WriteAndLoadKeepsGenresDocumentsAndTags) {
  moe::testing::TempDir temp;
  write_text_corpus(temp.path(), three_documents(), "hand-made");
  const TextCorpus loaded = load_corpus(temp.path());  // a directory: a converted corpus
  EXPECT_EQ(loaded.train.bytes, "the cat\n\nmy dog\n\n");
  EXPECT_EQ(loaded.genres[1].name, "humor");
  EXPECT_EQ(loaded.genre_at(Split::train, 10), 1);
  EXPECT_EQ(loaded.tag_at(Split::train, 13), 1);
  const auto index = nlohmann::json::parse(read_file_capped(temp.path() / "index.json", 1 << 20));
  EXPECT_EQ(index["provenance"], "hand-made");
  EXPECT_EQ(index["splits"]["validation"]["file"], "val.txt");
}

TEST(TextCorpus, PlainTextFileIsOneDocumentOfUnknownGenre) {
  moe::testing::TempDir temp;
  std::string text;
  for (int i = 0; i < 100; ++i) text += static_cast<char>('a' + i % 26);
  write_file_atomically(temp.path() / "book.txt", text);
  const TextCorpus corpus = load_corpus(temp.path() / "book.txt");  // a file: plain text
  ASSERT_EQ(corpus.genres.size(), 1u);
  EXPECT_EQ(corpus.genres[0].name, "unknown");
  EXPECT_EQ(corpus.train.bytes, text.substr(0, 90));  // the last 10% is validation
  EXPECT_EQ(corpus.validation.bytes, text.substr(90));
  EXPECT_EQ(corpus.train.documents.size(), 1u);
  EXPECT_EQ(corpus.genre_at(Split::validation, 9), 0);
  EXPECT_TRUE(corpus.tag_names.empty());
}

// ---- the unigram baseline ----

TEST(TextCorpus, UnigramBitsPerByteOnAKnownText) {
  // train "aab": p(a) = (2+1)/(3+256), p(b) = (1+1)/(3+256); evaluated "ab".
  const double expected = -(std::log2(3.0 / 259.0) + std::log2(2.0 / 259.0)) / 2.0;
  EXPECT_DOUBLE_EQ(unigram_bits_per_byte("aab", "ab"), expected);
  // A byte never seen in training costs log2(N + 256) bits, not infinity.
  EXPECT_DOUBLE_EQ(unigram_bits_per_byte("aab", "z"), std::log2(259.0));
  // Nothing learned: every byte is 1/256, exactly 8 bits.
  EXPECT_DOUBLE_EQ(unigram_bits_per_byte("", "hello"), 8.0);
  // One symbol seen a million times: close to zero bits.
  EXPECT_LT(unigram_bits_per_byte(std::string(1000000, 'x'), "xxxx"), 0.001);
  EXPECT_THROW(unigram_bits_per_byte("abc", ""), TextCorpusError);
}

// ---- bad input: each message names the file and says what to do ----

TEST(TextCorpus, MissingCorpusSaysHowToFetchIt) {
  moe::testing::TempDir temp;
  expect_error([&] { load_text_corpus(temp.path()); }, {"index.json", "fetch.sh", "--data"});
  expect_error([&] { load_corpus(temp.path() / "nothing.txt"); }, {"nothing.txt", "fetch.sh"});
  expect_error([&] { load_plain_text(temp.path() / "nothing.txt"); }, {"nothing.txt", "no such file"});
}

TEST(TextCorpus, EmptyOrTinyTextFileIsAnError) {
  moe::testing::TempDir temp;
  write_file_atomically(temp.path() / "empty.txt", "");
  expect_error([&] { load_corpus(temp.path() / "empty.txt"); }, {"empty.txt", "empty"});
  write_file_atomically(temp.path() / "tiny.txt", "abc");
  expect_error([&] { load_corpus(temp.path() / "tiny.txt"); }, {"tiny.txt", "too small"});
}

class TextCorpusIndex : public ::testing::Test {
 protected:
  void SetUp() override {
    write_text_corpus(temp.path(), three_documents(), "hand-made");
    original_ = nlohmann::json::parse(read_file_capped(temp.path() / "index.json", 1 << 20));
  }
  // The index as written, to change one field at a time.
  nlohmann::json index() const { return original_; }
  void write_index(const nlohmann::json& value) { write_file_atomically(temp.path() / "index.json", value.dump()); }
  moe::testing::TempDir temp;

 private:
  nlohmann::json original_;
};

TEST_F(TextCorpusIndex, NotJson) {
  write_file_atomically(temp.path() / "index.json", "{\"format\": ");
  expect_error([&] { load_text_corpus(temp.path()); }, {"index.json", "not valid JSON", "fetch.sh"});
  write_file_atomically(temp.path() / "index.json", "");
  expect_error([&] { load_text_corpus(temp.path()); }, {"index.json", "empty"});
}

TEST_F(TextCorpusIndex, WrongFormatOrVersion) {
  auto value = index();
  value["format"] = "something-else";
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"format"});
  value = index();
  value["format"] = "moe-text-corpus";
  value["version"] = 99;
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"version"});
}

TEST_F(TextCorpusIndex, MissingOrMistypedField) {
  auto value = index();
  value["splits"]["train"].erase("bytes");
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"splits.train.bytes", "missing"});
  value = index();
  value["splits"]["validation"]["documents"][0]["end"] = "seven";
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"splits.validation.documents[0].end", "integer"});
}

TEST_F(TextCorpusIndex, SizeDisagreesWithTheFile) {
  write_file_atomically(temp.path() / "train.txt", "the cat\n\nmy do");  // truncated
  expect_error([&] { load_text_corpus(temp.path()); }, {"train.txt", "index.json says 17", "fetch.sh"});
}

TEST_F(TextCorpusIndex, DocumentsThatDoNotTileTheSplit) {
  auto value = index();
  value["splits"]["train"]["documents"][1]["begin"] = 10;
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"documents[1].begin", "tile"});
  value = index();
  value["splits"]["train"]["documents"][1]["end"] = 16;
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"cover 16 of 17"});
}

TEST_F(TextCorpusIndex, UnknownGenre) {
  auto value = index();
  value["splits"]["train"]["documents"][0]["genre"] = "poetry";
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"'poetry'", "genre"});
}

TEST_F(TextCorpusIndex, MissingSplitFile) {
  fs::remove(temp.path() / "val.txt");
  expect_error([&] { load_text_corpus(temp.path()); }, {"val.txt", "no such file"});
}

TEST_F(TextCorpusIndex, EmptySplitFile) {
  write_file_atomically(temp.path() / "val.txt", "");
  auto value = index();
  value["splits"]["validation"]["bytes"] = 0;
  value["splits"]["validation"]["documents"] = nlohmann::json::array();
  write_index(value);
  expect_error([&] { load_text_corpus(temp.path()); }, {"val.txt", "empty"});
}

TEST_F(TextCorpusIndex, BadTagSpans) {
  write_file_atomically(temp.path() / "train.tags.npy", "not an npy file");
  expect_error([&] { load_text_corpus(temp.path()); }, {"train.tags.npy"});
  write_npy(temp.path() / "train.tags.npy", std::vector<int32_t>{0, 3, 0, 15, 5, 1}, {2, 3});  // past the end
  expect_error([&] { load_text_corpus(temp.path()); }, {"train.tags.npy", "row 1"});
  write_npy(temp.path() / "train.tags.npy", std::vector<int32_t>{0, 3, 7}, {1, 3});  // unknown tag
  expect_error([&] { load_text_corpus(temp.path()); }, {"train.tags.npy", "row 0"});
  // Without tags the same corpus loads: the tags are optional.
  CorpusLoadOptions options;
  options.load_tags = false;
  EXPECT_EQ(load_text_corpus(temp.path(), options).train.bytes.size(), 17u);
}

}  // namespace
}  // namespace moe
