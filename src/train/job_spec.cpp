#include "epx/train/job_spec.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/base/env.hpp"
#include "epx/base/to_lower.hpp"
#include "epx/check/group_limited_routing.hpp"
#include "epx/check/pipeline_split.hpp"
#include "epx/config/mixed_precision.hpp"
#include "epx/config/schema.hpp"
#include "epx/config/scheduler_steps.hpp"
#include "epx/config/yarn.hpp"
#include "epx/schedule/pipeline.hpp"

namespace epx {
namespace {

// "file:line:col: key=value: why" for a key read from a file, else "key=value: why".
[[noreturn]] void bad(const Config& c, const std::string& field, const std::string& value, const std::string& why) {
  throw ConfigError(fmt::format("{}={}: {}", c.cite(field), value, why));
}

std::string opt(const OptInt& v) { return v ? std::to_string(*v) : "None"; }

// Fields of a Bridge dump that epx keeps without modelling them but that change what the model
// computes (Bridge's MoE providers set them: GPT-OSS, MiniMax, Gemma4, Qwen3-Next, Qwen3.5, GLM,
// Nemotron), and dropout. Set off what epx computes (`fits`), epx's runtime would train another
// model than the config's, so it refuses them.
void refuse_unmodelled_math(const Config& c) {
  const YAML::Node fields = c.extra_fields.child_map("model");
  const auto none = [&](const YAML::Node& n) { return n.IsNull() || (n.IsScalar() && (n.Scalar() == "None" || n.Scalar() == "null")); };
  const auto text = [&](const YAML::Node& n) {
    if (n.IsMap() && n["_target_"].IsDefined() && n["_target_"].IsScalar()) return n["_target_"].Scalar();
    if (none(n)) return std::string("None");
    return n.IsScalar() ? n.Scalar() : YAML::Dump(n);
  };
  const auto is_false = [&](const YAML::Node& n) { return none(n) || (n.IsScalar() && to_lower(n.Scalar()) == "false"); };
  const auto zero_probability = [&](const YAML::Node& n) {
    double v = 1;
    return !none(n) && n.IsScalar() && YAML::convert<double>::decode(n, v) && v == 0.0;
  };
  const std::vector<std::tuple<const char*, std::function<bool(const YAML::Node&)>, const char*>> table = {
      {"attention_output_gate", is_false, "epx's attention has no output gate"},
      {"experimental_attention_variant", none, "epx's layers are softmax attention only"},
      {"moe_latent_size", none, "epx dispatches tokens at the hidden width (no latent projection)"},
      {"moe_apply_probs_on_input", is_false, "epx applies the routing probability after the activation, not to fc1's input"},
      {"rotary_interleaved", is_false, "epx's RoPE rotates halves, not interleaved pairs"},
      {"qk_l2_norm", is_false, "epx's QK-norm is an RMSNorm, not an L2 norm"},
      {"mtp_hsm", is_false, "epx's MTP depths take the previous depth's output unmixed"},
      // Megatron's default is 0.1; Bridge's providers set 0.0, as MoE pretraining runs without it.
      {"hidden_dropout", zero_probability, "epx trains without dropout, and Megatron's dropout takes a probability "
                                           "(None fails torch's dropout); set it to 0.0"},
      {"attention_dropout", zero_probability, "epx trains without dropout, and Megatron's dropout takes a probability "
                                              "(None fails its attention's dropout); set it to 0.0"},
  };
  for (const auto& [field, fits, why] : table) {
    const YAML::Node n = fields[field];
    if (!n.IsDefined() || fits(n)) continue;
    throw ConfigError(fmt::format("{}={}: {}; epx's runtime would train another model than this config's. epx check "
                                  "and epx plan take the config; epx run and epx layer do not model this field yet",
                                  c.cite(fmt::format("model.{}", field)), text(n), why));
  }
}

// The MLPs' activation (activation_func, gated_linear_unit, a gated unit's clamp and linear
// half's offset), as the experts, the shared expert and the dense MLPs compute it.
MlpActivation mlp_activation_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  MlpActivation a;
  const std::optional<ActivationFn> fn = activation_fn_from_name(m.activation_func);
  if (!fn) throw std::logic_error("activation_func " + m.activation_func + " passed the schema but has no kernel");
  a.fn = *fn;
  a.gated = m.gated_linear_unit;
  if (!a.gated && m.use_te_activation_func)
    bad(c, "model.use_te_activation_func", "true",
        fmt::format("Megatron-Core's TEActivationOp {} for an ungated {}; set model.use_te_activation_func=false",
                    a.fn == ActivationFn::gelu   ? "[model.te_activation_ungated] runs GELU's tanh approximation"
                    : a.fn == ActivationFn::silu ? "[model.te_activation_ungated] runs ReLU"
                                                 : "[model.te_activation] has no op",
                    m.activation_func));
  if (m.bias_activation_fusion && !m.use_te_activation_func && a.fn == ActivationFn::gelu && has_dense_mlps(m))
    bad(c, "model.bias_activation_fusion", "true",
        fmt::format("[model.fused_gelu_is_tanh] the {} fused {} is GELU's tanh approximation, the experts' and "
                    "epx's GELU the erf one; set model.bias_activation_fusion=false, or "
                    "model.activation_func=fast_gelu with it false for the tanh GELU everywhere",
                    a.gated ? "dense and shared MLPs'" : "dense MLPs'", a.gated ? "GEGLU" : "bias-GELU"));
  if (!a.gated) return a;  // Megatron reads the clamp and the offset only in its glu() (model.glu_fields_ungated)
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  if (const OptDouble& clamp = m.activation_func_clamp_value) {
    if (!(*clamp > 0) || *clamp > kFloatMax)
      bad(c, "model.activation_func_clamp_value", fmt::format("{}", *clamp),
          "the clamp bounds the linear half to [-c, c], so it must be a positive FP32 number; set one, or null");
    a.clamp = static_cast<float>(*clamp);
  }
  if (std::abs(m.glu_linear_offset) > kFloatMax)
    bad(c, "model.glu_linear_offset", fmt::format("{}", m.glu_linear_offset), "must be an FP32 number");
  a.linear_offset = static_cast<float>(m.glu_linear_offset);
  // Megatron's other activation kernels compute other math than its unfused glu(), which epx does.
  if (m.use_te_activation_func && (a.fn != ActivationFn::silu || a.clamp || a.linear_offset != 0))
    bad(c, "model.use_te_activation_func", "true",
        fmt::format("Transformer Engine's activation ops compute {} (and drop any clamp or offset), not Megatron's "
                    "unfused glu() epx computes; set model.use_te_activation_func=false",
                    a.fn == ActivationFn::gelu ? "GELU's tanh approximation" : "SwiGLU or GELU only"));
  return a;
}

// YarnRotaryEmbedding's arguments, as GPTModel reads them from the config: the four that its
// math needs must be set (model.yarn_fields); null mscales take the factor's own concentration.
YarnSpec yarn_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  YarnSpec y;
  const auto positive = [&](const char* field, const auto& v, auto& into) {
    if (!v)
      bad(c, field, "None",
          "[model.yarn_fields] YarnRotaryEmbedding computes with it (a TypeError in Megatron); set it (GPT-OSS: "
          "yarn_rotary_scaling_factor 32, yarn_original_max_position_embeddings 4096, yarn_beta_fast 32, "
          "yarn_beta_slow 1)");
    if (!(*v > 0) || !std::isfinite(static_cast<double>(*v)))
      bad(c, field, fmt::format("{}", *v),
          "[model.yarn_fields] YaRN takes the logarithm of it and divides by it; set a positive number");
    into = static_cast<double>(*v);
  };
  positive("model.yarn_rotary_scaling_factor", m.yarn_rotary_scaling_factor, y.factor);
  positive("model.yarn_original_max_position_embeddings", m.yarn_original_max_position_embeddings, y.original_max_positions);
  positive("model.yarn_beta_fast", m.yarn_beta_fast, y.beta_fast);
  positive("model.yarn_beta_slow", m.yarn_beta_slow, y.beta_slow);
  y.round_to_int = m.yarn_correction_range_round_to_int.value_or(false);  // None is falsy in Megatron's `if`
  if (m.rotary_base.values.front() <= 1)
    bad(c, "model.rotary_base", field_text(c, "model.rotary_base"),
        "[model.yarn_fields] YaRN divides by log(base); set a base above 1");
  return y;
}

// The fields both the MoE layer and the model read: width, sequence, micro-batch, precision.
void check_shared_fields(const Config& c) {
  refuse_unmodelled_math(c);
  const ModelConfig& m = c.model;
  if (m.hidden_size < 1) bad(c, "model.hidden_size", std::to_string(m.hidden_size), "must be positive: epx run builds the model (0 is a parallelism-only config); set the model's width");
  if (m.seq_length < 1) bad(c, "model.seq_length", std::to_string(m.seq_length), "must be positive");
  if (c.train.micro_batch_size.value_or(1) < 1)
    bad(c, "train.micro_batch_size", std::to_string(*c.train.micro_batch_size), "must be positive");
  // Bridge's mixed_precision, when set, decided the precision fields: the refusal names it.
  const OptString group = mixed_precision_source(c);
  const std::string by = group ? fmt::format(" (set by {})", *group) : "";
  const std::string bf16 = group && group->starts_with("-c") ? "-c bf16" : "mixed_precision=bf16_mixed";
  if (const OptString fp4 = mixed_precision_fp4(c))
    throw ConfigError(fmt::format("{}: trains in FP4 ({}); epx computes in BF16 or FP32, with no FP4 GEMMs; set {}",
                                  *group, *fp4, bf16));
  if (m.fp16)
    bad(c, "model.fp16", "true" + by,
        fmt::format("epx computes in BF16 or FP32; set {}", group ? bf16 : "model.bf16=true instead"));
  if (m.fp8)
    bad(c, "model.fp8", *m.fp8 + by,
        fmt::format("epx computes in BF16 or FP32, with no FP8 GEMMs; set {}",
                    group ? bf16 : "model.fp8=null"));
}

void check_attention_parallelism(const ModelConfig& m) {
  if (m.tensor_model_parallel_size != 1 || m.context_parallel_size != 1)
    throw ConfigError(fmt::format(
        "model.tensor_model_parallel_size={}, model.context_parallel_size={}: epx splits attention "
        "by data parallelism only; set both to 1 (expert_tensor_parallel_size still splits the experts)",
        m.tensor_model_parallel_size, m.context_parallel_size));
}

}  // namespace

ParallelLayout parallel_layout_from_config(const Config& c, int world) {
  const ModelConfig& m = c.model;
  check_attention_parallelism(m);
  return ParallelLayout::make(world, 1, 1, static_cast<int>(m.pipeline_model_parallel_size),
                              static_cast<int>(m.expert_model_parallel_size),
                              static_cast<int>(effective_etp(m)));
}

void check_layer_parallelism(const Config& c) {
  if (c.model.pipeline_model_parallel_size != 1)
    bad(c, "model.pipeline_model_parallel_size", std::to_string(c.model.pipeline_model_parallel_size),
        "one MoE layer has no pipeline stages; set it to 1 (epx run trains with PP)");
  check_attention_parallelism(c.model);
}

ParallelLayout layer_layout_from_config(const Config& c, int world) {
  check_layer_parallelism(c);
  return parallel_layout_from_config(c, world);
}

namespace {

// The MoE layer's spec once the shared fields are checked and the MLPs' activation is read (the
// model reads both for its dense MLPs too, once).
MoESpec moe_spec_of(const Config& c, const MlpActivation& activation) {
  const ModelConfig& m = c.model;
  MoESpec s;
  if (!m.num_moe_experts || *m.num_moe_experts < 1)
    bad(c, "model.num_moe_experts", m.num_moe_experts ? std::to_string(*m.num_moe_experts) : "None",
        "an MoE layer needs experts; set model.num_moe_experts to 1 or more");
  s.num_experts = *m.num_moe_experts;
  for (const std::string& key : c.none_moe_fields)
    bad(c, key, "None", "[moe.field_is_none] an MoE layer needs it; set it");
  s.hidden = m.hidden_size;
  s.activation = activation;
  s.topk = static_cast<int>(m.moe_router_topk);
  if (s.topk < 1 || s.topk > s.num_experts)
    bad(c, "model.moe_router_topk", std::to_string(s.topk),
        fmt::format("[moe.topk_range] must be between 1 and num_moe_experts ({})", s.num_experts));
  const auto ffn = m.moe_ffn_hidden_size ? m.moe_ffn_hidden_size : m.ffn_hidden_size;
  if (!ffn || *ffn < 1)
    bad(c, "model.moe_ffn_hidden_size", ffn ? std::to_string(*ffn) : "None",
        "set the experts' FFN width (model.moe_ffn_hidden_size)");
  s.ffn = *ffn;
  s.shared_ffn = m.moe_shared_expert_intermediate_size.value_or(0);
  s.bias = m.add_bias_linear;
  if (s.bias && effective_etp(m) != 1)
    bad(c, "model.expert_tensor_parallel_size", std::to_string(effective_etp(m)),
        "[moe.bias_needs_etp1] Bias in Moe is only supported when ETP==1; set model.expert_tensor_parallel_size=1 "
        "or model.add_bias_linear=false");
  if (s.bias && s.shared_ffn > 0)
    bad(c, "model.moe_shared_expert_intermediate_size", std::to_string(s.shared_ffn),
        "[moe.shared_expert_bias] bias is not supported in the shared experts; set model.add_bias_linear=false or "
        "model.moe_shared_expert_intermediate_size=null");
  if (s.bias && m.bias_dropout_fusion)
    bad(c, "model.bias_dropout_fusion", "true",
        "[moe.bias_dropout_fusion] bias_dropout_fusion is not supported in TEGroupedMLP when add_bias_linear=True; set "
        "model.bias_dropout_fusion=false");
  s.shared_expert_overlap = m.moe_shared_expert_overlap && s.shared_ffn > 0;
  s.shared_expert_gate = m.moe_shared_expert_gate && s.shared_ffn > 0;  // Megatron gates only a shared expert
  s.experts_wgrad_under_dispatch_backward = m.overlap_dispatch_backward_with_experts_wgrad;
  if (s.shared_ffn < 0)
    bad(c, "model.moe_shared_expert_intermediate_size", std::to_string(s.shared_ffn), "must be positive or None");
  s.dtype = m.bf16 ? DType::BF16 : DType::F32;

  s.score_function = m.moe_router_score_function;
  if (s.score_function != "softmax" && s.score_function != "sigmoid")
    bad(c, "model.moe_router_score_function", s.score_function, "epx supports softmax and sigmoid");
  if (m.moe_router_dtype == std::optional<std::string>("fp64"))
    bad(c, "model.moe_router_dtype", "fp64",
        "epx routes in FP32 (the router's GEMM, scores and top-k, as moe_router_dtype=fp32); set it to fp32 or null");
  s.pre_softmax = m.moe_router_pre_softmax;
  s.topk_scaling_factor = m.moe_router_topk_scaling_factor.value_or(1.0);
  // Megatron routes group-limited only when moe_router_group_topk is set; groups alone do nothing.
  s.group_topk = static_cast<int>(m.moe_router_group_topk.value_or(0));
  s.num_groups = s.group_topk > 0 ? static_cast<int>(m.moe_router_num_groups.value_or(0)) : 0;
  if (s.group_topk > 0) {
    if (s.num_groups < 1)
      bad(c, "model.moe_router_num_groups", "None",
          "[moe.group_limited_routing] group-limited routing (moe_router_group_topk) needs the groups");
    if (s.num_experts % s.num_groups != 0)
      bad(c, "model.moe_router_num_groups", std::to_string(s.num_groups),
          fmt::format("must divide num_moe_experts ({})", s.num_experts));
    if (s.group_topk > s.num_groups || s.group_topk > s.topk ||
        !group_limited_routes(s.num_experts, s.num_groups, s.group_topk, s.topk))
      bad(c, "model.moe_router_group_topk", std::to_string(s.group_topk),
          "[moe.group_limited_routing] must be between 1 and moe_router_num_groups and at most moe_router_topk, with "
          "topk // group_topk experts in a group and topk in the kept groups (epx ranks each group by the sum of its "
          "best topk // group_topk scores, as Megatron's group_limited_topk)");
  }
  s.expert_bias = m.moe_router_enable_expert_bias;
  s.bias_update_rate = m.moe_router_bias_update_rate;
  // As Megatron's router reads them: a coefficient per aux loss, and sinkhorn or quantile
  // balancing only as the one type (inside a list they do nothing: moe.load_balancing_list_ignores).
  const auto& types = m.moe_router_load_balancing_type;
  const std::string types_text = field_text(c, "model.moe_router_load_balancing_type");
  if (types.is("sinkhorn"))
    bad(c, "model.moe_router_load_balancing_type", types_text,
        "epx has no Sinkhorn routing; it runs aux_loss, seq_aux_loss, global_aux_loss (any of them as a list), "
        "quantile_balancing and none");
  if (!aux_loss_coeffs_fit(m))
    bad(c, "model.moe_aux_loss_coeff", field_text(c, "model.moe_aux_loss_coeff"),
        fmt::format("[moe.aux_loss_coeff_list] give one coefficient per load-balancing type ({})", types_text));
  for (AuxLoss k : kAuxLosses) at(s.aux_loss_coeff, k) = aux_loss_coeff(m, aux_loss_type(k));
  s.quantile_balancing = types.is("quantile_balancing");
  s.quantile_balancing_ema = m.moe_router_quantile_balancing_ema;
  if (s.quantile_balancing) {
    if (s.group_topk > 0)
      bad(c, "model.moe_router_group_topk", std::to_string(s.group_topk),
          "[moe.quantile_balancing_router] Quantile balancing routing does not support group-limited routing.");
    if (s.topk >= s.num_experts)
      bad(c, "model.moe_router_topk", std::to_string(s.topk),
          fmt::format("[moe.quantile_balancing_router] quantile balancing compares each token's top-k with its (k+1)-th "
                      "expert, so topk must be below num_moe_experts ({})",
                      s.num_experts));
    if (m.moe_expert_capacity_factor)
      bad(c, "model.moe_expert_capacity_factor", fmt::format("{}", *m.moe_expert_capacity_factor),
          "[moe.capacity_settings] moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss "
          "or none load balancing");
  }
  s.z_loss_coeff = m.moe_z_loss_coeff.value_or(0.0);
  s.force_load_balancing = m.moe_router_force_load_balancing;

  s.capacity_factor = m.moe_expert_capacity_factor;
  if (s.capacity_factor && *s.capacity_factor <= 0)
    bad(c, "model.moe_expert_capacity_factor", fmt::format("{}", *s.capacity_factor),
        "must be positive, or None for dropless");
  s.pad_to_capacity = m.moe_pad_expert_input_to_capacity;
  if (s.pad_to_capacity && !s.capacity_factor)
    bad(c, "model.moe_pad_expert_input_to_capacity", "true",
        "padding to capacity needs model.moe_expert_capacity_factor");
  s.drop_policy = m.moe_token_drop_policy;
  if (s.drop_policy != "probs" && s.drop_policy != "position")
    bad(c, "model.moe_token_drop_policy", s.drop_policy, "must be probs or position");

  s.init_std = m.init_method_std;
  s.num_layers = static_cast<int>(std::max<Int>(1, m.num_layers));
  s.seed = static_cast<std::uint64_t>(c.rng.seed);
  s.seq_length = m.seq_length;
  s.micro_batch = c.train.micro_batch_size.value_or(1);
  if (const std::string uneven = quantile_balancing_uneven(s.tokens(), s.topk, s.num_experts);
      s.quantile_balancing && !uneven.empty())
    bad(c, "model.seq_length", std::to_string(s.seq_length),
        fmt::format("[moe.quantile_balancing_assignments] {} Set seq_length x micro_batch_size ({}) x top-{} to a multiple "
                    "of {}",
                    uneven, s.micro_batch, s.topk, s.num_experts));
  return s;
}

}  // namespace

MoESpec moe_spec_from_config(const Config& c) {
  check_shared_fields(c);
  return moe_spec_of(c, mlp_activation_from_config(c));
}

// Multi-latent attention as Megatron-Core's MLASelfAttention builds it from MLATransformerConfig:
// a key and value per head, head_dim = qk_head_dim + qk_pos_emb_head_dim, RoPE or YaRN on the
// latter, and the softmax scaled by mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(head_dim).
void mla_attention_from_config(const Config& c, AttentionSpec& a) {
  const ModelConfig& m = c.model;
  const auto positive = [&](const char* field, Int v) {
    if (v < 1) bad(c, field, std::to_string(v), "multi-latent attention needs it positive; set a positive size");
  };
  if (m.q_lora_rank) positive("model.q_lora_rank", *m.q_lora_rank);
  positive("model.kv_lora_rank", m.kv_lora_rank);
  positive("model.qk_head_dim", m.qk_head_dim);
  positive("model.v_head_dim", m.v_head_dim);
  if (m.qk_pos_emb_head_dim < 2 || m.qk_pos_emb_head_dim % 2 != 0)
    bad(c, "model.qk_pos_emb_head_dim", std::to_string(m.qk_pos_emb_head_dim),
        "[model.mla_yarn_fields] MLA rotates its RoPE channels in pairs; set an even number, at least 2 (DeepSeek-V3: 64)");
  if (m.position_embedding_type == "yarn")  // GPTModel's YaRN table would reach MLA, which asserts it gets none
    bad(c, "model.position_embedding_type", "yarn",
        "[model.mla_position_embedding] position_embedding_type='yarn' is not a valid MLA config value: MLA builds its "
        "own RoPE from rope_type; set model.position_embedding_type=rope and model.rope_type=yarn");
  if (m.qk_layernorm && !m.q_lora_rank)  // Megatron-Core since #4452: a fused RMSNorm on x before linear_q_proj
    bad(c, "model.qk_layernorm", "true",
        "with q_lora_rank None, Megatron-Core's MLA normalises the query's input through Transformer Engine's fused "
        "layernorm-linear, which epx does not model; set model.q_lora_rank, or model.qk_layernorm=false");
  if (m.rope_type == "rope" && m.rotary_percent != 1.0)  // YaRN's MLA table ignores rotary_percent
    bad(c, "model.rotary_percent", fmt::format("{}", m.rotary_percent),
        "epx's MLA rotates every qk_pos_emb_head_dim channel; set model.rotary_percent=1.0");
  a.mla = MlaSpec{m.q_lora_rank.value_or(0), m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim};
  a.groups = a.heads;
  a.head_dim = m.qk_head_dim + m.qk_pos_emb_head_dim;
  a.rope = true;  // MLA builds its own rotary embedding, from rope_type
  a.rope_dim = m.qk_pos_emb_head_dim;
  const auto factor_fits = [&](const char* field, double v) {
    if (!(v > 0) || !std::isfinite(v))
      bad(c, field, fmt::format("{}", v),
          "[model.mla_yarn_fields] YaRN takes the logarithm of it and divides by it; set a positive number");
  };
  if (m.rope_type == "yarn") {
    factor_fits("model.rotary_scaling_factor", m.rotary_scaling_factor);
    factor_fits("model.beta_fast", m.beta_fast);
    factor_fits("model.beta_slow", m.beta_slow);
    positive("model.original_max_position_embeddings", m.original_max_position_embeddings);
    if (m.rotary_base.values.front() <= 1)
      bad(c, "model.rotary_base", field_text(c, "model.rotary_base"), "YaRN divides by log(base); set a base above 1");
    a.yarn = YarnSpec{m.rotary_scaling_factor, static_cast<double>(m.original_max_position_embeddings), m.beta_fast,
                      m.beta_slow, true};  // MLA leaves correction_range_round_to_int at its True
    a.rope_concentration = yarn_concentration(m.rotary_scaling_factor, m.mscale, m.mscale_all_dim);
    if (!yarn_concentration_fits(a.rope_concentration))
      bad(c, "model.mscale", fmt::format("{}", m.mscale),
          fmt::format("YaRN's concentration factor is {:g} (mscale's over mscale_all_dim's): cos and sin are multiplied "
                      "by it; set mscales that give a non-zero factor within FP32's range",
                      a.rope_concentration));
  }
  const double scale = mla_softmax_scale(m.rotary_scaling_factor, m.mscale_all_dim, static_cast<double>(a.head_dim));
  if (!(scale > 0) || scale > std::numeric_limits<float>::max())
    bad(c, "model.mscale_all_dim", fmt::format("{}", m.mscale_all_dim),
        fmt::format("MLA scales the logits by mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(head_dim) = {:g}, "
                    "which must be a positive FP32 number",
                    scale));
  a.softmax_scale = static_cast<float>(scale);
}

ModelSpec model_spec_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  check_shared_fields(c);
  ModelSpec s;
  if (m.num_layers < 1) bad(c, "model.num_layers", std::to_string(m.num_layers), "must be at least 1");
  if (!m.vocab_size || *m.vocab_size < 2)
    bad(c, "model.vocab_size", opt(m.vocab_size), "must be at least 2: the mock data draw token ids below it, and the LM head's loss over one id is always 0; "
        "set model.vocab_size (e.g. 4096)");
  if (m.normalization != "RMSNorm")
    bad(c, "model.normalization", m.normalization, "epx's layers use RMSNorm; set model.normalization=RMSNorm");
  if (m.position_embedding_type != "rope" && m.position_embedding_type != "yarn" && m.position_embedding_type != "none")
    bad(c, "model.position_embedding_type", m.position_embedding_type,
        "epx implements rope, yarn and none; set model.position_embedding_type=rope");

  s.vocab = *m.vocab_size;
  s.padded_vocab = padded_vocab(s.vocab, m);
  s.hidden = m.hidden_size;
  s.activation = mlp_activation_from_config(c);
  s.num_layers = static_cast<int>(m.num_layers);
  s.dtype = m.bf16 ? DType::BF16 : DType::F32;
  s.eps = static_cast<float>(m.layernorm_epsilon);
  s.zero_centered_gamma = m.layernorm_zero_centered_gamma;
  s.init_std = m.init_method_std;
  s.seed = static_cast<std::uint64_t>(c.rng.seed);
  s.tie_embeddings = m.share_embeddings_and_output_weights;
  s.seq_length = m.seq_length;
  s.micro_batch = c.train.micro_batch_size.value_or(1);

  AttentionSpec& a = s.attention;
  a.hidden = s.hidden;
  a.heads = m.num_attention_heads;
  if (a.heads < 1) bad(c, "model.num_attention_heads", std::to_string(a.heads), "must be positive: epx run builds the model (0 is a parallelism-only config); set the model's head count");
  a.groups = m.num_query_groups.value_or(a.heads);
  if (a.groups < 1 || a.heads % a.groups != 0)
    bad(c, "model.num_query_groups", std::to_string(a.groups),
        fmt::format("must divide num_attention_heads ({})", a.heads));
  if (m.multi_latent_attention) {
    mla_attention_from_config(c, a);
  } else {
    a.head_dim = m.kv_channels.value_or(s.hidden / a.heads);
    if (a.head_dim < 1) bad(c, "model.kv_channels", opt(m.kv_channels), "must be positive");
    a.rope = m.position_embedding_type == "rope" || m.position_embedding_type == "yarn";
    // Megatron's RotaryEmbedding: dim int(kv_channels * rotary_percent) where the share is below 1; it
    // rotates 2 ceil(dim / 2) channels. YarnRotaryEmbedding rotates kv_channels, whatever the share.
    a.rope_dim = m.rotary_percent < 1 && m.position_embedding_type == "rope"
                     ? static_cast<std::int64_t>(static_cast<double>(a.head_dim) * m.rotary_percent)
                     : a.head_dim;
    if (m.position_embedding_type == "yarn") a.yarn = yarn_from_config(c);
    // Megatron's attention (with Bridge's patch) scales cos and sin by YaRN's concentration wherever
    // yarn_rotary_scaling_factor is set, plain RoPE included.
    if (m.yarn_rotary_scaling_factor && a.rope) {
      a.rope_concentration = yarn_concentration(*m.yarn_rotary_scaling_factor, m.yarn_mscale, m.yarn_mscale_all_dim);
      if (!yarn_concentration_fits(a.rope_concentration))
        bad(c, "model.yarn_mscale", m.yarn_mscale ? fmt::format("{}", *m.yarn_mscale) : "None",
            fmt::format("[model.yarn_concentration] YaRN's concentration factor is {:g} (yarn_mscale's over "
                        "yarn_mscale_all_dim's, {}): cos and sin are multiplied by it; set mscales that give a "
                        "non-zero factor within FP32's range",
                        a.rope_concentration, field_text(c, "model.yarn_mscale_all_dim")));
    }
    // int(kv_channels * rotary_percent) below 1: Megatron's RotaryEmbedding has no frequencies and
    // rotates nothing.
    if (a.rope_dim < 1) a.rope = false;
    if (a.rope && (a.rope_dim + 1) / 2 * 2 > a.head_dim)
      bad(c, "model.kv_channels",
          m.kv_channels ? std::to_string(a.head_dim) : fmt::format("None ({} / {} heads)", s.hidden, a.heads),
          fmt::format("[model.rope_even_head_dim] rotary embeddings rotate pairs of channels, and the head's {} is odd; "
                      "set model.kv_channels={}",
                      a.head_dim, a.head_dim + 1));
  }
  if (m.rotary_base.values.size() != 1)
    bad(c, "model.rotary_base", field_text(c, "model.rotary_base"),
        "epx applies one RoPE base to every layer (the local and global layers' pair is not modelled); give one base");
  a.rope_base = m.rotary_base.values.front();
  a.qk_norm = m.qk_layernorm;
  // Megatron's linear_qkv: bias=add_bias_linear or add_qkv_bias; MLA's projections have none.
  a.qkv_bias = !m.multi_latent_attention && (m.add_bias_linear || m.add_qkv_bias);
  a.proj_bias = m.add_bias_linear;
  s.bias = m.add_bias_linear;
  a.eps = s.eps;
  a.zero_centered_gamma = s.zero_centered_gamma;
  if (m.softmax_scale && !m.multi_latent_attention) {  // MLA's scale is its own (mla_attention_from_config)
    if (!(*m.softmax_scale > 0) || *m.softmax_scale > std::numeric_limits<float>::max())
      bad(c, "model.softmax_scale", fmt::format("{}", *m.softmax_scale),
          "epx's blocked attention scales the logits by a positive FP32 number; set one, or null for "
          "1/sqrt(kv_channels)");
    a.softmax_scale = static_cast<float>(*m.softmax_scale);
  }
  a.softmax = m.softmax_type == "learnable"    ? AttentionSoftmax::learnable
              : m.softmax_type == "off-by-one" ? AttentionSoftmax::off_by_one
                                               : AttentionSoftmax::vanilla;
  // TE's causal attention takes (left, 0), makes (-1, -1) and (left >= 0, right) (left, 0), and
  // refuses the rest (model.window_size_causal).
  if (m.window_size && m.window_size->left < 0 && m.window_size->right != 0 && m.window_size->right != -1)
    bad(c, "model.window_size", fmt::format("[{}, {}]", m.window_size->left, m.window_size->right),
        "[model.window_size_causal] window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=causal");
  if (const OptInt window = sliding_window(m)) {
    a.window = *window;
    const std::optional<LayerFreq>& skip = m.window_attn_skip_freq;  // None: every layer
    if (skip && !skip->pattern.empty() && static_cast<Int>(skip->pattern.size()) < m.num_layers)
      bad(c, "model.window_attn_skip_freq", field_text(c, "model.window_attn_skip_freq"),
          fmt::format("[model.window_pattern_length] the pattern has {} entries for {} layers (Megatron raises an "
                      "IndexError at layer {}); give one 0/1 per layer (1: sliding window)",
                      skip->pattern.size(), m.num_layers, skip->pattern.size() + 1));
    for (int i = 0; i < s.num_layers; ++i) s.is_window.push_back(!skip || skip->is_window(i));
  }
  a.dtype = s.dtype;

  // moe_layer_freq: layer i is MoE when i % every == 0, or as the explicit pattern says.
  const bool any_experts = m.num_moe_experts && *m.num_moe_experts > 0;
  if (!m.moe_layer_freq.pattern.empty() &&
      static_cast<int>(m.moe_layer_freq.pattern.size()) != s.num_layers)
    bad(c, "model.moe_layer_freq", fmt::format("[{}]", fmt::join(m.moe_layer_freq.pattern, ", ")),
        fmt::format("[moe.layer_pattern_length] the pattern has {} entries for {} layers; give one 0/1 per layer", m.moe_layer_freq.pattern.size(), s.num_layers));
  for (int i = 0; i < s.num_layers; ++i) s.is_moe.push_back(any_experts && m.moe_layer_freq.is_moe(i));
  if (s.num_moe_layers() > 0) {
    s.moe = moe_spec_of(c, s.activation);
  }
  if (s.num_moe_layers() < s.num_layers) {
    if (!m.ffn_hidden_size || *m.ffn_hidden_size < 1)
      bad(c, "model.ffn_hidden_size", opt(m.ffn_hidden_size), "the dense MLP layers need a width; set model.ffn_hidden_size");
    s.ffn = *m.ffn_hidden_size;
  }

  // Recompute.
  RecomputeSpec& r = s.recompute;
  if (m.recompute_granularity == "selective") {
    for (const std::string& mod : m.recompute_modules.value_or(StringList{"core_attn"})) {
      if (mod == "layernorm") r.layernorm = true;
      else if (mod == "core_attn") r.core_attn = true;
      else if (mod == "moe_act") r.moe_act = true;
      else if (mod == "mlp") r.mlp = true;
      else if (mod == "shared_experts") r.shared_experts = true;
      else if (mod == "moe") r.moe = true;
      else if (mod == "mla_up_proj" && s.attention.mla) r.mla_up_proj = true;
      else if (mod == "mla_up_proj")
        bad(c, "model.recompute_modules", mod,
            "mla_up_proj in recompute_modules is only supported with multi_latent_attention (Megatron's "
            "TransformerConfig); remove it from the list or set model.multi_latent_attention=true");
      else
        bad(c, "model.recompute_modules", mod,
            "epx recomputes layernorm, core_attn, moe_act, mlp, shared_experts, mla_up_proj and moe; remove it "
            "from the list");
    }
  } else if (m.recompute_granularity == "full") {
    if (!m.recompute_method || (*m.recompute_method != "uniform" && *m.recompute_method != "block"))
      bad(c, "model.recompute_method", m.recompute_method.value_or("None"),
          "full recompute needs a method; set model.recompute_method=uniform or block");
    if (!m.recompute_num_layers || *m.recompute_num_layers < (*m.recompute_method == "block" ? 0 : 1))
      bad(c, "model.recompute_num_layers", opt(m.recompute_num_layers),
          "full recompute needs the number of layers per checkpoint (uniform, 1 or more) or recomputed (block, 0 or "
          "more)");
    r.method = *m.recompute_method;
    r.num_layers = static_cast<int>(*m.recompute_num_layers);
  } else if (m.recompute_granularity) {
    bad(c, "model.recompute_granularity", *m.recompute_granularity, "must be full, selective or None");
  }

  // Multi-token prediction: layers built as the decoder's last, after it.
  if (m.mtp_num_layers && *m.mtp_num_layers > 0) {
    s.mtp_layers = static_cast<int>(*m.mtp_num_layers);
    if (m.window_size)
      bad(c, "model.mtp_num_layers", std::to_string(s.mtp_layers),
          "epx does not model which MTP layers take the sliding window; set model.mtp_num_layers=null or "
          "model.window_size=null");
    s.mtp_loss_scale = m.mtp_loss_scaling_factor / s.mtp_layers;
    s.mtp_repeated = m.mtp_use_repeated_layer;
    s.mtp_detached = m.mtp_detach_heads;
    s.is_moe.insert(s.is_moe.end(), static_cast<std::size_t>(s.mtp_layers), s.is_moe.back());
  }
  return s;
}

DispatcherOptions dispatcher_options_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  DispatcherOptions o;
  if (m.moe_token_dispatcher_type == "alltoall") {
    o.type = DispatcherType::alltoall;
  } else if (m.moe_token_dispatcher_type == "flex") {
    o.type = DispatcherType::flex;
  } else {
    bad(c, "model.moe_token_dispatcher_type", m.moe_token_dispatcher_type,
        "epx runs expert parallelism with the alltoall and flex dispatchers only; set "
        "model.moe_token_dispatcher_type=alltoall or flex");
  }
  if (o.type != DispatcherType::flex) return o;
  FlexOptions& f = o.flex;
  const std::string backend = m.moe_flex_dispatcher_backend.value_or("deepep");
  if (backend == "deepep") {
    f.backend = FlexBackend::deepep;
  } else if (backend == "hybridep") {
    f.backend = FlexBackend::hybridep;
  } else {
    throw EnvironmentError(fmt::format(
        "model.moe_flex_dispatcher_backend={}: this epx build has no {} backend (it has deepep "
        "and hybridep); set model.moe_flex_dispatcher_backend=deepep or hybridep, or "
        "model.moe_token_dispatcher_type=alltoall",
        backend, backend));
  }
  if (const OptInt& sms = m.moe_flex_dispatcher_num_sms) {
    if (*sms < 1) bad(c, "model.moe_flex_dispatcher_num_sms", std::to_string(*sms), "expected a positive number (default 20)");
    f.num_sms = static_cast<int>(*sms);
  }
  f.ranks_per_domain = static_cast<int>(read_env(env::kHybridEpRanksPerDomain, &c.env_vars));
  f.tokens_per_chunk = static_cast<int>(read_env(env::kHybridEpTokensPerChunk, &c.env_vars));
  return o;
}

PipelineSpec pipeline_spec_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  const int pp = static_cast<int>(m.pipeline_model_parallel_size);
  if (pp == 1 && m.virtual_pipeline_model_parallel_size)
    bad(c, "model.virtual_pipeline_model_parallel_size", opt(m.virtual_pipeline_model_parallel_size),
        "[parallel.vpp_needs_pp] the interleaved schedule needs pipeline_model_parallel_size > 1; set it to null");
  const PipelineSplit split = pipeline_split(m);
  if (pp == 1 && split.chunks > 1)
    bad(c, "model.pipeline_model_parallel_layout", *m.pipeline_model_parallel_layout,
        "[parallel.vpp_needs_pp] its stages make model chunks for the interleaved schedule, which needs "
        "pipeline_model_parallel_size > 1; give one stage or set pipeline_model_parallel_size");
  if (split.embedding_stage != 0 || split.loss_stage != split.virtual_stages() - 1)
    bad(c, "model.pipeline_model_parallel_layout", *m.pipeline_model_parallel_layout,
        "epx builds the embedding on the first model chunk of the first stage and the loss on the last chunk of the "
        "last stage; move E into the layout's first stage and L into its last");
  PipelineSpec p = PipelineSpec::from_layer_counts(pp, split.chunks, split.interleaved, split.layers);
  p.group = static_cast<int>(m.microbatch_group_size_per_vp_stage.value_or(0));
  if (m.mtp_num_layers.value_or(0) > 0) p.mtp_stage = split.mtp_stage;
  // A standalone MTP stage keeps a copy of the embedding, which Megatron never syncs beside the
  // first stage's own (epx keeps one embedding per stage).
  if (split.mtp_beside_first_chunk())
    bad(c, "model.pipeline_model_parallel_layout", *m.pipeline_model_parallel_layout,
        fmt::format("[pipeline.mtp_first_rank_chunk] its MTP layers sit in model chunk {} of the first pipeline "
                    "stage, whose first chunk holds the embedding, where Megatron-Core never syncs the MTP chunk's "
                    "copy of it; put the m in another stage's last chunk or just before the layout's L",
                    split.mtp_stage / split.stages));
  // Bridge asserts this before Megatron-Core takes a VPP from the layout, so the VPP as given.
  if (pp > 1 && c.model.overlap_moe_expert_parallel_comm && !m.virtual_pipeline_model_parallel_size)
    bad(c, "model.virtual_pipeline_model_parallel_size", "None",
        "[ep_overlap.pp_needs_vpp] If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be "
        "specified when pipeline_model_parallel_size > 1; set it (e.g. 2)");
  return p;
}

ScheduleOptions schedule_options_from_config(const Config& c) {
  return {c.model.overlap_moe_expert_parallel_comm, c.model.delay_wgrad_compute};
}

LrSchedule lr_schedule_from_config(const Config& c) {
  LrSchedule s;
  if (!c.optimizer.lr || *c.optimizer.lr < 0)
    bad(c, "optimizer.lr", c.optimizer.lr ? fmt::format("{}", *c.optimizer.lr) : "None",
        "training needs a learning rate; set optimizer.lr (e.g. 3e-4)");
  s.max_lr = *c.optimizer.lr;
  s.min_lr = c.optimizer.min_lr.value_or(0.0);
  if (s.min_lr > s.max_lr)
    bad(c, "optimizer.min_lr", fmt::format("{}", s.min_lr), fmt::format("above optimizer.lr={}; set it lower", s.max_lr));
  s.warmup_init = c.scheduler.lr_warmup_init;
  s.samples_per_step = c.train.global_batch_size.value_or(1);
  s.style = c.scheduler.lr_decay_style;
  if (s.style != "constant" && s.style != "linear" && s.style != "cosine")
    bad(c, "scheduler.lr_decay_style", s.style, "epx implements constant, linear and cosine; set one of them");
  // Bridge's steps, capped (check rule scheduler.warmup_capped warns of the cap).
  const std::optional<SchedulerSteps> steps = scheduler_steps(c);
  if (!steps || steps->decay < 1)
    throw ConfigError("scheduler: the decay needs the run's length (train.train_iters or train.train_samples, "
                      "scheduler.lr_decay_iters / lr_decay_samples) and train.global_batch_size, at least 1 sample");
  s.warmup_samples = steps->warmup;
  s.decay_samples = steps->decay;
  return s;
}

GradReduceOptions grad_reduce_options_from_config(const Config& c, int dp) {
  GradReduceOptions o;
  o.overlap = c.ddp.overlap_grad_reduce;
  o.distributed = c.ddp.use_distributed_optimizer;  // finalize keeps ddp and optimizer in step
  // Megatron's overlap_param_gather needs the distributed optimizer; Bridge's comm_overlap
  // defaults it on with DP > 1 whatever the optimizer, so without one it has nothing to gather.
  o.overlap_param_gather = o.distributed && c.ddp.overlap_param_gather;
  o.reduce_dtype = c.model.bf16 && !c.ddp.grad_reduce_in_fp32 ? DType::BF16 : DType::F32;
  if (c.ddp.bucket_size && *c.ddp.bucket_size < 1)
    bad(c, "ddp.bucket_size", opt(c.ddp.bucket_size), "set a positive number of elements per gradient bucket, or null");
  o.bucket_size = c.ddp.bucket_size.value_or(o.overlap ? std::max<std::int64_t>(40'000'000, 1'000'000LL * dp) : 0);
  o.embedding_rows = c.ddp.reduce_embedding_rows;
  if (o.embedding_rows && !o.overlap)
    bad(c, "ddp.reduce_embedding_rows", "true",
        "[ddp.embedding_rows] it splits the overlapped reduction of the embedding's gradient; set "
        "ddp.overlap_grad_reduce=true, or set it false");
  if (o.embedding_rows && c.model.share_embeddings_and_output_weights && c.model.pipeline_model_parallel_size == 1)
    bad(c, "ddp.reduce_embedding_rows", "true",
        "[ddp.embedding_rows] with model.share_embeddings_and_output_weights=true on one pipeline stage the "
        "embedding's gradient also holds the LM head's, which is not a set of token rows; set it false");
  return o;
}

JobSpec JobSpec::from_config(const Config& c, int world) {
  if (c.target.num_gpus != world)
    throw ConfigError(fmt::format("target.num_gpus={}: the job has {} ranks; launch {} ranks or set -ng {}",
                                  c.target.num_gpus.value_or(0), world, c.target.num_gpus.value_or(0), world));
  JobSpec j{.layout = parallel_layout_from_config(c, world), .model = model_spec_from_config(c), .pipeline = {}, .dispatcher = {},
            .schedule = schedule_options_from_config(c), .grad_reduce = {}, .lr = {}};
  if (j.model.num_moe_layers() > 0) j.dispatcher = dispatcher_options_from_config(c);
  j.iterations = train_iterations(c).value_or(0);
  if (j.iterations > (1 << 24))  // train_iters is capped so; train_samples over a small batch may not be
    bad(c, "train.train_samples", opt(c.train.train_samples),
        fmt::format("{} iterations of global batch {}: at most {}", j.iterations, c.train.global_batch_size.value_or(0), 1 << 24));
  if (j.iterations < 1)
    bad(c, c.train.train_samples ? "train.train_samples" : "train.train_iters",
        opt(c.train.train_samples ? c.train.train_samples : c.train.train_iters),
        "set the number of iterations (or --max_steps), or samples for at least one global batch");
  const std::int64_t gbs = c.train.global_batch_size.value_or(0), mbs = j.model.micro_batch, dp = j.layout.dp;
  if (gbs < 1 || gbs % (mbs * dp) != 0)
    throw ConfigError(fmt::format(
        "train.global_batch_size={}: must be a positive multiple of micro_batch_size x data-parallel size "
        "= {} x {} = {} (each DP rank runs an equal number of micro-batches); set it to {}",
        gbs, mbs, dp, mbs * dp, std::max<std::int64_t>(1, gbs / (mbs * dp)) * mbs * dp));
  j.global_batch = gbs;
  j.micro_batches = gbs / (mbs * dp);
  const YAML::Node nan_check = c.extra_sections.child_map("rerun_state_machine")["check_for_nan_in_loss"];
  if (nan_check.IsDefined() && nan_check.IsScalar()) {
    const std::string v = to_lower(nan_check.Scalar());
    if (v != "true" && v != "false")
      bad(c, "rerun_state_machine.check_for_nan_in_loss", nan_check.Scalar(), "expected true or false");
    j.check_for_nan_in_loss = v == "true";
  }
  j.pipeline = pipeline_spec_from_config(c);
  if (const auto why = j.pipeline.interleaved ? interleaved_micro_batch_error(j.pipeline.stages, j.pipeline.micro_batch_group(),
                                                                              j.micro_batches)
                                             : std::nullopt)
    throw ConfigError(j.pipeline.micro_batch_group() < j.pipeline.stages
                          ? fmt::format("model.microbatch_group_size_per_vp_stage={}: {}; set it to {} or more",
                                        j.pipeline.micro_batch_group(), *why, j.pipeline.stages)
                          : fmt::format("train.global_batch_size={}: {}; set it to a multiple of {}", gbs, *why,
                                        mbs * dp * j.pipeline.micro_batch_group()));
  if (j.schedule.ep_overlap && j.model.recompute.moe)
    bad(c, "model.recompute_modules", "[..., moe]",
        "[ep_overlap.recompute_moe] disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm "
        "(the EP-overlap schedule runs the MoE layer's phases one by one)");
  if (j.schedule.ep_overlap && j.model.recompute.method.size())
    bad(c, "model.recompute_granularity", "full",
        "[ep_overlap.full_recompute] the EP-overlap schedule runs the layers node by node and cannot replay "
        "checkpointed layers; use selective recompute or set comm_overlap.overlap_moe_expert_parallel_comm=false");
  if (c.optimizer.optimizer != "adam")
    bad(c, "optimizer.optimizer", c.optimizer.optimizer, "epx's runtime implements adam; set optimizer.optimizer=adam");
  // TE's FusedAdam with every state in FP32 is epx's Adam (the BF16 weight and its 16 remainder
  // bits are the FP32 master); lower-precision state is not.
  const OptimizerConfig& o = c.optimizer;
  if (o.use_precision_aware_optimizer)
    for (const auto& [key, dtype] : {std::pair{"optimizer.main_params_dtype", &o.main_params_dtype},
                                     std::pair{"optimizer.main_grads_dtype", &o.main_grads_dtype},
                                     std::pair{"optimizer.exp_avg_dtype", &o.exp_avg_dtype},
                                     std::pair{"optimizer.exp_avg_sq_dtype", &o.exp_avg_sq_dtype}})
      if (*dtype != "fp32")
        bad(c, key, *dtype,
            c.set_on_command_line("optimizer.use_precision_aware_optimizer") &&
                    c.explicit_keys.at("optimizer.use_precision_aware_optimizer") == Config::Origin::flag
                ? "epx's Adam keeps FP32 masters and FP32 m and v (TE's FusedAdam in FP32, which -c bf16 turns on with "
                  "Adam, as run_script.py); set it to fp32"
                : "epx's Adam keeps FP32 masters and FP32 m and v (TE's FusedAdam in FP32); set it to fp32, or "
                  "optimizer.use_precision_aware_optimizer=false");
  j.lr = lr_schedule_from_config(c);
  j.grad_reduce = grad_reduce_options_from_config(c, j.layout.dp);
  return j;
}

}  // namespace epx
