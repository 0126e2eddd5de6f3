// The top-k router (Megatron-Core's TopKRouter), all math in FP32: gating GEMM, score function
// (softmax before or after top-k, or sigmoid with an optional aux-loss-free expert bias),
// group-limited top-k, capacity with drop or drop-and-pad, and load balancing: the aux losses
// (aux_loss, seq_aux_loss, global_aux_loss; any of them together), the z-loss, and quantile
// balancing. As in Megatron, the losses are not added to the model's loss: their gradients are
// injected into the router's backward, scaled by aux_loss_scale.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "epx/moe/moe_spec.hpp"
#include "epx/tensor/param.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

class Communicator;

// What the recompute of a training forward reuses so that it routes and weighs the same: the
// random logits' draw (force load balancing) and the global aux loss's mean counts.
struct RouterReplay {
  std::uint64_t draw = 0;
  std::vector<float> global_tokens_per_expert;  // [E] the running mean this micro-batch used
};

// One micro-batch's routing: the result and what the backward needs.
struct Routing {
  std::int64_t num_tokens = 0;
  Tensor probs;                          // [T, E] F32, zero off the routing map
  std::vector<std::uint8_t> routing_map; // [T, E]
  std::vector<std::int64_t> tokens_per_expert;  // [E] after capacity
  std::int64_t dropped = 0;              // (token, expert) pairs removed by capacity
  AuxLossValues aux_losses{};            // each with its coefficient (what is differentiated)
  double z_loss = 0.0;                   // includes moe_z_loss_coeff
  RouterReplay replay;                   // what a recompute of this forward needs

  // Saved for the backward.
  Tensor input;                          // [T, H] F32 router input
  Tensor scores;                         // [T, E] F32 softmax or sigmoid of the logits
  std::vector<std::int32_t> topk;        // [T, k] selected experts, before capacity
  Tensor aux_grad;                       // [T, E] F32 d(aux + z)/d(logits), already scaled
  Tensor dlogits;                        // [T, E] F32, set by backward_dgrad for wgrad
};

// The load of the busiest of `counts`' consecutive groups of `group` experts (an EP rank's local
// experts; 1: each expert) against the mean group's: 1 is balanced, 0 where nothing was routed.
double busiest_over_mean(std::span<const float> counts, std::size_t group);

// Top-k distinct experts per token, uniformly at random, probability 1/k each (what force load
// balancing gives): routing for the dispatch benchmarks, without a router.
Routing random_topk_routing(std::int64_t tokens, std::int64_t experts, int k, std::uint64_t seed);

class Router {
 public:
  explicit Router(const MoESpec& spec);

  Param weight;        // mlp.router.weight [E, H]
  Param bias;          // mlp.router.bias [E] (add_bias_linear; empty without), added to the logits
  Tensor expert_bias;  // mlp.router.expert_bias [E] F32 (a buffer, not trained by gradients)
  // [E] tokens per expert of the training forwards since the trainer last took them (once per
  // global batch): the expert-bias update's counts and the expert-load figure.
  std::vector<float> routed_tokens;
  // Quantile balancing: mlp.router.qb_beta [E] F32, subtracted from the logits to select; the
  // training forwards' estimates since the last update, and how many.
  Tensor qb_beta, qb_beta_accum;
  std::int64_t qb_beta_count = 0;
  // The global aux loss: the tokens per expert of this global batch's micro-batches so far,
  // summed over `global_aux_group` (Megatron's TP x DP x CP group; null: this rank alone).
  Tensor global_tokens_per_expert;
  std::int64_t global_aux_steps = 0;
  Communicator* global_aux_group = nullptr;

  // x [T, H] (any float dtype). seq_length is S of Megatron's [S, B] token order (seq_aux_loss).
  // `rank` (and the forward count) pick the random stream under force load balancing.
  // `replay`: a recompute of an earlier forward (activation recompute) that gave this: the same
  // random logits and global-aux counts, and nothing is counted again (expert bias, global aux
  // loss, quantile balancing). `aux_share` scales the aux losses (their gradient and value) and
  // the z-loss's value: a repeated MTP layer's 1 / mtp_num_layers (MoELayerOptions).
  Routing forward(const Tensor& x, std::int64_t seq_length, bool training, double aux_loss_scale = 1.0,
                  std::uint64_t rank = 0, const RouterReplay* replay = nullptr, double aux_share = 1.0);
  // dprobs [T, E] F32: returns dx [T, H] in `dx_dtype`; keeps dlogits for wgrad.
  Tensor backward_dgrad(Routing& r, const Tensor& dprobs, DType dx_dtype) const;
  // weight.grad += dlogits^T x.
  void backward_wgrad(Routing& r);
  // Aux-loss-free balancing, once per global batch: bias += rate * sign(mean - count), with
  // `counts` [E] the routed tokens summed over DP x CP.
  void update_expert_bias(const float* counts);
  // Quantile balancing, once per global batch (Megatron's _update_router_qb_beta): the mean of
  // this rank's estimates, which the caller averages over DP x CP into `dp_mean`; then qb_beta =
  // ema * qb_beta + (1 - ema) * dp_mean, recentred to mean 0, and the estimates restart.
  std::vector<float> qb_local_mean() const;
  void update_qb_beta(const float* dp_mean);
  // The end of a global batch: the global aux loss's counts restart.
  void reset_global_aux_loss();

 private:
  // The steps of forward, in Megatron's TopKRouter order.
  Tensor gating(Routing& r, std::uint64_t rank, const RouterReplay* replay);
  void apply_z_loss(Routing& r, const float* logits, double scale) const;
  void quantile_select(Routing& r, const float* logits, bool update);
  void score_and_select(Routing& r, const float* logits) const;
  void apply_capacity(Routing& r) const;
  void count_tokens(Routing& r, bool counted);
  void apply_aux_losses(Routing& r, const float* logits, std::int64_t seq_length, double scale,
                        const RouterReplay* replay);

  MoESpec spec_;
  std::uint64_t calls_ = 0;  // force balancing draws new logits on every forward
};

}  // namespace epx
