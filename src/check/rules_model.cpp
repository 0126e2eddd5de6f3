// The model's rules: MoE routing and experts, precision, FP8 and recompute.
#include <fmt/ranges.h>

#include "epx/base/edit_distance.hpp"
#include "epx/base/to_lower.hpp"
#include "epx/check/group_limited_routing.hpp"
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_model_rules(RuleTable& add) {
  add("moe.not_moe", A, {"model.num_moe_experts"}, "epx",
      "a config without experts has nothing MoE-specific to check", [](const CheckContext& c) {
        return fail_if(!c.cfg.model.num_moe_experts || *c.cfg.model.num_moe_experts == 0,
                       "num_moe_experts is not set: this is a dense model, so the expert-parallel "
                       "and overlap rules do not apply",
                       "model.num_moe_experts=<experts per MoE layer>");
      });
  add("moe.ffn_without_experts", E, {"model.moe_ffn_hidden_size", "model.num_moe_experts", "model.moe_layer_freq"},
      kMcore, "an expert FFN size without experts, on a model that is not mixed dense/MoE", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(!m.num_moe_experts && m.moe_ffn_hidden_size && !m.moe_layer_freq.has_dense(),
                       "moe_ffn_hidden_size is set but num_moe_experts is None. Please set num_moe_experts or remove "
                       "moe_ffn_hidden_size.",
                       "model.moe_ffn_hidden_size=null");
      });
  add("moe.field_is_none", E, {"model.num_moe_experts", "model.moe_router_topk", "model.moe_token_dispatcher_type"},
      kMcore, "an MoE model sets its top-k and token dispatcher (a dense model's dump may leave them None)",
      [](const CheckContext& c) {
        if (!c.cfg.model.num_moe_experts || c.user.none_moe_fields.empty()) return pass();
        std::vector<std::string> fixes;
        for (const std::string& key : c.user.none_moe_fields)
          fixes.push_back(key == "model.moe_router_topk" ? "model.moe_router_topk=2" : "model.moe_token_dispatcher_type=alltoall");
        return fail(fmt::format("{} {} None in a model with {} experts: Megatron's MoE layer needs {}",
                                fmt::join(c.user.none_moe_fields, " and "), fixes.size() > 1 ? "are" : "is",
                                *c.cfg.model.num_moe_experts, fixes.size() > 1 ? "them" : "it"),
                    fmt::format("{}", fmt::join(fixes, " ")));
      });
  add("moe.router_dtype", W, {"model.num_moe_experts", "model.moe_router_dtype"}, kMcore,
      "32 or more experts route in FP32", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && *m.num_moe_experts >= 32 && !m.moe_router_dtype,
                       "Using a large number of experts (e.g. >=32) without fp32 routing. Consider enabling "
                       "moe_router_dtype for better numerical stability.",
                       "model.moe_router_dtype=fp32");
      });
  add("moe.router_dtype_torch", W, {"model.moe_router_dtype"}, "Megatron-Core moe/router.py",
      "moe_router_dtype names fp32 or fp64 (not a torch dtype), the two the router upcasts to", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const OptString& dtype = m.moe_router_dtype;
        if (!m.num_moe_experts || !dtype || *dtype == "fp32" || *dtype == "fp64") return pass();
        if (!dtype->starts_with("torch.")) {
          return fail(fmt::format("moe_router_dtype is {}: the router upcasts only for 'fp32' and 'fp64', so it routes "
                                  "in the activations' dtype, as null does{}",
                                  *dtype, *m.num_moe_experts >= 32 ? ", and the large-expert-count warning is silenced" : ""),
                      *m.num_moe_experts >= 32 ? "model.moe_router_dtype=fp32" : "model.moe_router_dtype=null");
        }
        const std::string name = *dtype == "torch.float64" ? "fp64" : "fp32";
        return fail(fmt::format("moe_router_dtype is {} (a torch dtype): the router compares it with '{}', so it "
                                "routes in the activations' dtype, and the large-expert-count warning is silenced",
                                *dtype, name),
                    "model.moe_router_dtype=" + name);
      });
  add("model.rope_even_head_dim", E,
      {"model.position_embedding_type", "model.kv_channels", "model.hidden_size", "model.num_attention_heads",
       "model.rotary_percent"},
      "Megatron-Core models/common/embeddings/rotary_pos_embedding.py",
      "rotary embeddings rotate pairs: an odd RoPE dim fits only below the head dimension", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const bool yarn = m.position_embedding_type == "yarn";
        // MLA rotates whatever position_embedding_type says.
        if ((m.position_embedding_type != "rope" && !yarn && !m.multi_latent_attention) || m.num_attention_heads < 1)
          return pass();
        // MLA rotates its own qk_pos_emb_head_dim channels; otherwise int(kv_channels * rotary_percent),
        // rounded up to pairs: an odd one fits below the head dimension, not at it. YaRN rotates
        // kv_channels whatever the share.
        const Int head_dim = m.multi_latent_attention ? m.qk_pos_emb_head_dim
                                                      : m.kv_channels.value_or(m.hidden_size / m.num_attention_heads);
        const double share = m.multi_latent_attention || yarn || m.rotary_percent >= 1 ? 1 : m.rotary_percent;
        const auto rotated = [&](Int dim) { return static_cast<Int>(static_cast<double>(dim) * share); };
        const auto fits = [&](Int dim) { return rotated(dim) % 2 == 0 || rotated(dim) < dim; };
        if (fits(head_dim)) return pass();
        Int fixed = head_dim + 1;  // the next head dimension whose rotated pairs fit
        while (!fits(fixed) && fixed < head_dim + 64) ++fixed;
        const std::string key = m.multi_latent_attention ? "qk_pos_emb_head_dim" : "kv_channels";
        const std::string of = m.multi_latent_attention || m.kv_channels
                                   ? key
                                   : fmt::format("hidden_size {} / num_attention_heads {}", m.hidden_size, m.num_attention_heads);
        return fail(fmt::format("the head dimension rotates {} channels ({}{}), an odd count: rotary embeddings rotate "
                                "pairs of channels, and {}",
                                rotated(head_dim), of, share != 1 ? fmt::format(" x rotary_percent {:g}", share) : "",
                                yarn ? "YarnRotaryEmbedding fails when the model is built (its ceil(d/2) frequencies "
                                       "and its ramp of d//2 differ in length)"
                                     : "the first step fails on the shapes"),
                    fmt::format("model.{}={}", key, fixed));
      });
  add("moe.topk_range", E, {"model.moe_router_topk", "model.num_moe_experts"}, kMcore,
      "1 <= top-k <= number of experts", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts) return pass();
        return fail_if(m.moe_router_topk < 1 || m.moe_router_topk > *m.num_moe_experts,
                       fmt::format("moe_router_topk ({}) must be between 1 and num_moe_experts "
                                   "({})",
                                   m.moe_router_topk, *m.num_moe_experts),
                       fmt::format("model.moe_router_topk={}",
                                   std::clamp<Int>(m.moe_router_topk, 1, *m.num_moe_experts)));
      });
  add("moe.topk1_needs_pre_softmax", E,
      {"model.moe_router_topk", "model.moe_router_score_function", "model.moe_router_pre_softmax",
       "model.moe_router_load_balancing_type"},
      kMcore, "top-1 softmax routing takes the softmax before the top-k (after it, the router gets no gradient)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.moe_router_topk == 1 && m.moe_router_score_function == "softmax" &&
                           !m.moe_router_pre_softmax && !m.moe_router_load_balancing_type.is("sinkhorn"),
                       "Please use --moe-router-pre-softmax when topk is 1.", "model.moe_router_pre_softmax=true");
      });
  add("moe.group_limited_routing", E,
      {"model.moe_router_group_topk", "model.moe_router_num_groups", "model.num_moe_experts", "model.moe_router_topk"},
      kMcore,
      "group-limited routing (moe_router_group_topk) has groups that split the experts, each with its topk // "
      "group_topk best, and the kept groups hold topk experts",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.moe_router_group_topk || *m.moe_router_group_topk == 0 || !m.num_moe_experts) return pass();
        // The fix: the fewest groups that split the experts and leave group_topk to keep.
        Int fewest = std::min(*m.moe_router_group_topk, *m.num_moe_experts);
        while (*m.num_moe_experts % fewest != 0) ++fewest;
        std::string fix = fmt::format("model.moe_router_num_groups={}", fewest);
        if (*m.moe_router_group_topk > fewest) fix += fmt::format(" model.moe_router_group_topk={}", fewest);
        if (!m.moe_router_num_groups || *m.moe_router_num_groups == 0)
          return fail("When using group limited routing, moe_router_num_groups must be specified.", fix);
        const Int groups = *m.moe_router_num_groups;
        if (*m.num_moe_experts % groups != 0)
          return fail(fmt::format("num_moe_experts ({}) should be divisible by moe_router_num_groups ({}).",
                                  *m.num_moe_experts, groups),
                      fix);
        const Int group_topk = *m.moe_router_group_topk, topk = m.moe_router_topk;
        if (group_topk > groups)
          return fail(fmt::format("moe_router_group_topk ({}) should be smaller than moe_router_num_groups ({}).",
                                  group_topk, groups),
                      fmt::format("model.moe_router_group_topk={}", groups));
        // More groups kept fix both ways group_limited_topk fails.
        const Int per_group = *m.num_moe_experts / groups;
        const auto fits = [&](Int kept) { return group_limited_routes(*m.num_moe_experts, groups, kept, topk); };
        if (fits(group_topk)) return pass();
        Int kept = group_topk;
        while (kept < groups && !fits(kept)) ++kept;
        return fail(fmt::format("moe_router_topk ({}) from moe_router_group_topk ({}) of moe_router_num_groups ({}) "
                                "groups of {} experts: group-limited routing ranks each group by its best topk // "
                                "group_topk = {} scores and picks the top-k among the kept groups' {} experts; {}",
                                topk, group_topk, groups, per_group, topk / group_topk, group_topk * per_group,
                                topk / group_topk > per_group ? "a group has fewer (torch's topk raises)"
                                                              : "they are fewer than top-k (it would route to masked "
                                                                "experts)"),
                    fmt::format("model.moe_router_group_topk={}", kept));
      });
  add("moe.group_topk_above_topk", W, {"model.moe_router_group_topk", "model.moe_router_topk", "model.num_moe_experts"},
      kMcore, "group-limited routing keeps no more groups than the top-k (each group's rank sums its best topk // group_topk)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts || !m.moe_router_group_topk || *m.moe_router_group_topk <= m.moe_router_topk) return pass();
        return fail(fmt::format("moe_router_group_topk ({}) above moe_router_topk ({}): group_limited_topk ranks each "
                                "group by the sum of its best topk // group_topk = 0 scores, so every group ties and "
                                "which groups are kept is arbitrary (epx run refuses it)",
                                *m.moe_router_group_topk, m.moe_router_topk),
                    fmt::format("model.moe_router_group_topk={}", m.moe_router_topk));
      });
  add("moe.expert_bias_score_function", E, {"model.moe_router_enable_expert_bias", "model.moe_router_score_function"},
      kMcore, "aux-loss-free expert bias needs a sigmoid (or sqrtsoftplus) router", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.moe_router_enable_expert_bias && m.moe_router_score_function != "sigmoid" &&
                           m.moe_router_score_function != "sqrtsoftplus",
                       "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score "
                       "functions. Please set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset "
                       "--moe-router-enable-expert-bias.",
                       "model.moe_router_score_function=sigmoid");
      });
  add("moe.capacity_settings", E,
      {"model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity",
       "model.moe_router_load_balancing_type"},
      kMcore,
      "padding to capacity needs a capacity factor; a capacity factor needs aux-loss balancing (not sinkhorn or "
      "quantile_balancing)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const auto& types = m.moe_router_load_balancing_type;
        const bool drops = std::any_of(types.values.begin(), types.values.end(), [](const std::string& t) {
          return t != "aux_loss" && t != "seq_aux_loss" && t != "global_aux_loss" && t != "none";
        });
        if (m.moe_expert_capacity_factor && drops)
          return fail("moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss or none "
                      "load balancing",
                      types.is_list ? "model.moe_expert_capacity_factor=null model.moe_pad_expert_input_to_capacity=false"
                                    : "model.moe_router_load_balancing_type=aux_loss");
        return fail_if(m.moe_pad_expert_input_to_capacity && !m.moe_expert_capacity_factor,
                       "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity",
                       "model.moe_expert_capacity_factor=1.0");
      });
  add("moe.aux_loss_coeff_list", E, {"model.moe_router_load_balancing_type", "model.moe_aux_loss_coeff"}, kMcore,
      "a list of load-balancing types has one aux-loss coefficient each; one type has one coefficient",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const auto& types = m.moe_router_load_balancing_type;
        const auto& coeffs = m.moe_aux_loss_coeff;
        if (aux_loss_coeffs_fit(m)) return pass();
        if (types.is_list) {
          std::vector<std::string> fixed;
          for (std::size_t i = 0; i < types.values.size(); ++i)
            fixed.push_back(fmt::format("{}", i < coeffs.values.size() ? coeffs.values[i] : coeffs.values.back()));
          return fail("moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type",
                      fmt::format("model.moe_aux_loss_coeff=[{}]", fmt::join(fixed, ",")));
        }
        return fail(fmt::format("moe_aux_loss_coeff is a list ({} values) but moe_router_load_balancing_type is one "
                                "type ({}): Megatron's router compares the list with 0 and stops with a TypeError",
                                coeffs.values.size(), types.values.front()),
                    fmt::format("model.moe_aux_loss_coeff={}", coeffs.values.front()));
      });
  add("moe.load_balancing_type_unknown", W, {"model.moe_router_load_balancing_type"}, kMcore,
      "a load-balancing type Megatron's router knows", [](const CheckContext& c) {
        static const std::vector<std::string> kKnown = {"aux_loss", "seq_aux_loss", "global_aux_loss",
                                                        "sinkhorn", "quantile_balancing", "none"};
        const auto& types = c.cfg.model.moe_router_load_balancing_type;
        for (const std::string& t : types.values) {
          if (contains(kKnown, t)) continue;
          // Bridge's tests write several types as one string: Megatron reads one unknown name.
          if (!types.is_list && t.find(',') != std::string::npos) {
            std::vector<std::string> names;
            for (std::size_t start = 0; start <= t.size();) {
              const std::size_t end = std::min(t.find(',', start), t.size());
              std::string name = t.substr(start, end - start);
              name.erase(0, name.find_first_not_of(" \t"));
              name.erase(name.find_last_not_of(" \t") + 1);
              if (!name.empty()) names.push_back(name);
              start = end + 1;
            }
            const auto& given = c.cfg.model.moe_aux_loss_coeff.values;  // kept where it has one per name
            std::vector<std::string> coeffs;
            for (std::size_t i = 0; i < names.size(); ++i)
              coeffs.push_back(fmt::format("{}", given.size() == names.size() ? given[i] : given.front()));
            return fail(fmt::format("moe_router_load_balancing_type '{}' is one name to Megatron's router, which "
                                    "balances nothing for it; several types are a list, with a coefficient each",
                                    t),
                        fmt::format("model.moe_router_load_balancing_type=[{}] model.moe_aux_loss_coeff=[{}]",
                                    fmt::join(names, ","), fmt::join(coeffs, ",")));
          }
          const std::string nearest = nearest_name(kKnown, t);
          return fail(fmt::format("moe_router_load_balancing_type '{}' is not one of {}: Megatron's router takes it "
                                  "and balances nothing for it (as none){}",
                                  t, fmt::join(kKnown, ", "),
                                  t == "noaux_tc" ? "; DeepSeek's aux-loss-free balancing is "
                                                    "moe_router_enable_expert_bias with a sigmoid router"
                                                  : ""),
                      types.is_list ? "" : fmt::format("model.moe_router_load_balancing_type={}",
                                                       nearest.empty() ? "none" : nearest));
        }
        return pass();
      });
  add("moe.load_balancing_list_ignores", W, {"model.moe_router_load_balancing_type"}, kMcore,
      "sinkhorn and quantile_balancing take effect only as the one type, not inside a list", [](const CheckContext& c) {
        const auto& types = c.cfg.model.moe_router_load_balancing_type;
        for (const char* t : {"sinkhorn", "quantile_balancing"})
          if (types.is_list && types.contains(t))
            return fail(fmt::format("moe_router_load_balancing_type lists {}, but Megatron's router tests the type with "
                                    "== (a list never equals it): the tokens are routed by plain top-k and the {} "
                                    "entry does nothing",
                                    t, t),
                        types.values.size() == 1
                            ? fmt::format("model.moe_router_load_balancing_type={} model.moe_aux_loss_coeff={}", t,
                                          c.cfg.model.moe_aux_loss_coeff.values.front())
                            : "");
        return pass();
      });
  add("moe.bias_needs_etp1", E, {"model.add_bias_linear", "model.expert_tensor_parallel_size", "model.num_moe_experts"},
      kMcore, "biased expert linears need ETP = 1", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.add_bias_linear && effective_etp(m) != 1,
                       "Bias in Moe is only supported when ETP==1", "model.expert_tensor_parallel_size=1");
      });
  add("moe.bias_dropout_fusion", E, {"model.add_bias_linear", "model.bias_dropout_fusion", "model.num_moe_experts"},
      "Megatron-Core transformer/moe/experts.py TEGroupedMLP",
      "the grouped experts' biases cannot go through the fused bias-dropout-add", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.add_bias_linear && m.bias_dropout_fusion,
                       "bias_dropout_fusion is not supported in TEGroupedMLP when add_bias_linear=True",
                       "model.bias_dropout_fusion=false");
      });
  add("moe.layer_pattern_length", E, {"model.moe_layer_freq", "model.num_layers"}, kMcore,
      "an explicit moe_layer_freq pattern has one entry per layer", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const auto n = static_cast<Int>(m.moe_layer_freq.pattern.size());
        if (n == 0 || n == m.num_layers) return pass();
        // The fix keeps the pattern, cut or padded with its last entry to one per layer.
        auto fixed = m.moe_layer_freq.pattern;
        fixed.resize(static_cast<std::size_t>(std::clamp<Int>(m.num_layers, 1, 1 << 20)), fixed.back());
        return fail(fmt::format("Invalid length of moe_layer_pattern: {}, expected {}", n, m.num_layers),
                    fmt::format("model.moe_layer_freq=[{}]", fmt::join(fixed, ",")));
      });
  add("moe.shared_expert_overlap_dispatcher", E,
      {"model.moe_shared_expert_overlap", "model.moe_token_dispatcher_type",
       "model.moe_shared_expert_intermediate_size"},
      kMcore, "shared-expert overlap works with the alltoall and flex dispatchers (flex since April 2026)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.moe_shared_expert_intermediate_size && m.moe_shared_expert_overlap &&
                           m.moe_token_dispatcher_type != "alltoall" && m.moe_token_dispatcher_type != "flex",
                       "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.",
                       "model.moe_shared_expert_overlap=false");
      });
  add("precision.single_dtype", E, {"model.bf16", "model.fp16"}, kMcore,
      "bf16 and fp16 are exclusive", [](const CheckContext& c) {
        return fail_if(c.cfg.model.bf16 && c.cfg.model.fp16, "bf16 and fp16 cannot both be set",
                       "model.fp16=false");
      });
  add("fp8.param_needs_fp8", E, {"model.fp8_param", "model.fp8"}, kMcore, "FP8 weights need FP8 mode",
      [](const CheckContext& c) {
        return fail_if(c.cfg.model.fp8_param && !c.cfg.model.fp8, "fp8_param must be used together with fp8 mode.",
                       "model.fp8_param=false");
      });
  add("fp8.recompute_moe_act_layernorm", E,
      {"model.fp8", "model.fp8_recipe", "model.recompute_granularity", "model.recompute_modules", "target.te_version"},
      kMcore, "FP8 with moe_act or layernorm recompute needs a scaling recipe other than delayed, and TE 2.6",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.fp8 || m.recompute_granularity != "selective" || !m.recompute_modules ||
            (!contains(*m.recompute_modules, "moe_act") && !contains(*m.recompute_modules, "layernorm")))
          return pass();
        if (m.fp8_recipe == std::optional<std::string>("delayed"))
          return fail("Delayed scaling does not support moe_act and layernorm recompute for fp8.",
                      "model.fp8_recipe=tensorwise");
        return te_at_least(c, "2.6.0", fmt::format("moe_act and layernorm recompute for fp8 needs "
                                                   "transformer-engine>=2.6.0dev0, but your version is {}.",
                                                   c.cfg.target.te_version.value_or("")));
      });
  add("fp8.gpu", E, {"model.fp8", "model.fp8_recipe", "target.gpu"}, kTeFp8,
      "FP8 needs compute capability 8.9 (MXFP8 10.0)", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.fp8) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        if (!c.gpu.cuda()) return pass();  // epx's own runtime refuses FP8 itself (job_spec)
        // Transformer Engine's gates: 8.9 (Ada, Hopper) for FP8, 10.0 (Blackwell) for MXFP8.
        if (c.gpu.major * 10 + c.gpu.minor < 89)
          return fail("Device compute capability 8.9 or higher required for FP8 execution.", "model.fp8=null");
        return fail_if(m.fp8_recipe == std::optional<std::string>("mxfp8") && c.gpu.major < 10,
                       "Device compute capability 10.0 or higher required for MXFP8 execution.",
                       "model.fp8_recipe=tensorwise");
      });
  add("fp8.te_moe", E, {"model.fp8", "model.num_moe_experts", "model.moe_grouped_gemm", "target.te_version"}, kMcore,
      "MoE FP8 training needs TE >= 1.7.0, with grouped GEMM TE >= 1.11.0", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.fp8 || !m.num_moe_experts) return pass();
        const std::string te = c.cfg.target.te_version.value_or("unknown");
        if (!m.moe_grouped_gemm)
          return te_at_least(c, "1.7.0.dev0",
                             fmt::format("Only transformer-engine>=1.7.0 supports MoE FP8 training, but your version is {}.", te));
        return te_at_least(c, "1.11.0",
                           fmt::format("Only transformer-engine>=1.11.0 supports FP8 grouped gemm, but your version is {}.", te));
      });
  add("fp8.custom_recipe_factory", E, {"model.fp8", "model.fp8_recipe"}, kMcore,
      "the custom FP8 recipe names its quantizer factory (model.fp8_quantizer_factory)", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.fp8 || m.fp8_recipe != std::optional<std::string>("custom")) return pass();
        // epx keeps the factory as an unmodelled field of a Bridge dump's model section.
        const YAML::Node factory = c.cfg.extra_fields.child_map("model")["fp8_quantizer_factory"];
        return fail_if(!factory.IsDefined() || !factory.IsScalar() || factory.Scalar().empty() || factory.Scalar() == "null" ||
                           factory.Scalar() == "None",
                       "fp8_quantizer_factory must be provided when fp8_recipe is 'custom'. Specify a Python import path "
                       "(e.g., package.module.quantizer_factory) via --fp8-quantizer-factory.",
                       "model.fp8_recipe=tensorwise");
      });
  add("model.dropout_probability", E, {"model.hidden_dropout", "model.attention_dropout"},
      "torch.nn.functional.dropout via Megatron-Core's bias_dropout_add and TE DotProductAttention",
      "hidden_dropout and attention_dropout are probabilities in [0, 1]: torch's dropout raises on anything else",
      [](const CheckContext& c) {
        // epx keeps both as unmodelled fields of a Bridge dump's model section.
        const YAML::Node model = c.cfg.extra_fields.child_map("model");
        std::vector<std::string> why, fix;
        for (const char* field : {"hidden_dropout", "attention_dropout"}) {
          const YAML::Node n = model[field];
          if (!n.IsDefined()) continue;
          const std::string text = n.IsScalar() ? n.Scalar() : "";
          double p = 0;
          if (n.IsNull() || text == "None" || text == "null")
            why.push_back(fmt::format("model.{}=None (a TypeError comparing None with its bounds)", field));
          else if (to_lower(text) == "true" || to_lower(text) == "false")
            continue;  // Python's bools are 1 and 0
          else if (!n.IsScalar() || !YAML::convert<double>::decode(n, p))
            why.push_back(fmt::format("model.{}={} (not a number)", field, n.IsScalar() ? text : YAML::Dump(n)));
          else if (p < 0 || p > 1)
            why.push_back(fmt::format("model.{}={} (ValueError: dropout probability has to be between 0 and 1)", field, text));
          else
            continue;
          fix.push_back(fmt::format("model.{}=0.0", field));
        }
        if (why.empty()) return pass();
        return fail(fmt::format("{}: dropout takes each as a probability", fmt::join(why, "; ")),
                    fmt::format("{}", fmt::join(fix, " ")));
      });
  add("moe.permute_fusion_te", E, {"model.moe_permute_fusion", "model.num_moe_experts", "target.te_version"}, kMcore,
      "fused permutation (moe_permute_fusion) needs TE >= 2.1.0", [](const CheckContext& c) {
        if (!c.cfg.model.moe_permute_fusion || !c.cfg.model.num_moe_experts) return pass();
        return te_at_least(c, "2.1.0", "fused permutation is not available. Please install TE >= 2.1.0.",
                           "model.moe_permute_fusion=false");
      });
  add("recompute.full_needs_method", E,
      {"model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"},
      kMcore, "full recompute names a method and a layer count", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.recompute_granularity != "full") return pass();
        if (!m.recompute_method)
          return fail("When using recompute_granularity: full, recompute_method must be uniform "
                      "or block",
                      m.recompute_num_layers
                          ? "model.recompute_method=uniform"
                          : "model.recompute_method=uniform model.recompute_num_layers=1");
        // Block over 0 layers recomputes none (TransformerBlock's loop); uniform steps by the count.
        return fail_if(!m.recompute_num_layers || *m.recompute_num_layers < (*m.recompute_method == "block" ? 0 : 1),
                       "When using recompute_granularity: full, recompute_num_layers must be "
                       "between 1 and the layers per pipeline rank",
                       "model.recompute_num_layers=1");
      });

  add("recompute.selective_no_num_layers", E, {"model.recompute_granularity", "model.recompute_num_layers"}, kMcore,
      "selective recompute takes no layer count", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.recompute_granularity == "selective" && m.recompute_num_layers.has_value(),
                       "When using recompute_granularity: selective recompute_num_layers must be None.",
                       "model.recompute_num_layers=null");
      });
  add("recompute.module_names", E, {"model.recompute_granularity", "model.recompute_modules"}, kMcore,
      "selective recompute names modules Megatron-Core recomputes", [](const CheckContext& c) {
        // Megatron-Core's allowed_modules (gdn_*: gated delta net attention, gdp_*: its
        // projections, mhc: DeepSeek-V4's hyper-connections; epx models neither).
        static const std::vector<std::string> kAllowed = {"core_attn", "moe_act",      "layernorm",   "mla_up_proj",
                                                          "mlp",       "moe",          "shared_experts", "gdn_norm_out",
                                                          "gdp_in_proj", "gdp_qkv",    "mhc"};
        const auto& m = c.cfg.model;
        if (m.recompute_granularity != "selective" || !m.recompute_modules) return pass();
        std::vector<std::string> invalid, valid;
        for (const std::string& name : *m.recompute_modules)
          (contains(kAllowed, name) ? valid : invalid).push_back("'" + name + "'");
        if (invalid.empty()) return pass();
        for (std::string& v : valid) v = v.substr(1, v.size() - 2);
        std::vector<std::string> allowed;
        for (const std::string& a : kAllowed) allowed.push_back("'" + a + "'");
        return fail(fmt::format("Invalid choices for recompute_modules: {{{}}}. Allowed modules are: {{{}}}",
                                fmt::join(invalid, ", "), fmt::join(allowed, ", ")),
                    fmt::format("model.recompute_modules=[{}]", fmt::join(valid, ",")));
      });
  add("recompute.module_needs_its_feature", E,
      {"model.recompute_granularity", "model.recompute_modules", "model.moe_grouped_gemm",
       "model.multi_latent_attention", "model.moe_shared_expert_intermediate_size", "model.moe_shared_expert_overlap"},
      kMcore, "selective recompute of moe_act, mla_up_proj or shared_experts needs what they recompute",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.recompute_granularity != "selective" || !m.recompute_modules) return pass();
        const StringList& modules = *m.recompute_modules;
        if (contains(modules, "moe_act") && !m.moe_grouped_gemm)
          return fail("moe_act in recompute_modules is only supported with moe_grouped_gemm.",
                      "model.moe_grouped_gemm=true");
        if (contains(modules, "mla_up_proj") && !m.multi_latent_attention) {
          StringList rest;
          for (const std::string& name : modules)
            if (name != "mla_up_proj") rest.push_back(name);
          return fail("mla_up_proj in recompute_modules is only supported with multi_latent_attention.",
                      fmt::format("model.recompute_modules=[{}]", fmt::join(rest, ",")));
        }
        return fail_if(contains(modules, "shared_experts") && m.moe_shared_expert_intermediate_size &&
                           m.moe_shared_expert_overlap,
                       "shared_experts recompute cannot work with --moe-shared-expert-overlap.",
                       "model.moe_shared_expert_overlap=false");
      });
}

}  // namespace epx::rule_helpers
