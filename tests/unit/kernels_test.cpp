// Kernels against naive references and finite differences.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/kernels/kernels.hpp"
#include "gradcheck.hpp"

namespace epx {
namespace {

using test::dot;
using test::expect_directional_derivative;
using test::randn;

// C = op(A) op(B) by loops in double.
Tensor naive_gemm(const Tensor& a, Trans ta, const Tensor& b, Trans tb) {
  const std::int64_t m = ta == Trans::N ? a.dim(0) : a.dim(1), k = ta == Trans::N ? a.dim(1) : a.dim(0);
  const std::int64_t n = tb == Trans::N ? b.dim(1) : b.dim(0);
  Tensor c({m, n}, DType::F32);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l)
        s += static_cast<double>(ta == Trans::N ? a.get(i * a.dim(1) + l) : a.get(l * a.dim(1) + i)) *
             (tb == Trans::N ? b.get(l * b.dim(1) + j) : b.get(j * b.dim(1) + l));
      c.set(i * n + j, static_cast<float>(s));
    }
  return c;
}

void expect_close(const Tensor& got, const Tensor& want, double tol) {
  ASSERT_EQ(got.shape(), want.shape());
  for (std::int64_t i = 0; i < got.numel(); ++i)
    ASSERT_NEAR(got.get(i), want.get(i), tol * (1 + std::abs(want.get(i)))) << "element " << i;
}

TEST(Gemm, MatchesNaiveForEveryTransposeAndDtype) {
  const std::int64_t m = 7, k = 33, n = 5;
  for (DType dt : {DType::F32, DType::BF16})
    for (Trans ta : {Trans::N, Trans::T})
      for (Trans tb : {Trans::N, Trans::T}) {
        const Tensor a = randn(ta == Trans::N ? Shape{m, k} : Shape{k, m}, 1, 1.0, dt);
        const Tensor b = randn(tb == Trans::N ? Shape{k, n} : Shape{n, k}, 2, 1.0, dt);
        Tensor c({m, n}, DType::F32);
        gemm(mat(a), ta, mat(b), tb, mat_mut(c));
        // BF16 inputs are exact in the reference too (same rounded values); accumulation is FP32.
        expect_close(c, naive_gemm(a, ta, b, tb), 1e-5);
        gemm(mat(a), ta, mat(b), tb, mat_mut(c), /*accumulate=*/true);
        Tensor twice = naive_gemm(a, ta, b, tb);
        for (std::int64_t i = 0; i < twice.numel(); ++i) twice.set(i, 2 * twice.get(i));
        expect_close(c, twice, 1e-5);
      }
}

TEST(Gemm, Bf16OutputRoundsTheFp32Result) {
  const Tensor a = randn({4, 64}, 3, 1.0, DType::BF16), b = randn({64, 6}, 4, 1.0, DType::BF16);
  Tensor c({4, 6}, DType::BF16);
  gemm(mat(a), Trans::N, mat(b), Trans::N, mat_mut(c));
  const Tensor want = naive_gemm(a, Trans::N, b, Trans::N);
  for (std::int64_t i = 0; i < c.numel(); ++i) EXPECT_NEAR(c.get(i), want.get(i), 1e-2 * (1 + std::abs(want.get(i))));
}

TEST(Gemm, ShapeMismatchThrows) {
  const Tensor a = randn({4, 8}, 1), b = randn({9, 3}, 2);
  Tensor c({4, 3}, DType::F32);
  EXPECT_THROW(gemm(mat(a), Trans::N, mat(b), Trans::N, mat_mut(c)), std::invalid_argument);
}

TEST(Gemm, ReportsTheRuntimeIsa) {
  EXPECT_FALSE(gemm_isa().empty());
  EXPECT_FALSE(gemm_impl(DType::BF16).empty());
}

// Below AVX-512 oneDNN has no BF16 matmul; ctest's kernels.bf16_below_avx512 runs this (and the
// other BF16 tests) with DNNL_MAX_CPU_ISA=AVX2, so the fallback is exercised on any machine.
TEST(Gemm, Bf16WithoutANativeKernelIsWidenedToFp32) {
  if (gemm_impl(DType::BF16).find("widened") == std::string::npos)
    GTEST_SKIP() << "oneDNN has a BF16 matmul here: " << gemm_impl(DType::BF16);
  // Accumulating into BF16: A and B exact in FP32, C widened, one FP32 GEMM, one rounding. The
  // second shape is large enough that the conversions are split over the cores.
  for (const auto [m, k, n] : {std::array<std::int64_t, 3>{9, 40, 11}, {300, 260, 270}}) {
    const Tensor a = randn({m, k}, 5, 1.0, DType::BF16), b = randn({k, n}, 6, 1.0, DType::BF16);
    Tensor c = randn({m, n}, 7, 1.0, DType::BF16);
    Tensor fa({m, k}, DType::F32), fb({k, n}, DType::F32), want({m, n}, DType::F32);
    fa.copy_from(a);
    fb.copy_from(b);
    want.copy_from(c);
    gemm(mat(fa), Trans::N, mat(fb), Trans::N, mat_mut(want), /*accumulate=*/true);
    gemm(mat(a), Trans::N, mat(b), Trans::N, mat_mut(c), /*accumulate=*/true);
    for (std::int64_t i = 0; i < c.numel(); ++i)
      ASSERT_EQ(c.get(i), round_to_bf16(want.get(i))) << m << "x" << k << "x" << n << ", element " << i;
  }
}

TEST(GroupedGemm, EqualsOneGemmPerGroupIncludingEmptyGroups) {
  const std::vector<std::int64_t> counts{3, 0, 5, 1};
  const std::int64_t k = 16, n = 8, rows = 9;
  const Tensor x = randn({rows, k}, 5), w = randn({4, n, k}, 6);
  Tensor y({rows, n}, DType::F32), dw({4, n, k}, DType::F32);
  dw.fill(1.f);  // the wgrad accumulates into it
  std::vector<GemmProblem> fwd, wgrad;
  std::int64_t r0 = 0;
  for (std::int64_t g = 0; g < 4; ++g) {
    fwd.push_back({mat(x, r0, counts[g]), expert_mat(w, g), mat_mut(y, r0, counts[g])});
    wgrad.push_back({mat(y, r0, counts[g]), mat(x, r0, counts[g]), expert_mat_mut(dw, g)});
    r0 += counts[g];
  }
  grouped_gemm(fwd, Trans::N, Trans::T);
  grouped_gemm(wgrad, Trans::T, Trans::N, true);
  r0 = 0;
  for (std::int64_t g = 0; g < 4; ++g) {
    Tensor xg({counts[g], k}, DType::F32), wg({n, k}, DType::F32);
    for (std::int64_t i = 0; i < counts[g] * k; ++i) xg.set(i, x.get(r0 * k + i));
    for (std::int64_t i = 0; i < n * k; ++i) wg.set(i, w.get(g * n * k + i));
    const Tensor yg = naive_gemm(xg, Trans::N, wg, Trans::T);
    for (std::int64_t i = 0; i < counts[g] * n; ++i) EXPECT_NEAR(y.get(r0 * n + i), yg.get(i), 1e-4);
    const Tensor dwg = naive_gemm(yg, Trans::T, xg, Trans::N);  // zero for the empty group
    for (std::int64_t i = 0; i < n * k; ++i) EXPECT_NEAR(dw.get(g * n * k + i), 1 + dwg.get(i), 1e-3);
    r0 += counts[g];
  }
}

// The biases over row groups (one empty), scaled or not: the sums F32 or BF16, one thread's and
// split over (group, column block) tasks past the size that goes parallel, with a ragged last
// block, are bitwise the FP64 sums down each group's rows in order; the bias is added per group.
TEST(RowSums, AreTheInOrderFp64SumsBitwise) {
  for (const DType dt : {DType::F32, DType::BF16})
    for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{9, 7}, {400, 300}}) {
      const Tensor d = randn({rows, cols}, 31).to(dt), scale = randn({rows}, 32);
      const std::vector<std::int64_t> off{2, 5, 5, rows - 1};
      for (const bool scaled : {false, true}) {
        SCOPED_TRACE(fmt::format("{} {}x{} scaled {}", dtype_name(dt), rows, cols, scaled));
        std::vector<float> got(static_cast<std::size_t>(3 * cols), 0.5f);
        add_row_sums(d, off, scaled ? scale.data<float>() : nullptr, got.data());
        for (std::size_t g = 0; g < 3; ++g)
          for (std::int64_t j = 0; j < cols; ++j) {
            double want = 0;
            for (std::int64_t r = off[g]; r < off[g + 1]; ++r)
              want += (scaled ? static_cast<double>(scale.get(r)) : 1.0) * static_cast<double>(d.get(r * cols + j));
            ASSERT_EQ(got[g * static_cast<std::size_t>(cols) + static_cast<std::size_t>(j)], 0.5f + static_cast<float>(want))
                << "group " << g << " column " << j;
          }
      }
    }
  Tensor y({6, 2}, DType::F32);
  const std::vector<float> bias{1, 2, 3, 4}, scale{1, 1, 2, 2, 2, 9};
  add_bias_rows(y, {0, 2, 5}, bias.data(), scale.data());
  EXPECT_EQ(y.get(2), 1.f);   // row 1, group 0
  EXPECT_EQ(y.get(5), 8.f);   // row 2, group 1, times 2
  EXPECT_EQ(y.get(10), 0.f);  // row 5, in no group
}

// Every activation, gated plain, clamped (about a third of the inputs beyond the bound) and with
// GPT-OSS's linear offset, and ungated: the gradients of the input and of the probabilities.
TEST(Glu, GradientsMatchFiniteDifferencesForEveryActivation) {
  const std::int64_t m = 5, f = 6;
  for (const ActivationFn fn : kActivationFns) {
    for (const MlpActivation a :
         {MlpActivation{fn, {}, 0.f}, MlpActivation{fn, 0.9f, 1.f}, MlpActivation{fn, {}, 0.f, /*gated=*/false}}) {
      SCOPED_TRACE(fmt::format("{} clamp {} offset {} gated {}", activation_fn_name(fn), a.clamp.value_or(0.f),
                               a.linear_offset, a.gated));
      const std::int64_t w = a.fc1_width(f);
      Tensor h = randn({m, w}, 7), probs = randn({m}, 8, 0.5), g = randn({m, f}, 9);
      auto loss = [&] {
        Tensor out({m, f}, DType::F32);
        mlp_activation_forward(a, h, probs.data<float>(), out);
        return dot(out, g);
      };
      Tensor dh({m, w}, DType::F32), dprobs({m}, DType::F32);
      mlp_activation_backward(a, h, probs.data<float>(), g, dh, dprobs.data<float>());
      expect_directional_derivative(loss, h, dh, 10, "glu dh", 1e-4);
      expect_directional_derivative(loss, probs, dprobs, 11, "glu dprobs");
    }
  }
}

// The forward against the definitions, written again in double: torch's functions as Megatron-Core
// calls them, then act(min(g, c)) * (clamp(u, -c, c) + offset) * p, or act(h) * p ungated.
TEST(Glu, ForwardMatchesTheDefinitionsInDouble) {
  const auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
  const auto act = [&](ActivationFn fn, double x) {
    switch (fn) {
      case ActivationFn::silu: return x * sig(x);
      case ActivationFn::quick_gelu: return x * sig(1.702 * x);
      case ActivationFn::gelu: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
      case ActivationFn::fast_gelu: return 0.5 * x * (1 + std::tanh(0.7978845608 * x * (1 + 0.044715 * x * x)));
      case ActivationFn::relu: return std::max(x, 0.0);
      case ActivationFn::squared_relu: return std::max(x, 0.0) * std::max(x, 0.0);
      case ActivationFn::sigmoid: return sig(x);
      case ActivationFn::tanh: return std::tanh(x);
    }
    return 0.0;
  };
  const std::int64_t m = 4, f = 64;
  const Tensor h2 = randn({m, 2 * f}, 21, 2.0), probs = randn({m}, 22);
  Tensor gates({m, f}, DType::F32);  // the ungated input: each row's first f columns of h2
  for (std::int64_t i = 0; i < m * f; ++i) gates.set(i, h2.get(i / f * 2 * f + i % f));
  for (const ActivationFn fn : kActivationFns) {
    for (const MlpActivation a : {MlpActivation{fn, {}, 0.f}, MlpActivation{fn, 7.f, 1.f}, MlpActivation{fn, 0.5f, -0.25f},
                                  MlpActivation{fn, {}, 0.f, /*gated=*/false}}) {
      SCOPED_TRACE(fmt::format("{} clamp {} offset {} gated {}", activation_fn_name(fn), a.clamp.value_or(0.f),
                               a.linear_offset, a.gated));
      const Tensor h = a.gated ? h2 : gates;
      Tensor out({m, f}, DType::F32);
      mlp_activation_forward(a, h, probs.data<float>(), out);
      for (std::int64_t r = 0; r < m; ++r)
        for (std::int64_t j = 0; j < f; ++j) {
          double g = h2.get(r * 2 * f + j), u = h2.get(r * 2 * f + f + j);
          if (a.clamp) {
            g = std::min(g, double{*a.clamp});
            u = std::clamp(u, -double{*a.clamp}, double{*a.clamp});
          }
          const double want = act(fn, g) * (a.gated ? u + a.linear_offset : 1.0) * probs.get(r);
          EXPECT_NEAR(out.get(r * f + j), want, 2e-6 * (1 + std::abs(want))) << "row " << r << " column " << j;
        }
      // BF16 computes in FP32 from the same (rounded) inputs and rounds once.
      const Tensor hb = h.to(DType::BF16);
      Tensor ob({m, f}, DType::BF16), of({m, f}, DType::F32);
      mlp_activation_forward(a, hb, probs.data<float>(), ob);
      mlp_activation_forward(a, hb.to(DType::F32), probs.data<float>(), of);
      const Tensor rounded = of.to(DType::BF16);
      for (std::int64_t i = 0; i < m * f; ++i) EXPECT_EQ(ob.get(i), rounded.get(i));
    }
  }
}

// The tanh and the erfc epx vectorises (exp_poly.hpp) against libm's in double, relative, over a
// sweep through each one's switches and far into the tails: the tanh and GELU activations with up = 1.
TEST(Glu, TanhAndGeluCloseToLibmRelativeOverTheirRange) {
  const std::int64_t n = 4001;
  Tensor h({n, 2}, DType::F32), out({n, 1}, DType::F32);
  for (std::int64_t i = 0; i < n; ++i) {
    h.set(2 * i, static_cast<float>(i - n / 2) * 0.005f);  // -10 .. 10
    h.set(2 * i + 1, 1.f);
  }
  mlp_activation_forward({ActivationFn::tanh, {}, 0.f}, h, nullptr, out);
  for (std::int64_t i = 0; i < n; ++i) {
    const double want = std::tanh(static_cast<double>(h.get(2 * i)));
    EXPECT_NEAR(out.get(i), want, 3e-7 * std::abs(want)) << "tanh(" << h.get(2 * i) << ")";
  }
  for (std::int64_t i = 0; i < n; ++i) h.set(2 * i, h.get(2 * i) * 1.25f);  // -12.5 .. 12.5: erfc's 0 from 9 is below
  mlp_activation_forward({ActivationFn::gelu, {}, 0.f}, h, nullptr, out);
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = h.get(2 * i), want = 0.5 * x * std::erfc(-x / std::sqrt(2.0));
    // The rounding of x^2 / 2 costs more digits as |x| grows (GELU is below 3e-4 in size from -4).
    const double rel = std::abs(x) <= 2 ? 1e-6 : std::abs(x) <= 4 ? 2e-6 : 2e-5;
    EXPECT_NEAR(out.get(i), want, rel * std::abs(want) + 1e-35) << "gelu(" << x << ")";
  }
}

TEST(Glu, ActivationNamesRoundTrip) {
  for (const ActivationFn fn : kActivationFns) EXPECT_EQ(activation_fn_from_name(activation_fn_name(fn)), fn);
  EXPECT_FALSE(activation_fn_from_name("swish"));
}

TEST(Softmax, BackwardMatchesFiniteDifferences) {
  const std::int64_t r = 3, c = 7;
  Tensor x = randn({r, c}, 12), g = randn({r, c}, 13);
  auto loss = [&] {
    Tensor y({r, c}, DType::F32);
    softmax_rows(x.data<float>(), y.data<float>(), r, c);
    return dot(y, g);
  };
  Tensor y({r, c}, DType::F32), dx({r, c}, DType::F32);
  softmax_rows(x.data<float>(), y.data<float>(), r, c);
  softmax_backward_rows(y.data<float>(), g.data<float>(), dx.data<float>(), r, c);
  expect_directional_derivative(loss, x, dx, 14, "softmax dx");
}

// The textbook causal attention of one head in double: every row's softmax over the keys it sees
// ([i - window, i], or its whole prefix) and the sink, and the backward by the chain rule; dk and
// dv start at one (the kernel accumulates into them). `loss` is sum(o * dout), for finite
// differences of the sink.
struct NaiveAttention {
  Tensor o, dq, dk, dv;
  std::vector<double> lse;
  std::vector<float> delta;
  double loss = 0;
};
NaiveAttention naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                               std::int64_t window = -1, std::optional<double> sink = std::nullopt) {
  const std::int64_t S = q.dim(0), d = q.dim(1), d_v = v.dim(1);
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  const auto at = [](const Tensor& t, std::int64_t i, std::int64_t j) { return static_cast<double>(t.get(i * t.dim(1) + j)); };
  NaiveAttention r{Tensor({S, d_v}, DType::F32), Tensor({S, d}, DType::F32), Tensor({S, d}, DType::F32),
                   Tensor({S, d_v}, DType::F32), std::vector<double>(S), std::vector<float>(S)};
  std::vector<double> p(static_cast<std::size_t>(S * S), 0.0);
  std::vector<double> dq(static_cast<std::size_t>(S * d)), dk(dq.size(), 1.0), dv(static_cast<std::size_t>(S * d_v), 1.0);
  for (std::int64_t i = 0; i < S; ++i) {
    const std::int64_t lo = window < 0 ? 0 : std::max<std::int64_t>(0, i - window);
    std::vector<double> s(static_cast<std::size_t>(i + 1));
    double mx = sink.value_or(-1e300), sum = 0;
    for (std::int64_t j = lo; j <= i; ++j) {
      for (std::int64_t c = 0; c < d; ++c) s[j] += at(q, i, c) * at(k, j, c) * scale;
      mx = std::max(mx, s[j]);
    }
    for (std::int64_t j = lo; j <= i; ++j) sum += std::exp(s[j] - mx);
    if (sink) sum += std::exp(*sink - mx);
    r.lse[i] = mx + std::log(sum);
    for (std::int64_t j = lo; j <= i; ++j) p[i * S + j] = std::exp(s[j] - r.lse[i]);
    for (std::int64_t c = 0; c < d_v; ++c) {
      double o = 0;
      for (std::int64_t j = lo; j <= i; ++j) o += p[i * S + j] * at(v, j, c);
      r.o.set(i * d_v + c, static_cast<float>(o));
      r.loss += o * at(dout, i, c);
    }
    std::vector<double> dp(static_cast<std::size_t>(i + 1));
    double row_dot = 0;
    for (std::int64_t j = lo; j <= i; ++j) {
      for (std::int64_t c = 0; c < d_v; ++c) dp[j] += at(dout, i, c) * at(v, j, c);
      row_dot += p[i * S + j] * dp[j];
    }
    r.delta[i] = static_cast<float>(row_dot);
    for (std::int64_t j = lo; j <= i; ++j) {
      const double ds = p[i * S + j] * (dp[j] - row_dot) * scale;
      for (std::int64_t c = 0; c < d; ++c) {
        dq[i * d + c] += ds * at(k, j, c);
        dk[j * d + c] += ds * at(q, i, c);
      }
      for (std::int64_t c = 0; c < d_v; ++c) dv[j * d_v + c] += p[i * S + j] * at(dout, i, c);
    }
  }
  for (std::int64_t i = 0; i < S * d; ++i) {
    r.dq.set(i, static_cast<float>(dq[i]));
    r.dk.set(i, static_cast<float>(dk[i]));
  }
  for (std::int64_t i = 0; i < S * d_v; ++i) r.dv.set(i, static_cast<float>(dv[i]));
  return r;
}

// The blocked kernel against it, for blocks that cut the sequence into one block, uneven blocks
// and single rows, with no window, a window of one key (itself), windows inside and across
// blocks, and with and without a sink; in FP32 tightly, in BF16 (the reference then takes the
// rounded inputs) within what rounding the probabilities and score gradients to BF16 costs; values
// as wide as the keys, and narrower (MLA's value heads).
TEST(CausalAttention, BlocksMatchTheNaiveSoftmaxForwardAndBackward) {
  const std::int64_t S = 37, d = 8;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  for (const DType dtype : {DType::F32, DType::BF16})
  for (const std::int64_t d_v : {d, std::int64_t{5}}) {
    const Tensor q = randn({S, d}, 21).to(dtype), k = randn({S, d}, 22).to(dtype), v = randn({S, d_v}, 23).to(dtype),
                 dout = randn({S, d_v}, 24).to(dtype);
    const double tol = dtype == DType::F32 ? 1e-5 : 2e-2;
    for (const std::int64_t window : {-1, 0, 3, 20})
      for (const std::optional<float> sink : {std::optional<float>(), std::optional<float>(0.7f)}) {
        const NaiveAttention want = naive_attention(q.to(DType::F32), k.to(DType::F32), v.to(DType::F32),
                                                    dout.to(DType::F32), window, sink);
        const CausalAttentionMask mask{window, sink ? &*sink : nullptr};
        for (const std::int64_t block : {1, 8, 128}) {
          SCOPED_TRACE(fmt::format("{} d_v {} block {} window {} sink {}", dtype_name(dtype), d_v, block, window,
                                   sink.has_value()));
          Tensor o({S, d_v}, DType::F32), lse({S}, DType::F32), dq({S, d}, DType::F32), dk({S, d}, DType::F32),
              dv({S, d_v}, DType::F32);
          o.fill(7.f);  // written, not accumulated into
          dq.fill(7.f);
          dk.fill(1.f);
          dv.fill(1.f);
          if (dtype == DType::F32) {
            causal_attention_forward(q.data<float>(), k.data<float>(), v.data<float>(), S, d, d_v, scale,
                                     o.data<float>(), lse.data<float>(), mask, block);
            causal_attention_backward(q.data<float>(), k.data<float>(), v.data<float>(), lse.data<float>(),
                                      want.delta.data(), dout.data<float>(), S, d, d_v, scale, dq.data<float>(),
                                      dk.data<float>(), dv.data<float>(), mask, block);
          } else {
            using U = std::uint16_t;
            causal_attention_forward(q.data<U>(), k.data<U>(), v.data<U>(), S, d, d_v, scale, o.data<float>(),
                                     lse.data<float>(), mask, block);
            causal_attention_backward(q.data<U>(), k.data<U>(), v.data<U>(), lse.data<float>(), want.delta.data(),
                                      dout.data<U>(), S, d, d_v, scale, dq.data<float>(), dk.data<float>(),
                                      dv.data<float>(), mask, block);
          }
          expect_close(o, want.o, tol);
          for (std::int64_t i = 0; i < S; ++i)
            ASSERT_NEAR(lse.get(i), want.lse[i], 1e-5 * (1 + std::abs(want.lse[i]))) << "row " << i;
          expect_close(dq, want.dq, tol);
          expect_close(dk, want.dk, tol);
          expect_close(dv, want.dv, tol);
        }
      }
  }
}

// A window as wide as the sequence, or as int64 allows (the strip width must not overflow), is
// no window, bit for bit.
TEST(CausalAttention, AWindowWiderThanTheSequenceChangesNoBit) {
  const std::int64_t S = 21, d = 8;
  const Tensor q = randn({S, d}, 31), k = randn({S, d}, 32), v = randn({S, d}, 33);
  Tensor o1({S, d}, DType::F32), l1({S}, DType::F32);
  causal_attention_forward(q.data<float>(), k.data<float>(), v.data<float>(), S, d, d, 0.3f, o1.data<float>(),
                           l1.data<float>(), {}, 8);
  for (const std::int64_t w : {S, std::numeric_limits<std::int64_t>::max()}) {
    Tensor o2({S, d}, DType::F32), l2({S}, DType::F32);
    causal_attention_forward(q.data<float>(), k.data<float>(), v.data<float>(), S, d, d, 0.3f, o2.data<float>(),
                             l2.data<float>(), {w, nullptr}, 8);
    EXPECT_EQ(0, std::memcmp(o1.raw(), o2.raw(), o1.nbytes())) << w;
    EXPECT_EQ(0, std::memcmp(l1.raw(), l2.raw(), l1.nbytes())) << w;
  }
}

// The sink's gradient from the kernel's lse and delta against central differences of the naive
// double loss, with and without a window.
TEST(CausalAttention, SinkGradientMatchesFiniteDifferences) {
  const std::int64_t S = 19, d = 4;
  const Tensor q = randn({S, d}, 41), k = randn({S, d}, 42), v = randn({S, d}, 43), dout = randn({S, d}, 44);
  for (const std::int64_t window : {-1, 5})
    for (const float sink : {-1.5f, 0.f, 2.f}) {
      SCOPED_TRACE(fmt::format("window {} sink {}", window, sink));
      const NaiveAttention at = naive_attention(q, k, v, dout, window, sink);
      Tensor o({S, d}, DType::F32), lse({S}, DType::F32);
      causal_attention_forward(q.data<float>(), k.data<float>(), v.data<float>(), S, d, d, 0.5f, o.data<float>(),
                               lse.data<float>(), {window, &sink}, 8);
      const double h = 1e-4;
      const double fd = (naive_attention(q, k, v, dout, window, sink + h).loss -
                         naive_attention(q, k, v, dout, window, sink - h).loss) / (2 * h);
      const double got = attention_sink_grad(lse.data<float>(), at.delta.data(), S, sink);
      EXPECT_NEAR(got, fd, 1e-5 * (1 + std::abs(fd)));
      EXPECT_GT(std::abs(fd), 1e-3);  // the check is not vacuous
    }
}

TEST(CausalAttention, RefusesAWindowBelowMinusOne) {
  const Tensor q = randn({4, 2}, 1);
  Tensor o({4, 2}, DType::F32), lse({4}, DType::F32);
  EXPECT_THROW(causal_attention_forward(q.data<float>(), q.data<float>(), q.data<float>(), 4, 2, 2, 1.f, o.data<float>(),
                                        lse.data<float>(), {-2, nullptr}),
               std::invalid_argument);
}

TEST(SumOfSquares, MatchesTheRunningSumWithTails) {
  for (const std::int64_t n : {0, 1, 15, 16, 17, 1000}) {
    const Tensor x = randn({std::max<std::int64_t>(n, 1)}, 40 + static_cast<std::uint64_t>(n));
    double want = 0;
    for (std::int64_t i = 0; i < n; ++i) want += static_cast<double>(x.get(i)) * x.get(i);
    EXPECT_NEAR(sum_of_squares(x.data<float>(), n), want, 1e-12 * (1 + want)) << n << " elements";
  }
}

TEST(TopK, LargestFirstAndTiesGoToTheLowerIndex) {
  const std::vector<float> x{0.5f, 2.f, 2.f, -1.f, 3.f};
  std::vector<std::int32_t> idx(3);
  topk_rows(x.data(), 1, 5, 3, idx.data());
  EXPECT_EQ(idx, (std::vector<std::int32_t>{4, 1, 2}));
}

TEST(RmsNorm, DgradAndWgradMatchFiniteDifferences) {
  const std::int64_t t = 4, h = 8;
  Tensor x = randn({t, h}, 15), gamma = randn({h}, 16), g = randn({t, h}, 17);
  auto loss = [&] {
    Tensor y({t, h}, DType::F32), rstd({t}, DType::F32);
    rmsnorm_forward(x, gamma, 1e-6f, y, rstd);
    return dot(y, g);
  };
  Tensor y({t, h}, DType::F32), rstd({t}, DType::F32), dx({t, h}, DType::F32), dgamma({h}, DType::F32);
  rmsnorm_forward(x, gamma, 1e-6f, y, rstd);
  rmsnorm_dgrad(x, gamma, rstd, g, dx);
  rmsnorm_wgrad(x, rstd, g, dgamma);
  expect_directional_derivative(loss, x, dx, 18, "rmsnorm dx");
  expect_directional_derivative(loss, gamma, dgamma, 19, "rmsnorm dgamma");
}

TEST(CrossEntropy, ValueAndGradient) {
  const std::int64_t t = 3, v = 5;
  Tensor logits = randn({t, v}, 20), targets({t}, DType::I64), lse({t}, DType::F32);
  for (std::int64_t i = 0; i < t; ++i) targets.data<std::int64_t>()[i] = (i * 2) % v;
  // A uniform distribution costs log(V).
  Tensor flat({t, v}, DType::F32);
  EXPECT_NEAR(cross_entropy_forward(flat, targets, lse), std::log(5.0), 1e-6);
  auto loss = [&] { return cross_entropy_forward(logits, targets, lse); };
  Tensor dlogits({t, v}, DType::F32);
  loss();
  cross_entropy_backward(logits, targets, lse, 1.f, dlogits);
  expect_directional_derivative(loss, logits, dlogits, 21, "cross-entropy dlogits");
  targets.data<std::int64_t>()[0] = v;
  EXPECT_THROW(loss(), std::invalid_argument);
}

// A vocabulary wider than the 16 lanes, with a tail, against the loss and softmax in double.
TEST(CrossEntropy, WideRowsMatchTheNaiveSoftmaxInDouble) {
  const std::int64_t t = 4, v = 1003;
  const Tensor logits = randn({t, v}, 30, 3.0);
  Tensor targets({t}, DType::I64), lse({t}, DType::F32), dlogits({t, v}, DType::F32);
  for (std::int64_t i = 0; i < t; ++i) targets.data<std::int64_t>()[i] = (i * 331) % v;
  double want = 0;
  std::vector<double> want_lse(t);
  for (std::int64_t r = 0; r < t; ++r) {
    double mx = -1e300, sum = 0;
    for (std::int64_t c = 0; c < v; ++c) mx = std::max(mx, static_cast<double>(logits.get(r * v + c)));
    for (std::int64_t c = 0; c < v; ++c) sum += std::exp(logits.get(r * v + c) - mx);
    want_lse[r] = mx + std::log(sum);
    want += want_lse[r] - logits.get(r * v + targets.data<std::int64_t>()[r]);
  }
  EXPECT_NEAR(cross_entropy_forward(logits, targets, lse), want / t, 1e-5);
  cross_entropy_backward(logits, targets, lse, 2.f, dlogits);
  for (std::int64_t r = 0; r < t; ++r)
    for (std::int64_t c = 0; c < v; ++c) {
      const double p = std::exp(logits.get(r * v + c) - want_lse[r]) - (c == targets.data<std::int64_t>()[r] ? 1 : 0);
      ASSERT_NEAR(dlogits.get(r * v + c), p * 2 / t, 1e-6) << "row " << r << " column " << c;
    }
}

TEST(Permute, ExpertMajorRoundTripAndAdjoint) {
  // 4 tokens, 3 experts, 2 routes each.
  const std::vector<std::uint8_t> map{1, 1, 0,  0, 1, 1,  1, 0, 1,  0, 1, 1};
  const Permutation p = make_permutation(map.data(), 4, 3);
  EXPECT_EQ(p.tokens_per_expert, (std::vector<std::int64_t>{2, 3, 3}));
  EXPECT_EQ(p.row_token, (std::vector<std::int64_t>{0, 2, 0, 1, 3, 1, 2, 3}));
  const Tensor x = randn({4, 6}, 22);
  Tensor rows({8, 6}, DType::F32), back({4, 6}, DType::F32);
  permute_rows(x, p, rows);
  unpermute_rows(rows, p, back);
  for (std::int64_t i = 0; i < x.numel(); ++i) EXPECT_FLOAT_EQ(back.get(i), 2 * x.get(i));  // k copies summed
  // unpermute is the adjoint (the backward) of permute: <P x, y> = <x, P^T y>.
  const Tensor y = randn({8, 6}, 23);
  Tensor pty({4, 6}, DType::F32);
  unpermute_rows(y, p, pty);
  EXPECT_NEAR(dot(rows, y), dot(x, pty), 1e-4);
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// Permutation 2: chunks [A][B] -> [B][A], and the transposed sizes bring them back.
TEST(Permute, TransposeChunksRoundTrip) {
  const std::vector<std::int64_t> rows{2, 0, 1, 3, 1, 0};  // A = 2 sources x B = 3 experts
  std::vector<float> in;
  for (std::size_t c = 0; c < rows.size(); ++c)
    for (std::int64_t r = 0; r < rows[c]; ++r) in.push_back(static_cast<float>(10 * c + r));
  std::vector<float> out(in.size()), back(in.size());
  transpose_chunks(in.data(), out.data(), sizeof(float), rows, 2, 3);
  // Expert-major: (a0,b0) (a1,b0) (a0,b1) (a1,b1) (a0,b2) (a1,b2)
  EXPECT_EQ(out, (std::vector<float>{0, 1, 30, 31, 32, 40, 20}));
  transpose_chunks(out.data(), back.data(), sizeof(float), transposed_chunk_rows(rows, 2, 3), 3, 2);
  EXPECT_EQ(back, in);
}

}  // namespace
}  // namespace epx
