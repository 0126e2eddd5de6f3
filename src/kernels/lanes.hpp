// Reductions in kLanes fixed lanes for the per-ISA row loops (epx/base/cpu_clones.hpp): lane l
// takes elements l, l + kLanes, ...; the tail goes to lane 0 and the lanes are combined in order.
// The compiler can vectorise that (a single running sum or max it may not reorder), and the
// order is the source's, so every ISA gives the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "float_access.hpp"

namespace epx::detail {

inline constexpr int kLanes = 16;

// The largest of x[0..n) (F32 or BF16 elements); -inf for n = 0.
template <class T>
[[gnu::always_inline]] inline float max_in_lanes(const T* x, std::int64_t n) {
  float lane[kLanes];
  for (float& l : lane) l = -std::numeric_limits<float>::infinity();
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], ld(x, i + l));
  for (; i < n; ++i) lane[0] = std::max(lane[0], ld(x, i));
  float mx = lane[0];
  for (int l = 1; l < kLanes; ++l) mx = std::max(mx, lane[l]);
  return mx;
}

}  // namespace epx::detail
