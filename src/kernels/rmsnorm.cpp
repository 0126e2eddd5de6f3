// RMSNorm (no bias, no mean subtraction): the norm of Megatron's Qwen and DeepSeek layers.
#include <cmath>

#include "epx/kernels/kernels.hpp"
#include "float_access.hpp"

namespace epx {

void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
  const std::int64_t t = x.dim(0), h = x.dim(1);
  detail::expect_shape("rmsnorm_forward", "gamma", gamma, {h});
  detail::expect_shape("rmsnorm_forward", "rstd", rstd, {t});
  detail::expect_shape("rmsnorm_forward", "y", y, x.shape());
  const float* g = gamma.data<float>();
  float* rs = rstd.data<float>();
  detail::with_dtype("rmsnorm_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.raw());
    T* yp = static_cast<T*>(y.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t; ++r) {
      double ss = 0;
      for (std::int64_t j = 0; j < h; ++j) {
        const double v = detail::ld(xp, r * h + j);
        ss += v * v;
      }
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(h) + eps));
      rs[r] = inv;
      for (std::int64_t j = 0; j < h; ++j) detail::st(yp, r * h + j, detail::ld(xp, r * h + j) * inv * g[j]);
    }
  }, x, y);
}

void rmsnorm_dgrad(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx) {
  const std::int64_t t = x.dim(0), h = x.dim(1);
  detail::expect_shape("rmsnorm_dgrad", "gamma", gamma, {h});
  detail::expect_shape("rmsnorm_dgrad", "rstd", rstd, {t});
  detail::expect_shape("rmsnorm_dgrad", "dy", dy, x.shape());
  detail::expect_shape("rmsnorm_dgrad", "dx", dx, x.shape());
  const float* g = gamma.data<float>();
  const float* rs = rstd.data<float>();
  detail::with_dtype("rmsnorm_dgrad", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.raw());
    const T* dyp = static_cast<const T*>(dy.raw());
    T* dxp = static_cast<T*>(dx.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t; ++r) {
      // dx = rstd * (g*dy - x * rstd^2 * mean(g*dy*x))
      double dot = 0;
      for (std::int64_t j = 0; j < h; ++j)
        dot += static_cast<double>(g[j] * detail::ld(dyp, r * h + j)) * detail::ld(xp, r * h + j);
      const float c = static_cast<float>(dot / static_cast<double>(h)) * rs[r] * rs[r];
      for (std::int64_t j = 0; j < h; ++j)
        detail::st(dxp, r * h + j,
                   rs[r] * (g[j] * detail::ld(dyp, r * h + j) - detail::ld(xp, r * h + j) * c));
    }
  }, x, dy, dx);
}

void rmsnorm_wgrad(const Tensor& x, const Tensor& rstd, const Tensor& dy, Tensor& dgamma) {
  const std::int64_t t = x.dim(0), h = x.dim(1);
  detail::expect_shape("rmsnorm_wgrad", "rstd", rstd, {t});
  detail::expect_shape("rmsnorm_wgrad", "dy", dy, x.shape());
  detail::expect_shape("rmsnorm_wgrad", "dgamma", dgamma, {h});
  const float* rs = rstd.data<float>();
  float* dg = dgamma.data<float>();
  detail::with_dtype("rmsnorm_wgrad", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.raw());
    const T* dyp = static_cast<const T*>(dy.raw());
    // Columns split across threads, tokens summed in order: deterministic.
#pragma omp parallel for schedule(static)
    for (std::int64_t j = 0; j < h; ++j) {
      double acc = 0;
      for (std::int64_t r = 0; r < t; ++r)
        acc += static_cast<double>(detail::ld(dyp, r * h + j)) * detail::ld(xp, r * h + j) * rs[r];
      dg[j] += static_cast<float>(acc);
    }
  }, x, dy);
}

}  // namespace epx
