// The built `epx` binary: exit codes, output, flags, bad input.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epx/check/check.hpp"

namespace {

struct Result {
  int code = -1;
  std::string out;  // stdout and stderr together
};

Result run(const std::string& args) {
  const std::string cmd = std::string(EPX_BINARY) + " " + args + " 2>&1";
  Result r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), pipe)) r.out += buf.data();
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

bool has(const Result& r, const std::string& text) { return r.out.find(text) != std::string::npos; }

TEST(Cli, CleanRecipePasses) {
  const Result r = run("check qwen3_30b_a3b_proxy");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "verdict: PASS")) << r.out;
}

TEST(Cli, MisspeltOrMissingCommandIsNamed) {
  Result r = run("chek qwen3_30b_a3b_proxy");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "unknown command 'chek' for 'epx' (did you mean check?)")) << r.out;
  r = run("config shwo qwen3_30b_a3b_proxy");
  EXPECT_TRUE(has(r, "unknown command 'shwo' for 'epx config' (did you mean show?); the commands: show, list")) << r.out;
  r = run("bench");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "'epx bench' needs a command: dispatch, layer")) << r.out;
  r = run("check qwen3_30b_a3b_proxy --max-steps 3");  // the harness spells it --max_steps
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "(did you mean --max_steps?)")) << r.out;
}

TEST(Cli, ErrorsExitOne) {
  const Result r = run("check qwen3_30b_a3b_proxy comm_overlap.overlap_moe_expert_parallel_comm=true "
                       "-pp 2 -ng 4");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "error   ep_overlap.pp_needs_vpp [")) << r.out;
  EXPECT_TRUE(has(r, "model.pipeline_model_parallel_size=2")) << r.out;
  // The proxy's 2 layers do not split over PP 2 x VPP 2: the fix is the VPP that does.
  EXPECT_TRUE(has(r, "fix: model.virtual_pipeline_model_parallel_size=1")) << r.out;
  EXPECT_TRUE(has(r, "verdict: FAIL")) << r.out;
}

TEST(Cli, SeedsHarnessCommandShape) {
  // The seeds' A/B command: flags plus Hydra overrides, on the 16xH100 recipe.
  const Result r = run("check qwen3_30b_a3b -g h100 -ng 16 -gn 8 --max_steps 8 --cuda_graph_impl none "
                       "--moe_flex_dispatcher_backend None --moe_a2a_overlap false "
                       "comm_overlap.overlap_moe_expert_parallel_comm=true "
                       "comm_overlap.delay_wgrad_compute=false model.moe_shared_expert_overlap=false "
                       "--torch-version 2.7.0 --te-version 2.8.0");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "for ")) << r.out;
}

TEST(Cli, FixesOfFlagSetFieldsAreFlagsAndAFlagTakesItsLastValue) {
  // A world that folds neither side: both findings give the one world fix, as the flag that set
  // it; appended to the command line, the repeated flag takes it (argparse's last value).
  Result r = run("check qwen3_30b_a3b -ng 24");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "not divisible by ETP*EP*PP = 16: the expert side cannot be folded onto the ranks | fix: -ng 32")) << r.out;
  EXPECT_TRUE(has(r, "data_parallel_size = 1 x 24 | fix: -ng 32")) << r.out;
  r = run("check qwen3_30b_a3b -ng 24 -ng 32");
  EXPECT_EQ(r.code, 0) << r.out;
  // A batch neither DP 5 nor the interleaved schedule's groups of PP 8 divide: one batch for both.
  r = run("check qwen3_235b_a22b -ng 80 -ep 2");
  EXPECT_TRUE(has(r, "but it is 6 (M = 1638, N = 8, PP = 8) | fix: train.global_batch_size=8200")) << r.out;
  EXPECT_TRUE(has(r, "data_parallel_size = 1 x 5 | fix: train.global_batch_size=8200")) << r.out;
  // A field only implied by a flag (-rl sets full recompute): the override, and the flag to drop.
  r = run("check qwen3_30b_a3b -rl 1 --moe_a2a_overlap true");
  EXPECT_TRUE(has(r, "fix: model.recompute_granularity=selective (without -rl: a harness flag wins over overrides)")) << r.out;
  r = run("check qwen3_30b_a3b --te-version 2.1.0 --moe_a2a_overlap true comm_overlap.delay_wgrad_compute=false");
  EXPECT_TRUE(has(r, "fix: --te-version 2.")) << r.out;
}

TEST(Cli, HarnessIntegerFlagsReadAsPythonsInt) {
  // argparse's type=int: 010 is ten (CLI11 alone read octal 8), 1_000 a thousand, spaces around
  // are fine; 0x10, 4.0 and 1__0 are not integers; 10^20 is refused, not clamped to 2^63 - 1.
  Result r = run("config show qwen3_30b_a3b_proxy -tp 010 -gb ' 1_024 ' -pp=02 -vp -01");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "tensor_model_parallel_size: 10\n")) << r.out;
  EXPECT_TRUE(has(r, "global_batch_size: 1024\n")) << r.out;
  EXPECT_TRUE(has(r, "pipeline_model_parallel_size: 2\n")) << r.out;
  EXPECT_TRUE(has(r, "virtual_pipeline_model_parallel_size: null")) << r.out;  // -01 is -1: keep
  for (const char* bad : {"0x10", "4.0", "1__0", "_1", "''"}) {
    r = run(fmt::format("check qwen3_30b_a3b_proxy -ep {}", bad));
    EXPECT_EQ(r.code, 2) << bad << r.out;
    EXPECT_TRUE(has(r, "--ep: expected an integer (as Python's int() reads it)")) << bad << r.out;
  }
  r = run("check qwen3_30b_a3b_proxy -ng 99999999999999999999");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "--ng: '99999999999999999999' is out of range")) << r.out;
  r = run("config show qwen3_30b_a3b_proxy -pp 2 -vp 0x2");
  EXPECT_TRUE(has(r, "--vp: expected an integer, None (unset) or -1 (keep)")) << r.out;
}

TEST(Cli, HarnessFlagsCoupleWhatTheHarnessCouples) {
  // -ep on a HybridEP recipe resets the ranks per NVLink domain (8 in the recipe) to min(EP, 8)
  // on H100, unless an env_vars override set them; -g without -gn brings the GPU's node size.
  Result r = run("check qwen3_30b_a3b -ep 4 -ng 16");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run("check qwen3_30b_a3b -ep 4 -ng 16 env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8");
  EXPECT_TRUE(has(r, "hybridep.domain_divides_ep")) << r.out;
  r = run("plan qwen3_30b_a3b -g gb200 -ng 256 -ep 64 -gb 1024");
  EXPECT_TRUE(has(r, "64 nodes of 4, NVLink domain 64: Slurm segments of 16 nodes")) << r.out;
  // The harness checks the recipe's own hybridep backend: -ep past a rack, or on a GPU it has no
  // topology for, raises whatever the overrides set.
  r = run("check qwen3_30b_a3b -g gb200 -ng 128 -ep 128 --moe_flex_dispatcher_backend None");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "must not exceed the 72-rank NVLink domain")) << r.out;
  r = run("check qwen3_30b_a3b -g h200 -ep 8 env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "model.expert_model_parallel_size=8, which it does not couple")) << r.out;
  r = run("check qwen3_30b_a3b -g h200 model.expert_model_parallel_size=8");
  EXPECT_NE(r.code, 2) << r.out;
  r = run("plan qwen3_30b_a3b -gn 16");  // more H100s in a node than one NVLink domain holds
  EXPECT_TRUE(has(r, "1 node of 16, NVLink domain 8")) << r.out;
  r = run("plan qwen3_30b_a3b -g gb200 -gn 8 -ng 16");
  EXPECT_TRUE(has(r, "2 nodes of 8")) << r.out;
  // --cuda_graph_scope as the harness reads it: listed scopes only; full_iteration alone, never
  // with TE's graphs, and then it captures the whole step.
  r = run("check qwen3_30b_a3b --cuda_graph_scope attn,bogus");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "'bogus' is not a scope")) << r.out;
  r = run("check qwen3_30b_a3b --cuda_graph_scope full_iteration,attn --cuda_graph_impl local");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "full_iteration cannot be combined with other scopes")) << r.out;
  r = run("check qwen3_30b_a3b --cuda_graph_scope full_iteration");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "cannot use cuda_graph_impl=transformer_engine")) << r.out;
  r = run("config show qwen3_30b_a3b --cuda_graph_scope full_iteration --cuda_graph_impl local");
  EXPECT_TRUE(has(r, "  cuda_graph_impl: full_iteration\n")) << r.out;
  // advise's harness command lines paste into epx as they are (-m, -mr, --task, -c, ...); a
  // task epx does not model is refused.
  // On H200 the harness raises for -ep on a HybridEP recipe: the line gives EP as an override.
  for (const std::string extra : {"", " -g h200", " model.fp8=e4m3 model.fp8_recipe=tensorwise"}) {
    r = run("advise qwen3_30b_a3b" + extra);
    const auto at = r.out.find("run_script.py ");
    ASSERT_NE(at, std::string::npos) << r.out;
    const std::string harness = r.out.substr(at + 14, r.out.find('\n', at) - at - 14);
    r = run("check qwen3_30b_a3b " + harness + extra);
    EXPECT_EQ(r.code, 0) << harness << "\n" << r.out;
  }
  EXPECT_EQ(run("check qwen3_30b_a3b --task sft").code, 2);
  // -c builds the recipe at the harness's precision: Bridge's mixed_precision, gradients reduced
  // in BF16 (its _perf_precision), applied over the model's fields; FP4 is not modelled.
  r = run("config show qwen3_30b_a3b -c fp8_cs");
  EXPECT_TRUE(has(r, "  fp8: hybrid\n  fp8_recipe: tensorwise\n  fp8_param: true\n")) << r.out;
  EXPECT_TRUE(has(r, "  grad_reduce_in_fp32: false\n")) << r.out;
  // Messages name -c when it set the precision.
  r = run("check qwen3_30b_a3b -c bf16 model.fp8=hybrid");
  EXPECT_TRUE(has(r, "Bridge applies mixed_precision (-c bf16) over the model's precision fields before anything else "
                     "reads them: model.fp8=hybrid -> null; set the precision through -c"))
      << r.out;
  // A fix of a precision field -c set keeps the rest of its precision (FP8 stays on).
  r = run("check qwen3_30b_a3b -c fp8_mx -g h100");
  const std::string mxfp8 = "fix: mixed_precision=None model.bf16=true model.fp16=false model.fp8=e4m3 model.fp8_param=true "
                            "ddp.grad_reduce_in_fp32=false model.fp8_recipe=tensorwise";
  EXPECT_TRUE(has(r, mxfp8)) << r.out;
  r = run("config show qwen3_30b_a3b -c fp8_mx -g h100 " + mxfp8.substr(5));
  EXPECT_TRUE(has(r, "  fp8: e4m3\n  fp8_recipe: tensorwise\n")) << r.out;
  r = run("check qwen3_30b_a3b -c nvfp4");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "mixed_precision.fp4_not_modelled")) << r.out;
  // BF16 with Adam takes the precision-aware optimizer after the overrides, as run_script.py: it
  // needs the distributed optimizer, and an override cannot switch it off.
  r = run("config show qwen3_30b_a3b -c bf16 optimizer.use_precision_aware_optimizer=false");
  EXPECT_TRUE(has(r, "  use_precision_aware_optimizer: true\n")) << r.out;
  EXPECT_TRUE(has(run("config show qwen3_30b_a3b -c bf16 optimizer.optimizer=sgd"), "  use_precision_aware_optimizer: false\n"));
  r = run("check qwen3_30b_a3b_proxy -c bf16");
  EXPECT_TRUE(has(r, "--use-precision-aware-optimizer only supported with distributed optimizer | fix: "
                     "ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true\n"))
      << r.out;
}

TEST(Cli, FixesClearTheirFindingAndNotesSayWhatIsNotModelled) {
  Result r;
  // A fix that keeps the finding away: on V100 neither flex backend runs, so DeepEP's fix is
  // alltoall, not HybridEP; an interleaved batch's remainder is fixed by the group size, not
  // the batch.
  // The backend flag selects flex after the overrides: alltoall is the flag's None.
  r = run("check qwen3_30b_a3b_proxy -ng 1 -ep 1 --moe_flex_dispatcher_backend deepep");
  EXPECT_TRUE(has(r, "DeepEP dispatcher requires TPxEP > 1 | fix: --moe_flex_dispatcher_backend None")) << r.out;
  r = run("check qwen3_30b_a3b -g v100 --moe_flex_dispatcher_backend deepep");
  EXPECT_TRUE(has(r, "Falling back to alltoall. | fix: --moe_flex_dispatcher_backend None")) << r.out;
  r = run("check qwen3_30b_a3b -pp 4 -vp 2 -ng 64 -gb 1056");  // M 66: 66 mod 4 = 2
  EXPECT_TRUE(has(r, "fix: model.microbatch_group_size_per_vp_stage=6")) << r.out;
  // A dump's ddp values are Bridge's own: at another DP they are replaced without a warning; an
  // override the harness would replace is warned.
  r = run(std::string("check ") + EPX_TEST_DATA + "/bridge_dump_qwen3_30b_a3b.yaml -ng 2 -tp 2 -ep 2");
  EXPECT_FALSE(has(r, "comm_overlap.overwrites_ddp")) << r.out;
  r = run("check qwen3_30b_a3b ddp.overlap_grad_reduce=false");
  EXPECT_TRUE(has(r, "comm_overlap.overwrites_ddp")) << r.out;
  // ncclep: timed as DeepEP and said so; the alltoall rows drop the flex-only backend, so they pass.
  r = run("plan qwen3_30b_a3b model.moe_flex_dispatcher_backend=ncclep");
  EXPECT_TRUE(has(r, "note: ncclep is not modelled apart")) << r.out;
  EXPECT_FALSE(has(r, "rows marked !")) << r.out;
  // A deprecated SM knob beside an explicit moe_flex_dispatcher_num_sms (32 in the recipe): that
  // one wins, so the fix only drops the old knob.
  r = run("check qwen3_30b_a3b model.moe_deepep_num_sms=20");
  EXPECT_TRUE(has(r, "takes precedence) | fix: ~model.moe_deepep_num_sms\n")) << r.out;
}

TEST(Cli, DeepSeekV3LayoutFollowsPpAndVpAsTheHarness) {
  // -pp / -vp on DeepSeek-V3 rebuild its layout from the recipe's table, MTP beside the loss; a
  // pair outside it keeps the old one; the table replaces a layout override (the harness applies
  // it after them), --pipeline_model_parallel_layout does not.
  Result r;
  r = run("config show deepseek_v3 -pp 8 -vp 2");
  EXPECT_TRUE(has(r, "  pipeline_model_parallel_layout: Et*4|(t*4|)*14tmL\n")) << r.out;
  r = run("config show deepseek_v3 -pp 4 -vp None -ng 512");
  EXPECT_TRUE(has(r, "  pipeline_model_parallel_layout: Et*16|t*16|t*16|t*13mL\n")) << r.out;
  r = run("config show deepseek_v3 -pp 2 -vp 4 -ng 512");
  EXPECT_TRUE(has(r, "  pipeline_model_parallel_layout: Et|(tt|)*30mL\n")) << r.out;
  r = run("config show deepseek_v3 -pp 1 -vp None -ng 512");
  EXPECT_TRUE(has(r, "  pipeline_model_parallel_layout: null\n")) << r.out;
  r = run("config show deepseek_v3 -pp 8 -vp 2 model.pipeline_model_parallel_layout='Et*8|(t*8|)*6t*5mL'");
  EXPECT_TRUE(has(r, "  pipeline_model_parallel_layout: Et*4|(t*4|)*14tmL\n")) << r.out;  // the table runs after
  r = run("config show deepseek_v3 -pp 8 -vp 2 --pipeline_model_parallel_layout 'Et*8|(t*8|)*6t*5mL'");
  EXPECT_TRUE(has(r, "  pipeline_model_parallel_layout: Et*8|(t*8|)*6t*5mL\n")) << r.out;
  r = run("check deepseek_v3 -pp 8 -vp 2");
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(Cli, A2aOverlapFlagEnablesDelayWgrad) {
  const Result r = run("config show qwen3_30b_a3b_proxy --moe_a2a_overlap true");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "  overlap_moe_expert_parallel_comm: true")) << r.out;
  EXPECT_TRUE(has(r, "  delay_wgrad_compute: true")) << r.out;
}

TEST(Cli, JsonReport) {
  // Bad input under --json: the message on stderr, and one JSON object on stdout.
  const Result bad = run("check qwen3_30b_a3b_proxy --json model.bogus=1");
  EXPECT_EQ(bad.code, 2);
  const auto e = nlohmann::json::parse(bad.out.substr(bad.out.find('{')));
  EXPECT_EQ(e["exit_code"], 2);
  EXPECT_NE(e["error"].get<std::string>().find("unknown key 'model.bogus'"), std::string::npos) << bad.out;
  const Result r = run("check qwen3_30b_a3b_proxy --json model.moe_router_topk=99");
  EXPECT_EQ(r.code, 1);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["verdict"], "fail");
  EXPECT_EQ(j["findings"][0]["id"], "moe.topk_range");
  EXPECT_EQ(j["findings"][0]["fields"]["model.moe_router_topk"], "99");
}

TEST(Cli, ListRulesComesFromTheTable) {
  const Result r = run("check --list-rules");
  EXPECT_EQ(r.code, 0);
  for (const auto& rule : epx::rules()) EXPECT_TRUE(has(r, rule.id)) << rule.id;
  const Result j = run("check --list-rules --json");
  EXPECT_EQ(nlohmann::json::parse(j.out).size(), epx::rules().size());
}

TEST(Cli, UnusableInputExitsTwo) {
  struct BadInput {
    std::string args, says;
  };
  const std::vector<BadInput> cases = {
      {"qwen3_30b_a3b_proxy model.moe_topk=3", "did you mean model.moe_router_topk"},
      {"no_such_recipe", "no recipe named"},
      {"qwen3_30b_a3b_proxy -g h900", "unknown GPU 'h900'"},
      {"qwen3_30b_a3b_proxy --moe_a2a_overlap maybe", "--moe_a2a_overlap expects true or false"},
      {"qwen3_30b_a3b_proxy --moe_a2a_overlap ''", "--moe_a2a_overlap expects true or false, got ''"},
      {"qwen3_30b_a3b_proxy +model.num_layers=3", "Could not append to config"},
      {"qwen3_30b_a3b_proxy comm_overlap.tp_comm_bootstrap_backend=abc", "must be one of nccl|mpi|gloo"},
      {"qwen3_30b_a3b_proxy --moe_flex_dispatcher_backend nccl", "--moe_flex_dispatcher_backend"},
      {"qwen3_30b_a3b_proxy -rl 1 --recompute_modules moe_act", "-rl (full recompute) and --recompute_modules"},
      {"", "no config given"},
  };
  Result r;
  for (const auto& c : cases) {
    r = run("check " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r, c.says)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "terminate called")) << c.args;
  }

  const std::string bad = testing::TempDir() + "/bad.yaml";
  std::ofstream(bad) << "model:\n  num_layers: 4\n  hidden_size: [oops\n";
  r = run("check " + bad);
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, bad + ":")) << r.out;
  EXPECT_TRUE(has(r, "malformed YAML")) << r.out;
}

TEST(Cli, ConfigShowRoundTrips) {
  const std::string path = testing::TempDir() + "/shown.yaml";
  Result r = run("config show qwen3_30b_a3b model.moe_router_topk=4 -ep 8 > " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  r = run("config show " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(path);
  std::string first((std::istreambuf_iterator<char>(in)), {});
  // Drop the header comment, which names the source file.
  auto body = [](const std::string& s) { return s.substr(s.find('\n') + 1); };
  EXPECT_EQ(body(first), body(r.out));
  EXPECT_TRUE(has(r, "  moe_router_topk: 4")) << r.out;
  EXPECT_TRUE(has(r, "  expert_model_parallel_size: 8")) << r.out;
}

TEST(Cli, BridgeDumpGetsOneNote) {
  const Result r = run(std::string("check ") + EPX_TEST_DATA +
                       "/bridge_dump_qwen3_30b_a3b.yaml -g h100 --torch-version 2.7.0");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "note: kept but not modelled by epx (ignored): sections dataset")) << r.out;
  EXPECT_TRUE(has(r, "flex.deprecated_sm_knob")) << r.out;
}

}  // namespace

namespace {

std::string tmp(const std::string& name) {
  return "/tmp/epx_cli_" + std::to_string(::getpid()) + "_" + name;
}

TEST(CliLayer, InitSeedThenReadingTheFilesBackGivesTheSameResult) {
  const std::string w = tmp("w.safetensors"), x = tmp("x.safetensors"), g = tmp("g.safetensors");
  const std::string common = " qwen3_30b_a3b_proxy model.seq_length=32 --weights " + w + " --input " + x +
                             " --grad-output " + g;
  const Result first = run("layer" + common + " --init-seed 3 --out " + tmp("o1.safetensors"));
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_TRUE(has(first, "tokens per expert")) << first.out;
  const Result second = run("layer" + common + " --out " + tmp("o2.safetensors"));
  ASSERT_EQ(second.code, 0) << second.out;
  std::ifstream a(tmp("o1.safetensors"), std::ios::binary), b(tmp("o2.safetensors"), std::ios::binary);
  const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(sa.empty());
  EXPECT_EQ(sa, sb);
  // A file for another shape is refused with the tensor's name; nothing is written.
  const Result bad = run("layer qwen3_30b_a3b_proxy model.seq_length=16 --weights " + w + " --input " +
                         x + " --out " + tmp("o3.safetensors"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_TRUE(has(bad, "tensor 'input' has shape [32, 1, 256]; expected [16, 1, 256]")) << bad.out;
  EXPECT_FALSE(std::ifstream(tmp("o3.safetensors")).good());
  const Result wrong = run("layer qwen3_30b_a3b_proxy model.hidden_size=128 --weights " + w +
                           " --input " + x + " --out " + tmp("o3.safetensors"));
  EXPECT_EQ(wrong.code, 2) << wrong.out;
  EXPECT_TRUE(has(wrong, "tensor 'mlp.router.weight' has shape [16, 256]; expected [16, 128]")) << wrong.out;
  const Result missing = run("layer qwen3_30b_a3b_proxy --weights " + tmp("nope") + " --input " + x +
                             " --out " + tmp("o3.safetensors"));
  EXPECT_EQ(missing.code, 2) << missing.out;
  EXPECT_TRUE(has(missing, "cannot open the tensor file")) << missing.out;
  for (const auto& f : {w, x, g, tmp("o1.safetensors"), tmp("o2.safetensors")}) std::remove(f.c_str());
}

TEST(CliLayer, ConfigThatIsNotAnMoeLayerIsAClearError) {
  // The check's errors on the layer's math stop it first (exit 1, as epx run), before any file is read.
  const Result r = run("layer --config qwen3_30b_a3b_proxy model.moe_router_topk=40 --weights a --input b --out c");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "error   moe.topk_range [model.moe_router_topk=40")) << r.out;
  EXPECT_TRUE(has(r, "epx layer: the check found errors; not starting")) << r.out;
  // A fused activation Megatron refuses (the experts fuse SwiGLU and quick-GEGLU only) is refused,
  // not computed unfused; bench layer the same.
  const std::string fused = " qwen3_30b_a3b_proxy model.bias_activation_fusion=true model.activation_func=gelu "
                            "model.gated_linear_unit=false";
  for (const std::string& command : {"layer" + fused + " --weights a --input b --out c", "bench layer" + fused}) {
    const Result f = run(command);
    EXPECT_EQ(f.code, 1) << command << f.out;
    EXPECT_TRUE(has(f, "error   model.fused_activation_module")) << f.out;
    EXPECT_TRUE(has(f, "the check found errors; not starting")) << f.out;
  }
  // One process takes every expert, but the layer has no TP, CP or PP on any number of ranks.
  for (const auto& [flag, field] : {std::pair{"-tp 2", "model.tensor_model_parallel_size=2"},
                                    std::pair{"-cp 2", "model.context_parallel_size=2"},
                                    std::pair{"-pp 2", "model.pipeline_model_parallel_size=2"}}) {
    const Result p = run(fmt::format("layer --config qwen3_30b_a3b_proxy {} --weights a --input b --out c", flag));
    EXPECT_EQ(p.code, 2) << flag << p.out;
    EXPECT_TRUE(has(p, field)) << p.out;
  }
}

}  // namespace

TEST(Cli, PlanPrintsTheTableAndJson) {
  const Result text = run("plan qwen3_30b_a3b");
  EXPECT_EQ(text.code, 0) << text.out;
  EXPECT_TRUE(has(text, "model FLOPs: 23.006 GFLOP per token")) << text.out;
  EXPECT_TRUE(has(text, "(as configured)")) << text.out;
  const Result json = run("plan qwen3_30b_a3b --json");
  ASSERT_EQ(json.code, 0) << json.out;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  int configured = 0;
  for (const auto& v : j["variants"]) configured += v["as_configured"].get<bool>();
  EXPECT_EQ(configured, 1);
  EXPECT_TRUE(j["check_warnings"].is_array());
  EXPECT_TRUE(has(run("plan qwen3_30b_a3b --ranks 3"), "... 13 more ranks"));
  // A config the check warns on: plan and advise go on, and name the rules.
  for (const char* command : {"plan", "advise"}) {
    EXPECT_FALSE(has(run(fmt::format("{} qwen3_30b_a3b_proxy -g cpu -ng 4", command)), "epx check warns"));
    const Result warned = run(fmt::format("{} qwen3_30b_a3b_proxy -g cpu -ng 4 -gn 3", command));
    EXPECT_EQ(warned.code, 0) << warned.out;
    EXPECT_TRUE(has(warned, fmt::format("epx {}: epx check warns on this config (target.world_fills_nodes)", command)))
        << warned.out;
    const Result as_json = run(fmt::format("{} qwen3_30b_a3b_proxy -g cpu -ng 4 -gn 3 --json", command));
    ASSERT_EQ(as_json.code, 0) << as_json.out;
    EXPECT_EQ(nlohmann::json::parse(as_json.out)["check_warnings"], nlohmann::json::array({"target.world_fills_nodes"}));
  }
}

TEST(Cli, AdviseDiagnoseAndReportRefuseBadInputClearly) {
  const Result advice = run("advise qwen3_30b_a3b --json");
  ASSERT_EQ(advice.code, 0) << advice.out;
  EXPECT_EQ(nlohmann::json::parse(advice.out)["recommended"], "deepep");
  const Result have = run("advise qwen3_30b_a3b --have deepep,nccl");
  EXPECT_EQ(have.code, 2) << have.out;
  EXPECT_TRUE(has(have, "'nccl' is not a backend")) << have.out;
  const Result missing = run("diagnose /nonexistent/results.json");
  EXPECT_EQ(missing.code, 2) << missing.out;
  EXPECT_TRUE(has(missing, "/nonexistent/results.json: cannot read the run file: no such file")) << missing.out;
  const Result half = run("report :trace.json -o /tmp/x.html");
  EXPECT_EQ(half.code, 2) << half.out;
  EXPECT_TRUE(has(half, "RESULTS:TRACE takes the run's results before the colon and its trace after it")) << half.out;
  const std::string junk = ::testing::TempDir() + "epx_cli_junk.log";
  std::ofstream(junk) << "hello\nnot a training log\n";
  const Result not_a_log = run("diagnose " + junk);
  EXPECT_EQ(not_a_log.code, 2) << not_a_log.out;
  EXPECT_TRUE(has(not_a_log, "neither an `epx run --results` JSON nor a Megatron training log")) << not_a_log.out;
  std::ofstream(junk) << "{\"summary\": {},\n \"iterations\": [ }";
  const Result bad_json = run("diagnose " + junk);
  EXPECT_EQ(bad_json.code, 2) << bad_json.out;
  EXPECT_TRUE(has(bad_json, junk + ":2: not a valid epx results file")) << bad_json.out;
  // A results file whose steady range is not its iterations', or whose config is not a mapping.
  const std::string point = R"("step_time_s": 1, "tflops_per_rank": 1, "lm_loss": 5, "mem_max_allocated_bytes": 1)";
  const std::string results = R"({"summary": {"steady_state_iterations": [9, 2], "mean_step_time_s": 1,
    "tflops_per_rank": 1, "peak_memory_bytes": 1, "final_lm_loss": 5},
    "iterations": [{"iteration": 1, )" + point + R"(}, {"iteration": 2, )" + point + "}]}";
  std::ofstream(junk) << results;
  const Result reversed = run("diagnose " + junk);
  EXPECT_EQ(reversed.code, 2) << reversed.out;
  EXPECT_TRUE(has(reversed, "summary.steady_state_iterations [9, 2] is not a range of its iterations 1..2")) << reversed.out;
  // Each bad field is named by where it sits: JSON has no lines once parsed.
  std::string bad_field = results;
  bad_field.replace(bad_field.rfind("\"step_time_s\": 1"), 16, "\"step_time_s\": -1");
  std::ofstream(junk) << bad_field;
  const Result negative_step = run("diagnose " + junk);
  EXPECT_EQ(negative_step.code, 2) << negative_step.out;
  EXPECT_TRUE(has(negative_step, "iterations[1].step_time_s is -1")) << negative_step.out;
  for (const std::string steady : {"\"x\"", "null", "[0,2]", "[1.5,2]"}) {
    std::string bad_steady = results;
    bad_steady.replace(bad_steady.find("[9, 2]"), 6, steady);
    std::ofstream(junk) << bad_steady;
    const Result r = run("diagnose " + junk);
    EXPECT_EQ(r.code, 2) << steady << ": " << r.out;
    EXPECT_TRUE(has(r, "summary.steady_state_iterations is " + steady)) << r.out;
  }
  std::string fixed = results;
  fixed.replace(fixed.find("[9, 2]"), 6, "[1, 2]");
  std::ofstream(junk) << "{\"config\": \"x: [\"," << fixed.substr(1);
  const Result config = run("diagnose " + junk);
  EXPECT_EQ(config.code, 2) << config.out;
  EXPECT_TRUE(has(config, "'config' is not a mapping")) << config.out;
  // A negative time in a log line is corrupt input, not a step.
  std::ofstream(junk) << " iteration        1/      10 | elapsed time per iteration (ms): 812.5 |\n"
                         " iteration        2/      10 | elapsed time per iteration (ms): -5.0 |\n";
  const Result negative = run("diagnose " + junk);
  EXPECT_EQ(negative.code, 2) << negative.out;
  EXPECT_TRUE(has(negative, junk + ":2: elapsed time per iteration (ms) is -5.0: out of range")) << negative.out;
  // A line far longer than Megatron writes is not one of its lines (std::regex recursed on it).
  std::ofstream(junk) << " iteration        1/      10 | elapsed time per iteration (ms): " << std::string(200000, '1')
                      << " |\n";
  const Result long_line = run("diagnose " + junk);
  EXPECT_EQ(long_line.code, 2) << long_line.out;
  // A file past any run's (a sparse one: nothing is written) is refused unread.
  const std::string huge = ::testing::TempDir() + "epx_cli_huge.log";
  std::filesystem::resize_file((std::ofstream(huge), huge), std::uintmax_t{600} << 20);
  const Result too_long = run("diagnose " + huge);
  std::filesystem::remove(huge);
  EXPECT_EQ(too_long.code, 2) << too_long.out;
  EXPECT_TRUE(has(too_long, huge + ": more than 512 MiB")) << too_long.out;
  // The output is checked before anything is read or written.
  const Result out = run("report " + junk + " -o /nonexistent/dir/report.html");
  EXPECT_EQ(out.code, 2) << out.out;
  EXPECT_TRUE(has(out, "/nonexistent/dir")) << out.out;
  // An output that is one of the inputs would replace it: refused, the input left as it was.
  const Result over = run("report " + junk + " -o " + junk);
  EXPECT_EQ(over.code, 2) << over.out;
  EXPECT_TRUE(has(over, "-o " + junk + ": the same file as RUN " + junk)) << over.out;
  std::ifstream kept(junk);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}).substr(0, 10), " iteration");
}

TEST(Cli, PlanRefusesWhatTheCheckRefusesAndAsksForTheWorld) {
  const Result bad = run("plan qwen3_30b_a3b -ng 3");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_TRUE(has(bad, "epx plan: the check found errors")) << bad.out;
  const Result bad_json = run("plan qwen3_30b_a3b -ng 3 --json");  // still JSON: the check's, no plan
  EXPECT_EQ(bad_json.code, 1) << bad_json.out;
  ASSERT_TRUE(nlohmann::json::accept(bad_json.out)) << bad_json.out;
  EXPECT_TRUE(nlohmann::json::parse(bad_json.out)["plan"].is_null());
  const Result advise_json = run("advise qwen3_30b_a3b -ng 3 --json");
  EXPECT_EQ(advise_json.code, 1) << advise_json.out;
  ASSERT_TRUE(nlohmann::json::accept(advise_json.out)) << advise_json.out;
  EXPECT_TRUE(nlohmann::json::parse(advise_json.out)["advice"].is_null());
  const Result no_world = run(std::string("plan ") + EPX_TEST_DATA + "/bridge_dump_comm_overlap.yaml -g h100");
  EXPECT_EQ(no_world.code, 2) << no_world.out;
  EXPECT_TRUE(has(no_world, "pass -ng N")) << no_world.out;
  const Result no_file = run("plan qwen3_30b_a3b --hardware /nonexistent/hw.yaml");
  EXPECT_EQ(no_file.code, 2) << no_file.out;
  EXPECT_TRUE(has(no_file, "/nonexistent/hw.yaml: cannot open the file")) << no_file.out;
  // --hardware takes one file per occurrence: an override after it stays an override.
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_cli_hw_{}.yaml", getpid());
  std::ofstream(path) << "h100:\n  memory_gb: 80\n";
  const Result then_override = run("plan qwen3_30b_a3b --hardware " + path.string() + " model.num_layers=24");
  EXPECT_EQ(then_override.code, 0) << then_override.out;
  std::filesystem::remove(path);
}

namespace epx {
namespace {

// --collective-timeout within EPX_COLLECTIVE_TIMEOUT's range: 1e10 s overflowed the start-up
// watchdog's deadline and aborted the job at once, blaming a healthy rank.
TEST(Cli, CollectiveTimeoutIsBounded) {
  for (const char* t : {"1e10", "1e-9", "0"}) {
    const Result r = run(std::string("run qwen3_30b_a3b_proxy --collective-timeout ") + t);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r, "--collective-timeout: must be seconds from 0.001 to 1e+06")) << r.out;
  }
}

// `epx launch --dry-run` prints a line a shell reads back as the same arguments, and a cluster
// state with impossible counts is refused by name (nodes=0 divided by zero, nodes=abc was an
// internal error).
TEST(Cli, LaunchDryRunQuotesAndReadsTheClusterState) {
  const Result quoted = run("launch --dry-run -- epx run 'a b' 'x;rm -rf /tmp/nothing' \"it's\"");
  ASSERT_EQ(quoted.code, 0) << quoted.out;
  EXPECT_TRUE(has(quoted, " run 'a b' 'x;rm -rf /tmp/nothing' 'it'\\''s'")) << quoted.out;
  const std::string dir = ::testing::TempDir() + "epx_cluster_state";
  std::filesystem::create_directories(dir);
  ::setenv("EPX_CLUSTER_DIR", dir.c_str(), 1);
  for (const std::string nodes : {"0", "abc", "99999999999"}) {
    std::ofstream(dir + "/cluster.env") << "nodes=" << nodes << "\nranks_per_node=2\nsubnet=10.9.0.0/24\nagent=/bin/true\n";
    const Result r = run("launch --dry-run --cluster -- epx run x");
    EXPECT_EQ(r.code, 2) << nodes << ": " << r.out;
    EXPECT_TRUE(has(r, "cluster.env: nodes=" + nodes + ": not a whole number from 1 to 4096")) << r.out;
  }
  std::ofstream(dir + "/cluster.env") << "nodes=2\nranks_per_node=2\nsubnet=10.9.0.0/24\nagent=/bin/true\n";
  const Result fits = run("launch --dry-run --cluster -- epx run x");
  ::unsetenv("EPX_CLUSTER_DIR");
  std::filesystem::remove_all(dir);
  EXPECT_EQ(fits.code, 0) << fits.out;
  EXPECT_TRUE(has(fits, "-H epxnode0:2,epxnode1:2 -np 4")) << fits.out;
}

// `epx ARGS` with the environment variable NAME set to VALUE.
Result run_with(const char* name, const char* value, const std::string& args) {
  ::setenv(name, value, 1);
  const Result r = run(args);
  ::unsetenv(name);
  return r;
}

// Past the process's thread limit libgomp crashed (exit 139) starting the threads.
TEST(Cli, RefusesOmpNumThreadsPastTheLimit) {
  const Result r = run_with("OMP_NUM_THREADS", "100000", "check qwen3_30b_a3b_proxy");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "OMP_NUM_THREADS=100000: at most 1024 threads per process")) << r.out;
}

// An empty -g and a recipes folder that is not one were passed over in silence.
TEST(Cli, RefusesAnEmptyGpuAndAMissingRecipesFolder) {
  const Result gpu = run("check qwen3_30b_a3b -g ''");
  EXPECT_EQ(gpu.code, 2) << gpu.out;
  EXPECT_TRUE(has(gpu, "--gpu: names no GPU")) << gpu.out;
  const Result dir = run_with("EPX_RECIPES_DIR", "/nonexistent", "check qwen3_30b_a3b");
  EXPECT_EQ(dir.code, 2) << dir.out;
  EXPECT_TRUE(has(dir, "EPX_RECIPES_DIR=/nonexistent: not a directory of recipes")) << dir.out;
}

// A command that does not run is refused by name (mpirun ended with its own code above 128).
TEST(Cli, LaunchRefusesACommandThatDoesNotRun) {
  for (const std::string command : {"/nonexistent/binary", "''", "no_such_program_epx", "/tmp"}) {
    const Result r = run("launch -n 1 -- " + command);
    EXPECT_EQ(r.code, 2) << command << ": " << r.out;
    EXPECT_TRUE(has(r, "no such executable file")) << r.out;
  }
}

}  // namespace
}  // namespace epx
