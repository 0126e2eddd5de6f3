// Rows packed into raw byte buffers for the flex exchanges: a row's values, then its metadata.
// Buffers travel as 16-bit words (every stride is even); sums of rows are taken in FP32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "epx/tensor/tensor.hpp"

namespace epx {

// A raw byte buffer from the tensor cache.
inline Tensor byte_buffer(std::int64_t bytes) {
  return Tensor::uninitialized({std::max<std::int64_t>(bytes, 2) / 2}, DType::BF16);
}
inline std::byte* bytes_of(Tensor& t) { return static_cast<std::byte*>(t.raw()); }
inline const std::byte* bytes_of(const Tensor& t) { return static_cast<const std::byte*>(t.raw()); }

// acc[0, h) += the h values of `row` (F32 or BF16).
inline void add_row(float* acc, const std::byte* row, DType dt, std::int64_t h) {
  if (dt == DType::F32) {
    const auto* r = reinterpret_cast<const float*>(row);
    for (std::int64_t i = 0; i < h; ++i) acc[i] += r[i];
  } else {
    const auto* r = reinterpret_cast<const std::uint16_t*>(row);
    for (std::int64_t i = 0; i < h; ++i) acc[i] += bf16_to_float(r[i]);
  }
}
// `row` = acc[0, h), rounded to dt.
inline void store_row(std::byte* row, const float* acc, DType dt, std::int64_t h) {
  if (dt == DType::F32) {
    std::memcpy(row, acc, static_cast<std::size_t>(h) * sizeof(float));
  } else {
    auto* r = reinterpret_cast<std::uint16_t*>(row);
    for (std::int64_t i = 0; i < h; ++i) r[i] = float_to_bf16(acc[i]);
  }
}
inline float load_float(const std::byte* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace epx
