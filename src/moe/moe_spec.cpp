#include "epx/moe_spec.hpp"

#include <cmath>

#include <fmt/format.h>

namespace epx {
namespace {

[[noreturn]] void bad(const std::string& field, const std::string& value, const std::string& why) {
  throw ConfigError(fmt::format("{}={}: {}", field, value, why));
}

}  // namespace

std::int64_t MoESpec::capacity(std::int64_t num_tokens) const {
  if (!capacity_factor) return num_tokens;
  const double cap = std::ceil(static_cast<double>(num_tokens) * topk /
                               static_cast<double>(num_experts) * *capacity_factor);
  return std::min<std::int64_t>(num_tokens, static_cast<std::int64_t>(cap));
}

MoESpec moe_spec_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  MoESpec s;
  if (!m.num_moe_experts || *m.num_moe_experts < 1)
    bad("model.num_moe_experts", m.num_moe_experts ? std::to_string(*m.num_moe_experts) : "None",
        "an MoE layer needs experts; set model.num_moe_experts to 1 or more");
  s.num_experts = *m.num_moe_experts;
  if (m.hidden_size < 1) bad("model.hidden_size", std::to_string(m.hidden_size), "must be positive");
  s.hidden = m.hidden_size;
  s.topk = static_cast<int>(m.moe_router_topk);
  if (s.topk < 1 || s.topk > s.num_experts)
    bad("model.moe_router_topk", std::to_string(s.topk),
        fmt::format("must be between 1 and num_moe_experts ({})", s.num_experts));
  const auto ffn = m.moe_ffn_hidden_size ? m.moe_ffn_hidden_size : m.ffn_hidden_size;
  if (!ffn || *ffn < 1)
    bad("model.moe_ffn_hidden_size", ffn ? std::to_string(*ffn) : "None",
        "set the experts' FFN width (model.moe_ffn_hidden_size)");
  s.ffn = *ffn;
  s.shared_ffn = m.moe_shared_expert_intermediate_size.value_or(0);
  s.shared_expert_overlap = m.moe_shared_expert_overlap && s.shared_ffn > 0;
  if (s.shared_ffn < 0)
    bad("model.moe_shared_expert_intermediate_size", std::to_string(s.shared_ffn), "must be positive or None");
  if (m.fp16) bad("model.fp16", "true", "epx computes in BF16 or FP32; set model.bf16=true instead");
  s.dtype = m.bf16 ? DType::BF16 : DType::F32;

  s.score_function = m.moe_router_score_function;
  if (s.score_function != "softmax" && s.score_function != "sigmoid")
    bad("model.moe_router_score_function", s.score_function, "epx supports softmax and sigmoid");
  s.pre_softmax = m.moe_router_pre_softmax;
  s.topk_scaling_factor = m.moe_router_topk_scaling_factor.value_or(1.0);
  s.num_groups = static_cast<int>(m.moe_router_num_groups.value_or(0));
  s.group_topk = static_cast<int>(m.moe_router_group_topk.value_or(0));
  if (s.num_groups > 0) {
    if (s.num_experts % s.num_groups != 0)
      bad("model.moe_router_num_groups", std::to_string(s.num_groups),
          fmt::format("must divide num_moe_experts ({})", s.num_experts));
    if (s.group_topk < 1 || s.group_topk > s.num_groups || s.topk % s.group_topk != 0 ||
        s.topk / s.group_topk > s.num_experts / s.num_groups)
      bad("model.moe_router_group_topk", std::to_string(s.group_topk),
          "must be between 1 and moe_router_num_groups, divide moe_router_topk, and leave "
          "topk/group_topk experts per group");
  }
  s.expert_bias = m.moe_router_enable_expert_bias;
  s.bias_update_rate = m.moe_router_bias_update_rate;
  s.load_balancing = m.moe_router_load_balancing_type;
  if (s.load_balancing != "aux_loss" && s.load_balancing != "seq_aux_loss" && s.load_balancing != "none")
    bad("model.moe_router_load_balancing_type", s.load_balancing,
        "epx supports aux_loss, seq_aux_loss and none (global_aux_loss and sinkhorn are not "
        "implemented)");
  s.aux_loss_coeff = m.moe_aux_loss_coeff;
  s.z_loss_coeff = m.moe_z_loss_coeff.value_or(0.0);
  s.force_load_balancing = m.moe_router_force_load_balancing;

  s.capacity_factor = m.moe_expert_capacity_factor;
  if (s.capacity_factor && *s.capacity_factor <= 0)
    bad("model.moe_expert_capacity_factor", fmt::format("{}", *s.capacity_factor),
        "must be positive, or None for dropless");
  s.pad_to_capacity = m.moe_pad_expert_input_to_capacity;
  if (s.pad_to_capacity && !s.capacity_factor)
    bad("model.moe_pad_expert_input_to_capacity", "true",
        "padding to capacity needs model.moe_expert_capacity_factor");
  s.drop_policy = m.moe_token_drop_policy;
  if (s.drop_policy != "probs" && s.drop_policy != "position")
    bad("model.moe_token_drop_policy", s.drop_policy, "must be probs or position");

  s.init_std = m.init_method_std;
  s.num_layers = static_cast<int>(std::max<Int>(1, m.num_layers));
  s.seed = static_cast<std::uint64_t>(c.rng.seed);
  s.seq_length = m.seq_length;
  s.micro_batch = c.train.micro_batch_size.value_or(1);
  if (s.seq_length < 1) bad("model.seq_length", std::to_string(s.seq_length), "must be positive");
  if (s.micro_batch < 1)
    bad("train.micro_batch_size", std::to_string(s.micro_batch), "must be positive");
  return s;
}

}  // namespace epx
