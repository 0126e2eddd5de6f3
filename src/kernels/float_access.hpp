// Loads and stores of F32 or BF16 elements as float, and one dispatch on the activation dtype,
// so each elementwise kernel is written once and computes in FP32 for both dtypes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "epx/tensor/tensor.hpp"

namespace epx::detail {

inline float ld(const float* p, std::int64_t i) { return p[i]; }
inline float ld(const std::uint16_t* p, std::int64_t i) { return bf16_to_float(p[i]); }
inline void st(float* p, std::int64_t i, float v) { p[i] = v; }
inline void st(std::uint16_t* p, std::int64_t i, float v) { p[i] = float_to_bf16(v); }

// Calls f(T{}) with T = float or std::uint16_t for the dtype of every tensor given, which must
// agree (a kernel's activations share one dtype).
template <class F, class... Ts>
decltype(auto) with_dtype(const char* kernel, F&& f, const Tensor& first, const Ts&... rest) {
  if (((rest.dtype() != first.dtype()) || ...))
    throw std::invalid_argument(std::string(kernel) + ": activations must share one dtype");
  if (first.dtype() == DType::F32) return f(float{});
  if (first.dtype() == DType::BF16) return f(std::uint16_t{});
  throw std::invalid_argument(std::string(kernel) + ": expected F32 or BF16");
}

inline void expect_shape(const char* kernel, const char* what, const Tensor& t, const Shape& s) {
  if (t.shape() != s)
    throw std::invalid_argument(std::string(kernel) + ": " + what + " is " + shape_string(t.shape()) +
                                ", expected " + shape_string(s));
}

}  // namespace epx::detail
