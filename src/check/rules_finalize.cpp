// What Megatron-Bridge raises or turns off while it resolves the config (finalize).
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_finalize_rules(RuleTable& add) {
  add("tp_overlap.tp_size", W, {"comm_overlap.tp_comm_overlap", "model.tensor_model_parallel_size"},
      kBridgeCommOverlap, "TP overlap auto-disabled: TP < 2");
  add("tp_overlap.sequence_parallel", W, {"comm_overlap.tp_comm_overlap", "model.sequence_parallel"},
      kBridgeCommOverlap, "TP overlap auto-disabled: sequence_parallel off");
  add("tp_overlap.no_te", W, {"comm_overlap.tp_comm_overlap", "target.te_version"},
      kBridgeCommOverlap, "TP overlap auto-disabled: Transformer Engine not present");
  add("tp_overlap.default_cfg", W,
      {"comm_overlap.tp_comm_overlap", "comm_overlap.tp_comm_overlap_cfg"}, kBridgeCommOverlap,
      "TP overlap without a userbuffer config uses TE's default");
  add("config.misspelt_field", W, {}, "epx: a dump's kept fields against the modelled ones",
      "an unmodelled field of a Bridge dump one or two letters from a modelled one (checker.cpp)");
  add("mixed_precision.overwrites_model", W,
      {"mixed_precision", "model.bf16", "model.fp16", "model.fp8", "model.fp8_recipe", "model.fp8_param",
       "ddp.grad_reduce_in_fp32"},
      "Megatron-Bridge training/mixed_precision.py", "mixed_precision replaces precision fields the user set on the model");
  add("mixed_precision.fp4_not_modelled", W, {"mixed_precision"}, "Megatron-Bridge training/mixed_precision.py",
      "an FP4 mixed-precision recipe, which epx checks and plans as BF16");
  add("comm_overlap.overwrites_model", W,
      {"model.overlap_moe_expert_parallel_comm", "model.delay_wgrad_compute"}, kBridgeCommOverlap,
      "comm_overlap copies its (unset) overlap switches over the model's");
  add("comm_overlap.overwrites_ddp", W,
      {"ddp.overlap_grad_reduce", "ddp.overlap_param_gather", "ddp.align_param_gather", "ddp.bucket_size"},
      kBridgeCommOverlap, "with the distributed optimizer, comm_overlap's DP settings replace the ddp section's");
  add("optimizer.distributed_sync", W, {"ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"},
      kBridgeConfig, "the distributed optimizer asked for in one section only: on in both");
  add("optimizer.param_gather_sync", W, {"ddp.overlap_param_gather", "optimizer.overlap_param_gather"}, kBridgeConfig,
      "overlap_param_gather asked for in one section only: on in both");
  add("moe.ffn_hidden_size_unset", W, {"model.moe_ffn_hidden_size", "model.ffn_hidden_size"}, kMcore,
      "an MoE model without moe_ffn_hidden_size takes ffn_hidden_size (4 x hidden_size where that is unset too)");
  add("flex.deprecated_sm_knob", W, {"model.moe_deepep_num_sms", "model.moe_hybridep_num_sms"},
      kMcore, "deprecated per-backend SM-count knob");
  add("flex.conflicting_sm_knobs", E, {"model.moe_deepep_num_sms", "model.moe_hybridep_num_sms"},
      kMcore, "two deprecated SM-count knobs disagree");
}

}  // namespace epx::rule_helpers
