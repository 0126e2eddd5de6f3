// Relative L2 error between tensors, for the tests' tolerances.
#pragma once

#include <algorithm>
#include <cmath>

#include "epx/tensor/tensor.hpp"

namespace epx::test {

inline double rel_l2(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double d = static_cast<double>(got.get(i)) - want.get(i);
    num += d * d;
    den += static_cast<double>(want.get(i)) * want.get(i);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace epx::test
