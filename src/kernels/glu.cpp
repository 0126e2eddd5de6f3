// Gated linear units with the routing probability folded in after the activation, as Megatron-Core's
// MLP and experts compute them (weighted_bias_swiglu, weighted_bias_quick_geglu and the unfused
// glu()): out = act(min(gate, c)) * (clamp(up, -c, c) + offset) * p. Applying p here, before fc2,
// makes the expert output p * Expert(x), so combine is a plain sum.
//
// The rows are the experts' hot elementwise work (the whole [T k, 2F] fc1 output, forward and
// backward), so each row is one function compiled per ISA (EPX_CPU_CLONES) with the activation
// and the clamp switched once per row, and an exp, a tanh and an erfc the compiler can vectorise
// (exp_poly.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "exp_poly.hpp"
#include "float_access.hpp"

namespace epx {
namespace {

// 0 below -88, where exp_poly's clamp would give 6e-39 and silu(-3e38) would be -1.8.
[[gnu::always_inline]] inline float sigmoid(float x) { return x < -88.f ? 0.f : 1.f / (1.f + detail::exp_poly(-x)); }

// 1 + erf(y), close relative to itself on both sides: erfc(-y) below 0, 2 - erfc(y) above.
[[gnu::always_inline]] inline float one_plus_erf(float y) {
  const float e = detail::erfc_poly(std::fabs(y));
  return y < 0.f ? e : 2.f - e;
}

// act(g) and its derivative, as Megatron-Core and torch define them.
template <GluFn F>
[[gnu::always_inline]] inline float act(float g) {
  if constexpr (F == GluFn::silu) return g * sigmoid(g);
  if constexpr (F == GluFn::quick_gelu) return g * sigmoid(1.702f * g);
  if constexpr (F == GluFn::gelu) return 0.5f * g * one_plus_erf(g * 0.70710678118654752f);
  if constexpr (F == GluFn::fast_gelu) return 0.5f * g * (1.f + detail::tanh_poly(0.7978845608f * g * (1.f + 0.044715f * g * g)));
  if constexpr (F == GluFn::relu) return std::max(g, 0.f);  // NaN stays NaN, as torch's
  if constexpr (F == GluFn::squared_relu) return std::max(g, 0.f) * std::max(g, 0.f);
  if constexpr (F == GluFn::sigmoid) return sigmoid(g);
  if constexpr (F == GluFn::tanh) return detail::tanh_poly(g);
}
template <GluFn F>
[[gnu::always_inline]] inline float act_grad(float g) {
  if constexpr (F == GluFn::silu) {
    const float s = sigmoid(g);
    return s * (1.f + g * (1.f - s));
  }
  if constexpr (F == GluFn::quick_gelu) {
    const float s = sigmoid(1.702f * g);
    return s * (1.f + 1.702f * g * (1.f - s));
  }
  if constexpr (F == GluFn::gelu) {
    // The density term is 0 where exp_poly's clamp would stop it falling (|g| above 13).
    const float h = 0.5f * g * g;
    return 0.5f * one_plus_erf(g * 0.70710678118654752f) + (h < 87.f ? g * 0.39894228040143268f * detail::exp_poly(-h) : 0.f);
  }
  if constexpr (F == GluFn::fast_gelu) {
    const float t = detail::tanh_poly(0.7978845608f * g * (1.f + 0.044715f * g * g));
    return 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * 0.7978845608f * (1.f + 3.f * 0.044715f * g * g);
  }
  if constexpr (F == GluFn::relu) return g > 0.f ? 1.f : 0.f;
  if constexpr (F == GluFn::squared_relu) return g > 0.f ? 2.f * g : 0.f;
  if constexpr (F == GluFn::sigmoid) {
    const float s = sigmoid(g);
    return s * (1.f - s);
  }
  if constexpr (F == GluFn::tanh) {
    const float t = detail::tanh_poly(g);
    return 1.f - t * t;
  }
}

// One row. With kClamp, the gate is clamped from above and the linear half on both sides, and
// the gradient stops where a value was clamped (torch's clamp passes it at the bounds).
template <GluFn F, bool kClamp, class T>
[[gnu::always_inline]] inline void forward_row(const T* __restrict h, float p, std::int64_t f, float c, float offset,
                                               T* __restrict out) {
  for (std::int64_t j = 0; j < f; ++j) {
    float g = detail::ld(h, j), u = detail::ld(h, f + j);
    if constexpr (kClamp) {
      g = std::min(g, c);
      u = std::min(std::max(u, -c), c);
    }
    detail::st(out, j, act<F>(g) * (u + offset) * p);
  }
}

// prod[j] = act * (up + offset) * dout, for the probability's gradient (summed in order by the caller).
template <GluFn F, bool kClamp, class T>
[[gnu::always_inline]] inline void backward_row(const T* __restrict h, const T* __restrict dout, float p,
                                                std::int64_t f, float c, float offset, T* __restrict dh,
                                                float* __restrict prod) {
  for (std::int64_t j = 0; j < f; ++j) {
    float g = detail::ld(h, j), u = detail::ld(h, f + j);
    bool keep_g = true, keep_u = true;
    if constexpr (kClamp) {
      keep_g = g <= c;
      keep_u = u >= -c && u <= c;
      g = std::min(g, c);
      u = std::min(std::max(u, -c), c);
    }
    const float d = detail::ld(dout, j), a = act<F>(g), lin = u + offset;
    prod[j] = a * lin * d;
    const float dg = d * p * lin * act_grad<F>(g), du = d * p * a;
    detail::st(dh, j, keep_g ? dg : 0.f);  // a select, as torch's where: 0 even where dout is inf
    detail::st(dh, f + j, keep_u ? du : 0.f);
  }
}

// The activation and the clamp picked once per row, every case inlined into the ISA's clone (no
// lambdas: GCC compiles one that it does not inline for the baseline ISA, unvectorised).
template <GluFn F, class T>
[[gnu::always_inline]] inline void forward_fn(const GluActivation& a, const T* h, float p, std::int64_t f, T* out) {
  if (a.clamp) forward_row<F, true>(h, p, f, *a.clamp, a.linear_offset, out);
  else forward_row<F, false>(h, p, f, 0.f, a.linear_offset, out);
}
template <GluFn F, class T>
[[gnu::always_inline]] inline void backward_fn(const GluActivation& a, const T* h, const T* dout, float p,
                                               std::int64_t f, T* dh, float* prod) {
  if (a.clamp) backward_row<F, true>(h, dout, p, f, *a.clamp, a.linear_offset, dh, prod);
  else backward_row<F, false>(h, dout, p, f, 0.f, a.linear_offset, dh, prod);
}

template <class T>
[[gnu::always_inline]] inline void forward_any(const GluActivation& a, const T* h, float p, std::int64_t f, T* out) {
  switch (a.fn) {
    case GluFn::silu: return forward_fn<GluFn::silu>(a, h, p, f, out);
    case GluFn::quick_gelu: return forward_fn<GluFn::quick_gelu>(a, h, p, f, out);
    case GluFn::gelu: return forward_fn<GluFn::gelu>(a, h, p, f, out);
    case GluFn::fast_gelu: return forward_fn<GluFn::fast_gelu>(a, h, p, f, out);
    case GluFn::relu: return forward_fn<GluFn::relu>(a, h, p, f, out);
    case GluFn::squared_relu: return forward_fn<GluFn::squared_relu>(a, h, p, f, out);
    case GluFn::sigmoid: return forward_fn<GluFn::sigmoid>(a, h, p, f, out);
    case GluFn::tanh: return forward_fn<GluFn::tanh>(a, h, p, f, out);
  }
}
template <class T>
[[gnu::always_inline]] inline void backward_any(const GluActivation& a, const T* h, const T* dout, float p,
                                                std::int64_t f, T* dh, float* prod) {
  switch (a.fn) {
    case GluFn::silu: return backward_fn<GluFn::silu>(a, h, dout, p, f, dh, prod);
    case GluFn::quick_gelu: return backward_fn<GluFn::quick_gelu>(a, h, dout, p, f, dh, prod);
    case GluFn::gelu: return backward_fn<GluFn::gelu>(a, h, dout, p, f, dh, prod);
    case GluFn::fast_gelu: return backward_fn<GluFn::fast_gelu>(a, h, dout, p, f, dh, prod);
    case GluFn::relu: return backward_fn<GluFn::relu>(a, h, dout, p, f, dh, prod);
    case GluFn::squared_relu: return backward_fn<GluFn::squared_relu>(a, h, dout, p, f, dh, prod);
    case GluFn::sigmoid: return backward_fn<GluFn::sigmoid>(a, h, dout, p, f, dh, prod);
    case GluFn::tanh: return backward_fn<GluFn::tanh>(a, h, dout, p, f, dh, prod);
  }
}

EPX_CPU_CLONES void forward_row_f32(const GluActivation& a, const float* h, float p, std::int64_t f, float* out) {
  forward_any(a, h, p, f, out);
}
EPX_CPU_CLONES void forward_row_bf16(const GluActivation& a, const std::uint16_t* h, float p, std::int64_t f,
                                     std::uint16_t* out) {
  forward_any(a, h, p, f, out);
}
EPX_CPU_CLONES void backward_row_f32(const GluActivation& a, const float* h, const float* dout, float p,
                                     std::int64_t f, float* dh, float* prod) {
  backward_any(a, h, dout, p, f, dh, prod);
}
EPX_CPU_CLONES void backward_row_bf16(const GluActivation& a, const std::uint16_t* h, const std::uint16_t* dout,
                                      float p, std::int64_t f, std::uint16_t* dh, float* prod) {
  backward_any(a, h, dout, p, f, dh, prod);
}

void forward_row_of(const GluActivation& a, const float* h, float p, std::int64_t f, float* out) {
  forward_row_f32(a, h, p, f, out);
}
void forward_row_of(const GluActivation& a, const std::uint16_t* h, float p, std::int64_t f, std::uint16_t* out) {
  forward_row_bf16(a, h, p, f, out);
}
void backward_row_of(const GluActivation& a, const float* h, const float* d, float p, std::int64_t f, float* dh,
                     float* prod) {
  backward_row_f32(a, h, d, p, f, dh, prod);
}
void backward_row_of(const GluActivation& a, const std::uint16_t* h, const std::uint16_t* d, float p,
                     std::int64_t f, std::uint16_t* dh, float* prod) {
  backward_row_bf16(a, h, d, p, f, dh, prod);
}

}  // namespace

std::optional<GluFn> glu_fn_from_name(std::string_view name) {
  for (const GluFn fn : kGluFns)
    if (name == glu_fn_name(fn)) return fn;
  return std::nullopt;
}

const char* glu_fn_name(GluFn fn) {
  switch (fn) {
    case GluFn::silu: return "silu";
    case GluFn::quick_gelu: return "quick_gelu";
    case GluFn::gelu: return "gelu";
    case GluFn::fast_gelu: return "fast_gelu";
    case GluFn::relu: return "relu";
    case GluFn::squared_relu: return "squared_relu";
    case GluFn::sigmoid: return "sigmoid";
    case GluFn::tanh: return "tanh";
  }
  return "?";
}

void glu_forward(const GluActivation& a, const Tensor& h, const float* probs, Tensor& out) {
  const std::int64_t m = h.dim(0), f = h.dim(1) / 2;
  detail::expect_shape("glu_forward", "h", h, {m, 2 * f});
  detail::expect_shape("glu_forward", "out", out, {m, f});
  detail::with_dtype("glu_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* hp = static_cast<const T*>(h.raw());
    T* op = static_cast<T*>(out.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < m; ++r) forward_row_of(a, hp + r * 2 * f, probs ? probs[r] : 1.f, f, op + r * f);
  }, h, out);
}

void glu_backward(const GluActivation& a, const Tensor& h, const float* probs, const Tensor& dout, Tensor& dh,
                  float* dprobs) {
  const std::int64_t m = h.dim(0), f = h.dim(1) / 2;
  detail::expect_shape("glu_backward", "dout", dout, {m, f});
  detail::expect_shape("glu_backward", "dh", dh, {m, 2 * f});
  detail::with_dtype("glu_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* hp = static_cast<const T*>(h.raw());
    const T* dop = static_cast<const T*>(dout.raw());
    T* dhp = static_cast<T*>(dh.raw());
#pragma omp parallel
    {
      std::vector<float> prod(static_cast<std::size_t>(f));
#pragma omp for schedule(static)
      for (std::int64_t r = 0; r < m; ++r) {
        backward_row_of(a, hp + r * 2 * f, dop + r * f, probs ? probs[r] : 1.f, f, dhp + r * 2 * f, prod.data());
        if (!dprobs) continue;
        double dp = 0;  // in order, in FP64
        for (const float v : prod) dp += static_cast<double>(v);
        dprobs[r] = static_cast<float>(dp);
      }
    }
  }, h, dout, dh);
}

}  // namespace epx
