// Elementwise sums of activations (F32 or BF16), in FP32.
#include <stdexcept>

#include "epx/kernels/kernels.hpp"
#include "float_access.hpp"

namespace epx {

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  detail::expect_shape("add", "b", b, a.shape());
  if (out.numel() != a.numel()) detail::expect_shape("add", "out", out, a.shape());
  detail::with_dtype("add", [&](auto tag) {
    using T = decltype(tag);
    const T *ap = static_cast<const T*>(a.raw()), *bp = static_cast<const T*>(b.raw());
    T* op = static_cast<T*>(out.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < a.numel(); ++i) detail::st(op, i, detail::ld(ap, i) + detail::ld(bp, i));
  }, a, b, out);
}

void add(const Tensor& a, const Tensor& b, const Tensor& c, Tensor& out) {
  detail::expect_shape("add", "b", b, a.shape());
  detail::expect_shape("add", "c", c, a.shape());
  if (out.numel() != a.numel()) detail::expect_shape("add", "out", out, a.shape());
  detail::with_dtype("add", [&](auto tag) {
    using T = decltype(tag);
    const T *ap = static_cast<const T*>(a.raw()), *bp = static_cast<const T*>(b.raw()),
            *cp = static_cast<const T*>(c.raw());
    T* op = static_cast<T*>(out.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < a.numel(); ++i)
      detail::st(op, i, detail::ld(ap, i) + detail::ld(bp, i) + detail::ld(cp, i));
  }, a, b, c, out);
}

void add_f32(const Tensor& a, const Tensor& b_f32, const Tensor* c, Tensor& out) {
  detail::expect_shape("add_f32", "b", b_f32, a.shape());
  if (b_f32.dtype() != DType::F32) throw std::invalid_argument("add_f32: b must be F32");
  if (c) detail::expect_shape("add_f32", "c", *c, a.shape());
  if (c && c->dtype() != a.dtype()) throw std::invalid_argument("add_f32: c must have a's dtype");
  if (out.numel() != a.numel()) detail::expect_shape("add_f32", "out", out, a.shape());
  detail::with_dtype("add_f32", [&](auto tag) {
    using T = decltype(tag);
    const T* ap = static_cast<const T*>(a.raw());
    const T* cp = c ? static_cast<const T*>(c->raw()) : nullptr;
    const float* bp = b_f32.data<float>();
    T* op = static_cast<T*>(out.raw());
    const std::int64_t n = a.numel();
    if (cp) {
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < n; ++i) detail::st(op, i, detail::ld(ap, i) + bp[i] + detail::ld(cp, i));
    } else {
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < n; ++i) detail::st(op, i, detail::ld(ap, i) + bp[i]);
    }
  }, a, out);
}

}  // namespace epx
