#include "epx/train/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/base/cpu_clones.hpp"

namespace epx {

double LrSchedule::at(std::int64_t step) const {
  const std::int64_t samples = step * samples_per_step;
  if (warmup_samples > 0 && samples <= warmup_samples)
    return warmup_init + (max_lr - warmup_init) * static_cast<double>(samples) / warmup_samples;
  if (style == "constant") return max_lr;
  if (samples > decay_samples) return min_lr;
  const double ratio = (static_cast<double>(samples) - warmup_samples) / (static_cast<double>(decay_samples) - warmup_samples);
  const double coeff = style == "cosine" ? 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0) : 1.0 - ratio;
  return min_lr + coeff * (max_lr - min_lr);
}


namespace {

// One Adam update of n elements, in FP64 as before, vectorised per ISA (the same operations in
// every variant).
EPX_CPU_CLONES void adam_update(float* w, const float* g, float* m, float* v, std::int64_t n, double b1, double b2,
                                double c1, double c2, double eps, double wd, double lr) {
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = static_cast<float>(b1 * m[i] + (1 - b1) * g[i]);
    v[i] = static_cast<float>(b2 * v[i] + (1 - b2) * static_cast<double>(g[i]) * g[i]);
    const double update = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + wd * w[i];
    w[i] = static_cast<float>(w[i] - lr * update);
  }
}

std::vector<ParamRange> whole(const std::vector<Param*>& params) {
  std::vector<ParamRange> out;
  for (Param* p : params) out.push_back({p, 0, p->master.numel()});
  return out;
}

}  // namespace

Adam::Adam(std::vector<Param*> params, const OptimizerConfig& config) : Adam(whole(params), config) {}

Adam::Adam(std::vector<ParamRange> ranges, const OptimizerConfig& config) : config_(config) {
  if (config.optimizer != "adam")
    throw ConfigError(fmt::format("optimizer.optimizer={}: epx implements adam; set optimizer.optimizer=adam", config.optimizer));
  for (const ParamRange& r : ranges) {
    const std::int64_t n = r.end - r.begin;
    if (n > 0) states_.push_back({r, Tensor({n}, DType::F32), Tensor({n}, DType::F32), r.param->master.rank() > 1 && !r.param->bias, Tensor()});
  }
}

void Adam::step(double lr) {
  ++steps_;
  const double b1 = config_.adam_beta1, b2 = config_.adam_beta2, eps = config_.adam_eps;
  const double c1 = 1.0 - std::pow(b1, static_cast<double>(steps_)), c2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  for (State& s : states_) {
    float* w = s.master.defined() ? s.master.data<float>() : s.range.param->master.data<float>() + s.range.begin;
    const float* g = s.range.param->grad.data<float>() + s.range.begin;
    float *m = s.m.data<float>(), *v = s.v.data<float>();
    const double wd = s.decay ? config_.weight_decay : 0.0;
    const std::int64_t n = s.range.end - s.range.begin;
    constexpr std::int64_t kBlock = 16384;  // elements per thread's task
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; i += kBlock)
      adam_update(w + i, g + i, m + i, v + i, std::min(kBlock, n - i), b1, b2, c1, c2, eps, wd, lr);
    s.range.param->refresh(s.range.begin, s.range.end, w);
  }
}

void Adam::take_masters() {
  for (State& s : states_) {
    const Param* p = s.range.param;
    if (p->compute.dtype() != DType::BF16 || s.master.defined()) continue;
    if (!p->master.defined()) throw std::logic_error("Adam::take_masters: " + p->name + "'s master is gone already");
    const std::int64_t n = s.range.end - s.range.begin;
    s.master = Tensor({n}, DType::F32);
    std::copy_n(p->master.data<float>() + s.range.begin, n, s.master.data<float>());
  }
}


}  // namespace epx
