// Elementwise sums of activations (F32 or BF16), in FP32.
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

}  // namespace epx
