// The MLPs' activation with the routing probability folded in after it, as Megatron-Core's MLP and
// experts compute it (weighted_bias_swiglu, weighted_bias_quick_geglu, the unfused glu(), and
// activation_func(x) * probs when not gated): gated, out = act(min(gate, c)) * (clamp(up, -c, c) +
// offset) * p; not gated, out = act(h) * p. Applying p here, before fc2, makes the expert output
// p * Expert(x), so combine is a plain sum.
//
// The rows are the experts' hot elementwise work (the whole [T k, 2F] or [T k, F] fc1 output,
// forward and backward), so each row is one function compiled per ISA (EPX_CPU_CLONES) with the
// activation, the gating and the clamp switched once per row, and an exp, a tanh and an erfc the
// compiler can vectorise (exp_poly.hpp).
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
template <ActivationFn F>
[[gnu::always_inline]] inline float act(float g) {
  if constexpr (F == ActivationFn::silu) return g * sigmoid(g);
  if constexpr (F == ActivationFn::quick_gelu) return g * sigmoid(1.702f * g);
  if constexpr (F == ActivationFn::gelu) return 0.5f * g * one_plus_erf(g * 0.70710678118654752f);
  if constexpr (F == ActivationFn::fast_gelu) return 0.5f * g * (1.f + detail::tanh_poly(0.7978845608f * g * (1.f + 0.044715f * g * g)));
  if constexpr (F == ActivationFn::relu) return std::max(g, 0.f);  // NaN stays NaN, as torch's
  if constexpr (F == ActivationFn::squared_relu) return std::max(g, 0.f) * std::max(g, 0.f);
  if constexpr (F == ActivationFn::sigmoid) return sigmoid(g);
  if constexpr (F == ActivationFn::tanh) return detail::tanh_poly(g);
}
template <ActivationFn F>
[[gnu::always_inline]] inline float act_grad(float g) {
  if constexpr (F == ActivationFn::silu) {
    const float s = sigmoid(g);
    return s * (1.f + g * (1.f - s));
  }
  if constexpr (F == ActivationFn::quick_gelu) {
    const float s = sigmoid(1.702f * g);
    return s * (1.f + 1.702f * g * (1.f - s));
  }
  if constexpr (F == ActivationFn::gelu) {
    // The density term is 0 where exp_poly's clamp would stop it falling (|g| above 13).
    const float h = 0.5f * g * g;
    return 0.5f * one_plus_erf(g * 0.70710678118654752f) + (h < 87.f ? g * 0.39894228040143268f * detail::exp_poly(-h) : 0.f);
  }
  if constexpr (F == ActivationFn::fast_gelu) {
    const float t = detail::tanh_poly(0.7978845608f * g * (1.f + 0.044715f * g * g));
    return 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * 0.7978845608f * (1.f + 3.f * 0.044715f * g * g);
  }
  if constexpr (F == ActivationFn::relu) return g > 0.f ? 1.f : 0.f;
  if constexpr (F == ActivationFn::squared_relu) return g > 0.f ? 2.f * g : 0.f;
  if constexpr (F == ActivationFn::sigmoid) {
    const float s = sigmoid(g);
    return s * (1.f - s);
  }
  if constexpr (F == ActivationFn::tanh) {
    const float t = detail::tanh_poly(g);
    return 1.f - t * t;
  }
}

// One row. With kClamp, the gate is clamped from above and the linear half on both sides, and
// the gradient stops where a value was clamped (torch's clamp passes it at the bounds).
template <ActivationFn F, bool kClamp, class T>
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
template <ActivationFn F, bool kClamp, class T>
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

// One row of a unit that is not gated: out = act(h) * p.
template <ActivationFn F, class T>
[[gnu::always_inline]] inline void forward_row_ungated(const T* __restrict h, float p, std::int64_t f,
                                                       T* __restrict out) {
  for (std::int64_t j = 0; j < f; ++j) detail::st(out, j, act<F>(detail::ld(h, j)) * p);
}
template <ActivationFn F, class T>
[[gnu::always_inline]] inline void backward_row_ungated(const T* __restrict h, const T* __restrict dout, float p,
                                                        std::int64_t f, T* __restrict dh, float* __restrict prod) {
  for (std::int64_t j = 0; j < f; ++j) {
    const float x = detail::ld(h, j), d = detail::ld(dout, j);
    prod[j] = act<F>(x) * d;
    detail::st(dh, j, d * p * act_grad<F>(x));
  }
}

// The activation, the gating and the clamp picked once per row, every case inlined into the ISA's clone (no
// lambdas: GCC compiles one that it does not inline for the baseline ISA, unvectorised).
template <ActivationFn F, class T>
[[gnu::always_inline]] inline void forward_fn(const MlpActivation& a, const T* h, float p, std::int64_t f, T* out) {
  if (!a.gated) forward_row_ungated<F>(h, p, f, out);
  else if (a.clamp) forward_row<F, true>(h, p, f, *a.clamp, a.linear_offset, out);
  else forward_row<F, false>(h, p, f, 0.f, a.linear_offset, out);
}
template <ActivationFn F, class T>
[[gnu::always_inline]] inline void backward_fn(const MlpActivation& a, const T* h, const T* dout, float p,
                                               std::int64_t f, T* dh, float* prod) {
  if (!a.gated) backward_row_ungated<F>(h, dout, p, f, dh, prod);
  else if (a.clamp) backward_row<F, true>(h, dout, p, f, *a.clamp, a.linear_offset, dh, prod);
  else backward_row<F, false>(h, dout, p, f, 0.f, a.linear_offset, dh, prod);
}

template <class T>
[[gnu::always_inline]] inline void forward_any(const MlpActivation& a, const T* h, float p, std::int64_t f, T* out) {
  switch (a.fn) {
    case ActivationFn::silu: return forward_fn<ActivationFn::silu>(a, h, p, f, out);
    case ActivationFn::quick_gelu: return forward_fn<ActivationFn::quick_gelu>(a, h, p, f, out);
    case ActivationFn::gelu: return forward_fn<ActivationFn::gelu>(a, h, p, f, out);
    case ActivationFn::fast_gelu: return forward_fn<ActivationFn::fast_gelu>(a, h, p, f, out);
    case ActivationFn::relu: return forward_fn<ActivationFn::relu>(a, h, p, f, out);
    case ActivationFn::squared_relu: return forward_fn<ActivationFn::squared_relu>(a, h, p, f, out);
    case ActivationFn::sigmoid: return forward_fn<ActivationFn::sigmoid>(a, h, p, f, out);
    case ActivationFn::tanh: return forward_fn<ActivationFn::tanh>(a, h, p, f, out);
  }
}
template <class T>
[[gnu::always_inline]] inline void backward_any(const MlpActivation& a, const T* h, const T* dout, float p,
                                                std::int64_t f, T* dh, float* prod) {
  switch (a.fn) {
    case ActivationFn::silu: return backward_fn<ActivationFn::silu>(a, h, dout, p, f, dh, prod);
    case ActivationFn::quick_gelu: return backward_fn<ActivationFn::quick_gelu>(a, h, dout, p, f, dh, prod);
    case ActivationFn::gelu: return backward_fn<ActivationFn::gelu>(a, h, dout, p, f, dh, prod);
    case ActivationFn::fast_gelu: return backward_fn<ActivationFn::fast_gelu>(a, h, dout, p, f, dh, prod);
    case ActivationFn::relu: return backward_fn<ActivationFn::relu>(a, h, dout, p, f, dh, prod);
    case ActivationFn::squared_relu: return backward_fn<ActivationFn::squared_relu>(a, h, dout, p, f, dh, prod);
    case ActivationFn::sigmoid: return backward_fn<ActivationFn::sigmoid>(a, h, dout, p, f, dh, prod);
    case ActivationFn::tanh: return backward_fn<ActivationFn::tanh>(a, h, dout, p, f, dh, prod);
  }
}

EPX_CPU_CLONES void forward_row_f32(const MlpActivation& a, const float* h, float p, std::int64_t f, float* out) {
  forward_any(a, h, p, f, out);
}
EPX_CPU_CLONES void forward_row_bf16(const MlpActivation& a, const std::uint16_t* h, float p, std::int64_t f,
                                     std::uint16_t* out) {
  forward_any(a, h, p, f, out);
}
EPX_CPU_CLONES void backward_row_f32(const MlpActivation& a, const float* h, const float* dout, float p,
                                     std::int64_t f, float* dh, float* prod) {
  backward_any(a, h, dout, p, f, dh, prod);
}
EPX_CPU_CLONES void backward_row_bf16(const MlpActivation& a, const std::uint16_t* h, const std::uint16_t* dout,
                                      float p, std::int64_t f, std::uint16_t* dh, float* prod) {
  backward_any(a, h, dout, p, f, dh, prod);
}

void forward_row_of(const MlpActivation& a, const float* h, float p, std::int64_t f, float* out) {
  forward_row_f32(a, h, p, f, out);
}
void forward_row_of(const MlpActivation& a, const std::uint16_t* h, float p, std::int64_t f, std::uint16_t* out) {
  forward_row_bf16(a, h, p, f, out);
}
void backward_row_of(const MlpActivation& a, const float* h, const float* d, float p, std::int64_t f, float* dh,
                     float* prod) {
  backward_row_f32(a, h, d, p, f, dh, prod);
}
void backward_row_of(const MlpActivation& a, const std::uint16_t* h, const std::uint16_t* d, float p,
                     std::int64_t f, std::uint16_t* dh, float* prod) {
  backward_row_bf16(a, h, d, p, f, dh, prod);
}

}  // namespace

std::optional<ActivationFn> activation_fn_from_name(std::string_view name) {
  for (const ActivationFn fn : kActivationFns)
    if (name == activation_fn_name(fn)) return fn;
  return std::nullopt;
}

const char* activation_fn_name(ActivationFn fn) {
  switch (fn) {
    case ActivationFn::silu: return "silu";
    case ActivationFn::quick_gelu: return "quick_gelu";
    case ActivationFn::gelu: return "gelu";
    case ActivationFn::fast_gelu: return "fast_gelu";
    case ActivationFn::relu: return "relu";
    case ActivationFn::squared_relu: return "squared_relu";
    case ActivationFn::sigmoid: return "sigmoid";
    case ActivationFn::tanh: return "tanh";
  }
  return "?";
}

void mlp_activation_forward(const MlpActivation& a, const Tensor& h, const float* probs, Tensor& out) {
  const std::int64_t m = h.dim(0), f = out.dim(1), w = a.fc1_width(f);
  detail::expect_shape("mlp_activation_forward", "h", h, {m, w});
  detail::expect_shape("mlp_activation_forward", "out", out, {m, f});
  detail::with_dtype("mlp_activation_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* hp = static_cast<const T*>(h.raw());
    T* op = static_cast<T*>(out.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < m; ++r) forward_row_of(a, hp + r * w, probs ? probs[r] : 1.f, f, op + r * f);
  }, h, out);
}

void mlp_activation_backward(const MlpActivation& a, const Tensor& h, const float* probs, const Tensor& dout, Tensor& dh,
                  float* dprobs) {
  const std::int64_t m = h.dim(0), f = dout.dim(1), w = a.fc1_width(f);
  detail::expect_shape("mlp_activation_backward", "h", h, {m, w});
  detail::expect_shape("mlp_activation_backward", "dout", dout, {m, f});
  detail::expect_shape("mlp_activation_backward", "dh", dh, {m, w});
  detail::with_dtype("mlp_activation_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* hp = static_cast<const T*>(h.raw());
    const T* dop = static_cast<const T*>(dout.raw());
    T* dhp = static_cast<T*>(dh.raw());
#pragma omp parallel
    {
      std::vector<float> prod(static_cast<std::size_t>(f));
#pragma omp for schedule(static)
      for (std::int64_t r = 0; r < m; ++r) {
        backward_row_of(a, hp + r * w, dop + r * f, probs ? probs[r] : 1.f, f, dhp + r * w, prod.data());
        if (!dprobs) continue;
        double dp = 0;  // in order, in FP64
        for (const float v : prod) dp += static_cast<double>(v);
        dprobs[r] = static_cast<float>(dp);
      }
    }
  }, h, dout, dh);
}

}  // namespace epx
