// delay_wgrad_compute: Megatron-Bridge's and Megatron-Core's asserts.
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_delay_wgrad_rules(RuleTable& add) {
  add("delay_wgrad.te_overlap_grad_reduce", E,
      {"comm_overlap.delay_wgrad_compute", "ddp.overlap_grad_reduce", "target.te_version"},
      kBridgeCommOverlap, "delay_wgrad with overlap_grad_reduce needs TE >= 2.7.0",
      [](const CheckContext& c) {
        const bool grad_reduce = c.user.ddp.overlap_grad_reduce ||
                                 (c.user.comm_overlap &&
                                  c.user.comm_overlap->overlap_grad_reduce.value_or(false));
        if (!bridge_delay_wgrad(c) || !grad_reduce) return pass();
        return te_at_least(c, "2.7.0",
                           fmt::format("TE version >= 2.7.0 is required for overlap_grad_reduce "
                                       "when usingdelay_wgrad_compute. Current TE version: {}",
                                       c.cfg.target.te_version.value_or("unknown")));
      });
  add("delay_wgrad.te_grad_accum_fusion", E,
      {"comm_overlap.delay_wgrad_compute", "model.gradient_accumulation_fusion",
       "target.te_version"},
      kBridgeCommOverlap, "delay_wgrad with gradient_accumulation_fusion needs TE >= 2.7.0",
      [](const CheckContext& c) {
        if (!bridge_delay_wgrad(c) || !c.cfg.model.gradient_accumulation_fusion) return pass();
        return te_at_least(c, "2.7.0",
                           fmt::format("TE version >= 2.7.0 is required for "
                                       "gradient_accumulation_fusion when usingdelay_wgrad_compute. "
                                       "Current TE version: {}",
                                       c.cfg.target.te_version.value_or("unknown")));
      });
  add("delay_wgrad.needs_ep_overlap", E,
      {"comm_overlap.delay_wgrad_compute", "comm_overlap.overlap_moe_expert_parallel_comm"},
      kBridgeCommOverlap, "delay_wgrad needs EP overlap", [](const CheckContext& c) {
        if (!delay_wgrad(c) || ep_overlap(c)) return pass();
        // Bridge's assert accepts the model's switch before comm_overlap overwrites it; what
        // slips past it meets Megatron-Core's check.
        const bool bridge_fails =
            bridge_delay_wgrad(c) && !c.user.model.overlap_moe_expert_parallel_comm &&
            c.user.comm_overlap->overlap_moe_expert_parallel_comm != true;
        return fail(bridge_fails ? "overlap_moe_expert_parallel_comm is required for "
                                   "delay_wgrad_compute"
                                 : "overlap_moe_expert_parallel_comm must be enabled when "
                                   "enabling delay_wgrad_compute",
                    c.cfg.comm_overlap ? "comm_overlap.overlap_moe_expert_parallel_comm=true"
                                       : "model.overlap_moe_expert_parallel_comm=true");
      });
  // wgrad inside a CUDA-graph scope: attention, or the router when the shared expert runs there.
  // Bridge asks in CommOverlapConfig.setup, before its validate clears the lists of a config
  // without graphs: the lists as written.
  auto wgrad_in_graph = [](const CheckContext& c) {
    const ModelConfig& m = c.cfg.model;
    return has_cuda_graph_module(c.user.model, "attn") ||
           (has_cuda_graph_module(c.user.model, "moe_router") && m.moe_shared_expert_intermediate_size &&
            !m.moe_shared_expert_overlap);
  };
  add("delay_wgrad.cuda_graph_te", E,
      {"comm_overlap.delay_wgrad_compute", "model.cuda_graph_scope", "model.cuda_graph_modules",
       "target.te_version"},
      kBridgeCommOverlap, "delay_wgrad with wgrad in a CUDA-graph scope needs TE >= 2.12.0",
      [wgrad_in_graph](const CheckContext& c) {
        if (!bridge_delay_wgrad(c) || !wgrad_in_graph(c)) return pass();
        return te_at_least(c, "2.12.0",
                           "CUDA graph with delay_wgrad_compute requires TE version >= 2.12.0.");
      });
  add("delay_wgrad.cuda_graph_grad_accum_fusion", E,
      {"comm_overlap.delay_wgrad_compute", "model.cuda_graph_scope",
       "model.gradient_accumulation_fusion"},
      kBridgeCommOverlap, "delay_wgrad in a CUDA-graph scope needs gradient_accumulation_fusion",
      [wgrad_in_graph](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(bridge_delay_wgrad(c) && wgrad_in_graph(c) && !m.gradient_accumulation_fusion,
                       "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion "
                       "to be enabled. This is because default gradient accumulation does not use "
                       "static memory addresses, which breaks CUDA graph requirements.",
                       "model.gradient_accumulation_fusion=true");
      });
  add("delay_wgrad.cuda_graph_attn_bias", E,
      {"comm_overlap.delay_wgrad_compute", "model.cuda_graph_scope", "model.add_bias_linear",
       "model.add_qkv_bias"},
      kBridgeCommOverlap, "delay_wgrad with the attn CUDA-graph scope excludes attention bias",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(bridge_delay_wgrad(c) && has_cuda_graph_module(c.user.model, "attn") &&
                           (m.add_bias_linear || m.add_qkv_bias),
                       "CUDA graph with delay_wgrad_compute does not support attention bias for now.",
                       m.add_bias_linear ? "model.add_bias_linear=false" : "model.add_qkv_bias=false");
      });
  add("delay_wgrad.te_partial_cuda_graph", E,
      {"comm_overlap.delay_wgrad_compute", "model.cuda_graph_impl", "target.te_version"}, kMcore,
      "delay_wgrad with TE CUDA graphs needs TE >= 2.10.0", [](const CheckContext& c) {
        if (!delay_wgrad(c) || c.cfg.model.cuda_graph_impl != "transformer_engine") return pass();
        return te_at_least(c, "2.10.0",
                           "TE version >= 2.10.0 is required for delay_wgrad_compute with partial "
                           "cuda graph");
      });
}

}  // namespace epx::rule_helpers
