// Tensor storage and accounting, and safetensors files: round trip and every kind of bad file.
#include <gtest/gtest.h>

#include <cmath>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "epx/base/error.hpp"
#include "epx/tensor/safetensors.hpp"
#include "gradcheck.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("epx_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

void write_raw(const std::string& path, const std::string& header, std::size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  std::uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\0');
}

std::string error_of(const std::string& path) {
  return test::error_of<InputError>([&] { read_safetensors(path); });
}

TEST(Tensor, AlignedZeroedAndAccounted) {
  const auto before = memory_stats().allocated_bytes;
  reset_peak_memory();
  {
    Tensor t({3, 5}, DType::BF16);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.raw()) % 64, 0u);
    EXPECT_EQ(t.nbytes(), 30u);
    for (std::int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.get(i), 0.f);
    EXPECT_EQ(memory_stats().allocated_bytes, before + 30);
    const Tensor view = t.reshape({15});  // shares storage: no new bytes
    EXPECT_EQ(memory_stats().allocated_bytes, before + 30);
  }
  EXPECT_EQ(memory_stats().allocated_bytes, before);
  EXPECT_EQ(memory_stats().max_allocated_bytes, before + 30);
}

TEST(Tensor, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f + 0x1p-16f), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(Safetensors, RoundTripKeepsNamesShapesDtypesAndBytes) {
  TensorMap m{{"a", test::randn({2, 3}, 1)}, {"b", test::randn({4}, 2, 1.0, DType::BF16)},
              {"scalar", Tensor({}, DType::F32)}, {"counts", Tensor({3}, DType::I64)}};
  m.at("counts").data<std::int64_t>()[2] = 1ll << 40;
  const std::string path = temp_path("roundtrip.safetensors");
  write_safetensors(path, m, {{"k", "v"}});
  const TensorMap back = read_safetensors(path);
  ASSERT_EQ(back.size(), m.size());
  for (const auto& [name, t] : m) {
    const Tensor& b = back.at(name);
    EXPECT_EQ(b.shape(), t.shape()) << name;
    EXPECT_EQ(b.dtype(), t.dtype()) << name;
    EXPECT_EQ(std::memcmp(b.raw(), t.raw(), t.nbytes()), 0) << name;
  }
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove(path);
}

TEST(Safetensors, BadFilesNameTheFileAndTensor) {
  const std::string path = temp_path("bad.safetensors");
  EXPECT_NE(error_of(temp_path("missing.safetensors")).find("cannot open the tensor file: No such file"), std::string::npos);
  // A directory opens as a stream on Linux: its size read as 2^63 - 1 bytes.
  EXPECT_NE(error_of(std::filesystem::temp_directory_path().string()).find("is a directory"), std::string::npos);
  write_raw(path, "{not json", 0);
  EXPECT_NE(error_of(path).find("not JSON"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4);
  EXPECT_NE(error_of(path).find("tensor 'w' has dtype F16"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 8);  // truncated
  EXPECT_NE(error_of(path).find("tensor 'w'"), std::string::npos) << error_of(path);
  {
    std::ofstream out(path, std::ios::binary);
    std::uint64_t n = 1ull << 40;  // header length beyond the file
    out.write(reinterpret_cast<const char*>(&n), 8);
  }
  EXPECT_NE(error_of(path).find("header length"), std::string::npos) << error_of(path);
  // A shape whose byte count overflows 64 bits must not pass as a small tensor.
  write_raw(path, R"({"w":{"dtype":"F32","shape":[3,6148914691236517206],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error_of(path).find("tensor 'w' has shape"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8);
  EXPECT_NE(error_of(path).find(path + ": corrupt entry for tensor 'w'"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2]}})", 8);
  EXPECT_NE(error_of(path).find("corrupt entry for tensor 'w'"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":1,"shape":[2],"data_offsets":[0,8]}})", 8);  // named by the format, not the library
  EXPECT_NE(error_of(path).find("corrupt entry for tensor 'w': the format's entry is {\"dtype\": a string"),
            std::string::npos)
      << error_of(path);
  EXPECT_EQ(error_of(path).find("json.exception"), std::string::npos) << error_of(path);
  // Header lies the format does not allow (the Rust safetensors crate refuses them too).
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error_of(path).find("not a whole number"), std::string::npos) << error_of(path);
  write_raw(path, R"({"__metadata__":{"a":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error_of(path).find("__metadata__ is not a map of strings"), std::string::npos) << error_of(path);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  EXPECT_NE(error_of(path).find("data_offsets overlap at byte 4"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  EXPECT_NE(error_of(path).find("data_offsets leave a gap at byte 0"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12);
  EXPECT_NE(error_of(path).find("cover 8 of its 12 data bytes"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 12);
  EXPECT_NE(error_of(path).find("truncated safetensors file?"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8);  // not 2^64 - 8
  EXPECT_NE(error_of(path).find("data_offsets [-8,0] is not two byte offsets from 0"), std::string::npos) << error_of(path);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16);
  EXPECT_NE(error_of(path).find("tensor 'w' is named twice"), std::string::npos) << error_of(path);
  std::filesystem::remove(path);
}

TEST(Safetensors, ExpectTensorChecksPresenceShapeAndDtype) {
  const TensorMap m{{"x", Tensor({2, 3}, DType::F32)}, {"n", Tensor({2}, DType::I64)}};
  EXPECT_NO_THROW(expect_tensor(m, "x", {2, 3}, "f"));
  auto msg = [&](const std::string& name, const Shape& s) {
    return test::error_of<InputError>([&] { expect_tensor(m, name, s, "f.safetensors"); });
  };
  EXPECT_NE(msg("y", {2, 3}).find("tensor 'y' is missing"), std::string::npos);
  EXPECT_NE(msg("x", {3, 2}).find("has shape [2, 3]; expected [3, 2]"), std::string::npos);
  EXPECT_NE(msg("n", {2}).find("is I64"), std::string::npos);
  // Values must be finite, in either float dtype.
  TensorMap bad{{"f", Tensor({2, 2}, DType::F32)}, {"b", Tensor({3}, DType::BF16)}};
  bad.at("f").set(3, std::nanf(""));
  bad.at("b").set(1, -INFINITY);
  const std::string nan = test::error_of<InputError>([&] { expect_tensor(bad, "f", {2, 2}, "w.safetensors"); });
  EXPECT_NE(nan.find("w.safetensors: tensor 'f' holds NaN at element 3"), std::string::npos) << nan;
  EXPECT_THROW(expect_tensor(bad, "b", {3}, "w.safetensors"), InputError);
}

}  // namespace
}  // namespace epx
