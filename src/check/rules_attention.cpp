// The attention rules: what Transformer Engine's DotProductAttention makes of a causal model's
// sliding window (check_set_window_size), what YaRN RoPE needs set and its concentration factor,
// which backend takes sinks or a window under context parallelism (and the TE that has sinks),
// a2a's heads over the CP ranks,
// cp_comm_type's per-layer list and a2a+p2p's hierarchical sizes, what Megatron-Core's
// is_layer_window_attention needs of window_attn_skip_freq, and MLA's own RoPE and its YaRN's fields.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "epx/config/yarn.hpp"
#include "rule_helpers.hpp"

namespace epx::rule_helpers {
namespace {

// The heads each TP rank gives Transformer Engine's core attention: its query heads, and its
// key/value heads (its query groups, one where Megatron replicates fewer groups than TP ranks;
// MLA's keys have one per query head).
struct CpHeads {
  Int q, kv;
};
CpHeads cp_heads(const ModelConfig& m) {
  const Int tp = std::max<Int>(1, m.tensor_model_parallel_size), q = m.num_attention_heads / tp;
  if (m.multi_latent_attention) return {q, q};
  const Int groups = m.num_query_groups.value_or(m.num_attention_heads);
  return {q, groups < tp ? 1 : groups / tp};
}

}  // namespace


void add_attention_rules(RuleTable& add) {
  static const char* kWindowMessage = "window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=causal";
  add("model.window_size_causal", E, {"model.window_size"}, kTeAttention,
      "a causal model's window is (left, 0): an unbounded left side with a right one is refused",
      [](const CheckContext& c) {
        const auto& w = c.cfg.model.window_size;
        return fail_if(w && w->left < 0 && w->right != 0 && w->right != -1, kWindowMessage, "model.window_size=null");
      });
  add("model.window_size_right", W, {"model.window_size"}, kTeAttention,
      "TE sets a causal model's right window side to 0, with a warning",
      [](const CheckContext& c) {
        const auto& w = c.cfg.model.window_size;
        if (!w || w->right == 0 || (w->left < 0 && w->right != -1)) return pass();
        return fail(fmt::format("{} (TE warns and attends over ({}, 0))", kWindowMessage, w->left),
                    w->left < 0 ? "model.window_size=null" : fmt::format("model.window_size=[{},0]", w->left));
      });
  add("model.yarn_fields", E,
      {"model.position_embedding_type", "model.yarn_rotary_scaling_factor", "model.yarn_original_max_position_embeddings",
       "model.yarn_beta_fast", "model.yarn_beta_slow", "model.rotary_base"},
      "Megatron-Core models/gpt/gpt_model.py, models/common/embeddings/yarn_rotary_pos_embedding.py",
      "YaRN RoPE computes with the scaling factor, the original context and both betas (set, positive) and the log of "
      "a base above 1",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.position_embedding_type != "yarn") return pass();
        // GPTModel passes each provider field as it is; Megatron-LM's own defaults are the fix.
        const std::vector<std::tuple<std::string, std::string, std::optional<double>>> fields = {
            {"model.yarn_rotary_scaling_factor", "1.0", m.yarn_rotary_scaling_factor},
            {"model.yarn_original_max_position_embeddings", "4096",
             m.yarn_original_max_position_embeddings
                 ? std::optional<double>(static_cast<double>(*m.yarn_original_max_position_embeddings))
                 : std::nullopt},
            {"model.yarn_beta_fast", "32.0", m.yarn_beta_fast},
            {"model.yarn_beta_slow", "1.0", m.yarn_beta_slow}};
        std::vector<std::string> missing, fixes;
        for (const auto& [field, fix, value] : fields)
          if (!value) {
            missing.push_back(field);
            fixes.push_back(field + "=" + fix);
          }
        if (!missing.empty())
          return fail(fmt::format("{} None: YarnRotaryEmbedding computes with {} and raises a TypeError when the model "
                                  "is built",
                                  fmt::join(missing, ", "), missing.size() > 1 ? "them" : "it"),
                      fmt::format("{}", fmt::join(fixes, " ")));
        for (const auto& [field, fix, value] : fields)
          if (!(*value > 0) || !std::isfinite(*value))
            return fail(fmt::format("{}={}: YaRN takes the logarithm of it or divides by it (a ValueError or "
                                    "ZeroDivisionError when the model is built)",
                                    field, *value),
                        field + "=" + fix);
        return fail_if(m.rotary_base.values.front() <= 1,
                       fmt::format("rotary_base={}: YaRN divides by log(base) when the model is built",
                                   m.rotary_base.values.front()),
                       "model.rotary_base=10000");
      });
  add("model.yarn_concentration", E,
      {"model.yarn_rotary_scaling_factor", "model.yarn_mscale", "model.yarn_mscale_all_dim",
       "model.position_embedding_type"},
      "Megatron-Core transformer/attention.py (Bridge's patched _yarn_get_concentration_factor_from_config)",
      "wherever yarn_rotary_scaling_factor is set, RoPE's cos and sin are multiplied by YaRN's concentration factor: "
      "it must be non-zero and within FP32's range",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.yarn_rotary_scaling_factor || (m.position_embedding_type != "rope" && m.position_embedding_type != "yarn"))
          return pass();
        const double conc = yarn_concentration(*m.yarn_rotary_scaling_factor, m.yarn_mscale, m.yarn_mscale_all_dim);
        return fail_if(!yarn_concentration_fits(conc),
                       fmt::format("YaRN's concentration factor is {:g} (yarn_mscale's over yarn_mscale_all_dim's): "
                                   "the rotary embedding's cos and sin are multiplied by it",
                                   conc),
                       "model.yarn_mscale=null");
      });
  add("model.sink_context_parallel", E,
      {"model.softmax_type", "model.context_parallel_size", "model.cp_comm_type"}, kTeAttention,
      "attention sinks under context parallelism run on FusedAttention with cp_comm_type a2a only",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.softmax_type == "vanilla" || m.context_parallel_size <= 1) return pass();
        // FlashAttention takes no sink, UnfusedDotProductAttention no CP, FusedAttention only a2a.
        const bool a2a = m.cp_comm_type && !m.cp_comm_type->values.empty() &&
                         std::all_of(m.cp_comm_type->values.begin(), m.cp_comm_type->values.end(),
                                     [](const std::string& t) { return t == "a2a"; });
        return fail_if(!a2a,
                       fmt::format("No dot product attention backend is available for the provided inputs. (softmax_type "
                                   "{} with context_parallel_size {} and cp_comm_type {}: FlashAttention takes no sink, "
                                   "UnfusedDotProductAttention no context parallelism, FusedAttention only a2a)",
                                   m.softmax_type, m.context_parallel_size,
                                   m.cp_comm_type ? fmt::format("{}", fmt::join(m.cp_comm_type->values, ",")) : "None (p2p)"),
                       "model.cp_comm_type=a2a");
      });
  add("model.cp_a2a_heads", E,
      {"model.cp_comm_type", "model.context_parallel_size", "model.hierarchical_context_parallel_sizes",
       "model.num_attention_heads", "model.num_query_groups", "model.tensor_model_parallel_size"},
      "Transformer Engine attention/dot_product_attention/context_parallel.py (AttnFuncWithCPAndQKVOA2A)",
      "cp_comm_type a2a scatters each TP rank's query and key/value heads over the CP ranks (a2a+p2p over its "
      "a2a level)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int cp = m.context_parallel_size;
        if (cp <= 1 || !m.cp_comm_type) return pass();
        const auto has = [&](const char* type) { return std::ranges::find(m.cp_comm_type->values, type) != m.cp_comm_type->values.end(); };
        const auto& sizes = m.hierarchical_context_parallel_sizes;
        Int ranks = 0;  // the ranks the heads are scattered over
        if (has("a2a")) ranks = cp;
        else if (has("a2a+p2p") && sizes && sizes->is_list && sizes->values.size() == 2) ranks = sizes->values[0];
        if (ranks <= 1) return pass();
        const CpHeads h = cp_heads(m);
        // p2p takes no window (model.window_context_parallel); allgather does.
        const bool window = m.window_size && m.window_size->left >= 0;
        const std::string fix = window ? "model.cp_comm_type=allgather" : "model.cp_comm_type=p2p";
        if (ranks == cp)
          return fail_if(h.q % cp != 0 || h.kv % cp != 0,
                         fmt::format("cp_comm_type='a2a' requires num_heads % cp_size == 0 for Q, K, V. Found "
                                     "num_heads_q = {}, num_heads_kv = {}, cp_size = {}.",
                                     h.q, h.kv, cp),
                         fix);
        return fail_if(h.q % ranks != 0 || h.kv % ranks != 0,
                       fmt::format("cp_comm_type='a2a+p2p' scatters the heads over its a2a level of {} ranks "
                                   "(hierarchical_context_parallel_sizes[0]): num_heads_q = {} and num_heads_kv = {} "
                                   "per TP rank must divide by it (TE's view of the heads raises otherwise)",
                                   ranks, h.q, h.kv),
                       fix);
      });
  add("model.window_context_parallel", E, {"model.window_size", "model.context_parallel_size", "model.cp_comm_type"},
      kTeAttention, "a sliding window under context parallelism needs cp_comm_type a2a or all_gather",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.window_size || m.window_size->left < 0 || m.context_parallel_size <= 1) return pass();
        // Megatron's allgather is TE's all_gather.
        const std::vector<std::string> types = m.cp_comm_type ? m.cp_comm_type->values : std::vector<std::string>{"p2p"};
        for (const std::string& t : types)
          if (t != "a2a" && t != "allgather")
            return fail(fmt::format("Context parallelism does not support sliding window attention with cp_comm_type='{}'!",
                                    t),
                        "model.cp_comm_type=a2a");
        return pass();
      });
  add("model.cp_comm_type_length", E, {"model.cp_comm_type", "model.context_parallel_size", "model.num_layers"}, kMcore,
      "a cp_comm_type list has one entry per layer", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.context_parallel_size <= 1 || !m.cp_comm_type || !m.cp_comm_type->is_list) return pass();
        const auto n = static_cast<Int>(m.cp_comm_type->values.size());
        return fail_if(n != m.num_layers,
                       fmt::format("Length of cp_comm_type ({}) should equal to the total number of transformer layers "
                                   "({})!",
                                   n, m.num_layers),
                       fmt::format("model.cp_comm_type={}", m.cp_comm_type->values.front()));
      });
  add("model.hierarchical_cp_sizes", E,
      {"model.cp_comm_type", "model.hierarchical_context_parallel_sizes", "model.context_parallel_size"},
      "Megatron-Bridge training/config.py _validate_cp_comm_type; Transformer Engine context_parallel.py",
      "a2a+p2p CP needs hierarchical_context_parallel_sizes, two levels (a2a inside, p2p across) whose product is "
      "context_parallel_size",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int cp = m.context_parallel_size;
        const auto& sizes = m.hierarchical_context_parallel_sizes;
        const bool a2a_p2p = m.cp_comm_type && std::ranges::any_of(m.cp_comm_type->values, [](const std::string& t) {
          return t.find("a2a+p2p") != std::string::npos;
        });
        // Two levels that work for this model: all of CP in the a2a level (TE then runs plain a2a)
        // where the heads divide by CP, else all of it in the p2p level.
        const CpHeads h = cp_heads(m);
        const std::string levels = fmt::format("model.hierarchical_context_parallel_sizes=[{}]",
                                               h.q % cp == 0 && h.kv % cp == 0 ? fmt::format("{},1", cp)
                                                                               : fmt::format("1,{}", cp));
        if (a2a_p2p && !sizes)
          return fail("hierarchical_context_parallel_sizes must be set when cp_comm_type contains 'a2a+p2p'. Without "
                      "it, CP communication is silently disabled and each rank attends only to its local chunk, "
                      "producing artificially high throughput but broken training.",
                      levels);
        if (!sizes) return pass();
        const std::string fix = a2a_p2p ? levels : "model.hierarchical_context_parallel_sizes=null";
        if (!sizes->is_list)  // Bridge's prod() of a bare int raises
          return fail(fmt::format("hierarchical_context_parallel_sizes must be a list of sizes, one per level; got the "
                                  "int {}",
                                  sizes->values.front()),
                      fix);
        if (std::ranges::any_of(sizes->values, [](Int s) { return s < 1; }))
          return fail(fmt::format("hierarchical_context_parallel_sizes [{}]: every level's size is a rank count, at "
                                  "least 1",
                                  fmt::join(sizes->values, ", ")),
                      fix);
        Int product = 1;
        bool overflow = false;
        for (const Int s : sizes->values) overflow = overflow || __builtin_mul_overflow(product, s, &product);
        if (overflow || product != cp)
          return fail(fmt::format("Product of hierarchical_context_parallel_sizes [{}] ({}) must equal "
                                  "context_parallel_size (={}).",
                                  fmt::join(sizes->values, ", "),
                                  overflow ? std::string("past int64's range") : fmt::format("={}", product), cp),
                      fix);
        return fail_if(a2a_p2p && cp > 1 && sizes->values.size() != 2,
                       "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]! "
                       "(Megatron builds one group per level of hierarchical_context_parallel_sizes)",
                       levels);
      });
  add("model.mla_position_embedding", E, {"model.multi_latent_attention", "model.position_embedding_type"},
      "Megatron-Bridge models/conversion/model_bridge.py; Megatron-Core multi_latent_attention.py",
      "MLA builds its own RoPE (rope_type); GPTModel's YaRN table would reach it, which it asserts against",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.multi_latent_attention && m.position_embedding_type == "yarn",
                       "position_embedding_type='yarn' is not a valid MLA config value (MLA's forward asserts "
                       "rotary_pos_emb is None); MLA's RoPE kind is rope_type",
                       "model.position_embedding_type=rope model.rope_type=yarn");
      });
  add("model.mla_yarn_fields", E,
      {"model.multi_latent_attention", "model.qk_pos_emb_head_dim", "model.rope_type", "model.rotary_scaling_factor",
       "model.original_max_position_embeddings", "model.beta_fast", "model.beta_slow", "model.mscale",
       "model.mscale_all_dim", "model.rotary_base"},
      "Megatron-Core transformer/multi_latent_attention.py, models/common/embeddings/yarn_rotary_pos_embedding.py",
      "MLA rotates qk_pos_emb_head_dim channels; its YaRN takes logarithms of a positive factor, original context and "
      "betas and of a base above 1, and its mscales must leave cos, sin and the logits' scale finite",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.multi_latent_attention) return pass();
        if (m.qk_pos_emb_head_dim < 1)  // an odd count is model.rope_even_head_dim's
          return fail(fmt::format("qk_pos_emb_head_dim={}: MLA's RoPE has no channels to rotate", m.qk_pos_emb_head_dim),
                      "model.qk_pos_emb_head_dim=64");
        if (m.rope_type != "yarn") return pass();
        const std::vector<std::tuple<std::string, double, std::string>> fields{
            {"model.rotary_scaling_factor", m.rotary_scaling_factor, "40.0"},
            {"model.original_max_position_embeddings", static_cast<double>(m.original_max_position_embeddings), "4096"},
            {"model.beta_fast", m.beta_fast, "32.0"},
            {"model.beta_slow", m.beta_slow, "1.0"}};
        for (const auto& [field, value, fix] : fields)
          if (!(value > 0) || !std::isfinite(value))
            return fail(fmt::format("{}={}: YaRN takes the logarithm of it or divides by it when the model is built",
                                    field, value),
                        field + "=" + fix);
        if (m.rotary_base.values.front() <= 1)
          return fail(fmt::format("rotary_base={}: YaRN divides by log(base) when the model is built",
                                  m.rotary_base.values.front()),
                      "model.rotary_base=10000");
        const double concentration = yarn_concentration(m.rotary_scaling_factor, m.mscale, m.mscale_all_dim);
        const double scale = mla_softmax_scale(m.rotary_scaling_factor, m.mscale_all_dim,
                                               static_cast<double>(m.qk_head_dim + m.qk_pos_emb_head_dim));
        return fail_if(!yarn_concentration_fits(concentration) || !(scale > 0) || scale > 3.4e38,
                       fmt::format("mscale={} and mscale_all_dim={} give YaRN's concentration factor {:g} (cos and "
                                   "sin are multiplied by it) and a softmax scale of {:g}: both must be non-zero and "
                                   "within FP32's range",
                                   m.mscale, m.mscale_all_dim, concentration, scale),
                       "model.mscale=1.0 model.mscale_all_dim=1.0");
      });
  add("model.sink_te_version", E, {"model.softmax_type", "target.te_version"}, "Megatron-Core extensions/transformer_engine.py",
      "attention sinks (softmax_type off-by-one or learnable) need Transformer Engine 2.8", [](const CheckContext& c) {
        if (c.cfg.model.softmax_type == "vanilla") return pass();
        return te_at_least(c, "2.8.0",
                           fmt::format("Transformer-Engine v{} must be >= 2.8.0 to support`softmax_type`.",
                                       c.cfg.target.te_version.value_or("?")));
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
