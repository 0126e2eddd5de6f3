// Elementwise sums of activations (F32 or BF16), in FP32, and the linear layers' biases.
#include <algorithm>
#include <stdexcept>
#include <vector>

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

void add_bias_rows(Tensor& y, std::int64_t r0, std::int64_t r1, const float* bias, const float* scale) {
  if (y.dtype() != DType::F32 || y.rank() != 2 || r0 < 0 || r1 > y.dim(0))
    throw std::invalid_argument("add_bias_rows: y must be a 2-D F32 tensor holding the rows");
  const std::int64_t n = y.dim(1);
  float* yp = y.data<float>();
#pragma omp parallel for schedule(static)
  for (std::int64_t r = r0; r < r1; ++r) {
    const float p = scale ? scale[r] : 1.f;
    for (std::int64_t j = 0; j < n; ++j) yp[r * n + j] += p * bias[j];
  }
}

void add_row_sums(const Tensor& d, std::int64_t r0, std::int64_t r1, const float* scale, float* out) {
  if (d.rank() != 2 || r0 < 0 || r1 > d.dim(0)) throw std::invalid_argument("add_row_sums: d must be 2-D holding the rows");
  const std::int64_t n = d.dim(1);
  // Threads take column blocks and sum each column down the rows in order: the same FP64 sums,
  // bit for bit, at any thread count. Small sums stay on one thread.
  constexpr std::int64_t kBlock = 64;
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  detail::with_dtype("add_row_sums", [&](auto tag) {
    using T = decltype(tag);
    const T* dp = static_cast<const T*>(d.raw());
#pragma omp parallel for schedule(static) if (blocks > 1 && (r1 - r0) * n >= 65536)
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t j0 = b * kBlock, j1 = std::min(n, j0 + kBlock);
      double sum[kBlock] = {};
      for (std::int64_t r = r0; r < r1; ++r) {
        const double p = scale ? scale[r] : 1.0;
        for (std::int64_t j = j0; j < j1; ++j) sum[j - j0] += p * detail::ld(dp, r * n + j);
      }
      for (std::int64_t j = j0; j < j1; ++j) out[j] += static_cast<float>(sum[j - j0]);
    }
  }, d);
}

}  // namespace epx
