// An expf the compiler can vectorise inside the per-ISA loops (epx/base/cpu_clones.hpp): Cephes'
// expf (Cody-Waite reduction, degree-6 polynomial), within 2 ulp of libm's. Inputs are clamped to
// [-87, 88], so exp of a large negative number is about 1.6e-38, not 0: a caller that needs an
// exact zero (a masked score) writes it itself.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace epx::detail {

[[gnu::always_inline]] inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504088896341f + 0x1.8p23f;  // round(x / ln 2), by the magic number
  const float n = t - 0x1.8p23f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
}

// A tanhf the compiler can vectorise the same way: (1 - e) / (1 + e) with e = exp(-2|x|), and below
// |x| = 1/8, where 1 - e cancels, tanh's Taylor series to x^7 (its next term is 1e-9 of x there).
// Within 2.4e-7 of tanh, relative (a sweep of -12 to 12 by 1e-4). libm's tanhf, called per
// element, made the tanh GELU's layer twice as slow as SwiGLU's.
[[gnu::always_inline]] inline float tanh_poly(float x) {
  const float a = std::fabs(x);
  const float e = exp_poly(-2.f * a);
  const float x2 = x * x;
  const float series = a * (1.f + x2 * (-1.f / 3.f + x2 * (2.f / 15.f + x2 * (-17.f / 315.f))));
  return std::copysign(a < 0.125f ? series : (1.f - e) / (1.f + e), x);
}

}  // namespace epx::detail
