// The MoE layer on one rank: finite-difference gradients of the whole layer for each routing
// mode, capacity and permutation invariants, determinism, and BF16 against FP32.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <cstring>
#include <numeric>
#include <set>

#include "epx/base/error.hpp"
#include "epx/moe/moe_layer.hpp"
#include "gradcheck.hpp"
#include "tensor_compare.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

using test::dot;
using test::expect_directional_derivative;
using test::randn;

MoESpec small_spec() {
  MoESpec s;
  s.hidden = 16;
  s.num_experts = 6;
  s.topk = 2;
  s.ffn = 12;
  s.shared_ffn = 8;
  s.seq_length = 8;
  s.micro_batch = 2;
  at(s.aux_loss_coeff, AuxLoss::aux_loss) = 0.1;  // large, so the injected gradients are visible in the check
  s.z_loss_coeff = 0.01;
  s.init_std = 0.3;
  return s;
}

struct Case {
  std::string name;
  std::function<void(MoESpec&)> edit;
  std::function<void(MoELayer&)> prepare = [](MoELayer&) {};
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// A Case's `prepare` that draws the layer's biases away from Megatron's zeros, so that they matter.
std::function<void(MoELayer&)> draw_biases(std::uint64_t first_seed) {
  return [first_seed](MoELayer& l) {
    std::uint64_t seed = first_seed;
    for (Param* p : l.params())
      if (p->bias) {
        p->master.copy_from(randn(p->master.shape(), seed++, 0.5));
        p->refresh();
      }
  };
}

class LayerGradient : public ::testing::TestWithParam<Case> {};

// With `losses_only`, the output gradient is zero, so the check sees the aux and z losses alone
// (their gradients are small next to the output's and would hide inside its tolerance).
void check_layer_gradients(const Case& c, bool losses_only) {
  MoESpec spec = small_spec();
  c.edit(spec);
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.init_weights(42);
  if (spec.expert_bias)
    for (std::int64_t j = 0; j < spec.num_experts; ++j) layer.router.expert_bias.set(j, 0.05f * static_cast<float>(j % 3));
  c.prepare(layer);
  Tensor x = randn({spec.seq_length, spec.micro_batch, spec.hidden}, 1);
  Tensor g = randn(x.shape(), 2);
  if (losses_only) g.zero();
  const double atol = losses_only ? 2e-5 : 1e-3;

  MoELayer::Context ctx;
  layer.router.reset_global_aux_loss();  // each forward is a global batch of one micro-batch
  layer.forward(x, ctx);
  const auto base_map = ctx.routing.routing_map;
  const bool expert0_idle = ctx.routing.tokens_per_expert[0] == 0;
  layer.zero_grad();
  const Tensor dx = layer.backward(ctx, g);
  if (expert0_idle) {  // an expert without tokens: a zero-row group, zero gradients
    const TensorMap grads = layer.grad_tensors();
    for (const char* n : {"grad.mlp.experts.linear_fc1.weight0", "grad.mlp.experts.linear_fc2.weight0"})
      EXPECT_EQ(dot(grads.at(n), grads.at(n)), 0.0) << n;
  }
  if (c.name == "expert_with_zero_tokens") {
    EXPECT_TRUE(expert0_idle);
  }

  bool routing_changed = false;
  auto loss = [&] {
    MoELayer::Context c;
    layer.router.reset_global_aux_loss();
    const Tensor y = layer.forward(x, c);
    routing_changed |= c.routing.routing_map != base_map;
    double aux = 0;
    for (double v : c.routing.aux_losses) aux += v;
    return dot(y, g) + aux + c.routing.z_loss;
  };
  // Finite differences are only meaningful where the discrete routing does not change: if a
  // step flips a near-tied top-k choice, retry with a smaller one.
  auto check = [&](Tensor& p, const Tensor& grad, std::uint64_t seed, const std::string& what,
                   const std::function<void()>& changed) {
    double eps = 1e-3;
    for (int attempt = 0; attempt < 4; ++attempt, eps /= 4) {
      routing_changed = false;
      const Tensor saved = p.clone();
      const Tensor dir = randn(p.shape(), seed);
      for (double e : {eps, -eps}) {
        for (std::int64_t i = 0; i < p.numel(); ++i) p.set(i, saved.get(i) + static_cast<float>(e * dir.get(i)));
        changed();
        loss();
      }
      p.copy_from(saved);
      changed();
      if (!routing_changed) break;
    }
    ASSERT_FALSE(routing_changed) << what << ": routing flips even at step " << eps;
    expect_directional_derivative(loss, p, grad, seed, what.c_str(), eps, 5e-3, atol, changed);
  };
  check(x, dx, 3, "input", [] {});
  // Every weight of the layer's file is a parameter (trained, reduced over DP and checked here);
  // the experts' files number each expert's tensor, the buffers are not trained.
  std::set<std::string> weights, params;
  for (const auto& [name, t] : layer.weight_tensors())
    if (name != "mlp.router.expert_bias" && name != "mlp.router.qb_beta") weights.insert(name.substr(0, name.find_last_not_of("0123456789") + 1));
  for (Param* p : layer.params()) params.insert(p->name);
  EXPECT_EQ(weights, params);
  std::uint64_t seed = 10;
  for (Param* p : layer.params()) check(p->master, p->grad, seed++, p->name, [p] { p->refresh(); });
}

TEST_P(LayerGradient, MatchesFiniteDifferencesForInputAndEveryWeight) { check_layer_gradients(GetParam(), false); }
TEST_P(LayerGradient, AuxAndZLossGradientsMatchFiniteDifferences) { check_layer_gradients(GetParam(), true); }

INSTANTIATE_TEST_SUITE_P(
    Routing, LayerGradient,
    ::testing::Values(
        Case{"softmax_topk", [](MoESpec&) {}},
        Case{"pre_softmax", [](MoESpec& s) { s.pre_softmax = true; }},
        Case{"sigmoid_bias_scaled_grouped",
             [](MoESpec& s) {
               s.score_function = "sigmoid";
               s.expert_bias = true;
               s.topk_scaling_factor = 2.5;
               s.num_groups = 3;
               s.group_topk = 2;
             }},
        Case{"seq_aux_loss", [](MoESpec& s) { s.aux_loss_coeff = {0, 0.1, 0}; }},
        Case{"aux_and_seq_aux_loss", [](MoESpec& s) { s.aux_loss_coeff = {0.05, 0.1, 0}; }},
        Case{"global_aux_loss_sigmoid",
             [](MoESpec& s) {
               s.aux_loss_coeff = {0, 0, 0.1};
               s.score_function = "sigmoid";
             }},
        // Selection by the logits minus a bias; the probabilities and their gradient as top-k's.
        Case{"quantile_balancing",
             [](MoESpec& s) {
               s.quantile_balancing = true;
               s.aux_loss_coeff = {};
               s.topk = 3;  // 16 tokens x top-3 split evenly over 6 experts
             },
             [](MoELayer& l) {
               for (std::int64_t j = 0; j < 6; ++j) l.router.qb_beta.set(j, 0.1f * static_cast<float>(j % 4) - 0.15f);
             }},
        Case{"top1_no_shared", [](MoESpec& s) { s.topk = 1; s.shared_ffn = 0; }},
        // Qwen3-Next's sigmoid gate on the shared expert, its own weight checked too.
        Case{"shared_expert_gate", [](MoESpec& s) { s.shared_expert_gate = true; }},
        // GPT-OSS's experts: quick-GELU with the linear half offset. The clamp is set but cuts nothing
        // here: its kinks break finite differences over the whole input (Glu.* checks it cutting).
        Case{"quick_geglu_offset", [](MoESpec& s) { s.activation = {ActivationFn::quick_gelu, 5.f, 1.f}; }},
        // gated_linear_unit=false: Megatron's default MLP (GELU), and Nemotron-H's squared ReLU.
        Case{"ungated_gelu", [](MoESpec& s) { s.activation = {ActivationFn::gelu, {}, 0.f, /*gated=*/false}; }},
        Case{"ungated_squared_relu_biases",
             [](MoESpec& s) {
               s.activation = {ActivationFn::squared_relu, {}, 0.f, /*gated=*/false};
               s.bias = true;
               s.shared_ffn = 0;
             },
             draw_biases(80)},
        Case{"capacity_drop", [](MoESpec& s) { s.capacity_factor = 0.5; }},
        // add_bias_linear: fc1's and fc2's biases, fc2's scaled by the probability (its gradient
        // reaches the router); drawn away from Megatron's zeros so that they matter.
        Case{"linear_biases", [](MoESpec& s) { s.bias = true; s.shared_ffn = 0; },
             draw_biases(70)},
        // The bias steers selection only: expert 0 gets no tokens, expert 1 nearly all.
        Case{"expert_with_zero_tokens",
             [](MoESpec& s) {
               s.score_function = "sigmoid";
               s.expert_bias = true;
             },
             [](MoELayer& l) {
               l.router.expert_bias.set(0, -10.f);
               l.router.expert_bias.set(1, 10.f);
             }},
        Case{"capacity_pad_position",
             [](MoESpec& s) {
               s.capacity_factor = 0.75;
               s.pad_to_capacity = true;
               s.drop_policy = "position";
             }}),
    [](const auto& info) { return info.param.name; });

Routing route(MoESpec spec, std::int64_t tokens, std::uint64_t seed) {
  spec.seq_length = tokens;
  spec.micro_batch = 1;
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.init_weights(seed);
  MoELayer::Context ctx;
  layer.forward(randn({tokens, spec.hidden}, seed + 1), ctx);
  return ctx.routing;
}

TEST(Routing, DroplessKeepsEveryTokenExpertPair) {
  const Routing r = route(small_spec(), 64, 5);
  EXPECT_EQ(std::accumulate(r.tokens_per_expert.begin(), r.tokens_per_expert.end(), std::int64_t{0}), 64 * 2);
  EXPECT_EQ(r.dropped, 0);
  for (std::int64_t t = 0; t < 64; ++t) {
    int routes = 0;
    double sum = 0;
    for (int e = 0; e < 6; ++e) {
      routes += r.routing_map[static_cast<std::size_t>(t * 6 + e)];
      sum += r.probs.get(t * 6 + e);
    }
    EXPECT_EQ(routes, 2);
    EXPECT_NEAR(sum, 1.0, 1e-6);  // post-softmax top-k probabilities are normalised
  }
}

TEST(Routing, CapacityDropsExactlyTheOverflowInTheDocumentedOrder) {
  MoESpec spec = small_spec();
  const Routing dropless = route(spec, 64, 6);
  for (const std::string policy : {"probs", "position"}) {
    spec.capacity_factor = 1.0;
    spec.drop_policy = policy;
    const Routing r = route(spec, 64, 6);
    const std::int64_t cap = spec.capacity(64);  // ceil(64 * 2 / 6 * 1.0) = 22
    EXPECT_EQ(cap, 22);
    std::int64_t overflow = 0;
    for (int e = 0; e < 6; ++e) {
      const std::int64_t before = dropless.tokens_per_expert[static_cast<std::size_t>(e)];
      overflow += std::max<std::int64_t>(0, before - cap);
      EXPECT_EQ(r.tokens_per_expert[static_cast<std::size_t>(e)], std::min(before, cap)) << policy << " expert " << e;
      // Every kept pair was routed, and every dropped one ranks below every kept one.
      float min_kept = 2.f, max_dropped = -1.f;
      std::int64_t last_kept = -1, first_dropped = 64;
      for (std::int64_t t = 0; t < 64; ++t) {
        const auto i = static_cast<std::size_t>(t * 6 + e);
        if (r.routing_map[i]) {
          EXPECT_TRUE(dropless.routing_map[i]);
          min_kept = std::min(min_kept, dropless.probs.get(t * 6 + e));
          last_kept = t;
        } else if (dropless.routing_map[i]) {
          max_dropped = std::max(max_dropped, dropless.probs.get(t * 6 + e));
          first_dropped = std::min(first_dropped, t);
        }
      }
      if (policy == "probs") EXPECT_GE(min_kept, max_dropped) << "expert " << e;
      else EXPECT_LT(last_kept, first_dropped) << "expert " << e;
    }
    EXPECT_GT(overflow, 0) << "the test needs an expert over capacity";
    EXPECT_EQ(r.dropped, overflow);
  }
}

TEST(Routing, DropAndPadGivesEveryExpertExactlyCapacityRows) {
  MoESpec spec = small_spec();
  spec.capacity_factor = 1.0;
  spec.pad_to_capacity = true;
  const Routing r = route(spec, 64, 7);
  for (auto n : r.tokens_per_expert) EXPECT_EQ(n, spec.capacity(64));
}

TEST(Routing, ForceLoadBalancingIsNearUniformAndIgnoresTheWeights) {
  MoESpec spec = small_spec();
  spec.num_experts = 16;
  spec.topk = 4;
  spec.force_load_balancing = true;
  const Routing a = route(spec, 2048, 8), b = route(spec, 2048, 9);  // different router weights
  EXPECT_EQ(a.routing_map, b.routing_map);  // random logits from the seed and rank only
  const double mean = 2048.0 * 4 / 16;
  for (auto n : a.tokens_per_expert) EXPECT_NEAR(static_cast<double>(n), mean, 0.15 * mean);
  // Another rank draws other logits.
  spec.seq_length = 2048;
  MoELayer layer(spec, make_local_dispatcher(16), {.rank = 1});
  layer.init_weights(8);
  MoELayer::Context ctx;
  layer.forward(randn({2048, spec.hidden}, 9), ctx);
  EXPECT_NE(ctx.routing.routing_map, a.routing_map);
  // The straight-through gradient still reaches the router weight.
  layer.zero_grad();
  layer.backward(ctx, randn({2048, spec.hidden}, 10));
  EXPECT_GT(dot(layer.router.weight.grad, layer.router.weight.grad), 0.0);
}

TEST(Router, ExpertBiasMovesTowardsBalance) {
  MoESpec spec = small_spec();
  spec.score_function = "sigmoid";
  spec.expert_bias = true;
  spec.seq_length = 64;
  spec.micro_batch = 1;
  MoELayer layer(spec, make_local_dispatcher(6));
  layer.init_weights(3);
  MoELayer::Context ctx;
  layer.forward(randn({64, 16}, 4), ctx);
  const auto counts = ctx.routing.tokens_per_expert;
  for (int e = 0; e < 6; ++e) EXPECT_EQ(layer.router.routed_tokens[static_cast<std::size_t>(e)], counts[static_cast<std::size_t>(e)]);
  layer.router.update_expert_bias(layer.router.routed_tokens.data());
  const double mean = 64.0 * 2 / 6;
  for (int e = 0; e < 6; ++e) {
    const float b = layer.router.expert_bias.get(e);
    if (static_cast<double>(counts[static_cast<std::size_t>(e)]) > mean) {
      EXPECT_FLOAT_EQ(b, -1e-3f);
    }
    if (static_cast<double>(counts[static_cast<std::size_t>(e)]) < mean) {
      EXPECT_FLOAT_EQ(b, 1e-3f);
    }
  }
}

// The expert load over experts and over EP ranks' groups of local experts, against sums by hand.
TEST(Router, BusiestOverMeanPerExpertAndPerEpRank) {
  const std::vector<float> counts{6, 0, 1, 1, 2, 2};  // mean 2 per expert
  EXPECT_DOUBLE_EQ(busiest_over_mean(counts, 1), 3.0);
  EXPECT_DOUBLE_EQ(busiest_over_mean(counts, 2), 6.0 / 4.0);  // ranks of {6,0}, {1,1}, {2,2}
  EXPECT_DOUBLE_EQ(busiest_over_mean(counts, 3), 7.0 / 6.0);  // {6,0,1}, {1,2,2}
  EXPECT_DOUBLE_EQ(busiest_over_mean(counts, 6), 1.0);
  EXPECT_DOUBLE_EQ(busiest_over_mean(std::vector<float>(4, 0.f), 2), 0.0);
  EXPECT_THROW(busiest_over_mean(counts, 4), std::invalid_argument);  // EP ranks hold equal shares
  EXPECT_THROW(busiest_over_mean(counts, 0), std::invalid_argument);
}

// Megatron's logits, the aux losses' scores (softmax over all experts) and their own top-k, naively.
struct NaiveScores {
  std::vector<std::vector<double>> logits, p;
  std::vector<std::vector<int>> top;
};
NaiveScores naive_scores(const Router& router, const Tensor& x, int k) {
  const std::int64_t t_count = x.dim(0), h = x.dim(1), e = router.weight.master.dim(0);
  NaiveScores s;
  for (std::int64_t t = 0; t < t_count; ++t) {
    std::vector<double> l(static_cast<std::size_t>(e)), p(l.size());
    double z = 0, m = -1e300;
    for (std::int64_t j = 0; j < e; ++j) {
      for (std::int64_t i = 0; i < h; ++i) l[static_cast<std::size_t>(j)] += x.get(t * h + i) * router.weight.master.get(j * h + i);
      m = std::max(m, l[static_cast<std::size_t>(j)]);
    }
    for (std::int64_t j = 0; j < e; ++j) z += p[static_cast<std::size_t>(j)] = std::exp(l[static_cast<std::size_t>(j)] - m);
    for (double& v : p) v /= z;
    std::vector<int> order(static_cast<std::size_t>(e));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[static_cast<std::size_t>(a)] > p[static_cast<std::size_t>(b)]; });
    order.resize(static_cast<std::size_t>(k));
    s.logits.push_back(l);
    s.p.push_back(p);
    s.top.push_back(order);
  }
  return s;
}

// A repeated MTP layer's share (1 / mtp_num_layers per call, Megatron's router): its aux losses'
// value and injected gradient scale by it, its z-loss's value does and its gradient does not.
TEST(Router, AuxLossShareScalesTheAuxLossesAndTheZLossesValue) {
  MoESpec spec = small_spec();
  const Tensor x = randn({16, spec.hidden}, 9);
  const auto routed = [&](const MoESpec& s, double share) {
    Router router(s);
    router.weight.master.copy_from(randn(router.weight.master.shape(), 3));
    router.weight.refresh();
    return router.forward(x, 8, true, 0.25, 0, nullptr, share);
  };
  const auto scaled = [](const Tensor& a, double f, const Tensor& b) {
    for (std::int64_t i = 0; i < a.numel(); ++i)
      if (a.data<float>()[i] * static_cast<float>(f) != b.data<float>()[i]) return false;
    return true;
  };
  for (AuxLoss k : kAuxLosses) {  // aux, seq-aux and global-aux: the same attach
    MoESpec aux = spec;
    aux.z_loss_coeff = 0;
    aux.aux_loss_coeff = {};
    at(aux.aux_loss_coeff, k) = 0.1;
    const Routing a1 = routed(aux, 1.0), a2 = routed(aux, 0.5);
    EXPECT_GT(at(a1.aux_losses, k), 0) << aux_loss_log_name(k);
    EXPECT_EQ(at(a2.aux_losses, k), 0.5 * at(a1.aux_losses, k)) << aux_loss_log_name(k);
    EXPECT_TRUE(scaled(a1.aux_grad, 0.5, a2.aux_grad)) << aux_loss_log_name(k);
  }
  MoESpec z = spec;
  z.aux_loss_coeff = {};
  const Routing z1 = routed(z, 1.0), z2 = routed(z, 0.5);
  EXPECT_GT(z1.z_loss, 0);
  EXPECT_EQ(z2.z_loss, 0.5 * z1.z_loss);
  EXPECT_TRUE(scaled(z1.aux_grad, 1.0, z2.aux_grad));
}

// Megatron's global_aux_loss: micro-batch j weighs each expert by the mean of the global batch's
// counts so far (micro-batches 1..j), N the micro-batch's tokens; one micro-batch after a restart
// is the plain aux loss. A recompute reuses the counts and counts nothing again.
TEST(Router, GlobalAuxLossAveragesTheCountsOfTheGlobalBatchSoFar) {
  MoESpec spec = small_spec();
  spec.aux_loss_coeff = {0, 0, 0.1};
  spec.seq_length = 32;
  spec.micro_batch = 1;
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.init_weights(5);
  const std::int64_t e = spec.num_experts;
  const int k = spec.topk;
  std::vector<double> counts(static_cast<std::size_t>(e), 0);
  for (int j = 1; j <= 3; ++j) {
    const Tensor x = randn({32, spec.hidden}, 20 + static_cast<std::uint64_t>(j));
    const NaiveScores s = naive_scores(layer.router, x, k);
    for (const auto& top : s.top)
      for (int i : top) counts[static_cast<std::size_t>(i)] += 1;
    double want = 0;
    for (std::int64_t t = 0; t < 32; ++t)
      for (std::int64_t i = 0; i < e; ++i)
        want += s.p[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)] * counts[static_cast<std::size_t>(i)] / j;
    want *= 0.1 * static_cast<double>(e) / (k * 32.0 * 32.0);
    const Routing r = layer.router.forward(x, 32, true);
    EXPECT_NEAR(at(r.aux_losses, AuxLoss::global_aux_loss), want, 1e-6 * want) << "micro-batch " << j;
    EXPECT_EQ(at(r.aux_losses, AuxLoss::aux_loss), 0.0);
    const Routing again = layer.router.forward(x, 32, true, 1.0, 0, &r.replay);
    EXPECT_EQ(at(again.aux_losses, AuxLoss::global_aux_loss), at(r.aux_losses, AuxLoss::global_aux_loss));
    EXPECT_EQ(std::memcmp(again.aux_grad.raw(), r.aux_grad.raw(), r.aux_grad.nbytes()), 0);
    EXPECT_EQ(layer.router.global_aux_steps, j);
  }
  layer.router.reset_global_aux_loss();
  MoESpec plain = spec;
  plain.aux_loss_coeff = {0.1, 0, 0};
  Router aux(plain);
  aux.weight.master.copy_from(layer.router.weight.master);
  const Tensor x = randn({32, spec.hidden}, 30);
  const Routing g = layer.router.forward(x, 32, true), a = aux.forward(x, 32, true);
  EXPECT_EQ(at(g.aux_losses, AuxLoss::global_aux_loss), at(a.aux_losses, AuxLoss::aux_loss));
  EXPECT_EQ(std::memcmp(g.aux_grad.raw(), a.aux_grad.raw(), a.aux_grad.nbytes()), 0);
}

// Megatron's quantile balancing: the top-k of logits - qb_beta; each training forward estimates,
// per expert, the (c+1)-th largest of logits[:, e] - a_t (a_t: token t's (k+1)-th shifted logit,
// c = T * k / E); once per global batch the mean estimate enters the EMA, recentred.
TEST(Router, QuantileBalancingSelectsByShiftedLogitsAndEstimatesTheBias) {
  MoESpec spec = small_spec();
  spec.aux_loss_coeff = {};
  spec.quantile_balancing = true;
  spec.quantile_balancing_ema = 0.25;
  const std::int64_t e = spec.num_experts, tokens = 30;  // 30 x top-2 = 60 assignments, 10 per expert
  const int k = spec.topk;
  MoELayer layer(spec, make_local_dispatcher(e));
  layer.init_weights(6);
  const std::vector<float> beta0 = {0.2f, -0.1f, 0.f, 0.05f, -0.3f, 0.15f};
  for (std::int64_t j = 0; j < e; ++j) layer.router.qb_beta.set(j, beta0[static_cast<std::size_t>(j)]);
  std::vector<double> estimate_sum(static_cast<std::size_t>(e), 0);
  for (int mb = 0; mb < 2; ++mb) {
    const Tensor x = randn({tokens, spec.hidden}, 40 + static_cast<std::uint64_t>(mb));
    const NaiveScores s = naive_scores(layer.router, x, k);
    const Routing r = layer.router.forward(x, tokens, true);
    for (std::int64_t t = 0; t < tokens; ++t) {
      std::vector<double> shifted = s.logits[static_cast<std::size_t>(t)];
      for (std::int64_t j = 0; j < e; ++j) shifted[static_cast<std::size_t>(j)] -= beta0[static_cast<std::size_t>(j)];
      std::vector<int> order(static_cast<std::size_t>(e));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return shifted[static_cast<std::size_t>(a)] > shifted[static_cast<std::size_t>(b)]; });
      // The probabilities: a softmax over the selected logits (softmax after top-k).
      double z = 0;
      for (int i = 0; i < k; ++i) z += std::exp(s.logits[static_cast<std::size_t>(t)][static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]);
      for (int i = 0; i < k; ++i) {
        const int j = order[static_cast<std::size_t>(i)];
        EXPECT_EQ(r.routing_map[static_cast<std::size_t>(t * e + j)], 1) << "token " << t;
        EXPECT_NEAR(r.probs.get(t * e + j), std::exp(s.logits[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)]) / z, 1e-5);
      }
    }
    for (std::int64_t j = 0; j < e; ++j) {  // the estimate, by sorting
      std::vector<double> column;
      for (std::int64_t t = 0; t < tokens; ++t) {
        std::vector<double> shifted = s.logits[static_cast<std::size_t>(t)];
        for (std::int64_t i = 0; i < e; ++i) shifted[static_cast<std::size_t>(i)] -= beta0[static_cast<std::size_t>(i)];
        std::sort(shifted.begin(), shifted.end(), std::greater<>());
        column.push_back(s.logits[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)] - shifted[static_cast<std::size_t>(k)]);
      }
      std::sort(column.begin(), column.end(), std::greater<>());
      estimate_sum[static_cast<std::size_t>(j)] += column[static_cast<std::size_t>(tokens * k / e)];
    }
    // Evaluation forwards and recomputes estimate nothing.
    layer.router.forward(x, tokens, false);
    layer.router.forward(x, tokens, true, 1.0, 0, &r.replay);
  }
  EXPECT_EQ(layer.router.qb_beta_count, 2);
  const std::vector<float> mean = layer.router.qb_local_mean();
  std::vector<double> want(static_cast<std::size_t>(e));
  double centre = 0;
  for (std::int64_t j = 0; j < e; ++j) {
    EXPECT_NEAR(mean[static_cast<std::size_t>(j)], estimate_sum[static_cast<std::size_t>(j)] / 2, 1e-5);
    want[static_cast<std::size_t>(j)] = 0.25 * beta0[static_cast<std::size_t>(j)] + 0.75 * mean[static_cast<std::size_t>(j)];
    centre += want[static_cast<std::size_t>(j)] / static_cast<double>(e);
  }
  layer.router.update_qb_beta(mean.data());
  for (std::int64_t j = 0; j < e; ++j) EXPECT_NEAR(layer.router.qb_beta.get(j), want[static_cast<std::size_t>(j)] - centre, 1e-6);
  EXPECT_EQ(layer.router.qb_beta_count, 0);
  EXPECT_EQ(layer.router.qb_beta_accum.get(0), 0.f);
  // A micro-batch whose assignments do not split evenly over the experts is refused, as Megatron.
  EXPECT_THROW(layer.router.forward(randn({7, spec.hidden}, 50), 7, true), InputError);
}

// What quantile balancing is for: on skewed logits (half the experts favoured), a few global
// batches of bias updates bring every expert near T * k / E assignments.
TEST(Router, QuantileBalancingEvensTheLoad) {
  MoESpec spec = small_spec();
  spec.aux_loss_coeff = {};
  spec.quantile_balancing = true;
  const std::int64_t e = spec.num_experts, tokens = 240;
  Router router(spec);
  for (std::int64_t j = 0; j < e; ++j)
    for (std::int64_t h = 0; h < spec.hidden; ++h)
      router.weight.master.set(j * spec.hidden + h, (j < e / 2 ? 0.3f : -0.3f) + 0.05f * static_cast<float>((j * 7 + h) % 5));
  Tensor x = randn({tokens, spec.hidden}, 60);
  for (std::int64_t i = 0; i < x.numel(); ++i) x.set(i, std::fabs(x.get(i)));
  const double fair = static_cast<double>(tokens * spec.topk) / static_cast<double>(e);
  const auto max_load = [&](const Routing& r) {
    return static_cast<double>(*std::max_element(r.tokens_per_expert.begin(), r.tokens_per_expert.end()));
  };
  EXPECT_GE(max_load(router.forward(x, tokens, false)), 1.8 * fair);
  for (int step = 0; step < 5; ++step) {
    router.forward(x, tokens, true);
    const std::vector<float> mean = router.qb_local_mean();
    router.update_qb_beta(mean.data());
  }
  EXPECT_LE(max_load(router.forward(x, tokens, false)), 1.15 * fair);
}

// Output, input gradient and weight gradients of one forward + backward.
struct LayerRun {
  Tensor y, dx;
  TensorMap grads;
  Routing routing;
};
LayerRun run_layer(const MoESpec& spec, const TensorMap& weights, const Tensor& x, const Tensor& g) {
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.load_weights(weights, "memory");
  MoELayer::Context ctx;
  LayerRun r;
  r.y = layer.forward(x.to(spec.dtype), ctx).to(DType::F32);
  layer.zero_grad();
  r.dx = layer.backward(ctx, g.to(spec.dtype)).to(DType::F32);
  r.grads = layer.grad_tensors();
  r.routing = ctx.routing;
  return r;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(MoELayer, SameSeedAndInputsGiveBitwiseTheSameResults) {
  for (DType dt : {DType::F32, DType::BF16}) {
    MoESpec spec = small_spec();
    spec.dtype = dt;
    MoELayer init(spec, make_local_dispatcher(spec.num_experts));
    init.init_weights(77);
    const Tensor x = randn({8, 2, 16}, 78), g = randn({8, 2, 16}, 79);
    const LayerRun a = run_layer(spec, init.weight_tensors(), x, g);
    const LayerRun b = run_layer(spec, init.weight_tensors(), x, g);
    EXPECT_TRUE(bitwise_equal(a.y, b.y));
    EXPECT_TRUE(bitwise_equal(a.dx, b.dx));
    for (const auto& [name, t] : a.grads) EXPECT_TRUE(bitwise_equal(t, b.grads.at(name))) << name;
  }
}

using test::rel_l2;

// The documented BF16 tolerance (README): relative L2 error against FP32 on the same weights and
// inputs, when the routing decisions agree.
TEST(MoELayer, Bf16StaysWithinTheDocumentedToleranceOfFp32) {
  MoESpec spec = small_spec();
  spec.hidden = 64;
  spec.ffn = 48;
  spec.shared_ffn = 32;
  spec.seq_length = 32;
  spec.init_std = 0.02;
  MoELayer init(spec, make_local_dispatcher(spec.num_experts));
  init.init_weights(8);
  const Tensor x = randn({32, 2, 64}, 6), g = randn({32, 2, 64}, 7);
  const LayerRun f32 = run_layer(spec, init.weight_tensors(), x, g);
  spec.dtype = DType::BF16;
  const LayerRun bf16 = run_layer(spec, init.weight_tensors(), x, g);
  ASSERT_EQ(bf16.routing.routing_map, f32.routing.routing_map);
  EXPECT_LT(rel_l2(bf16.y, f32.y), 1e-2);
  EXPECT_LT(rel_l2(bf16.dx, f32.dx), 1e-2);
  for (const auto& [name, t] : f32.grads) EXPECT_LT(rel_l2(bf16.grads.at(name), t), 2e-2) << name;
}

TEST(MoELayer, RejectsInputOfTheWrongShapeOrDtype) {
  MoESpec spec = small_spec();
  MoELayer layer(spec, make_local_dispatcher(6));
  layer.init_weights(1);
  MoELayer::Context ctx;
  EXPECT_THROW(layer.forward(randn({8, 2, 15}, 1), ctx), InputError);
  EXPECT_THROW(layer.forward(randn({8, 2, 16}, 1, 1.0, DType::BF16), ctx), InputError);
  TensorMap w = layer.weight_tensors();
  w.erase("mlp.experts.linear_fc2.weight3");
  const std::string missing = test::error_of<InputError>([&] { layer.load_weights(w, "w.safetensors"); });
  EXPECT_NE(missing.find("'mlp.experts.linear_fc2.weight3' is missing"), std::string::npos) << missing;
  // A tensor the layer has no place for (written for a config with an expert bias) is not dropped.
  w = layer.weight_tensors();
  w.emplace("mlp.router.expert_bias", Tensor({6}, DType::F32));
  const std::string extra = test::error_of<InputError>([&] { layer.load_weights(w, "w.safetensors"); });
  EXPECT_NE(extra.find("tensor 'mlp.router.expert_bias' is not a weight of this layer"), std::string::npos) << extra;
}

// Weights written with another add_bias_linear or gated_linear_unit: the error names the field.
TEST(MoELayer, WeightsOfAnotherMlpFormNameTheField) {
  const auto error_loading = [](const MoESpec& writer, const MoESpec& reader) {
    MoELayer w(writer, make_local_dispatcher(writer.num_experts)), r(reader, make_local_dispatcher(reader.num_experts));
    w.init_weights(1);
    return test::error_of<InputError>([&] { r.load_weights(w.weight_tensors(), "w.safetensors"); });
  };
  MoESpec gated = small_spec(), ungated = gated, biased = gated;
  ungated.activation.gated = false;
  biased.bias = true;
  biased.shared_ffn = 0;
  EXPECT_NE(error_loading(gated, ungated).find("this config's fc1 is [12, 16]: the file was written with "
                                               "model.gated_linear_unit=true"),
            std::string::npos)
      << error_loading(gated, ungated);
  EXPECT_NE(error_loading(ungated, gated).find("model.gated_linear_unit=false"), std::string::npos);
  MoESpec unbiased = biased;
  unbiased.bias = false;
  EXPECT_NE(error_loading(biased, unbiased).find("(model.add_bias_linear gives it)"), std::string::npos)
      << error_loading(biased, unbiased);
  EXPECT_NE(error_loading(unbiased, biased).find("tensor 'mlp.router.bias' is missing, which this config's "
                                                 "model.add_bias_linear gives the layer"),
            std::string::npos)
      << error_loading(unbiased, biased);
  MoESpec unshared = gated;
  unshared.shared_ffn = 0;
  EXPECT_NE(error_loading(unshared, gated).find("model.moe_shared_expert_intermediate_size"), std::string::npos);
  EXPECT_EQ(error_loading(ungated, ungated), "(no error)");
}

TEST(MoELayer, QuantileBalancingBiasTravelsWithTheWeights) {
  MoESpec spec = small_spec();
  spec.quantile_balancing = true;
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.init_weights(3);
  layer.router.qb_beta.set(2, 0.5f);
  MoELayer other(spec, make_local_dispatcher(spec.num_experts));
  other.load_weights(layer.weight_tensors(), "w.safetensors");
  EXPECT_EQ(other.router.qb_beta.get(2), 0.5f);
  TensorMap w = layer.weight_tensors();
  w.erase("mlp.router.qb_beta");
  EXPECT_THROW(other.load_weights(w, "w.safetensors"), InputError);
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// An independent forward: per token, loop over its top-k experts and the shared expert, in double.
std::vector<double> naive_forward(const TensorMap& w, const Tensor& x, const MoESpec& s) {
  const std::int64_t t_count = x.numel() / s.hidden, h = s.hidden;
  // fc1's and fc2's biases where the file has them: added, fc2's times the probability.
  const auto bias = [&](const std::string& name, std::int64_t i) {
    const auto it = w.find(name);
    return it == w.end() ? 0.0 : static_cast<double>(it->second.get(i));
  };
  auto mlp = [&](const Tensor& w1, const Tensor& w2, const std::string& b1, const std::string& b2, std::int64_t f,
                 std::int64_t t, double prob, std::vector<double>& out) {
    const MlpActivation& a = s.activation;
    const auto fn = [&](double v) {  // the activations these tests use
      switch (a.fn) {
        case ActivationFn::silu: return v / (1 + std::exp(-v));
        case ActivationFn::quick_gelu: return v / (1 + std::exp(-1.702 * v));
        case ActivationFn::gelu: return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
        case ActivationFn::squared_relu: return v > 0 ? v * v : 0.0;
        default: ADD_FAILURE() << "no naive " << activation_fn_name(a.fn); return 0.0;
      }
    };
    std::vector<double> act(static_cast<std::size_t>(f));
    for (std::int64_t j = 0; j < f; ++j) {
      double g = bias(b1, j), u = a.gated ? bias(b1, f + j) : 0.0;
      for (std::int64_t i = 0; i < h; ++i) {
        g += static_cast<double>(w1.get(j * h + i)) * x.get(t * h + i);
        if (a.gated) u += static_cast<double>(w1.get((f + j) * h + i)) * x.get(t * h + i);
      }
      if (a.clamp) {
        g = std::min(g, double{*a.clamp});
        u = std::clamp(u, -double{*a.clamp}, double{*a.clamp});
      }
      act[static_cast<std::size_t>(j)] = fn(g) * (a.gated ? u + a.linear_offset : 1.0) * prob;
    }
    for (std::int64_t i = 0; i < h; ++i) {
      out[static_cast<std::size_t>(t * h + i)] += bias(b2, i) * prob;
      for (std::int64_t j = 0; j < f; ++j) out[static_cast<std::size_t>(t * h + i)] += w2.get(i * f + j) * act[static_cast<std::size_t>(j)];
    }
  };
  std::vector<double> out(static_cast<std::size_t>(t_count * h), 0.0);
  const Tensor& router = w.at("mlp.router.weight");
  for (std::int64_t t = 0; t < t_count; ++t) {
    std::vector<double> logits(static_cast<std::size_t>(s.num_experts));
    for (std::int64_t e = 0; e < s.num_experts; ++e) logits[static_cast<std::size_t>(e)] = bias("mlp.router.bias", e);
    for (std::int64_t e = 0; e < s.num_experts; ++e)
      for (std::int64_t i = 0; i < h; ++i) logits[static_cast<std::size_t>(e)] += static_cast<double>(router.get(e * h + i)) * x.get(t * h + i);
    std::vector<std::int64_t> order(static_cast<std::size_t>(s.num_experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)]; });
    double z = 0;
    for (int i = 0; i < s.topk; ++i) z += std::exp(logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]);
    for (int i = 0; i < s.topk; ++i) {
      const std::int64_t e = order[static_cast<std::size_t>(i)];
      mlp(w.at("mlp.experts.linear_fc1.weight" + std::to_string(e)),
          w.at("mlp.experts.linear_fc2.weight" + std::to_string(e)), "mlp.experts.linear_fc1.bias" + std::to_string(e),
          "mlp.experts.linear_fc2.bias" + std::to_string(e), s.ffn, t, std::exp(logits[static_cast<std::size_t>(e)]) / z,
          out);
    }
    double gate = 1;  // Megatron's shared-expert gate: sigmoid(x . w)
    if (s.shared_expert_gate) {
      double logit = 0;
      for (std::int64_t i = 0; i < h; ++i) logit += static_cast<double>(w.at("mlp.shared_experts.gate_weight").get(i)) * x.get(t * h + i);
      gate = 1 / (1 + std::exp(-logit));
    }
    if (s.shared_ffn)
      mlp(w.at("mlp.shared_experts.linear_fc1.weight"), w.at("mlp.shared_experts.linear_fc2.weight"),
          "mlp.shared_experts.linear_fc1.bias", "mlp.shared_experts.linear_fc2.bias", s.shared_ffn, t, gate, out);
  }
  return out;
}

TEST(MoELayer, ForwardMatchesANaivePerTokenReference) {
  for (const int variant : {0, 1, 2}) {
    const bool gate = variant == 1;
    MoESpec spec = small_spec();
    spec.shared_expert_gate = gate;
    spec.bias = gate;  // GPT-OSS's router and experts have biases (a shared expert has none)
    if (gate) spec.activation = {ActivationFn::quick_gelu, 0.2f, 1.f};  // GPT-OSS's, clamping some of the inputs
    if (variant == 2) spec.activation = {ActivationFn::squared_relu, {}, 0.f, /*gated=*/false};  // Nemotron-H's
    MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
    layer.init_weights(11);
    std::uint64_t seed = 90;
    for (Param* p : layer.params())
      if (p->bias) {
        if (p != &layer.router.bias) EXPECT_EQ(dot(p->master, p->master), 0.0) << p->name << ": Megatron zeroes them";
        else EXPECT_GT(dot(p->master, p->master), 0.0) << "Megatron draws the router's bias";
        p->master.copy_from(randn(p->master.shape(), seed++, 0.3));
        p->refresh();
      }
    const Tensor x = randn({8, 2, 16}, 12);
    MoELayer::Context ctx;
    const Tensor y = layer.forward(x, ctx);
    const auto want = naive_forward(layer.weight_tensors(), x, spec);
    for (std::int64_t i = 0; i < y.numel(); ++i) ASSERT_NEAR(y.get(i), want[static_cast<std::size_t>(i)], 1e-5) << i << " variant " << variant;
    if (gate) {  // the clamp cuts some of the inputs
      spec.activation.clamp.reset();
      const auto unclamped = naive_forward(layer.weight_tensors(), x, spec);
      EXPECT_NE(unclamped, want);
    }
  }
}

// The gate's weight is in the layer's file, under Megatron's name, and read back.
TEST(MoELayer, SharedExpertGateTravelsWithTheWeights) {
  MoESpec spec = small_spec();
  spec.shared_expert_gate = true;
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.init_weights(3);
  const TensorMap w = layer.weight_tensors();
  ASSERT_EQ(w.at("mlp.shared_experts.gate_weight").shape(), (Shape{1, spec.hidden}));
  EXPECT_EQ(MoELayer::file_shapes(spec).count("mlp.shared_experts.gate_weight"), 1u);
  MoELayer other(spec, make_local_dispatcher(spec.num_experts));
  other.load_weights(w, "w.safetensors");
  EXPECT_EQ(other.shared_gate->master.get(5), layer.shared_gate->master.get(5));
  EXPECT_NE(layer.shared_gate->master.get(5), 0.f);
}

}  // namespace
}  // namespace epx
