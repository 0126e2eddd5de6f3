// The shape and options of one MoE layer (Megatron-Core's TransformerConfig fields): everything
// the router, experts and layer need. Built from the config by train/job_spec.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "epx/kernels/mlp_activation.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

// Megatron's load-balancing losses, in the order its training log names them.
enum class AuxLoss { aux_loss, seq_aux_loss, global_aux_loss };
inline constexpr std::array<AuxLoss, 3> kAuxLosses = {AuxLoss::aux_loss, AuxLoss::seq_aux_loss, AuxLoss::global_aux_loss};
using AuxLossValues = std::array<double, kAuxLosses.size()>;  // one per AuxLoss
inline double& at(AuxLossValues& v, AuxLoss k) { return v[static_cast<std::size_t>(k)]; }
inline double at(const AuxLossValues& v, AuxLoss k) { return v[static_cast<std::size_t>(k)]; }
// moe_router_load_balancing_type's name of one ("aux_loss") and the training log's
// ("load_balancing_loss").
const char* aux_loss_type(AuxLoss k);
const char* aux_loss_log_name(AuxLoss k);
// Megatron's refusal of quantile balancing where a micro-batch's assignments do not split evenly
// over the experts; empty where they do.
std::string quantile_balancing_uneven(std::int64_t tokens, int topk, std::int64_t experts);

struct MoESpec {
  std::int64_t hidden = 0;
  std::int64_t num_experts = 0;
  int topk = 2;
  std::int64_t ffn = 0;         // moe_ffn_hidden_size
  std::int64_t shared_ffn = 0;  // moe_shared_expert_intermediate_size; 0 = no shared expert
  // moe_shared_expert_overlap: the shared expert's forward runs while the dispatch is in flight,
  // its dgrad while the combine-backward is (otherwise both run with the router, Megatron's order).
  bool shared_expert_overlap = false;
  // moe_shared_expert_gate: the shared expert's output times sigmoid(x . w) per token, w
  // (mlp.shared_experts.gate_weight [1, H]) a weight of its own.
  bool shared_expert_gate = false;
  // overlap_dispatch_backward_with_experts_wgrad: the routed experts' wgrad runs while the
  // dispatch's backward exchange is in flight (Megatron's delayed-wgrad stream), not after it.
  bool experts_wgrad_under_dispatch_backward = false;
  DType dtype = DType::F32;     // activations and compute weights: BF16 when model.bf16
  MlpActivation activation;     // the experts' and shared expert's (activation_func, its clamp and offset)
  bool bias = false;            // add_bias_linear: the router's bias and the experts' fc1 and fc2 biases

  // Router (math in FP32).
  std::string score_function = "softmax";  // softmax | sigmoid
  bool pre_softmax = false;
  double topk_scaling_factor = 1.0;
  int num_groups = 0;   // group-limited routing: groups of experts (0 = off)
  int group_topk = 0;   // groups kept per token
  bool expert_bias = false;
  double bias_update_rate = 1e-3;
  // Load balancing: each aux loss's coefficient, as Megatron's get_aux_loss_coeff gives it (0: off;
  // a list of types turns on several), or quantile balancing (a per-expert bias on the logits,
  // updated once per global batch, with moe_router_quantile_balancing_ema).
  AuxLossValues aux_loss_coeff{};
  bool quantile_balancing = false;
  double quantile_balancing_ema = 0.0;
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
