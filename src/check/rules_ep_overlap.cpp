// EP overlap: Megatron-Bridge's asserts in its order, then Megatron-Core's extra ones.
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_ep_overlap_rules(RuleTable& add) {
  add("ep_overlap.expert_parallel", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.expert_model_parallel_size"},
      kBridgeCommOverlap, "EP overlap needs EP > 1", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.expert_model_parallel_size <= 1,
                       by_path(c,
                               "overlap_moe_expert_parallel_comm is only supported when "
                               "expert_model_parallel_size > 1",
                               "overlap_moe_expert_parallel_comm is only supported with expert "
                               "model parallelism"),
                       disable_overlap(c));
      });
  add("ep_overlap.num_experts", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.num_moe_experts"},
      kBridgeCommOverlap, "EP overlap needs more than one expert (Bridge only)",
      [](const CheckContext& c) {
        const auto& n = c.cfg.model.num_moe_experts;
        return fail_if(bridge_ep_overlap(c) && (!n || *n <= 1),
                       fmt::format("overlap_moe_expert_parallel_comm is only supported when "
                                   "num_moe_experts > 1, but got {}",
                                   n ? std::to_string(*n) : "None"),
                       disable_overlap(c));
      });
  add("ep_overlap.dispatcher", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_token_dispatcher_type"},
      kBridgeCommOverlap, "EP overlap needs the alltoall or flex dispatcher",
      [](const CheckContext& c) {
        const auto& d = c.cfg.model.moe_token_dispatcher_type;
        return fail_if(ep_overlap(c) && d != "alltoall" && d != "flex",
                       by_path(c,
                               fmt::format("overlap_moe_expert_parallel_comm is only supported "
                                           "when moe_token_dispatcher_type == 'alltoall' or "
                                           "'flex', but got {}",
                                           d),
                               "overlap_moe_expert_parallel_comm is supported with alltoall/flex "
                               "token dispatcher"),
                       "model.moe_token_dispatcher_type=alltoall");
      });
  add("ep_overlap.precision", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.bf16", "model.fp16"},
      kBridgeCommOverlap, "EP overlap needs a bf16 or fp16 model", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && !c.cfg.model.bf16 && !c.cfg.model.fp16,
                       by_path(c,
                               "overlap_moe_expert_parallel_comm is only supported when using "
                               "bf16 or fp16 models",
                               "overlap_moe_expert_parallel_comm is only supported with bf16 or "
                               "fp16 model"),
                       "model.bf16=true");
      });
  add("ep_overlap.torch_version", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "target.torch_version"},
      kBridgeCommOverlap, "EP overlap needs torch >= 2.6.0 (hangs before)",
      [](const CheckContext& c) {
        if (!ep_overlap(c) || !c.cuda()) return pass();
        if (!c.cfg.target.torch_version) return unknown("pass --torch-version to check");
        return fail_if(!version_at_least(*c.cfg.target.torch_version, "2.6.0"),
                       "A2A Overlap encounters hang issue with torch version < 2.6.0",
                       "target.torch_version=2.6.0");
      });
  add("ep_overlap.pp_needs_vpp", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_layout"},
      kBridgeCommOverlap, "EP overlap with PP > 1 needs VPP set (VPP=1 passes, and runs the interleaved schedule)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!ep_overlap(c) || m.pipeline_model_parallel_size <= 1 || m.virtual_pipeline_model_parallel_size) return pass();
        const auto implied = virtual_pipeline_size(m);
        // Without a comm_overlap section Bridge's assert does not run, and Megatron-Core takes VPP
        // from the layout before its own.
        if (implied && !c.user.comm_overlap) return pass();
        return fail(fmt::format("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
                                "pipeline_model_parallel_size > 1{}",
                                implied ? fmt::format(" (the pipeline layout implies VPP {}, but Bridge asserts the field "
                                                      "before Megatron-Core reads the layout)",
                                                      *implied)
                                        : ""),
                    vpp_to_set(m));
      });
  add("ep_overlap.full_recompute", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_granularity"},
      kBridgeCommOverlap, "EP overlap excludes full recompute (seed pitfall)",
      [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.recompute_granularity == "full",
                       "disable full recomputation when enabling overlap_moe_expert_parallel_comm",
                       "model.recompute_granularity=selective");
      });
  add("ep_overlap.recompute_method", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_method"},
      kBridgeCommOverlap, "EP overlap needs recompute_method None", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.recompute_method.has_value(),
                       "disable recomputation method when enabling overlap_moe_expert_parallel_comm",
                       "model.recompute_method=null");
      });
  add("ep_overlap.recompute_num_layers", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_num_layers"},
      kBridgeCommOverlap, "EP overlap needs recompute_num_layers None", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.recompute_num_layers.has_value(),
                       "recompute_num_layers must be None when enabling "
                       "overlap_moe_expert_parallel_comm",
                       "model.recompute_num_layers=null");
      });
  add("ep_overlap.recompute_moe", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_modules"},
      kBridgeCommOverlap, "EP overlap excludes 'moe' from recompute_modules",
      [](const CheckContext& c) {
        const auto& mods = c.cfg.model.recompute_modules;
        if (!ep_overlap(c) || !mods || !contains(*mods, "moe")) return pass();
        StringList rest;
        for (const auto& m : *mods)
          if (m != "moe") rest.push_back(m);
        return fail("disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm",
                    fmt::format("model.recompute_modules=[{}]", fmt::join(rest, ",")));
      });
  add("ep_overlap.shared_expert_overlap", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_shared_expert_overlap"},
      kBridgeCommOverlap, "EP overlap excludes shared-expert overlap", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.moe_shared_expert_overlap,
                       "disable moe_shared_expert_overlap when enabling "
                       "overlap_moe_expert_parallel_comm",
                       "model.moe_shared_expert_overlap=false");
      });
  add("ep_overlap.mtp_layers", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.mtp_num_layers"},
      kBridgeCommOverlap, "EP overlap allows at most one MTP layer", [](const CheckContext& c) {
        const auto& n = c.cfg.model.mtp_num_layers;
        return fail_if(ep_overlap(c) && n && *n != 0 && *n != 1,
                       "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm.",
                       "model.mtp_num_layers=1");
      });
  // The MTP layer is built as the decoder's last (Megatron's MTP block spec), so it is MoE where
  // that layer is; the EP-overlap schedule builds its nodes for an MoE MTP layer only.
  add("ep_overlap.mtp_moe", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.mtp_num_layers", "model.moe_layer_freq",
       "model.num_moe_experts"},
      "Megatron-Core models/common/fine_grained_callables.py", "EP overlap needs an MoE MTP layer",
      [](const CheckContext& c) {
        const ModelConfig& m = c.cfg.model;
        const bool moe = m.num_moe_experts && *m.num_moe_experts >= 1 && m.moe_layer_freq.is_moe(m.num_layers - 1);
        return fail_if(ep_overlap(c) && m.mtp_num_layers.value_or(0) > 0 && !moe,
                       "MTP layer in a2a overlap only supports MoE layer for now.", "model.mtp_num_layers=null");
      });
  // Megatron-Core's extra EP-overlap checks (TransformerConfig.__post_init__).
  add("ep_overlap.cuda_graph_moe_scope", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.cuda_graph_impl",
       "model.cuda_graph_modules", "model.cuda_graph_scope"},
      kMcore, "EP overlap excludes TE CUDA-graph scopes moe and mlp", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!ep_overlap(c) || m.cuda_graph_impl != "transformer_engine" ||
            (!has_cuda_graph_module(m, "moe") && !has_cuda_graph_module(m, "mlp")))
          return pass();
        // Keep the other scopes; the router and preprocessing are the seeds' dropless choice. The
        // fixes rewrite the lists as written (finalize moves the legacy scope into the modules).
        std::vector<std::string> fixes;
        const ModelConfig& u = c.user.model;
        for (const auto& [name, list] : {std::pair{"cuda_graph_modules", &u.cuda_graph_modules},
                                         std::pair{"cuda_graph_scope", &u.cuda_graph_scope}}) {
          if (!contains(*list, "moe") && !contains(*list, "mlp")) continue;
          StringList keep;
          for (const auto& s : *list)
            if (s != "moe" && s != "mlp") keep.push_back(s);
          if (keep.empty()) keep = {"moe_router", "moe_preprocess"};
          fixes.push_back(fmt::format("model.{}=[{}]", name, fmt::join(keep, ",")));
        }
        return fail("CUDA graph scope on moe and mlp is not supported with "
                    "overlap_moe_expert_parallel_comm",
                    fmt::format("{}", fmt::join(fixes, " ")));
      });
  add("ep_overlap.dispatch_wgrad_exclusive", E,
      {"model.overlap_dispatch_backward_with_experts_wgrad",
       "comm_overlap.overlap_moe_expert_parallel_comm", "comm_overlap.delay_wgrad_compute"},
      kMcore, "overlap_dispatch_backward_with_experts_wgrad excludes EP overlap and delay_wgrad",
      [](const CheckContext& c) {
        return fail_if(c.cfg.model.overlap_dispatch_backward_with_experts_wgrad &&
                           (ep_overlap(c) || delay_wgrad(c)),
                       "overlap_dispatch_backward_with_experts_wgrad cannot be combined with "
                       "overlap_moe_expert_parallel_comm or delay_wgrad_compute",
                       "model.overlap_dispatch_backward_with_experts_wgrad=false");
      });
  add("ep_overlap.dispatch_wgrad_te", E,
      {"model.overlap_dispatch_backward_with_experts_wgrad", "target.te_version"}, kMcore,
      "overlap_dispatch_backward_with_experts_wgrad needs TE >= 2.3.0", [](const CheckContext& c) {
        if (!c.cfg.model.overlap_dispatch_backward_with_experts_wgrad) return pass();
        return te_at_least(c, "2.3.0",
                           "overlap_dispatch_backward_with_experts_wgrad requires TE >= 2.3.0");
      });
  add("ep_overlap.early_attn_release", E,
      {"model.ep_overlap_early_attn_memory_release",
       "comm_overlap.overlap_moe_expert_parallel_comm"},
      kMcore, "ep_overlap_early_attn_memory_release needs EP overlap", [](const CheckContext& c) {
        return fail_if(c.cfg.model.ep_overlap_early_attn_memory_release && !ep_overlap(c),
                       "ep_overlap_early_attn_memory_release requires "
                       "overlap_moe_expert_parallel_comm",
                       "model.ep_overlap_early_attn_memory_release=false");
      });
}

}  // namespace epx::rule_helpers
