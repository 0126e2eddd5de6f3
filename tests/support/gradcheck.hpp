// Finite-difference checks: the central difference of a scalar function along a random direction
// of a parameter, against the analytic directional derivative <grad, direction>.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "epx/tensor/random.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx::test {

// A tensor of N(0, scale) values (F32, or rounded to BF16).
inline Tensor randn(Shape shape, std::uint64_t seed, double scale = 1.0, DType dtype = DType::F32) {
  return random_normal(std::move(shape), dtype, seed, 17, scale);
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a.get(i)) * b.get(i);
  return s;
}

// Checks d/de f(p + e * dir) at e = 0 against <grad, dir>, where `p` is an F32 tensor that f
// reads (after `changed()`, e.g. a refresh of compute copies). Restores p.
inline void expect_directional_derivative(const std::function<double()>& f, Tensor& p,
                                          const Tensor& grad, std::uint64_t seed, const char* what,
                                          double eps = 1e-3, double rtol = 2e-3, double atol = 1e-3,
                                          const std::function<void()>& changed = [] {}) {
  const Tensor dir = randn(p.shape(), seed);
  const Tensor saved = p.clone();
  auto at = [&](double e) {
    for (std::int64_t i = 0; i < p.numel(); ++i) p.set(i, saved.get(i) + static_cast<float>(e * dir.get(i)));
    changed();
    return f();
  };
  const double fd = (at(eps) - at(-eps)) / (2 * eps);
  // The same difference at half the step: its truncation error is O(eps^2), far below the bound,
  // so the two differ by f's FP32 rounding over the step, which grows as eps shrinks (a routing
  // near a tie can force eps down to 1e-5) and with the GEMM kernel's summation order. A wrong
  // gradient is wrong at both steps alike and still fails. The widening is capped at twice the
  // bound itself, so a rough f cannot make any gradient pass.
  const double fd_half = (at(eps / 2) - at(-eps / 2)) / eps;
  p.copy_from(saved);
  changed();
  const double analytic = dot(grad, dir);
  const double bound = rtol * std::abs(analytic) + atol;
  EXPECT_NEAR(fd, analytic, bound + 2 * std::min(std::abs(fd - fd_half), bound))
      << what << ": finite difference " << fd << " (" << fd_half << " at half the step) vs analytic "
      << analytic;
}

}  // namespace epx::test
