// test_brown_convert.cpp: the Brown converter on the hand-made sample in brown_sample/ (the
// package's layout): tags stripped, spacing restored, headlines, genres from the file letter,
// the validation split by whole documents and stratified by genre, the same files on every run.
//   ctest --test-dir build -R BrownConvert
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>
#include <string>

#include "brown_corpus.h"
#include "file_io.h"  // read_file_capped
#include "temp_dir.h"
#include "text_corpus.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

const fs::path kSample = MOE_BROWN_SAMPLE_DIR;

std::string read_text(const fs::path& path) { return read_file_capped(path, uint64_t{1} << 24); }

std::vector<std::string> document_ids(const CorpusSplit& split) {
  std::vector<std::string> ids;
  for (const CorpusDocument& document : split.documents) ids.push_back(document.id);
  return ids;
}

TEST(BrownConvert, StripsTagsAndRestoresSpacing) {
  std::vector<std::string> tag_names;
  const BrownDocument document = parse_brown_document("ca01", read_text(kSample / "ca01"), tag_names);
  // Quotes `` '' become ", no space before , . ; ) or after ( and around --, single quotes paired,
  // one period after "Jr.", 1/2 keeps its slash, a headline on its own line, a blank line at the end.
  EXPECT_EQ(document.text,
            "The city council voted Monday to repair the old bridge.\n"
            "Mayor John Smith Jr. said, \"We can't wait any longer\". "
            "Work begins in May (weather permitting)--and ends about 1/2 mile away.\n"
            "Costs rise\n"
            "The bill, he said, will be 'modest'; nobody agreed. The bridge was built by Tom Brown Jr.\n"
            "\n");
  EXPECT_EQ(document.id, "ca01");
  EXPECT_EQ(brown_genres()[static_cast<size_t>(document.genre)].name, "news");
}

TEST(BrownConvert, TagSpansCoverTheirWords) {
  std::vector<std::string> tag_names;
  const BrownDocument document = parse_brown_document("ca01", read_text(kSample / "ca01"), tag_names);
  ASSERT_FALSE(document.tags.empty());
  auto word_of = [&](const TagSpan& span) { return document.text.substr(span.begin, span.length); };
  auto tag_of = [&](const TagSpan& span) { return tag_names[static_cast<size_t>(span.tag)]; };
  EXPECT_EQ(word_of(document.tags[0]), "The");
  EXPECT_EQ(tag_of(document.tags[0]), "at");
  uint64_t previous_end = 0;
  int found = 0;
  for (const TagSpan& span : document.tags) {
    EXPECT_GE(span.begin, previous_end);  // sorted, no overlap
    previous_end = span.begin + span.length;
    EXPECT_EQ(word_of(span).find_first_of(" \n"), std::string::npos);
    if (word_of(span) == "can't") { EXPECT_EQ(tag_of(span), "md*"); ++found; }
    if (word_of(span) == "1/2") { EXPECT_EQ(tag_of(span), "cd"); ++found; }
    if (word_of(span) == "Costs") { EXPECT_EQ(tag_of(span), "nns-hl"); ++found; }
    if (word_of(span) == "\"") { EXPECT_TRUE(tag_of(span) == "``" || tag_of(span) == "''"); ++found; }
  }
  EXPECT_EQ(found, 5);
  EXPECT_LE(previous_end, document.text.size());
}

TEST(BrownConvert, GenresFollowTheCategoryLetter) {
  const std::vector<Genre>& genres = brown_genres();
  ASSERT_EQ(genres.size(), 15u);
  std::string letters;
  for (const Genre& genre : genres) letters += genre.code;
  EXPECT_EQ(letters, "abcdefghjklmnpr");  // the Brown categories skip i, o and q
  EXPECT_EQ(genres[static_cast<size_t>(brown_genre_of_letter('a'))].name, "news");
  EXPECT_EQ(genres[static_cast<size_t>(brown_genre_of_letter('m'))].name, "science_fiction");
  EXPECT_EQ(genres[static_cast<size_t>(brown_genre_of_letter('r'))].title, "Humor");
  EXPECT_EQ(brown_genre_of_letter('i'), -1);
  EXPECT_EQ(brown_genre_of_letter('z'), -1);
}

TEST(BrownConvert, ValidationPositionsAreEvenlySpacedPerGenre) {
  EXPECT_EQ(validation_positions(80, 0.1), (std::vector<size_t>{5, 15, 25, 35, 45, 55, 65, 75}));
  EXPECT_EQ(validation_positions(9, 0.1), (std::vector<size_t>{4}));  // humor: at least one
  EXPECT_EQ(validation_positions(6, 0.1), (std::vector<size_t>{3}));
  EXPECT_EQ(validation_positions(2, 0.1), (std::vector<size_t>{1}));
  EXPECT_TRUE(validation_positions(1, 0.1).empty());  // a lone document stays in training
  EXPECT_EQ(validation_positions(4, 0.5), (std::vector<size_t>{1, 3}));
  EXPECT_THROW(validation_positions(10, 1.0), TextCorpusError);
  EXPECT_THROW(validation_positions(10, -0.1), TextCorpusError);
}

TEST(BrownConvert, SplitTakesWholeDocumentsStratifiedByGenre) {
  std::string provenance;
  const TextCorpus corpus = convert_brown(kSample, {}, provenance);
  // news ca01..ca04: one held out at position 2; editorial cb01, cb02: position 1;
  // adventure and humor have one document each, which stays in training.
  EXPECT_EQ(document_ids(corpus.train), (std::vector<std::string>{"ca01", "ca02", "ca04", "cb01", "cn01", "cr01"}));
  EXPECT_EQ(document_ids(corpus.validation), (std::vector<std::string>{"ca03", "cb02"}));

  BrownConvertOptions half;
  half.validation_fraction = 0.5;
  const TextCorpus halved = convert_brown(kSample, half, provenance);
  EXPECT_EQ(document_ids(halved.validation), (std::vector<std::string>{"ca02", "ca04", "cb02"}));

  // Each document's bytes in its split are exactly that document, converted alone.
  for (Split which : {Split::train, Split::validation}) {
    const CorpusSplit& split = corpus.split(which);
    uint64_t expected_begin = 0;
    for (const CorpusDocument& document : split.documents) {
      EXPECT_EQ(document.begin, expected_begin);
      expected_begin = document.end;
      std::vector<std::string> tag_names;
      const BrownDocument alone = parse_brown_document(document.id, read_text(kSample / document.id), tag_names);
      EXPECT_EQ(split.bytes.substr(document.begin, document.end - document.begin), alone.text) << document.id;
      EXPECT_EQ(document.genre, alone.genre);
      EXPECT_EQ(corpus.genres[static_cast<size_t>(document.genre)].code[0], document.id[1]);
    }
    EXPECT_EQ(expected_begin, split.bytes.size());
  }
  EXPECT_NE(provenance.find("validation"), std::string::npos);
}

TEST(BrownConvert, WritesTheSameFilesEveryRun) {
  moe::testing::TempDir temp;
  for (const char* name : {"first", "second"}) {
    std::string provenance;
    write_text_corpus(temp.path() / name, convert_brown(kSample, {}, provenance), provenance);
  }
  for (const char* file : {"index.json", "train.txt", "val.txt", "train.tags.npy", "val.tags.npy"}) {
    ASSERT_TRUE(fs::exists(temp.path() / "first" / file)) << file;
    EXPECT_EQ(read_text(temp.path() / "first" / file), read_text(temp.path() / "second" / file)) << file;
  }
}

TEST(BrownConvert, WrittenCorpusLoadsBackTheSame) {
  moe::testing::TempDir temp;
  std::string provenance;
  const TextCorpus converted = convert_brown(kSample, {}, provenance);
  write_text_corpus(temp.path(), converted, provenance);
  const TextCorpus loaded = load_text_corpus(temp.path());
  EXPECT_EQ(loaded.tag_names, converted.tag_names);
  ASSERT_EQ(loaded.genres.size(), converted.genres.size());
  for (Split which : {Split::train, Split::validation}) {
    const CorpusSplit& a = converted.split(which);
    const CorpusSplit& b = loaded.split(which);
    EXPECT_EQ(a.bytes, b.bytes);
    ASSERT_EQ(a.documents.size(), b.documents.size());
    for (size_t i = 0; i < a.documents.size(); ++i) {
      EXPECT_EQ(a.documents[i].id, b.documents[i].id);
      EXPECT_EQ(a.documents[i].genre, b.documents[i].genre);
      EXPECT_EQ(a.documents[i].begin, b.documents[i].begin);
      EXPECT_EQ(a.documents[i].end, b.documents[i].end);
    }
    ASSERT_EQ(a.tags.size(), b.tags.size());
    for (size_t i = 0; i < a.tags.size(); ++i) {
      EXPECT_EQ(a.tags[i].begin, b.tags[i].begin);
      EXPECT_EQ(a.tags[i].length, b.tags[i].length);
      EXPECT_EQ(a.tags[i].tag, b.tags[i].tag);
    }
  }
  // The tag of a byte inside "council" in the first training document.
  const uint64_t council = loaded.train.bytes.find("council");
  EXPECT_EQ(loaded.tag_names[static_cast<size_t>(loaded.tag_at(Split::train, council + 2))], "nn");
  EXPECT_EQ(loaded.tag_at(Split::train, council - 1), -1);  // the space before it
}

TEST(BrownConvert, WithoutTagsWritesNoTagFiles) {
  moe::testing::TempDir temp;
  std::string provenance;
  BrownConvertOptions options;
  options.keep_tags = false;
  write_text_corpus(temp.path(), convert_brown(kSample, options, provenance), provenance);
  EXPECT_FALSE(fs::exists(temp.path() / "train.tags.npy"));
  const TextCorpus loaded = load_text_corpus(temp.path());
  EXPECT_TRUE(loaded.tag_names.empty());
  EXPECT_EQ(loaded.tag_at(Split::train, 0), -1);
}

// ---- bad input ----

void copy_sample(const fs::path& to) {
  fs::create_directories(to);
  for (const auto& entry : fs::directory_iterator(kSample)) fs::copy_file(entry.path(), to / entry.path().filename());
}

void expect_error(const std::function<void()>& action, const std::vector<std::string>& words) {
  try {
    action();
    ADD_FAILURE() << "no TextCorpusError";
  } catch (const TextCorpusError& e) {
    for (const std::string& word : words) EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
}

TEST(BrownConvert, TokenWithoutTagNamesTheDocumentAndLine) {
  std::vector<std::string> tag_names;
  expect_error([&] { parse_brown_document("ca09", "\n\tThe/at cat sat/vbd ./.\n", tag_names); },
               {"ca09", "line 2", "'cat'"});
}

TEST(BrownConvert, DocumentWithoutTextIsAnError) {
  std::vector<std::string> tag_names;
  expect_error([&] { parse_brown_document("ca09", "\n\n\n", tag_names); }, {"ca09", "no text"});
}

TEST(BrownConvert, CategoriesFileMustAgreeWithTheLetters) {
  moe::testing::TempDir temp;
  copy_sample(temp.path());
  write_file_atomically(temp.path() / "cats.txt", "ca01 news\ncb01 humor\n");
  std::string provenance;
  expect_error([&] { convert_brown(temp.path(), {}, provenance); }, {"cats.txt", "cb01", "humor", "editorial"});
}

TEST(BrownConvert, MissingOrEmptyPackageSaysWhatToDo) {
  moe::testing::TempDir temp;
  std::string provenance;
  expect_error([&] { convert_brown(temp.path() / "nowhere", {}, provenance); }, {"nowhere", "fetch.sh"});
  expect_error([&] { convert_brown(temp.path(), {}, provenance); }, {"no Brown documents"});
}

}  // namespace
}  // namespace moe
