#include "epx/moe/experts.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"

namespace epx {
namespace {

// Row offsets of each group, checked against the row count.
std::vector<std::int64_t> offsets(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  std::vector<std::int64_t> off(counts.size() + 1, 0);
  for (std::size_t g = 0; g < counts.size(); ++g) off[g + 1] = off[g] + counts[g];
  if (off.back() != rows)
    throw std::invalid_argument(fmt::format("experts: group counts sum to {}, input has {} rows", off.back(), rows));
  return off;
}

// Group g's rows of y [M, N] F32 += bias[g] (times probs[r] where given); bias [G, N] in the
// compute dtype.
void add_group_biases(Tensor& y, const Param& bias, const std::vector<std::int64_t>& off, const float* probs) {
  add_bias_rows(y, off, bias.compute.to(DType::F32).data<float>(), probs);
}

}  // namespace

GroupedMlp::GroupedMlp(std::string prefix, std::int64_t groups, std::int64_t hidden,
                       std::int64_t ffn, DType dtype, MlpActivation activation, bool grouped,
                       Recompute recompute, bool bias)
    : recompute(recompute),
      fc1(prefix + ".linear_fc1.weight", {groups, activation.fc1_width(ffn), hidden}, dtype),
      fc2(prefix + ".linear_fc2.weight", {groups, hidden, ffn}, dtype),
      fc1_bias(prefix + ".linear_fc1.bias", {bias ? groups : 0, activation.fc1_width(ffn)}, dtype),
      fc2_bias(prefix + ".linear_fc2.bias", {bias ? groups : 0, hidden}, dtype),
      groups_(groups), hidden_(hidden), ffn_(ffn), dtype_(dtype), activation_(activation), grouped_(grouped) {
  fc1.expert = fc2.expert = fc1_bias.expert = fc2_bias.expert = grouped;
  fc1_bias.bias = fc2_bias.bias = true;
}

std::vector<Param*> GroupedMlp::params() {
  if (has_bias()) return {&fc1, &fc2, &fc1_bias, &fc2_bias};
  return {&fc1, &fc2};
}

std::string GroupedMlp::tensor_name(const Param& p, std::int64_t g) const {
  return grouped_ ? fmt::format("{}{}", p.name, g) : p.name;
}

Tensor GroupedMlp::forward(const Tensor& x, std::vector<std::int64_t> counts,
                           std::vector<float> probs, Saved& s) const {
  const std::int64_t m = x.dim(0);
  if (x.dtype() != dtype_ || x.dim(1) != hidden_)
    throw std::invalid_argument(fmt::format("experts: input is {} {}, expected [M, {}] {}", shape_string(x.shape()),
                                            dtype_name(x.dtype()), hidden_, dtype_name(dtype_)));
  if (static_cast<std::int64_t>(counts.size()) != groups_)
    throw std::invalid_argument("experts: one count per group expected");
  offsets(counts, m);
  s.x = x;
  s.counts = std::move(counts);
  s.probs = std::move(probs);
  recompute_activations(s);
  // With a bias the GEMM writes FP32, the bias is added and the sum rounded once.
  Tensor y({m, hidden_}, has_bias() ? DType::F32 : dtype_);
  const auto off = offsets(s.counts, m);
  std::vector<GemmProblem> p2;
  for (std::int64_t g = 0; g < groups_; ++g) {
    const std::int64_t r0 = off[static_cast<std::size_t>(g)], n = s.counts[static_cast<std::size_t>(g)];
    p2.push_back({mat(s.act, r0, n), expert_mat(fc2.compute, g), mat_mut(y, r0, n)});
  }
  grouped_gemm(p2, Trans::N, Trans::T);
  if (has_bias()) {
    add_group_biases(y, fc2_bias, off, s.probs.empty() ? nullptr : s.probs.data());
    y = y.to(dtype_);
  }
  if (recompute == Recompute::all) s.h = Tensor();
  if (recompute != Recompute::none) s.act = Tensor();
  return y;
}

void GroupedMlp::recompute_activations(Saved& s) const {
  const std::int64_t m = s.x.dim(0);
  if (!s.h.defined()) {
    const auto off = offsets(s.counts, m);
    s.h = Tensor::uninitialized({m, activation_.fc1_width(ffn_)}, has_bias() ? DType::F32 : dtype_);
    std::vector<GemmProblem> p1;
    for (std::int64_t g = 0; g < groups_; ++g) {
      const std::int64_t r0 = off[static_cast<std::size_t>(g)], n = s.counts[static_cast<std::size_t>(g)];
      p1.push_back({mat(s.x, r0, n), expert_mat(fc1.compute, g), mat_mut(s.h, r0, n)});
    }
    grouped_gemm(p1, Trans::N, Trans::T);
    if (has_bias()) {
      add_group_biases(s.h, fc1_bias, off, nullptr);
      s.h = s.h.to(dtype_);
    }
  }
  if (!s.act.defined()) {
    s.act = Tensor::uninitialized({m, ffn_}, dtype_);
    mlp_activation_forward(activation_, s.h, s.probs.empty() ? nullptr : s.probs.data(), s.act);
  }
}

Tensor GroupedMlp::backward_dgrad(Saved& s, const Tensor& dy, std::vector<float>* dprobs) const {
  const std::int64_t m = s.x.dim(0);
  if (dy.shape() != Shape{m, hidden_} || dy.dtype() != dtype_)
    throw std::invalid_argument("experts: output gradient shape or dtype mismatch");
  const auto off = offsets(s.counts, m);
  recompute_activations(s);  // what the forward dropped (recompute_modules)
  s.dy = dy;
  Tensor dact({m, ffn_}, dtype_);
  s.dh = Tensor({m, activation_.fc1_width(ffn_)}, dtype_);
  Tensor dx({m, hidden_}, dtype_);
  std::vector<GemmProblem> p2, p1;
  for (std::int64_t g = 0; g < groups_; ++g) {
    const std::int64_t r0 = off[static_cast<std::size_t>(g)], n = s.counts[static_cast<std::size_t>(g)];
    p2.push_back({mat(dy, r0, n), expert_mat(fc2.compute, g), mat_mut(dact, r0, n)});
    p1.push_back({mat(s.dh, r0, n), expert_mat(fc1.compute, g), mat_mut(dx, r0, n)});
  }
  grouped_gemm(p2, Trans::N, Trans::N);
  float* dp = nullptr;
  if (!s.probs.empty() && dprobs) {
    dprobs->assign(static_cast<std::size_t>(m), 0.f);
    dp = dprobs->data();
  }
  mlp_activation_backward(activation_, s.h, s.probs.empty() ? nullptr : s.probs.data(), dact, s.dh, dp);
  if (dp && has_bias()) {  // fc2's bias is scaled by the probability: dp += dy . b2
    const Tensor b = fc2_bias.compute.to(DType::F32), dy32 = dy.to(DType::F32);
    const float *bp = b.data<float>(), *dyp = dy32.data<float>();
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < m; ++r) {
      const float* bg = bp + (std::upper_bound(off.begin(), off.end(), r) - off.begin() - 1) * hidden_;  // r's group
      double sum = 0;  // in order, in FP64, as the activation's part
      for (std::int64_t j = 0; j < hidden_; ++j) sum += static_cast<double>(dyp[r * hidden_ + j]) * bg[j];
      dp[r] += static_cast<float>(sum);
    }
  }
  grouped_gemm(p1, Trans::N, Trans::N);
  return dx;
}

void GroupedMlp::backward_wgrad(Saved& s) {
  if (!s.dy.defined()) throw std::logic_error("experts: wgrad before dgrad");
  const auto off = offsets(s.counts, s.x.dim(0));
  std::vector<GemmProblem> p2, p1;
  for (std::int64_t g = 0; g < groups_; ++g) {
    const std::int64_t r0 = off[static_cast<std::size_t>(g)], n = s.counts[static_cast<std::size_t>(g)];
    // dW2[H, F] += dy^T act;  dW1[2F or F, H] += dh^T x.
    p2.push_back({mat(s.dy, r0, n), mat(s.act, r0, n), expert_mat_mut(fc2.grad, g)});
    p1.push_back({mat(s.dh, r0, n), mat(s.x, r0, n), expert_mat_mut(fc1.grad, g)});
  }
  grouped_gemm(p2, Trans::T, Trans::N, /*accumulate=*/true);
  grouped_gemm(p1, Trans::T, Trans::N, /*accumulate=*/true);
  if (has_bias()) {  // db2 += sum of p dy; db1 += sum of dh
    add_row_sums(s.dy, off, s.probs.empty() ? nullptr : s.probs.data(), fc2_bias.grad.data<float>());
    add_row_sums(s.dh, off, nullptr, fc1_bias.grad.data<float>());
  }
  s = Saved{};
}

}  // namespace epx
