#include "epx/moe/router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "epx/kernels/kernels.hpp"
#include "epx/tensor/random.hpp"

namespace epx {
namespace {

// Top-k of one row, optionally group-limited (Megatron's group_limited_topk): rank groups by the
// sum of their best k/group_topk scores, keep group_topk groups, then take the top-k inside.
void select_topk(const float* scores, std::int64_t e, int k, int groups, int group_topk,
                 std::int32_t* out) {
  if (groups <= 0) {
    topk_rows(scores, 1, e, k, out);
    return;
  }
  const std::int64_t per = e / groups;
  const int best = k / group_topk;
  std::vector<float> group_score(static_cast<std::size_t>(groups));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(best));
  for (int g = 0; g < groups; ++g) {
    topk_rows(scores + g * per, 1, per, best, idx.data());
    float s = 0;
    for (auto i : idx) s += scores[g * per + i];
    group_score[static_cast<std::size_t>(g)] = s;
  }
  std::vector<std::int32_t> kept(static_cast<std::size_t>(group_topk));
  topk_rows(group_score.data(), 1, groups, group_topk, kept.data());
  std::vector<float> masked(static_cast<std::size_t>(e), -INFINITY);
  for (auto g : kept)
    std::copy(scores + g * per, scores + (g + 1) * per, masked.begin() + g * per);
  topk_rows(masked.data(), 1, e, k, out);
}

}  // namespace

Router::Router(const MoESpec& spec)
    : weight("mlp.router.weight", {spec.num_experts, spec.hidden}, DType::F32),
      expert_bias({spec.num_experts}, DType::F32),
      local_tokens_per_expert({spec.num_experts}, DType::F32),
      spec_(spec) {}

Routing Router::forward(const Tensor& x, std::int64_t seq_length, bool training,
                        double aux_loss_scale, std::uint64_t rank, std::optional<std::uint64_t> replay_draw) {
  if (seq_length < 1 || x.dim(0) % seq_length != 0)
    throw std::invalid_argument("router: the token count must be a multiple of seq_length");
  Routing r;
  r.num_tokens = x.dim(0);
  r.input = x.to(DType::F32);  // a copy: wgrad must not see later changes to x
  const Tensor logits = gating(r, rank, replay_draw);
  r.aux_grad = Tensor({r.num_tokens, spec_.num_experts}, DType::F32);
  if (training) apply_z_loss(r, logits.data<float>(), aux_loss_scale);
  score_and_select(r, logits.data<float>());
  if (spec_.capacity_factor) apply_capacity(r);
  count_tokens(r, /*for_bias=*/training && spec_.expert_bias && !replay_draw);
  if (training) apply_aux_loss(r, logits.data<float>(), seq_length, aux_loss_scale);
  return r;
}

// The gating GEMM; under force load balancing, Megatron's RandomSTE: random logits from a
// per-rank stream, identity backward.
Tensor Router::gating(Routing& r, std::uint64_t rank, std::optional<std::uint64_t> replay_draw) {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  Tensor logits_t({t_count, e}, DType::F32);
  gemm(mat(r.input), Trans::N, mat(weight.master), Trans::T, mat_mut(logits_t));
  if (spec_.force_load_balancing) {
    float* logits = logits_t.data<float>();
    r.draw = replay_draw ? *replay_draw : calls_++;
    const CounterRng rng(spec_.seed + 0x9e37ull * (rank + 1), r.draw);
    for (std::int64_t i = 0; i < t_count * e; ++i) logits[i] = static_cast<float>(rng.normal(static_cast<std::uint64_t>(i)));
  }
  return logits_t;
}

// z-loss (ST-MoE, Megatron's z_loss_func): coeff * mean(logsumexp(logits)^2); its gradient goes
// into r.aux_grad.
void Router::apply_z_loss(Routing& r, const float* logits, double scale) const {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  if (spec_.z_loss_coeff <= 0 || t_count == 0) return;
  float* aux_grad = r.aux_grad.data<float>();
  std::vector<float> lse(static_cast<std::size_t>(t_count)), sm(static_cast<std::size_t>(e));
  logsumexp_rows(logits, lse.data(), t_count, e);
  double z = 0;
  for (std::int64_t t = 0; t < t_count; ++t) {
    const double l = lse[static_cast<std::size_t>(t)];
    z += l * l;
    softmax_rows(logits + t * e, sm.data(), 1, e);
    const double g = scale * spec_.z_loss_coeff * 2.0 * l / static_cast<double>(t_count);
    for (std::int64_t j = 0; j < e; ++j) aux_grad[t * e + j] += static_cast<float>(g * sm[static_cast<std::size_t>(j)]);
  }
  r.z_loss = spec_.z_loss_coeff * z / static_cast<double>(t_count);
}

// Scores (softmax before or after the top-k, or sigmoid plus the expert bias for selection only),
// the top-k (group-limited when configured), the routed probabilities scaled by
// moe_router_topk_scaling_factor, and the routing map.
void Router::score_and_select(Routing& r, const float* logits) const {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  const int k = spec_.topk;
  r.scores = Tensor({t_count, e}, DType::F32);
  float* scores = r.scores.data<float>();
  r.probs = Tensor({t_count, e}, DType::F32);
  float* probs = r.probs.data<float>();
  r.topk.assign(static_cast<std::size_t>(t_count * k), 0);
  r.routing_map.assign(static_cast<std::size_t>(t_count * e), 0);
  const bool sigmoid_scores = spec_.score_function == "sigmoid";
  std::vector<float> select_on(static_cast<std::size_t>(e));
  for (std::int64_t t = 0; t < t_count; ++t) {
    const float* lg = logits + t * e;
    float* sc = scores + t * e;
    std::int32_t* sel = r.topk.data() + t * k;
    if (sigmoid_scores) {
      sigmoid(lg, sc, e);
      for (std::int64_t j = 0; j < e; ++j)
        select_on[static_cast<std::size_t>(j)] = sc[j] + (spec_.expert_bias ? expert_bias.data<float>()[j] : 0.f);
      select_topk(select_on.data(), e, k, spec_.num_groups, spec_.group_topk, sel);
      double z = 0;
      for (int i = 0; i < k; ++i) z += sc[sel[i]];
      for (int i = 0; i < k; ++i)
        probs[t * e + sel[i]] = k > 1 ? static_cast<float>(sc[sel[i]] / (z + 1e-20)) : sc[sel[i]];
    } else if (spec_.pre_softmax) {
      softmax_rows(lg, sc, 1, e);
      select_topk(sc, e, k, spec_.num_groups, spec_.group_topk, sel);
      for (int i = 0; i < k; ++i) probs[t * e + sel[i]] = sc[sel[i]];
    } else {
      select_topk(lg, e, k, spec_.num_groups, spec_.group_topk, sel);
      std::vector<float> chosen(static_cast<std::size_t>(k)), p(static_cast<std::size_t>(k));
      for (int i = 0; i < k; ++i) chosen[static_cast<std::size_t>(i)] = lg[sel[i]];
      softmax_rows(chosen.data(), p.data(), 1, k);
      for (int i = 0; i < k; ++i) sc[sel[i]] = probs[t * e + sel[i]] = p[static_cast<std::size_t>(i)];
    }
    for (int i = 0; i < k; ++i) {
      probs[t * e + sel[i]] *= static_cast<float>(spec_.topk_scaling_factor);
      r.routing_map[static_cast<std::size_t>(t * e + sel[i])] = 1;
    }
  }
}

// Capacity (Megatron's apply_capacity / drop_and_pad): per expert keep `cap` pairs, by
// probability (ties: lower token first) or by position (earliest tokens); with padding, fill the
// column up to `cap` with the lowest-index tokens not routed to it, at probability 0.
void Router::apply_capacity(Routing& r) const {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  float* probs = r.probs.data<float>();
  const std::int64_t cap = spec_.capacity(t_count);
  std::vector<std::int64_t> routed;
  for (std::int64_t j = 0; j < e; ++j) {
    routed.clear();
    for (std::int64_t t = 0; t < t_count; ++t)
      if (r.routing_map[static_cast<std::size_t>(t * e + j)]) routed.push_back(t);
    if (spec_.drop_policy == "probs")
      std::stable_sort(routed.begin(), routed.end(), [&](std::int64_t a, std::int64_t b) {
        return probs[a * e + j] > probs[b * e + j];
      });
    for (std::size_t i = static_cast<std::size_t>(std::min<std::int64_t>(cap, static_cast<std::int64_t>(routed.size()))); i < routed.size(); ++i) {
      r.routing_map[static_cast<std::size_t>(routed[i] * e + j)] = 0;
      probs[routed[i] * e + j] = 0.f;
      ++r.dropped;
    }
    if (spec_.pad_to_capacity) {
      std::int64_t have = std::min<std::int64_t>(cap, static_cast<std::int64_t>(routed.size()));
      std::vector<std::uint8_t> was_routed(static_cast<std::size_t>(t_count), 0);
      for (auto t : routed) was_routed[static_cast<std::size_t>(t)] = 1;
      for (std::int64_t t = 0; t < t_count && have < cap; ++t)
        if (!was_routed[static_cast<std::size_t>(t)]) {
          r.routing_map[static_cast<std::size_t>(t * e + j)] = 1;
          ++have;
        }
    }
  }
}

// Tokens per expert after capacity; a training forward (not a recompute) also counts them for
// the aux-loss-free expert-bias update.
void Router::count_tokens(Routing& r, bool for_bias) {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  r.tokens_per_expert.assign(static_cast<std::size_t>(e), 0);
  for (std::int64_t t = 0; t < t_count; ++t)
    for (std::int64_t j = 0; j < e; ++j)
      r.tokens_per_expert[static_cast<std::size_t>(j)] += r.routing_map[static_cast<std::size_t>(t * e + j)];
  if (for_bias)
    for (std::int64_t j = 0; j < e; ++j)
      local_tokens_per_expert.data<float>()[j] += static_cast<float>(r.tokens_per_expert[static_cast<std::size_t>(j)]);
}

// Load-balancing loss (Megatron's switch_load_balancing_loss_func, per sequence for
// seq_aux_loss) on the full score distribution and its own unbiased top-k; its gradient goes into
// r.aux_grad.
void Router::apply_aux_loss(Routing& r, const float* logits, std::int64_t seq_length, double scale) const {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  const int k = spec_.topk;
  if (spec_.load_balancing == "none" || spec_.aux_loss_coeff <= 0 || t_count == 0) return;
  const float* scores = r.scores.data<float>();
  float* aux_grad = r.aux_grad.data<float>();
  const bool sigmoid_scores = spec_.score_function == "sigmoid";
  std::vector<float> p_aux(static_cast<std::size_t>(t_count * e));
  if (sigmoid_scores) {
    for (std::int64_t t = 0; t < t_count; ++t) {
      double z = 0;
      for (std::int64_t j = 0; j < e; ++j) z += scores[t * e + j];
      for (std::int64_t j = 0; j < e; ++j)
        p_aux[static_cast<std::size_t>(t * e + j)] = static_cast<float>(scores[t * e + j] / (z + 1e-20));
    }
  } else {
    softmax_rows(logits, p_aux.data(), t_count, e);
  }
  std::vector<std::int32_t> top(static_cast<std::size_t>(t_count * k));
  topk_rows(p_aux.data(), t_count, e, k, top.data());
  // seq_aux_loss: statistics per sequence b of Megatron's [S, B] order (token t = s * B + b).
  const bool per_seq = spec_.load_balancing == "seq_aux_loss";
  const std::int64_t b_count = per_seq ? t_count / seq_length : 1;
  const std::int64_t s_count = per_seq ? seq_length : t_count;
  std::vector<double> count(static_cast<std::size_t>(b_count * e), 0), mass(static_cast<std::size_t>(b_count * e), 0);
  for (std::int64_t t = 0; t < t_count; ++t) {
    const std::int64_t b = per_seq ? t % b_count : 0;
    for (int i = 0; i < k; ++i) count[static_cast<std::size_t>(b * e + top[static_cast<std::size_t>(t * k + i)])] += 1;
    for (std::int64_t j = 0; j < e; ++j) mass[static_cast<std::size_t>(b * e + j)] += p_aux[static_cast<std::size_t>(t * e + j)];
  }
  const double c = static_cast<double>(e) * spec_.aux_loss_coeff /
                   (static_cast<double>(k) * static_cast<double>(s_count) * static_cast<double>(s_count) *
                    static_cast<double>(b_count));
  for (std::size_t i = 0; i < count.size(); ++i) r.aux_loss += c * count[i] * mass[i];
  // d aux / d p_aux[t, j] = c * count[b(t), j], then back through the score function.
  std::vector<float> dp(static_cast<std::size_t>(e)), dl(static_cast<std::size_t>(e));
  for (std::int64_t t = 0; t < t_count; ++t) {
    const std::int64_t b = per_seq ? t % b_count : 0;
    for (std::int64_t j = 0; j < e; ++j)
      dp[static_cast<std::size_t>(j)] = static_cast<float>(scale * c * count[static_cast<std::size_t>(b * e + j)]);
    if (sigmoid_scores) {
      double z = 0, dot = 0;
      for (std::int64_t j = 0; j < e; ++j) {
        z += scores[t * e + j];
        dot += static_cast<double>(dp[static_cast<std::size_t>(j)]) * scores[t * e + j];
      }
      z += 1e-20;
      for (std::int64_t j = 0; j < e; ++j) {
        const double s = scores[t * e + j];
        const double ds = dp[static_cast<std::size_t>(j)] / z - dot / (z * z);
        aux_grad[t * e + j] += static_cast<float>(ds * s * (1 - s));
      }
    } else {
      softmax_backward_rows(p_aux.data() + t * e, dp.data(), dl.data(), 1, e);
      for (std::int64_t j = 0; j < e; ++j) aux_grad[t * e + j] += dl[static_cast<std::size_t>(j)];
    }
  }
}

Tensor Router::backward_dgrad(Routing& r, const Tensor& dprobs, DType dx_dtype) const {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  const int k = spec_.topk;
  r.dlogits = r.aux_grad.clone();
  float* dl = r.dlogits.data<float>();
  const float* dp = dprobs.data<float>();
  const float* sc = r.scores.data<float>();
  const bool sigmoid_scores = spec_.score_function == "sigmoid";
  std::vector<float> dsel(static_cast<std::size_t>(k)), full(static_cast<std::size_t>(e)), dfull(static_cast<std::size_t>(e));
  for (std::int64_t t = 0; t < t_count; ++t) {
    const std::int32_t* sel = r.topk.data() + t * k;
    // Gradient of each selected, unscaled probability; dropped pairs had probability 0.
    for (int i = 0; i < k; ++i) {
      const auto idx = static_cast<std::size_t>(t * e + sel[i]);
      dsel[static_cast<std::size_t>(i)] =
          r.routing_map[idx] ? dp[idx] * static_cast<float>(spec_.topk_scaling_factor) : 0.f;
    }
    if (sigmoid_scores) {
      double z = 0, dot = 0;
      for (int i = 0; i < k; ++i) {
        z += sc[t * e + sel[i]];
        dot += static_cast<double>(dsel[static_cast<std::size_t>(i)]) * sc[t * e + sel[i]];
      }
      z += 1e-20;
      for (int i = 0; i < k; ++i) {
        const double s = sc[t * e + sel[i]];
        const double ds = k > 1 ? dsel[static_cast<std::size_t>(i)] / z - dot / (z * z) : dsel[static_cast<std::size_t>(i)];
        dl[t * e + sel[i]] += static_cast<float>(ds * s * (1 - s));
      }
    } else if (spec_.pre_softmax) {
      std::fill(full.begin(), full.end(), 0.f);
      for (int i = 0; i < k; ++i) full[static_cast<std::size_t>(sel[i])] = dsel[static_cast<std::size_t>(i)];
      softmax_backward_rows(sc + t * e, full.data(), dfull.data(), 1, e);
      for (std::int64_t j = 0; j < e; ++j) dl[t * e + j] += dfull[static_cast<std::size_t>(j)];
    } else {
      double dot = 0;
      for (int i = 0; i < k; ++i) dot += static_cast<double>(dsel[static_cast<std::size_t>(i)]) * sc[t * e + sel[i]];
      for (int i = 0; i < k; ++i) {
        const float p = sc[t * e + sel[i]];
        dl[t * e + sel[i]] += p * (dsel[static_cast<std::size_t>(i)] - static_cast<float>(dot));
      }
    }
  }
  Tensor dx({t_count, spec_.hidden}, DType::F32);
  gemm(mat(r.dlogits), Trans::N, mat(weight.master), Trans::N, mat_mut(dx));
  return dx_dtype == DType::F32 ? dx : dx.to(dx_dtype);
}

void Router::backward_wgrad(Routing& r) {
  gemm(mat(r.dlogits), Trans::T, mat(r.input), Trans::N, mat_mut(weight.grad), /*accumulate=*/true);
}

void Router::update_expert_bias() {
  float* bias = expert_bias.data<float>();
  float* count = local_tokens_per_expert.data<float>();
  const std::int64_t e = spec_.num_experts;
  double mean = 0;
  for (std::int64_t j = 0; j < e; ++j) mean += count[j];
  mean /= static_cast<double>(e);
  for (std::int64_t j = 0; j < e; ++j) {
    const double d = mean - count[j];
    bias[j] += static_cast<float>(spec_.bias_update_rate * ((d > 0) - (d < 0)));
    count[j] = 0.f;
  }
}

Routing random_topk_routing(std::int64_t tokens, std::int64_t experts, int k, std::uint64_t seed) {
  Routing r;
  r.num_tokens = tokens;
  r.probs = Tensor({tokens, experts}, DType::F32);
  r.routing_map.assign(static_cast<std::size_t>(tokens * experts), 0);
  const CounterRng rng(seed, 99);
  std::uint64_t draw = 0;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int chosen = 0; chosen < k;) {
      const auto e = static_cast<std::int64_t>(rng.uniform(draw++) * static_cast<double>(experts)) % experts;
      auto& m = r.routing_map[static_cast<std::size_t>(t * experts + e)];
      if (m) continue;
      m = 1;
      r.probs.data<float>()[t * experts + e] = 1.0f / static_cast<float>(k);
      ++chosen;
    }
  return r;
}

}  // namespace epx
