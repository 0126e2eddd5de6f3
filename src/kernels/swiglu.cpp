// SwiGLU with the routing probability folded in after the activation (Megatron-Core's
// weighted_bias_swiglu): out = silu(gate) * up * p. Applying p here, before fc2, makes the
// expert output p * Expert(x), so combine is a plain sum.
#include <cmath>

#include "epx/kernels/kernels.hpp"
#include "float_access.hpp"

namespace epx {
namespace {

inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

void swiglu_forward(const Tensor& h, const float* probs, Tensor& out) {
  const std::int64_t m = h.dim(0), f = h.dim(1) / 2;
  detail::expect_shape("swiglu_forward", "h", h, {m, 2 * f});
  detail::expect_shape("swiglu_forward", "out", out, {m, f});
  detail::with_dtype("swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* hp = static_cast<const T*>(h.raw());
    T* op = static_cast<T*>(out.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < m; ++r) {
      const float p = probs ? probs[r] : 1.f;
      for (std::int64_t j = 0; j < f; ++j) {
        const float g = detail::ld(hp, r * 2 * f + j), u = detail::ld(hp, r * 2 * f + f + j);
        detail::st(op, r * f + j, g * sigmoidf(g) * u * p);
      }
    }
  }, h, out);
}

void swiglu_backward(const Tensor& h, const float* probs, const Tensor& dout, Tensor& dh,
                     float* dprobs) {
  const std::int64_t m = h.dim(0), f = h.dim(1) / 2;
  detail::expect_shape("swiglu_backward", "dout", dout, {m, f});
  detail::expect_shape("swiglu_backward", "dh", dh, {m, 2 * f});
  detail::with_dtype("swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* hp = static_cast<const T*>(h.raw());
    const T* dop = static_cast<const T*>(dout.raw());
    T* dhp = static_cast<T*>(dh.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < m; ++r) {
      const float p = probs ? probs[r] : 1.f;
      double dp = 0;
      for (std::int64_t j = 0; j < f; ++j) {
        const float g = detail::ld(hp, r * 2 * f + j), u = detail::ld(hp, r * 2 * f + f + j);
        const float d = detail::ld(dop, r * f + j);
        const float s = sigmoidf(g), silu = g * s;
        dp += static_cast<double>(silu * u * d);
        const float dsilu = s * (1.f + g * (1.f - s));
        detail::st(dhp, r * 2 * f + j, d * p * u * dsilu);
        detail::st(dhp, r * 2 * f + f + j, d * p * silu);
      }
      if (dprobs) dprobs[r] = static_cast<float>(dp);
    }
  }, h, dout, dh);
}

}  // namespace epx
