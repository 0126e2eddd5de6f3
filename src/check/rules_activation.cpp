// The MLP activation's rules: what Megatron-Core raises for activation_func with
// bias_activation_fusion, use_te_activation_func and a clamped SwiGLU, at construction
// (TransformerConfig) and at the first step (the MLPs' and grouped experts' fused kernels), and
// where a kernel computes other math than the config names, or a field is not read.
#include <cmath>

#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_activation_rules(RuleTable& add) {
  add("model.fused_activation", E,
      {"model.bias_activation_fusion", "model.activation_func", "model.gated_linear_unit", "model.add_bias_linear",
       "model.glu_linear_offset"},
      kMcore, "the fused bias-activation kernels cover GELU, SwiGLU and quick-GEGLU, each in the form it is written for",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.bias_activation_fusion) return pass();
        const std::string off = "model.bias_activation_fusion=false";
        if (!contains(StringList{"gelu", "silu", "quick_gelu"}, m.activation_func))
          return fail("When bias_activation_fusion is True, activation function should be either gelu, swiglu, or "
                      "quick_geglu",
                      off);
        if (m.activation_func == "gelu" && !m.gated_linear_unit && !m.add_bias_linear)
          return fail("When bias_activation_fusion is True, gated_linear_unit is False and activation function is "
                      "gelu, add_bias_linear must also be True.",
                      off);
        if (m.activation_func == "quick_gelu" && !m.gated_linear_unit)
          return fail("When bias_activation_fusion is True and activation function is quick_gelu, gated_linear_unit "
                      "must be True.",
                      "model.gated_linear_unit=true");
        if (m.glu_linear_offset != 0.0 && m.activation_func != "quick_gelu")
          return fail("When bias_activation_fusion is True and glu_linear_offset is non-zero, activation function "
                      "must be quick_gelu.",
                      off);
        return fail_if(m.use_te_activation_func,
                       "bias_activation_fusion and use_te_activation_func cannot be both true. If you use bias in "
                       "MLP FC1, we recommend setting bias_activation_fusion to True and use_te_activation_func to "
                       "False.",
                       "model.use_te_activation_func=false");
      });
  add("model.fused_activation_module", E,
      {"model.bias_activation_fusion", "model.activation_func", "model.gated_linear_unit", "model.num_moe_experts",
       "model.moe_layer_freq", "model.moe_shared_expert_intermediate_size"},
      "Megatron-Core transformer/moe/experts.py, transformer/mlp.py",
      "the experts fuse SwiGLU and quick-GEGLU only, the dense and shared MLPs GELU and SwiGLU only (raised at the "
      "first step)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        // TE's activation takes precedence; a fusion the config itself refuses is model.fused_activation's.
        if (!m.bias_activation_fusion || m.use_te_activation_func || !contains(StringList{"gelu", "silu", "quick_gelu"}, m.activation_func))
          return pass();
        const std::string off = "model.bias_activation_fusion=false";
        const bool experts = m.num_moe_experts.has_value();
        if (experts && !(m.gated_linear_unit && contains(StringList{"silu", "quick_gelu"}, m.activation_func)))
          return fail("Only support fusion of swiglu and quick_gelu in TEGroupedMLP.", off);
        return fail_if(has_dense_mlps(m) && (m.activation_func == "quick_gelu" || (m.activation_func == "silu" && !m.gated_linear_unit)),
                       "Only support fusion of gelu and swiglu", off);
      });
  add("model.fused_gelu_is_tanh", W,
      {"model.bias_activation_fusion", "model.activation_func", "model.gated_linear_unit", "model.add_bias_linear",
       "model.num_moe_experts", "model.moe_layer_freq", "model.moe_shared_expert_intermediate_size"},
      "Megatron-Core transformer/mlp.py, fusions/fused_bias_geglu.py, fusions/fused_bias_gelu.py",
      "a fused GEGLU or bias-GELU in the dense and shared MLPs is the tanh approximation of GELU, not the erf one "
      "the config names",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        // An ungated GELU without biases is refused by TransformerConfig first (model.fused_activation).
        return fail_if(m.bias_activation_fusion && !m.use_te_activation_func && m.activation_func == "gelu" &&
                           (m.gated_linear_unit || m.add_bias_linear) && has_dense_mlps(m),
                       fmt::format("with bias_activation_fusion the {} run {}, GELU's tanh "
                                   "approximation{}, while the unfused MLP computes torch's erf GELU; epx run "
                                   "refuses it, computing only the latter",
                                   // a shared expert has no biases, so bias_gelu_impl is the dense MLPs' alone
                                   m.gated_linear_unit ? "dense and shared MLPs" : "dense MLPs",
                                   m.gated_linear_unit ? "bias_geglu_impl" : "bias_gelu_impl",
                                   m.gated_linear_unit ? " (and no clamp or offset)" : ""),
                       "model.bias_activation_fusion=false");
      });
  add("model.te_activation", E, {"model.use_te_activation_func", "model.activation_func", "model.gated_linear_unit"},
      kMcore, "Transformer Engine's activation modules are GELU and SiLU (gated or not) as Megatron-Core picks them",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.use_te_activation_func) return pass();
        const std::string off = "model.use_te_activation_func=false";
        if (!contains(StringList{"gelu", "silu", "relu"}, m.activation_func))
          return fail("TransformerEngine only support gelu, geglu, silu, swiglu, relu, reglu. If you don't want to "
                      "use TransformerEngine activation function, set use_te_activation_func to False",
                      off);
        // extensions/transformer_engine.py's TEActivationOp tests silu twice: relu has no branch, so it raises at build.
        return fail_if(m.activation_func == "relu",
                       "Only SwiGLU, GEGLU, ReGLU, GELU, ReLU are supported by transformer engine. Please set "
                       "use_te_activation_func=False",
                       off);
      });
  add("model.te_activation_ungated", W, {"model.use_te_activation_func", "model.activation_func", "model.gated_linear_unit"},
      "Megatron-Core extensions/transformer_engine.py (TEActivationOp)",
      "Transformer Engine's op for an ungated GELU is the tanh approximation, and Megatron-Core picks ReLU for an "
      "ungated SiLU",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.use_te_activation_func || m.gated_linear_unit) return pass();
        if (m.activation_func == "gelu")
          return fail("TEActivationOp builds te.pytorch.ops.GELU, GELU's tanh approximation, where the config names "
                      "torch's erf GELU; epx run refuses it, computing only the latter",
                      "model.use_te_activation_func=false");
        // Its second `activation_func == F.silu` test was meant for ReLU (the gated branch has the same slip).
        return fail_if(m.activation_func == "silu",
                       "TEActivationOp builds te.pytorch.ops.ReLU for an ungated silu: the model trains with ReLU, "
                       "not the SiLU the config names; epx run refuses it, computing only the latter",
                       "model.use_te_activation_func=false");
      });
  add("model.glu_fields_ungated", W,
      {"model.gated_linear_unit", "model.activation_func_clamp_value", "model.glu_linear_offset"},
      "Megatron-Core transformer/mlp.py, transformer/moe/experts.py",
      "the clamp and the linear offset belong to a gated unit's linear half; an ungated MLP reads neither",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.gated_linear_unit) return pass();
        std::vector<std::string> unread, fixes;
        if (m.activation_func_clamp_value) {
          unread.push_back(fmt::format("activation_func_clamp_value={} (this MLP runs unclamped)", *m.activation_func_clamp_value));
          fixes.emplace_back("model.activation_func_clamp_value=null");
        }
        if (m.glu_linear_offset != 0.0) {
          unread.push_back(fmt::format("glu_linear_offset={} (it adds no offset)", m.glu_linear_offset));
          fixes.emplace_back("model.glu_linear_offset=0.0");
        }
        return fail_if(!unread.empty(),
                       fmt::format("{} {} read only by glu() (gated_linear_unit=True), and this MLP is ungated",
                                   fmt::join(unread, " and "), unread.size() > 1 ? "are" : "is"),
                       fmt::format("{}", fmt::join(fixes, " ")));
      });
  add("model.swiglu_clamp", E,
      {"model.activation_func_clamp_value", "model.activation_func", "model.gated_linear_unit", "model.num_moe_experts",
       "model.glu_linear_offset", "model.use_te_activation_func"},
      kMcore, "a clamped SwiGLU (DeepSeek-V4) has a positive finite bound, experts, no linear offset and no TE activation",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.activation_func_clamp_value || m.activation_func != "silu" || !m.gated_linear_unit) return pass();
        const double v = *m.activation_func_clamp_value;
        if (!std::isfinite(v) || v <= 0)
          return fail("activation_func_clamp_value for SwiGLU must be finite and greater than zero.",
                      "model.activation_func_clamp_value=null");
        if (!m.num_moe_experts)
          return fail("activation_func_clamp_value for SwiGLU is only supported with MoE.",
                      "model.activation_func_clamp_value=null");
        if (m.glu_linear_offset != 0.0)
          return fail("glu_linear_offset must be zero when activation_func_clamp_value is set for SwiGLU.",
                      "model.glu_linear_offset=0.0");
        return fail_if(m.use_te_activation_func,
                       "use_te_activation_func must be False when activation_func_clamp_value is not None for SwiGLU",
                       "model.use_te_activation_func=false");
      });
}

}  // namespace epx::rule_helpers
