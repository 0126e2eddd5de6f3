// YaRN's concentration factor (Megatron-Core's _yarn_get_concentration_factor), from the config's
// yarn_rotary_scaling_factor s, yarn_mscale and yarn_mscale_all_dim: 0.1 m ln(s) + 1 for s > 1
// (1 below) with m = 1, or with both mscales that of yarn_mscale over that of yarn_mscale_all_dim.
// Megatron's attention multiplies RoPE's cos and sin, for q and k, by it; the checker and the
// runtime both read it from here.
#pragma once

#include <cmath>
#include <limits>
#include <optional>

namespace epx {

// Megatron-Core's _yarn_get_mscale: 0.1 m ln(s) + 1 for s > 1, else 1. MLA scales its softmax by
// its square at m = mscale_all_dim.
inline double yarn_mscale(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

inline double yarn_concentration(double factor, std::optional<double> mscale, std::optional<double> mscale_all_dim) {
  if (!mscale || !mscale_all_dim) return yarn_mscale(factor, 1);
  return yarn_mscale(factor, *mscale) / yarn_mscale(factor, *mscale_all_dim);
}

// MLA's logits' scale (MultiLatentAttention): mscale(factor, mscale_all_dim)^2 / sqrt(head_dim),
// whatever its rope_type; the runtime and the checker both read it from here.
inline double mla_softmax_scale(double factor, double mscale_all_dim, double head_dim) {
  const double m = yarn_mscale(factor, mscale_all_dim);
  return m * m / std::sqrt(head_dim);
}

// A factor the FP32 rotary table can hold, and that leaves the rotation non-zero.
inline bool yarn_concentration_fits(double m) {
  return std::isfinite(m) && m != 0 && std::abs(m) <= std::numeric_limits<float>::max();
}

}  // namespace epx
