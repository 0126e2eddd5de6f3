// The MoE layer on one rank: finite-difference gradients of the whole layer for each routing
// mode, capacity and permutation invariants, determinism, and BF16 against FP32.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <cstring>
#include <numeric>

#include "epx/base/error.hpp"
#include "epx/moe/moe_layer.hpp"
#include "gradcheck.hpp"
#include "tensor_compare.hpp"

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
  s.aux_loss_coeff = 0.1;  // large, so the injected gradients are visible in the check
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
    const Tensor y = layer.forward(x, c);
    routing_changed |= c.routing.routing_map != base_map;
    return dot(y, g) + c.routing.aux_loss + c.routing.z_loss;
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
        Case{"seq_aux_loss", [](MoESpec& s) { s.load_balancing = "seq_aux_loss"; }},
        Case{"top1_no_shared", [](MoESpec& s) { s.topk = 1; s.shared_ffn = 0; }},
        Case{"capacity_drop", [](MoESpec& s) { s.capacity_factor = 0.5; }},
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
  layer.router.update_expert_bias();
  const double mean = 64.0 * 2 / 6;
  for (int e = 0; e < 6; ++e) {
    const float b = layer.router.expert_bias.get(e);
    if (static_cast<double>(counts[static_cast<std::size_t>(e)]) > mean) {
      EXPECT_FLOAT_EQ(b, -1e-3f);
    }
    if (static_cast<double>(counts[static_cast<std::size_t>(e)]) < mean) {
      EXPECT_FLOAT_EQ(b, 1e-3f);
    }
    EXPECT_EQ(layer.router.local_tokens_per_expert.get(e), 0.f);
  }
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
  try {
    layer.load_weights(w, "w.safetensors");
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'mlp.experts.linear_fc2.weight3' is missing"), std::string::npos) << e.what();
  }
  // A tensor the layer has no place for (written for a config with an expert bias) is not dropped.
  w = layer.weight_tensors();
  w.emplace("mlp.router.expert_bias", Tensor({6}, DType::F32));
  try {
    layer.load_weights(w, "w.safetensors");
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'mlp.router.expert_bias' is not a weight of this layer"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// An independent forward: per token, loop over its top-k experts and the shared expert, in double.
std::vector<double> naive_forward(const TensorMap& w, const Tensor& x, const MoESpec& s) {
  const std::int64_t t_count = x.numel() / s.hidden, h = s.hidden;
  auto mlp = [&](const Tensor& w1, const Tensor& w2, std::int64_t f, std::int64_t t, double prob,
                 std::vector<double>& out) {
    std::vector<double> act(static_cast<std::size_t>(f));
    for (std::int64_t j = 0; j < f; ++j) {
      double g = 0, u = 0;
      for (std::int64_t i = 0; i < h; ++i) {
        g += static_cast<double>(w1.get(j * h + i)) * x.get(t * h + i);
        u += static_cast<double>(w1.get((f + j) * h + i)) * x.get(t * h + i);
      }
      act[static_cast<std::size_t>(j)] = g / (1 + std::exp(-g)) * u * prob;
    }
    for (std::int64_t i = 0; i < h; ++i)
      for (std::int64_t j = 0; j < f; ++j) out[static_cast<std::size_t>(t * h + i)] += w2.get(i * f + j) * act[static_cast<std::size_t>(j)];
  };
  std::vector<double> out(static_cast<std::size_t>(t_count * h), 0.0);
  const Tensor& router = w.at("mlp.router.weight");
  for (std::int64_t t = 0; t < t_count; ++t) {
    std::vector<double> logits(static_cast<std::size_t>(s.num_experts));
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
          w.at("mlp.experts.linear_fc2.weight" + std::to_string(e)), s.ffn, t,
          std::exp(logits[static_cast<std::size_t>(e)]) / z, out);
    }
    if (s.shared_ffn)
      mlp(w.at("mlp.shared_experts.linear_fc1.weight"), w.at("mlp.shared_experts.linear_fc2.weight"),
          s.shared_ffn, t, 1.0, out);
  }
  return out;
}

TEST(MoELayer, ForwardMatchesANaivePerTokenReference) {
  const MoESpec spec = small_spec();
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  layer.init_weights(11);
  const Tensor x = randn({8, 2, 16}, 12);
  MoELayer::Context ctx;
  const Tensor y = layer.forward(x, ctx);
  const auto want = naive_forward(layer.weight_tensors(), x, spec);
  for (std::int64_t i = 0; i < y.numel(); ++i) ASSERT_NEAR(y.get(i), want[static_cast<std::size_t>(i)], 1e-5) << i;
}

}  // namespace
}  // namespace epx
