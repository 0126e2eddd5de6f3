// The seeds' pitfalls and advice.
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_advice_rules(RuleTable& add) {
  add("advice.small_ep_overlap", A,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_token_dispatcher_type",
       "model.expert_model_parallel_size", "target.num_gpus"},
      kDocs, "EP overlap at EP <= 4 on alltoall within <= 2 nodes is often flat or slower",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!ep_overlap(c) || m.moe_token_dispatcher_type != "alltoall" ||
            m.expert_model_parallel_size > 4)
          return pass();
        const OptInt nodes = num_nodes(c.cfg);
        if (!nodes) return world_not_given(c);
        return fail_if(*nodes <= 2,
                       fmt::format("EP overlap with alltoall at EP {} on {} node(s) can be correct "
                                   "but flat or slower; measure it against overlap off before "
                                   "making it the default",
                                   m.expert_model_parallel_size, *nodes),
                       // --moe_a2a_overlap false changes nothing in the harness (overrides.py)
                       "comm_overlap.overlap_moe_expert_parallel_comm=false comm_overlap.delay_wgrad_compute=false");
      });
  add("advice.few_microbatches", A,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "train.global_batch_size",
       "train.micro_batch_size", "target.num_gpus"},
      kDocs, "EP overlap needs several micro-batches to interleave", [](const CheckContext& c) {
        if (ep_overlap(c) && !c.world() && c.cfg.train.global_batch_size) return world_not_given(c);
        const Int n = microbatches(c.cfg);
        return fail_if(ep_overlap(c) && n > 0 && n < 2,
                       fmt::format("{} micro-batch per step: the merged forward/backward schedule "
                                   "has no neighbour to overlap with (the first forward and last "
                                   "backward always run alone)",
                                   n),
                       "train.global_batch_size=<at least 2 x micro_batch_size x DP>");
      });
  add("advice.pp_without_vpp", A,
      {"model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
       "model.pipeline_model_parallel_layout"},
      kSeedOverlap, "PP > 1 without VPP rules out EP overlap later", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (ep_overlap(c) || m.pipeline_model_parallel_size <= 1 || m.virtual_pipeline_model_parallel_size) return pass();
        if (const auto implied = virtual_pipeline_size(m))  // a layout of several stages per rank
          return fail(fmt::format("the pipeline layout runs the interleaved schedule (VPP {}), but "
                                  "virtual_pipeline_model_parallel_size is unset: EP overlap cannot be enabled until it "
                                  "is set (Bridge asserts the field before Megatron-Core reads the layout)",
                                  *implied),
                      vpp_to_set(m));
        return fail("pipeline parallelism without VPP: EP overlap cannot be enabled on this layout (it needs "
                    "virtual_pipeline_model_parallel_size)",
                    vpp_to_set(m));
      });
  add("advice.full_recompute", A, {"model.recompute_granularity"}, kSeedWorkflow,
      "prefer selective recompute to full recompute", [](const CheckContext& c) {
        return fail_if(!ep_overlap(c) && c.cfg.model.recompute_granularity == "full",
                       "full recompute costs throughput and blocks EP overlap; selective recompute "
                       "(layernorm, core_attn, moe_act, mlp, shared_experts) usually recovers most "
                       "of the memory",
                       "model.recompute_granularity=selective model.recompute_method=null "
                       "model.recompute_num_layers=null");
      });
}

}  // namespace epx::rule_helpers
