// CUDA graphs: Megatron-Core's asserts on per-layer graphs (local, transformer_engine) and the
// seeds' advice on full-iteration graphs.
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_cuda_graph_rules(RuleTable& add) {
  add("cuda_graph.modules", E,
      {"model.cuda_graph_impl", "model.cuda_graph_modules", "model.cuda_graph_scope", "model.num_moe_experts",
       "model.moe_layer_freq", "model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity",
       "model.moe_token_dispatcher_type"},
      kMcore, "per-layer CUDA graph modules fit the model: MoE ones on MoE layers, mlp on dense ones, moe drop-padded",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (full_iteration_graph(m)) {
          // Bridge's legacy scope becomes the modules list; "full" and "full_iteration" are dropped.
          bool modules = false;
          for (const StringList* list : {&m.cuda_graph_modules, &m.cuda_graph_scope})
            for (const std::string& name : *list)
              modules = modules || (name != "full" && name != "full_iteration" && name != "full_iteration_inference");
          const std::string scope = m.cuda_graph_impl == "local" ? "[full_iteration]" : "[]";  // the legacy switch kept
          return fail_if(modules, "cuda_graph_modules must be empty when cuda_graph_impl=\"full_iteration\".",
                         (m.cuda_graph_modules.empty() ? "" : "model.cuda_graph_modules=[] ") + std::string("model.cuda_graph_scope=") + scope);
        }
        if (m.cuda_graph_impl != "local" && m.cuda_graph_impl != "transformer_engine") return pass();
        // The local implementation captures moe_router and moe_preprocess together.
        const bool local = m.cuda_graph_impl == "local";
        const auto has = [&](const char* name) {
          const std::string n = name;
          if (local && (n == "moe_router" || n == "moe_preprocess"))
            return has_cuda_graph_module(m, "moe_router") || has_cuda_graph_module(m, "moe_preprocess");
          return has_cuda_graph_module(m, name);
        };
        const auto set = [&](const char* list) { return fmt::format("{}={}", written_graph_list(c), list); };
        if (has("moe") && has("moe_router"))
          return fail("cuda_graph_modules must not contain both moe and moe_router.", set("[moe_router]"));
        if (has("moe_preprocess") && !has("moe_router"))
          return fail("moe_preprocess cuda graph is only supported with moe_router cuda graph.",
                      set("[moe_router,moe_preprocess]"));
        if (!m.num_moe_experts || *m.num_moe_experts <= 1)
          return fail_if(has("moe") || has("moe_router"), "moe cuda graph is only supported for MoE.", set("[attn]"));
        if (!m.moe_layer_freq.has_dense() && has("mlp"))
          return fail("mlp cuda graph is only supported for dense layers, but not found in the model.", set("[attn]"));
        const bool drop_pad = m.moe_expert_capacity_factor && m.moe_pad_expert_input_to_capacity;
        if (!drop_pad && has("moe"))
          return fail("moe cuda graph is only supported with drop-padding MoE.", set("[attn]"));
        // Megatron-Core also counts moe_router_padding_for_fp8 here, which epx does not model (no FP8).
        return fail_if(!drop_pad && m.moe_token_dispatcher_type == "alltoall" && m.moe_expert_capacity_factor &&
                           has("moe_preprocess"),
                       "moe_preprocess cuda graph is not supported when there are DtoH copies and synchronizations in "
                       "the preprocess step.",
                       local ? set("[attn]") : set("[moe_router]"));
      });
  add("cuda_graph.full_alone", E, {"model.cuda_graph_modules", "model.cuda_graph_scope"},
      "Megatron-Core transformer/cuda_graph_config.py", "the \"full\" module stands alone", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        for (const StringList* list : {&m.cuda_graph_modules, &m.cuda_graph_scope})
          if (contains(*list, "full") && list->size() > 1)
            return fail("full scope cannot be used with other scopes.", fmt::format("{}=[full]", written_graph_list(c)));
        return pass();
      });
  // Megatron-Core migrates two deprecated module names (full_iteration to cuda_graph_impl,
  // full_iteration_inference to the inference scope) only where nothing new-style contradicts
  // them; finalize has migrated the first where it fits.
  add("cuda_graph.deprecated_modules", E, {"model.cuda_graph_modules", "model.cuda_graph_scope", "model.cuda_graph_impl"},
      "Megatron-Core transformer/cuda_graph_config.py",
      "a deprecated module name (full_iteration, full_iteration_inference) alone and with an implementation it migrates to",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        std::vector<std::string> deprecated, rest;
        for (const std::string& name : m.cuda_graph_modules)
          (name == "full_iteration" || name == "full_iteration_inference" ? deprecated : rest).push_back(name);
        if (deprecated.empty()) return pass();
        const std::string keep = fmt::format("{}=[{}]", written_graph_list(c), fmt::join(rest, ","));
        if (std::any_of(deprecated.begin(), deprecated.end(), [&](const std::string& d) { return d != deprecated.front(); }))
          return fail(fmt::format("cuda_graph_modules cannot contain multiple deprecated values at the same time: ['{}'].",
                                  fmt::join(deprecated, "', '")),
                      keep);
        const std::string& impl = m.cuda_graph_impl;
        const bool fits = deprecated.front() == "full_iteration" ? impl == "none" || impl == "local" || impl == "full_iteration"
                                                                 : impl == "none" || impl == "local";
        return fail_if(!fits,
                       fmt::format("cuda_graph_modules='{}' cannot be combined with cuda_graph_impl='{}'.",
                                   deprecated.front(), impl),
                       keep);
      });
  add("cuda_graph.te_rng_tracker", E, {"model.cuda_graph_impl", "model.use_te_rng_tracker", "rng.te_rng_tracker"},
      "Megatron-Bridge models/gpt_provider.py", "CUDA graphs need Transformer Engine's RNG tracker",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.cuda_graph_impl != "none" && !m.use_te_rng_tracker,
                       "Transformer engine's RNG tracker is required for cudagraphs, it can be enabled with "
                       "use_te_rng_tracker=True'.",
                       "model.use_te_rng_tracker=true");
      });
  add("cuda_graph.scope_and_modules", E, {"model.cuda_graph_scope", "model.cuda_graph_modules"}, kMcore,
      "Bridge's legacy cuda_graph_scope and cuda_graph_modules are not both set", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        // Megatron-Core's default modules, "full", counts as unset.
        const bool modules = !m.cuda_graph_modules.empty() && m.cuda_graph_modules != StringList{"full"};
        // Megatron tests the scope against None: the fix is None, not an empty list.
        return fail_if(!m.cuda_graph_scope.empty() && modules, "cuda_graph_scope and cuda_graph_modules cannot be set together.",
                       "model.cuda_graph_scope=null");
      });
  add("cuda_graph.recompute", E,
      {"model.cuda_graph_impl", "model.recompute_granularity", "model.recompute_modules", "model.cuda_graph_modules",
       "model.cuda_graph_scope"},
      kMcore, "per-layer CUDA graphs take selective recompute only, and not of moe around a moe_router graph",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.cuda_graph_impl == "none" || !m.recompute_granularity || full_iteration_graph(m)) return pass();
        if (*m.recompute_granularity != "selective")
          return fail("full recompute is only supported with full iteration CUDA graph.",
                      "model.recompute_granularity=selective model.recompute_method=null model.recompute_num_layers=null");
        return fail_if(m.cuda_graph_impl == "transformer_engine" && m.recompute_modules &&
                           contains(*m.recompute_modules, "moe") && has_cuda_graph_module(m, "moe_router"),
                       "moe recompute is not supported with moe_router CUDA graph with: ",
                       "model.recompute_modules=[core_attn]");
      });
  add("advice.full_graph_dropless", A,
      {"model.cuda_graph_impl", "model.cuda_graph_scope", "model.moe_expert_capacity_factor"}, kSeedWorkflow,
      "full-iteration CUDA graphs suit drop-and-pad, not dropless MoE", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && full_iteration_graph(m) && !m.moe_expert_capacity_factor,
                       "full-iteration CUDA graphs need static shapes; with dropless MoE start with "
                       "TE-scoped graphs (attn, moe_router, moe_preprocess)",
                       "model.cuda_graph_impl=transformer_engine " + written_graph_list(c) + "=[attn,moe_router,moe_preprocess]");
      });
}

}  // namespace epx::rule_helpers
