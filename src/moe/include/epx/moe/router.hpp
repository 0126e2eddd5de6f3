// The top-k router (Megatron-Core's TopKRouter), all math in FP32: gating GEMM, score function
// (softmax before or after top-k, or sigmoid with an optional aux-loss-free expert bias),
// group-limited top-k, capacity with drop or drop-and-pad, and the load-balancing losses
// (aux_loss or seq_aux_loss, z-loss). As in Megatron, the losses are not added to the model's
// loss: their gradients are injected into the router's backward, scaled by aux_loss_scale.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "epx/moe/moe_spec.hpp"
#include "epx/tensor/param.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

// One micro-batch's routing: the result and what the backward needs.
struct Routing {
  std::int64_t num_tokens = 0;
  Tensor probs;                          // [T, E] F32, zero off the routing map
  std::vector<std::uint8_t> routing_map; // [T, E]
  std::vector<std::int64_t> tokens_per_expert;  // [E] after capacity
  std::int64_t dropped = 0;              // (token, expert) pairs removed by capacity
  double aux_loss = 0.0;                 // includes moe_aux_loss_coeff (what is differentiated)
  double z_loss = 0.0;                   // includes moe_z_loss_coeff
  std::uint64_t draw = 0;                // which random logits force load balancing drew

  // Saved for the backward.
  Tensor input;                          // [T, H] F32 router input
  Tensor scores;                         // [T, E] F32 softmax or sigmoid of the logits
  std::vector<std::int32_t> topk;        // [T, k] selected experts, before capacity
  Tensor aux_grad;                       // [T, E] F32 d(aux + z)/d(logits), already scaled
  Tensor dlogits;                        // [T, E] F32, set by backward_dgrad for wgrad
};

// Top-k distinct experts per token, uniformly at random, probability 1/k each (what force load
// balancing gives): routing for the dispatch benchmarks, without a router.
Routing random_topk_routing(std::int64_t tokens, std::int64_t experts, int k, std::uint64_t seed);

class Router {
 public:
  explicit Router(const MoESpec& spec);

  Param weight;        // mlp.router.weight [E, H]
  Tensor expert_bias;  // mlp.router.expert_bias [E] F32 (a buffer, not trained by gradients)
  Tensor local_tokens_per_expert;  // [E] F32, counted per training forward for the bias update

  // x [T, H] (any float dtype). seq_length is S of Megatron's [S, B] token order (seq_aux_loss).
  // `rank` (and the forward count) pick the random stream under force load balancing.
  // `replay_draw`: a recompute of an earlier forward (activation recompute) that drew this: the
  // same random logits, and the tokens are not counted again for the expert-bias update.
  Routing forward(const Tensor& x, std::int64_t seq_length, bool training, double aux_loss_scale = 1.0,
                  std::uint64_t rank = 0, std::optional<std::uint64_t> replay_draw = std::nullopt);
  // dprobs [T, E] F32: returns dx [T, H] in `dx_dtype`; keeps dlogits for wgrad.
  Tensor backward_dgrad(Routing& r, const Tensor& dprobs, DType dx_dtype) const;
  // weight.grad += dlogits^T x.
  void backward_wgrad(Routing& r);
  // Aux-loss-free balancing, once per global batch: bias += rate * sign(mean - count).
  void update_expert_bias();

 private:
  // The steps of forward, in Megatron's TopKRouter order.
  Tensor gating(Routing& r, std::uint64_t rank, std::optional<std::uint64_t> replay_draw);
  void apply_z_loss(Routing& r, const float* logits, double scale) const;
  void score_and_select(Routing& r, const float* logits) const;
  void apply_capacity(Routing& r) const;
  void count_tokens(Routing& r, bool for_bias);
  void apply_aux_loss(Routing& r, const float* logits, std::int64_t seq_length, double scale) const;

  MoESpec spec_;
  std::uint64_t calls_ = 0;  // force balancing draws new logits on every forward
};

}  // namespace epx
