// SwiGLU with the routing probability folded in after the activation (Megatron-Core's
// weighted_bias_swiglu): out = silu(gate) * up * p. Applying p here, before fc2, makes the
// expert output p * Expert(x), so combine is a plain sum.
//
// The rows are the experts' hot elementwise work (the whole [T k, 2F] fc1 output, forward and
// backward), so each row is one function compiled per ISA (EPX_CPU_CLONES) with an exp the
// compiler can vectorise (exp_poly.hpp), within 2 ulp of libm's; epx used std::exp before and
// its results moved by that much.
#include <cstdint>
#include <vector>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "exp_poly.hpp"
#include "float_access.hpp"


namespace epx {
namespace {

[[gnu::always_inline]] inline float sigmoid(float x) { return 1.f / (1.f + detail::exp_poly(-x)); }

template <class T>
[[gnu::always_inline]] inline void forward_row(const T* h, float p, std::int64_t f, T* out) {
  for (std::int64_t j = 0; j < f; ++j) {
    const float g = detail::ld(h, j), u = detail::ld(h, f + j);
    detail::st(out, j, g * sigmoid(g) * u * p);
  }
}

// prod[j] = silu * up * dout, for the probability's gradient (summed in order by the caller).
template <class T>
[[gnu::always_inline]] inline void backward_row(const T* h, const T* dout, float p, std::int64_t f, T* dh, float* prod) {
  for (std::int64_t j = 0; j < f; ++j) {
    const float g = detail::ld(h, j), u = detail::ld(h, f + j);
    const float d = detail::ld(dout, j);
    const float s = sigmoid(g), silu = g * s;
    prod[j] = silu * u * d;
    const float dsilu = s * (1.f + g * (1.f - s));
    detail::st(dh, j, d * p * u * dsilu);
    detail::st(dh, f + j, d * p * silu);
  }
}

EPX_CPU_CLONES void forward_row_f32(const float* h, float p, std::int64_t f, float* out) { forward_row(h, p, f, out); }
EPX_CPU_CLONES void forward_row_bf16(const std::uint16_t* h, float p, std::int64_t f, std::uint16_t* out) {
  forward_row(h, p, f, out);
}
EPX_CPU_CLONES void backward_row_f32(const float* h, const float* dout, float p, std::int64_t f, float* dh, float* prod) {
  backward_row(h, dout, p, f, dh, prod);
}
EPX_CPU_CLONES void backward_row_bf16(const std::uint16_t* h, const std::uint16_t* dout, float p, std::int64_t f,
                                      std::uint16_t* dh, float* prod) {
  backward_row(h, dout, p, f, dh, prod);
}

void forward_row_of(const float* h, float p, std::int64_t f, float* out) { forward_row_f32(h, p, f, out); }
void forward_row_of(const std::uint16_t* h, float p, std::int64_t f, std::uint16_t* out) { forward_row_bf16(h, p, f, out); }
void backward_row_of(const float* h, const float* d, float p, std::int64_t f, float* dh, float* prod) {
  backward_row_f32(h, d, p, f, dh, prod);
}
void backward_row_of(const std::uint16_t* h, const std::uint16_t* d, float p, std::int64_t f, std::uint16_t* dh,
                     float* prod) {
  backward_row_bf16(h, d, p, f, dh, prod);
}

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
    for (std::int64_t r = 0; r < m; ++r) forward_row_of(hp + r * 2 * f, probs ? probs[r] : 1.f, f, op + r * f);
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
#pragma omp parallel
    {
      std::vector<float> prod(static_cast<std::size_t>(f));
#pragma omp for schedule(static)
      for (std::int64_t r = 0; r < m; ++r) {
        backward_row_of(hp + r * 2 * f, dop + r * f, probs ? probs[r] : 1.f, f, dhp + r * 2 * f, prod.data());
        double dp = 0;  // in order, in FP64
        for (const float v : prod) dp += static_cast<double>(v);
        if (dprobs) dprobs[r] = static_cast<float>(dp);
      }
    }
  }, h, dout, dh);
}

}  // namespace epx
