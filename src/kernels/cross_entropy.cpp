// Token-mean cross-entropy over a vocabulary, with the log-sum-exp saved for the backward.
//
// Each row walks the whole vocabulary once forward and once backward, so the rows are compiled
// per ISA (EPX_CPU_CLONES, no FMA contraction) with the vectorisable exp of exp_poly.hpp and the
// sums in 16 fixed lanes: the same bits on every CPU. (Before, the exps were libm's in double,
// about 5% of a step on the medium recipe; the loss moved in its last digits.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "exp_poly.hpp"
#include "float_access.hpp"
#include "lanes.hpp"

namespace epx {
namespace {

template <class T>
[[gnu::always_inline]] inline float row_lse(const T* x, std::int64_t v) {
  using detail::kLanes;
  const float mx = detail::max_in_lanes(x, v);
  float lane[kLanes] = {};
  std::int64_t c = 0;
  for (; c + kLanes <= v; c += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += detail::exp_poly(detail::ld(x, c + l) - mx);
  for (; c < v; ++c) lane[0] += detail::exp_poly(detail::ld(x, c) - mx);
  float sum = 0.f;
  for (const float l : lane) sum += l;
  return mx + std::log(sum);
}

// dx = (softmax(x) - onehot(target)) * scale (dx may be x: the target's logit is read first).
template <class T>
[[gnu::always_inline]] inline void row_grad(const T* x, float lse, std::int64_t target, float scale, std::int64_t v,
                                            T* dx) {
  const float at_target = detail::ld(x, target);
  for (std::int64_t c = 0; c < v; ++c) detail::st(dx, c, detail::exp_poly(detail::ld(x, c) - lse) * scale);
  detail::st(dx, target, (detail::exp_poly(at_target - lse) - 1.f) * scale);
}

EPX_CPU_CLONES float row_lse_f32(const float* x, std::int64_t v) { return row_lse(x, v); }
EPX_CPU_CLONES float row_lse_bf16(const std::uint16_t* x, std::int64_t v) { return row_lse(x, v); }
EPX_CPU_CLONES void row_grad_f32(const float* x, float lse, std::int64_t t, float s, std::int64_t v, float* dx) {
  row_grad(x, lse, t, s, v, dx);
}
EPX_CPU_CLONES void row_grad_bf16(const std::uint16_t* x, float lse, std::int64_t t, float s, std::int64_t v,
                                  std::uint16_t* dx) {
  row_grad(x, lse, t, s, v, dx);
}
float row_lse_of(const float* x, std::int64_t v) { return row_lse_f32(x, v); }
float row_lse_of(const std::uint16_t* x, std::int64_t v) { return row_lse_bf16(x, v); }
void row_grad_of(const float* x, float lse, std::int64_t t, float s, std::int64_t v, float* dx) {
  row_grad_f32(x, lse, t, s, v, dx);
}
void row_grad_of(const std::uint16_t* x, float lse, std::int64_t t, float s, std::int64_t v, std::uint16_t* dx) {
  row_grad_bf16(x, lse, t, s, v, dx);
}

void check_targets(const std::int64_t* tgt, std::int64_t t, std::int64_t v) {
  for (std::int64_t r = 0; r < t; ++r)
    if (tgt[r] < 0 || tgt[r] >= v)
      throw std::invalid_argument(fmt::format("cross_entropy: target {} of token {} is outside the vocabulary [0, {})", tgt[r], r, v));
}

}  // namespace

double cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& lse) {
  const std::int64_t t = logits.dim(0), v = logits.dim(1);
  detail::expect_shape("cross_entropy", "targets", targets, {t});
  detail::expect_shape("cross_entropy", "lse", lse, {t});
  const std::int64_t* tgt = targets.data<std::int64_t>();
  check_targets(tgt, t, v);
  float* l = lse.data<float>();
  double total = 0;
  detail::with_dtype("cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t; ++r) l[r] = row_lse_of(x + r * v, v);
    for (std::int64_t r = 0; r < t; ++r) total += l[r] - detail::ld(x, r * v + tgt[r]);  // in order
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
  check_targets(tgt, t, v);
  const float* l = lse.data<float>();
  const float scale = t == 0 ? 0.f : dloss / static_cast<float>(t);
  detail::with_dtype("cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits.raw());
    T* dx = static_cast<T*>(dlogits.raw());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t; ++r) row_grad_of(x + r * v, l[r], tgt[r], scale, v, dx + r * v);
  }, logits, dlogits);
}

}  // namespace epx
