// The attention rules: what Transformer Engine's DotProductAttention makes of a causal model's
// sliding window (check_set_window_size), what YaRN RoPE needs set, and what Megatron-Core's
// is_layer_window_attention needs of window_attn_skip_freq.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_attention_rules(RuleTable& add) {
  static const char* kWindowMessage = "window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=causal";
  add("model.window_size_causal", E, {"model.window_size"}, kTeAttention,
      "a causal model's window is (left, 0): an unbounded left side with a right one is refused",
      [](const CheckContext& c) {
        const auto& w = c.cfg.model.window_size;
        return fail_if(w && w->left < 0 && w->right > 0, kWindowMessage, "model.window_size=null");
      });
  add("model.window_size_right", W, {"model.window_size"}, kTeAttention,
      "TE sets a causal model's right window side to 0, with a warning",
      [](const CheckContext& c) {
        const auto& w = c.cfg.model.window_size;
        if (!w || w->right == 0 || (w->left < 0 && w->right > 0)) return pass();
        return fail(fmt::format("{} (TE warns and attends over ({}, 0))", kWindowMessage, w->left),
                    w->left < 0 ? "model.window_size=null" : fmt::format("model.window_size=[{},0]", w->left));
      });
  add("model.yarn_fields", E,
      {"model.position_embedding_type", "model.yarn_rotary_scaling_factor", "model.yarn_original_max_position_embeddings",
       "model.yarn_beta_fast", "model.yarn_beta_slow"},
      "Megatron-Core models/gpt/gpt_model.py, models/common/embeddings/yarn_rotary_pos_embedding.py",
      "YaRN RoPE computes with the scaling factor, the original context and both betas: each must be set",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.position_embedding_type != "yarn") return pass();
        // GPTModel passes each provider field as it is; Megatron-LM's own defaults are the fix.
        const std::vector<std::pair<std::string, bool>> fields = {
            {"model.yarn_rotary_scaling_factor=1.0", m.yarn_rotary_scaling_factor.has_value()},
            {"model.yarn_original_max_position_embeddings=4096", m.yarn_original_max_position_embeddings.has_value()},
            {"model.yarn_beta_fast=32.0", m.yarn_beta_fast.has_value()},
            {"model.yarn_beta_slow=1.0", m.yarn_beta_slow.has_value()}};
        std::vector<std::string> missing, fixes;
        for (const auto& [fix, set] : fields)
          if (!set) {
            missing.push_back(fix.substr(0, fix.find('=')));
            fixes.push_back(fix);
          }
        return fail_if(!missing.empty(),
                       fmt::format("{} None: YarnRotaryEmbedding computes with {} and raises a TypeError when the model "
                                   "is built",
                                   fmt::join(missing, ", "), missing.size() > 1 ? "them" : "it"),
                       fmt::format("{}", fmt::join(fixes, " ")));
      });
  add("model.window_pattern_length", E, {"model.window_attn_skip_freq", "model.window_size", "model.num_layers"},
      "Megatron-Core transformer/utils.py is_layer_window_attention",
      "a window_attn_skip_freq list has an entry for every layer (1: sliding window)", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.window_size || !m.window_attn_skip_freq) return pass();
        const auto& pattern = m.window_attn_skip_freq->pattern;
        const auto n = static_cast<Int>(pattern.size());
        if (n == 0 || n >= m.num_layers) return pass();
        // The fix keeps the pattern, padded with its last entry to one per layer.
        auto fixed = pattern;
        fixed.resize(static_cast<std::size_t>(std::clamp<Int>(m.num_layers, 1, 1 << 20)), fixed.back());
        return fail(fmt::format("IndexError: list index out of range (the list has {} entries; layer {} of {} reads "
                                "window_attn_skip_freq[{}])",
                                n, n + 1, m.num_layers, n),
                    fmt::format("model.window_attn_skip_freq=[{}]", fmt::join(fixed, ",")));
      });
}

}  // namespace epx::rule_helpers
