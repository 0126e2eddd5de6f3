// What Megatron-Core and Bridge raise when the model is built or first runs.
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_first_step_rules(RuleTable& add) {
  add("pipeline.p2p_flags", E,
      {"model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
       "comm_overlap.overlap_p2p_comm", "comm_overlap.batch_p2p_comm"},
      "Megatron-Core pipeline_parallel/schedules.py",
      "the interleaved schedule overlaps or batches its p2p, never both; 1F1B does not overlap it",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.pipeline_model_parallel_size <= 1) return pass();
        if (virtual_pipeline_size(m))
          return fail_if(m.overlap_p2p_comm && m.batch_p2p_comm, "Can not use both overlap_p2p_comm and batch_p2p_comm",
                         "comm_overlap.batch_p2p_comm=false");
        return fail_if(m.overlap_p2p_comm,
                       "Non-interleaved pipeline parallelism does not support overlapping p2p communication",
                       "comm_overlap.overlap_p2p_comm=false");
      });
  add("cuda_graph.local_full_iteration_only", E, {"model.cuda_graph_impl", "model.cuda_graph_scope", "model.cuda_graph_modules"},
      "Megatron-Bridge utils/cuda_graph.py", "Bridge runs cuda_graph_impl=local only as a full-iteration graph",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.cuda_graph_impl == "local" && !full_iteration_graph(m),
                       "Megatron Bridge supports model.cuda_graph_impl=\"local\" only for full-iteration CUDA graphs. "
                       "Use model.cuda_graph_impl=\"transformer_engine\" for scoped CUDA graph capture such as "
                       "\"attn\" or \"mlp\".",
                       "model.cuda_graph_impl=transformer_engine");
      });
  // The flex managers exchange over the ETP x EP group: one rank has no one to exchange with.
  for (const auto& [backend, name] : {std::pair{"deepep", "DeepEP"}, {"ncclep", "NCCL EP"}})
    add(fmt::format("flex.{}_needs_tp_ep", backend), E,
        {"model.moe_flex_dispatcher_backend", "model.expert_model_parallel_size", "model.expert_tensor_parallel_size"},
        "Megatron-Core moe/token_dispatcher.py", fmt::format("{} needs ETP x EP > 1", name),
        [backend, name](const CheckContext& c) {
          const auto& m = c.cfg.model;
          return fail_if(uses_flex(m, backend) && m.expert_model_parallel_size * m.expert_tensor_parallel_size.value_or(1) <= 1,
                         fmt::format("{} dispatcher requires TPxEP > 1", name), "model.moe_token_dispatcher_type=alltoall");
        });
  add("moe.router_fusion_te", E, {"model.moe_router_fusion", "model.moe_router_score_function", "target.te_version"},
      "Megatron-Core moe/moe_utils.py", "the fused router (moe_router_fusion) needs TE >= 2.7.0, 2.13.0 for sqrtsoftplus",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.moe_router_fusion || !m.num_moe_experts) return pass();
        // Megatron-Core imports TE's fused router ops from 2.7.0.dev on (extensions/transformer_engine.py).
        if (m.moe_router_score_function == "sqrtsoftplus")
          return te_at_least(c, "2.13.0",
                             "Fused sqrtsoftplus score function requires TE >= 2.13.0. Please upgrade Transformer "
                             "Engine or disable moe_router_fusion.",
                             "model.moe_router_fusion=false");
        return te_at_least(c, "2.7.0.dev0", "fused_topk_with_score_function is not available. Please install TE >= 2.6.0.",
                           "model.moe_router_fusion=false");
      });
  add("train.seed_positive", E, {"rng.seed"}, "Megatron-Bridge training/initialize.py",
      "the random seed is a positive integer", [](const CheckContext& c) {
        return fail_if(c.cfg.rng.seed <= 0, fmt::format("Seed ({}) should be a positive integer.", c.cfg.rng.seed),
                       "rng.seed=1234");
      });
  add("flex.ncclep_dropless", E, {"model.moe_flex_dispatcher_backend", "model.moe_expert_capacity_factor",
                                  "model.moe_pad_expert_input_to_capacity"},
      "Megatron-Core moe/token_dispatcher.py", "NCCL EP has no drop and pad", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(uses_flex(m, "ncclep") && (m.moe_pad_expert_input_to_capacity || m.moe_expert_capacity_factor),
                       "drop and pad is not supported yet with the 'ncclep' backend.",
                       "model.moe_expert_capacity_factor=null model.moe_pad_expert_input_to_capacity=false");
      });
  add("moe.sinkhorn_aux_loss", E, {"model.moe_router_load_balancing_type", "model.moe_aux_loss_coeff"},
      "Megatron-Core moe/router.py", "Sinkhorn routing takes no aux loss", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.moe_router_load_balancing_type.is("sinkhorn") && !m.moe_aux_loss_coeff.is(0.0),
                       "Sinkhorn routing does not support aux loss.", "model.moe_aux_loss_coeff=0.0");
      });
  add("moe.quantile_balancing_router", E,
      {"model.moe_router_load_balancing_type", "model.moe_router_fusion", "model.moe_router_num_groups",
       "model.moe_router_group_topk", "model.moe_router_topk", "model.num_moe_experts"},
      "Megatron-Core moe/router.py",
      "quantile balancing routes without the fused router, without groups, and compares a token's top-k with its (k+1)-th "
      "expert",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts || !m.moe_router_load_balancing_type.is("quantile_balancing")) return pass();
        if (m.moe_router_fusion)
          return fail("Quantile balancing routing does not support moe_router_fusion.", "model.moe_router_fusion=false");
        if (m.moe_router_topk >= *m.num_moe_experts)  // torch's topk(k + 1) raises
          return fail(fmt::format("quantile balancing takes each token's top-(k+1) scores: moe_router_topk ({}) must be "
                                  "below num_moe_experts ({})",
                                  m.moe_router_topk, *m.num_moe_experts),
                      fmt::format("model.moe_router_topk={}", std::max<Int>(1, *m.num_moe_experts - 1)));
        return fail_if(m.moe_router_num_groups || m.moe_router_group_topk,
                       "Quantile balancing routing does not support group-limited routing.",
                       "model.moe_router_num_groups=null model.moe_router_group_topk=null");
      });
  add("moe.quantile_balancing_assignments", E,
      {"model.moe_router_load_balancing_type", "train.micro_batch_size", "model.seq_length", "model.moe_router_topk",
       "model.num_moe_experts"},
      "Megatron-Core moe/moe_utils.py",
      "quantile balancing gives each expert an equal share of a micro-batch's routed assignments (tokens x top-k)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts || !m.moe_router_load_balancing_type.is("quantile_balancing")) return pass();
        // The logits of a micro-batch gathered over TP x CP: all its tokens, each TP rank's own
        // under sequence parallelism, else every TP rank's copy.
        const Int m_tokens = c.cfg.train.micro_batch_size.value_or(1) * m.seq_length *
                             (m.sequence_parallel ? 1 : m.tensor_model_parallel_size);
        return fail_if((m_tokens * m.moe_router_topk) % *m.num_moe_experts != 0,
                       fmt::format("Quantile balancing requires the number of routed assignments ({} tokens * top-{}) "
                                   "to be divisible by {} experts.",
                                   m_tokens, m.moe_router_topk, *m.num_moe_experts));
      });
  add("moe.quantile_balancing_ignores", W,
      {"model.moe_router_load_balancing_type", "model.moe_aux_loss_coeff", "model.moe_router_enable_expert_bias"},
      "Megatron-Core moe/router.py", "quantile balancing replaces the aux loss and the expert bias",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts || !m.moe_router_load_balancing_type.is("quantile_balancing")) return pass();
        const auto& coeffs = m.moe_aux_loss_coeff.values;
        if (std::any_of(coeffs.begin(), coeffs.end(), [](double v) { return v != 0; }))
          return fail("moe_aux_loss_coeff is ignored under quantile_balancing: the router looks a coefficient up by "
                      "aux-loss type, and none is selected (its assert that aux losses are off never sees it)",
                      "model.moe_aux_loss_coeff=0.0");
        return fail_if(m.moe_router_enable_expert_bias,
                       "moe_router_enable_expert_bias is ignored under quantile_balancing: the bias is still updated, "
                       "but the router selects experts by the logits minus its own qb_beta",
                       "model.moe_router_enable_expert_bias=false");
      });
  add("moe.shared_expert_bias", E, {"model.moe_shared_expert_intermediate_size", "model.add_bias_linear"},
      "Megatron-Core moe/shared_experts.py", "shared experts have no bias", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.moe_shared_expert_intermediate_size && m.add_bias_linear,
                       "bias is not supported in the shared experts", "model.add_bias_linear=false");
      });
  add("mtp.uniform_recompute_one_layer", E,
      {"model.mtp_num_layers", "model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"},
      "Megatron-Core transformer/multi_token_prediction.py", "MTP's uniform recompute takes one layer at a time",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.mtp_num_layers.value_or(0) > 0 && m.recompute_granularity == std::optional<std::string>("full") &&
                           m.recompute_method == std::optional<std::string>("uniform") && m.recompute_num_layers != 1,
                       "recompute_num_layers must be 1 for MTP recompute", "model.recompute_num_layers=1");
      });
  add("mtp.detach_heads_without_mtp", W, {"model.mtp_detach_heads", "model.mtp_num_layers"},
      "Megatron-Core transformer/multi_token_prediction.py", "mtp_detach_heads acts on MTP layers only",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.mtp_detach_heads && m.mtp_num_layers.value_or(0) == 0,
                       "mtp_detach_heads is set but the model has no MTP layers (mtp_num_layers is 0 or unset): it "
                       "changes nothing",
                       "model.mtp_detach_heads=false");
      });
  add("mtp.depth_past_sequence", W, {"model.mtp_num_layers", "model.seq_length"},
      "Megatron-Core transformer/multi_token_prediction.py", "an MTP depth at or past seq_length has no labels to learn",
      [](const CheckContext& c) {
        // Depth d predicts the token d + 1 ahead: its labels and loss mask roll d places, so it
        // keeps at most seq_length - d tokens (packed sequences roll within each one). From
        // d = seq_length on none are left; Megatron clamps the token count to 1 and the depth's
        // loss is 0, its layer trains on nothing.
        const auto& m = c.cfg.model;
        const Int depths = m.mtp_num_layers.value_or(0);
        if (depths < m.seq_length) return pass();
        const std::string which = depths > m.seq_length ? fmt::format("depths {}..{} have", m.seq_length, depths)
                                                        : fmt::format("depth {} has", depths);
        return fail(fmt::format("mtp_num_layers={} with seq_length={}: MTP depth d keeps at most seq_length - d tokens, "
                                "so {} no labels and train nothing (the loss reads 0)",
                                depths, m.seq_length, which),
                    m.seq_length > 1 ? fmt::format("model.mtp_num_layers={}", m.seq_length - 1) : "model.mtp_num_layers=null");
      });
}

}  // namespace epx::rule_helpers
