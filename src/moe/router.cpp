#include "epx/moe/router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/comm/comm.hpp"
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
      bias("mlp.router.bias", {spec.bias ? spec.num_experts : 0}, DType::F32),
      expert_bias({spec.num_experts}, DType::F32),
      routed_tokens(static_cast<std::size_t>(spec.num_experts), 0.f),
      qb_beta({spec.num_experts}, DType::F32),
      qb_beta_accum({spec.num_experts}, DType::F32),
      global_tokens_per_expert({spec.num_experts}, DType::F32),
      spec_(spec) {
  bias.bias = true;
}

Routing Router::forward(const Tensor& x, std::int64_t seq_length, bool training,
                        double aux_loss_scale, std::uint64_t rank, const RouterReplay* replay, double aux_share) {
  if (seq_length < 1 || x.dim(0) % seq_length != 0)
    throw std::invalid_argument("router: the token count must be a multiple of seq_length");
  Routing r;
  r.num_tokens = x.dim(0);
  r.input = x.to(DType::F32);  // a copy: wgrad must not see later changes to x
  const Tensor logits = gating(r, rank, replay);
  r.aux_grad = Tensor({r.num_tokens, spec_.num_experts}, DType::F32);
  if (training) apply_z_loss(r, logits.data<float>(), aux_loss_scale);
  if (spec_.quantile_balancing) quantile_select(r, logits.data<float>(), /*update=*/training && !replay);
  score_and_select(r, logits.data<float>());
  if (spec_.capacity_factor) apply_capacity(r);
  count_tokens(r, /*counted=*/training && !replay);
  if (training) apply_aux_losses(r, logits.data<float>(), seq_length, aux_loss_scale * aux_share, replay);
  if (aux_share != 1.0) {
    for (AuxLoss k : kAuxLosses) at(r.aux_losses, k) *= aux_share;
    r.z_loss *= aux_share;
  }
  return r;
}

// The gating GEMM; under force load balancing, Megatron's RandomSTE: random logits from a
// per-rank stream, identity backward.
Tensor Router::gating(Routing& r, std::uint64_t rank, const RouterReplay* replay) {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  Tensor logits_t({t_count, e}, DType::F32);
  gemm(mat(r.input), Trans::N, mat(weight.master), Trans::T, mat_mut(logits_t));
  if (spec_.bias) add_bias_rows(logits_t, {0, t_count}, bias.master.data<float>(), nullptr);
  if (spec_.force_load_balancing) {
    float* logits = logits_t.data<float>();
    r.replay.draw = replay ? replay->draw : calls_++;
    const CounterRng rng(spec_.seed + 0x9e37ull * (rank + 1), r.replay.draw);
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

// Quantile balancing (Megatron's qb_dual_update): the top-k of logits - qb_beta. A training
// forward also estimates, per expert, the bias that would give it exactly c = T * k / E of the
// micro-batch's assignments: with a_t the (k+1)-th largest shifted logit of token t, the
// (c+1)-th largest of logits[t, e] - a_t over the tokens.
void Router::quantile_select(Routing& r, const float* logits, bool update) {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  const int k = spec_.topk;
  const float* beta = qb_beta.data<float>();
  r.topk.assign(static_cast<std::size_t>(t_count * k), 0);
  std::vector<float> shifted(static_cast<std::size_t>(e)), alpha(static_cast<std::size_t>(t_count));
  std::vector<std::int32_t> top(static_cast<std::size_t>(k + 1));
  for (std::int64_t t = 0; t < t_count; ++t) {
    for (std::int64_t j = 0; j < e; ++j) shifted[static_cast<std::size_t>(j)] = logits[t * e + j] - beta[j];
    topk_rows(shifted.data(), 1, e, k + 1, top.data());
    std::copy_n(top.begin(), k, r.topk.begin() + t * k);
    alpha[static_cast<std::size_t>(t)] = shifted[static_cast<std::size_t>(top[static_cast<std::size_t>(k)])];
  }
  if (!update || t_count == 0) return;
  if (const std::string uneven = quantile_balancing_uneven(t_count, k, e); !uneven.empty()) throw InputError(uneven);
  const auto c = static_cast<std::size_t>(t_count * k / e);
  std::vector<float> column(static_cast<std::size_t>(t_count));
  float* accum = qb_beta_accum.data<float>();
  for (std::int64_t j = 0; j < e; ++j) {
    for (std::int64_t t = 0; t < t_count; ++t)
      column[static_cast<std::size_t>(t)] = logits[t * e + j] - alpha[static_cast<std::size_t>(t)];
    std::nth_element(column.begin(), column.begin() + static_cast<std::ptrdiff_t>(c), column.end(), std::greater<>());
    accum[j] += column[c];
  }
  ++qb_beta_count;
}

// Scores (softmax before or after the top-k, or sigmoid plus the expert bias for selection only),
// the top-k (group-limited when configured; quantile balancing has chosen it already), the routed
// probabilities scaled by moe_router_topk_scaling_factor, and the routing map.
void Router::score_and_select(Routing& r, const float* logits) const {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  const int k = spec_.topk;
  r.scores = Tensor({t_count, e}, DType::F32);
  float* scores = r.scores.data<float>();
  r.probs = Tensor({t_count, e}, DType::F32);
  float* probs = r.probs.data<float>();
  const bool preselected = spec_.quantile_balancing;
  if (!preselected) r.topk.assign(static_cast<std::size_t>(t_count * k), 0);
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
      if (!preselected) select_topk(select_on.data(), e, k, spec_.num_groups, spec_.group_topk, sel);
      double z = 0;
      for (int i = 0; i < k; ++i) z += sc[sel[i]];
      for (int i = 0; i < k; ++i)
        probs[t * e + sel[i]] = k > 1 ? static_cast<float>(sc[sel[i]] / (z + 1e-20)) : sc[sel[i]];
    } else if (spec_.pre_softmax) {
      softmax_rows(lg, sc, 1, e);
      if (!preselected) select_topk(sc, e, k, spec_.num_groups, spec_.group_topk, sel);
      for (int i = 0; i < k; ++i) probs[t * e + sel[i]] = sc[sel[i]];
    } else {
      if (!preselected) select_topk(lg, e, k, spec_.num_groups, spec_.group_topk, sel);
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
// the trainer's expert-load figure and the aux-loss-free expert-bias update.
void Router::count_tokens(Routing& r, bool counted) {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  r.tokens_per_expert.assign(static_cast<std::size_t>(e), 0);
  for (std::int64_t t = 0; t < t_count; ++t)
    for (std::int64_t j = 0; j < e; ++j)
      r.tokens_per_expert[static_cast<std::size_t>(j)] += r.routing_map[static_cast<std::size_t>(t * e + j)];
  if (!counted) return;
  for (std::size_t j = 0; j < routed_tokens.size(); ++j) routed_tokens[j] += static_cast<float>(r.tokens_per_expert[j]);
}

// The aux losses (Megatron's switch_load_balancing_loss_func) on the full score distribution and
// its own unbiased top-k: coeff * E / (k * N^2) * sum_e count_e * sum_t p[t, e], with
//   aux_loss         this micro-batch's counts, N its tokens;
//   seq_aux_loss     the same per sequence b of Megatron's [S, B] order (token t = s * B + b), / B;
//   global_aux_loss  the counts summed over global_aux_group, averaged over the global batch's
//                    micro-batches so far; N the micro-batch's tokens over the group.
// Their gradients, through the score function, go into r.aux_grad.
void Router::apply_aux_losses(Routing& r, const float* logits, std::int64_t seq_length, double scale,
                              const RouterReplay* replay) {
  const std::int64_t t_count = r.num_tokens, e = spec_.num_experts;
  const int k = spec_.topk;
  const auto& coeffs = spec_.aux_loss_coeff;
  if (t_count == 0 || std::none_of(coeffs.begin(), coeffs.end(), [](double c) { return c > 0; })) return;
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
  // d loss / d p_aux[t, j] = weight[b(t), j], summed over the losses that are on.
  std::vector<double> weight_local(static_cast<std::size_t>(e), 0), weight_seq;
  const std::int64_t b_count = t_count / seq_length;
  // Each loss: its counts per group of tokens (`groups` of them, token t in group t % groups), its
  // scale c; the loss is c * sum count * mass, its gradient c * count.
  auto add_loss = [&](AuxLoss kind, std::int64_t groups, const std::vector<double>& count, double c,
                      std::vector<double>& weight) {
    std::vector<double> mass(static_cast<std::size_t>(groups * e), 0);
    for (std::int64_t t = 0; t < t_count; ++t)
      for (std::int64_t j = 0; j < e; ++j)
        mass[static_cast<std::size_t>((t % groups) * e + j)] += p_aux[static_cast<std::size_t>(t * e + j)];
    double loss = 0;
    for (std::size_t i = 0; i < count.size(); ++i) loss += c * count[i] * mass[i];
    at(r.aux_losses, kind) = loss;
    weight.resize(count.size(), 0);
    for (std::size_t i = 0; i < count.size(); ++i) weight[i] += c * count[i];
  };
  auto top_counts = [&](std::int64_t groups) {
    std::vector<double> count(static_cast<std::size_t>(groups * e), 0);
    for (std::int64_t t = 0; t < t_count; ++t)
      for (int i = 0; i < k; ++i) count[static_cast<std::size_t>((t % groups) * e + top[static_cast<std::size_t>(t * k + i)])] += 1;
    return count;
  };
  const double ek = static_cast<double>(e) / static_cast<double>(k);
  const auto t_d = static_cast<double>(t_count);
  if (const double coeff = at(coeffs, AuxLoss::aux_loss); coeff > 0)
    add_loss(AuxLoss::aux_loss, 1, top_counts(1), ek * coeff / (t_d * t_d), weight_local);
  if (const double coeff = at(coeffs, AuxLoss::seq_aux_loss); coeff > 0) {
    const auto s = static_cast<double>(seq_length);
    add_loss(AuxLoss::seq_aux_loss, b_count, top_counts(b_count), ek * coeff / (s * s * static_cast<double>(b_count)),
             weight_seq);
  }
  if (const double coeff = at(coeffs, AuxLoss::global_aux_loss); coeff > 0) {
    std::vector<float>& mean = r.replay.global_tokens_per_expert;
    const int ranks = global_aux_group ? global_aux_group->size() : 1;
    if (replay) {
      mean = replay->global_tokens_per_expert;
    } else {
      std::vector<double> local = top_counts(1);
      std::vector<float> counts(local.begin(), local.end());
      if (global_aux_group) global_aux_group->allreduce(counts.data(), static_cast<std::int64_t>(counts.size()), DType::F32);
      float* total = global_tokens_per_expert.data<float>();
      ++global_aux_steps;
      mean.resize(static_cast<std::size_t>(e));
      for (std::int64_t j = 0; j < e; ++j) {
        total[j] += counts[static_cast<std::size_t>(j)];
        mean[static_cast<std::size_t>(j)] = total[j] / static_cast<float>(global_aux_steps);
      }
    }
    const double n = t_d * ranks;
    add_loss(AuxLoss::global_aux_loss, 1, std::vector<double>(mean.begin(), mean.end()), ek * coeff / (n * n),
             weight_local);
  }
  // Back through the score function.
  std::vector<float> dp(static_cast<std::size_t>(e)), dl(static_cast<std::size_t>(e));
  for (std::int64_t t = 0; t < t_count; ++t) {
    for (std::int64_t j = 0; j < e; ++j) {
      double w = weight_local.empty() ? 0 : weight_local[static_cast<std::size_t>(j)];
      if (!weight_seq.empty()) w += weight_seq[static_cast<std::size_t>((t % b_count) * e + j)];
      dp[static_cast<std::size_t>(j)] = static_cast<float>(scale * w);
    }
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
  if (spec_.bias) add_row_sums(r.dlogits, {0, r.num_tokens}, nullptr, bias.grad.data<float>());
}

void Router::update_expert_bias(const float* count) {
  float* bias = expert_bias.data<float>();
  const std::int64_t e = spec_.num_experts;
  double mean = 0;
  for (std::int64_t j = 0; j < e; ++j) mean += count[j];
  mean /= static_cast<double>(e);
  for (std::int64_t j = 0; j < e; ++j) {
    const double d = mean - count[j];
    bias[j] += static_cast<float>(spec_.bias_update_rate * ((d > 0) - (d < 0)));
  }
}

std::vector<float> Router::qb_local_mean() const {
  const float* accum = qb_beta_accum.data<float>();
  const float count = static_cast<float>(std::max<std::int64_t>(qb_beta_count, 1));
  std::vector<float> mean(static_cast<std::size_t>(spec_.num_experts));
  for (std::size_t j = 0; j < mean.size(); ++j) mean[j] = accum[j] / count;
  return mean;
}

void Router::update_qb_beta(const float* dp_mean) {
  float* beta = qb_beta.data<float>();
  const std::int64_t e = spec_.num_experts;
  const auto ema = static_cast<float>(spec_.quantile_balancing_ema);
  float centre = 0;
  for (std::int64_t j = 0; j < e; ++j) {
    beta[j] = ema * beta[j] + (1 - ema) * dp_mean[j];
    centre += beta[j];
  }
  centre /= static_cast<float>(e);
  for (std::int64_t j = 0; j < e; ++j) beta[j] -= centre;
  qb_beta_accum.zero();
  qb_beta_count = 0;
}

void Router::reset_global_aux_loss() {
  global_tokens_per_expert.zero();
  global_aux_steps = 0;
}

double busiest_over_mean(std::span<const float> counts, std::size_t group) {
  if (group == 0 || counts.size() % group != 0)
    throw std::invalid_argument(fmt::format("busiest_over_mean: groups of {} over {} experts", group, counts.size()));
  double total = 0, busiest = 0;
  for (std::size_t g = 0; g + group <= counts.size(); g += group) {
    const std::span<const float> part = counts.subspan(g, group);
    const double n = std::accumulate(part.begin(), part.end(), 0.0);
    total += n;
    busiest = std::max(busiest, n);
  }
  return total > 0 ? busiest / (total / static_cast<double>(counts.size() / group)) : 0;
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
