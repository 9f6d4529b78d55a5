// test_safetensors.cpp: the safetensors reader and writer (common/safetensors.h): a round trip of
// every typed view with metadata, the writer's bytes against a hand-built file of the format, a
// hand-built file with half-precision dtypes read back, a file written by the Python library,
// every error of the reader and the writer, and the atomic save.
// Run: cmake --build build --target test_safetensors && ctest --test-dir build -R Safetensors
#include <gmock/gmock.h>  // HasSubstr
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "safetensors.h"
#include "temp_dir.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

// The 8-byte little-endian length, then the header text, then the data.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + header + data;
}

template <typename T>
std::string raw(std::initializer_list<T> values) {
  std::string out;
  for (T value : values) out.append(reinterpret_cast<const char*>(&value), sizeof(T));
  return out;
}

// The message of the SafetensorsError that f throws, or "" if it throws none.
template <typename Function>
std::string error_of(Function&& f) {
  try {
    f();
  } catch (const SafetensorsError& error) {
    return error.what();
  }
  return "";
}

std::string parse_error(const std::string& bytes) {
  return error_of([&] { SafetensorsFile::parse(bytes, "bad.safetensors"); });
}

// ---- writing and reading back ----

TEST(Safetensors, RoundTripOfEveryTypedViewWithMetadata) {
  testing::TempDir dir;
  const std::vector<float> f32 = {1.5f, -2.25f, 3e-8f, 0.0f, -0.0f, 7.0f};
  const std::vector<double> f64 = {std::acos(-1.0), -1e300, 1e-300};
  const std::vector<int32_t> i32 = {-7};
  const std::vector<int64_t> i64 = {int64_t{1} << 40, -3};
  const std::vector<float> empty;
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"config", R"({"D": 8})"}};
  const auto path = dir.path() / "round.safetensors";
  save_safetensors(path,
                   {tensor_view("blocks.0.w", {2, 3}, std::span<const float>(f32)),
                    tensor_view("pi", {3}, std::span<const double>(f64)),
                    tensor_view("scalar", {}, std::span<const int32_t>(i32)),
                    tensor_view("big", {2}, std::span<const int64_t>(i64)),
                    tensor_view("nothing", {0, 4}, std::span<const float>(empty))},
                   metadata);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "round.safetensors.tmp"));

  const SafetensorsFile file = SafetensorsFile::load(path);
  EXPECT_EQ(file.metadata(), metadata);
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.tensors()[0].name, "blocks.0.w");  // data order is the order written
  EXPECT_EQ(file.info("blocks.0.w").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(file.info("blocks.0.w").dtype, Dtype::f32);
  EXPECT_EQ(file.info("pi").dtype, Dtype::f64);
  EXPECT_EQ(file.info("scalar").shape, std::vector<int64_t>{});
  EXPECT_EQ(file.info("scalar").elements(), 1);
  EXPECT_EQ(file.info("nothing").elements(), 0);
  EXPECT_EQ(file.to_float("blocks.0.w"), f32);
  EXPECT_EQ(file.to_double("pi"), f64);
  EXPECT_EQ(file.to_double("scalar"), std::vector<double>{-7.0});
  EXPECT_EQ(file.to_double("big"), (std::vector<double>{std::ldexp(1.0, 40), -3.0}));
  EXPECT_TRUE(file.to_double("nothing").empty());
  const std::span<const std::byte> bytes = file.bytes("pi");
  ASSERT_EQ(bytes.size(), 24u);
  EXPECT_EQ(std::memcmp(bytes.data(), f64.data(), 24), 0);

  // The data starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_length = 0;
  in.read(reinterpret_cast<char*>(&header_length), 8);
  EXPECT_EQ((8 + header_length) % 8, 0u);
}

// The writer's output is the format byte for byte: the length, the JSON in the order given, spaces
// to a multiple of 8, then the little-endian values.
TEST(Safetensors, EncodesTheSpecificationByteForByte) {
  const std::vector<float> a = {1.0f, -2.0f};
  const std::vector<int32_t> b = {7};
  const std::string encoded = encode_safetensors(
      {tensor_view("a", {2}, std::span<const float>(a)), tensor_view("b", {}, std::span<const int32_t>(b))},
      {{"k", "v"}});
  const std::string header =
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I32","shape":[],"data_offsets":[8,12]}})"
      "    ";  // 132 bytes of JSON + 4 spaces = 136 = 0x88
  const std::string expected = std::string("\x88\0\0\0\0\0\0\0", 8) + header +
                               std::string("\x00\x00\x80\x3f"    // 1.0f
                                           "\x00\x00\x00\xc0"    // -2.0f
                                           "\x07\x00\x00\x00",   // 7
                                           12);
  EXPECT_EQ(encoded, expected);
}

// A file as another writer may make it: keys in any order, no metadata, no padding, tensors listed
// out of data order, half-precision and integer dtypes.
TEST(Safetensors, ReadsAHandBuiltFileWithEveryConvertedDtype) {
  const std::string header =
      R"({"h":{"shape":[4],"data_offsets":[4,12],"dtype":"F16"},)"
      R"( "b":{"data_offsets":[0,4],"dtype":"BF16","shape":[1,2]},)"
      R"( "i":{"dtype":"I64","shape":[1],"data_offsets":[12,20]},)"
      R"( "u":{"dtype":"U8","shape":[2],"data_offsets":[20,22]},)"
      R"( "f8":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[22,23]}})";
  const std::string data = raw<uint16_t>({0x3f80, 0xc000}) +                  // BF16 1, -2
                           raw<uint16_t>({0x3c00, 0xb800, 0x0001, 0x7c00}) +  // F16 1, -0.5, 2^-24, inf
                           raw<int64_t>({-5}) + raw<uint8_t>({0, 255}) + raw<uint8_t>({0x38});
  const SafetensorsFile file = SafetensorsFile::parse(file_bytes(header, data), "hand.safetensors");
  EXPECT_TRUE(file.metadata().empty());
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.tensors()[0].name, "b");  // sorted by data offset
  EXPECT_EQ(file.to_double("b"), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(file.to_double("h"), (std::vector<double>{1.0, -0.5, std::ldexp(1.0, -24), INFINITY}));
  EXPECT_EQ(file.to_double("i"), std::vector<double>{-5.0});
  EXPECT_EQ(file.to_double("u"), (std::vector<double>{0.0, 255.0}));
  EXPECT_EQ(file.bytes("f8").size(), 1u);
  EXPECT_THAT(error_of([&] { file.to_double("f8"); }), HasSubstr("tensor 'f8' is F8_E4M3"));
  EXPECT_TRUE(file.contains("h"));
  EXPECT_FALSE(file.contains("w"));
}

// A file written by the Python library (safetensors 0.8.0, PyTorch 2.11) on the GPU machine:
//   save_file({"w_bf16": torch.tensor([[1.0, -2.5], [3.0, 0.125]], dtype=torch.bfloat16),
//              "h_f16": torch.tensor([1.0, -0.5, 65504.0], dtype=torch.float16),
//              "i_i64": torch.tensor([-5, 7]), "s_f32": torch.tensor(2.5),
//              "z_i32": torch.zeros((0, 3), dtype=torch.int32)},
//             "python_safetensors_0.8.0.safetensors", metadata={"format": "pt"})
// (the same library reads this writer's files: safetensors.numpy.load_file gives the same values).
TEST(Safetensors, ReadsAFileWrittenByThePythonLibrary) {
  const SafetensorsFile file = SafetensorsFile::load("tests/common/data/python_safetensors_0.8.0.safetensors");
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(file.info("w_bf16").dtype, Dtype::bf16);
  EXPECT_EQ(file.info("w_bf16").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(file.to_double("w_bf16"), (std::vector<double>{1.0, -2.5, 3.0, 0.125}));
  EXPECT_EQ(file.to_double("h_f16"), (std::vector<double>{1.0, -0.5, 65504.0}));
  EXPECT_EQ(file.to_double("i_i64"), (std::vector<double>{-5.0, 7.0}));
  EXPECT_EQ(file.info("s_f32").shape, std::vector<int64_t>{});
  EXPECT_EQ(file.to_float("s_f32"), std::vector<float>{2.5f});
  EXPECT_EQ(file.info("z_i32").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(file.to_double("z_i32").empty());
}

// ---- every error of the reader ----

TEST(Safetensors, ReaderErrorsNameTheFileAndTheFault) {
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight = raw<float>({1.0f, 2.0f});
  ASSERT_EQ(parse_error(file_bytes(good, eight)), "");

  EXPECT_THAT(parse_error(std::string("\x05\0\0", 3)),
              HasSubstr("bad.safetensors: is 3 bytes long; a safetensors file starts with an 8-byte"));
  EXPECT_THAT(parse_error(file_bytes(good, eight).substr(0, 20)),
              HasSubstr("the header claims 54 bytes, but only 12 follow its length (truncated file?)"));
  EXPECT_THAT(parse_error(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}"),
              HasSubstr("beyond the format's limit of 100000000 bytes"));
  EXPECT_THAT(parse_error(file_bytes(good, eight).substr(0, 66)),  // the data cut short
              HasSubstr("tensor 'a' has data_offsets [0, 8] out of range: the data section has 4 bytes"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a": {"dtype": "F32",)", "")), HasSubstr("header: not valid JSON"));
  EXPECT_THAT(parse_error(file_bytes("", "")), HasSubstr("header: not valid JSON"));
  EXPECT_THAT(parse_error(file_bytes("[1, 2]", "")), HasSubstr("header is JSON but not an object"));
  // Nested far deeper than any header needs, in the header, in one tensor's entry and in
  // __metadata__: refused before parsing, with the limit named (serialising such a value for a
  // message would exhaust the stack).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_THAT(parse_error(file_bytes(deep, "")), HasSubstr("header: JSON nested deeper than 64 levels"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":)" + deep + "}", "")), HasSubstr("JSON nested deeper than 64 levels"));
  EXPECT_THAT(parse_error(file_bytes(R"({"__metadata__":{"k":)" + deep + "}}", "")), HasSubstr("JSON nested deeper than 64 levels"));
  // A value quoted in a message is an excerpt, not the whole of it; so is what the parser last read.
  EXPECT_LT(parse_error(file_bytes("[" + std::string(20000, '1') + "]", "")).size(), 1000u);
  std::string long_list = "[1";
  for (int i = 0; i < 5000; ++i) long_list += ",-1";
  long_list += "]";
  const std::string message = parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":)" + long_list + R"(,"data_offsets":[0,8]}})", eight));
  EXPECT_THAT(message, HasSubstr("..."));
  EXPECT_LT(message.size(), 1000u);
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a': unknown dtype 'F31'; known: BOOL, U8, I8"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a' has no dtype"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a' has shape [-2]; expected integers >= 0"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight)),
              HasSubstr("tensor 'a' has data_offsets [0]; expected [begin, end]"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight)),
              HasSubstr("with end before begin"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":7})", eight)), HasSubstr("tensor 'a' is 7; expected an object"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a' has data_offsets [0,8] (8 bytes); F64 x shape [2] needs 16 bytes"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", eight)),
              HasSubstr("tensor 'a' has data_offsets [0,16] (16 bytes); F32 x shape [2] needs 8 bytes"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                     eight)),
              HasSubstr("tensors 'a' [0, 8) and 'b' [4, 8) overlap"));
  EXPECT_THAT(parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight)),
              HasSubstr("bytes [0, 4) of the data section belong to no tensor (the format allows no holes)"));
  EXPECT_THAT(parse_error(file_bytes(good, eight + "junk")),
              HasSubstr("bytes [8, 12) of the data section belong to no tensor"));
  EXPECT_THAT(parse_error(file_bytes(R"({"__metadata__":{"k":1}})", "")),
              HasSubstr("__metadata__ entry 'k' is 1; expected a string"));
  EXPECT_THAT(parse_error(file_bytes(R"({"__metadata__":[]})", "")), HasSubstr("__metadata__ is []; expected an object"));

  const SafetensorsFile file = SafetensorsFile::parse(file_bytes(good, eight), "good.safetensors");
  EXPECT_EQ(error_of([&] { file.info("b"); }), "good.safetensors: has no tensor named 'b'");
  EXPECT_THAT(error_of([&] { file.to_double("b"); }), HasSubstr("has no tensor named 'b'"));
  EXPECT_THAT(error_of([&] { SafetensorsFile::load("/nonexistent/w.safetensors"); }),
              HasSubstr("/nonexistent/w.safetensors: no such file"));
}

// ---- the writer ----

TEST(Safetensors, WriterErrorsNameTheTensor) {
  const std::vector<float> two = {1.0f, 2.0f};
  const std::span<const float> view(two);
  EXPECT_THAT(error_of([&] { encode_safetensors({tensor_view("a", {3}, view)}); }),
              HasSubstr("tensor 'a' has 8 bytes; F32 x shape [3] needs 12"));
  EXPECT_THAT(error_of([&] { encode_safetensors({tensor_view("a", {2}, view), tensor_view("a", {2}, view)}); }),
              HasSubstr("two tensors are named 'a'"));
  EXPECT_THAT(error_of([&] { encode_safetensors({tensor_view("", {2}, view)}); }), HasSubstr("a tensor has an empty name"));
  EXPECT_THAT(error_of([&] { encode_safetensors({tensor_view("__metadata__", {2}, view)}); }), HasSubstr("reserved"));
  EXPECT_THAT(error_of([&] { encode_safetensors({tensor_view("a", {-1, -2}, view)}); }), HasSubstr("a negative extent"));
}

// A save that fails part-way leaves the previous file whole and no temporary file behind.
TEST(Safetensors, SaveIsAtomic) {
  testing::TempDir dir;
  const auto path = dir.path() / "w.safetensors";
  const std::vector<float> old_values = {1.0f, 2.0f};
  save_safetensors(path, {tensor_view("w", {2}, std::span<const float>(old_values))});
  const std::vector<float> new_values(1000, 3.0f);
  EXPECT_THAT(error_of([&] {
                save_safetensors(path, {tensor_view("w", {1000}, std::span<const float>(new_values))}, {},
                                 {.fail_after_bytes = 500});
              }),
              HasSubstr("simulated write failure after 500 bytes"));
  EXPECT_EQ(SafetensorsFile::load(path).to_float("w"), old_values);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "w.safetensors.tmp"));

  const auto nowhere = dir.path() / "missing" / "w.safetensors";
  EXPECT_THAT(error_of([&] { save_safetensors(nowhere, {tensor_view("w", {2}, std::span<const float>(old_values))}); }),
              HasSubstr("cannot create"));
  EXPECT_FALSE(std::filesystem::exists(nowhere));
}

}  // namespace
}  // namespace moe
