// The GPT model `epx run` trains, on one rank: gradients of the attention and of the whole model
// against finite differences (FP32), activation recompute against none (bitwise), the LR schedule,
// the mock data and the config errors.
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "epx/config/yarn.hpp"
#include "epx/model/gpt_model.hpp"
#include "epx/config/scheduler_steps.hpp"
#include "epx/train/job_spec.hpp"
#include "epx/train/mock_data.hpp"
#include "epx/train/optimizer.hpp"
#include "gradcheck.hpp"
#include "small_gpt.hpp"
#include "tensor_compare.hpp"

namespace epx {
namespace {

using test::expect_directional_derivative;
using test::randn;


Config tiny(const std::vector<std::string>& overrides = {}) {
  // The shared small GPT at a shorter sequence, a smaller vocabulary, larger weights and no aux loss.
  Config c = load_config_text(test::kSmallGpt, "tiny");
  for (const char* o : {"model.layernorm_epsilon=1.0e-6", "model.seq_length=12", "model.vocab_size=40",
                        "model.init_method_std=0.1", "model.moe_aux_loss_coeff=0", "train.micro_batch_size=2"})
    apply_override(c, o);
  for (const auto& o : overrides) apply_override(c, o);
  return c;
}

GPTModel make_model(const ModelSpec& spec) {
  GPTModel m(spec, [&] { return make_local_dispatcher(spec.moe->num_experts); });
  m.init_weights(7);
  return m;
}

struct Batch {
  Tensor tokens, targets;
};
Batch batch(const ModelSpec& spec) {
  Batch b;
  MockData(MockData::Mode::random, spec.vocab, spec.seq_length, 3).micro_batch(0, spec.micro_batch, b.tokens, b.targets);
  return b;
}

// The input's and every parameter's gradient of sum(attention(x) * r) against finite differences.
void check_attention_gradients(SelfAttention& attn) {
  const std::int64_t S = 5, B = 2, H = attn.spec().hidden;
  Tensor x = randn({S * B, H}, 4);
  const Tensor r = randn({S * B, H}, 5);
  const auto f = [&] {
    SelfAttention::Context c;
    return test::dot(attn.forward(x, S, c), r);
  };
  for (Param* p : attn.params()) p->grad.zero();
  SelfAttention::Context ctx;
  attn.forward(x, S, ctx);
  const Tensor dx = attn.backward_dgrad(ctx, r);
  attn.backward_wgrad(ctx);
  expect_directional_derivative(f, x, dx, 11, "dx");
  for (Param* p : attn.params())
    expect_directional_derivative(f, p->master, p->grad, 12, p->name.c_str());
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  // Every channel rotated; the first 4 of 6 at Megatron's odd dim 3 (partial RoPE); a softmax scale
  // of the config's; a sliding window of 2 with learned sinks and YaRN (GPT-OSS); the off-by-one sink.
  struct Case {
    std::int64_t rope_dim;
    std::optional<float> scale;
    std::int64_t window;
    AttentionSoftmax softmax;
    std::optional<YarnSpec> yarn;
  };
  const YarnSpec yarn{.factor = 8, .original_max_positions = 4, .beta_fast = 2, .beta_slow = 0.5};
  for (const Case& k : {Case{0, {}, -1, AttentionSoftmax::vanilla, {}}, Case{3, {}, -1, AttentionSoftmax::vanilla, {}},
                        Case{0, 0.3f, -1, AttentionSoftmax::vanilla, {}},
                        Case{0, {}, 2, AttentionSoftmax::learnable, yarn},
                        Case{0, {}, -1, AttentionSoftmax::off_by_one, {}}}) {
  SCOPED_TRACE(fmt::format("rope_dim {} scale {} window {} softmax {} yarn {}", k.rope_dim, k.scale.value_or(0),
                           k.window, static_cast<int>(k.softmax), k.yarn.has_value()));
  AttentionSpec s{.hidden = 16, .heads = 4, .groups = 2, .head_dim = 6, .qk_norm = true, .eps = 1e-6f, .rope = true,
                  .rope_base = 100, .rope_dim = k.rope_dim, .yarn = k.yarn, .window = k.window, .softmax = k.softmax,
                  .dtype = DType::F32};
  s.softmax_scale = k.scale;
  SelfAttention attn("a", s);
  attn.linear_qkv.master.copy_from(randn(attn.linear_qkv.master.shape(), 1, 0.3));
  attn.linear_proj.master.copy_from(randn(attn.linear_proj.master.shape(), 2, 0.3));
  attn.q_layernorm.master.copy_from(randn({6}, 3, 0.2));
  for (std::int64_t i = 0; i < 6; ++i) attn.q_layernorm.master.set(i, 1 + attn.q_layernorm.master.get(i));
  if (k.softmax == AttentionSoftmax::learnable) attn.softmax_offset.master.copy_from(randn({4}, 6, 1.0));
  EXPECT_EQ(attn.params().size(), k.softmax == AttentionSoftmax::learnable ? 5u : 4u);
  check_attention_gradients(attn);
  }
}

// Multi-latent attention (src/model/mla.cpp): with and without the q latent, with and without the
// latents' norms (qk_layernorm), plain RoPE and YaRN with a concentration factor.
AttentionSpec mla_spec(std::int64_t q_lora_rank, bool norms, std::optional<YarnSpec> yarn) {
  AttentionSpec s{.hidden = 16, .heads = 4, .groups = 4, .head_dim = 7, .qk_norm = norms, .eps = 1e-6f, .rope = true,
                  .rope_base = 100, .rope_dim = 4, .yarn = yarn, .dtype = DType::F32};
  if (yarn) s.rope_concentration = 1.2;
  s.softmax_scale = 0.45f;
  s.mla = MlaSpec{.q_lora_rank = q_lora_rank, .kv_lora_rank = 6, .qk_head_dim = 3, .pe_dim = 4, .v_head_dim = 5};
  return s;
}
void randomise(SelfAttention& attn) {
  std::uint64_t seed = 60;
  for (Param* p : attn.params()) {
    const bool norm = p->master.rank() == 1;
    p->master.copy_from(randn(p->master.shape(), seed++, norm ? 0.2 : 0.3));
    if (norm)
      for (std::int64_t i = 0; i < p->master.numel(); ++i) p->master.set(i, 1 + p->master.get(i));
    p->refresh();
  }
}

TEST(Attention, MlaGradientsMatchFiniteDifferences) {
  const YarnSpec yarn{.factor = 8, .original_max_positions = 4, .beta_fast = 2, .beta_slow = 0.5};
  for (const std::int64_t q_lora_rank : {0, 5})
    for (const bool norms : {true, false})
      for (const std::optional<YarnSpec>& y : {std::optional<YarnSpec>(), std::optional<YarnSpec>(yarn)}) {
        SCOPED_TRACE(fmt::format("q_lora_rank {} norms {} yarn {}", q_lora_rank, norms, y.has_value()));
        SelfAttention attn("a", mla_spec(q_lora_rank, norms, y));
        const std::size_t norm_count = norms ? (q_lora_rank > 0 ? 2 : 1) : 0;
        EXPECT_EQ(attn.params().size(), (q_lora_rank > 0 ? 5u : 4u) + norm_count);
        randomise(attn);
        check_attention_gradients(attn);
      }
}

// MLA's forward against Megatron-Core's MLASelfAttention written out in double: the latents and
// their norms, the up projections split per head into [nope | pe] and [k_nope | v], RoPE on the
// de-interleaved pe channels (t[0::2] then t[1::2], rotated by halves) with one k_pe for every
// head, the causal softmax at the spec's scale, and linear_proj.
TEST(Attention, MlaMatchesMegatronsFormulation) {
  const std::int64_t S = 5, B = 2, T = S * B, H = 16, nh = 4, nope = 3, pe = 4, dv = 5, ql = 5, kvl = 6;
  const AttentionSpec spec = mla_spec(ql, true, std::nullopt);
  SelfAttention attn("a", spec);
  randomise(attn);
  const Tensor x = randn({T, H}, 4);
  SelfAttention::Context ctx;
  const Tensor y = attn.forward(x, S, ctx);

  const auto linear = [](const Param& w, const std::vector<double>& in) {
    const std::int64_t out_n = w.master.dim(0), in_n = w.master.dim(1);
    std::vector<double> out(static_cast<std::size_t>(out_n), 0.0);
    for (std::int64_t o = 0; o < out_n; ++o)
      for (std::int64_t i = 0; i < in_n; ++i) out[o] += w.master.get(o * in_n + i) * in[i];
    return out;
  };
  const auto rms = [&](const Param& g, std::vector<double> v) {
    double ms = 0;
    for (const double e : v) ms += e * e / static_cast<double>(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = v[i] / std::sqrt(ms + 1e-6) * g.master.get(static_cast<std::int64_t>(i));
    return v;
  };
  const auto rope = [&](const double* t, std::int64_t pos) {  // apply_rotary_pos_emb, mla_rotary_interleaved
    std::vector<double> u(static_cast<std::size_t>(pe)), out(u.size());
    for (std::int64_t i = 0; i < pe / 2; ++i) {
      u[i] = t[2 * i];
      u[pe / 2 + i] = t[2 * i + 1];
    }
    for (std::int64_t i = 0; i < pe / 2; ++i) {
      const double a = static_cast<double>(pos) * std::pow(100.0, -2.0 * static_cast<double>(i) / static_cast<double>(pe));
      out[i] = u[i] * std::cos(a) - u[pe / 2 + i] * std::sin(a);
      out[pe / 2 + i] = u[pe / 2 + i] * std::cos(a) + u[i] * std::sin(a);
    }
    return out;
  };
  // Per token: query and key per head ([nope | pe]), value per head.
  std::vector<std::vector<double>> qs(T), ks(T), vs(T);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> xt(static_cast<std::size_t>(H));
    for (std::int64_t i = 0; i < H; ++i) xt[i] = x.get(t * H + i);
    const auto q = linear(attn.linear_q_up_proj, rms(attn.q_layernorm, linear(attn.linear_q_down_proj, xt)));
    const auto down = linear(attn.linear_kv_down_proj, xt);
    const auto kv = linear(attn.linear_kv_up_proj, rms(attn.kv_layernorm, std::vector<double>(down.begin(), down.begin() + kvl)));
    const auto k_pe = rope(down.data() + kvl, t / B);
    for (std::int64_t h = 0; h < nh; ++h) {
      const auto q_pe = rope(q.data() + h * (nope + pe) + nope, t / B);
      for (std::int64_t i = 0; i < nope; ++i) qs[t].push_back(q[h * (nope + pe) + i]);
      qs[t].insert(qs[t].end(), q_pe.begin(), q_pe.end());
      for (std::int64_t i = 0; i < nope; ++i) ks[t].push_back(kv[h * (nope + dv) + i]);
      ks[t].insert(ks[t].end(), k_pe.begin(), k_pe.end());
      for (std::int64_t i = 0; i < dv; ++i) vs[t].push_back(kv[h * (nope + dv) + nope + i]);
    }
  }
  ASSERT_EQ(ks[0].size(), static_cast<std::size_t>(nh * (nope + pe)));
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t s = t / B, b = t % B;
    std::vector<double> o(static_cast<std::size_t>(nh * dv), 0.0);
    for (std::int64_t h = 0; h < nh; ++h) {
      std::vector<double> logits;
      for (std::int64_t j = 0; j <= s; ++j) {
        double l = 0;
        for (std::int64_t i = 0; i < nope + pe; ++i) l += qs[t][h * (nope + pe) + i] * ks[j * B + b][h * (nope + pe) + i];
        logits.push_back(l * *spec.softmax_scale);
      }
      const double mx = *std::max_element(logits.begin(), logits.end());
      double z = 0;
      for (const double l : logits) z += std::exp(l - mx);
      for (std::int64_t j = 0; j <= s; ++j)
        for (std::int64_t i = 0; i < dv; ++i) o[h * dv + i] += std::exp(logits[j] - mx) / z * vs[j * B + b][h * dv + i];
    }
    const auto want = linear(attn.linear_proj, o);
    for (std::int64_t i = 0; i < H; ++i) ASSERT_NEAR(y.get(t * H + i), want[i], 1e-5) << "token " << t << " channel " << i;
  }
}

// The linear layers' biases (add_bias_linear: linear_qkv's and linear_proj's; add_qkv_bias:
// linear_qkv's only) against finite differences, and zero biases change no bit.
TEST(Attention, BiasesMatchFiniteDifferences) {
  for (const bool proj : {true, false}) {
  SCOPED_TRACE(proj ? "add_bias_linear" : "add_qkv_bias");
  AttentionSpec s{.hidden = 16, .heads = 4, .groups = 2, .head_dim = 6, .qk_norm = true, .qkv_bias = true,
                  .proj_bias = proj, .eps = 1e-6f, .rope = true, .rope_base = 100, .dtype = DType::F32};
  SelfAttention attn("a", s);
  AttentionSpec plain_spec = s;
  plain_spec.qkv_bias = plain_spec.proj_bias = false;
  SelfAttention plain("a", plain_spec);
  for (SelfAttention* a : {&attn, &plain}) {
    a->linear_qkv.master.copy_from(randn(a->linear_qkv.master.shape(), 1, 0.3));
    a->linear_proj.master.copy_from(randn(a->linear_proj.master.shape(), 2, 0.3));
  }
  const std::int64_t S = 5, B = 2;
  Tensor x = randn({S * B, 16}, 4);
  const Tensor r = randn({S * B, 16}, 5);
  SelfAttention::Context c1, c2;
  EXPECT_EQ(test::dot(attn.forward(x, S, c1), r), test::dot(plain.forward(x, S, c2), r));
  ASSERT_EQ(attn.params().size(), proj ? 6u : 5u);
  attn.linear_qkv_bias.master.copy_from(randn(attn.linear_qkv_bias.master.shape(), 6, 0.5));
  if (proj) attn.linear_proj_bias.master.copy_from(randn({16}, 7, 0.5));
  for (Param* p : attn.params()) p->refresh();
  check_attention_gradients(attn);
  }
}

// Where linear_qkv's bias lands: a bias on the value channels alone shifts every token's output
// by W_proj applied to it (each softmax row sums to 1), the biases of q and k aside.
TEST(Attention, AValueBiasShiftsTheOutputByItsProjection) {
  const std::int64_t nh = 2, ng = 1, d = 4, H = 8, T = 5;
  AttentionSpec s{.hidden = H, .heads = nh, .groups = ng, .head_dim = d, .qkv_bias = true, .rope = true,
                  .rope_base = 100, .dtype = DType::F32};
  SelfAttention attn("a", s);
  attn.linear_qkv.master.copy_from(randn(attn.linear_qkv.master.shape(), 1, 0.4));
  attn.linear_proj.master.copy_from(randn(attn.linear_proj.master.shape(), 2, 0.4));
  const Tensor x = randn({T, H}, 3);
  SelfAttention::Context c0, c1;
  const Tensor y0 = attn.forward(x, T, c0);
  const Tensor bv = randn({d}, 4, 0.5);  // the one value group's channels: [q heads | k group | v group]
  for (std::int64_t j = 0; j < d; ++j) attn.linear_qkv_bias.master.set((nh + ng) * d + j, bv.get(j));
  const Tensor y1 = attn.forward(x, T, c1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < H; ++i) {
      double shift = 0;  // both heads read the one group: o gains b_v in each head's channels
      for (std::int64_t h = 0; h < nh; ++h)
        for (std::int64_t j = 0; j < d; ++j) shift += attn.linear_proj.master.get(i * nh * d + h * d + j) * bv.get(j);
      EXPECT_NEAR(y1.get(t * H + i) - y0.get(t * H + i), shift, 1e-5) << t << " " << i;
    }
}

// YaRN's frequencies and concentration factor at GPT-OSS's numbers (head 64, base 150000, factor
// 32, original context 4096, betas 32 and 1), against a float64 Python transcription of
// Megatron-Core's yarn_rotary_pos_embedding.py: the correction range is 8.0928..17.398 unrounded
// (8..18 rounded); frequencies below it are the base's, above it divided by the factor.
TEST(Rope, YarnFrequenciesAndConcentrationAsMegatron) {
  RopeSpec r{64, 150000, YarnSpec{.factor = 32, .original_max_positions = 4096, .beta_fast = 32, .beta_slow = 1,
                                  .round_to_int = false}, 1};
  const std::vector<double> f = rope_inv_freq(r);
  ASSERT_EQ(f.size(), 32u);
  for (const auto& [i, want] : std::vector<std::pair<std::size_t, double>>{{0, 1.0},
                                                                           {8, 0.050813274815461475},
                                                                           {9, 0.03170569618466377},
                                                                           {12, 0.006794959489732219},
                                                                           {17, 0.00012931870124506317},
                                                                           {18, 3.8308812373753384e-05},
                                                                           {31, 3.0235114281192144e-07}})
    EXPECT_NEAR(f[i], want, 1e-14 * want) << i;
  EXPECT_NEAR(yarn_concentration(32, std::nullopt, std::nullopt), 1.3465735902799727, 1e-15);
  r.yarn->round_to_int = true;
  EXPECT_NEAR(rope_inv_freq(r)[12], 0.007015713910504388, 1e-16);
  EXPECT_NEAR(yarn_concentration(32, 1.0, 0.5), 1.1476934674947155, 1e-15);
  EXPECT_EQ(yarn_concentration(1, std::nullopt, std::nullopt), 1.0);
  // A factor of 1 is plain RoPE, bit for bit.
  const RopeSpec plain{64, 150000, std::nullopt, 1};
  r.yarn = YarnSpec{.factor = 1};
  EXPECT_EQ(rope_inv_freq(r), rope_inv_freq(plain));
}

// The concentration factor m multiplies the rotated q and k both: the attention is the one without
// it with the logits' scale times m^2 (an m on q alone would give m).
TEST(Rope, TheConcentrationScalesQueriesAndKeysBoth) {
  const auto out = [](double m, std::optional<float> scale) {
    AttentionSpec s{.hidden = 16, .heads = 4, .groups = 2, .head_dim = 4, .rope = true, .rope_base = 100,
                    .rope_concentration = m, .dtype = DType::F32};
    s.softmax_scale = scale;
    SelfAttention attn("a", s);
    attn.linear_qkv.master.copy_from(randn(attn.linear_qkv.master.shape(), 1, 0.4));
    attn.linear_proj.master.copy_from(randn(attn.linear_proj.master.shape(), 2, 0.4));
    SelfAttention::Context c;
    return attn.forward(randn({6, 16}, 3), 6, c);
  };
  const double m = 1.3465735902799727;
  const Tensor with = out(m, std::nullopt), scaled = out(1, static_cast<float>(0.5 * m * m));  // 1/sqrt(4) = 0.5
  EXPECT_LT(test::rel_l2(with, scaled), 1e-6);
  EXPECT_GT(test::rel_l2(with, out(1, std::nullopt)), 1e-3);
  EXPECT_GT(test::rel_l2(with, out(1, static_cast<float>(0.5 * m))), 1e-3);
}

// Partial RoPE rotates the first rope_dim channels of each query and key head and passes the rest:
// with the query and key weights of the rotated channels zeroed, the attention is the one without
// RoPE, bit for bit; with every channel's weights it differs from both that and full RoPE.
TEST(Attention, PartialRopeRotatesOnlyTheFirstChannels) {
  const std::int64_t d = 8, r = 4, nh = 2, ng = 1, S = 6;
  const auto run = [&](bool rope, std::int64_t rope_dim, bool zero_rotated) {
    AttentionSpec s{.hidden = 8, .heads = nh, .groups = ng, .head_dim = d, .qk_norm = false, .rope = rope,
                    .rope_base = 100, .rope_dim = rope_dim, .dtype = DType::F32};
    SelfAttention attn("a", s);
    attn.linear_qkv.master.copy_from(randn(attn.linear_qkv.master.shape(), 1, 0.5));
    if (zero_rotated)  // rows of linear_qkv: the query heads' channels, then the key groups', then the values'
      for (std::int64_t head = 0; head < nh + ng; ++head)
        for (std::int64_t ch = 0; ch < r; ++ch)
          for (std::int64_t i = 0; i < 8; ++i) attn.linear_qkv.master.set((head * d + ch) * 8 + i, 0.f);
    attn.linear_proj.master.copy_from(randn(attn.linear_proj.master.shape(), 2, 0.5));
    for (Param* p : attn.params()) p->refresh();
    SelfAttention::Context c;
    const Tensor y = attn.forward(randn({S, 8}, 3), S, c);
    return std::vector<float>(y.data<float>(), y.data<float>() + y.numel());
  };
  EXPECT_EQ(run(true, r, true), run(false, 0, true));
  EXPECT_NE(run(true, r, false), run(false, 0, false));
  EXPECT_NE(run(true, r, false), run(true, 0, false));
  // An odd dim rotates one channel more (Megatron's ceil(dim / 2) frequencies), if the head has it.
  EXPECT_NO_THROW(SelfAttention("a", AttentionSpec{.hidden = 8, .heads = 2, .groups = 1, .head_dim = 8, .rope_dim = 7}));
  EXPECT_THROW(SelfAttention("a", AttentionSpec{.hidden = 8, .heads = 2, .groups = 1, .head_dim = 7, .rope_dim = 7}),
               std::invalid_argument);
}

// A BF16 model's attention (BF16 GEMM operands in the linears and the blocked core attention,
// FP32 softmax) against FP32 on the same weights and input, over more than one query block:
// within the relative L2 error the MoE layer's BF16 test allows.
TEST(Attention, Bf16StaysWithinTheDocumentedToleranceOfFp32) {
  const std::int64_t S = 200, B = 2, H = 64;
  const auto run = [&](DType dtype, std::vector<Tensor>* grads) {
    AttentionSpec s{.hidden = H, .heads = 4, .groups = 2, .head_dim = 16, .qk_norm = true, .eps = 1e-6f, .rope = true,
                    .rope_base = 10000, .dtype = dtype};
    SelfAttention attn("a", s);
    attn.linear_qkv.master.copy_from(randn(attn.linear_qkv.master.shape(), 1, 0.1));
    attn.linear_proj.master.copy_from(randn(attn.linear_proj.master.shape(), 2, 0.1));
    for (Param* p : attn.params()) p->refresh();
    SelfAttention::Context ctx;
    const Tensor y = attn.forward(randn({S * B, H}, 3).to(dtype), S, ctx);
    const Tensor dx = attn.backward_dgrad(ctx, randn({S * B, H}, 4).to(dtype));
    attn.backward_wgrad(ctx);
    for (Param* p : attn.params()) grads->push_back(p->grad.clone());
    return std::pair(y.to(DType::F32), dx.to(DType::F32));
  };
  std::vector<Tensor> g32, g16;
  const auto [y32, dx32] = run(DType::F32, &g32);
  const auto [y16, dx16] = run(DType::BF16, &g16);
  EXPECT_LT(test::rel_l2(y16, y32), 1e-2);
  EXPECT_LT(test::rel_l2(dx16, dx32), 1e-2);
  for (std::size_t i = 0; i < g32.size(); ++i) EXPECT_LT(test::rel_l2(g16[i], g32[i]), 2e-2) << "parameter " << i;
}

TEST(Attention, IsCausal) {
  AttentionSpec s{.hidden = 8, .heads = 2, .groups = 1, .head_dim = 4, .qk_norm = false, .rope = true, .dtype = DType::F32};
  SelfAttention attn("a", s);
  attn.linear_qkv.master.copy_from(randn(attn.linear_qkv.master.shape(), 1));
  attn.linear_proj.master.copy_from(randn(attn.linear_proj.master.shape(), 2));
  Tensor x = randn({6, 8}, 3);
  SelfAttention::Context c1, c2;
  const Tensor y1 = attn.forward(x, 6, c1);
  for (std::int64_t j = 0; j < 8; ++j) x.set(5 * 8 + j, 9.f);  // change the last token only
  const Tensor y2 = attn.forward(x, 6, c2);
  for (std::int64_t i = 0; i < 5 * 8; ++i) ASSERT_EQ(y1.get(i), y2.get(i)) << "earlier tokens saw a later one";
}

// Every expert is chosen (top-k = E), so no perturbation flips the routing and the loss is
// smooth; sparse routing's gradients are checked by the MoE layer's own tests. Then again with
// partial RoPE, the tanh GELU in the dense MLP and the experts, and zero-centred norms (Gemma's
// and Qwen3-Next's choices); GPT-OSS's attention; biases; ungated GELU MLPs (Megatron's default); and
// DeepSeek's multi-latent attention with YaRN.
TEST(GPTModel, WholeModelGradientsMatchFiniteDifferences) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{}, std::vector<std::string>{"model.rotary_percent=0.5", "model.activation_func=fast_gelu",
                                                             "model.layernorm_zero_centered_gamma=true"},
        std::vector<std::string>{"model.window_size=[3, 0]", "model.window_attn_skip_freq=2",
                                 "model.softmax_type=learnable", "model.position_embedding_type=yarn",
                                 "model.yarn_rotary_scaling_factor=8.0", "model.yarn_original_max_position_embeddings=4",
                                 "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0"},
        std::vector<std::string>{"model.add_bias_linear=true", "model.moe_shared_expert_intermediate_size=null"},
        std::vector<std::string>{"model.gated_linear_unit=false", "model.activation_func=gelu"},
        std::vector<std::string>{"model.multi_latent_attention=true", "model.q_lora_rank=8", "model.kv_lora_rank=6",
                                 "model.qk_head_dim=4", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=6",
                                 "model.rotary_scaling_factor=4.0", "model.original_max_position_embeddings=4",
                                 "model.mscale_all_dim=0.5"}}) {
  SCOPED_TRACE(extra.empty() ? "SwiGLU, full RoPE" : fmt::format("{}", fmt::join(extra, " ")));
  std::vector<std::string> overrides{"model.moe_router_topk=8"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  const ModelSpec spec = model_spec_from_config(tiny(overrides));
  GPTModel model = make_model(spec);
  // Learned sinks and biases start at 0 (TE, Megatron); their gradients are checked away from it.
  for (Param* p : model.params())
    if (p->name.ends_with("softmax_offset") || p->bias) {
      p->master.copy_from(randn(p->master.shape(), 9, 1.0));
      p->refresh();
    }
  const Batch b = batch(spec);
  model.zero_grad();
  GPTModel::Context ctx;
  model.forward(b.tokens, b.targets, ctx);
  model.backward(ctx, 1.f);
  const auto f = [&] {
    GPTModel::Context c;
    return model.forward(b.tokens, b.targets, c);
  };
  std::uint64_t seed = 100;
  for (Param* p : model.params())
    expect_directional_derivative(f, p->master, p->grad, ++seed, p->name.c_str(), 1e-3, 5e-3, 2e-4,
                                  [p] { p->refresh(); });
  }
}

// Multi-token prediction: the objective is the LM loss plus each depth's loss times
// mtp_loss_scaling_factor / mtp_num_layers, and every gradient (the embedding's through the rolled
// tokens and the MTP layers', the decoder's through the first depth's input) is its derivative:
// one and two depths, an MoE and a dense MTP layer (built as the decoder's last), tied embeddings,
// and more depths than the sequence has positions.
// The LM loss itself is the model's without MTP, bit for bit.
// The gradients `params` hold (after a backward of dloss 1) against finite differences of the
// objective: the LM loss plus each MTP depth's loss weighted mtp_loss_scale.
void expect_mtp_objective_gradients(GPTModel& model, const Batch& b, const std::vector<Param*>& params, std::uint64_t seed) {
  const auto f = [&] {
    GPTModel::Context c;
    double loss = model.forward(b.tokens, b.targets, c);
    for (double l : c.mtp_losses) loss += model.spec().mtp_loss_scale * l;
    return loss;
  };
  for (Param* p : params)
    expect_directional_derivative(f, p->master, p->grad, ++seed, p->name.c_str(), 1e-3, 5e-3, 2e-4, [p] { p->refresh(); });
}

TEST(GPTModel, MtpGradientsMatchFiniteDifferences) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"model.mtp_num_layers=1"},
        std::vector<std::string>{"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.6",
                                 "model.moe_layer_freq=[1,0]"},
        std::vector<std::string>{"model.mtp_num_layers=1", "model.share_embeddings_and_output_weights=true"},
        // Deeper than the sequence: the last depth has no target and a loss of 0 (Megatron's
        // count clamped to 1), but its layer still runs.
        std::vector<std::string>{"model.mtp_num_layers=3", "model.seq_length=2", "model.moe_router_topk=8"},
        std::vector<std::string>{"model.mtp_num_layers=1", "model.recompute_granularity=full",
                                 "model.recompute_method=uniform", "model.recompute_num_layers=1"}}) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(extra, " ")));
    std::vector<std::string> overrides{"model.moe_router_topk=8"};
    overrides.insert(overrides.end(), extra.begin(), extra.end());
    const ModelSpec spec = model_spec_from_config(tiny(overrides));
    GPTModel model = make_model(spec);
    ASSERT_EQ(model.mtp.size(), static_cast<std::size_t>(spec.mtp_layers));
    const Batch b = batch(spec);
    model.zero_grad();
    GPTModel::Context ctx;
    const double lm = model.forward(b.tokens, b.targets, ctx);
    ASSERT_EQ(ctx.mtp_losses.size(), model.mtp.size());
    model.backward(ctx, 1.f);
    {
      std::vector<std::string> plain = overrides;
      plain.erase(std::remove_if(plain.begin(), plain.end(), [](const std::string& o) { return o.starts_with("model.mtp"); }),
                  plain.end());
      GPTModel without = make_model(model_spec_from_config(tiny(plain)));
      GPTModel::Context c;
      EXPECT_EQ(without.forward(b.tokens, b.targets, c), lm);
    }
    expect_mtp_objective_gradients(model, b, model.params(), 300);
  }
}

// mtp_use_repeated_layer: one MTP layer runs at every depth. Against two separate layers holding
// the same weights, the losses are the same bits and the one layer's gradient is the two's sum
// (FP32 accumulation order); its router's aux losses count half per call (Megatron's router), so
// the MTP part of the logged aux loss is half the two layers'. Finite differences check the
// shared weights' gradients.
TEST(GPTModel, ARepeatedMtpLayerRunsAtEveryDepth) {
  // Two separate layers with the same weights, and the one layer repeated (with an aux loss
  // or without, whose gradient reaches every weight before the router).
  const auto models = [](const std::vector<std::string>& o) {
    const ModelSpec two = model_spec_from_config(tiny(o));
    ModelSpec one = two;
    one.mtp_repeated = true;
    auto pair = std::make_pair(make_model(two), make_model(one));
    const std::vector<Param*> p0 = pair.first.mtp[0]->params(), p1 = pair.first.mtp[1]->params();
    for (std::size_t i = 0; i < p0.size(); ++i) {
      p1[i]->master.copy_from(p0[i]->master);
      p1[i]->refresh();
    }
    return pair;
  };
  auto [separate, repeated] = models({"model.mtp_num_layers=2"});
  ASSERT_EQ(repeated.mtp.size(), 1u);
  EXPECT_EQ(repeated.params().size() + separate.mtp[1]->params().size(), separate.params().size());
  const Batch b = batch(separate.spec());
  GPTModel::Context cs, cr;
  separate.zero_grad(), repeated.zero_grad();
  EXPECT_EQ(separate.forward(b.tokens, b.targets, cs), repeated.forward(b.tokens, b.targets, cr));
  EXPECT_EQ(cs.mtp_losses, cr.mtp_losses);
  separate.backward(cs, 1.f), repeated.backward(cr, 1.f);
  const std::vector<Param*> p0 = separate.mtp[0]->params(), p1 = separate.mtp[1]->params(), pr = repeated.mtp[0]->params();
  for (std::size_t i = 0; i < p0.size(); ++i) {
    Tensor sum = p0[i]->grad.clone();
    add(sum, p1[i]->grad, sum);
    EXPECT_LT(test::rel_l2(pr[i]->grad, sum), 1e-5) << pr[i]->name;
  }
  // With an aux loss, the MTP layer's part of the logged aux loss (against the model without
  // MTP) is half the two layers'.
  auto [separate_aux, repeated_aux] = models({"model.mtp_num_layers=2", "model.moe_aux_loss_coeff=0.1"});
  GPTModel no_mtp = make_model(model_spec_from_config(tiny({"model.moe_aux_loss_coeff=0.1"})));
  GPTModel::Context ca, cb, cn;
  separate_aux.forward(b.tokens, b.targets, ca);
  repeated_aux.forward(b.tokens, b.targets, cb);
  no_mtp.forward(b.tokens, b.targets, cn);
  const double decoder = at(cn.aux_losses, AuxLoss::aux_loss), mtp_part = at(ca.aux_losses, AuxLoss::aux_loss) - decoder;
  EXPECT_GT(mtp_part, 0);
  EXPECT_NEAR(at(cb.aux_losses, AuxLoss::aux_loss), decoder + mtp_part / 2, 1e-12);
  // The shared weights' gradients, where the aux losses have none (every expert routed).
  ModelSpec all = model_spec_from_config(tiny({"model.mtp_num_layers=2", "model.moe_router_topk=8"}));
  all.mtp_repeated = true;
  GPTModel model = make_model(all);
  model.zero_grad();
  GPTModel::Context ctx;
  model.forward(b.tokens, b.targets, ctx);
  model.backward(ctx, 1.f);
  expect_mtp_objective_gradients(model, b, model.mtp[0]->params(), 700);
}

// mtp_detach_heads: the MTP takes the decoder's hidden states, the embedding's rows and the output
// weight as constants. Its layers' gradients are the attached model's, bit for bit; every other
// weight's are those of the model whose MTP losses weigh 0 (which add exact zeros), tied or not.
TEST(GPTModel, DetachedMtpHeadsTrainTheMtpLayersAlone) {
  for (const char* tied : {"false", "true"}) {
    const ModelSpec attached = model_spec_from_config(
        tiny({"model.mtp_num_layers=2", fmt::format("model.share_embeddings_and_output_weights={}", tied)}));
    ModelSpec detached = attached, weightless = attached;
    detached.mtp_detached = true;
    weightless.mtp_loss_scale = 0;
    GPTModel a = make_model(attached), d = make_model(detached), w = make_model(weightless);
    const Batch b = batch(attached);
    GPTModel::Context ca, cd, cw;
    for (GPTModel* m : {&a, &d, &w}) m->zero_grad();
    EXPECT_EQ(a.forward(b.tokens, b.targets, ca), d.forward(b.tokens, b.targets, cd));
    EXPECT_EQ(ca.mtp_losses, cd.mtp_losses);
    w.forward(b.tokens, b.targets, cw);
    a.backward(ca, 1.f), d.backward(cd, 1.f), w.backward(cw, 1.f);
    const std::vector<Param*> pa = a.params(), pd = d.params(), pw = w.params(), mtp = d.mtp_params();
    ASSERT_EQ(pa.size(), pd.size());
    ASSERT_FALSE(mtp.empty());
    for (std::size_t i = 0; i < pd.size(); ++i) {
      const bool in_mtp = std::find(mtp.begin(), mtp.end(), pd[i]) != mtp.end();
      const Param& ref = in_mtp ? *pa[i] : *pw[i];
      EXPECT_EQ(std::memcmp(pd[i]->grad.raw(), ref.grad.raw(), ref.grad.nbytes()), 0) << tied << " " << pd[i]->name;
      // ... and differ from the attached model's outside the MTP layers, where its losses reach.
      if (!in_mtp && (pd[i] == &d.embedding || pd[i] == &d.output_layer || pd[i] == &d.final_layernorm)) {
        EXPECT_GT(test::rel_l2(pa[i]->grad, pd[i]->grad), 1e-6) << tied << " " << pd[i]->name;
      }
    }
  }
}

// Over two pipeline stages, tied embeddings and MTP keep a copy of the embedding in the last
// stage's chunk, drawn as the first stage's: the two chunks' losses are the whole model's, and
// the first stage's embedding gradient plus the copy's is the whole model's (which adds the two
// parts into one gradient in another order: within FP32 rounding).
TEST(GPTModel, TheLastStagesEmbeddingCopyCarriesTheHeadsPartOfTheGradient) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"model.share_embeddings_and_output_weights=true"},
        std::vector<std::string>{"model.mtp_num_layers=1"},
        std::vector<std::string>{"model.mtp_num_layers=2", "model.share_embeddings_and_output_weights=true"}}) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(extra, " ")));
    const ModelSpec spec = model_spec_from_config(tiny(extra));
    GPTModel whole = make_model(spec);
    const auto chunk = [&](ModelChunk c) {
      auto m = std::make_unique<GPTModel>(spec, [&] { return make_local_dispatcher(spec.moe->num_experts); },
                                          MoELayerOptions{}, c);
      m->init_weights(7);
      return m;
    };
    const auto first = chunk({{0, 1}, true, false}), last = chunk({{1, 2}, false, true});
    ASSERT_NE(first->shared_embedding(), nullptr);
    ASSERT_EQ(last->shared_embedding(), &last->embedding);
    EXPECT_EQ(std::memcmp(last->embedding.master.raw(), first->embedding.master.raw(), first->embedding.master.nbytes()), 0);
    const Batch b = batch(spec);
    whole.zero_grad(), first->zero_grad(), last->zero_grad();
    GPTModel::Context cw, c1, c2;
    const double loss = whole.forward(b.tokens, b.targets, cw);
    whole.backward(cw, 1.f);
    const Tensor x = first->forward_layers(first->embed(b.tokens, b.targets, c1), c1);
    last->begin(b.tokens, b.targets, c2);
    EXPECT_EQ(last->head_forward(last->forward_layers(x, c2), c2), loss);
    EXPECT_EQ(c2.mtp_losses, cw.mtp_losses);
    first->embed_backward(c1, first->backward_layers(c1, last->backward_layers(c2, last->head_backward(c2, 1.f))));
    Tensor sum = first->embedding.grad.clone();
    add(sum, last->embedding.grad, sum);
    EXPECT_GT(test::rel_l2(last->embedding.grad, first->embedding.grad), 0.1);  // a part of its own
    EXPECT_LT(test::rel_l2(sum, whole.embedding.grad), 1e-6);
  }
}

// Megatron's standalone MTP stage: a chunk before the loss's runs the final norm and the MTP
// layers and hands on [decoder's hidden states; each depth's]; the loss's chunk takes the losses of
// those rows. The losses are the whole model's bit for bit, the MTP layers' gradients too, and the
// embedding's three parts (first stage, MTP stage's copy, tied head's copy) add up to the whole's.
TEST(GPTModel, AStandaloneMtpStageHandsTheLossItsDepthsHiddenStates) {
  const ModelSpec spec = model_spec_from_config(tiny({"model.mtp_num_layers=2", "model.share_embeddings_and_output_weights=true"}));
  GPTModel whole = make_model(spec);
  const auto chunk = [&](ModelChunk c) {
    auto m = std::make_unique<GPTModel>(spec, [&] { return make_local_dispatcher(spec.moe->num_experts); }, MoELayerOptions{}, c);
    m->init_weights(7);
    m->zero_grad();
    return m;
  };
  const auto first = chunk({{0, 1}, true, false}), mtp = chunk({{1, 2}, false, false, true}),
             loss = chunk({{2, 2}, false, true, false, true});
  ASSERT_EQ(mtp->mtp.size(), 2u);
  ASSERT_TRUE(loss->mtp.empty());
  for (GPTModel* c : {first.get(), mtp.get(), loss.get()}) ASSERT_EQ(c->shared_embedding(), &c->embedding);
  const Batch b = batch(spec);
  whole.zero_grad();
  GPTModel::Context cw, c1, c2, c3;
  const double want = whole.forward(b.tokens, b.targets, cw);
  whole.backward(cw, 1.f);
  const Tensor x = first->forward_layers(first->embed(b.tokens, b.targets, c1), c1);
  mtp->begin(b.tokens, b.targets, c2);
  const Tensor y = mtp->mtp_stage_forward(mtp->forward_layers(x, c2), c2);
  ASSERT_EQ(y.dim(0), 3 * x.dim(0));
  loss->begin(b.tokens, b.targets, c3);
  EXPECT_EQ(loss->head_forward(y, c3), want);
  EXPECT_EQ(c3.mtp_losses, cw.mtp_losses);
  const Tensor dy = loss->head_backward(c3, 1.f);
  first->embed_backward(c1, first->backward_layers(c1, mtp->backward_layers(c2, mtp->mtp_stage_backward(c2, dy, false))));
  for (std::size_t k = 0; k < 2; ++k) {
    const std::vector<Param*> got = mtp->mtp[k]->params(), ref = whole.mtp[k]->params();
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_EQ(std::memcmp(got[i]->grad.raw(), ref[i]->grad.raw(), ref[i]->grad.nbytes()), 0) << got[i]->name;
  }
  Tensor sum = first->embedding.grad.clone();
  add(sum, mtp->embedding.grad, sum);
  add(sum, loss->embedding.grad, sum);
  EXPECT_LT(test::rel_l2(sum, whole.embedding.grad), 1e-6);
  EXPECT_LT(test::rel_l2(mtp->final_layernorm.grad, whole.final_layernorm.grad), 1e-6);
}

// A sliding window as long as the sequence is no window, and the off-by-one sink is the learned
// one at 0, bit for bit (loss and every shared gradient); a short window, the sinks and their
// layer pattern each change the model. GPT-OSS's pattern: window_attn_skip_freq 2 puts the window
// on the odd layer numbers (the first of the tiny model's two).
TEST(GPTModel, SlidingWindowAndSinksFromTheConfig) {
  struct Run {
    double loss;
    std::vector<Tensor> grads;
  };
  const auto run = [](const std::vector<std::string>& extra) {
    std::vector<std::string> o{"model.moe_router_topk=8"};
    o.insert(o.end(), extra.begin(), extra.end());
    const ModelSpec spec = model_spec_from_config(tiny(o));
    GPTModel model = make_model(spec);
    const Batch b = batch(spec);
    model.zero_grad();
    GPTModel::Context c;
    Run r{model.forward(b.tokens, b.targets, c), {}};
    model.backward(c, 1.f);
    for (Param* p : model.params())
      if (!p->name.ends_with("softmax_offset")) r.grads.push_back(p->grad.clone());
    return r;
  };
  const auto same = [](const Run& a, const Run& b) {
    if (a.loss != b.loss || a.grads.size() != b.grads.size()) return false;
    for (std::size_t i = 0; i < a.grads.size(); ++i)
      if (std::memcmp(a.grads[i].raw(), b.grads[i].raw(), a.grads[i].nbytes()) != 0) return false;
    return true;
  };
  const Run plain = run({});
  EXPECT_TRUE(same(run({"model.window_size=[11, 0]"}), plain));  // seq_length 12
  EXPECT_TRUE(same(run({"model.window_size=[-1, 0]"}), plain));
  EXPECT_TRUE(same(run({"model.softmax_type=off-by-one"}), run({"model.softmax_type=learnable"})));
  EXPECT_FALSE(same(run({"model.softmax_type=off-by-one"}), plain));
  const Run every = run({"model.window_size=[2, 0]"});
  EXPECT_FALSE(same(every, plain));
  EXPECT_FALSE(same(run({"model.window_size=[2, 0]", "model.window_attn_skip_freq=2"}), every));
  EXPECT_TRUE(same(run({"model.window_size=[2, 0]", "model.window_attn_skip_freq=[1, 1]"}), every));
  EXPECT_TRUE(same(run({"model.window_size=[2, 0]", "model.window_attn_skip_freq=1"}), plain));  // every layer full
  EXPECT_TRUE(same(run({"model.window_size=[2, 0]", "model.window_attn_skip_freq=[0, 0, 1]"}), plain));  // Megatron reads 2

  const std::vector<std::string> yarn{"model.position_embedding_type=yarn", "model.yarn_original_max_position_embeddings=4",
                                      "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0"};
  std::vector<std::string> yarn1 = yarn, yarn8 = yarn;
  yarn1.push_back("model.yarn_rotary_scaling_factor=1.0");
  yarn8.push_back("model.yarn_rotary_scaling_factor=8.0");
  EXPECT_TRUE(same(run(yarn1), plain));  // the tiny model's position_embedding_type is rope
  EXPECT_FALSE(same(run(yarn8), plain));

  const ModelSpec gpt_oss = model_spec_from_config(
      tiny({"model.window_size=[5, 0]", "model.window_attn_skip_freq=2", "model.softmax_type=learnable"}));
  EXPECT_EQ(gpt_oss.attention.window, 5);
  EXPECT_EQ(gpt_oss.is_window, (std::vector<bool>{true, false}));
  EXPECT_EQ(gpt_oss.attention_of(0).window, 5);
  // GPT-OSS's 127 keys over this 12-token sequence, or a window past int64's range, is no window.
  for (const char* w : {"model.window_size=[127, 0]", "model.window_size=[9223372036854775807, 0]"})
    EXPECT_TRUE(model_spec_from_config(tiny({w})).is_window.empty()) << w;
  EXPECT_EQ(gpt_oss.attention_of(1).window, -1);
  EXPECT_EQ(gpt_oss.attention.softmax, AttentionSoftmax::learnable);
  GPTModel model = make_model(gpt_oss);
  int sinks = 0;
  for (Param* p : model.params())
    if (p->name.ends_with("core_attention.softmax_offset")) {
      ++sinks;
      EXPECT_EQ(p->master.shape(), (Shape{gpt_oss.attention.heads}));
      EXPECT_EQ(p->master.get(0), 0.f);
    }
  EXPECT_EQ(sinks, 2);
}

// softmax_scale replaces 1 / sqrt(kv_channels): given as that value, nothing changes; another
// scale changes the model.
TEST(Attention, SoftmaxScaleFromTheConfig) {
  const auto loss = [](const std::vector<std::string>& o) {
    const ModelSpec spec = model_spec_from_config(tiny(o));
    GPTModel model = make_model(spec);
    const Batch b = batch(spec);
    GPTModel::Context c;
    return model.forward(b.tokens, b.targets, c);
  };
  const double plain = loss({});
  EXPECT_EQ(model_spec_from_config(tiny({"model.softmax_scale=0.25"})).attention.softmax_scale, 0.25f);
  EXPECT_EQ(loss({fmt::format("model.softmax_scale={}", 1.f / std::sqrt(8.f))}), plain);  // kv_channels 8
  EXPECT_NE(loss({"model.softmax_scale=1.0"}), plain);
}

// Zero-centred norms (layernorm_zero_centered_gamma) multiply by 1 + their weight, which starts at
// 0: at initialisation the model is the plain one, and with every norm weight w of the plain model
// stored as w - 1 (exact for w in [0.5, 2]) the loss and every other gradient are the same, bit for bit.
TEST(GPTModel, ZeroCentredNormsAreThePlainOnesShiftedByOne) {
  const std::vector<std::string> o{"model.moe_router_topk=8"};
  std::vector<std::string> zo = o;
  zo.push_back("model.layernorm_zero_centered_gamma=true");
  const ModelSpec plain_spec = model_spec_from_config(tiny(o)), zero_spec = model_spec_from_config(tiny(zo));
  ASSERT_TRUE(zero_spec.zero_centered_gamma && zero_spec.attention.zero_centered_gamma);
  GPTModel plain = make_model(plain_spec), zero = make_model(zero_spec);
  const Batch b = batch(plain_spec);
  const auto loss = [&](GPTModel& m) {
    m.zero_grad();
    GPTModel::Context c;
    const double l = m.forward(b.tokens, b.targets, c);
    m.backward(c, 1.f);
    return l;
  };
  const std::vector<Param*> pp = plain.params(), zp = zero.params();
  ASSERT_EQ(pp.size(), zp.size());
  int norms = 0;
  for (std::size_t i = 0; i < zp.size(); ++i)
    if (zp[i]->name.find("layernorm") != std::string::npos) {
      ++norms;
      EXPECT_EQ(zp[i]->master.get(0), 0.f) << zp[i]->name;
    }
  EXPECT_EQ(norms, 2 * 2 + 2 * 2 + 1);  // per layer: input, pre-MLP, q and k; the final norm
  EXPECT_EQ(loss(plain), loss(zero));
  for (std::size_t i = 0; i < pp.size(); ++i) {
    const bool norm = pp[i]->name.find("layernorm") != std::string::npos;
    const Tensor shift = randn(pp[i]->master.shape(), 40 + i, 0.2);
    for (std::int64_t j = 0; j < pp[i]->master.numel(); ++j) {
      if (norm) pp[i]->master.set(j, 1.f + shift.get(j));
      zp[i]->master.set(j, norm ? pp[i]->master.get(j) - 1.f : pp[i]->master.get(j));
    }
    pp[i]->refresh();
    zp[i]->refresh();
  }
  EXPECT_EQ(loss(plain), loss(zero));
  for (std::size_t i = 0; i < pp.size(); ++i)
    for (std::int64_t j = 0; j < pp[i]->grad.numel(); ++j)
      ASSERT_EQ(pp[i]->grad.get(j), zp[i]->grad.get(j)) << pp[i]->name << " " << j;
}

// One step's loss, gradients and peak memory over its start on a 4-layer tiny model.
std::pair<double, std::vector<Tensor>> recompute_run(std::vector<std::string> overrides, std::int64_t* peak) {
  overrides.insert(overrides.end(), {"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]", "model.seq_length=32"});
  const ModelSpec spec = model_spec_from_config(tiny(overrides));
  GPTModel model = make_model(spec);
  const Batch b = batch(spec);
  model.zero_grad();
  reset_peak_memory();
  const std::int64_t before = memory_stats().allocated_bytes;
  GPTModel::Context ctx;
  const double loss = model.forward(b.tokens, b.targets, ctx);
  model.backward(ctx, 1.f);
  *peak = memory_stats().max_allocated_bytes - before;
  std::vector<Tensor> grads;
  for (Param* p : model.params()) grads.push_back(p->grad.clone());
  return std::pair(loss, grads);
}

// Every recompute mode gives the same loss and gradients as none, bit for bit, and holds less
// memory at the peak; but core_attn, which has nothing to drop from the blocked attention.
TEST(GPTModel, RecomputeChangesNothingButMemory) {
  const auto run = recompute_run;
  std::int64_t base_peak = 0;
  const auto [loss, grads] = run({}, &base_peak);
  const std::vector<std::vector<std::string>> modes = {
      {"model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"},
      {"model.recompute_granularity=selective", "model.recompute_modules=[layernorm,moe_act,mlp,shared_experts]"},
      {"model.recompute_granularity=selective", "model.recompute_modules=[moe]"},
      {"model.recompute_granularity=selective", "model.recompute_modules=[moe,layernorm,mlp]"},
      {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"},
      {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=2"},
      {"model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=1"}};
  for (const auto& mode : modes) {
    std::int64_t peak = 0;
    const auto [l, g] = run(mode, &peak);
    EXPECT_EQ(l, loss) << mode[1];
    for (std::size_t i = 0; i < g.size(); ++i)
      ASSERT_EQ(0, std::memcmp(g[i].raw(), grads[i].raw(), g[i].nbytes())) << mode[1] << " gradient " << i;
    if (mode[1] == "model.recompute_modules=[core_attn]") EXPECT_EQ(peak, base_peak);
    else EXPECT_LT(peak, base_peak) << mode[1] << " should lower the peak";
  }
}

// MTP under full recompute: uniform reruns each MTP layer's forward before its backward (as
// Megatron's MTP checkpoint), block leaves it; either gives the same bits as none, with a lower peak.
TEST(GPTModel, MtpUnderFullRecomputeChangesNothingButMemory) {
  const std::vector<std::string> mtp{"model.mtp_num_layers=2"};
  std::int64_t base_peak = 0;
  const auto [loss, grads] = recompute_run(mtp, &base_peak);
  for (const char* method : {"uniform", "block"}) {
    std::vector<std::string> o = mtp;
    o.insert(o.end(), {"model.recompute_granularity=full", fmt::format("model.recompute_method={}", method),
                       "model.recompute_num_layers=1"});
    std::int64_t peak = 0;
    const auto [l, g] = recompute_run(o, &peak);
    EXPECT_EQ(l, loss) << method;
    for (std::size_t i = 0; i < g.size(); ++i)
      ASSERT_EQ(0, std::memcmp(g[i].raw(), grads[i].raw(), g[i].nbytes())) << method << " gradient " << i;
    EXPECT_LT(peak, base_peak) << method;
    // What an MTP layer holds between its forward and backward: only its inputs under uniform.
    const ModelSpec spec = model_spec_from_config(tiny(o));
    GPTModel model = make_model(spec);
    const Batch b = batch(spec);
    GPTModel::Context ctx;
    model.forward(b.tokens, b.targets, ctx);
    EXPECT_EQ(ctx.mtp[0].cat.defined(), method == std::string("block")) << method;
    EXPECT_TRUE(ctx.mtp[0].h.defined() && ctx.mtp[0].emb.defined()) << method;
  }
}

// MLA's mla_up_proj (alone, with the layernorm recompute that drops the q projection's input x,
// and under full recompute) gives the same bits as none, with and without the q latent and the
// latents' norms (not the second without the first, which epx refuses), in FP32 and BF16, and
// lowers the peak: q, k and v wait for the backward.
TEST(GPTModel, MlaUpProjRecomputeChangesNothingButMemory) {
  for (const char* q_lora_rank : {"8", "null"})
    for (const char* norms : {"true", "false"})
      for (const char* bf16 : {"false", "true"}) {
        if (q_lora_rank == std::string("null") && norms == std::string("true")) continue;  // refused (job_spec)
        SCOPED_TRACE(fmt::format("q_lora_rank {} qk_layernorm {} bf16 {}", q_lora_rank, norms, bf16));
        const std::vector<std::string> mla{"model.multi_latent_attention=true", fmt::format("model.q_lora_rank={}", q_lora_rank),
                                           "model.kv_lora_rank=8", "model.qk_head_dim=4", "model.qk_pos_emb_head_dim=4",
                                           "model.v_head_dim=6", fmt::format("model.qk_layernorm={}", norms),
                                           fmt::format("model.bf16={}", bf16)};
        const auto with = [&](std::vector<std::string> extra) {
          extra.insert(extra.begin(), mla.begin(), mla.end());
          return extra;
        };
        std::int64_t base_peak = 0;
        const auto [loss, grads] = recompute_run(mla, &base_peak);
        for (const auto& mode : {std::vector<std::string>{"model.recompute_modules=[mla_up_proj]"},
                                 std::vector<std::string>{"model.recompute_modules=[layernorm,mla_up_proj]"}}) {
          std::int64_t peak = 0;
          auto o = with(mode);
          o.push_back("model.recompute_granularity=selective");
          const auto [l, g] = recompute_run(o, &peak);
          EXPECT_EQ(l, loss) << mode[0];
          for (std::size_t i = 0; i < g.size(); ++i)
            ASSERT_EQ(0, std::memcmp(g[i].raw(), grads[i].raw(), g[i].nbytes())) << mode[0] << " gradient " << i;
          EXPECT_LT(peak, base_peak) << mode[0] << " should lower the peak";
        }
      }
  EXPECT_THROW(model_spec_from_config(tiny({"model.recompute_granularity=selective", "model.recompute_modules=[mla_up_proj]"})),
               ConfigError);
}

// Megatron decays neither 1-D weights nor `*.bias`: the experts' stacked [G, N] biases (TE's
// per-expert bias<g>) keep their value under weight decay with a zero gradient; a matrix shrinks.
TEST(Adam, BiasesAndOneDimensionalWeightsAreNotDecayed) {
  Param w("w", {2, 3}, DType::F32), b("b", {2, 3}, DType::F32), g("g", {3}, DType::F32);
  b.bias = true;
  for (Param* p : {&w, &b, &g}) {
    p->master.fill(1.f);
    p->grad.zero();
  }
  OptimizerConfig oc;
  oc.weight_decay = 0.1;
  Adam adam(std::vector<Param*>{&w, &b, &g}, oc);
  adam.step(0.5);
  EXPECT_LT(w.master.get(0), 1.f);
  EXPECT_EQ(b.master.get(0), 1.f);
  EXPECT_EQ(g.master.get(0), 1.f);
}

TEST(LrSchedule, WarmupThenCosineAsMegatron) {
  const Config c = load_config_text(R"(
optimizer: {lr: 1.0e-3, min_lr: 1.0e-4}
scheduler: {lr_decay_style: cosine, lr_warmup_iters: 2}
train: {train_iters: 10, global_batch_size: 1}
)", "s");
  const LrSchedule s = lr_schedule_from_config(c);
  EXPECT_DOUBLE_EQ(s.at(0), 0.0);
  EXPECT_DOUBLE_EQ(s.at(1), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(2), 1e-3);
  EXPECT_NEAR(s.at(6), 1e-4 + 0.5 * (std::cos(M_PI * 0.5) + 1) * 9e-4, 1e-15);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(11), 1e-4);
}

TEST(LrSchedule, AWarmupAsLongAsTheDecayIsCappedAsBridge) {
  // Counted in samples (global batch 4): a warmup of 2 iterations against a decay of 2 is capped
  // at 2 x 4 - 1 = 7 samples; Megatron counts the same way, so the shape stays.
  const Config c = load_config_text(R"(
optimizer: {lr: 1.0e-3, min_lr: 0.0}
scheduler: {lr_decay_style: linear, lr_warmup_iters: 2}
train: {global_batch_size: 4, train_iters: 2}
)", "s");
  const LrSchedule s = lr_schedule_from_config(c);
  EXPECT_EQ(s.warmup_samples, 7);
  EXPECT_DOUBLE_EQ(s.at(1), 1e-3 * 4 / 7);
  EXPECT_DOUBLE_EQ(s.at(2), 0.0);  // past the warmup: the end of the decay
}

TEST(LrSchedule, MaxStepsAndSampleBasedTrainingAsBridge) {
  // scheduler.max_steps: a 2-iteration run on the schedule of the full 10.
  Config c = load_config_text(R"(
optimizer: {lr: 1.0e-3, min_lr: 1.0e-4}
scheduler: {lr_decay_style: cosine, lr_warmup_iters: 2, max_steps: 10}
train: {train_iters: 2, global_batch_size: 1}
)", "s");
  EXPECT_EQ(lr_schedule_from_config(c).decay_samples, 10);
  EXPECT_DOUBLE_EQ(lr_schedule_from_config(c).at(2), 1e-3);
  // Sample-based: 40 samples in global batches of 4 are 10 iterations; a warmup of a quarter of
  // the decay is 10 samples, reached between the second and third iteration.
  c = load_config_text(R"(
optimizer: {lr: 1.0e-3, min_lr: 0.0}
scheduler: {lr_decay_style: linear, lr_warmup_fraction: 0.25}
train: {train_samples: 40, global_batch_size: 4}
)", "s");
  EXPECT_EQ(train_iterations(c), 10);
  const LrSchedule s = lr_schedule_from_config(c);
  EXPECT_DOUBLE_EQ(s.warmup_samples, 10.0);
  EXPECT_EQ(s.decay_samples, 40);
  EXPECT_DOUBLE_EQ(s.at(1), 1e-3 * 4 / 10);
  EXPECT_DOUBLE_EQ(s.at(10), 0.0);
}

TEST(MockData, PatternIsLearnableAndRandomIsInRange) {
  const MockData pattern(MockData::Mode::pattern, 100, 20, 5, 8), random(MockData::Mode::random, 100, 20, 5);
  std::map<std::int64_t, std::int64_t> next;
  for (std::int64_t i = 0; i < 10; ++i) {
    const auto s = pattern.sample(i);
    for (std::size_t j = 0; j + 1 < s.size(); ++j) {
      const auto [it, fresh] = next.emplace(s[j], s[j + 1]);
      EXPECT_EQ(it->second, s[j + 1]) << "the next token follows from the current one";
    }
  }
  EXPECT_EQ(next.size(), 8u);
  for (auto t : random.sample(3)) EXPECT_TRUE(t >= 0 && t < 100);
  EXPECT_EQ(random.sample(3), random.sample(3));
  EXPECT_NE(random.sample(3), random.sample(4));
}

TEST(ModelSpec, RefusesWhatItCannotBuild) {
  const auto message = [](const std::vector<std::string>& o) {
    try {
      model_spec_from_config(tiny(o));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({"model.normalization=LayerNorm"}).find("set model.normalization=RMSNorm"), std::string::npos);
  EXPECT_NE(message({"model.moe_layer_freq=[1,1,1]"}).find("3 entries for 2 layers"), std::string::npos);
  EXPECT_NE(message({"model.recompute_granularity=full"}).find("model.recompute_method"), std::string::npos);
  EXPECT_NE(message({"model.recompute_granularity=selective", "model.recompute_modules=[mhc]"})
                .find("model.recompute_modules=mhc: epx recomputes layernorm"),
            std::string::npos);
  EXPECT_EQ(message({"model.recompute_granularity=selective", "model.recompute_modules=[moe]"}), "no error");
  EXPECT_NE(message({"model.vocab_size=null"}).find("model.vocab_size"), std::string::npos);
}

}  // namespace
}  // namespace epx
