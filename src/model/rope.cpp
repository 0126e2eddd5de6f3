#include "epx/model/rope.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <tuple>

namespace epx {
namespace {

// YaRN's _yarn_find_correction_dim: the dim whose frequency turns `rotations` times over the
// original context.
double correction_dim(double rotations, double dim, double base, double original) {
  return dim * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
}

}  // namespace

std::vector<double> rope_inv_freq(const RopeSpec& r) {
  const double dim = static_cast<double>(r.dim);
  std::vector<double> f(static_cast<std::size_t>((r.dim + 1) / 2));
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = std::pow(r.base, -2.0 * static_cast<double>(i) / dim);
  if (!r.yarn) return f;
  const YarnSpec& y = *r.yarn;
  double low = correction_dim(y.beta_fast, dim, r.base, y.original_max_positions);
  double high = correction_dim(y.beta_slow, dim, r.base, y.original_max_positions);
  if (y.round_to_int) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // Megatron's guard against a zero-width ramp
  for (std::size_t i = 0; i < f.size(); ++i) {
    // ramp 0: the extrapolated (original) frequency; 1: interpolated, divided by the factor.
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    f[i] += (f[i] / y.factor - f[i]) * ramp;
  }
  return f;
}

RopeTable::RopeTable(std::int64_t seq, const RopeSpec& r) {
  const std::vector<double> f = rope_inv_freq(r);
  const double m = r.concentration;
  half_ = static_cast<std::int64_t>(f.size());
  cos_.resize(static_cast<std::size_t>(seq * half_));
  sin_.resize(cos_.size());
  for (std::int64_t pos = 0; pos < seq; ++pos)
    for (std::int64_t i = 0; i < half_; ++i) {
      const double a = static_cast<double>(pos) * f[static_cast<std::size_t>(i)];
      cos_[static_cast<std::size_t>(pos * half_ + i)] = static_cast<float>(m * std::cos(a));
      sin_[static_cast<std::size_t>(pos * half_ + i)] = static_cast<float>(m * std::sin(a));
    }
}

void RopeTable::rotate(const float* in, float* out, std::int64_t d, std::int64_t pos, bool inverse) const {
  const float* c = cos_.data() + pos * half_;
  const float* sn = sin_.data() + pos * half_;
  for (std::int64_t i = 0; i < half_; ++i) {
    const float s = inverse ? -sn[i] : sn[i];
    const float x0 = in[i], x1 = in[i + half_];
    out[i] = x0 * c[i] - x1 * s;
    out[i + half_] = x1 * c[i] + x0 * s;
  }
  std::copy(in + 2 * half_, in + d, out + 2 * half_);
}

const RopeTable& rope_table(std::int64_t seq, const RopeSpec& r) {
  static std::mutex mu;
  // Keyed by the sequence length and what the table is made of.
  static std::map<std::tuple<std::int64_t, std::vector<double>, double>, std::unique_ptr<const RopeTable>> tables;
  std::lock_guard lock(mu);
  auto& table = tables[{seq, rope_inv_freq(r), r.concentration}];
  if (!table) table = std::make_unique<const RopeTable>(seq, r);
  return *table;
}

}  // namespace epx
