// sum(x^2) in FP64 over fixed lanes (lanes.hpp), compiled per ISA (EPX_CPU_CLONES, no FMA contraction): the
// gradient norm walks every gradient each step, and a single running sum is one long chain of
// dependent adds. The lanes are summed in a fixed order, so every CPU gives the same bits.
#include <cstdint>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "lanes.hpp"

namespace epx {
namespace {

EPX_CPU_CLONES double sum_of_squares_lanes(const float* x, std::int64_t n) {
  using detail::kLanes;
  double lane[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double v = x[i + l];
      lane[l] += v * v;
    }
  for (; i < n; ++i) lane[0] += static_cast<double>(x[i]) * x[i];
  double s = 0;
  for (const double l : lane) s += l;
  return s;
}

}  // namespace

double sum_of_squares(const float* x, std::int64_t n) { return sum_of_squares_lanes(x, n); }

}  // namespace epx
