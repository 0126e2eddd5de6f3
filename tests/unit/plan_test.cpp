// The planner against Megatron's FLOPs formula and the published runs of the reference
// (../shared/reference/planner.md): one hardware description must explain them all.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "epx/check/pipeline_split.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "epx/model/gpt_model.hpp"
#include "epx/plan/diagnose.hpp"
#include "epx/plan/pipeline_balance.hpp"
#include "epx/plan/run_evidence.hpp"
#include "epx/plan/plan.hpp"
#include "epx/plan/search.hpp"
#include "epx/plan/step_time.hpp"
#include "epx/train/job_spec.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

Config resolved(const std::string& recipe, const std::vector<std::string>& overrides) {
  const CheckReport r = run_check(test::load_with(recipe, overrides));
  EXPECT_TRUE(r.ok()) << format_report(r);
  return r.resolved;
}

double rel(double predicted, double measured) { return std::abs(predicted / measured - 1); }

TEST(Plan, ModelFlopsAreMegatrons) {
  // num_floating_point_operations at seq 4096 (reference values, GFLOP per token).
  EXPECT_LT(rel(model_flops(resolved("qwen3_30b_a3b", {})).per_token() / 1e9, 23.006), 0.005);
  EXPECT_LT(rel(model_flops(resolved("qwen3_235b_a22b", {})).per_token() / 1e9, 148.03), 0.005);
  EXPECT_LT(rel(model_flops(resolved("deepseek_v3", {})).per_token() / 1e9, 259.99), 0.005);  // one MTP layer
  EXPECT_LT(rel(model_flops(resolved("deepseek_v3", {"model.mtp_num_layers=null", "model.pipeline_model_parallel_layout=Et|(tt|)*30L"})).per_token() / 1e9, 249.81), 0.005);
  // epx run's count is the planner's: its TFLOP/s compare 1:1 with Megatron's log and the plan.
  // (deepseek_v3_proxy: a dense first layer and a shared expert.)
  for (const char* recipe :
       {"qwen3_30b_a3b_proxy", "qwen3_30b_a3b_medium", "qwen3_30b_a3b", "deepseek_v3_proxy", "deepseek_v3_mla_proxy"}) {
    for (const char* gated : {"model.gated_linear_unit=true", "model.gated_linear_unit=false"}) {
      const Config c = resolved(recipe, {"target.num_gpus=16", "train.global_batch_size=64", gated});
      EXPECT_DOUBLE_EQ(model_spec_from_config(c).flops_per_token(), model_flops(c).per_token()) << recipe << " " << gated;
    }
    // A vocabulary Megatron pads (to 128): counted padded by both, computed unpadded by epx.
    const Config odd = resolved(recipe, {"target.num_gpus=16", "train.global_batch_size=64", "model.vocab_size=4000"});
    EXPECT_DOUBLE_EQ(model_spec_from_config(odd).flops_per_token(), model_flops(odd).per_token()) << recipe;
    EXPECT_EQ(model_spec_from_config(odd).vocab, 4000);
  }
  // Multi-latent attention, with and without the q latent: Megatron's MLA count in both.
  for (const char* q_lora : {"model.q_lora_rank=64", "model.q_lora_rank=null"}) {
    const Config c = resolved("deepseek_v3_proxy",
                              {"model.multi_latent_attention=true", q_lora, "model.kv_lora_rank=32", "model.qk_head_dim=32",
                               "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32", "target.num_gpus=16",
                               "train.global_batch_size=64"});
    EXPECT_DOUBLE_EQ(model_spec_from_config(c).flops_per_token(), model_flops(c).per_token()) << q_lora;
  }
  // MTP: each layer as the decoder's last (MoE; dense after a dense last layer), its norms and
  // eh_proj, and the LM head once more per depth.
  for (const char* freq : {"model.moe_layer_freq=[0,1,1]", "model.moe_layer_freq=[0,1,0]"})
    for (const char* depths : {"model.mtp_num_layers=1", "model.mtp_num_layers=2"}) {
      const Config c = resolved("deepseek_v3_proxy", {freq, depths, "target.num_gpus=16", "train.global_batch_size=64"});
      EXPECT_DOUBLE_EQ(model_spec_from_config(c).flops_per_token(), model_flops(c).per_token()) << freq << " " << depths;
    }
}

// Each stage's layers as the config places them: the layout's, uneven, or counting the embedding.
TEST(Plan, StagesFollowTheConfigsSplit) {
  // DeepSeek-V3's "Et|(tt|)*30mL" over PP 8 x VPP 4: stage 0 holds the embedding and 1 + 3 x 2
  // layers, stage 7 three chunks of 2, the MTP layer and the loss.
  const ModelConfig v3 = resolved("deepseek_v3", {}).model;
  const PipelineSplit split = pipeline_split(v3);
  const PipelineStage first = pipeline_stage(v3, split, 0), last = pipeline_stage(v3, split, 7);
  EXPECT_EQ(first.layers, 7);
  EXPECT_TRUE(first.first && !first.last);
  EXPECT_EQ(last.layers, 6);
  EXPECT_EQ(last.mtp_layers, 1);
  EXPECT_TRUE(last.last && !last.first);
  // Megatron builds the loss on the last stage wherever a layout's L sits (check warns
  // pipeline.layout_embedding_loss_stages): the planner counts it there too.
  const ModelConfig moved = resolved("deepseek_v3_mla_proxy", {"target.num_gpus=4", "model.expert_model_parallel_size=1",
                                                               "model.pipeline_model_parallel_size=4",
                                                               "model.pipeline_model_parallel_layout=Ettt|m|L|"})
                                .model;
  const PipelineSplit moved_split = pipeline_split(moved);
  EXPECT_FALSE(pipeline_stage(moved, moved_split, 2).last);
  EXPECT_TRUE(pipeline_stage(moved, moved_split, 3).last);
  EXPECT_EQ(pipeline_stage(moved, moved_split, 1).mtp_layers, 1);
  // A lighter first stage holds less at the peak.
  const std::vector<std::string> pp4 = {"model.pipeline_model_parallel_size=4", "model.virtual_pipeline_model_parallel_size=1",
                                        "target.num_gpus=64"};
  std::vector<std::string> uneven = pp4;
  uneven.insert(uneven.end(), {"model.num_layers_in_first_pipeline_stage=9", "model.num_layers_in_last_pipeline_stage=13"});
  const Config even_c = resolved("qwen3_30b_a3b", pp4), uneven_c = resolved("qwen3_30b_a3b", uneven);
  EXPECT_EQ(pipeline_stage(uneven_c.model, pipeline_split(uneven_c.model), 0).layers, 9);
  EXPECT_LT(make_plan(uneven_c).configured().peak_memory_gb, make_plan(even_c).configured().peak_memory_gb);
}

// Megatron's optimizers step on an FP32 copy of BF16 main grads: with full recompute's small
// activations that copy sets the peak; with FP32 main grads there is none.
TEST(Plan, TheOptimizerStepCanSetThePeak) {
  const std::vector<std::string> full = {"model.recompute_granularity=full", "model.recompute_method=uniform",
                                         "model.recompute_num_layers=1", "model.cuda_graph_impl=none",
                                         "comm_overlap.overlap_moe_expert_parallel_comm=false"};
  const MemoryPlan m = make_plan(resolved("qwen3_30b_a3b", full)).memory;
  EXPECT_DOUBLE_EQ(m.step_grads, 4 * m.optimizer_params);
  EXPECT_GT(m.step_grads, m.activations + m.logits);
  EXPECT_DOUBLE_EQ(m.peak(), m.weights + m.gradients + m.optimizer + m.dispatcher_buffers + m.step_grads + m.other);
  std::vector<std::string> fp32 = full;
  fp32.push_back("ddp.grad_reduce_in_fp32=true");
  EXPECT_EQ(make_plan(resolved("qwen3_30b_a3b", fp32)).memory.step_grads, 0);
}

// The optimizer's state beside each FP32 master: Adam's m and v (12 bytes a parameter), one
// momentum for SGD and Lion (8); Muon's momentum for the matrices and Adam for the embedding and
// output layer, which Megatron keeps from Muon. Megatron's emerging optimizers (all but adam and
// sgd) shard their state only layer-wise (dist_muon), not by the distributed optimizer.
TEST(Plan, OptimizerStateFollowsTheOptimizer) {
  const auto memory = [](const std::string& name) {
    return make_plan(resolved("qwen3_30b_a3b", {"optimizer.optimizer=" + name})).memory;
  };
  const MemoryPlan adam = memory("adam"), sgd = memory("sgd"), muon = memory("dist_muon"), lion = memory("lion");
  EXPECT_DOUBLE_EQ(adam.optimizer, 12 * adam.optimizer_params);
  EXPECT_DOUBLE_EQ(sgd.optimizer, 8 * sgd.optimizer_params);
  EXPECT_DOUBLE_EQ(sgd.optimizer_params, adam.optimizer_params);  // both sharded by the distributed optimizer
  EXPECT_GT(muon.optimizer, sgd.optimizer);  // the first stage's embedding under Adam
  EXPECT_LT(muon.optimizer, adam.optimizer);
  EXPECT_DOUBLE_EQ(muon.optimizer_params, adam.optimizer_params);
  EXPECT_DOUBLE_EQ(lion.optimizer_params, lion.dense_params + lion.expert_params);  // not sharded
  EXPECT_DOUBLE_EQ(lion.optimizer, 8 * lion.optimizer_params);
  EXPECT_GT(memory("muon").optimizer, muon.optimizer);
}

// Bridge pads the vocabulary only where its setup takes it from the tokenizer: Qwen3's preset
// 151936 rows over TP 2 are not padded to 152064.
TEST(Plan, TheEmbeddingHasThePresetVocabulary) {
  const auto embedding = [](const std::vector<std::string>& more) {
    Config c = load_config_file(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
    for (const char* o : {"model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "target.gpu=h100"})
      apply_override(c, o);
    for (const std::string& o : more) apply_override(c, o);
    return make_plan(run_check(c).resolved).memory.embedding_params;
  };
  EXPECT_DOUBLE_EQ(embedding({}), 151936.0 * 2048 / 2);
  EXPECT_DOUBLE_EQ(embedding({"+tokenizer.use_tokenizer_vocab_size=true"}), 152064.0 * 2048 / 2);
}

// The seeds' Qwen3-30B-A3B runs on 16 x H100 (GBS 1024, MBS 1, seq 4096, EP 16), each within
// 15% in step time; peak memory within 5% of the measured max allocated (Megatron's BF16 main
// grads: 4 bytes a parameter instead put it 10% high).
TEST(Plan, SeedRunsOnSixteenH100) {
  const std::vector<std::string> ab = {"model.moe_token_dispatcher_type=alltoall", "model.moe_permute_fusion=false",
                                       "model.moe_permute_fusion_into_hybridep=false"};
  const auto with = [](std::vector<std::string> v, std::vector<std::string> more) {
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  struct Row {
    std::vector<std::string> overrides;
    double step_s, memory_gb;  // memory: Megatron's log, bytes / 1e9; 0: not published
  };
  const std::vector<Row> rows = {
      // seed A/B: alltoall, CUDA graphs off, permute fusion off
      {with(ab, {"model.cuda_graph_impl=none", "comm_overlap.overlap_moe_expert_parallel_comm=false"}), 41.25, 0},
      {with(ab, {"model.cuda_graph_impl=none", "comm_overlap.overlap_moe_expert_parallel_comm=true"}), 31.31, 0},
      {with(ab, {"model.cuda_graph_impl=none", "comm_overlap.overlap_moe_expert_parallel_comm=true",
                 "comm_overlap.delay_wgrad_compute=true"}),
       31.20, 0},
      // seed smoke: alltoall with TE graph scopes, 61.351 GB max allocated
      {with(ab, {"comm_overlap.overlap_moe_expert_parallel_comm=false"}), 45.65, 61.351},
      // Bridge's HybridEP A/B (the recipe as shipped), 62.166 GB with overlap on
      {{"comm_overlap.overlap_moe_expert_parallel_comm=false"}, 24.714, 0},
      {{}, 20.992, 62.166},
  };
  for (const Row& r : rows) {
    const Plan p = make_plan(resolved("qwen3_30b_a3b", r.overrides));
    const Variant& v = p.configured();
    EXPECT_LT(rel(v.step_time_s, r.step_s), 0.15) << testing::PrintToString(r.overrides) << ": " << v.step_time_s;
    if (r.memory_gb > 0) {
      EXPECT_LT(rel(v.peak_memory_gb * 1073741824.0 / 1e9, r.memory_gb), 0.05) << v.peak_memory_gb << " GiB";
    }
    EXPECT_TRUE(p.fits);
  }
}

TEST(Plan, OneRowPerDispatcherAndScheduleAndOneAsConfigured) {
  const Plan p = make_plan(resolved("qwen3_30b_a3b", {}));
  ASSERT_EQ(p.variants.size(), 9u);
  int configured_rows = 0;
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    const Variant& v = p.variants[i];
    configured_rows += v.as_configured;
    EXPECT_EQ(v.as_configured, v.overrides.empty());
    EXPECT_GT(v.step_time_s, 0);
    // Rows come in threes per dispatcher (no overlap first); overlap exposes less.
    if (v.ep_overlap) {
      EXPECT_LE(v.exposed_comm_s, p.variants[i / 3 * 3].exposed_comm_s);
    }
  }
  EXPECT_EQ(configured_rows, 1);
  EXPECT_LT(p.variants[3].step_time_s, p.variants[0].step_time_s);  // deepep < alltoall, no overlap
  const nlohmann::json j = plan_json(p);
  for (const char* key : {"flops_per_token", "fits", "memory_gb", "variants"}) EXPECT_TRUE(j.contains(key)) << key;
  for (const char* key : {"weights", "gradients", "optimizer", "activations", "dispatcher_buffers", "other", "peak"})
    EXPECT_TRUE(j["memory_gb"].contains(key)) << key;
}

TEST(Plan, FP8IsSaidToBeTimedAtTheBF16Rate) {
  const Config bf16 = resolved("qwen3_30b_a3b", {"target.gpu=h100"});
  const Config fp8 = resolved("qwen3_30b_a3b", {"target.gpu=h100", "model.fp8=hybrid", "model.fp8_recipe=tensorwise"});
  EXPECT_TRUE(make_plan(bf16).notes.empty());
  const Plan p = make_plan(fp8);
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_NE(p.notes.front().find("timed at the BF16 rate"), std::string::npos);
  EXPECT_EQ(p.configured().step_time_s, make_plan(bf16).configured().step_time_s);  // an upper bound, as said
  // diagnose does not offer FP8 to a run that has it.
  RunEvidence run;
  run.mean_step_s = 40, run.tflops_per_gpu = 50;
  for (const Fix& f : diagnose(run, fp8, find_gpu("h100")).fixes) EXPECT_EQ(f.what.rfind("FP8,", 0), std::string::npos) << f.what;
}

// A sliding window's share of a full causal layer's QK^T and PV is the keys its rows see against
// S / 2 per row (Megatron-Bridge's flop_utils); the step time counts only that, while the model
// FLOPs stay Megatron-LM's, every layer in full, and the plan says so.
TEST(Plan, SlidingWindowLayersAreTimedAtTheirShare) {
  Config c = resolved("qwen3_30b_a3b", {"model.window_size=[127,0]", "model.window_attn_skip_freq=2"});
  const Int S = c.model.seq_length;
  double keys = 0;
  for (Int i = 0; i < S; ++i) keys += std::min<Int>(i + 1, 128);
  EXPECT_NEAR(window_core_share(c.model), keys / S / (S / 2.0), 1e-12);
  EXPECT_EQ(window_layers_in(c.model, 0, c.model.num_layers), c.model.num_layers / 2);
  EXPECT_EQ(window_layers_in(c.model, 0, 1), 1);  // layer_number 1 has the window
  EXPECT_EQ(window_layers_in(c.model, 1, 2), 0);
  EXPECT_EQ(window_core_share(resolved("qwen3_30b_a3b", {"model.window_size=[100000,0]"}).model), 1);
  const Plan plain = make_plan(resolved("qwen3_30b_a3b", {})), windowed = make_plan(c);
  EXPECT_EQ(windowed.flops.per_token(), plain.flops.per_token());
  EXPECT_LT(windowed.configured().step_time_s, plain.configured().step_time_s);
  ASSERT_EQ(windowed.notes.size(), 1u);
  EXPECT_NE(windowed.notes[0].find("sliding window: 24 of 48 layers attend over 128 keys"), std::string::npos)
      << windowed.notes[0];
  EXPECT_EQ(make_plan(resolved("qwen3_30b_a3b", {"model.window_size=[-1,0]"})).configured().step_time_s,
            plain.configured().step_time_s);
  // epx's own blocked kernel multiplies rows + window keys per row: at S 256 and 127 keys, all
  // but the first block's, nearly the full causal work.
  ModelConfig proxy = c.model;
  proxy.seq_length = 256;
  double blocked = 0, full = 0;
  for (Int r0 = 0; r0 < 256; r0 += 128) {
    blocked += 128.0 * static_cast<double>(r0 + 128 - std::max<Int>(0, r0 - 127));
    full += 128.0 * static_cast<double>(r0 + 128);
  }
  EXPECT_DOUBLE_EQ(blocked_window_core_share(proxy), blocked / full);
  EXPECT_GT(blocked_window_core_share(proxy), window_core_share(proxy));
}

TEST(Plan, EachPipelineStageIsTimedFromItsOwnLayers) {
  // PP 2 with a heavy head on the last stage: it is the slowest, and it sets the step.
  const Config c = resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=2", "target.gpu=cpu", "model.num_layers=8",
                                                    "model.vocab_size=16384", "model.pipeline_model_parallel_size=2",
                                                    "model.expert_model_parallel_size=1"});
  const Plan even = make_plan(c);
  ASSERT_EQ(even.stage_compute_s.size(), 2u);
  EXPECT_GT(even.stage_compute_s[1], 1.5 * even.stage_compute_s[0]);
  EXPECT_NE(format_plan(even).find("stage 1 is the slowest"), std::string::npos);
  // Two layers moved off it: the stages come closer and the step shortens.
  Config moved = c;
  apply_override(moved, "model.pipeline_model_parallel_layout=Et*6|ttL");
  const Plan balanced = make_plan(run_check(moved).resolved);
  EXPECT_LT(balanced.configured().step_time_s, even.configured().step_time_s);
  EXPECT_TRUE(make_plan(resolved("qwen3_30b_a3b", {})).stage_compute_s.empty());  // PP 1: no stage table
}

TEST(Plan, TimeSharedStagesLendTheSlowestOneTheirWaits) {
  // PP 4 on 4 ranks of a 2-core cpu: the head's stage is the slowest. It runs on a core of its own
  // while the three lighter stages share the other, so only its neighbours' contention slows it:
  // its compute is the one it takes with a node (and a core) to itself, over the shared-core
  // efficiency. With the stages even, all four share: the node's work over its two cores.
  const auto plan = [](const std::string& vocab, const std::string& per_node) {
    return make_plan(resolved("qwen3_30b_a3b_proxy", {"target.gpu=cpu", "target.num_gpus=4", "target.gpus_per_node=" + per_node,
                                                      "model.num_layers=8", "model.expert_model_parallel_size=1",
                                                      "model.pipeline_model_parallel_size=4", "model.vocab_size=" + vocab}));
  };
  const GpuInfo& cpu = *find_gpu("cpu");
  ASSERT_EQ(cpu.rates.cores, 2);
  const double e = cpu.rates.shared_core_efficiency;
  const Plan heavy = plan("65536", "4"), heavy_apart = plan("65536", "1");
  ASSERT_EQ(heavy.stage_compute_s.size(), 4u);
  ASSERT_GT(heavy_apart.stage_compute_s[3], 2 * heavy_apart.stage_compute_s[0]);
  for (int p = 0; p < 4; ++p) EXPECT_NEAR(heavy.stage_compute_s[p], heavy_apart.stage_compute_s[p] / e, 1e-12) << p;
  const Plan even = plan("1024", "4"), even_apart = plan("1024", "1");
  const std::vector<double>& a = even_apart.stage_compute_s;
  const double slow_down = 4 * (a[0] + a[1] + a[2] + a[3]) / 4 / 2 / *std::max_element(a.begin(), a.end());
  ASSERT_GT(slow_down, 1.5);
  for (int p = 0; p < 4; ++p) EXPECT_NEAR(even.stage_compute_s[p], a[p] * slow_down / e, 1e-12) << p;
  // PP 2 x DP 4 on two nodes of 4 ranks: the second node holds the head's stage only, its four
  // ranks on the two cores.
  const auto two_nodes = [](const std::string& per_node) {
    return make_plan(resolved("qwen3_30b_a3b_proxy", {"target.gpu=cpu", "target.num_gpus=8", "target.gpus_per_node=" + per_node,
                                                      "model.num_layers=8", "model.expert_model_parallel_size=1",
                                                      "model.pipeline_model_parallel_size=2", "model.vocab_size=65536"}));
  };
  const Plan nodes = two_nodes("4"), nodes_apart = two_nodes("1");
  ASSERT_EQ(nodes.stage_compute_s.size(), 2u);
  EXPECT_NEAR(nodes.stage_compute_s[1], nodes_apart.stage_compute_s[1] * 4 / 2 / e, 1e-12);
}

TEST(Plan, TheBubbleIsTheOtherStagesFillAndDrain) {
  // 1F1B's bubble is the other stages' forward before the slowest stage's first micro-batch and
  // backward after its last: their compute, and the rest of a micro-batch (exchanges,
  // memory-bound work) as even over the stages; (PP - 1) of the slowest's times where the stages
  // are even, less where they are lighter (a heavy head), and over VPP interleaved.
  const GpuInfo gpu = *find_gpu("h100");
  const auto bubble = [&](const std::string& vocab, int vpp, StepCosts* out = nullptr) {
    std::vector<std::string> o{"target.num_gpus=4", "target.gpu=h100", "model.num_layers=8", "model.expert_model_parallel_size=1",
                               "model.pipeline_model_parallel_size=4", "model.vocab_size=" + vocab};
    if (vpp > 1) o.push_back(fmt::format("model.virtual_pipeline_model_parallel_size={}", vpp));
    const Config c = resolved("qwen3_30b_a3b_proxy", o);
    const LayoutPlan lp = plan_layout(c, gpu);
    const MemoryPlan mem = plan_memory(c, lp, Dispatcher::alltoall, false);
    const StepCosts costs = step_costs(c, lp, gpu, plan_comm(c, lp, gpu, Dispatcher::alltoall), mem, Dispatcher::alltoall);
    if (out) *out = costs;
    const StepTime t = step_time(costs, 8, vpp, false, false), one = step_time(costs, 1, vpp, false, false);
    return std::pair{t.bubble, one.layers};  // the bubble, and one micro-batch on the slowest stage
  };
  StepCosts heavy;
  const auto [heavy_bubble, heavy_one] = bubble("262144", 1, &heavy);  // (GPU: no time-sharing)
  const std::vector<double>& st = heavy.stage_compute;
  ASSERT_EQ(st.size(), 4u);
  ASSERT_GT(st[3], 2 * st[0]);
  EXPECT_EQ(heavy.stages, 4);
  EXPECT_DOUBLE_EQ(heavy.compute, st[3]);
  EXPECT_NEAR(heavy.other_stages, st[0] + st[1] + st[2], 1e-15);
  const double rest = heavy_one - heavy.compute;  // one micro-batch beyond the slowest stage's compute
  EXPECT_NEAR(heavy_bubble, st[0] + st[1] + st[2] + 3 * rest, 1e-12 * heavy_one);
  EXPECT_LT(heavy_bubble, 3 * heavy_one * 0.7);
  const auto [even_bubble, even_one] = bubble("8", 1);
  EXPECT_NEAR(even_bubble, 3 * even_one, 0.02 * even_one);  // the head of an 8-token vocabulary is nearly free
  const auto [interleaved, one] = bubble("262144", 2);
  EXPECT_NEAR(interleaved, (st[0] + st[1] + st[2] + 3 * (one - heavy.compute)) / 2, 1e-12 * one);
}

TEST(Plan, RowsTheCheckerRefusesAreMarked) {
  // PP 2 without VPP: every EP-overlap row is one Bridge refuses as it stands.
  const Config c = resolved("qwen3_30b_a3b", {"target.gpu=h100", "model.pipeline_model_parallel_size=2",
                                              "target.num_gpus=32", "comm_overlap.overlap_moe_expert_parallel_comm=false"});
  Plan p = make_plan(c);
  check_variants(p, c);
  int refused = 0;
  for (const Variant& v : p.variants) {
    EXPECT_EQ(!v.refusal.empty(), v.ep_overlap) << testing::PrintToString(v.overrides) << ": " << v.refusal;
    if (v.ep_overlap) {
      EXPECT_NE(v.refusal.find("[ep_overlap.pp_needs_vpp]"), std::string::npos) << v.refusal;
    }
    refused += !v.refusal.empty();
  }
  EXPECT_GT(refused, 0);
  EXPECT_NE(format_plan(p).find("epx check refuses them as they stand"), std::string::npos);
}

TEST(Plan, MemoryFollowsTheDistributedOptimizerAndRecompute) {
  const MemoryPlan dist = make_plan(resolved("qwen3_30b_a3b", {})).memory;
  const MemoryPlan plain = make_plan(resolved("qwen3_30b_a3b", {"ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"})).memory;
  EXPECT_NEAR(plain.optimizer, 12 * (plain.dense_params + plain.expert_params), 1);  // 18 bytes per parameter
  EXPECT_NEAR(dist.optimizer, 12 * dist.dense_params / 16 + 12 * dist.expert_params, 1);  // dense over DP 16, experts EDP 1
  const MemoryPlan full = make_plan(resolved("qwen3_30b_a3b", {"model.cuda_graph_impl=none", "model.recompute_granularity=full", "model.recompute_method=uniform",
                                                               "model.recompute_num_layers=1",
                                                               "comm_overlap.overlap_moe_expert_parallel_comm=false"}))
                              .memory;
  EXPECT_LT(full.activations, dist.activations / 5);
  // The precision-aware optimizer: BF16 m and v, the FP32 master as its 16 remainder bits, and
  // the grads read in place (no FP32 copy at the step).
  const MemoryPlan aware = make_plan(resolved("qwen3_30b_a3b", {"optimizer.use_precision_aware_optimizer=true",
                                                                "optimizer.exp_avg_dtype=bf16",
                                                                "optimizer.exp_avg_sq_dtype=bf16"}))
                               .memory;
  EXPECT_NEAR(aware.optimizer, dist.optimizer / 2, 1);
  // Below TE 2.1 Megatron keeps the whole FP32 master (no remainders).
  const MemoryPlan old_te = make_plan(resolved("qwen3_30b_a3b", {"optimizer.use_precision_aware_optimizer=true",
                                                                 "optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16",
                                                                 "target.te_version=2.0.0", "model.moe_permute_fusion=false"}))
                                .memory;
  EXPECT_NEAR(old_te.optimizer, dist.optimizer * 8 / 12, 1);
  EXPECT_GT(dist.step_grads, 0);
  EXPECT_EQ(aware.step_grads, 0);
  // Under a tensorwise recipe (Bridge's default, bf16_mixed included) Megatron keeps its FP32
  // masters and the step's grad copy: only m and v shrink.
  const MemoryPlan tensorwise = make_plan(resolved("qwen3_30b_a3b", {"optimizer.use_precision_aware_optimizer=true",
                                                                     "optimizer.exp_avg_dtype=bf16",
                                                                     "optimizer.exp_avg_sq_dtype=bf16",
                                                                     "model.fp8_recipe=tensorwise"}))
                                    .memory;
  EXPECT_NEAR(tensorwise.optimizer, dist.optimizer * 8 / 12, 1);
  EXPECT_EQ(tensorwise.step_grads, dist.step_grads);
}

TEST(Plan, RecomputeCostsWhatItRecomputesAndSavesWhatItDrops) {
  // 48 layers on one stage. Block recomputes the first N (each on its own), uniform every layer
  // in groups of N; selective recompute pays for the modules it runs again.
  const auto plan = [](std::vector<std::string> more) {
    more.insert(more.begin(), {"model.cuda_graph_impl=none", "comm_overlap.overlap_moe_expert_parallel_comm=false",
                               "comm_overlap.delay_wgrad_compute=false"});
    return make_plan(resolved("qwen3_30b_a3b", more));
  };
  const auto full = [&](const char* method, int n) {
    return plan({"model.recompute_granularity=full", fmt::format("model.recompute_method={}", method),
                 fmt::format("model.recompute_num_layers={}", n)});
  };
  const Plan none = plan({}), block1 = full("block", 1), block24 = full("block", 24), block48 = full("block", 48),
             uniform1 = full("uniform", 1), uniform8 = full("uniform", 8);
  const auto step = [](const Plan& p) { return p.configured().step_time_s; };
  EXPECT_NEAR(block1.memory.activations, none.memory.activations, 0.03 * none.memory.activations);
  EXPECT_LT(step(block1) - step(none), 0.01 * step(none));  // 1 of 48 layers again
  EXPECT_LT(block24.memory.activations, 0.6 * none.memory.activations);
  EXPECT_NEAR(step(block24) - step(none), (step(block48) - step(none)) / 2, 0.01 * step(none));
  EXPECT_DOUBLE_EQ(block48.memory.activations, uniform1.memory.activations);
  EXPECT_DOUBLE_EQ(step(block48), step(uniform1));
  // Every forward again: a third more of the micro-batches' compute (not of the optimizer step).
  const double ratio = uniform1.configured().compute_s / none.configured().compute_s;
  EXPECT_GT(ratio, 1.25);
  EXPECT_LT(ratio, 4.0 / 3.0);
  EXPECT_GT(uniform8.memory.activations, uniform1.memory.activations);  // 8 layers rebuilt at once
  EXPECT_DOUBLE_EQ(step(uniform8), step(uniform1));
  // A recomputed MoE layer exchanges its tokens forward again: half the four exchanges more.
  const auto exchanges = [](const Plan& p) { return p.configured().exposed_comm_s - p.configured().exposed_dp_s; };
  EXPECT_NEAR(exchanges(uniform1), 1.5 * exchanges(none), 0.01 * exchanges(none));
  EXPECT_NEAR(exchanges(block24), 1.25 * exchanges(none), 0.01 * exchanges(none));
  const Plan moe = plan({"model.recompute_granularity=selective", "model.recompute_modules=[moe]"}),
             core = plan({"model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"}),
             act = plan({"model.recompute_granularity=selective", "model.recompute_modules=[moe_act]"});
  EXPECT_GT(step(moe), step(core));
  EXPECT_GT(step(core), step(none));
  EXPECT_DOUBLE_EQ(step(act), step(none));  // elementwise
  EXPECT_NEAR(exchanges(moe), 1.5 * exchanges(none), 0.01 * exchanges(none));
  EXPECT_DOUBLE_EQ(exchanges(core), exchanges(none));
  EXPECT_LT(moe.memory.activations, core.memory.activations);
}

TEST(Plan, FullRecomputeTurnsEpOverlapOffWhereItWasSet) {
  // Through comm_overlap where the config has the section (Bridge copies it onto the model), on
  // the model where only the model sets it: a new section would bring its own defaults.
  const auto has = [](const std::vector<std::string>& o, const std::string& s) {
    return std::find(o.begin(), o.end(), s) != o.end();
  };
  const std::vector<std::string> section =
      full_recompute_overrides(resolved("qwen3_30b_a3b_proxy", {"+comm_overlap.overlap_moe_expert_parallel_comm=true"}));
  EXPECT_TRUE(has(section, "comm_overlap.overlap_moe_expert_parallel_comm=false")) << fmt::format("{}", fmt::join(section, " "));
  const std::vector<std::string> model =
      full_recompute_overrides(resolved("qwen3_30b_a3b_proxy", {"comm_overlap=None", "model.overlap_moe_expert_parallel_comm=true"}));
  EXPECT_TRUE(has(model, "model.overlap_moe_expert_parallel_comm=false")) << fmt::format("{}", fmt::join(model, " "));
  EXPECT_TRUE(has(model, "model.delay_wgrad_compute=false"));
  const Replanned replanned =
      replan(resolved("qwen3_30b_a3b_proxy", {"comm_overlap=None", "model.overlap_moe_expert_parallel_comm=true"}), model);
  EXPECT_TRUE(replanned.plan) << replanned.refusal;
  EXPECT_FALSE(replanned.plan->configured().ep_overlap);
}

TEST(Plan, ExpertInputsPaddedToCapacityCountTheirRows) {
  // Padded to capacity, every expert computes factor x tokens x k / experts rows, empty ones too:
  // the routed activations, the dispatcher's buffers, alltoall's exchanges and the experts' GEMM
  // time grow with the factor; the model FLOPs (Megatron's count) do not. A factor below 1
  // without padding drops what overflows.
  const auto plan = [](const std::vector<std::string>& overrides) {
    return make_plan(resolved("qwen3_30b_a3b", overrides));
  };
  const Plan plain = plan({}), padded = plan({"model.moe_expert_capacity_factor=4", "model.moe_pad_expert_input_to_capacity=true"}),
             dropping = plan({"model.moe_expert_capacity_factor=0.5"}),
             unpadded = plan({"model.moe_expert_capacity_factor=4"});
  EXPECT_GT(padded.memory.activations, 2 * plain.memory.activations);
  EXPECT_GT(padded.memory.dispatcher_buffers, 1.5 * plain.memory.dispatcher_buffers);  // beside HybridEP's workspace
  EXPECT_GT(padded.variants.front().exposed_comm_s, plain.variants.front().exposed_comm_s);
  EXPECT_GT(padded.configured().step_time_s, 1.5 * plain.configured().step_time_s);
  EXPECT_DOUBLE_EQ(padded.flops_per_step, plain.flops_per_step);
  EXPECT_LT(dropping.memory.activations, plain.memory.activations);
  EXPECT_DOUBLE_EQ(unpadded.memory.activations, plain.memory.activations);
}

TEST(Plan, CpuRuntimeFieldsAreRefusedOnAGpu) {
  // cores, attention_tflops and shared_core_efficiency time epx's own ranks: on an H100 they
  // would have slowed its plans without a word.
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_hw_{}.yaml", getpid());
  std::ofstream(path) << "h100:\n  cores: 3\n";
  try {
    add_hardware_file(path.string());
    ADD_FAILURE() << "cores on an h100 were taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("h100: cores, attention_tflops and shared_core_efficiency describe epx's CPU runtime"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(find_gpu("h100")->rates.cores, 0);  // a refused file changes nothing
  std::filesystem::remove(path);
}

TEST(Plan, GroupsInsideOrAcrossNodes) {
  const LayoutPlan two_nodes = make_plan(resolved("qwen3_30b_a3b", {})).layout;
  const LayoutPlan one_node = make_plan(resolved("qwen3_30b_a3b", {"target.num_gpus=8", "model.expert_model_parallel_size=8",
                                                                   "+env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8"}))
                                  .layout;
  for (const GroupPlacement& g : two_nodes.groups)
    if (g.kind == GroupKind::ep) {
      EXPECT_FALSE(g.within_node);
    }
  for (const GroupPlacement& g : one_node.groups) EXPECT_TRUE(g.within_node && g.within_nvlink);
  EXPECT_NE(format_rank_map(two_nodes, 4).find("12 more ranks"), std::string::npos);
  // The NVLink domain is the node unless the system's spans nodes (GB200's 72 over nodes of 4);
  // there it is the Slurm segment Bridge's harness requests: every node up to a rack's 18, else
  // the largest divisor of the node count up to 18.
  const Config h100_by_4 = resolved("qwen3_30b_a3b", {"target.gpus_per_node=4"});
  EXPECT_EQ(plan_layout(h100_by_4, target_gpu(h100_by_4)).nvlink_domain, 4);
  EXPECT_EQ(plan_layout(h100_by_4, target_gpu(h100_by_4)).segment_nodes, 0);
  for (const auto& [gpus, segment] : std::vector<std::pair<int, int>>{{16, 4}, {72, 18}, {176, 11}, {256, 16}, {296, 2}}) {
    const Config gb200 = resolved("qwen3_30b_a3b", {"target.gpu=gb200", "target.gpus_per_node=4",
                                                    fmt::format("target.num_gpus={}", gpus), "model.expert_model_parallel_size=8",
                                                    fmt::format("train.global_batch_size={}", 8 * gpus)});
    const LayoutPlan l = plan_layout(gb200, target_gpu(gb200));
    EXPECT_EQ(l.segment_nodes, segment) << gpus;
    EXPECT_EQ(l.nvlink_domain, 4 * segment) << gpus;
    EXPECT_EQ(l.rack_gpus, 72);
  }
}

TEST(Plan, HardwareFilesAddAndOverrideEntries) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_plan_hw_{}.yaml", getpid());
  std::ofstream(path) << "h100:\n  bf16_tflops: 1978\nmygpu:\n  memory_gb: 96\n  bf16_tflops: 500\n";
  add_hardware_file(path.string());
  EXPECT_EQ(find_gpu("h100")->rates.bf16_tflops, 1978);
  EXPECT_EQ(find_gpu("h100")->rates.memory_gb, 80);  // fields not given stay
  ASSERT_NE(find_gpu("mygpu"), nullptr);
  EXPECT_EQ(find_gpu("mygpu")->rates.memory_gb, 96);
  // A file with an error is refused whole, naming the file, line and field; nothing changes.
  std::ofstream(path) << "h100:\n  bf16_tflops: 989\nbad:\n  memory_gb: lots\n";
  try {
    add_hardware_file(path.string());
    FAIL() << "a bad value was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string() + ":4:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.memory_gb"), std::string::npos) << e.what();
  }
  EXPECT_EQ(find_gpu("h100")->rates.bf16_tflops, 1978);
  EXPECT_EQ(find_gpu("bad"), nullptr);
  std::ofstream(path) << "? [a, b]\n: 1\n";
  EXPECT_THROW(add_hardware_file(path.string()), ConfigError);
  std::ofstream(path) << "h100:\n  memory_gb: 0\n";  // every layout would fit
  EXPECT_THROW(add_hardware_file(path.string()), ConfigError);
  EXPECT_EQ(find_gpu("h100")->rates.memory_gb, 80);
  std::ofstream(path) << "cpu:\n  attention_fp32_tflops: 0.2\n";  // a calibration from before the rename
  try {
    add_hardware_file(path.string());
    FAIL() << "the old attention key was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("renamed attention_tflops"), std::string::npos) << e.what();
  }
  std::ofstream(path) << "h100:\n  nvlink_efficiency: 0.7\n  gemm_efficiency: 7\n";  // a share, at most 1
  try {
    add_hardware_file(path.string());
    FAIL() << "an efficiency above 1 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string() + ":3:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("h100.gemm_efficiency"), std::string::npos) << e.what();
  }
  EXPECT_EQ(find_gpu("h100")->rates.nvlink_efficiency, 0.65);
  // An efficiency of 0 divides the work by 0 (inf step times); cores come whole.
  // A rate under 1e-6 but not 0 (1e-320 times a peak is 0 again): refused, not a NaN plan.
  for (const char* text : {"cpu:\n  shared_core_efficiency: 0\n", "cpu:\n  cores: 0.5\n", "cpu:\n  memory_gb: 1e30\n",
                           "cpu:\n  shared_core_efficiency: 1e-320\n", "cpu:\n  hbm_tb_s: 1e-9\n"}) {
    std::ofstream(path) << text;
    EXPECT_THROW(add_hardware_file(path.string()), ConfigError) << text;
  }
  // A rate the step time needs left at 0 (not known) is named when a plan needs it: the network's
  // only where the layout spans nodes.
  std::ofstream(path) << "slowgpu:\n  memory_gb: 80\n  bf16_tflops: 500\n  hbm_tb_s: 2\n  nvlink_gb_s: 300\n"
                         "  nvlink_efficiency: 0.6\n  gemm_efficiency: 0.3\n";
  add_hardware_file(path.string());
  EXPECT_NO_THROW(make_plan(resolved("qwen3_30b_a3b_proxy", {"target.gpu=slowgpu", "target.num_gpus=2"})));  // one node
  try {
    make_plan(resolved("qwen3_30b_a3b_proxy", {"target.gpu=slowgpu", "target.num_gpus=16", "target.gpus_per_node=8",
                                               "train.global_batch_size=16"}));
    FAIL() << "a plan across nodes without the network's rate was made";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the hardware catalog (with " + path.string() + ") has no network_gb_s for it"),
              std::string::npos)
        << e.what();
  }
  // Compute capability as torch reports it, MAJOR.MINOR: Ada's 8.9 runs FP8, Ampere's 8.6 does not.
  std::ofstream(path) << "ada:\n  compute_capability: 8.9\n  memory_gb: 48\nampere:\n  compute_capability: 8.6\n";
  add_hardware_file(path.string());
  EXPECT_EQ(find_gpu("ada")->minor, 9);
  const auto fp8_refused = [](const char* gpu) {
    const CheckReport r = run_check(test::load_with("qwen3_30b_a3b_proxy", {std::string("target.gpu=") + gpu, "model.fp8=hybrid"}));
    return std::any_of(r.findings.begin(), r.findings.end(), [](const Finding& f) { return f.rule_id == "fp8.gpu"; });
  };
  EXPECT_FALSE(fp8_refused("ada"));
  EXPECT_TRUE(fp8_refused("ampere"));
  std::ofstream(path) << "ada:\n  compute_capability: 8.x\n";
  EXPECT_THROW(add_hardware_file(path.string()), ConfigError);
  // Before Ampere there are no BF16 tensor cores: no rate to give, and the message says so.
  try {
    make_plan(resolved("qwen3_30b_a3b_proxy", {"target.gpu=v100", "target.num_gpus=2"}));
    FAIL() << "a V100 was planned without a BF16 rate";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("compute capability 7 has no BF16 tensor cores"), std::string::npos) << e.what();
  }
  std::ofstream(path) << "h100:\n  bf16_tflops: 989\n";  // back to the catalog's
  add_hardware_file(path.string());
  std::filesystem::remove(path);
}

TEST(Plan, VppOfOneRunsInterleavedAndHoldsItsWarmUp) {
  // Megatron-Core runs VPP = 1 (set, not None) through the interleaved schedule: the first stage
  // warms up 2 (PP - 1) micro-batches, Megatron's factor 1 + (PP - 1) / PP; without VPP, 1F1B's PP.
  const auto in_flight = [](const std::string& vpp) {
    const Config c = resolved("qwen3_235b_a22b", {"model.virtual_pipeline_model_parallel_size=" + vpp,
                                                  "comm_overlap.overlap_moe_expert_parallel_comm=false",
                                                  "comm_overlap.delay_wgrad_compute=false"});
    return plan_memory(c, plan_layout(c, target_gpu(c)), Dispatcher::alltoall, false).in_flight;
  };
  const double pp = 8;
  EXPECT_DOUBLE_EQ(in_flight("null"), pp);
  EXPECT_DOUBLE_EQ(in_flight("1"), pp * (1 + (pp - 1) / pp));
  EXPECT_DOUBLE_EQ(in_flight("2"), pp * (1 + (pp - 1) / (2 * pp)));
  // Groups of 16 micro-batches per chunk at VPP 4: (VPP - 1) (N - PP) = 6 more micro-batches on
  // every stage (the most-loaded stage may then be another: its warm-up is PP - stage).
  const Config grouped = resolved("qwen3_235b_a22b", {"model.microbatch_group_size_per_vp_stage=16",
                                                      "comm_overlap.overlap_moe_expert_parallel_comm=false",
                                                      "comm_overlap.delay_wgrad_compute=false"});
  const double warmup = (plan_memory(grouped, plan_layout(grouped, target_gpu(grouped)), Dispatcher::alltoall, false).in_flight -
                        3.0 * (16 - 8) / 4) /
                       (1 + (pp - 1) / (4 * pp));
  EXPECT_NEAR(warmup, std::round(warmup), 1e-9);
  EXPECT_GE(warmup, pp - 1);
}

TEST(Plan, WithoutSequenceParallelismTenOfEighteenStayWhole) {
  // Megatron's compute_activation_memory_without_sp: s*b*h*(10 + 24/TP) a layer, where SP splits
  // all 34: at TP 2 each of the 48 layers holds 10*s*b*h/2 more. (An MoE layer refuses to train
  // so, parallel.ep_tp_needs_sp: the term is the planner's alone, resolved without the check.)
  const auto activations = [](const char* sp) {
    const Config c = resolve_config(test::load_with("qwen3_30b_a3b", {"target.num_gpus=32", "model.tensor_model_parallel_size=2",
                                                                      std::string("model.sequence_parallel=") + sp}),
                                    std::nullopt);
    return plan_memory(c, plan_layout(c, target_gpu(c)), Dispatcher::alltoall, false).activations;
  };
  EXPECT_NEAR(activations("false") - activations("true"), 48 * 10.0 * 4096 * 2048 / 2, 1e3);
}

TEST(Plan, MlaDownProjectionsAreWholeOnEveryTpRank) {
  // Megatron builds MLA's q and kv down-projections as TELinear "duplicated": TP splits every
  // attention weight but those h x (q_lora_rank + kv_lora_rank + qk_pos_emb_head_dim).
  const auto dense = [](int tp) {
    const Config c = resolved("qwen3_30b_a3b_proxy",
                              {"target.gpu=h100", "target.num_gpus=4", "model.multi_latent_attention=true",
                               "model.q_lora_rank=64", "model.kv_lora_rank=32", "model.qk_head_dim=32",
                               "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32",
                               fmt::format("model.tensor_model_parallel_size={}", tp), "model.sequence_parallel=true"});
    return plan_memory(c, plan_layout(c, target_gpu(c)), Dispatcher::alltoall, false).dense_params;
  };
  const double split = 4 * (dense(2) - dense(4));  // what TP splits
  const Config c = resolved("qwen3_30b_a3b_proxy", {});
  const double h = static_cast<double>(c.model.hidden_size), layers = static_cast<double>(c.model.num_layers);
  const double router = static_cast<double>(*c.model.num_moe_experts) * h;
  EXPECT_NEAR(dense(2) - split / 2, layers * (h * (64 + 32 + 16) + router), 1);
}

// The planner's parameters are the runtime model's matrices (it leaves out the norms' and other
// vectors), with two MTP layers or one repeated (mtp_use_repeated_layer: one layer's weights for
// both depths).
TEST(Plan, ParametersAreTheRuntimeModelsWithARepeatedMtpLayer) {
  for (const bool repeated : {false, true}) {
    const Config c = resolved("deepseek_v3_proxy", {"model.mtp_num_layers=2", "target.num_gpus=1", "model.expert_model_parallel_size=1",
                                                    fmt::format("model.mtp_use_repeated_layer={}", repeated)});
    const MemoryPlan mem = plan_memory(c, plan_layout(c, target_gpu(c)), Dispatcher::alltoall, false);
    const ModelSpec spec = model_spec_from_config(c);
    ASSERT_EQ(spec.mtp_repeated, repeated);
    GPTModel model(spec, [&] { return make_local_dispatcher(spec.moe->num_experts); });
    double n = 0;
    for (const Param* p : model.params())
      if (p->master.shape().size() >= 2) n += static_cast<double>(p->master.numel());
    EXPECT_DOUBLE_EQ(mem.dense_params + mem.expert_params, n) << repeated;
  }
}

TEST(Plan, CpuAttentionKeepsNoScores) {
  // epx's blocked attention, as flash attention on a GPU, keeps no S x S probabilities, so
  // selective core_attn recompute has nothing to drop.
  const auto activations = [](const std::vector<std::string>& more) {
    std::vector<std::string> o = {"target.num_gpus=2"};
    o.insert(o.end(), more.begin(), more.end());
    const Config c = resolved("qwen3_30b_a3b_proxy", o);
    return plan_memory(c, plan_layout(c, target_gpu(c)), Dispatcher::alltoall, false).activations;
  };
  const double cpu = activations({"target.gpu=cpu"});
  const double recomputed = activations({"target.gpu=cpu", "model.recompute_granularity=selective",
                                         "model.recompute_modules=[core_attn]"});
  EXPECT_NEAR(cpu, recomputed, 1);
  EXPECT_NEAR(activations({"target.gpu=h100"}), cpu, 1);
}

TEST(Diagnose, OnEpxsRuntimeTheGpuOnlyFixesAreANote) {
  // A low compute rate on epx's runtime: fused permutation and FP8 are the target's, named in a
  // note, not offered as fixes to run here.
  RunEvidence run;
  run.mean_step_s = 1;
  run.tflops_per_gpu = 1e-6;
  const Diagnosis d = diagnose(run, resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=2", "target.gpu=cpu"}), find_gpu("cpu"));
  ASSERT_EQ(d.binding, "compute/host");
  for (const Fix& f : d.fixes) EXPECT_TRUE(f.what.find("FP8") == std::string::npos) << f.what;
  std::string notes;
  for (const std::string& n : d.notes) notes += n + "\n";
  EXPECT_NE(notes.find("for the target, not in epx's CPU runtime yet: "), std::string::npos) << notes;
  EXPECT_NE(notes.find("FP8"), std::string::npos) << notes;
}

// A run whose busiest expert routes far above the mean is told so, with what evens it.
TEST(Diagnose, AnUnevenExpertLoadIsANote) {
  RunEvidence run;
  run.mean_step_s = 1;
  run.steady_first = 3, run.steady_last = 5;
  run.config = resolved("qwen3_30b_a3b_proxy", {"target.gpu=cpu"});  // EP 2, aux loss 1e-3
  const auto notes = [&](double load) {
    run.expert_load = load;
    std::string all;
    for (const std::string& n : diagnose(run, std::nullopt, find_gpu("cpu")).notes) all += n + "\n";
    return all;
  };
  EXPECT_NE(notes(2.29).find("the busiest expert routed 2.29x the mean tokens"), std::string::npos) << notes(2.29);
  EXPECT_NE(notes(2.29).find("a larger aux-loss coefficient (moe_aux_loss_coeff 0.001)"), std::string::npos) << notes(2.29);
  EXPECT_EQ(notes(1.1).find("busiest expert"), std::string::npos);
  // Where the EP ranks' load is measured, it decides: many local experts even out a busy one.
  run.ep_rank_load = 1.1;
  EXPECT_EQ(notes(2.29).find("busiest expert"), std::string::npos);
  run.ep_rank_load = 1.25;
  EXPECT_NE(notes(1.5).find("1.50x the mean tokens, the busiest EP rank's local experts 1.25x the mean rank's"), std::string::npos)
      << notes(1.5);
  run.config = resolved("qwen3_30b_a3b_proxy", {"target.gpu=cpu", "target.num_gpus=1", "model.expert_model_parallel_size=1"});
  EXPECT_EQ(notes(2.29).find("busiest expert"), std::string::npos);  // one EP rank: nobody waits
}

TEST(Diagnose, ARateAboveTheAttainableSaysTheEfficiencyIsFromElsewhere) {
  RunEvidence run;
  run.mean_step_s = 1;
  const GpuInfo& cpu = *find_gpu("cpu");
  const double attainable = cpu.rates.bf16_tflops * cpu.rates.gemm_efficiency;
  for (const double share : {0.5, 1.5}) {
    run.tflops_per_gpu = share * attainable;
    const Diagnosis d = diagnose(run, std::nullopt, &cpu);
    const auto& host = d.walls.back();
    ASSERT_EQ(host.wall, "compute/host");
    EXPECT_EQ(host.evidence.find("--calibrate") != std::string::npos, share > 1) << host.evidence;
  }
  // With the config, the attainable rate times the output layer's FLOPs at the peak, as the
  // planner does on cpu: a run at that rate reads 100%.
  const Config c = resolved("qwen3_30b_a3b_proxy", {"target.gpu=cpu", "target.num_gpus=1", "model.expert_model_parallel_size=1"});
  const ModelFlops f = model_flops(c);
  const double head = f.logits / f.per_token(), peak = cpu.rates.bf16_tflops;
  ASSERT_GT(head, 0.05);
  run.tflops_per_gpu = 1 / ((1 - head) / attainable + head / peak);
  const std::string evidence = diagnose(run, c, &cpu).walls.back().evidence;
  EXPECT_NE(evidence.find(fmt::format("100% of the attainable {:.3g}", run.tflops_per_gpu)), std::string::npos) << evidence;
  EXPECT_NE(evidence.find("the output layer's"), std::string::npos) << evidence;
}

TEST(Diagnose, AConfigThatPlansAnotherLayoutThanTheRunsIsNoted) {
  const Config c = resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=2", "target.gpu=cpu"});
  RunEvidence run;
  run.mean_step_s = 1;
  const auto notes = [&](const std::string& layout) {
    run.layout = layout;
    std::string all;
    for (const std::string& n : diagnose(run, c, find_gpu("cpu")).notes) all += n + "\n";
    return all;
  };
  const std::string planned = make_plan(c).layout.layout.describe();
  EXPECT_EQ(notes(planned).find("the run's layout is"), std::string::npos) << notes(planned);
  const std::string other = "world 2 = TP1 CP1 DP1 PP2 | ETP1 EP1 EDP1 PP2";
  EXPECT_NE(notes(other).find(fmt::format("the run's layout is {}, the config plans {}", other, planned)), std::string::npos)
      << notes(other);
}

TEST(Diagnose, AnExposedDpTailWithOverlapOnSuggestsTheEmbeddingRows) {
  // An epx run bound by its DP reduction with overlap_grad_reduce already on: the next fix is
  // epx's own rows split; once it is on, or with a tied head on one stage, it is not offered.
  const auto fixes = [](const std::vector<std::string>& more) {
    std::vector<std::string> o{"target.num_gpus=2", "target.gpu=cpu", "ddp.overlap_grad_reduce=true"};
    o.insert(o.end(), more.begin(), more.end());
    RunEvidence run;
    run.mean_step_s = 1;
    run.trace = TraceBreakdown{};
    run.trace->step_s = 1, run.trace->iterations = 1;
    run.trace->comm_s = run.trace->dp_reduce_s = 0.5;
    run.trace->exposed_s = run.trace->dp_reduce_exposed_s = 0.4;
    const Diagnosis d = diagnose(run, resolved("qwen3_30b_a3b_proxy", o), find_gpu("cpu"));
    EXPECT_EQ(d.binding, "communication");
    std::string all;
    for (const Fix& f : d.fixes) all += testing::PrintToString(f.overrides);
    return all;
  };
  EXPECT_NE(fixes({}).find("ddp.reduce_embedding_rows=true"), std::string::npos) << fixes({});
  EXPECT_EQ(fixes({"ddp.reduce_embedding_rows=true"}).find("reduce_embedding_rows"), std::string::npos);
  EXPECT_EQ(fixes({"model.share_embeddings_and_output_weights=true"}).find("reduce_embedding_rows"), std::string::npos);
  // Over stages the first stage's table is token rows again (the copy holds the head's part).
  EXPECT_NE(fixes({"model.share_embeddings_and_output_weights=true", "model.pipeline_model_parallel_size=2",
                   "target.num_gpus=4"})
                .find("reduce_embedding_rows"),
            std::string::npos);
}

TEST(Diagnose, ExposedCommunicationBeyondTheCoresIdleTimeIsCpuTime) {
  // A rank that kept its core 90% busy and waited 40% of the step on communication: overlap can
  // cut only the 10% idle; kept 50% busy, the note is not given.
  const auto notes = [](double cpu_s) {
    RunEvidence run;
    run.mean_step_s = 1;
    run.cpu_s_per_iteration = cpu_s, run.cores_per_rank = 1;
    run.trace = TraceBreakdown{};
    run.trace->step_s = 1, run.trace->iterations = 1;
    run.trace->comm_s = run.trace->token_exchange_s = 0.8;
    run.trace->exposed_s = run.trace->token_exchange_exposed_s = 0.4;
    const Diagnosis d = diagnose(run, std::nullopt, find_gpu("cpu"));
    std::string all = d.walls.back().evidence + "\n";
    for (const std::string& n : d.notes) all += n + "\n";
    return all;
  };
  EXPECT_NE(notes(0.9).find("rank 0's threads kept its 1 core(s) 90% busy (0.9 s of CPU per iteration): more overlap can "
                            "cut at most their idle 10% of the step, not all of the 40% of communication exposed"),
            std::string::npos)
      << notes(0.9);
  EXPECT_EQ(notes(0.5).find("more overlap can cut at most"), std::string::npos) << notes(0.5);
  EXPECT_NE(notes(0.5).find("rank 0's threads kept its 1 core(s) 50% busy"), std::string::npos) << notes(0.5);
}

// epx run writes a NaN loss as null (a diverged run with check_for_nan_in_loss off): read as NaN
// and named; a value past any run's is refused, not summed into an overflow.
TEST(RunEvidence, EpxResultsOfADivergedRunAndOutOfRangeValues) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_results_{}.json", getpid());
  const auto results = [&](const std::string& loss, const std::string& step) {
    std::ofstream(path) << fmt::format(
        R"({{"iterations": [{{"iteration": 1, "step_time_s": 1, "tflops_per_rank": 1, "lm_loss": 8, "mem_max_allocated_bytes": 1}},
                             {{"iteration": 2, "step_time_s": {}, "tflops_per_rank": 1, "lm_loss": {}, "mem_max_allocated_bytes": 1}}],
            "summary": {{"steady_state_iterations": [1, 2], "mean_step_time_s": 1, "tflops_per_rank": 1,
                         "peak_memory_bytes": 1, "final_lm_loss": {}}}}})",
        step, loss, loss);
    return path.string();
  };
  const RunEvidence run = read_run(results("null", "1"), std::nullopt);
  EXPECT_EQ(run.cpu_s_per_iteration, 0) << "results before the CPU time was measured";
  EXPECT_TRUE(std::isnan(run.iterations[1].lm_loss));
  EXPECT_TRUE(std::isnan(run.final_loss));
  std::string notes;
  for (const std::string& n : diagnose(run, std::nullopt, find_gpu("cpu")).notes) notes += n + "\n";
  EXPECT_NE(notes.find("the LM loss is NaN or infinite from iteration 2: the training diverged"), std::string::npos) << notes;
  const std::string huge_step = test::error_of<InputError>([&] { read_run(results("8", "1e300"), std::nullopt); });
  EXPECT_NE(huge_step.find("iterations[1].step_time_s is 1e+300: beyond any run's"), std::string::npos) << huge_step;
  // A byte-order mark before the JSON is read past; an empty file is named so.
  const std::string plain = [&] {
    std::ifstream in(results("8", "1"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  std::ofstream(path) << "\xEF\xBB\xBF" << plain;
  EXPECT_EQ(read_run(path.string(), std::nullopt).kind, "epx results");
  std::ofstream(path) << " \n";
  const std::string empty = test::error_of<InputError>([&] { read_run(path.string(), std::nullopt); });
  EXPECT_NE(empty.find(": the file is empty"), std::string::npos) << empty;
  // Past a double, or a key given twice: input errors naming the file, not the parser's exceptions.
  for (const auto& [step, message] : {std::pair<std::string, std::string>{"1e999", ":2: not a valid epx results file: the "
                                                                                   "number 1e999 is beyond a double's range"},
                                      {"1, \"step_time_s\": 2", ": not a valid epx results file: the key \"step_time_s\" "
                                                                "appears twice"}}) {
    const std::string e = test::error_of<InputError>([&] { read_run(results("8", step), std::nullopt); });
    EXPECT_EQ(e.rfind(path.string() + message, 0), 0u) << step << ": " << e;
  }
  // The rank's CPU time per steady iteration and its cores; a rank of no core is refused.
  const auto with_cpu = [&](const std::string& cores) {
    std::string text = plain;  // into the summary, the last object
    text.insert(text.rfind("}}"), fmt::format(R"(, "process_cpu_s": 3, "cores_per_rank": {})", cores));
    std::ofstream(path) << text;
    return path.string();
  };
  const RunEvidence cpu_run = read_run(with_cpu("0.5"), std::nullopt);
  EXPECT_EQ(cpu_run.cpu_s_per_iteration, 1.5);
  EXPECT_EQ(cpu_run.cores_per_rank, 0.5);
  const std::string no_core = test::error_of<InputError>([&] { read_run(with_cpu("0"), std::nullopt); });
  EXPECT_NE(no_core.find("summary.cores_per_rank is 0: a rank has at least a thousandth of a core"), std::string::npos)
      << no_core;
  // A trace given as the run is named as a JSON array.
  std::ofstream(path) << "[1, 2, 3]\n";
  const std::string array = test::error_of<InputError>([&] { read_run(path.string(), std::nullopt); });
  EXPECT_NE(array.find(": a JSON array, not an `epx run --results` file"), std::string::npos) << array;
  // A trace time past any run is named as such, not taken for another run's trace.
  const auto trace = std::filesystem::temp_directory_path() / fmt::format("epx_trace_{}.json", getpid());
  std::ofstream(trace) << R"([{"ph": "X", "pid": 0, "tid": 0, "name": "optimizer step", "cat": "compute", "ts": 1e300, "dur": 1}])";
  const std::string late = test::error_of<InputError>([&] { read_run(results("8", "1"), trace.string()); });
  EXPECT_NE(late.find("event 0 ('optimizer step') has ts 1e+300 and dur 1 (microseconds from the run's start): past any run"),
            std::string::npos)
      << late;
  std::filesystem::remove(trace);
  std::filesystem::remove(path);
}

// A results file's errors cite its lines: a value's (found again after parsing), a missing
// key's object, and the config's fields at their line and column in the file, not in a re-dump.
TEST(RunEvidence, ResultsErrorsCiteTheFilesLines) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_lines_{}.json", getpid());
  const auto error = [&](const std::string& hidden, const std::string& step, const std::string& loss) {
    std::ofstream(path) << fmt::format(R"({{
  "config": {{
    "model": {{"num_layers": 2,
      "hidden_size": {}}}
  }},
  "iterations": [
    {{"iteration": 1, "step_time_s": 1, "tflops_per_rank": 1, "lm_loss": 8, "mem_max_allocated_bytes": 1}},
    {{"iteration": 2, "step_time_s": {}, "tflops_per_rank": 1, {} "mem_max_allocated_bytes": 1}}
  ],
  "summary": {{"mean_step_time_s": 1, "tflops_per_rank": 1, "peak_memory_bytes": 1, "final_lm_loss": 8}}
}}
)",
                                       hidden, step, loss);
    return test::error_of<InputError>([&] { read_run(path.string(), std::nullopt); });
  };
  const std::string p = path.string();
  EXPECT_EQ(error("64", "1e300", R"("lm_loss": 8,)").rfind(p + ":8: iterations[1].step_time_s is 1e+300", 0), 0u)
      << error("64", "1e300", R"("lm_loss": 8,)");
  EXPECT_EQ(error("64", "1", "").rfind(p + ":8: iterations[1].lm_loss is missing", 0), 0u) << error("64", "1", "");
  const std::string hidden = error("1.5", "1", R"("lm_loss": 8,)");
  EXPECT_NE(hidden.find(p + ":4:22: model.hidden_size expects an integer, got 1.5"), std::string::npos) << hidden;
  std::filesystem::remove(path);
}

// Logs as they come from launchers and from other Megatron and Bridge versions (helper-found
// excerpts of real logs, cut down).
TEST(RunEvidence, LaunchersAndOlderFormatsReadTheSame) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_megatron_formats_{}.log", getpid());
  const auto read = [&](const std::string& text) {
    std::ofstream(path) << text;
    return read_run(path.string(), std::nullopt);
  };
  const auto line = [](int it, double ms, const std::string& more = "") {
    return fmt::format(" [2025-11-03 10:00:00] iteration {:8d}/     100 | elapsed time per iteration (ms): {} | {}lm "
                       "loss: 5.0 |\n",
                       it, ms, more);
  };
  // Prefixes one after another: mpirun --tag-output, srun -l over torchrun --tee, kubectl's time.
  for (const std::string prefix : {"[1,7]<stdout>:", "0: [default7]:", "2025-06-01T10:00:00.123456789Z "}) {
    SCOPED_TRACE(prefix);
    std::string text;
    for (int it : {10, 20, 30})
      text += prefix + line(it, 1000) + prefix + "(min, max) time across ranks (ms):\n" + prefix +
              "    all-grads-sync .................................: (20.00, 60.00)\n";
    const RunEvidence run = read(text);
    EXPECT_DOUBLE_EQ(run.timers_min_ms.at("all-grads-sync"), 20);
    EXPECT_DOUBLE_EQ(run.mean_step_s, 1.0);
  }
  // Before August 2022 the timers were one line; the DP reduction had other names then (and
  // until September 2023: grads-all-reduce).
  RunEvidence run = read(line(10, 1000) + line(20, 1000) +
                         "time (ms) | forward-compute: 604.56 | backward-params-all-reduce: 267.65 | optimizer: 85.27\n" +
                         line(30, 1000) + "    grads-all-reduce ...............................: (300.00, 320.00)\n");
  EXPECT_DOUBLE_EQ(run.timers_ms.at("backward-params-all-reduce"), 267.65 / 2);  // one of the two steady lines
  EXPECT_DOUBLE_EQ(run.timers_min_ms.at("grads-all-reduce"), 300.0 / 2);
  const Diagnosis old_names = diagnose(run, resolved("qwen3_30b_a3b", {"target.gpu=h100"}), find_gpu("h100"));
  EXPECT_NE(old_names.walls[1].evidence.find("pipeline waits 0.294 s"), std::string::npos) << old_names.walls[1].evidence;
  // Bridge's rate is its Step Time line, before the iteration's line (after it in older Bridge).
  run = read("Step Time : 1.00s GPU utilization: 58.2MODEL_TFLOP/s/GPU\n" + line(10, 1000) +
             "Step Time : 1.00s GPU utilization: 49.3MODEL_TFLOP/s/GPU\n" + line(20, 1000) +
             "Step Time : 1.00s GPU utilization: 49.3MODEL_TFLOP/s/GPU\n" + line(30, 1000));
  EXPECT_TRUE(run.throughput_logged);
  EXPECT_DOUBLE_EQ(run.iterations.front().tflops_per_gpu, 58.2);
  run = read(line(10, 1000) + "Step Time : 1.00s GPU utilization: 58.2TFLOP/s/GPU\n" + line(20, 1000) +
             "Step Time : 1.00s GPU utilization: 49.3TFLOP/s/GPU\n" + line(30, 1000) +
             "Step Time : 1.00s GPU utilization: 40.0TFLOP/s/GPU\n");
  EXPECT_TRUE(run.throughput_logged);  // a rate line after the last iteration's: the older order
  EXPECT_DOUBLE_EQ(run.iterations[1].tflops_per_gpu, 49.3);
  // The current order, cut at its start (a tail): the first line has no rate, the rest theirs,
  // and the steady state's lines all have one.
  run = read(line(10, 1000) + "Step Time : 1.00s GPU utilization: 58.2TFLOP/s/GPU\n" + line(20, 1000) +
             "Step Time : 1.00s GPU utilization: 49.3TFLOP/s/GPU\n" + line(30, 1000));
  EXPECT_FALSE(run.iterations[0].throughput_logged);
  EXPECT_TRUE(run.throughput_logged);
  EXPECT_DOUBLE_EQ(run.iterations[1].tflops_per_gpu, 58.2);
  EXPECT_DOUBLE_EQ(run.iterations[2].tflops_per_gpu, 49.3);
  // A first line's skipped iteration counts whether the next line repeats it (Megatron-LM since
  // 2026) or not (before, and Bridge).
  run = read(line(1, 5000, "number of skipped iterations:   1 | ") + line(2, 1000, "number of skipped iterations:   0 | ") +
             line(3, 1000) + line(4, 1000));
  EXPECT_EQ(run.skipped_iterations, 1);
  run = read(line(1, 5000, "number of skipped iterations:   1 | ") + line(2, 1000, "number of skipped iterations:   1 | ") +
             line(3, 1000) + line(4, 1000));
  EXPECT_EQ(run.skipped_iterations, 1);
  // A resumed run (a second arguments dump) that goes on from where it stopped: its first line,
  // the resumed process's warm-up, is left out of the steady state.
  run = read("  world_size ...... 8\n" + line(10, 1000) + line(20, 1000) + line(30, 1000) + line(40, 1000) +
             "  world_size ...... 8\n" + line(41, 30000) + line(50, 1000) + line(60, 1000));
  EXPECT_EQ(run.restarted_at, 41);
  EXPECT_FALSE(run.went_back);
  EXPECT_DOUBLE_EQ(run.mean_step_s, 1.0);
  // Two lines, the first iteration's and the interval's: the second covers the first again.
  run = read(line(1, 9000) + line(10, 1000));
  EXPECT_DOUBLE_EQ(run.mean_step_s, 1.0);
  // Ranks' memory lines run together, and an iteration line run on after them.
  run = read(line(1, 1000) + "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.0 | max allocated: 2048.00 | "
             "reserved: 3.0 | max reserved: 3.0[Rank 8] (after 1 iterations) memory (MB) | allocated: 1.0 | max "
             "allocated: 1024.00 | reserved: 3.0 | max reserved: 3.0" + line(2, 1000));
  EXPECT_DOUBLE_EQ(run.peak_memory_gb, 2.0);
  EXPECT_EQ(run.iterations.size(), 2u);
  // Megatron's 2019 loss had no colon.
  run = read(" iteration      400/    3000 | elapsed time per iteration (ms): 12879.0 | learning rate 6.300E-06 | lm loss "
             "6.758929E+00 | loss scale 64.0 |\n");
  EXPECT_DOUBLE_EQ(run.final_loss, 6.758929);
  // Not Megatron's: the generic refusal (not the iteration's range); a wrapped paste is named.
  const auto refusal = [&](const std::string& text) { return test::error_of<InputError>([&] { read(text); }); };
  EXPECT_NE(refusal("Training epoch 0, iteration 0/149 | lr: 1e-05 | reduced_train_loss: 4.4 | train_step_timing in s: 2.1\n")
                .find("neither an `epx run --results` JSON nor a Megatron training log"),
            std::string::npos);
  const std::string wrapped = refusal(" iteration 10/ 50 | consumed samples: 5120 |\nelapsed time per iteration (ms): 13212.7 |\n");
  EXPECT_NE(wrapped.find(":2: a line with an elapsed time per iteration that does not read as Megatron's"), std::string::npos)
      << wrapped;
  EXPECT_NE(wrapped.find("cut, wrapped or run into by other output?"), std::string::npos) << wrapped;
  EXPECT_NE(refusal(line(-3, 1000)).find(":1: a line with an elapsed time"), std::string::npos) << refusal(line(-3, 1000));
  // A line cut inside its step time by another rank's output is left out, and said so (it read
  // as a 1 ms step).
  run = read(line(10, 1000) + line(20, 1000) + " [2025-11-03 10:00:00] iteration       30/     100 | elapsed time per "
                                               "iteration (ms): 1\n" + line(40, 1000));
  EXPECT_EQ(run.iterations.size(), 3u);
  EXPECT_DOUBLE_EQ(run.mean_step_s, 1.0);
  EXPECT_EQ(run.unread_lines, 1);
  EXPECT_EQ(run.first_unread_line, 3u);
  std::string notes;
  for (const std::string& n : diagnose(run, std::nullopt, find_gpu("cpu")).notes) notes += n + "\n";
  EXPECT_NE(notes.find("1 line(s) of the log with an elapsed time per iteration do not read"), std::string::npos) << notes;
  // A line without a loss (Megatron prints only losses >= 0: skipped iterations) is no divergence.
  run = read(line(10, 1000).replace(line(10, 1000).find("lm loss"), 14, "") + line(20, 1000) + line(30, 1000));
  EXPECT_TRUE(std::isnan(run.iterations.front().lm_loss));
  EXPECT_EQ(run.diverged_at, 0);
  // A loss printed NAN (Megatron before it printed only losses >= 0): a passing one is a skipped
  // step; to the log's end, the run diverged from its first such line.
  const auto nan_at = [&](int it) {
    std::string l = line(it, 1000);
    const auto at = l.find("lm loss: ") + 9;
    return l.replace(at, l.find(' ', at) - at, "NAN");
  };
  run = read(line(10, 1000) + nan_at(20) + line(30, 1000));
  EXPECT_EQ(run.diverged_at, 0);
  run = read(line(10, 1000) + nan_at(20) + nan_at(30));
  EXPECT_EQ(run.diverged_at, 20);
  notes.clear();
  for (const std::string& n : diagnose(run, std::nullopt, find_gpu("cpu")).notes) notes += n + "\n";
  EXPECT_NE(notes.find("the LM loss is NaN or infinite from iteration 20: the training diverged"), std::string::npos) << notes;
  std::filesystem::remove(path);
}

TEST(RunEvidence, MegatronLogsAsMegatronLMAndBridgeWriteThem) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_megatron_{}.log", getpid());
  const auto line = [](int it, double ms) {
    return fmt::format(" [2025-11-03 10:00:00] iteration {:8d}/     100 | consumed samples: 512 | elapsed time per "
                       "iteration (ms): {} | throughput per GPU (TFLOP/s/GPU): 20.0 | lm loss: 5.0 |\n",
                       it, ms);
  };
  // log_interval 10: the first line averages iterations 1..10, warm-up included; the steady state
  // starts with the line after it. Megatron-LM's own memory line is in MiB, the max over ranks.
  std::ofstream(path) << "  world_size ...................................... 16\n"  // Megatron's arguments dump
                      << line(10, 20000) << line(20, 9000) << line(30, 9000)
                      << "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1000.0 | max allocated: 2048.00 | "
                         "reserved: 3000.0 | max reserved: 3000.0\n"
                      << "[Rank 4] (after 10 iterations) memory (MB) | allocated: 1000.0 | max allocated: 4096.00 | "
                         "reserved: 3000.0 | max reserved: 3000.0\n";
  RunEvidence run = read_run(path.string(), std::nullopt);
  EXPECT_EQ(run.steady_first, 11);
  {
    // An iteration past the run's total is two lines run together, not a run.
    const auto bad = std::filesystem::temp_directory_path() / fmt::format("epx_megatron_{}_bad.log", getpid());
    std::ofstream(bad) << line(10, 9000) << " iteration        4/       2 | elapsed time per iteration (ms): 9000 |\n";
    const std::string e = test::error_of<InputError>([&] { read_run(bad.string(), std::nullopt); });
    EXPECT_NE(e.find(":2: iteration 4/2: past the run's 2 iterations (train_iters)"), std::string::npos) << e;
    std::filesystem::remove(bad);
  }
  EXPECT_EQ(run.ranks, 16);
  EXPECT_DOUBLE_EQ(run.mean_step_s, 9.0);
  EXPECT_DOUBLE_EQ(run.peak_memory_gb, 4.0);
  EXPECT_NE(format_diagnosis(run, diagnose(run, std::nullopt, find_gpu("h100"))).find("30 iterations (3 logged)"),
            std::string::npos);
  // Megatron's timers (--timing-log-level 1) after each line: the DP reduction's wait after the
  // backward is measured communication without a trace.
  const std::string timers = "(min, max) time across ranks (ms):\n"
                             "    forward-backward ...............................: (8000.00, 8100.00)\n"
                             "    all-grads-sync .................................: (2500.00, 3000.00)\n"
                             "    optimizer ......................................: (90.00, 100.00)\n";
  std::ofstream(path) << line(1, 9000) << timers << line(2, 9000) << timers << line(3, 9000) << timers;
  run = read_run(path.string(), std::nullopt);
  ASSERT_EQ(run.timers_ms.count("all-grads-sync"), 1u);
  EXPECT_DOUBLE_EQ(run.timers_ms["all-grads-sync"], 3000);
  EXPECT_DOUBLE_EQ(run.timers_min_ms["all-grads-sync"], 2500);
  const Diagnosis timed = diagnose(run, resolved("qwen3_30b_a3b", {"target.gpu=h100"}), find_gpu("h100"));
  EXPECT_EQ(timed.binding, "communication") << timed.why;
  // The DP reduction is the max over ranks (Megatron's timer starts after a barrier: the spread
  // is the ranks' own reductions, and the step waits for the longest): 3 s.
  EXPECT_NE(timed.why.find("min-max over ranks): all-grads-sync 2500-3000"), std::string::npos) << timed.why;
  EXPECT_NE(timed.walls[1].evidence.find("pipeline waits 3 s"), std::string::npos) << timed.walls[1].evidence;
  EXPECT_TRUE(timed.walls[1].measured);
  // The ranks differ by 500 ms in the reduction (over 10% of it and 2% of the step): a note;
  // --timing-log-option all names the rank that takes longest.
  const auto notes_of = [](const Diagnosis& d) { return fmt::format("{}", fmt::join(d.notes, "\n")); };
  EXPECT_NE(notes_of(timed).find("differ most in all-grads-sync (2500 to 3000 ms per iteration)"), std::string::npos)
      << notes_of(timed);
  const std::string all = "times across ranks (ms):\n"
                          "  forward-compute:\n     rank  0: 4000.00\n     rank  1: 5200.00\n     rank  2: 4100.00\n"
                          "  all-grads-sync:\n     rank  0: 1400.00\n     rank  1: 200.00\n     rank  2: 1300.00\n"
                          "  optimizer:\n     rank  0: 100.00\n     rank  1: 101.00\n     rank  2: 100.00\n";
  std::ofstream(path) << line(1, 9000) << all << line(2, 9000) << all << line(3, 9000) << all;
  RunEvidence per_rank = read_run(path.string(), std::nullopt);
  EXPECT_DOUBLE_EQ(per_rank.timers_ms["forward-compute"], 5200);
  EXPECT_DOUBLE_EQ(per_rank.timers_min_ms["all-grads-sync"], 200);
  EXPECT_DOUBLE_EQ(per_rank.timers_by_rank_ms["all-grads-sync"][2], 1300);
  const Diagnosis ranks = diagnose(per_rank, std::nullopt, find_gpu("h100"));
  EXPECT_NE(notes_of(ranks).find("differ most in all-grads-sync (200 to 1400 ms per iteration), forward-compute (4000 "
                                 "to 5200 ms per iteration): a rank slower"),
            std::string::npos)
      << notes_of(ranks);
  EXPECT_NE(notes_of(ranks).find("; rank 0 takes longest in all-grads-sync, rank 1 takes longest in forward-compute"),
            std::string::npos)
      << notes_of(ranks);
  EXPECT_EQ(notes_of(ranks).find("optimizer ("), std::string::npos) << notes_of(ranks);  // 1%: not a spread
  // What is left after the backward gets smaller: BF16 instead of FP32, a reduce-scatter.
  const Diagnosis fp32 = diagnose(run, resolved("qwen3_30b_a3b", {"target.gpu=h100", "ddp.grad_reduce_in_fp32=true",
                                                                  "ddp.use_distributed_optimizer=false",
                                                                  "optimizer.use_distributed_optimizer=false"}),
                                  find_gpu("h100"));
  std::vector<std::string> fixes;
  for (const Fix& f : fp32.fixes) fixes.push_back(fmt::format("{}", fmt::join(f.overrides, " ")));
  EXPECT_NE(std::find(fixes.begin(), fixes.end(), "ddp.grad_reduce_in_fp32=false"), fixes.end()) << fmt::format("{}", fmt::join(fixes, "\n"));
  EXPECT_NE(std::find(fixes.begin(), fixes.end(), "ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true ddp.overlap_param_gather=true "
                                             "optimizer.overlap_param_gather=true"),
            fixes.end());
  // Prefixed by the launcher (torchrun --tee, srun -l), the same lines read the same; a log whose
  // batch is not the config's says so.
  std::ofstream(path) << "[default0]:  world_size ...... 16\n" << line(1, 9000) << line(2, 9000) << line(3, 9000)
                      << "[default0]:    all-grads-sync .................: (2500.00, 3000.00)\n"
                      << "7:    backward-recv ..................: (10.00, 20.00)\n";
  run = read_run(path.string(), std::nullopt);
  EXPECT_EQ(run.ranks, 16);
  EXPECT_DOUBLE_EQ(run.timers_ms["all-grads-sync"], 3000);
  EXPECT_DOUBLE_EQ(run.timers_ms["backward-recv"], 20);
  run.global_batch_size = 64;
  const Diagnosis other = diagnose(run, resolved("qwen3_30b_a3b", {"target.gpu=h100"}), find_gpu("h100"));
  std::string notes;
  for (const std::string& n : other.notes) notes += n + "\n";
  EXPECT_NE(notes.find("the log's global batch is 64, the config's 1024"), std::string::npos) << notes;
  // A last line the run was still writing is left out, and said so; a NaN loss is no loss (the
  // report's gap), not 0; Megatron-LM's "using world size" line gives the ranks.
  std::ofstream(path) << "using world size: 32, data-parallel size: 32, context-parallel size: 1\n" << line(1, 9000)
                      << line(2, 9000) << line(3, 9000)
                      << " [2025-11-03 10:00:00] iteration        4/     100 | elapsed time per iteration (ms): 9000 | "
                         "lm loss: nan |\n"
                      << " [2025-11-03 10:00:00] iteration        5/     100 | consumed samples: 512 | elapsed time per "
                         "iteration (ms): 4";
  run = read_run(path.string(), std::nullopt);
  EXPECT_TRUE(run.cut_off);
  ASSERT_EQ(run.iterations.size(), 4u);
  EXPECT_TRUE(std::isnan(run.iterations.back().lm_loss));
  EXPECT_EQ(run.ranks, 32);
  EXPECT_DOUBLE_EQ(run.mean_step_s, 9.0);
  // A run resumed at iteration 1000: its first line (1001, off the interval) and the next one,
  // which covers 1001 again with its counts, stay out of the steady state and the sums.
  const auto counted = [&](int it, double ms, int skipped) {
    return fmt::format(" [2025-11-03 10:00:00] iteration {:8d}/  2000 | elapsed time per iteration (ms): {} | "
                       "number of skipped iterations: {:3d} | number of nan iterations:   0 |\n",
                       it, ms, skipped);
  };
  std::ofstream(path) << counted(1001, 60000, 1) << counted(1010, 15000, 1) << counted(1020, 9000, 0)
                      << counted(1030, 9000, 0);
  run = read_run(path.string(), std::nullopt);
  EXPECT_EQ(run.steady_first, 1011);
  EXPECT_DOUBLE_EQ(run.mean_step_s, 9.0);
  EXPECT_EQ(run.skipped_iterations, 1);
  // Without memory lines the peak is not known, and not called 0. A skipped iteration and a
  // steady step far above the others are named.
  std::ofstream(path) << line(1, 9000) << line(2, 9000) << line(3, 9000) << line(4, 9000) << line(5, 14000)
                      << " [2025-11-03 10:00:00] iteration        6/     100 | elapsed time per iteration (ms): 9000 | "
                         "lm loss: 5.0 | number of skipped iterations:   1 | number of nan iterations:   0 |\n";
  run = read_run(path.string(), std::nullopt);
  EXPECT_EQ(run.steady_first, 3);
  EXPECT_EQ(run.skipped_iterations, 1);
  const std::string text = format_diagnosis(run, diagnose(run, std::nullopt, find_gpu("h100")));
  EXPECT_NE(text.find("peak not logged"), std::string::npos) << text;
  EXPECT_EQ(text.find("peak 0 GiB"), std::string::npos) << text;
  EXPECT_NE(text.find("1 skipped and 0 NaN"), std::string::npos) << text;
  EXPECT_NE(text.find("iteration(s) 5 (1.56x)"), std::string::npos) << text;
  // A requeued run appended to its log: its lines replace the first run's from where it resumed.
  std::ofstream(path) << line(1, 9000) << line(2, 9000) << line(3, 9000) << line(4, 9000) << line(3, 20000)
                      << line(4, 9000) << line(5, 9000);
  run = read_run(path.string(), std::nullopt);
  ASSERT_EQ(run.iterations.size(), 5u);
  EXPECT_EQ(run.restarted_at, 3);
  EXPECT_DOUBLE_EQ(run.iterations[2].step_s, 20.0);
  EXPECT_EQ(run.steady_first, 5);  // the resumed process warms up again (3 and the line repeating it)
  EXPECT_DOUBLE_EQ(run.mean_step_s, 9.0);
  EXPECT_NE(format_diagnosis(run, diagnose(run, std::nullopt, find_gpu("h100"))).find("the log goes back to iteration 3"),
            std::string::npos);
  // Too short for the resumed process's steady state: the first process's before the restart,
  // not the resumed one's warm-up; with none, every line.
  std::ofstream(path) << line(1, 30000) << line(2, 9000) << line(3, 9000) << line(4, 9000) << line(4, 20000)
                      << line(5, 9000);
  run = read_run(path.string(), std::nullopt);
  EXPECT_EQ(run.steady_first, 3);
  EXPECT_EQ(run.steady_last, 3);
  EXPECT_DOUBLE_EQ(run.mean_step_s, 9.0);
  std::ofstream(path) << line(1, 30000) << line(2, 9000) << line(3, 9000) << line(3, 9000) << line(4, 9000);
  run = read_run(path.string(), std::nullopt);
  EXPECT_EQ(run.steady_first, 1);
  EXPECT_DOUBLE_EQ(run.mean_step_s, (30.0 + 9 + 9 + 9) / 4);
  // log_interval 1: the first iteration's counts are not reset either, so the second line's
  // include them (1, 2, 1 is three skipped iterations).
  std::ofstream(path) << counted(1, 9000, 1) << counted(2, 9000, 2) << counted(3, 9000, 1) << counted(4, 9000, 0);
  EXPECT_EQ(read_run(path.string(), std::nullopt).skipped_iterations, 3);
  // Without --log-throughput (Megatron's default) the rate is not 0 but unknown, or, with the
  // config, Megatron's FLOPs of it over the logged step.
  std::ofstream(path) << counted(1, 9000, 0) << counted(2, 9000, 0) << counted(3, 9000, 0) << counted(4, 9000, 0);
  run = read_run(path.string(), std::nullopt);
  EXPECT_FALSE(run.throughput_logged);
  const Diagnosis unknown = diagnose(run, std::nullopt, find_gpu("h100"));
  EXPECT_FALSE(unknown.tflops_per_gpu);
  EXPECT_NE(format_diagnosis(run, unknown).find("throughput not logged"), std::string::npos);
  EXPECT_EQ(unknown.why.find("0 TFLOP/s"), std::string::npos) << unknown.why;
  const Config config = resolved("qwen3_30b_a3b", {"target.gpu=h100"});
  const Diagnosis counted_flops = diagnose(run, config, find_gpu("h100"));
  ASSERT_TRUE(counted_flops.tflops_per_gpu);
  const Plan plan = make_plan(config);
  EXPECT_NEAR(*counted_flops.tflops_per_gpu, plan.flops_per_step / 9.0 / plan.layout.layout.world / 1e12, 1e-9);
  EXPECT_NE(counted_flops.walls.back().evidence.find("the log has no throughput"), std::string::npos);
  std::filesystem::remove(path);
}

TEST(PipelineBalance, MovesLayersOffTheStageThatHoldsTheHead) {
  ModelConfig m;
  m.num_layers = 8;
  m.pipeline_model_parallel_size = 2;
  // Stage 1 holds 4 layers of 0.1 s and a head of 0.35 s: 6 / 2 layers give 0.6 / 0.55 s.
  auto b = balance_pipeline(m, {0.4, 0.75});
  ASSERT_TRUE(b);
  EXPECT_EQ(b->slowest_stage, 1);
  EXPECT_NEAR(b->per_layer_s, 0.1, 1e-12);
  EXPECT_EQ(b->layers_balanced, (std::vector<Int>{6, 2}));
  EXPECT_NEAR(b->slowest_balanced_s, 0.6, 1e-12);
  EXPECT_TRUE(b->helps());
  EXPECT_EQ(b->layout, "Et*6|ttL");
  // A head of one layer's time: moving a layer only moves the wait.
  b = balance_pipeline(m, {0.4, 0.5});
  ASSERT_TRUE(b);
  EXPECT_FALSE(b->helps());
  // Middle stages time a layer; VPP spreads a stage's layers over its chunks, the earlier first.
  m.num_layers = 16;
  m.pipeline_model_parallel_size = 4;
  m.virtual_pipeline_model_parallel_size = 2;
  b = balance_pipeline(m, {0.4, 0.4, 0.4, 0.8});
  ASSERT_TRUE(b);
  EXPECT_EQ(b->layers_balanced, (std::vector<Int>{5, 5, 5, 1}));
  EXPECT_EQ(b->layout, "Et*3|t*3|t*3|t|tt|tt|tt|L");
  ModelConfig laid_out = m;
  laid_out.pipeline_model_parallel_layout = b->layout;
  EXPECT_NO_THROW(pipeline_split(laid_out));
  EXPECT_FALSE(balance_pipeline(m, {0.4, 0.4}));  // not this config's stages
}

TEST(Diagnose, APipelineWaitGetsPipelineFixesNotExchangeOnes) {
  // PP 2 with EP 1 and DP 1: no token exchange or gradient reduction to fix; the last stage's
  // head makes the first wait, and the fixes balance the stages and shrink the bubble.
  const Config c = resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=2", "target.gpu=cpu", "model.num_layers=8",
                                                    "model.pipeline_model_parallel_size=2",
                                                    "model.expert_model_parallel_size=1"});
  RunEvidence run;
  run.mean_step_s = 1;
  run.pipeline = PipelineEvidence{.stages = 2, .chunks = 1, .micro_batches = 8, .ideal_bubble = 1.0 / 8,
                                  .schedule_s = {0.95, 0.95}, .wait_s = {0.55, 0.25}};
  const Diagnosis d = diagnose(run, c, find_gpu("cpu"));
  EXPECT_EQ(d.binding, "communication");
  ASSERT_GE(d.fixes.size(), 2u);
  EXPECT_EQ(d.fixes[0].overrides, (std::vector<std::string>{"model.pipeline_model_parallel_layout='Et*6|ttL'"}));
  EXPECT_EQ(d.fixes[1].overrides, (std::vector<std::string>{"model.virtual_pipeline_model_parallel_size=2"}));
  for (const Fix& f : d.fixes)
    for (const std::string& o : f.overrides)
      EXPECT_TRUE(o.find("dispatcher") == std::string::npos && o.find("ddp.") == std::string::npos &&
                  o.find("overlap_moe") == std::string::npos)
          << o;
  // A fix the planner predicts slower is not offered but named in a note (the measured balance
  // is offered whatever the planner says).
  for (const Fix& f : d.fixes) {
    const auto at = f.predicted.find("(+");
    EXPECT_TRUE(at == std::string::npos || f.predicted.substr(at, 4) == "(+0%" || f.what.starts_with("balance"))
        << f.what << ": " << f.predicted;
  }
}

TEST(Plan, EachExchangeAndReductionPaysTheLinkLatency) {
  // The proxy on 2 local cpu ranks: 2 MoE layers x 5 exchanges per micro-batch (4 and the token
  // counts), and per step the DP reduction plus the grad-norm and loss all-reduces.
  const Config c = resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=2", "target.gpu=cpu"});
  GpuInfo gpu = *find_gpu("cpu");
  gpu.rates.nvlink_latency_us = 0;
  const LayoutPlan lp = plan_layout(c, gpu);
  const MemoryPlan mem = plan_memory(c, lp, Dispatcher::alltoall, false);
  const CommPlan base = plan_comm(c, lp, gpu, Dispatcher::alltoall);
  gpu.rates.nvlink_latency_us = 100;
  const CommPlan slow = plan_comm(c, lp, gpu, Dispatcher::alltoall);
  EXPECT_NEAR(slow.token_exchange_s - base.token_exchange_s, 2 * 5 * 100e-6, 1e-12);
  EXPECT_NEAR(slow.stage_reduce_s[0] + slow.step_allreduces_s - base.stage_reduce_s[0] - base.step_allreduces_s, 3 * 100e-6,
              1e-12);
  // The proxy is BF16 with grad_reduce_in_fp32 false: BF16 buckets, as epx's runtime sends them;
  // FP32 with the flag.
  const double nvl = gpu.rates.nvlink_gb_s * gpu.rates.nvlink_efficiency * 1e9;
  EXPECT_NEAR(base.stage_reduce_s[0], 2 * mem.dense_params / nvl, 1e-12);
  Config fp32 = c;
  fp32.ddp.grad_reduce_in_fp32 = true;
  EXPECT_NEAR(plan_comm(fp32, lp, gpu, Dispatcher::alltoall).stage_reduce_s[0], 4 * mem.dense_params / nvl + 100e-6, 1e-12);
}

TEST(Plan, EmbeddingRowsMoveTheTableOffTheTail) {
  // ddp.reduce_embedding_rows on 2 nodes: the embedding table's reduction leaves the tail for the
  // last micro-batch's rows (seq x hidden BF16 plus the ids, one rank's share); the plain schedule
  // hides the table under the whole last micro-batch, the merged one only under its backward.
  const std::vector<std::string> o{"target.num_gpus=2", "target.gpu=cpu", "target.gpus_per_node=1", "model.vocab_size=4096",
                                   "train.global_batch_size=32", "ddp.overlap_grad_reduce=true"};
  std::vector<std::string> with = o;
  with.push_back("ddp.reduce_embedding_rows=true");
  const Config dense = resolved("qwen3_30b_a3b_proxy", o), rows = resolved("qwen3_30b_a3b_proxy", with);
  const GpuInfo gpu = *find_gpu("cpu");
  const LayoutPlan lp = plan_layout(rows, gpu);
  const MemoryPlan mem = plan_memory(rows, lp, Dispatcher::alltoall, false);
  EXPECT_DOUBLE_EQ(mem.embedding_params, 4096.0 * 256);
  const CommPlan cd = plan_comm(dense, lp, gpu, Dispatcher::alltoall), cr = plan_comm(rows, lp, gpu, Dispatcher::alltoall);
  EXPECT_EQ(cd.embedding_rows_s, 0);
  EXPECT_EQ(cr.stage_reduce_s, cd.stage_reduce_s);
  const double net = gpu.rates.network_gb_s * gpu.rates.network_efficiency * 1e9, lat = gpu.rates.network_latency_us * 1e-6;
  // The table: a bucket of its own, ready before the last micro-batch.
  const auto table = [](const CommPlan& p) {
    return std::find_if(p.first_stage_buckets.begin(), p.first_stage_buckets.end(),
                        [](const CommPlan::Bucket& b) { return b.ready == CommPlan::kBeforeLastMicroBatch; });
  };
  EXPECT_EQ(table(cd), cd.first_stage_buckets.end());
  ASSERT_NE(table(cr), cr.first_stage_buckets.end());
  EXPECT_NEAR(table(cr)->reduce_s, 2 * 0.5 * 4096 * 256 * 2 / net + lat, 1e-12);
  EXPECT_NEAR(cr.embedding_rows_s, 256 * (256 * 2 + 8) / net + 2 * lat, 1e-12);
  const StepCosts sd = step_costs(dense, lp, gpu, cd, mem, Dispatcher::alltoall);
  const StepCosts sr = step_costs(rows, lp, gpu, cr, mem, Dispatcher::alltoall);
  EXPECT_LE(sr.dp, sd.dp + cr.embedding_rows_s);
  EXPECT_GE(sr.dp_merged, sr.dp);
  EXPECT_GE(sr.dp, cr.embedding_rows_s);
}

TEST(Plan, OverlappedReductionLeavesItsLastBucketsExposed) {
  // overlap_grad_reduce on 2 nodes: the buckets go out as the last backward completes them, so
  // what it cannot hide is the tail, the buckets it completes last (layer 0's, the embedding's);
  // the same at any depth, where the whole reduction grows with the layers.
  const GpuInfo gpu = *find_gpu("cpu");
  const auto plan = [&](int layers, std::vector<std::string> more) {
    std::vector<std::string> o{"target.num_gpus=2", "target.gpu=cpu", "target.gpus_per_node=1", "train.global_batch_size=32",
                               "ddp.overlap_grad_reduce=true", "ddp.bucket_size=100000", "model.num_layers=" + std::to_string(layers)};
    o.insert(o.end(), more.begin(), more.end());
    const Config c = resolved("qwen3_30b_a3b_proxy", o);
    const LayoutPlan lp = plan_layout(c, gpu);
    const MemoryPlan mem = plan_memory(c, lp, Dispatcher::alltoall, false);
    const CommPlan comm = plan_comm(c, lp, gpu, Dispatcher::alltoall);
    return std::pair{comm, step_costs(c, lp, gpu, comm, mem, Dispatcher::alltoall)};
  };
  const auto [shallow, s4] = plan(4, {});
  const auto [deep, s16] = plan(16, {});
  ASSERT_FALSE(deep.first_stage_buckets.empty());
  EXPECT_TRUE(std::is_sorted(deep.first_stage_buckets.begin(), deep.first_stage_buckets.end(),
                             [](const auto& a, const auto& b) { return a.ready < b.ready; }));
  EXPECT_GT(deep.first_stage_buckets.size(), shallow.first_stage_buckets.size());
  // The embedding's bucket, the one the next forward needs first, with its 4096 x 256 BF16
  // gradient (ring all-reduce over 2 ranks), starts at the backward's end.
  const double net = gpu.rates.network_gb_s * gpu.rates.network_efficiency * 1e9;
  ASSERT_EQ(std::count_if(deep.first_stage_buckets.begin(), deep.first_stage_buckets.end(),
                          [](const CommPlan::Bucket& b) { return b.first_needed; }),
            1);
  const CommPlan::Bucket& last = *std::find_if(deep.first_stage_buckets.begin(), deep.first_stage_buckets.end(),
                                               [](const CommPlan::Bucket& b) { return b.first_needed; });
  EXPECT_EQ(&last, &deep.first_stage_buckets.back());  // the dense kind's only (EDP is 1)
  EXPECT_GE(last.reduce_s, 2 * 0.5 * 4096 * 256 * 2 / net);
  EXPECT_GE(s16.dp, last.reduce_s + deep.step_allreduces_s);
  EXPECT_GT(deep.stage_reduce_s[0] - shallow.stage_reduce_s[0], 2 * (s16.dp - s4.dp));
  EXPECT_LT(s16.dp, 0.5 * deep.stage_reduce_s[0]);
  // The distributed optimizer's all-gather: after the optimizer step, or under the next forward
  // but for the first bucket it needs, the embedding's (bucket_size 1: the embedding alone, 4096 x
  // 256 BF16 weights, half of them from the other rank). Bridge's comm_overlap sets the DDP's
  // fields with the distributed optimizer.
  const auto [sharded, after] = plan(16, {"ddp.use_distributed_optimizer=true", "comm_overlap.overlap_param_gather=false", "comm_overlap.bucket_size=1"});
  const auto [same, under] = plan(16, {"ddp.use_distributed_optimizer=true", "comm_overlap.overlap_param_gather=true", "comm_overlap.bucket_size=1"});
  ASSERT_EQ(sharded.stage_gather_s.size(), 1u);
  EXPECT_GT(sharded.stage_gather_s[0], 0);
  EXPECT_NEAR(after.dp - under.dp, sharded.stage_gather_s[0] - 0.5 * 4096 * 256 * 2 / net, 1e-9);
}

TEST(Plan, InterleavedGpuRunsLaunchAChunksBucketsAtItsEnd) {
  // Each model chunk has its own DDP, so no bucket spans two chunks. Megatron buckets only the
  // first chunk, and with align_grad_reduce (its default) under VPP starts a chunk's buckets after
  // the chunk's last backward: on the first stage, chunk 0's all at the very end. epx's runtime
  // buckets every chunk and starts each bucket as it completes.
  for (const char* name : {"h100", "cpu"}) {
    const GpuInfo gpu = *find_gpu(name);
    const Config c = resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=8", std::string("target.gpu=") + name,
                                                      "model.num_layers=8", "model.pipeline_model_parallel_size=2",
                                                      "model.virtual_pipeline_model_parallel_size=2", "train.global_batch_size=32",
                                                      "ddp.overlap_grad_reduce=true", "ddp.bucket_size=1"});
    const LayoutPlan lp = plan_layout(c, gpu);
    const CommPlan comm = plan_comm(c, lp, gpu, Dispatcher::alltoall);
    const auto count = [&](auto&& pred) { return std::count_if(comm.first_stage_buckets.begin(), comm.first_stage_buckets.end(), pred); };
    const bool h100 = std::string(name) == "h100";
    // Chunk 1 (layers 4 and 5): one bucket a kind (dense, expert) on the GPU; on cpu one a weight
    // group (bucket size 1), a layer's, each kind.
    EXPECT_EQ(count([](const CommPlan::Bucket& b) { return b.chunk == 1; }), h100 ? 2 : 2 * 2) << name;
    // Chunk 0's all at the end on the GPU; on cpu layer 1's before it (layer 0's and the
    // embedding's complete at the end).
    EXPECT_EQ(count([](const CommPlan::Bucket& b) { return b.chunk == 0 && b.ready < 1; }), h100 ? 0 : 2) << name;
  }
}

TEST(Plan, TheBucketsHoldTheFirstStagesWeights) {
  // The weight groups the buckets are made of add up to the first stage's parameters, on a GPU
  // (a layer's MLP and attention apart) and on cpu (a layer whole, the MTP layers with the head),
  // with MTP layers and with one repeated MTP layer.
  for (const char* gpu_name : {"h100", "cpu"})
    for (const char* repeated : {"false", "true"}) {
      const GpuInfo gpu = *find_gpu(gpu_name);
      const Config c = resolved("deepseek_v3_mla_proxy", {"target.num_gpus=2", std::string("target.gpu=") + gpu_name,
                                                          "model.mtp_num_layers=2", std::string("model.mtp_use_repeated_layer=") + repeated});
      const LayoutPlan lp = plan_layout(c, gpu);
      double dense = 0, expert = 0, done = 0;
      for (const GradGroup& g : first_stage_grad_groups(c, lp)) {
        dense += g.dense, expert += g.expert;
        EXPECT_GE(g.done, done) << gpu_name;
        done = g.done;
      }
      const StageParams p = stage_params(c, lp, 0, embedding_rows(c));
      EXPECT_NEAR(dense, p.dense, 1e-6 * p.dense) << gpu_name << " repeated " << repeated;
      EXPECT_NEAR(expert, p.expert, 1e-6 * p.expert) << gpu_name << " repeated " << repeated;
      EXPECT_DOUBLE_EQ(done, 1) << gpu_name;
    }
}

TEST(Plan, ALaterStagesReductionRunsPastTheFirstStagesCooldown) {
  // PP 2 on a slow link, the second stage holding 7 of 8 layers and the head: its one bucket
  // starts after its own last backward, one backward slot before the first stage's ends, and
  // what it needs beyond that slot is exposed.
  GpuInfo gpu = *find_gpu("cpu");
  gpu.rates.network_gb_s = 0.001;
  const Config c = resolved("qwen3_30b_a3b_proxy", {"target.num_gpus=4", "target.gpu=cpu", "target.gpus_per_node=1",
                                                    "model.num_layers=8", "model.pipeline_model_parallel_size=2",
                                                    "model.num_layers_in_first_pipeline_stage=1", "train.global_batch_size=32",
                                                    "ddp.overlap_grad_reduce=true", "ddp.bucket_size=100000"});
  const LayoutPlan lp = plan_layout(c, gpu);
  const MemoryPlan mem = plan_memory(c, lp, Dispatcher::alltoall, false);
  const CommPlan comm = plan_comm(c, lp, gpu, Dispatcher::alltoall);
  const StepCosts s = step_costs(c, lp, gpu, comm, mem, Dispatcher::alltoall);
  ASSERT_EQ(comm.stage_reduce_s.size(), 2u);
  const double slot = 2.0 / 3.0 * (s.compute + s.memory_bound + s.host);
  double first_stage = 0;
  for (const CommPlan::Bucket& b : comm.first_stage_buckets) first_stage += b.reduce_s;
  ASSERT_GT(comm.stage_reduce_s[1] - slot, first_stage);  // the later stage's is the longer tail
  EXPECT_NEAR(s.dp, comm.stage_reduce_s[1] - slot + comm.step_allreduces_s + comm.embedding_stages_s, 1e-9);
  // Without overlap_grad_reduce the same: each stage reduces after its own backward.
  Config plain = c;
  plain.ddp.overlap_grad_reduce = false;
  const CommPlan at_end = plan_comm(plain, lp, gpu, Dispatcher::alltoall);
  EXPECT_NEAR(step_costs(plain, lp, gpu, at_end, mem, Dispatcher::alltoall).dp, s.dp, 1e-9);
}

TEST(Plan, DetachedMtpHeadsSkipTheirOutputWeightsGradient) {
  // mtp_detach_heads: each MTP depth's output layer skips its wgrad, 2hV of its 6hV FLOPs a token
  // (timed at the peak on cpu, with the layers' GEMMs on a GPU); the cross-entropy still runs.
  for (const char* gpu_name : {"cpu", "h100"}) {
    const GpuInfo gpu = *find_gpu(gpu_name);
    const auto compute = [&](const char* detach) {
      const Config c = resolved("deepseek_v3_mla_proxy", {"target.num_gpus=2", std::string("target.gpu=") + gpu_name,
                                                          "model.mtp_num_layers=2", detach});
      const LayoutPlan lp = plan_layout(c, gpu);
      const MemoryPlan mem = plan_memory(c, lp, Dispatcher::alltoall, false);
      return step_costs(c, lp, gpu, plan_comm(c, lp, gpu, Dispatcher::alltoall), mem, Dispatcher::alltoall).compute;
    };
    const Config c = resolved("deepseek_v3_mla_proxy", {"target.num_gpus=2", "model.mtp_num_layers=2"});
    const double skipped = 2 * 2.0 * static_cast<double>(c.model.hidden_size) * static_cast<double>(padded_vocab_size(c.model)) *
                           static_cast<double>(c.model.seq_length) * c.train.micro_batch_size.value_or(1);
    const double attached = compute("model.mtp_detach_heads=false"), detached = compute("model.mtp_detach_heads=true");
    if (std::string(gpu_name) == "cpu")
      EXPECT_NEAR(attached - detached, skipped / (gpu.rates.bf16_tflops * 1e12 * gpu.rates.shared_core_efficiency), 1e-12 + 1e-9 * attached);
    else
      EXPECT_GT(attached - detached, skipped / (gpu.rates.bf16_tflops * 1e12)) << gpu_name;  // at below the peak
    EXPECT_LT(detached, attached) << gpu_name;
  }
}

TEST(Plan, TiedEmbeddingsAndMtpOverStagesSumTheEmbeddingsGradientBetweenThem) {
  // PP 2 over 2 nodes: the first and last stage all-reduce the embedding's whole BF16 gradient
  // after the DP reduction (Megatron's _allreduce_word_embedding_grads), exposed.
  const std::vector<std::string> o{"target.num_gpus=2", "target.gpu=cpu", "target.gpus_per_node=1", "model.vocab_size=4096",
                                   "model.pipeline_model_parallel_size=2", "model.expert_model_parallel_size=1"};
  const GpuInfo gpu = *find_gpu("cpu");
  const double net = gpu.rates.network_gb_s * gpu.rates.network_efficiency * 1e9, lat = gpu.rates.network_latency_us * 1e-6;
  const auto costs = [&](const std::vector<std::string>& more) {
    std::vector<std::string> all = o;
    all.insert(all.end(), more.begin(), more.end());
    const Config c = resolved("qwen3_30b_a3b_proxy", all);
    const LayoutPlan lp = plan_layout(c, gpu);
    const MemoryPlan mem = plan_memory(c, lp, Dispatcher::alltoall, false);
    const CommPlan comm = plan_comm(c, lp, gpu, Dispatcher::alltoall);
    return std::tuple{comm.embedding_stages_s, step_costs(c, lp, gpu, comm, mem, Dispatcher::alltoall).dp, comm.pp_s};
  };
  const auto [untied_s, untied_dp, untied_pp] = costs({});
  EXPECT_EQ(untied_s, 0);
  for (const char* shared : {"model.share_embeddings_and_output_weights=true", "model.mtp_num_layers=1"}) {
    const auto [s, dp, pp] = costs({shared});
    EXPECT_NEAR(s, 4096.0 * 256 * 2 / net + lat, 1e-12) << shared;
    EXPECT_NEAR(dp, untied_dp + s, 1e-12) << shared;
  }
  // A standalone MTP stage holds a copy too (get_embedding_ranks): in the first stage's one chunk
  // there is nothing to sum untied; tied over PP 4 with the MTP in stage 2, a ring over 3 stages
  // sends 4/3 of the gradient.
  const auto [first_s, first_dp, first_pp] = costs({"model.mtp_num_layers=1", "model.pipeline_model_parallel_layout=Ettm|L"});
  EXPECT_EQ(first_s, 0);
  EXPECT_DOUBLE_EQ(first_pp, 2 * untied_pp);  // the stage's one boundary carries the depth's rows too
  EXPECT_GT(std::get<0>(costs({"model.mtp_num_layers=1", "model.share_embeddings_and_output_weights=true",
                               "model.pipeline_model_parallel_layout=Ettm|L"})),
            0);
  const std::vector<std::string> pp4{"target.num_gpus=4", "model.pipeline_model_parallel_size=4",
                                     "model.share_embeddings_and_output_weights=true", "model.mtp_num_layers=1"};
  std::vector<std::string> standalone = pp4;
  standalone.push_back("model.pipeline_model_parallel_layout=Et|t|m|L");
  EXPECT_NEAR(std::get<0>(costs(standalone)), 4.0 / 3 * 4096.0 * 256 * 2 / net + lat, 1e-12);
  standalone.back() = "model.pipeline_model_parallel_layout=Et|t||mL";  // the MTP beside the loss: 2 stages
  EXPECT_NEAR(std::get<0>(costs(standalone)), 4096.0 * 256 * 2 / net + lat, 1e-12);
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// The config's own out-of-range values are refused as epx plan refuses them, not searched into
// "no layout passes".
TEST(PlanSearch, RefusesTheConfigsOwnOutOfRangeValues) {
  for (const char* o : {"train.global_batch_size=0", "target.num_gpus=0", "model.expert_model_parallel_size=0"}) {
    const std::string e = test::error_of([&] { search_layouts(test::load_with("qwen3_30b_a3b", {o}), std::nullopt, 5); });
    EXPECT_NE(e.find("is out of range"), std::string::npos) << o << ": " << e;
  }
}

TEST(PlanSearch, RanksLegalLayoutsThatFit) {
  Config c = test::load_with("qwen3_30b_a3b", {});
  const SearchResult r = search_layouts(c, std::nullopt, 5);
  ASSERT_EQ(r.top.size(), 5u);
  EXPECT_GT(r.passed_check, r.fit - 1);
  EXPECT_LT(r.passed_check, r.configs_checked);  // the check removes some (e.g. PP without VPP under EP overlap)
  // Faster first; steps within 0.1% tie, and the one holding less memory goes first.
  for (std::size_t i = 0; i + 1 < r.top.size(); ++i)
    EXPECT_LE(r.top[i].variant.step_time_s, 1.001 * r.top[i + 1].variant.step_time_s);
  // The best row, applied to the config, passes the check and plans to the same step time.
  Config best = c;
  for (const std::string& o : r.top[0].overrides) apply_override(best, o);
  const CheckReport report = run_check(best);
  ASSERT_TRUE(report.ok()) << format_report(report);
  const Plan p = make_plan(report.resolved);
  for (const Variant& v : p.variants) {
    if (v.as_configured) {
      EXPECT_DOUBLE_EQ(v.step_time_s, r.top[0].variant.step_time_s);
    }
  }
  EXPECT_FALSE(r.why.empty());
  // Without the container's versions the version-gated rules pass unjudged, and the output says so.
  EXPECT_TRUE(r.unchecked.contains("ep_overlap.torch_version: pass --torch-version to check"));
  EXPECT_NE(format_search(r).find("unchecked ep_overlap.torch_version"), std::string::npos);
  EXPECT_EQ(search_json(r)["top"].size(), 5u);
}

TEST(PlanSearch, PipelinesWhoseLayersDoNotDivideTakeTheCheckersSplit) {
  // 94 layers over PP 4 x VPP 2 do not split evenly: the candidate takes the split the check's
  // fix gives (here the recipe's own embedding and loss counted), and each such row, applied,
  // passes and plans to its step time.
  const Config c = test::load_with("qwen3_235b_a22b", {});
  const SearchResult r = search_layouts(c, std::nullopt, 400);
  int uneven = 0;
  for (const SearchRow& row : r.top) {
    Config applied = c;
    for (const std::string& o : row.overrides) apply_override(applied, o);
    const Int pp = applied.model.pipeline_model_parallel_size, v = applied.model.virtual_pipeline_model_parallel_size.value_or(1);
    if (pp == 1 || applied.model.num_layers % (pp * v) == 0) continue;
    ++uneven;
    const CheckReport report = run_check(applied);
    ASSERT_TRUE(report.ok()) << fmt::format("{}", fmt::join(row.overrides, " ")) << format_report(report);
    EXPECT_DOUBLE_EQ(make_plan(report.resolved).configured().step_time_s, row.variant.step_time_s);
  }
  EXPECT_GT(uneven, 0);
}

}  // namespace
}  // namespace epx
