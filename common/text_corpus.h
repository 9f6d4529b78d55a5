// text_corpus.h: the training text of the byte-level language model, as the training programs see it.
//
// A TextCorpus is two byte streams, "train" and "validation", each a concatenation of whole
// documents, and for every document its id and genre. Training reads windows of these bytes
// (batch_sampler.h); the run records count expert load per genre through genre_at(); the unigram
// baseline below is the number a trained model's validation bits per byte is compared with.
//
// Two sources:
//   load_text_corpus("notebooks_data/brown")  a converted corpus (moe_brown_convert writes it):
//       index.json                 genres, POS tag names, and per split its file and documents
//       train.txt, val.txt         the byte streams of the splits "train" and "validation"
//       train.tags.npy, val.tags.npy   optional, int32 [N, 3]: (begin, length, tag) for each word
//                                  or punctuation token, begin a byte offset into its split
//   load_plain_text("book.txt")              any text file (--data FILE): one document of genre
//       "unknown"; its last 10% of bytes (cut at a byte, no parsing) is the validation split.
//   load_corpus(path) picks one of the two: a directory is a converted corpus, a file is plain text.
//
// Every problem is a moe::TextCorpusError whose message names the file and says what to do:
// a missing corpus says how to fetch it, a corrupt index names the field, an empty file says so.
//
//   cmake --build build --target moe_common   (tests: ctest --test-dir build -R text_corpus)
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

class TextCorpusError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Split { train, validation };
const char* split_name(Split split);  // "train", "validation"

struct Genre {
  std::string name;   // short id, e.g. "news", "science_fiction"; "unknown" for plain text
  std::string code;   // the Brown category letter "a".."r"; "" for plain text
  std::string title;  // e.g. "Press: reportage"
};

// One document inside a split's byte stream: bytes [begin, end). Documents tile the stream.
struct CorpusDocument {
  std::string id;  // e.g. "ca01"
  int genre = 0;   // index into TextCorpus::genres
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A part-of-speech tag on the bytes [begin, begin + length) of a split (spaces carry no tag).
struct TagSpan {
  uint64_t begin = 0;
  uint32_t length = 0;
  int tag = 0;  // index into TextCorpus::tag_names
};

struct CorpusSplit {
  std::string bytes;
  std::vector<CorpusDocument> documents;  // in stream order
  std::vector<TagSpan> tags;              // sorted by begin; empty when the corpus has no tags
};

struct TextCorpus {
  std::string source;                  // where it came from, for messages and run records
  std::vector<Genre> genres;
  std::vector<std::string> tag_names;  // empty when the corpus has no tags
  CorpusSplit train;
  CorpusSplit validation;

  const CorpusSplit& split(Split which) const { return which == Split::train ? train : validation; }
  CorpusSplit& split(Split which) { return which == Split::train ? train : validation; }
  // The document holding byte `offset` of a split; throws if offset is past the end.
  const CorpusDocument& document_at(Split which, uint64_t offset) const;
  // The genre (index into genres) of byte `offset` of a split; throws if offset is past the end.
  int genre_at(Split which, uint64_t offset) const;
  // The POS tag (index into tag_names) on byte `offset`, or -1 for a byte between tokens or a
  // corpus without tags.
  int tag_at(Split which, uint64_t offset) const;
};

// Reading. Files larger than max_file_bytes are refused (a wrong path must not exhaust memory).
struct CorpusLoadOptions {
  bool load_tags = true;  // read the .tags.npy files when the index names them
  uint64_t max_file_bytes = uint64_t{1} << 32;
};
TextCorpus load_text_corpus(const std::filesystem::path& directory, const CorpusLoadOptions& options = {});
TextCorpus load_plain_text(const std::filesystem::path& file, const CorpusLoadOptions& options = {});
TextCorpus load_corpus(const std::filesystem::path& path, const CorpusLoadOptions& options = {});

// Writing (the converter's side): index.json, train.txt, val.txt and, when tag_names is not
// empty, train.tags.npy and val.tags.npy into `directory` (created if missing), each file written atomically.
// `provenance` is stored in the index as it is (where the text came from, how it was split).
void write_text_corpus(const std::filesystem::path& directory, const TextCorpus& corpus,
                       const std::string& provenance);

// The unigram baseline: bits per byte of `evaluated` under the byte frequencies of `trained`,
//   p(b) = (count(b) + 1) / (N + 256),   bits/byte = -mean over evaluated bytes of log2 p(b),
// add-one (Laplace) smoothing so a byte never seen in training costs log2(N + 256) bits, not
// infinity. A model that learns nothing beyond byte frequencies scores about this.
double unigram_bits_per_byte(std::string_view trained, std::string_view evaluated);

}  // namespace moe
