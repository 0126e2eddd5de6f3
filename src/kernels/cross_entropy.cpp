// Token-mean cross-entropy over a vocabulary, with the log-sum-exp saved for the backward.
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"
#include "float_access.hpp"

namespace epx {

double cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& lse) {
  const std::int64_t t = logits.dim(0), v = logits.dim(1);
  detail::expect_shape("cross_entropy", "targets", targets, {t});
  detail::expect_shape("cross_entropy", "lse", lse, {t});
  const std::int64_t* tgt = targets.data<std::int64_t>();
  float* l = lse.data<float>();
  double total = 0;
  detail::with_dtype("cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits.raw());
    for (std::int64_t r = 0; r < t; ++r) {
      if (tgt[r] < 0 || tgt[r] >= v)
        throw std::invalid_argument(fmt::format("cross_entropy: target {} of token {} is outside the vocabulary [0, {})", tgt[r], r, v));
      float mx = detail::ld(x, r * v);
      for (std::int64_t c = 1; c < v; ++c) mx = std::max(mx, detail::ld(x, r * v + c));
      double sum = 0;
      for (std::int64_t c = 0; c < v; ++c) sum += std::exp(static_cast<double>(detail::ld(x, r * v + c) - mx));
      l[r] = mx + static_cast<float>(std::log(sum));
      total += l[r] - detail::ld(x, r * v + tgt[r]);
    }
  }, logits);
  return t == 0 ? 0.0 : total / static_cast<double>(t);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float dloss, Tensor& dlogits) {
  const std::int64_t t = logits.dim(0), v = logits.dim(1);
  detail::expect_shape("cross_entropy_backward", "targets", targets, {t});
  detail::expect_shape("cross_entropy_backward", "lse", lse, {t});
  detail::expect_shape("cross_entropy_backward", "dlogits", dlogits, logits.shape());
  const std::int64_t* tgt = targets.data<std::int64_t>();
  const float* l = lse.data<float>();
  const float scale = t == 0 ? 0.f : dloss / static_cast<float>(t);
  detail::with_dtype("cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits.raw());
    T* dx = static_cast<T*>(dlogits.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t; ++r)
      for (std::int64_t c = 0; c < v; ++c) {
        const float p = std::exp(detail::ld(x, r * v + c) - l[r]);
        detail::st(dx, r * v + c, (p - (c == tgt[r] ? 1.f : 0.f)) * scale);
      }
  }, logits, dlogits);
}

}  // namespace epx
