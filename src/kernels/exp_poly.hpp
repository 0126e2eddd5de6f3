// Functions the compiler can vectorise inside the per-ISA loops (epx/base/cpu_clones.hpp): an expf
// and, below, the tanh and erfc built on it. The expf is Cephes' (Cody-Waite reduction, degree-6
// polynomial), within 2 ulp of libm's. Inputs are clamped to [-87, 88], so exp of a large negative
// number is about 1.6e-38, not 0: a caller that needs an exact zero (a masked score) writes it itself.
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

// erfc(z) for z >= 0, vectorisable: exp(-z^2) times a Chebyshev interpolant of erfc(z) exp(z^2) in
// t = 1 / (1 + z/2) on z in [0, 10] (12 nodes; scripts/fit_erfc.py prints the coefficients and
// their error, 8e-9 relative in double arithmetic), summed by Clenshaw's recurrence; 0 from z = 9
// (erfc(9) is 4e-37; beyond it exp_poly's clamp would take over). In FP32 within 5.2e-7 of erfc,
// relative, up to z = 2 and 4.7e-6 up to 9 (the rounding of z^2 grows with z). GELU built on it
// (1 + erf(y) as erfc(-y) below 0, 2 - erfc(y) above) is within 6.5e-7 of its value for |x| <= 2,
// 1.6e-6 to 4 and 1.6e-5 in the tail (sweeps by 1e-4). libm's erff, called per element, made
// GELU's rows ten times as slow as SwiGLU's.
[[gnu::always_inline]] inline float erfc_poly(float z) {
  static constexpr float c[] = {4.310002596e-1f, 4.614259617e-1f, 9.719738448e-2f, 1.065875721e-2f,
                                -1.28012821e-4f, -1.583578583e-4f, 1.026692835e-6f, 3.210776998e-6f,
                                -1.719199317e-7f, -6.914008414e-8f, 1.072180366e-8f, 8.569712459e-10f};
  const float zc = std::min(z, 10.f);
  const float t = 1.f / (1.f + 0.5f * zc);
  const float u = 2.4f * t - 1.4f;  // t in [1/6, 1] onto [-1, 1]
  float b1 = 0.f, b2 = 0.f;
  for (int j = 11; j >= 1; --j) {
    const float b0 = 2.f * u * b1 - b2 + c[j];
    b2 = b1;
    b1 = b0;
  }
  const float scaled = u * b1 - b2 + c[0];
  return z < 9.f ? exp_poly(-zc * zc) * scaled : 0.f;
}

}  // namespace epx::detail
