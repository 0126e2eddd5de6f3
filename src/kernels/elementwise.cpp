// Elementwise sums of activations (F32 or BF16), in FP32, and the linear layers' biases.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

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

namespace {

void check_groups(const char* kernel, const Tensor& t, const std::vector<std::int64_t>& off) {
  bool ok = t.rank() == 2 && off.size() >= 2 && off.front() >= 0 && off.back() <= t.dim(0);
  for (std::size_t g = 0; ok && g + 1 < off.size(); ++g) ok = off[g] <= off[g + 1];
  if (!ok) throw std::invalid_argument(fmt::format("{}: the tensor must be 2-D holding ascending row groups", kernel));
}

}  // namespace

void add_bias_rows(Tensor& y, const std::vector<std::int64_t>& off, const float* bias, const float* scale) {
  if (y.dtype() != DType::F32) throw std::invalid_argument("add_bias_rows: y must be F32");
  check_groups("add_bias_rows", y, off);
  const std::int64_t n = y.dim(1);
  float* yp = y.data<float>();
#pragma omp parallel for schedule(static)
  for (std::int64_t r = off.front(); r < off.back(); ++r) {
    const auto g = std::upper_bound(off.begin(), off.end(), r) - off.begin() - 1;
    const float* b = bias + g * n;
    const float p = scale ? scale[r] : 1.f;
    for (std::int64_t j = 0; j < n; ++j) yp[r * n + j] += p * b[j];
  }
}

void add_row_sums(const Tensor& d, const std::vector<std::int64_t>& off, const float* scale, float* out) {
  check_groups("add_row_sums", d, off);
  const std::int64_t n = d.dim(1), groups = static_cast<std::int64_t>(off.size()) - 1;
  // Threads take (group, column block) tasks and sum each column down its group's rows in order:
  // the same FP64 sums, bit for bit, at any thread count. Small sums stay on one thread.
  constexpr std::int64_t kBlock = 64;
  const std::int64_t blocks = (n + kBlock - 1) / kBlock, tasks = groups * blocks;
  detail::with_dtype("add_row_sums", [&](auto tag) {
    using T = decltype(tag);
    const T* dp = static_cast<const T*>(d.raw());
#pragma omp parallel for schedule(static) if (tasks > 1 && (off.back() - off.front()) * n >= 65536)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t g = task / blocks, j0 = task % blocks * kBlock, j1 = std::min(n, j0 + kBlock);
      double sum[kBlock] = {};
      for (std::int64_t r = off[static_cast<std::size_t>(g)]; r < off[static_cast<std::size_t>(g) + 1]; ++r) {
        const double p = scale ? scale[r] : 1.0;
        for (std::int64_t j = j0; j < j1; ++j) sum[j - j0] += p * detail::ld(dp, r * n + j);
      }
      for (std::int64_t j = j0; j < j1; ++j) out[g * n + j] += static_cast<float>(sum[j - j0]);
    }
  }, d);
}

}  // namespace epx
