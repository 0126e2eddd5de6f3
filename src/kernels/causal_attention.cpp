// Blocked causal attention for one head, FP32. Query block i (rows [r0, r0 + rows)) only sees
// keys [0, r0 + rows), so its scores are a [rows, r0 + rows] strip: one GEMM against the keys it
// can see, a softmax of each row over its unmasked prefix, one GEMM with the values. No S x S
// matrix exists, the key blocks above the diagonal are never multiplied (the causal half of the
// FLOPs, plus half of each diagonal block), and the strip stays in cache. The backward recomputes
// each strip's probabilities from the saved log-sum-exp (as flash attention does) and accumulates
// dK and dV over the query blocks in order, so results do not depend on threads.
//
// The row loops are compiled per ISA (EPX_CPU_CLONES, built without FMA contraction) and their
// sums run in 16 fixed lanes, so they vectorise and give the same bits on every CPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "exp_poly.hpp"

namespace epx {
namespace {

constexpr int kLanes = 16;

MatRef f32_mat(const float* p, std::int64_t rows, std::int64_t cols) { return {p, DType::F32, rows, cols}; }
MatMut f32_mut(float* p, std::int64_t rows, std::int64_t cols) { return {p, DType::F32, rows, cols}; }

// A scaled score row -> probabilities: row[j] = exp(row[j] * scale - max) / sum for j < valid,
// 0 for valid <= j < n. Returns the row's log-sum-exp of the scaled scores.
EPX_CPU_CLONES float softmax_prefix_row(float* row, std::int64_t valid, std::int64_t n, float scale) {
  float lane[kLanes];
  for (float& l : lane) l = -std::numeric_limits<float>::infinity();
  std::int64_t j = 0;
  for (; j + kLanes <= valid; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], row[j + l]);
  for (; j < valid; ++j) lane[0] = std::max(lane[0], row[j]);
  float mx = lane[0];
  for (int l = 1; l < kLanes; ++l) mx = std::max(mx, lane[l]);
  mx *= scale;  // scale > 0: the largest scaled score

  for (j = 0; j < valid; ++j) row[j] = detail::exp_poly(row[j] * scale - mx);
  for (float& l : lane) l = 0.f;
  for (j = 0; j + kLanes <= valid; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += row[j + l];
  for (; j < valid; ++j) lane[0] += row[j];
  float sum = 0.f;
  for (const float l : lane) sum += l;
  const float inv = 1.f / sum;
  for (j = 0; j < valid; ++j) row[j] *= inv;
  for (; j < n; ++j) row[j] = 0.f;
  return mx + std::log(sum);
}

// The backward's probabilities from the saved log-sum-exp.
EPX_CPU_CLONES void probs_from_lse_row(float* row, std::int64_t valid, std::int64_t n, float scale, float lse) {
  std::int64_t j = 0;
  for (; j < valid; ++j) row[j] = detail::exp_poly(row[j] * scale - lse);
  for (; j < n; ++j) row[j] = 0.f;
}

// dS = P * (dP - delta) * scale, in place over dP (zero where P is masked).
EPX_CPU_CLONES void score_grad_row(const float* p, float* dp, std::int64_t n, float delta, float scale) {
  for (std::int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta) * scale;
}

void check_args(const char* kernel, std::int64_t seq, std::int64_t d, std::int64_t block) {
  if (seq < 1 || d < 1 || block < 1)
    throw std::invalid_argument(fmt::format("{}: seq {}, head_dim {}, block {} must be positive", kernel, seq, d, block));
}

}  // namespace

void causal_attention_forward(const float* q, const float* k, const float* v, std::int64_t seq, std::int64_t d,
                              float scale, float* out, float* lse, std::int64_t block) {
  check_args("causal_attention_forward", seq, d, block);
  std::vector<float> strip(static_cast<std::size_t>(std::min(block, seq) * seq));
  for (std::int64_t r0 = 0; r0 < seq; r0 += block) {
    const std::int64_t rows = std::min(block, seq - r0), keys = r0 + rows;
    gemm(f32_mat(q + r0 * d, rows, d), Trans::N, f32_mat(k, keys, d), Trans::T, f32_mut(strip.data(), rows, keys));
    for (std::int64_t r = 0; r < rows; ++r)
      lse[r0 + r] = softmax_prefix_row(strip.data() + r * keys, r0 + r + 1, keys, scale);
    gemm(f32_mat(strip.data(), rows, keys), Trans::N, f32_mat(v, keys, d), Trans::N, f32_mut(out + r0 * d, rows, d));
  }
}

void causal_attention_backward(const float* q, const float* k, const float* v, const float* lse, const float* delta,
                               const float* dout, std::int64_t seq, std::int64_t d, float scale, float* dq, float* dk,
                               float* dv, std::int64_t block) {
  check_args("causal_attention_backward", seq, d, block);
  const std::size_t strip_size = static_cast<std::size_t>(std::min(block, seq) * seq);
  std::vector<float> p(strip_size), dp(strip_size);
  for (std::int64_t r0 = 0; r0 < seq; r0 += block) {
    const std::int64_t rows = std::min(block, seq - r0), keys = r0 + rows;
    gemm(f32_mat(q + r0 * d, rows, d), Trans::N, f32_mat(k, keys, d), Trans::T, f32_mut(p.data(), rows, keys));
    for (std::int64_t r = 0; r < rows; ++r)
      probs_from_lse_row(p.data() + r * keys, r0 + r + 1, keys, scale, lse[r0 + r]);
    // dV += P^T dO;  dP = dO V^T;  dS = P (dP - delta) scale;  dQ = dS K;  dK += dS^T Q.
    gemm(f32_mat(p.data(), rows, keys), Trans::T, f32_mat(dout + r0 * d, rows, d), Trans::N, f32_mut(dv, keys, d), true);
    gemm(f32_mat(dout + r0 * d, rows, d), Trans::N, f32_mat(v, keys, d), Trans::T, f32_mut(dp.data(), rows, keys));
    for (std::int64_t r = 0; r < rows; ++r)
      score_grad_row(p.data() + r * keys, dp.data() + r * keys, keys, delta[r0 + r], scale);
    gemm(f32_mat(dp.data(), rows, keys), Trans::N, f32_mat(k, keys, d), Trans::N, f32_mut(dq + r0 * d, rows, d));
    gemm(f32_mat(dp.data(), rows, keys), Trans::T, f32_mat(q + r0 * d, rows, d), Trans::N, f32_mut(dk, keys, d), true);
  }
}

}  // namespace epx
