// The multiplier an RMSNorm applies from its weight: the weight, or 1 + the weight under
// Megatron-Core's layernorm_zero_centered_gamma (TENorm's zero_centered_gamma: Gemma, Qwen3-Next,
// Qwen3.5), where the weight starts at 0.
#pragma once

#include "epx/tensor/param.hpp"

namespace epx {

inline Tensor norm_gain(const Param& gamma, bool zero_centered) {
  if (!zero_centered) return gamma.master;
  Tensor g = gamma.master.clone();
  float* p = g.data<float>();
  for (std::int64_t i = 0; i < g.numel(); ++i) p[i] += 1.f;
  return g;
}

// The weight's initial value: a gain of 1 either way.
inline float norm_init(bool zero_centered) { return zero_centered ? 0.f : 1.f; }

}  // namespace epx
