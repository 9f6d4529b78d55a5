// file_io.h: the two file operations the record formats in common/ share.
//
// write_file_atomically: readers (the viewer, a notebook) never see a half-written run.json,
// .npy or trace file, because the bytes go to "<path>.tmp" first and are renamed over <path>,
// and a rename within one directory replaces the file in one step.
// read_file_capped: reads a whole file, refusing one larger than a limit with a message that
// names the file, its size and the limit, so a wrong path cannot exhaust memory.
// Both throw moe::RecordError.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace moe {

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

std::string read_file_capped(const std::filesystem::path& path, uint64_t max_bytes);

}  // namespace moe
