// The MLP activation's rules: what Megatron-Core's TransformerConfig raises at construction for
// activation_func with bias_activation_fusion, use_te_activation_func and a clamped SwiGLU.
#include <cmath>

#include "rule_helpers.hpp"

namespace epx::rule_helpers {
namespace {

bool one_of(const std::string& v, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (v == n) return true;
  return false;
}

}  // namespace

void add_activation_rules(RuleTable& add) {
  add("model.fused_activation", E,
      {"model.bias_activation_fusion", "model.activation_func", "model.gated_linear_unit", "model.add_bias_linear",
       "model.glu_linear_offset"},
      kMcore, "the fused bias-activation kernels cover GELU, SwiGLU and quick-GEGLU, each in the form it is written for",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.bias_activation_fusion) return pass();
        const std::string off = "model.bias_activation_fusion=false";
        if (!one_of(m.activation_func, {"gelu", "silu", "quick_gelu"}))
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
  add("model.te_activation", E, {"model.use_te_activation_func", "model.activation_func"}, kMcore,
      "Transformer Engine's activation modules are GELU, SiLU and ReLU (gated or not)", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.use_te_activation_func && !one_of(m.activation_func, {"gelu", "silu", "relu"}),
                       "TransformerEngine only support gelu, geglu, silu, swiglu, relu, reglu. If you don't want to "
                       "use TransformerEngine activation function, set use_te_activation_func to False",
                       "model.use_te_activation_func=false");
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
