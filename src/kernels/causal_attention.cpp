// Blocked causal attention for one head. Query block i (rows [r0, r0 + rows)) only sees keys
// [k0, r0 + rows), k0 = 0 or, under a sliding window w, r0 - w, so its scores are a
// [rows, r0 + rows - k0] strip: one GEMM against the keys it can see, a softmax of each row over
// its unmasked range, one GEMM with the values. No S x S matrix exists, the key blocks above the
// diagonal (and left of the window) are never multiplied (the diagonal blocks are, whole: the
// causal half of the FLOPs plus half a block per block row), and the strip stays in cache. The
// backward recomputes each strip's probabilities from the saved log-sum-exp (as flash attention
// does) and accumulates dK and dV over the query blocks in order, so results do not depend on
// threads. A sink (Megatron's softmax_offset) is one more logit in every row's softmax, with no
// value: it only enlarges the log-sum-exp, and its gradient follows from that and delta.
//
// In BF16 (a BF16 model) the GEMMs take BF16 operands with FP32 accumulation, as flash attention
// does on a GPU: q, k, v and dO come in BF16, the probabilities and the score gradient are
// rounded to BF16 for the GEMMs that read them, and the softmax, the log-sum-exp and every
// output and accumulator stay FP32.
//
// The row loops are compiled per ISA (EPX_CPU_CLONES, built without FMA contraction) and their
// sums run in 16 fixed lanes, so they vectorise and give the same bits on every CPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "exp_poly.hpp"
#include "float_access.hpp"
#include "lanes.hpp"

namespace epx {
namespace {

template <class T> constexpr DType dtype_of = DType::F32;
template <> constexpr DType dtype_of<std::uint16_t> = DType::BF16;
template <class T> MatRef as_mat(const T* p, std::int64_t rows, std::int64_t cols) { return {p, dtype_of<T>, rows, cols}; }
MatMut f32_mut(float* p, std::int64_t rows, std::int64_t cols) { return {p, DType::F32, rows, cols}; }

// A score row -> probabilities: p[j] = exp(row[j] * scale - max) / sum for lo <= j < hi, 0 for
// the other j < n (p may be the row itself); the sum counts exp(*sink - max) as well when there
// is a sink. Returns the row's log-sum-exp of the scaled scores (and the sink).
template <class T>
[[gnu::always_inline]] inline float softmax_range(float* row, std::int64_t lo, std::int64_t hi, std::int64_t n,
                                                  float scale, const float* sink, T* p) {
  using detail::kLanes;
  float* r = row + lo;
  const std::int64_t valid = hi - lo;
  float mx = detail::max_in_lanes(r, valid) * scale;  // scale > 0: the largest scaled score
  if (sink) mx = std::max(mx, *sink);
  std::int64_t j = 0;
  for (; j < valid; ++j) r[j] = detail::exp_poly(r[j] * scale - mx);
  float lane[kLanes] = {};
  for (j = 0; j + kLanes <= valid; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += r[j + l];
  for (; j < valid; ++j) lane[0] += r[j];
  float sum = 0.f;
  for (const float l : lane) sum += l;
  if (sink) sum += detail::exp_poly(*sink - mx);
  const float inv = 1.f / sum;
  for (j = 0; j < lo; ++j) detail::st(p, j, 0.f);
  for (; j < hi; ++j) detail::st(p, j, row[j] * inv);
  for (; j < n; ++j) detail::st(p, j, 0.f);
  return mx + std::log(sum);
}

// The backward's probabilities from the saved log-sum-exp, in place in FP32 and, for BF16, rounded
// into p as well.
template <class T>
[[gnu::always_inline]] inline void probs_from_lse(float* row, std::int64_t lo, std::int64_t hi, std::int64_t n,
                                                  float scale, float lse, T* p) {
  std::int64_t j = 0;
  for (; j < lo; ++j) row[j] = 0.f;
  for (; j < hi; ++j) row[j] = detail::exp_poly(row[j] * scale - lse);
  for (; j < n; ++j) row[j] = 0.f;
  if constexpr (!std::is_same_v<T, float>)
    for (j = 0; j < n; ++j) detail::st(p, j, row[j]);
}

// dS = P * (dP - delta) * scale (zero where P is masked), into ds (which may be dp).
template <class T>
[[gnu::always_inline]] inline void score_grad(const float* p, const float* dp, std::int64_t n, float delta, float scale,
                                              T* ds) {
  for (std::int64_t j = 0; j < n; ++j) detail::st(ds, j, p[j] * (dp[j] - delta) * scale);
}

EPX_CPU_CLONES float softmax_range_f32(float* row, std::int64_t lo, std::int64_t hi, std::int64_t n, float scale,
                                        const float* sink, float* p) {
  return softmax_range(row, lo, hi, n, scale, sink, p);
}
EPX_CPU_CLONES float softmax_range_bf16(float* row, std::int64_t lo, std::int64_t hi, std::int64_t n, float scale,
                                         const float* sink, std::uint16_t* p) {
  return softmax_range(row, lo, hi, n, scale, sink, p);
}
EPX_CPU_CLONES void probs_from_lse_f32(float* row, std::int64_t lo, std::int64_t hi, std::int64_t n, float scale,
                                       float lse, float* p) {
  probs_from_lse(row, lo, hi, n, scale, lse, p);
}
EPX_CPU_CLONES void probs_from_lse_bf16(float* row, std::int64_t lo, std::int64_t hi, std::int64_t n, float scale,
                                        float lse, std::uint16_t* p) {
  probs_from_lse(row, lo, hi, n, scale, lse, p);
}
EPX_CPU_CLONES void score_grad_f32(const float* p, const float* dp, std::int64_t n, float delta, float scale, float* ds) {
  score_grad(p, dp, n, delta, scale, ds);
}
EPX_CPU_CLONES void score_grad_bf16(const float* p, const float* dp, std::int64_t n, float delta, float scale,
                                    std::uint16_t* ds) {
  score_grad(p, dp, n, delta, scale, ds);
}
float softmax_range_of(float* r, std::int64_t lo, std::int64_t hi, std::int64_t n, float s, const float* sink, float* p) {
  return softmax_range_f32(r, lo, hi, n, s, sink, p);
}
float softmax_range_of(float* r, std::int64_t lo, std::int64_t hi, std::int64_t n, float s, const float* sink,
                       std::uint16_t* p) {
  return softmax_range_bf16(r, lo, hi, n, s, sink, p);
}
void probs_from_lse_of(float* r, std::int64_t lo, std::int64_t hi, std::int64_t n, float s, float l, float* p) {
  probs_from_lse_f32(r, lo, hi, n, s, l, p);
}
void probs_from_lse_of(float* r, std::int64_t lo, std::int64_t hi, std::int64_t n, float s, float l, std::uint16_t* p) {
  probs_from_lse_bf16(r, lo, hi, n, s, l, p);
}
void score_grad_of(const float* p, const float* dp, std::int64_t n, float d, float s, float* ds) { score_grad_f32(p, dp, n, d, s, ds); }
void score_grad_of(const float* p, const float* dp, std::int64_t n, float d, float s, std::uint16_t* ds) {
  score_grad_bf16(p, dp, n, d, s, ds);
}

void check_args(const char* kernel, std::int64_t seq, std::int64_t d, std::int64_t d_v, std::int64_t block, float scale,
                const CausalAttentionMask& mask) {
  if (seq < 1 || d < 1 || d_v < 1 || block < 1 || !(scale > 0.f && std::isfinite(scale)))  // the softmax's max needs scale > 0
    throw std::invalid_argument(fmt::format("{}: seq {}, head_dim {}, value width {}, block {} and scale {} must be positive",
                                            kernel, seq, d, d_v, block, scale));
  if (mask.window < -1)  // a sink that is not finite is the model's NaN, which the NaN check reports
    throw std::invalid_argument(fmt::format("{}: window {} must be -1 (none) or at least 0", kernel, mask.window));
}

// The first key query row i sees (a block's rows see from its first row's on).
std::int64_t first_key(std::int64_t i, const CausalAttentionMask& mask) {
  return mask.window < 0 ? 0 : std::max<std::int64_t>(0, i - mask.window);
}

// The strips of one query block: FP32 scores (and FP32 probabilities in the backward), and for
// BF16 the GEMM operand copies; for FP32 the operands are the FP32 strips themselves. A strip is
// at most block x (block + window) (x seq without a window); every element a block reads its GEMM
// or its softmax wrote first, so the buffers start uninitialised (zero-filling them cost more than
// a windowed head's GEMMs).
template <class T>
struct Strips {
  std::unique_ptr<float[]> scores, grad;
  std::unique_ptr<T[]> op, grad_op;
  Strips(std::int64_t seq, std::int64_t block, const CausalAttentionMask& mask, bool backward) {
    const std::int64_t width = mask.window < 0 || mask.window >= seq ? seq : std::min(seq, block + mask.window);
    const auto n = static_cast<std::size_t>(std::min(block, seq) * width);
    scores.reset(new float[n]);
    if (backward) grad.reset(new float[n]);
    if constexpr (!std::is_same_v<T, float>) {
      op.reset(new T[n]);
      if (backward) grad_op.reset(new T[n]);
    }
  }
  T* probs() {
    if constexpr (std::is_same_v<T, float>) return scores.get();
    else return op.get();
  }
  T* score_grad() {
    if constexpr (std::is_same_v<T, float>) return grad.get();
    else return grad_op.get();
  }
};

template <class T>
void forward(const T* q, const T* k, const T* v, std::int64_t seq, std::int64_t d, std::int64_t d_v, float scale,
             float* out, float* lse, const CausalAttentionMask& mask, std::int64_t block) {
  check_args("causal_attention_forward", seq, d, d_v, block, scale, mask);
  Strips<T> strip(seq, block, mask, false);
  for (std::int64_t r0 = 0; r0 < seq; r0 += block) {
    const std::int64_t rows = std::min(block, seq - r0), k0 = first_key(r0, mask), keys = r0 + rows - k0;
    gemm(as_mat(q + r0 * d, rows, d), Trans::N, as_mat(k + k0 * d, keys, d), Trans::T,
         f32_mut(strip.scores.get(), rows, keys));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = r0 + r;
      lse[i] = softmax_range_of(strip.scores.get() + r * keys, first_key(i, mask) - k0, i + 1 - k0, keys, scale,
                                mask.sink, strip.probs() + r * keys);
    }
    gemm(as_mat(strip.probs(), rows, keys), Trans::N, as_mat(v + k0 * d_v, keys, d_v), Trans::N,
         f32_mut(out + r0 * d_v, rows, d_v));
  }
}

template <class T>
void backward(const T* q, const T* k, const T* v, const float* lse, const float* delta, const T* dout, std::int64_t seq,
              std::int64_t d, std::int64_t d_v, float scale, float* dq, float* dk, float* dv,
              const CausalAttentionMask& mask, std::int64_t block) {
  check_args("causal_attention_backward", seq, d, d_v, block, scale, mask);
  Strips<T> strip(seq, block, mask, true);
  for (std::int64_t r0 = 0; r0 < seq; r0 += block) {
    const std::int64_t rows = std::min(block, seq - r0), k0 = first_key(r0, mask), keys = r0 + rows - k0;
    float* p = strip.scores.get();
    float* dp = strip.grad.get();
    gemm(as_mat(q + r0 * d, rows, d), Trans::N, as_mat(k + k0 * d, keys, d), Trans::T, f32_mut(p, rows, keys));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = r0 + r;
      probs_from_lse_of(p + r * keys, first_key(i, mask) - k0, i + 1 - k0, keys, scale, lse[i], strip.probs() + r * keys);
    }
    // dV += P^T dO;  dP = dO V^T;  dS = P (dP - delta) scale;  dQ = dS K;  dK += dS^T Q.
    gemm(as_mat(strip.probs(), rows, keys), Trans::T, as_mat(dout + r0 * d_v, rows, d_v), Trans::N,
         f32_mut(dv + k0 * d_v, keys, d_v), true);
    gemm(as_mat(dout + r0 * d_v, rows, d_v), Trans::N, as_mat(v + k0 * d_v, keys, d_v), Trans::T, f32_mut(dp, rows, keys));
    for (std::int64_t r = 0; r < rows; ++r)
      score_grad_of(p + r * keys, dp + r * keys, keys, delta[r0 + r], scale, strip.score_grad() + r * keys);
    gemm(as_mat(strip.score_grad(), rows, keys), Trans::N, as_mat(k + k0 * d, keys, d), Trans::N,
         f32_mut(dq + r0 * d, rows, d));
    gemm(as_mat(strip.score_grad(), rows, keys), Trans::T, as_mat(q + r0 * d, rows, d), Trans::N,
         f32_mut(dk + k0 * d, keys, d), true);
  }
}

}  // namespace

void causal_attention_forward(const float* q, const float* k, const float* v, std::int64_t seq, std::int64_t d,
                              std::int64_t d_v, float scale, float* out, float* lse, const CausalAttentionMask& mask,
                              std::int64_t block) {
  forward(q, k, v, seq, d, d_v, scale, out, lse, mask, block);
}
void causal_attention_forward(const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, std::int64_t seq,
                              std::int64_t d, std::int64_t d_v, float scale, float* out, float* lse,
                              const CausalAttentionMask& mask, std::int64_t block) {
  forward(q, k, v, seq, d, d_v, scale, out, lse, mask, block);
}
void causal_attention_backward(const float* q, const float* k, const float* v, const float* lse, const float* delta,
                               const float* dout, std::int64_t seq, std::int64_t d, std::int64_t d_v, float scale,
                               float* dq, float* dk, float* dv, const CausalAttentionMask& mask, std::int64_t block) {
  backward(q, k, v, lse, delta, dout, seq, d, d_v, scale, dq, dk, dv, mask, block);
}
void causal_attention_backward(const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, const float* lse,
                               const float* delta, const std::uint16_t* dout, std::int64_t seq, std::int64_t d,
                               std::int64_t d_v, float scale, float* dq, float* dk, float* dv,
                               const CausalAttentionMask& mask, std::int64_t block) {
  backward(q, k, v, lse, delta, dout, seq, d, d_v, scale, dq, dk, dv, mask, block);
}

double attention_sink_grad(const float* lse, const float* delta, std::int64_t seq, float sink) {
  double g = 0;
  for (std::int64_t i = 0; i < seq; ++i) g -= std::exp(static_cast<double>(sink) - lse[i]) * delta[i];
  return g;
}

}  // namespace epx
