// The shape and options of one MoE layer (Megatron-Core's TransformerConfig fields): everything
// the router, experts and layer need. Built from the config by train/job_spec.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "epx/tensor/tensor.hpp"

namespace epx {

struct MoESpec {
  std::int64_t hidden = 0;
  std::int64_t num_experts = 0;
  int topk = 2;
  std::int64_t ffn = 0;         // moe_ffn_hidden_size
  std::int64_t shared_ffn = 0;  // moe_shared_expert_intermediate_size; 0 = no shared expert
  // moe_shared_expert_overlap: the shared expert's forward runs while the dispatch is in flight,
  // its dgrad while the combine-backward is (otherwise both run with the router, Megatron's order).
  bool shared_expert_overlap = false;
  // overlap_dispatch_backward_with_experts_wgrad: the routed experts' wgrad runs while the
  // dispatch's backward exchange is in flight (Megatron's delayed-wgrad stream), not after it.
  bool experts_wgrad_under_dispatch_backward = false;
  DType dtype = DType::F32;     // activations and compute weights: BF16 when model.bf16

  // Router (math in FP32).
  std::string score_function = "softmax";  // softmax | sigmoid
  bool pre_softmax = false;
  double topk_scaling_factor = 1.0;
  int num_groups = 0;   // group-limited routing: groups of experts (0 = off)
  int group_topk = 0;   // groups kept per token
  bool expert_bias = false;
  double bias_update_rate = 1e-3;
  std::string load_balancing = "aux_loss";  // aux_loss | seq_aux_loss | none
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  bool force_load_balancing = false;

  // Capacity (unset = dropless).
  std::optional<double> capacity_factor;
  bool pad_to_capacity = false;
  std::string drop_policy = "probs";  // probs | position

  // Initialisation, as Megatron: N(0, std) and N(0, std / sqrt(2 * num_layers)) for fc2.
  double init_std = 0.02;
  int num_layers = 1;
  std::uint64_t seed = 1234;

  // Tokens per micro-batch: seq_length x micro_batch_size, in Megatron's [S, B] order.
  std::int64_t seq_length = 0;
  std::int64_t micro_batch = 1;
  std::int64_t tokens() const { return seq_length * micro_batch; }
  // Tokens kept per expert with a capacity factor: ceil(T * k / E * cf), at most T.
  std::int64_t capacity(std::int64_t num_tokens) const;
};

}  // namespace epx
