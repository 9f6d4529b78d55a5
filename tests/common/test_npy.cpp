// test_npy.cpp: .npy files written and read back for every dtype and odd shapes, the exact
// header numpy expects, every corrupt case, and random bytes.
//   ctest --test-dir build -R Npy
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "npy.h"
#include "temp_dir.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

const std::vector<std::vector<int64_t>> kShapes = {{}, {0}, {5}, {2, 3}, {2, 0, 4}, {1, 1, 2, 3}};

template <typename T>
void round_trip_every_shape(const fs::path& dir) {
  for (const auto& shape : kShapes) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    std::vector<T> values(static_cast<size_t>(count));
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<T>(i * 7 + 1);
    const fs::path path = dir / (std::string("a") + std::to_string(shape.size()) + ".npy");
    write_npy(path, values, shape);
    const NpyArray back = read_npy(path);
    EXPECT_EQ(back.dtype, npy_dtype_of<T>());
    EXPECT_EQ(back.shape, shape);
    EXPECT_EQ(back.element_count(), count);
    EXPECT_EQ(back.values<T>(), values);
    // numpy aligns the data to 64 bytes; so do we.
    EXPECT_EQ((fs::file_size(path) - back.data.size()) % 64, 0u);
  }
}

TEST(Npy, RoundTripsEveryDtypeAndShape) {
  moe::testing::TempDir temp;
  round_trip_every_shape<float>(temp.path());
  round_trip_every_shape<double>(temp.path());
  round_trip_every_shape<int32_t>(temp.path());
  round_trip_every_shape<int64_t>(temp.path());
  round_trip_every_shape<uint8_t>(temp.path());
  round_trip_every_shape<uint16_t>(temp.path());  // bfloat16 raw bits
}

TEST(Npy, KeepsExactValues) {
  const std::vector<float> values = {1.5f, -0.0f, 3.4e38f, 1e-45f};
  const NpyArray back = parse_npy(serialize_npy(make_npy(values, {4})));
  EXPECT_EQ(back.values<float>(), values);
  const std::vector<int64_t> big = {INT64_MIN, INT64_MAX, 0};
  EXPECT_EQ(parse_npy(serialize_npy(make_npy(big, {3, 1}))).values<int64_t>(), big);
}

TEST(Npy, HeaderIsTheOneNumpyWrites) {
  const std::string bytes = serialize_npy(make_npy(std::vector<float>(6), {2, 3}));
  ASSERT_GE(bytes.size(), 128u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_length = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
  EXPECT_EQ((10 + header_length) % 64, 0u);
  const std::string header = bytes.substr(10, header_length);
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 0), 0u) << header;
  EXPECT_EQ(header.back(), '\n');
  const std::string one_d = serialize_npy(make_npy(std::vector<uint8_t>(3), {3}));
  EXPECT_NE(one_d.find("'descr': '|u1'"), std::string::npos);
  EXPECT_NE(one_d.find("'shape': (3,)"), std::string::npos);
  EXPECT_NE(serialize_npy(make_npy(std::vector<double>{2.0}, {})).find("'shape': ()"), std::string::npos);
}

TEST(Npy, AcceptsHeadersWrittenByOtherTools) {
  // Double quotes, other key order, no trailing comma, format 2.0.
  std::string header = "{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<i4\"}\n";
  std::string bytes = std::string("\x93NUMPY\x02\x00", 8);
  for (int i = 0; i < 4; ++i) bytes += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  bytes += header + std::string("\x01\x00\x00\x00\x02\x00\x00\x00", 8);
  EXPECT_EQ(parse_npy(bytes).values<int32_t>(), (std::vector<int32_t>{1, 2}));
}

std::string error_of(const std::string& bytes) {
  try {
    parse_npy(bytes, "x.npy");
  } catch (const RecordError& e) {
    return e.what();
  }
  return "(no RecordError thrown)";
}

std::string with_header(const std::string& header, const std::string& data, char major = 1) {
  std::string bytes = std::string("\x93NUMPY", 6) + major + '\0';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  return bytes + header + data;
}

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

TEST(Npy, RejectsCorruptFilesWithClearErrors) {
  const std::string good = serialize_npy(make_npy(std::vector<float>{1, 2, 3, 4}, {2, 2}));
  EXPECT_CONTAINS(error_of("PK\x03\x04 not numpy"), "bad magic");
  EXPECT_CONTAINS(error_of(""), "bad magic");
  EXPECT_CONTAINS(error_of(good.substr(0, 7)), "truncated");
  EXPECT_CONTAINS(error_of(good.substr(0, 9)), "truncated");
  EXPECT_CONTAINS(error_of(good.substr(0, 40)), "truncated .npy header");
  std::string version = good;
  version[6] = 4;
  EXPECT_CONTAINS(error_of(version), "unsupported .npy format version 4.0");
  EXPECT_CONTAINS(error_of(with_header("{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }\n",
                                       std::string(8, '\0'))),
                  "unsupported .npy dtype '<c8'");
  EXPECT_CONTAINS(error_of(with_header("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }\n",
                                       std::string(4, '\0'))),
                  "'>f4'");
  EXPECT_CONTAINS(error_of(with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n",
                                       std::string(16, '\0'))),
                  "fortran_order True");
  EXPECT_CONTAINS(error_of(good.substr(0, good.size() - 1)), "shorter than the shape");
  EXPECT_CONTAINS(error_of(good + "x"), "extra bytes");
  EXPECT_CONTAINS(error_of(with_header("{'descr': '<f4', 'shape': (2,), }\n", std::string(8, '\0'))),
                  "must have");
  EXPECT_CONTAINS(error_of(with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }\n", "")),
                  "dimension");
  EXPECT_CONTAINS(error_of(with_header("{'descr': '<f4', 'fortran_order': False, "
                                       "'shape': (4294967296, 4294967296, 4294967296), }\n",
                                       "")),
                  "shorter than the shape");
  EXPECT_THROW(parse_npy(good).values<double>(), RecordError);
  EXPECT_THROW(make_npy(std::vector<float>(5), {2, 2}), RecordError);
  EXPECT_THROW(read_npy("/nonexistent/x.npy"), RecordError);
}

TEST(NpyFuzz, MutatedAndRandomBytesParseOrThrowRecordError) {
  std::mt19937_64 random(7);
  std::vector<std::string> seeds = {
      serialize_npy(make_npy(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3})),
      serialize_npy(make_npy(std::vector<uint8_t>{}, {0})),
      serialize_npy(make_npy(std::vector<int64_t>{42}, {})),
  };
  int parsed = 0, rejected = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string bytes = seeds[i % seeds.size()];
    const int edits = 1 + static_cast<int>(random() % 4);
    for (int e = 0; e < edits && !bytes.empty(); ++e) {
      const size_t at = random() % bytes.size();
      switch (random() % 5) {
        case 0: bytes[at] = static_cast<char>(random()); break;
        case 1: bytes.resize(at); break;
        case 2: bytes.insert(at, 1, "0123456789(),' TrueFalse{}:"[random() % 27]); break;
        case 3: bytes.erase(at, 1); break;
        case 4: bytes[at] = static_cast<char>(bytes[at] ^ (1 << (random() % 8))); break;
      }
    }
    if (i % 10 == 9) {  // pure noise, sometimes with the right magic
      bytes.assign(random() % 200, '\0');
      for (char& c : bytes) c = static_cast<char>(random());
      if (i % 20 == 19) bytes = std::string("\x93NUMPY\x01\x00", 8) + bytes;
    }
    try {
      const NpyArray array = parse_npy(bytes);
      EXPECT_EQ(static_cast<uint64_t>(array.element_count() * npy_item_size(array.dtype)), array.data.size());
      ++parsed;
    } catch (const RecordError&) {
      ++rejected;
    }
  }
  EXPECT_GT(parsed, 20);  // strict checks reject most mutations; some still parse
  EXPECT_GT(rejected, 1000);
}

}  // namespace
}  // namespace moe
