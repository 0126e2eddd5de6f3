// The checker: every rule on both sides (a config that trips it and a neighbour that does not),
// finalize's derived fields, versions, and report shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/check/check.hpp"
#include "epx/check/pipeline_layout.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

using test::load_with;
using Overrides = std::vector<std::string>;

// Base for every case: the 2-rank CPU proxy (EP2, alltoall, bf16, GBS 8, MBS 1).
constexpr const char* kBase = "qwen3_30b_a3b_proxy";

// A Megatron-Bridge dump, for what only a dump has (tagged sections that keep unmodelled fields).
const std::string kDump = std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml";

CheckReport check(const Overrides& o, const OptString& flag = std::nullopt, const std::string& base = kBase) {
  if (base == kBase) return run_check(load_with(kBase, o), flag);
  Config c = load_config_file(base);
  for (const std::string& override : o) apply_override(c, override);
  return run_check(c, flag);
}

const Finding* find(const CheckReport& r, const std::string& id) {
  for (const auto& f : r.findings)
    if (f.rule_id == id) return &f;
  return nullptr;
}

Overrides operator+(Overrides a, const Overrides& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const Overrides OV = {"comm_overlap.overlap_moe_expert_parallel_comm=true"};
const Overrides DW = OV + Overrides{"comm_overlap.delay_wgrad_compute=true"};
const Overrides H100 = {"target.gpu=h100"};
const Overrides TP2 = {"model.tensor_model_parallel_size=2", "target.num_gpus=4"};
const Overrides PP2 = {"model.pipeline_model_parallel_size=2", "target.num_gpus=4"};
const Overrides HYBRIDEP = {"model.moe_token_dispatcher_type=flex",
                            "model.moe_flex_dispatcher_backend=hybridep"};
const Overrides DEEPEP = {"model.moe_token_dispatcher_type=flex",
                          "model.moe_flex_dispatcher_backend=deepep"};
const Overrides ATTN_GRAPH = {"model.cuda_graph_scope=[attn]"};
const Overrides TE_GRAPH = {"model.cuda_graph_impl=transformer_engine", "model.use_te_rng_tracker=true", "target.gpu=h100",
                            "target.te_version=2.12.0", "target.torch_version=2.7.0"};
const Overrides GB200_EP = {"target.gpu=gb200", "model.num_moe_experts=128",
                            "train.global_batch_size=128"};

struct Case {
  std::string rule;
  Overrides trips;
  Overrides passes;
  OptString flag_trips = std::nullopt;
  OptString flag_passes = std::nullopt;
  std::string base = kBase;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"parallel.world_divisible", {"model.tensor_model_parallel_size=2", "target.num_gpus=3"}, TP2},
      {"parallel.expert_world_divisible", {"model.expert_model_parallel_size=4"}, {}},
      {"parallel.ep_needs_experts", {"~model.num_moe_experts"}, {}},
      {"parallel.experts_divisible_by_ep", {"model.num_moe_experts=15"}, {}},
      {"parallel.heads_divisible_by_tp", TP2 + Overrides{"model.num_attention_heads=7"}, TP2},
      {"parallel.heads_divisible_by_tp",
       {"model.tensor_model_parallel_size=4", "target.num_gpus=12", "model.num_query_groups=3", "model.num_attention_heads=12"},
       {"model.tensor_model_parallel_size=4", "target.num_gpus=8", "model.num_query_groups=2"}},
      {"parallel.sp_needs_tp", {"model.sequence_parallel=true"}, TP2 + Overrides{"model.sequence_parallel=true"}},
      {"attention.query_groups_divide_heads", {"model.num_query_groups=3"}, {"model.num_query_groups=4"}},
      {"attention.query_groups_divide_heads",  // the fix also suits TP 4: 2 groups, not 3
       {"model.tensor_model_parallel_size=4", "target.num_gpus=4", "model.sequence_parallel=true",
        "model.num_attention_heads=12", "model.num_query_groups=5"},
       {"model.tensor_model_parallel_size=4", "target.num_gpus=4", "model.sequence_parallel=true",
        "model.num_attention_heads=12", "model.num_query_groups=4"}},
      {"pipeline.layout", PP2 + Overrides{"model.num_layers=4", "model.pipeline_model_parallel_layout=Et|tL"},
       PP2 + Overrides{"model.num_layers=4", "model.pipeline_model_parallel_layout=Ett|ttL"}},
      {"optimizer.precision_aware_dtypes", {"optimizer.exp_avg_dtype=bf16"},
       {"optimizer.exp_avg_dtype=bf16", "optimizer.use_precision_aware_optimizer=true", "ddp.use_distributed_optimizer=true"}},
      {"optimizer.precision_aware_dtypes", {"optimizer.use_precision_aware_optimizer=true"},
       {"optimizer.use_precision_aware_optimizer=true", "ddp.use_distributed_optimizer=true"}},
      {"train.mode", {"train.train_iters=null", "train.train_samples=1024", "+train.rampup_batch_size=[16,16,1024]"},
       {"train.train_iters=null", "train.train_samples=1024"}, {}, {}, kDump},
      {"config.misspelt_field", {"+model.moe_router_top_k=4"}, {"+model.moe_router_top_k_unrelated=4"}, {}, {}, kDump},
      // Gemma4's dense provider leaves the top-k None, Qwen3-VL's recipes the dispatcher.
      {"moe.field_is_none", {"model.moe_router_topk=None"}, {"model.moe_router_topk=None", "~model.num_moe_experts",
                                                              "model.expert_model_parallel_size=1", "model.moe_ffn_hidden_size=null",
                                                              "model.moe_shared_expert_intermediate_size=null"}, {}, {}, kDump},
      {"moe.field_is_none", {"model.moe_token_dispatcher_type=null"}, {"model.moe_token_dispatcher_type=alltoall"}, {}, {}, kDump},
      {"fp8.param_needs_fp8", {"model.fp8_param=true"}, {"model.fp8_param=true", "model.fp8=hybrid", "target.gpu=h100"}},
      {"fp8.gpu", {"model.fp8=hybrid", "target.gpu=a100"}, {"model.fp8=hybrid", "target.gpu=h100"}},
      {"fp8.recompute_moe_act_layernorm",
       {"model.fp8=hybrid", "model.fp8_recipe=delayed", "model.recompute_granularity=selective",
        "model.recompute_modules=[moe_act,layernorm]"},
       {"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "model.recompute_granularity=selective",
        "model.recompute_modules=[moe_act,layernorm]"}},
      {"fp8.recompute_moe_act_layernorm",
       {"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "model.recompute_granularity=selective",
        "model.recompute_modules=[layernorm]", "target.gpu=h100", "target.te_version=2.5.0"},
       {"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "model.recompute_granularity=selective",
        "model.recompute_modules=[layernorm]", "target.gpu=h100", "target.te_version=2.6.0"}},
      {"fp8.gpu", {"model.fp8=hybrid", "model.fp8_recipe=mxfp8", "target.gpu=h100"},
       {"model.fp8=hybrid", "model.fp8_recipe=mxfp8", "target.gpu=b200"}},
      {"parallel.layers_divisible_by_pp", PP2 + Overrides{"model.num_layers=3"}, PP2},  // fix: uneven stages
      // Megatron builds the embedding on stage 0's first chunk whatever the layout says.
      {"pipeline.layout_embedding_loss_stages", PP2 + Overrides{"model.num_layers=4", "model.pipeline_model_parallel_layout='|Etttt|L|'"},
       PP2 + Overrides{"model.num_layers=4", "model.pipeline_model_parallel_layout='Et|tt|t|L'"}},
      // A standalone MTP stage in the first rank's second chunk: its embedding copy never syncs.
      {"pipeline.mtp_first_rank_chunk", PP2 + Overrides{"model.num_layers=4", "model.mtp_num_layers=1",
                                                        "model.pipeline_model_parallel_layout='Et|ttt|m|L'"},
       PP2 + Overrides{"model.num_layers=4", "model.mtp_num_layers=1", "model.pipeline_model_parallel_layout='Et|ttt||mL'"}},
      {"parallel.layers_divisible_by_pp",  // fix: the embedding and loss counted
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2"}, PP2},
      {"parallel.layers_divisible_by_pp",  // fix: a smaller VPP
       PP2 + Overrides{"model.num_layers=4", "model.virtual_pipeline_model_parallel_size=3"},
       PP2 + Overrides{"model.num_layers=4", "model.virtual_pipeline_model_parallel_size=2"}},
      {"parallel.layers_divisible_by_pp",  // fix: a layout
       PP2 + Overrides{"model.num_layers=5", "model.virtual_pipeline_model_parallel_size=2"},
       PP2 + Overrides{"model.num_layers=5", "model.virtual_pipeline_model_parallel_size=2",
                       "model.pipeline_model_parallel_layout='Et|tt|t|tL'"}},
      {"parallel.ep_tp_needs_sp", TP2, TP2 + Overrides{"model.sequence_parallel=true"}},
      {"train.batch_divisible", {"train.global_batch_size=7"}, {}},
      {"train.batch_divisible", {"train.global_batch_size=null"}, {"train.global_batch_size=2"}},
      {"train.samples_below_one_batch", {"train.train_iters=null", "train.train_samples=7", "scheduler.lr_warmup_iters=0"},
       {"train.train_iters=null", "train.train_samples=8", "scheduler.lr_warmup_iters=0"}},
      {"train.batch_divisible", {"train.micro_batch_size=null"}, {"train.micro_batch_size=1"}},
      {"cuda_graph.modules", TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe_preprocess]"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe_router,moe_preprocess]"}},
      {"cuda_graph.modules", TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe]"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe]", "model.moe_expert_capacity_factor=1.0",
                            "model.moe_pad_expert_input_to_capacity=true"}},
      {"cuda_graph.modules", TE_GRAPH + Overrides{"model.cuda_graph_modules=[mlp]"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[mlp]", "model.moe_layer_freq=[0,1]"}},
      {"cuda_graph.modules", TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe,moe_router]"}, TE_GRAPH},
      {"cuda_graph.modules", TE_GRAPH + Overrides{"model.cuda_graph_scope=[moe]"},  // the fix keeps to the scope list
       TE_GRAPH + Overrides{"model.cuda_graph_scope=[moe_router]"}},
      {"cuda_graph.modules",  // local captures moe_router with moe_preprocess
       {"model.cuda_graph_impl=local", "model.cuda_graph_scope=[moe_router]", "model.moe_expert_capacity_factor=1.0"},
       {"model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]", "model.moe_expert_capacity_factor=1.0"}},
      {"cuda_graph.modules",
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe_router,moe_preprocess]", "model.moe_expert_capacity_factor=1.0"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[moe_router]", "model.moe_expert_capacity_factor=1.0"}},
      {"cuda_graph.recompute",
       TE_GRAPH + Overrides{"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"},
       TE_GRAPH + Overrides{"model.recompute_granularity=selective"}},
      {"cuda_graph.recompute",  // full recompute under a full-iteration graph is Megatron's one exception
       TE_GRAPH + Overrides{"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"},
       TE_GRAPH + Overrides{"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1",
                            "model.cuda_graph_impl=full_iteration"}},
      {"cuda_graph.modules", TE_GRAPH + Overrides{"model.cuda_graph_impl=full_iteration", "model.cuda_graph_modules=[attn]"},
       TE_GRAPH + Overrides{"model.cuda_graph_impl=full_iteration", "model.cuda_graph_scope=[full_iteration]"}},
      {"cuda_graph.modules",  // the legacy switch: Megatron-Core migrates it, then asserts the same
       TE_GRAPH + Overrides{"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration,attn]"},
       TE_GRAPH + Overrides{"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"}},
      {"cuda_graph.recompute",
       TE_GRAPH + Overrides{"model.recompute_granularity=selective", "model.recompute_modules=[moe]",
                            "model.cuda_graph_modules=[moe_router]"},
       TE_GRAPH + Overrides{"model.recompute_granularity=selective", "model.recompute_modules=[moe]",
                            "model.cuda_graph_modules=[attn]"}},
      {"parallel.cp_seq_length", {"model.context_parallel_size=2", "target.num_gpus=4", "model.seq_length=254"},
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.seq_length=256"}},
      {"scheduler.lr_order", {"optimizer.min_lr=1.0"}, {"optimizer.min_lr=0.0"}},
      {"scheduler.lr_order", {"scheduler.lr_warmup_init=1.0"}, {"scheduler.lr_warmup_init=0.0"}},
      {"scheduler.warmup_capped", {"train.train_iters=2", "scheduler.lr_warmup_iters=2"},
       {"train.train_iters=3", "scheduler.lr_warmup_iters=2"}},
      {"scheduler.warmup_capped",  // sample-based, the warmup a fraction of the decay
       {"train.train_iters=null", "train.train_samples=64", "scheduler.lr_warmup_iters=0", "scheduler.lr_warmup_fraction=1.0"},
       {"train.train_iters=null", "train.train_samples=64", "scheduler.lr_warmup_iters=0", "scheduler.lr_warmup_fraction=0.5"}},
      {"train.mode", {"train.train_iters=null"}, {"train.train_iters=null", "train.train_samples=64"}},
      {"train.mode", {"train.train_samples=64"}, {}},
      {"scheduler.iteration_or_sample_fields", {"scheduler.lr_decay_samples=64"}, {"scheduler.lr_decay_iters=8"}},
      {"scheduler.iteration_or_sample_fields", {"scheduler.lr_warmup_fraction=0.1"},
       {"scheduler.lr_warmup_fraction=0.1", "scheduler.lr_warmup_iters=0"}},
      {"scheduler.matches_training", {"scheduler.lr_warmup_iters=0", "scheduler.lr_warmup_samples=8"}, {}},
      {"scheduler.matches_training", {"train.train_iters=null", "train.train_samples=64"},
       {"train.train_iters=null", "train.train_samples=64", "scheduler.lr_warmup_iters=0", "scheduler.lr_warmup_samples=8"}},
      {"scheduler.matches_training", {"scheduler.max_steps=5"}, {"scheduler.max_steps=20"}},
      {"moe.not_moe", {"~model.num_moe_experts", "model.expert_model_parallel_size=1"}, {}},
      {"moe.ffn_without_experts", {"~model.num_moe_experts", "model.expert_model_parallel_size=1"},
       {"~model.num_moe_experts", "model.expert_model_parallel_size=1", "model.moe_layer_freq=2"}},
      {"moe.router_dtype", {"model.num_moe_experts=32"}, {"model.num_moe_experts=32", "model.moe_router_dtype=fp32"}},
      {"model.rope_even_head_dim", {"model.hidden_size=250", "model.kv_channels=null"},
       {"model.hidden_size=256", "model.kv_channels=null"}},
      {"model.rope_even_head_dim", {"model.kv_channels=33"}, {"model.kv_channels=34"}},
      {"model.rope_even_head_dim",  // int(32 * 0.97) = 31 is odd: Megatron rotates 32 channels, which fit
       {"model.kv_channels=33"}, {"model.rotary_percent=0.97", "model.kv_channels=32"}},
      {"moe.router_dtype_torch", {"model.moe_router_dtype=torch.float32"}, {"model.moe_router_dtype=fp32"}},
      {"model.yarn_fields", {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0"},
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0"}},
      {"model.rope_even_head_dim",  // YaRN rotates every channel, rotary_percent or not
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0",
        "model.kv_channels=33", "model.rotary_percent=0.5"},
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0",
        "model.kv_channels=34", "model.rotary_percent=0.5"}},
      {"model.yarn_fields",
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=-1.0", "model.yarn_beta_slow=1.0"},
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0"}},
      {"model.yarn_concentration",  // mscale_all_dim at -10 / ln 32 puts a zero under the factor
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0",
        "model.yarn_mscale=1.0", "model.yarn_mscale_all_dim=-2.8853900817779268"},
       {"model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
        "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0", "model.yarn_beta_slow=1.0",
        "model.yarn_mscale=1.0", "model.yarn_mscale_all_dim=1.0"}},
      {"model.window_size_right", {"model.window_size=[127,-5]"}, {"model.window_size=[127,0]"}},
      {"model.sink_context_parallel",
       {"model.softmax_type=learnable", "model.context_parallel_size=2", "target.num_gpus=4"},
       {"model.softmax_type=learnable", "model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=a2a"}},
      {"model.yarn_concentration",  // also under plain RoPE: Bridge's patch applies the factor wherever it is set
       {"model.yarn_rotary_scaling_factor=32.0", "model.yarn_mscale=1e308", "model.yarn_mscale_all_dim=1.0"},
       {"model.yarn_rotary_scaling_factor=32.0", "model.yarn_mscale=1.0", "model.yarn_mscale_all_dim=1.0"}},
      {"model.window_context_parallel",
       {"model.window_size=[127,0]", "model.context_parallel_size=2", "target.num_gpus=4"},
       {"model.window_size=[127,0]", "model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=allgather"}},
      {"model.mla_yarn_fields", {"model.multi_latent_attention=true", "model.beta_slow=0.0"},
       {"model.multi_latent_attention=true", "model.beta_slow=0.0", "model.rope_type=rope"}},
      {"model.mla_yarn_fields", {"model.multi_latent_attention=true", "model.qk_pos_emb_head_dim=0"},
       {"model.multi_latent_attention=true", "model.qk_pos_emb_head_dim=64"}},
      {"model.mla_yarn_fields", {"model.multi_latent_attention=true", "model.mscale=1.0e300"},
       {"model.multi_latent_attention=true", "model.mscale=1.0"}},
      {"model.mla_position_embedding", {"model.multi_latent_attention=true", "model.position_embedding_type=yarn"},
       {"model.multi_latent_attention=true", "model.position_embedding_type=rope"}},
      {"model.cp_a2a_heads",  // the base: 4 heads, 2 groups
       {"model.context_parallel_size=4", "target.num_gpus=8", "model.cp_comm_type=a2a"},
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=a2a"}},
      {"model.cp_a2a_heads",  // 2 groups over TP 4: Megatron replicates them, one key/value head a rank
       {"model.context_parallel_size=2", "model.tensor_model_parallel_size=4", "model.num_attention_heads=8",
        "target.num_gpus=8", "model.cp_comm_type=a2a"},
       {"model.context_parallel_size=2", "model.tensor_model_parallel_size=4", "model.num_attention_heads=8",
        "model.num_query_groups=8", "target.num_gpus=8", "model.cp_comm_type=a2a"}},
      {"model.cp_a2a_heads",  // a2a+p2p scatters over its a2a level
       {"model.context_parallel_size=4", "target.num_gpus=8", "model.cp_comm_type=a2a+p2p",
        "model.hierarchical_context_parallel_sizes=[4,1]"},
       {"model.context_parallel_size=4", "target.num_gpus=8", "model.cp_comm_type=a2a+p2p",
        "model.hierarchical_context_parallel_sizes=[2,2]"}},
      {"model.hierarchical_cp_sizes", {"model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=a2a+p2p"},
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=a2a+p2p",
        "model.hierarchical_context_parallel_sizes=[2,1]"}},
      {"model.hierarchical_cp_sizes",
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.hierarchical_context_parallel_sizes=[2,2]"},
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.hierarchical_context_parallel_sizes=[1,2]"}},
      {"model.hierarchical_cp_sizes",  // TE takes exactly two groups for a2a+p2p
       {"model.context_parallel_size=4", "target.num_gpus=8", "model.cp_comm_type=a2a+p2p",
        "model.hierarchical_context_parallel_sizes=[2,1,2]"},
       {"model.context_parallel_size=4", "target.num_gpus=8", "model.hierarchical_context_parallel_sizes=[2,1,2]"}},
      {"model.hierarchical_cp_sizes", {"model.hierarchical_context_parallel_sizes=1"},
       {"model.hierarchical_context_parallel_sizes=[1]"}},
      {"model.hierarchical_cp_sizes",  // a size far past CP does not overflow the product
       {"model.hierarchical_context_parallel_sizes=[4611686018427387904,4]"}, {"model.hierarchical_context_parallel_sizes=[1]"}},
      {"model.cp_comm_type_length",  // the base has 2 layers
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=[a2a]"},
       {"model.context_parallel_size=2", "target.num_gpus=4", "model.cp_comm_type=[a2a,p2p]"}},
      {"model.sink_te_version", H100 + Overrides{"model.softmax_type=learnable", "target.te_version=2.7.0"},
       H100 + Overrides{"model.softmax_type=learnable", "target.te_version=2.8.0"}},
      {"moe.bias_dropout_fusion", {"model.add_bias_linear=true", "model.bias_dropout_fusion=true"},
       {"model.add_bias_linear=true"}},
      {"model.window_size_causal", {"model.window_size=[-1,3]"}, {"model.window_size=[-1,0]"}},
      {"model.window_size_right", {"model.window_size=[127,5]"}, {"model.window_size=[127,0]"}},
      {"model.window_size_right", {"model.window_size=[-1,-1]"}, {"model.window_size=null"}},
      {"model.window_pattern_length",  // the base has 2 layers; a longer list Megatron reads in part
       {"model.window_size=[127,0]", "model.window_attn_skip_freq=[1]"},
       {"model.window_size=[127,0]", "model.window_attn_skip_freq=[1,0,1]"}},
      {"model.fused_activation", {"model.bias_activation_fusion=true", "model.activation_func=relu"},
       {"model.bias_activation_fusion=true"}},
      {"model.fused_activation",
       {"model.bias_activation_fusion=true", "model.activation_func=gelu", "model.gated_linear_unit=false"},
       {"model.bias_activation_fusion=true", "model.activation_func=gelu", "model.gated_linear_unit=false",
        "model.add_bias_linear=true"}},
      {"model.fused_activation",
       {"model.bias_activation_fusion=true", "model.activation_func=quick_gelu", "model.gated_linear_unit=false"},
       {"model.bias_activation_fusion=true", "model.activation_func=quick_gelu"}},
      {"model.fused_activation", {"model.bias_activation_fusion=true", "model.glu_linear_offset=1.0"},
       {"model.bias_activation_fusion=true", "model.glu_linear_offset=1.0", "model.activation_func=quick_gelu",
        "model.activation_func_clamp_value=7.0"}},
      {"model.fused_activation", {"model.bias_activation_fusion=true", "model.use_te_activation_func=true"},
       {"model.use_te_activation_func=true"}},
      {"model.te_activation", {"model.use_te_activation_func=true", "model.activation_func=quick_gelu"},
       {"model.use_te_activation_func=true"}},
      {"model.te_activation", {"model.use_te_activation_func=true", "model.activation_func=relu"},
       {"model.use_te_activation_func=true", "model.activation_func=gelu"}},
      {"model.fused_activation_module",  // the experts' fused kernels: SwiGLU and quick-GEGLU
       {"model.bias_activation_fusion=true", "model.activation_func=gelu"},
       {"model.bias_activation_fusion=true", "model.activation_func=quick_gelu"}},
      {"model.fused_activation_module",  // the dense MLPs' (moe_layer_freq) and shared experts': GELU and SwiGLU
       {"model.bias_activation_fusion=true", "model.activation_func=quick_gelu", "model.moe_layer_freq=[0,1]",
        "model.num_layers=2"},
       {"model.bias_activation_fusion=true", "model.activation_func=quick_gelu", "model.num_layers=2"}},
      {"model.fused_gelu_is_tanh",
       {"model.bias_activation_fusion=true", "model.activation_func=gelu", "~model.num_moe_experts",
        "model.expert_model_parallel_size=1"},
       {"model.activation_func=gelu", "~model.num_moe_experts", "model.expert_model_parallel_size=1"}},
      {"model.fused_gelu_is_tanh",  // ungated: bias_gelu_impl, with biases (TransformerConfig refuses it without)
       {"model.bias_activation_fusion=true", "model.activation_func=gelu", "model.gated_linear_unit=false",
        "model.add_bias_linear=true", "~model.num_moe_experts", "model.expert_model_parallel_size=1"},
       {"model.bias_activation_fusion=true", "model.activation_func=gelu", "model.gated_linear_unit=false",
        "~model.num_moe_experts", "model.expert_model_parallel_size=1"}},
      {"model.te_activation_ungated",
       {"model.use_te_activation_func=true", "model.activation_func=silu", "model.gated_linear_unit=false"},
       {"model.use_te_activation_func=true", "model.activation_func=silu"}},
      {"model.te_activation_ungated",
       {"model.use_te_activation_func=true", "model.activation_func=gelu", "model.gated_linear_unit=false"},
       {"model.activation_func=gelu", "model.gated_linear_unit=false"}},
      {"model.glu_fields_ungated", {"model.gated_linear_unit=false", "model.activation_func_clamp_value=7.0"},
       {"model.activation_func_clamp_value=7.0"}},
      {"model.glu_fields_ungated", {"model.gated_linear_unit=false", "model.glu_linear_offset=1.0"},
       {"model.gated_linear_unit=false"}},
      {"model.swiglu_clamp", {"model.activation_func_clamp_value=-1.0"}, {"model.activation_func_clamp_value=10.0"}},
      {"model.swiglu_clamp", {"model.activation_func_clamp_value=10.0", "model.glu_linear_offset=0.5"},
       {"model.activation_func_clamp_value=10.0", "model.glu_linear_offset=0.5", "model.activation_func=quick_gelu"}},
      {"model.swiglu_clamp", {"model.activation_func_clamp_value=10.0", "model.use_te_activation_func=true"},
       {"model.activation_func_clamp_value=10.0", "model.gated_linear_unit=false", "model.use_te_activation_func=true"}},
      {"model.swiglu_clamp",
       {"model.activation_func_clamp_value=10.0", "~model.num_moe_experts", "model.expert_model_parallel_size=1"},
       {"~model.num_moe_experts", "model.expert_model_parallel_size=1"}},
      {"moe.router_dtype_torch", {"model.moe_router_dtype=bf16"}, {"model.moe_router_dtype=null"}},
      {"cuda_graph.full_alone", TE_GRAPH + Overrides{"model.cuda_graph_modules=[full,attn]"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[full]"}},
      {"cuda_graph.deprecated_modules", {"model.cuda_graph_impl=local", "model.cuda_graph_modules=[full_iteration,full_iteration_inference]"},
       {"model.cuda_graph_impl=local", "model.cuda_graph_modules=[full_iteration]"}},
      {"cuda_graph.deprecated_modules",  // Megatron-Core reads the legacy scope as the modules first
       TE_GRAPH + Overrides{"model.cuda_graph_scope=[full_iteration]"}, TE_GRAPH + Overrides{"model.cuda_graph_scope=[attn]"}},
      {"cuda_graph.deprecated_modules", TE_GRAPH + Overrides{"model.cuda_graph_modules=[full_iteration_inference,attn]"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[attn]"}},
      {"moe.topk_range", {"model.moe_router_topk=17"}, {}},
      {"moe.ffn_hidden_size_unset", {"model.moe_ffn_hidden_size=null"}, {}},
      {"optimizer.distributed_sync", {"ddp.use_distributed_optimizer=true"},
       {"ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true"}},
      {"optimizer.param_gather_sync", {"optimizer.overlap_param_gather=true"},
       {"ddp.overlap_param_gather=true", "optimizer.overlap_param_gather=true"}},
      {"moe.aux_loss_coeff_list", {"model.moe_router_load_balancing_type=[aux_loss,global_aux_loss]"},
       {"model.moe_router_load_balancing_type=[aux_loss,global_aux_loss]", "model.moe_aux_loss_coeff=[1e-3,1e-4]"}},
      {"moe.aux_loss_coeff_list",  // the fix pads with the last coefficient
       {"model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss,global_aux_loss]", "model.moe_aux_loss_coeff=[1e-3,1e-4]"},
       {"model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss]", "model.moe_aux_loss_coeff=[1e-3,1e-4]"}},
      {"moe.aux_loss_coeff_list", {"model.moe_aux_loss_coeff=[1e-3]"},  // one type beside a list: Megatron's TypeError
       {"model.moe_router_load_balancing_type=none", "model.moe_aux_loss_coeff=[1e-3]"}},
      {"moe.load_balancing_type_unknown", {"model.moe_router_load_balancing_type=aux-loss"},
       {"model.moe_router_load_balancing_type=aux_loss"}},  // the fix is the nearest name
      {"moe.load_balancing_type_unknown", {"model.moe_router_load_balancing_type=noaux_tc"},
       {"model.moe_router_load_balancing_type=none"}},
      {"moe.load_balancing_type_unknown",  // Bridge's tests' comma string: one name to Megatron; the fix is a list
       {"model.moe_router_load_balancing_type=aux_loss,seq_aux_loss"},
       {"model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss]", "model.moe_aux_loss_coeff=[1e-3,1e-3]"}},
      {"moe.load_balancing_list_ignores", {"model.moe_router_load_balancing_type=[sinkhorn]", "model.moe_aux_loss_coeff=[0.0]"},
       {"model.moe_router_load_balancing_type=[aux_loss]", "model.moe_aux_loss_coeff=[0.0]"}},
      {"moe.load_balancing_list_ignores",
       {"model.moe_router_load_balancing_type=[aux_loss,quantile_balancing]", "model.moe_aux_loss_coeff=[1e-3,0.0]"},
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=0.0"}},
      {"moe.quantile_balancing_router", {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_router_fusion=true"},
       {"model.moe_router_load_balancing_type=quantile_balancing"}},
      {"moe.quantile_balancing_router",
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_router_num_groups=4", "model.moe_router_group_topk=2"},
       {"model.moe_router_load_balancing_type=aux_loss", "model.moe_router_num_groups=4", "model.moe_router_group_topk=2"}},
      {"moe.quantile_balancing_router",  // torch's topk(k + 1) over 16 experts
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_router_topk=16"},
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_router_topk=15", "model.seq_length=512"}},
      {"moe.quantile_balancing_assignments",  // 255 tokens x top-4 over 16 experts
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.seq_length=255"},
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.seq_length=252"}},
      {"moe.quantile_balancing_ignores", {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=1e-3"},
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=0.0"}},
      {"moe.quantile_balancing_ignores",
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=0.0",
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true"},
       {"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=0.0",
        "model.moe_router_score_function=sigmoid"}},
      {"moe.topk1_needs_pre_softmax", {"model.moe_router_topk=1"},
       {"model.moe_router_topk=1", "model.moe_router_pre_softmax=true"}},
      {"moe.group_limited_routing", {"model.moe_router_group_topk=2", "model.expert_model_parallel_size=1"},
       {"model.moe_router_group_topk=2", "model.moe_router_num_groups=2"}},
      {"moe.group_limited_routing", {"model.moe_router_group_topk=2"},
       {"model.moe_router_group_topk=2", "model.moe_router_num_groups=4"}},
      // 16 experts in 8 groups of 2, top-4: one group kept cannot give its best 4 (torch's topk
      // raises); two kept give 2 each but hold 4; top-4 from 3 of 8 groups (best 1 each) is fine.
      {"moe.group_limited_routing", {"model.moe_router_num_groups=8", "model.moe_router_group_topk=1"},
       {"model.moe_router_num_groups=8", "model.moe_router_group_topk=2"}},
      {"moe.group_limited_routing", {"model.moe_router_num_groups=8", "model.moe_router_group_topk=1"},
       {"model.moe_router_num_groups=8", "model.moe_router_group_topk=3"}},
      {"moe.group_topk_above_topk", {"model.moe_router_num_groups=8", "model.moe_router_group_topk=5"},
       {"model.moe_router_num_groups=8", "model.moe_router_group_topk=4"}},
      {"parallel.ffn_divisible", {"model.moe_ffn_hidden_size=129", "model.expert_tensor_parallel_size=2", "target.num_gpus=4"},
       {"model.moe_ffn_hidden_size=128", "model.expert_tensor_parallel_size=2", "target.num_gpus=4"}},
      {"parallel.ffn_divisible", TP2 + Overrides{"model.sequence_parallel=true", "model.moe_layer_freq=[0,1]", "model.ffn_hidden_size=765"},
       TP2 + Overrides{"model.sequence_parallel=true", "model.moe_layer_freq=[0,1]", "model.ffn_hidden_size=766"}},
      {"parallel.ffn_divisible",  // all layers MoE: the dense size is not built
       TP2 + Overrides{"model.sequence_parallel=true", "model.moe_shared_expert_intermediate_size=255"},
       TP2 + Overrides{"model.sequence_parallel=true", "model.ffn_hidden_size=765"}},
      {"optimizer.adam_eps_zero", {"optimizer.adam_eps=0"}, {"optimizer.adam_eps=1e-12"}},
      {"recompute.module_names", {"model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mhcx]"},
       {"model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mhc]"}},
      {"recompute.module_names",  // Megatron reads the names only for selective recompute
       {"model.recompute_granularity=selective", "model.recompute_modules=[attn]"},
       {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1",
        "model.recompute_modules=[attn]"}},
      {"optimizer.known_optimizer", {"optimizer.optimizer=Adam"}, {"optimizer.optimizer=dist_muon"}},
      {"target.world_fills_nodes", {"target.gpu=h100", "target.num_gpus=4"},
       {"target.gpu=h100", "target.num_gpus=4", "target.gpus_per_node=4"}},
      {"target.world_fills_nodes",  // the emulated cluster runs whole nodes too; one machine's ranks pass
       {"target.gpu=cpu", "target.num_gpus=4", "target.gpus_per_node=3"},
       {"target.gpu=cpu", "target.num_gpus=4", "target.gpus_per_node=8"}},
      {"moe.expert_bias_score_function", {"model.moe_router_enable_expert_bias=true"},
       {"model.moe_router_enable_expert_bias=true", "model.moe_router_score_function=sigmoid"}},
      {"moe.capacity_settings", {"model.moe_pad_expert_input_to_capacity=true"},
       {"model.moe_pad_expert_input_to_capacity=true", "model.moe_expert_capacity_factor=1.0"}},
      {"moe.capacity_settings", {"model.moe_expert_capacity_factor=1.0", "model.moe_router_load_balancing_type=sinkhorn"},
       {"model.moe_expert_capacity_factor=1.0"}},
      {"moe.bias_needs_etp1", TP2 + Overrides{"model.add_bias_linear=true", "model.expert_tensor_parallel_size=2"},
       TP2 + Overrides{"model.add_bias_linear=true"}},
      {"moe.layer_pattern_length", {"model.moe_layer_freq=[1,1,1]"}, {"model.moe_layer_freq=[1,1]"}},
      {"moe.shared_expert_overlap_dispatcher",
       {"model.moe_token_dispatcher_type=allgather", "model.moe_shared_expert_intermediate_size=256",
        "model.moe_shared_expert_overlap=true"},
       DEEPEP + Overrides{"model.moe_shared_expert_intermediate_size=256", "model.moe_shared_expert_overlap=true"}},
      {"precision.single_dtype", {"model.fp16=true"}, {}},
      {"recompute.selective_no_num_layers", {"model.recompute_granularity=selective", "model.recompute_num_layers=1"},
       {"model.recompute_granularity=selective"}},
      {"recompute.module_needs_its_feature",
       {"model.recompute_granularity=selective", "model.recompute_modules=[moe_act]", "model.moe_grouped_gemm=false"},
       {"model.recompute_granularity=selective", "model.recompute_modules=[moe_act]", "model.moe_grouped_gemm=true"}},
      {"recompute.module_needs_its_feature",
       {"model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mla_up_proj]"},
       {"model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"}},
      {"recompute.module_needs_its_feature",
       {"model.recompute_granularity=selective", "model.recompute_modules=[shared_experts]",
        "model.moe_shared_expert_intermediate_size=256", "model.moe_shared_expert_overlap=true"},
       {"model.recompute_granularity=selective", "model.recompute_modules=[shared_experts]",
        "model.moe_shared_expert_intermediate_size=256"}},
      {"recompute.full_needs_method", {"model.recompute_granularity=full"},
       {"model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"}},
      {"recompute.full_needs_method",  // block over 0 layers recomputes none; uniform would never step
       {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=0"},
       {"model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=0"}},
      {"ep_overlap.expert_parallel", OV + Overrides{"model.expert_model_parallel_size=1"}, OV},
      {"ep_overlap.num_experts", OV + Overrides{"model.num_moe_experts=1", "model.moe_router_topk=1"},
       OV},
      {"ep_overlap.dispatcher", OV + Overrides{"model.moe_token_dispatcher_type=allgather"}, OV},
      {"ep_overlap.precision", OV + Overrides{"model.bf16=false"}, OV + Overrides{"model.bf16=false", "model.fp16=true"}},
      {"ep_overlap.torch_version", OV + H100 + Overrides{"target.torch_version=2.6.0a0+ecf3bae"},
       OV + H100 + Overrides{"target.torch_version=2.6.0"}},
      {"ep_overlap.pp_needs_vpp", OV + PP2,
       OV + PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=1"}},
      // A layout's VPP: Bridge asserts the field with a comm_overlap section; without one,
      // Megatron-Core reads the layout first.
      {"ep_overlap.pp_needs_vpp", OV + PP2 + Overrides{"model.pipeline_model_parallel_layout='E|t|t|L'"},
       PP2 + Overrides{"~comm_overlap", "model.overlap_moe_expert_parallel_comm=true",
                       "model.pipeline_model_parallel_layout='E|t|t|L'"}},
      {"ep_overlap.full_recompute",
       OV + Overrides{"model.recompute_granularity=full", "model.recompute_method=uniform",
                      "model.recompute_num_layers=1"},
       OV + Overrides{"model.recompute_granularity=selective"}},
      {"ep_overlap.recompute_method", OV + Overrides{"model.recompute_method=block"}, OV},
      {"ep_overlap.recompute_num_layers", OV + Overrides{"model.recompute_num_layers=1"}, OV},
      {"ep_overlap.recompute_moe", OV + Overrides{"model.recompute_modules=[moe,mlp]"},
       OV + Overrides{"model.recompute_modules=[mlp]"}},
      {"ep_overlap.shared_expert_overlap", OV + Overrides{"model.moe_shared_expert_overlap=true"},
       OV},
      {"ep_overlap.mtp_layers", OV + Overrides{"model.mtp_num_layers=2"},
       OV + Overrides{"model.mtp_num_layers=1"}},
      {"ep_overlap.mtp_moe", OV + Overrides{"model.mtp_num_layers=1", "model.moe_layer_freq=[1,0]"},
       OV + Overrides{"model.mtp_num_layers=1", "model.moe_layer_freq=[0,1]"}},
      {"ep_overlap.cuda_graph_moe_scope",
       OV + Overrides{"model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[mlp]"},
       OV + Overrides{"model.cuda_graph_impl=transformer_engine",
                      "model.cuda_graph_scope=[moe_router,moe_preprocess]"}},
      {"ep_overlap.dispatch_wgrad_exclusive",
       OV + Overrides{"model.overlap_dispatch_backward_with_experts_wgrad=true"},
       {"model.overlap_dispatch_backward_with_experts_wgrad=true"}},
      {"ep_overlap.dispatch_wgrad_te",
       H100 + Overrides{"model.overlap_dispatch_backward_with_experts_wgrad=true", "target.te_version=2.2.0"},
       H100 + Overrides{"model.overlap_dispatch_backward_with_experts_wgrad=true", "target.te_version=2.3.0"}},
      {"ep_overlap.early_attn_release", {"model.ep_overlap_early_attn_memory_release=true"},
       OV + Overrides{"model.ep_overlap_early_attn_memory_release=true"}},
      {"delay_wgrad.te_overlap_grad_reduce",
       DW + H100 + Overrides{"ddp.overlap_grad_reduce=true", "target.te_version=2.6.0"},
       DW + H100 + Overrides{"ddp.overlap_grad_reduce=true", "target.te_version=2.7.0"}},
      {"delay_wgrad.te_grad_accum_fusion",
       DW + H100 + Overrides{"model.gradient_accumulation_fusion=true", "target.te_version=2.6"},
       DW + H100 + Overrides{"model.gradient_accumulation_fusion=true", "target.te_version=2.8"}},
      {"delay_wgrad.needs_ep_overlap", {"comm_overlap.delay_wgrad_compute=true"}, DW},
      {"delay_wgrad.cuda_graph_te",
       DW + H100 + ATTN_GRAPH +
           Overrides{"model.gradient_accumulation_fusion=true", "target.te_version=2.11.0"},
       DW + H100 + ATTN_GRAPH +
           Overrides{"model.gradient_accumulation_fusion=true", "target.te_version=2.12.0"}},
      {"delay_wgrad.cuda_graph_grad_accum_fusion", DW + ATTN_GRAPH + Overrides{"model.gradient_accumulation_fusion=false"},
       DW + ATTN_GRAPH},
      {"delay_wgrad.cuda_graph_attn_bias",
       DW + ATTN_GRAPH + Overrides{"model.gradient_accumulation_fusion=true", "model.add_qkv_bias=true"},
       DW + ATTN_GRAPH + Overrides{"model.gradient_accumulation_fusion=true"}},
      {"delay_wgrad.te_partial_cuda_graph",
       DW + H100 + Overrides{"model.cuda_graph_impl=transformer_engine", "target.te_version=2.9.1"},
       DW + H100 + Overrides{"model.cuda_graph_impl=transformer_engine", "target.te_version=2.10.0"}},
      {"tp_overlap.tp_size", {"comm_overlap.tp_comm_overlap=true"}, {}},
      {"tp_overlap.sequence_parallel", H100 + TP2 + Overrides{"comm_overlap.tp_comm_overlap=true"},
       H100 + TP2 + Overrides{"comm_overlap.tp_comm_overlap=true", "model.sequence_parallel=true"}},
      {"tp_overlap.default_cfg",
       H100 + TP2 + Overrides{"comm_overlap.tp_comm_overlap=true", "model.sequence_parallel=true"},
       H100 + TP2 + Overrides{"model.sequence_parallel=true"}},
      {"tp_overlap.no_te",
       TP2 + Overrides{"comm_overlap.tp_comm_overlap=true", "model.sequence_parallel=true"},
       H100 + TP2 + Overrides{"comm_overlap.tp_comm_overlap=true", "model.sequence_parallel=true"}},
      // Raised when Megatron builds the model or runs its first step.
      {"pipeline.p2p_flags",
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "comm_overlap.batch_p2p_comm=true"},
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2"}},
      {"pipeline.p2p_flags", PP2 + Overrides{"comm_overlap.overlap_p2p_comm=true"}, PP2},
      {"cuda_graph.local_full_iteration_only", {"model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]"},
       {"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"}},
      {"flex.deepep_needs_tp_ep", DEEPEP + Overrides{"model.expert_model_parallel_size=1"}, DEEPEP},
      {"flex.ncclep_needs_tp_ep",
       {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep", "model.expert_model_parallel_size=1"},
       {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep"}},
      {"moe.router_fusion_te", H100 + Overrides{"model.moe_router_fusion=true", "target.te_version=2.6.0"},
       H100 + Overrides{"model.moe_router_fusion=true", "target.te_version=2.7.0.dev0"}},
      {"moe.router_fusion_te",
       H100 + Overrides{"model.moe_router_fusion=true", "model.moe_router_score_function=sqrtsoftplus",
                        "model.moe_router_enable_expert_bias=true", "target.te_version=2.12.0"},
       H100 + Overrides{"model.moe_router_fusion=true", "model.moe_router_score_function=sigmoid",
                        "model.moe_router_enable_expert_bias=true", "target.te_version=2.12.0"}},
      {"moe.permute_fusion_te", H100 + Overrides{"model.moe_permute_fusion=true", "target.te_version=2.0.0"},
       H100 + Overrides{"model.moe_permute_fusion=true", "target.te_version=2.1.0"}},
      {"fp8.te_moe", H100 + Overrides{"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "target.te_version=1.10.0"},
       H100 + Overrides{"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "target.te_version=1.11.0"}},
      {"fp8.te_moe",
       H100 + Overrides{"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "model.moe_grouped_gemm=false",
                        "target.te_version=1.6.0"},
       H100 + Overrides{"model.fp8=hybrid", "model.fp8_recipe=tensorwise", "model.moe_grouped_gemm=false",
                        "target.te_version=1.7.0"}},
      {"train.seed_positive", {"rng.seed=0"}, {"rng.seed=1"}},
      {"fp8.custom_recipe_factory",  // the dump's mixed_precision (bf16_mixed) would reset FP8
       H100 + Overrides{"mixed_precision=None", "model.fp8=hybrid", "model.fp8_recipe=custom"},
       H100 + Overrides{"mixed_precision=None", "model.fp8=hybrid", "model.fp8_recipe=custom",
                        "+model.fp8_quantizer_factory=pkg.mod.factory"},
       std::nullopt, std::nullopt, kDump},
      {"model.dropout_probability", {"model.attention_dropout=null"}, {"model.attention_dropout=0.0"}, std::nullopt,
       std::nullopt, kDump},
      {"model.dropout_probability", {"model.hidden_dropout=1.5", "model.attention_dropout=abc"},
       {"model.hidden_dropout=1.0", "model.attention_dropout=0.0"}, std::nullopt, std::nullopt, kDump},
      {"cuda_graph.te_rng_tracker", {"model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]"},
       {"model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]", "rng.te_rng_tracker=true"}},
      {"cuda_graph.scope_and_modules", TE_GRAPH + Overrides{"model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=[attn]"},
       TE_GRAPH + Overrides{"model.cuda_graph_modules=[attn]"}},
      {"cuda_graph.scope_and_modules",  // Megatron-Core's default modules, as a dump before its post-init has them
       TE_GRAPH + Overrides{"model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=[attn,mlp]"},
       TE_GRAPH + Overrides{"model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=full"}},
      {"cuda_graph.scope_and_modules",  // without a graph Bridge clears both lists first
       TE_GRAPH + Overrides{"model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=[mlp]"},
       TE_GRAPH + Overrides{"model.cuda_graph_impl=none", "model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=[mlp]"}},
      {"flex.ncclep_dropless",
       {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep",
        "model.moe_expert_capacity_factor=1.0"},
       {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep"}},
      {"moe.sinkhorn_aux_loss", {"model.moe_router_load_balancing_type=sinkhorn", "model.moe_aux_loss_coeff=0.01"},
       {"model.moe_router_load_balancing_type=sinkhorn", "model.moe_aux_loss_coeff=0.0"}},
      {"moe.shared_expert_bias", {"model.moe_shared_expert_intermediate_size=64", "model.add_bias_linear=true"},
       {"model.moe_shared_expert_intermediate_size=64"}},
      {"mtp.uniform_recompute_one_layer",
       {"model.mtp_num_layers=1", "model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=2"},
       {"model.mtp_num_layers=1", "model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"}},
      {"mtp.detach_heads_without_mtp", {"model.mtp_detach_heads=true"},
       {"model.mtp_detach_heads=true", "model.mtp_num_layers=1"}},
      {"mtp.depth_past_sequence", {"model.mtp_num_layers=3", "model.seq_length=3"},
       {"model.mtp_num_layers=2", "model.seq_length=3"}},
      {"mixed_precision.fp4_not_modelled", {"mixed_precision=bf16_with_nvfp4_mixed"}, {"mixed_precision=bf16_mixed"}},
      {"mixed_precision.overwrites_model", {"model.bf16=false", "model.fp16=true", "mixed_precision=bf16_mixed"},
       {"mixed_precision=bf16_mixed"}},
      {"comm_overlap.overwrites_model", {"model.overlap_moe_expert_parallel_comm=true"},
       {"~comm_overlap", "model.overlap_moe_expert_parallel_comm=true"}},
      // DP 2: comm_overlap's optimizer defaults (overlap on, 128 Mi buckets) replace the ddp section's.
      {"comm_overlap.overwrites_ddp",
       {"target.num_gpus=4", "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=false"},
       {"target.num_gpus=4", "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=false",
        "comm_overlap.overlap_grad_reduce=false"}},
      {"comm_overlap.overwrites_ddp",
       {"target.num_gpus=4", "ddp.use_distributed_optimizer=true", "ddp.bucket_size=200000"},
       {"target.num_gpus=4", "ddp.use_distributed_optimizer=true", "ddp.bucket_size=134217728"}},
      {"flex.deprecated_sm_knob", {"model.moe_deepep_num_sms=20"}, {}},
      {"flex.conflicting_sm_knobs", {"model.moe_deepep_num_sms=20", "model.moe_hybridep_num_sms=16"},
       {"model.moe_deepep_num_sms=20", "model.moe_hybridep_num_sms=20"}},
      {"flex.apply_not_moe", {"~model.num_moe_experts", "model.expert_model_parallel_size=1"},
       {}, "deepep", "deepep"},
      {"flex.apply_fallback", {"target.gpu=gb200"}, {"target.gpu=h100"}, "deepep", "deepep"},
      {"flex.no_backend", {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=null"},
       DEEPEP},
      {"flex.deepep_gpu", DEEPEP + Overrides{"target.gpu=gb200"}, DEEPEP + H100},
      {"flex.hybridep_gpu", HYBRIDEP + Overrides{"target.gpu=v100"}, HYBRIDEP + H100},
      {"flex.backend_without_flex", {"model.moe_flex_dispatcher_backend=hybridep"}, {}},
      {"flex.backend_needs_flex", {"model.moe_flex_dispatcher_backend=ncclep"},
       {"model.moe_flex_dispatcher_backend=ncclep", "model.moe_token_dispatcher_type=flex"}},
      {"flex.backend_needs_flex",
       DEEPEP + Overrides{"model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"},
       DEEPEP + Overrides{"model.moe_expert_capacity_factor=1.0"}},
      {"flex.runtime_package", DEEPEP + H100, DEEPEP},
      {"flex.cpu_backend", {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep"},
       DEEPEP},
      {"hybridep.topology",
       HYBRIDEP + GB200_EP + Overrides{"model.expert_model_parallel_size=128", "target.num_gpus=128"},
       HYBRIDEP + GB200_EP + Overrides{"model.expert_model_parallel_size=64", "target.num_gpus=64"}},
      {"hybridep.domain_divides_ep",
       HYBRIDEP + Overrides{"+env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=3"}, HYBRIDEP},
      {"hybridep.tokens_per_chunk", HYBRIDEP + Overrides{"+env_vars.NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API=0"},
       HYBRIDEP + Overrides{"+env_vars.NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API=32"}},
      {"hybridep.tokens_per_chunk", HYBRIDEP + Overrides{"+env_vars.NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API=abc"}, HYBRIDEP},
      {"hybridep.domain_mismatch",
       HYBRIDEP + H100 + Overrides{"+env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=1"},
       HYBRIDEP + H100},
      {"hybridep.env_without_hybridep", {"+env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8"}, {}},
      {"advice.small_ep_overlap", OV, OV + DEEPEP},
      {"advice.few_microbatches", OV + Overrides{"train.global_batch_size=2"}, OV},
      {"ddp.embedding_rows", {"ddp.reduce_embedding_rows=true", "ddp.overlap_grad_reduce=false"},
       {"ddp.reduce_embedding_rows=true", "ddp.overlap_grad_reduce=true"}},
      // With the distributed optimizer the comm_overlap section's value replaces ddp's: the fix goes there.
      // (its default at DP 1 is off).
      {"ddp.embedding_rows",
       {"target.num_gpus=1", "model.expert_model_parallel_size=1", "ddp.reduce_embedding_rows=true",
        "ddp.overlap_grad_reduce=true", "ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true"},
       {"target.num_gpus=1", "model.expert_model_parallel_size=1", "ddp.reduce_embedding_rows=true",
        "comm_overlap.overlap_grad_reduce=true", "ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true"}},
      // Tied on one stage the table holds the head's gradient too; over stages the copy does.
      {"ddp.embedding_rows",
       {"ddp.reduce_embedding_rows=true", "ddp.overlap_grad_reduce=true", "model.share_embeddings_and_output_weights=true"},
       PP2 + Overrides{"ddp.reduce_embedding_rows=true", "ddp.overlap_grad_reduce=true",
                       "model.share_embeddings_and_output_weights=true"}},
      {"pipeline.defer_embedding_wgrad", {"comm_overlap.defer_embedding_wgrad_compute=true"}, {}},
      {"pipeline.defer_embedding_wgrad", {"~comm_overlap", "model.defer_embedding_wgrad_compute=true"}, {"~comm_overlap"}},
      {"pipeline.defer_embedding_wgrad", PP2 + Overrides{"comm_overlap.defer_embedding_wgrad_compute=true"},
       PP2 + Overrides{"comm_overlap.defer_embedding_wgrad_compute=true", "model.gradient_accumulation_fusion=true",
                       "comm_overlap.wgrad_deferral_limit=0"}},
      {"pipeline.defer_embedding_wgrad",
       PP2 + Overrides{"comm_overlap.defer_embedding_wgrad_compute=true", "model.gradient_accumulation_fusion=true"},
       PP2 + Overrides{"comm_overlap.defer_embedding_wgrad_compute=true", "model.gradient_accumulation_fusion=true",
                       "comm_overlap.wgrad_deferral_limit=0"}},
      {"parallel.vpp_needs_pp", {"model.pipeline_model_parallel_layout=Et|tL"},  // two stages: VPP 2 at PP 1
       {"model.pipeline_model_parallel_layout=EttL"}},
      {"parallel.vpp_needs_pp", {"model.virtual_pipeline_model_parallel_size=2"},
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4"}},
      {"pipeline.interleaved_microbatches",
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4", "train.global_batch_size=2"},
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4"}},
      {"pipeline.interleaved_microbatches",  // 4 micro-batches in groups of 3 leave 1, under PP
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4",
                       "model.microbatch_group_size_per_vp_stage=3"},
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4",
                       "model.microbatch_group_size_per_vp_stage=4"}},
      {"pipeline.interleaved_microbatches",  // a group smaller than PP
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4",
                       "model.microbatch_group_size_per_vp_stage=1"},
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4"}},
      {"pipeline.interleaved_microbatches",  // the VPP Megatron-Core reads from a layout of 2 stages per rank
       PP2 + Overrides{"model.pipeline_model_parallel_layout=Et|t|t|tL", "model.num_layers=4", "train.global_batch_size=2"},
       PP2 + Overrides{"model.pipeline_model_parallel_layout=Et|t|t|tL", "model.num_layers=4"}},
      {"advice.pp_without_vpp", PP2,
       PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4"}},
      {"advice.full_recompute",
       {"model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"},
       {}},
      {"advice.full_graph_dropless", {"model.cuda_graph_impl=full_iteration"},
       {"model.cuda_graph_impl=full_iteration", "model.moe_expert_capacity_factor=1.0"}},
      // local is per-layer graphs; with the legacy full_iteration scope it is the whole step.
      {"advice.full_graph_dropless", {"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"},
       {"model.cuda_graph_impl=local"}},
  };
  return all;
}

TEST(CheckRules, BaseConfigIsClean) {
  const CheckReport r = check({});
  EXPECT_TRUE(r.findings.empty()) << format_report(r);
  EXPECT_TRUE(r.ok());
}

TEST(CheckRules, EveryRuleHasBothSides) {
  std::set<std::string> covered;
  for (const auto& c : cases()) covered.insert(c.rule);
  for (const auto& rule : rules()) EXPECT_TRUE(covered.count(rule.id)) << "no test case: " << rule.id;
  EXPECT_EQ(covered.size(), rules().size()) << "a case names a rule that does not exist";
}

TEST(CheckRules, EachCaseTripsAndPasses) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.rule);
    const Rule* rule = find_rule(c.rule);
    ASSERT_NE(rule, nullptr);
    const CheckReport tripped = check(c.trips, c.flag_trips, c.base);
    const Finding* f = find(tripped, c.rule);
    ASSERT_NE(f, nullptr) << format_report(tripped);
    EXPECT_EQ(f->severity, rule->severity);
    EXPECT_FALSE(f->message.empty());
    EXPECT_FALSE(f->values.empty());
    if (rule->severity == Severity::error) {
      EXPECT_FALSE(tripped.ok());
    }
    const CheckReport passed = check(c.passes, c.flag_passes, c.base);
    EXPECT_EQ(find(passed, c.rule), nullptr) << format_report(passed);
  }
}

TEST(CheckRules, BridgeMessagesVerbatim) {
  auto message = [](const Overrides& o, const std::string& id) {
    const CheckReport r = check(o);
    const Finding* f = find(r, id);
    return f ? f->message : "(none)";
  };
  EXPECT_EQ(message(OV + PP2, "ep_overlap.pp_needs_vpp"),
            "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified "
            "when pipeline_model_parallel_size > 1");
  {  // Bridge asks before Megatron-Core reads the VPP from a layout: the fix gives the layout's.
    const CheckReport r =
        check(OV + PP2 + Overrides{"model.num_layers=4", "model.pipeline_model_parallel_layout=E|t|t|t|t|L"});
    const Finding* f = find(r, "ep_overlap.pp_needs_vpp");
    ASSERT_NE(f, nullptr) << format_report(r);
    EXPECT_EQ(f->fix, "model.virtual_pipeline_model_parallel_size=3");
  }
  EXPECT_EQ(message(OV + Overrides{"model.moe_shared_expert_overlap=true"},
                    "ep_overlap.shared_expert_overlap"),
            "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm");
  EXPECT_EQ(message({"comm_overlap.delay_wgrad_compute=true"}, "delay_wgrad.needs_ep_overlap"),
            "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute");
  EXPECT_EQ(message(DEEPEP + Overrides{"target.gpu=gb200"}, "flex.deepep_gpu"),
            "DeepEP is supported for Ampere, Hopper, and Blackwell (B200/B300) GPUs. Current GPU: "
            "NVIDIA GB200");
  EXPECT_EQ(message({"comm_overlap.tp_comm_overlap=true"}, "tp_overlap.tp_size"),
            "Disabling tensor parallel communication overlap due to TP size < 2.");
}

TEST(CheckRules, FixesAreOverridesThatApply) {
  // A fix that is an override must itself load: paste it and the finding goes away.
  for (const auto& c : cases()) {
    const CheckReport r = check(c.trips, c.flag_trips, c.base);
    const Finding* f = find(r, c.rule);
    if (!f || f->fix.empty() || f->fix.find('<') != std::string::npos || f->fix.starts_with("--"))
      continue;
    SCOPED_TRACE(c.rule + " fix: " + f->fix);
    Overrides fixed = c.trips;
    size_t start = 0;
    while (start < f->fix.size()) {
      size_t end = f->fix.find(' ', start);
      if (end == std::string::npos) end = f->fix.size();
      fixed.push_back(f->fix.substr(start, end - start));
      start = end + 1;
    }
    const CheckReport after = check(fixed, c.flag_trips, c.base);
    EXPECT_EQ(find(after, c.rule), nullptr) << format_report(after);
  }
}

TEST(CheckRules, MtpLayersSitInTheLastChunkOfOneRank) {
  // Megatron-Core's validate_layer_layout: MTP only in a rank's last virtual stage, all of it.
  const auto layout_error = [](const std::string& layout, int mtp) {
    const CheckReport r = check({"model.pipeline_model_parallel_size=2", "target.num_gpus=4", "model.num_layers=4",
                                 fmt::format("model.mtp_num_layers={}", mtp),
                                 "model.pipeline_model_parallel_layout=" + layout});
    const Finding* f = find(r, "pipeline.layout");
    return f ? f->message : std::string("(none)");
  };
  // Four virtual stages over PP 2: chunk 0 of ranks 0 and 1, then chunk 1 of each.
  EXPECT_EQ(layout_error("Ettt|tm||L", 1).rfind("Currently we restrict that the MTP should be always in the last", 0), 0u)
      << layout_error("Ettt|tm||L", 1);
  EXPECT_EQ(layout_error("Ett|tt|m|mL", 2), "All of the MTP layers must be in the same one virtual pipeline stage");
  EXPECT_EQ(layout_error("Ett|tt||mL", 1), "(none)");
  EXPECT_EQ(layout_error("Ett|ttmL", 1), "(none)");
  // A count that misses the layout's m: the fix is the layout's count where the m share a stage.
  const auto count_fix = [](const std::string& layout, const std::string& mtp) {
    const CheckReport r = check({"model.pipeline_model_parallel_size=2", "target.num_gpus=4", "model.num_layers=4",
                                 "model.mtp_num_layers=" + mtp, "model.pipeline_model_parallel_layout=" + layout});
    const Finding* f = find(r, "pipeline.layout");
    return f ? f->fix : std::string("(none)");
  };
  EXPECT_EQ(count_fix("Ett|ttmmL", "null"), "model.mtp_num_layers=2");
  EXPECT_EQ(count_fix("Ett|ttL", "1"), "model.mtp_num_layers=null");
  EXPECT_EQ(count_fix("Ett|tt|m|mL", "1").rfind("model.pipeline_model_parallel_layout=", 0), 0u) << count_fix("Ett|tt|m|mL", "1");
  // Misplaced m (before a decoder layer; in chunk 0 of rank 1 under VPP 2): the layout's fix.
  for (const char* misplaced : {"Emtt|ttL", "Et|tm|t|tL"})
    EXPECT_EQ(count_fix(misplaced, "null").rfind("model.pipeline_model_parallel_layout=", 0), 0u) << count_fix(misplaced, "null");
}

TEST(CheckRules, AMisspeltFieldOfABridgeDumpIsFlagged) {
  // Unmodelled fields of a tagged section are kept; one a letter from a modelled field is a typo
  // that leaves the real field at its default. The shipped dump's own fields raise nothing.
  Config dump = load_config_file(kDump);
  EXPECT_EQ(find(run_check(dump), "config.misspelt_field"), nullptr);
  for (const std::string real : {"+model.fp4=null", "+model.fp4_recipe=nvfp4", "+model.fp4_param=false",
                                  "+scheduler.lr_decay_steps=51200", "+scheduler.lr_warmup_steps=10240"})
    apply_override(dump, real);  // Megatron's and Bridge's own fields, a letter or two from modelled ones
  EXPECT_EQ(find(run_check(dump), "config.misspelt_field"), nullptr);
  apply_override(dump, "+model.moe_router_top_k=4");
  const CheckReport r = run_check(dump);
  const Finding* f = find(r, "config.misspelt_field");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->values, (std::vector<std::pair<std::string, std::string>>{{"model.moe_router_top_k", "4"},
                                                                         {"model.moe_router_topk", "8"}}));
  EXPECT_EQ(f->fix, "model.moe_router_topk=4 ~model.moe_router_top_k");
  apply_override(dump, "model.moe_router_topk=4");
  apply_override(dump, "~model.moe_router_top_k");
  EXPECT_EQ(find(run_check(dump), "config.misspelt_field"), nullptr);
}

TEST(CheckRules, AWorldSizeFixFoldsBothSides) {
  // TP 2 and EP 3 on 8 GPUs: 9 would fold the experts but not TP; the fix is a multiple of both.
  const Overrides o = {"model.tensor_model_parallel_size=2", "model.expert_model_parallel_size=3",
                       "model.num_moe_experts=6", "target.num_gpus=8"};
  const CheckReport r = check(o);
  const Finding* f = find(r, "parallel.expert_world_divisible");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->fix, "target.num_gpus=12");
  const CheckReport after = check(o + Overrides{f->fix});
  EXPECT_EQ(find(after, "parallel.expert_world_divisible"), nullptr);
  EXPECT_EQ(find(after, "parallel.world_divisible"), nullptr);
  // EP that does not divide the experts: the nearest divisor.
  const CheckReport e = check({"model.expert_model_parallel_size=3", "target.num_gpus=3"});
  ASSERT_NE(find(e, "parallel.experts_divisible_by_ep"), nullptr);
  EXPECT_EQ(find(e, "parallel.experts_divisible_by_ep")->fix, "model.expert_model_parallel_size=4");
}

TEST(CheckRules, EveryPipelineSplitThatFailsGetsAFixThatSplits) {
  // Layer counts, PP and VPP sizes, uneven stages, the embedding / loss counted and MTP: where the
  // layers do not split, the fix is concrete (no placeholder) and pasting it clears the finding.
  int failing = 0;
  for (const int layers : {1, 2, 3, 5, 7, 12, 13, 61})
    for (const int pp : {1, 2, 3, 4})
      for (const std::string vpp : {"null", "2", "3"})
        for (const Overrides& more : {Overrides{}, Overrides{"model.num_layers_in_first_pipeline_stage=1"},
                                      Overrides{"model.account_for_loss_in_pipeline_split=true"},
                                      Overrides{"model.mtp_num_layers=1"}}) {  // a layout puts it beside the loss
          Overrides o = {fmt::format("model.num_layers={}", layers), fmt::format("model.pipeline_model_parallel_size={}", pp),
                         "model.virtual_pipeline_model_parallel_size=" + vpp, fmt::format("target.num_gpus={}", 2 * pp)};
          o.insert(o.end(), more.begin(), more.end());
          const CheckReport before = check(o);
          const Finding* f = find(before, "parallel.layers_divisible_by_pp");
          if (!f) continue;
          ++failing;
          SCOPED_TRACE(fmt::format("{} -> fix: {}", fmt::join(o, " "), f->fix));
          ASSERT_EQ(f->fix.find('<'), std::string::npos);
          for (size_t start = 0; start < f->fix.size();) {
            const size_t end = std::min(f->fix.find(' ', start), f->fix.size());
            o.push_back(f->fix.substr(start, end - start));
            start = end + 1;
          }
          const CheckReport after = check(o);
          EXPECT_EQ(find(after, "parallel.layers_divisible_by_pp"), nullptr) << format_report(after);
          EXPECT_EQ(find(after, "pipeline.layout"), nullptr) << format_report(after);
        }
  EXPECT_GT(failing, 100);
}

TEST(CheckRules, OverlapSetOnlyOnTheModelGetsMegatronCoreChecks) {
  // No comm_overlap section: Bridge's asserts do not run, Megatron-Core's do, with its words.
  const Overrides model_only = {"~comm_overlap", "model.overlap_moe_expert_parallel_comm=true"};
  CheckReport r = check(model_only + Overrides{"model.expert_model_parallel_size=1",
                                               "model.num_moe_experts=1", "model.moe_router_topk=1"});
  const Finding* f = find(r, "ep_overlap.expert_parallel");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->message, "overlap_moe_expert_parallel_comm is only supported with expert model parallelism");
  EXPECT_EQ(f->fix, "model.overlap_moe_expert_parallel_comm=false");
  EXPECT_EQ(find(r, "ep_overlap.num_experts"), nullptr);  // Megatron-Core has no such check

  // delay_wgrad with the model's overlap switch passes Bridge's assert, then comm_overlap
  // overwrites the switch and Megatron-Core rejects it.
  r = check({"model.overlap_moe_expert_parallel_comm=true", "comm_overlap.delay_wgrad_compute=true"});
  f = find(r, "delay_wgrad.needs_ep_overlap");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->message,
            "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute");
  // Bridge's delay_wgrad TE rules do not run without comm_overlap asking for delay_wgrad.
  r = check({"~comm_overlap", "model.overlap_moe_expert_parallel_comm=true",
             "model.delay_wgrad_compute=true", "model.gradient_accumulation_fusion=true",
             "target.gpu=h100", "target.te_version=2.6.0"});
  EXPECT_EQ(find(r, "delay_wgrad.te_grad_accum_fusion"), nullptr) << format_report(r);
}

TEST(CheckRules, UnknownEnvironmentIsReportedNotGuessed) {
  const CheckReport r = check(OV + H100);
  EXPECT_EQ(find(r, "ep_overlap.torch_version"), nullptr);
  ASSERT_EQ(r.unchecked.size(), 1u);
  EXPECT_NE(r.unchecked[0].find("--torch-version"), std::string::npos);
  // epx's own CPU runtime has no torch: the rule does not apply there.
  EXPECT_TRUE(check(OV).unchecked.empty());
}

TEST(CheckRules, UnusableEnvironmentThrows) {
  EXPECT_THROW(check({"target.gpu=h900"}), ConfigError);
  EXPECT_THROW(check({"target.torch_version=latest"}), ConfigError);
}

// A size or rate outside what it can mean is refused as bad input naming the field, not passed
// (a zero-width model, a negative learning rate) or judged by a divisibility rule (EP 0: "not
// divisible by 0").
TEST(CheckRules, ValuesOutOfRangeAreRefused) {
  for (const std::string kv :
       {"model.expert_model_parallel_size=0", "model.context_parallel_size=-1", "model.seq_length=0",
        "model.vocab_size=0", "model.moe_ffn_hidden_size=-4", "model.num_layers=-1",
        "train.global_batch_size=0", "train.train_iters=-5", "target.num_gpus=-2",
        "model.hidden_size=16777217", "scheduler.lr_warmup_iters=-1", "optimizer.lr=-1e-4",
        "optimizer.adam_beta2=1", "optimizer.weight_decay=-0.1", "model.moe_expert_capacity_factor=0",
        "model.moe_router_num_groups=-4", "model.qk_head_dim=-1", "model.q_lora_rank=0",
        "model.moe_flex_dispatcher_num_sms=-1", "model.moe_deepep_num_sms=-9223372036854775808", "ddp.bucket_size=0",
        "comm_overlap.bucket_size=-1", "train.eval_iters=-1", "model.mtp_num_layers=-1",
        "model.recompute_num_layers=-1"}) {
    SCOPED_TRACE(kv);
    try {
      check({kv});
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      const std::string key = kv.substr(0, kv.find('='));
      EXPECT_NE(std::string(e.what()).find(key + "="), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
    }
  }
  // 0 leaves the model's shape not given; the least values pass; nan and inf are no numbers.
  EXPECT_TRUE(check({"model.seq_length=1", "train.train_iters=1", "optimizer.lr=0", "optimizer.min_lr=0", "optimizer.adam_beta1=0",
                     "scheduler.lr_warmup_iters=0"})
                  .ok());
  EXPECT_THROW(load_with(kBase, {"optimizer.lr=nan"}), ConfigError);  // by the schema, before any range
  EXPECT_THROW(load_with(kBase, {"optimizer.clip_grad=inf"}), ConfigError);
  EXPECT_THROW(load_with(kBase, {"comm_overlap.tp_comm_bootstrap_backend=abc"}), ConfigError);  // nccl|mpi|gloo
  // A subnormal is a number (std::stod refused it: an internal error).
  EXPECT_NO_THROW(check({"optimizer.lr=1e-320", "optimizer.min_lr=0", "model.layernorm_epsilon=1e-310"}));
  // The shape is all three sizes or none: one left 0 beside the others is a size left out.
  EXPECT_NO_THROW(check({"model.num_layers=0", "model.hidden_size=0", "model.num_attention_heads=0"}));
  for (const char* left_out : {"model.num_layers=0", "model.hidden_size=0", "model.num_attention_heads=0"}) {
    try {
      check({left_out});
      ADD_FAILURE() << left_out << " passed";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("a model shape needs num_layers, hidden_size and num_attention_heads all set"),
                std::string::npos)
          << e.what();
    }
  }
}
TEST(PipelineLayout, ParsedAsMegatronCore) {
  // DeepSeek-V3's: the embedding and one layer, 30 stages of two, then the MTP layer and the loss.
  const std::vector<std::string> v3 = parse_pipeline_layout("Et|(tt|)*30mL");
  ASSERT_EQ(v3.size(), 32u);
  EXPECT_EQ(v3.front(), "Et");
  EXPECT_EQ(v3[1], "tt");
  EXPECT_EQ(v3.back(), "mL");
  EXPECT_EQ(parse_pipeline_layout("Et*3,|t|L"), (std::vector<std::string>{"Ettt", "t", "L"}));
  EXPECT_EQ(parse_pipeline_layout("(|t)*2"), (std::vector<std::string>{"", "t", "t"}));
  try {
    parse_pipeline_layout("Et|tx|L");
    FAIL() << "an unknown layer was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "Invalid layer character: x (stage='tx', layout_str='Et|tx|L'), known layer "
                                     "characters: ['E', 'L', 't', 'm']");
  }
  EXPECT_THROW(parse_pipeline_layout("t*99999999"), ConfigError);
  EXPECT_THROW(parse_pipeline_layout("Et*(9)*100000L"), ConfigError);  // 100000 digits: scanned, no recursion
  EXPECT_EQ(parse_pipeline_layout("t*003|t"), (std::vector<std::string>{"ttt", "t"}));  // int("003") is 3
  EXPECT_EQ(parse_pipeline_layout(std::string(60000, 't')).front().size(), 60000u);
}

TEST(Versions, Pep440Ordering) {
  EXPECT_TRUE(version_at_least("2.6.0", "2.6.0"));
  EXPECT_TRUE(version_at_least("2.10.1", "2.6.0"));
  EXPECT_FALSE(version_at_least("2.5.1", "2.6.0"));
  EXPECT_FALSE(version_at_least("2.6.0a0+ecf3bae40a", "2.6.0"));
  EXPECT_TRUE(version_at_least("2.7.0a0+git1234", "2.6.0"));
  EXPECT_TRUE(version_at_least("2.6", "2.6.0"));
  EXPECT_FALSE(version_at_least("2.12.0rc1", "2.12.0"));
  EXPECT_TRUE(version_at_least("2.12.0rc1", "2.12.0a0"));
  EXPECT_THROW(version_at_least("abc", "1.0"), ConfigError);
}

// ---- Finalize: Bridge's derived fields --------------------------------------------------------

Config resolved(const Overrides& o, const OptString& flag = std::nullopt) {
  return resolve_config(load_with(kBase, o), flag);
}

TEST(Finalize, DataParallelSizeAndEtp) {
  const Config c = resolved({"target.num_gpus=8", "model.tensor_model_parallel_size=2"});
  EXPECT_EQ(c.comm_overlap->data_parallel_size, 4);
  EXPECT_EQ(c.model.expert_tensor_parallel_size, 1);  // set in the recipe
  const Config d = resolved({"~model.expert_tensor_parallel_size"});
  EXPECT_EQ(d.model.expert_tensor_parallel_size, 1);  // EP > 1: Bridge's default 1
  const Config e = resolved({"~model.expert_tensor_parallel_size", "model.expert_model_parallel_size=1",
                             "model.tensor_model_parallel_size=2"});
  EXPECT_EQ(e.model.expert_tensor_parallel_size, 2);  // EP = 1: MCore defaults ETP to TP
  EXPECT_EQ(*resolved({}).model.recompute_modules, StringList{"core_attn"});
}

TEST(Finalize, PipelineP2pDefaults) {
  const Config plain = resolved(PP2);
  EXPECT_FALSE(plain.model.overlap_p2p_comm);
  EXPECT_TRUE(plain.model.batch_p2p_comm);
  const Config interleaved = resolved(PP2 + Overrides{"model.virtual_pipeline_model_parallel_size=2"});
  EXPECT_TRUE(interleaved.model.overlap_p2p_comm);
  EXPECT_FALSE(interleaved.model.batch_p2p_comm);
  const Config no_pp = resolved({});
  EXPECT_FALSE(no_pp.model.overlap_p2p_comm);
  EXPECT_FALSE(no_pp.model.batch_p2p_comm);
  const Config user = resolved(PP2 + Overrides{"comm_overlap.overlap_p2p_comm=true"});
  EXPECT_TRUE(user.model.overlap_p2p_comm);  // user values win over computed defaults
  // Without a comm_overlap section Bridge computes nothing: MCore's defaults stay.
  const Config none = resolved(PP2 + Overrides{"~comm_overlap"});
  EXPECT_TRUE(none.model.batch_p2p_comm);
}

TEST(Finalize, DataParallelOverlapDefaults) {
  const Config c = resolved(PP2 + Overrides{"target.num_gpus=8", "model.virtual_pipeline_model_parallel_size=2",
                                            "ddp.use_distributed_optimizer=true"});
  EXPECT_EQ(c.ddp.bucket_size, 128LL * 1024 * 1024);
  EXPECT_TRUE(c.ddp.overlap_grad_reduce);
  EXPECT_TRUE(c.ddp.overlap_param_gather);
  EXPECT_TRUE(c.ddp.align_param_gather);
  EXPECT_TRUE(c.optimizer.overlap_param_gather);
  EXPECT_FALSE(c.optimizer.overlap_param_gather_with_optimizer_step);
  const Config user = resolved({"ddp.use_distributed_optimizer=true",
                                "comm_overlap.overlap_grad_reduce=false"});
  EXPECT_FALSE(user.ddp.overlap_grad_reduce);
  EXPECT_TRUE(user.ddp.overlap_param_gather);
  const Config dp1 = resolved({"ddp.use_distributed_optimizer=true", "target.num_gpus=1",
                               "model.expert_model_parallel_size=1"});
  EXPECT_FALSE(dp1.ddp.overlap_grad_reduce);
  EXPECT_FALSE(dp1.ddp.bucket_size.has_value());
  const Config no_dist_opt = resolved({});
  EXPECT_FALSE(no_dist_opt.ddp.overlap_grad_reduce);
}

TEST(Finalize, CommOverlapDrivesTheModel) {
  const Config on = resolved(DW);
  EXPECT_TRUE(on.model.overlap_moe_expert_parallel_comm);
  EXPECT_TRUE(on.model.delay_wgrad_compute);
  const Config overwritten = resolved({"model.overlap_moe_expert_parallel_comm=true"});
  EXPECT_FALSE(overwritten.model.overlap_moe_expert_parallel_comm);
  const Config model_only = resolved({"~comm_overlap", "model.overlap_moe_expert_parallel_comm=true"});
  EXPECT_TRUE(model_only.model.overlap_moe_expert_parallel_comm);
  const Config tp = resolved({"comm_overlap.tp_comm_overlap=true"});
  EXPECT_FALSE(tp.model.tp_comm_overlap);
  EXPECT_FALSE(tp.comm_overlap->tp_comm_overlap);
}

TEST(Finalize, NegativeCapacityFactorIsDropless) {
  EXPECT_FALSE(resolved({"model.moe_expert_capacity_factor=-1"}).model.moe_expert_capacity_factor);
  EXPECT_EQ(resolved({"model.moe_expert_capacity_factor=1.5"}).model.moe_expert_capacity_factor, 1.5);
}

// Bridge clears the graph lists without a graph; Megatron-Core moves the legacy scope into the
// modules and the deprecated full_iteration module into cuda_graph_impl, where its asserts pass.
TEST(Finalize, CudaGraphListsAsMegatronResolvesThem) {
  const Config none = resolved({"model.cuda_graph_impl=none", "model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=[mlp]"});
  EXPECT_TRUE(none.model.cuda_graph_scope.empty());
  EXPECT_TRUE(none.model.cuda_graph_modules.empty());
  const Config legacy = resolved({"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"});
  EXPECT_EQ(legacy.model.cuda_graph_impl, "full_iteration");
  EXPECT_TRUE(legacy.model.cuda_graph_scope.empty());
  EXPECT_TRUE(legacy.model.cuda_graph_modules.empty());
  const Config te = resolved({"model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn,moe_router]"});
  EXPECT_EQ(te.model.cuda_graph_modules, (StringList{"attn", "moe_router"}));
  EXPECT_TRUE(te.model.cuda_graph_scope.empty());
  // Where an assert fails, nothing moves, and the rule sees the config as written.
  const Config both = resolved({"model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]",
                                "model.cuda_graph_modules=[mlp]"});
  EXPECT_EQ(both.model.cuda_graph_scope, StringList{"attn"});
  const Config rest = resolved({"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration,attn]"});
  EXPECT_EQ(rest.model.cuda_graph_impl, "local");
  EXPECT_EQ(rest.model.cuda_graph_modules, (StringList{"full_iteration", "attn"}));
}

// Megatron-Core's FFN defaults: 4 x hidden, and the experts' the dense width.
TEST(Finalize, FfnWidthsAsMegatronCoreDefaultsThem) {
  const Config c = resolved({"model.ffn_hidden_size=null", "model.moe_ffn_hidden_size=null", "model.hidden_size=96"});
  EXPECT_EQ(c.model.ffn_hidden_size, 384);
  EXPECT_EQ(c.model.moe_ffn_hidden_size, 384);
  EXPECT_EQ(resolved({"model.moe_ffn_hidden_size=null", "model.ffn_hidden_size=200"}).model.moe_ffn_hidden_size, 200);
}

TEST(Finalize, FlexBackendSteps) {
  const Config folded = resolved({"model.moe_hybridep_num_sms=24"});
  EXPECT_EQ(folded.model.moe_flex_dispatcher_num_sms, 24);
  const Config fallback = resolved({"model.moe_token_dispatcher_type=flex", "~model.moe_flex_dispatcher_backend",
                                    "model.moe_flex_dispatcher_backend=null"});
  EXPECT_EQ(fallback.model.moe_token_dispatcher_type, "alltoall");
  const Config applied = resolved({"model.moe_shared_expert_overlap=true"}, "hybridep");
  EXPECT_EQ(applied.model.moe_token_dispatcher_type, "flex");
  EXPECT_EQ(applied.model.moe_flex_dispatcher_backend, "hybridep");
  EXPECT_FALSE(applied.model.moe_shared_expert_overlap);
  EXPECT_TRUE(applied.model.moe_hybridep_pad_uneven_dispatch_inputs);
  EXPECT_EQ(applied.env_vars.at("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"), "2");
  const Config gb = resolved(H100 + Overrides{"target.num_gpus=16", "model.expert_model_parallel_size=16",
                                              "train.global_batch_size=16"},
                             "hybridep");
  EXPECT_EQ(gb.env_vars.at("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"), "8");
  EXPECT_EQ(gb.env_vars.at("NVLINK_DOMAIN_SIZE"), "8");
  EXPECT_EQ(gb.env_vars.at("USE_MNNVL"), "0");
  const Config fell_back = resolved({"target.gpu=gb200"}, "deepep");
  EXPECT_EQ(fell_back.model.moe_token_dispatcher_type, "alltoall");
  EXPECT_FALSE(fell_back.model.moe_flex_dispatcher_backend.has_value());
}

TEST(Report, JsonAndTextAgree) {
  const CheckReport r = check(OV + PP2);
  const auto j = report_json(r);
  EXPECT_EQ(j["verdict"], "fail");
  EXPECT_EQ(j["errors"].get<int>(), r.count(Severity::error));
  EXPECT_EQ(j["findings"].size(), r.findings.size());
  const std::string text = format_report(r);
  EXPECT_NE(text.find("verdict: FAIL"), std::string::npos);
  for (const auto& f : r.findings) EXPECT_NE(text.find(f.rule_id), std::string::npos);
  // Errors come first.
  EXPECT_EQ(r.findings.front().severity, Severity::error);
}

}  // namespace
}  // namespace epx
