// What the checker assumes when the user gives no world size, GPU or versions: a Megatron-Bridge
// dump checked as a new user would, with and without -ng / -g / --torch-version / --te-version.
// For every error rule that reads target.* the findings are exactly those Bridge (or
// Megatron-Core) would raise on that environment, and nothing is guessed where a fact is missing.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>

#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/config/schema.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

using test::error_of;

using Ids = std::set<std::string>;

const std::string kDump = std::string(EPX_TEST_DATA) + "/bridge_dump_comm_overlap.yaml";

CheckReport check_dump(const std::vector<std::string>& overrides) {
  Config c = load_config_file(kDump);
  for (const auto& o : overrides) apply_override(c, o, Config::Origin::flag);
  return run_check(c);
}

bool reads_target(const std::string& rule_id) {
  const Rule* rule = find_rule(rule_id);
  for (const auto& f : rule->fields)
    if (f.starts_with("target.")) return true;
  return false;
}

// Errors from rules that read the world size, the GPU or a version.
Ids environment_errors(const CheckReport& r) {
  Ids ids;
  for (const auto& f : r.findings)
    if (f.severity == Severity::error && reads_target(f.rule_id)) ids.insert(f.rule_id);
  return ids;
}

Ids unchecked(const CheckReport& r) {
  Ids ids;
  for (const auto& u : r.unchecked) ids.insert(u.substr(0, u.find(':')));
  return ids;
}

const Ids kWorldRules = {"parallel.world_divisible", "parallel.expert_world_divisible",
                         "train.batch_divisible", "advice.few_microbatches"};
const Ids kVersionRules = {"ep_overlap.torch_version", "delay_wgrad.te_overlap_grad_reduce",
                           "delay_wgrad.te_grad_accum_fusion", "delay_wgrad.cuda_graph_te",
                           "delay_wgrad.te_partial_cuda_graph"};

Ids operator+(Ids a, const Ids& b) {
  a.insert(b.begin(), b.end());
  return a;
}

// The dump's layout has PP > 1 with VPP: the interleaved schedule's micro-batch count needs the world too.
const Ids kDumpWorldRules = kWorldRules + Ids{"pipeline.interleaved_microbatches"};

// A dump's data_parallel_size gives the world (DP x TP x PP x CP); one past any run is refused
// at its line, not multiplied past 64 bits into a num_gpus the user never wrote.
TEST(CheckDefaults, BridgeDumpDataParallelSizeGivesTheWorld) {
  const std::string text = read_config_text(kDump);
  const auto with_dp = [&](const std::string& dp) {
    std::string t = text;
    const std::string key = "data_parallel_size: null";
    t.replace(t.find(key), key.size(), "data_parallel_size: " + dp);
    return load_config_text(t, "dump.yaml");
  };
  const Config c = with_dp("4");
  const ModelConfig& m = c.model;
  EXPECT_EQ(c.target.num_gpus, 4 * m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size);
  for (const std::string dp : {"9223372036854775807", "0", "-1"}) {
    try {
      with_dp(dp);
      ADD_FAILURE() << dp << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("dump.yaml:55:"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("comm_overlap.data_parallel_size=" + dp + " is out of range"), std::string::npos)
          << e.what();
    }
  }
}

TEST(CheckDefaults, BridgeDumpAloneGuessesNothing) {
  const CheckReport r = check_dump({});
  EXPECT_EQ(environment_errors(r), Ids{});
  EXPECT_EQ(unchecked(r), kDumpWorldRules + kVersionRules + Ids{"flex.deepep_gpu"});
  EXPECT_TRUE(r.ok());
  const std::string text = format_report(r);
  EXPECT_NE(text.find("world size: not given"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU: not given"), std::string::npos) << text;
  // EP 4 x PP 2 folds on multiples of 8; GBS 64 at MBS 1 divides over DP 4, 8, 16, 32.
  EXPECT_NE(text.find("unchecked parallel.expert_world_divisible: world size not given (pass -ng N "
                      "or set target.num_gpus); fits 8, 16, 32, 64, ... GPUs"),
            std::string::npos)
      << text;
  const auto json = report_json(r);
  EXPECT_TRUE(json["target"]["num_gpus"].is_null());
  EXPECT_TRUE(json["target"]["gpu"].is_null());
}

TEST(CheckDefaults, VersionsApplyWithoutANamedGpu) {
  // A torch / TE version describes a GPU container: every rule that reads it applies, as Bridge
  // and Megatron-Core assert on that container; the GPU-architecture rule waits for -g.
  const CheckReport old = check_dump({"target.torch_version=2.5.1", "target.te_version=2.6.0"});
  EXPECT_EQ(environment_errors(old), kVersionRules);
  EXPECT_EQ(unchecked(old), kDumpWorldRules + Ids{"flex.deepep_gpu"});
  const CheckReport fresh = check_dump({"target.torch_version=2.6.0", "target.te_version=2.12.0"});
  EXPECT_EQ(environment_errors(fresh), Ids{});
  EXPECT_EQ(unchecked(fresh), kDumpWorldRules + Ids{"flex.deepep_gpu"});
  // Between the two: TE 2.7 meets the grad-reduce and fusion asserts, not the CUDA-graph ones.
  const CheckReport mid = check_dump({"target.torch_version=2.6.0", "target.te_version=2.7.0"});
  EXPECT_EQ(environment_errors(mid),
            (Ids{"delay_wgrad.cuda_graph_te", "delay_wgrad.te_partial_cuda_graph"}));
}

TEST(CheckDefaults, WorldSizeWhenGiven) {
  const Ids errors = environment_errors(check_dump({"target.num_gpus=12"}));
  // 12 is not a multiple of ETP x EP x PP = 8; DP 6 does not divide GBS 64.
  EXPECT_EQ(errors, (Ids{"parallel.expert_world_divisible", "train.batch_divisible"}));
  EXPECT_EQ(environment_errors(check_dump({"target.num_gpus=16"})), Ids{});
  EXPECT_EQ(unchecked(check_dump({"target.num_gpus=16"})).count("parallel.world_divisible"), 0u);
}

TEST(CheckDefaults, BatchThatNoWorldDividesIsAnErrorWithoutTheWorld) {
  const CheckReport r = check_dump({"train.micro_batch_size=3"});
  EXPECT_EQ(environment_errors(r), Ids{"train.batch_divisible"});
}

TEST(CheckDefaults, GpuRulesWhenTheGpuIsNamed) {
  EXPECT_EQ(environment_errors(check_dump({"target.gpu=gb200"})), Ids{"flex.deepep_gpu"});
  const CheckReport h100 = check_dump({"target.gpu=h100"});
  EXPECT_EQ(environment_errors(h100), Ids{});
  EXPECT_EQ(unchecked(h100).count("flex.deepep_gpu"), 0u);
  // A named GPU without versions: the version rules stay unchecked, not passed.
  EXPECT_EQ(unchecked(h100), kDumpWorldRules + kVersionRules);
}

TEST(CheckDefaults, AnEpxRecipeWithoutTargetIsACpuJob) {
  Config c = load_config_text("model: {num_moe_experts: 4, expert_model_parallel_size: 2, "
                              "moe_token_dispatcher_type: alltoall, bf16: true}\n",
                              "plain.yaml");
  const CheckReport r = run_check(c);
  EXPECT_EQ(unchecked(r), (Ids{"parallel.world_divisible", "parallel.expert_world_divisible"}));
  EXPECT_NE(format_report(r).find("GPU: not given, cpu assumed"), std::string::npos);
}

TEST(CheckDefaults, UnknownGpuFromAFileNamesTheFileAndLine) {
  const Config c = load_config_text("model: {num_moe_experts: 4}\ntarget:\n  gpu: h900\n", "t.yaml");
  try {
    run_check(c);
    FAIL() << "an unknown GPU must be refused";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("t.yaml:3:8: target.gpu: unknown GPU 'h900'", 0), 0u)
        << e.what();
  }
}

TEST(CheckDefaults, VersionWithHugeComponentsIsBadInput) {
  Config c = load_config_file(kDump);
  apply_override(c, "target.torch_version='99999999999999999999.0'");
  EXPECT_THROW(run_check(c), ConfigError);
  apply_override(c, "target.torch_version='" + std::string(5000, '1') + "'");
  EXPECT_THROW(run_check(c), ConfigError);
}

TEST(CheckDefaults, JsonReportIsValidWhateverBytesTheInputHas) {
  const Config c = load_config_text("model:\n  _target_: x\n  \xff\xfename: 1\n", "bytes.yaml");
  const std::string text = json_text(report_json(run_check(c)), 2);
  EXPECT_TRUE(nlohmann::json::accept(text)) << text;
  EXPECT_NE(text.find("\xef\xbf\xbd"), std::string::npos);  // U+FFFD in place of the bad bytes
}

// Bridge's mixed_precision (a recipe's name or its fields) replaces the model's and DDP's
// precision fields first thing in runtime_config_update, defaults included.

TEST(CheckDefaults, MixedPrecisionReplacesThePrecisionFields) {
  const auto resolved = [](const std::vector<std::string>& overrides) {
    Config c = load_config_file(resolve_recipe("qwen3_30b_a3b_proxy"));
    for (const std::string& o : overrides) apply_override(c, o);
    return run_check(c);
  };
  const CheckReport fp8 = resolved({"mixed_precision=bf16-with-fp8-current-scaling-mixed"});
  EXPECT_EQ(fp8.resolved.model.fp8, "hybrid");
  EXPECT_EQ(fp8.resolved.model.fp8_recipe, "tensorwise");
  EXPECT_TRUE(fp8.resolved.model.fp8_param);  // from fp8_param_gather
  EXPECT_TRUE(fp8.resolved.model.bf16);
  EXPECT_TRUE(fp8.resolved.ddp.grad_reduce_in_fp32);
  const CheckReport half = resolved({"mixed_precision=fp16_mixed"});
  EXPECT_TRUE(half.resolved.model.fp16);
  EXPECT_FALSE(half.resolved.model.bf16);
  EXPECT_FALSE(half.resolved.ddp.grad_reduce_in_fp32);
  // An override it replaces is told.
  const CheckReport reset = resolved({"model.fp8=hybrid", "mixed_precision=bf16_mixed"});
  EXPECT_FALSE(reset.resolved.model.fp8);
  EXPECT_EQ(std::count_if(reset.findings.begin(), reset.findings.end(),
                          [](const Finding& f) { return f.rule_id == "mixed_precision.overwrites_model"; }),
            1);
  EXPECT_EQ(resolved({"mixed_precision=None"}).resolved.model.bf16, true);
  // A fix of a field it replaces drops it first (the model's field alone would be replaced
  // again), keeping the other fields at what it set.
  const CheckReport fp32 = resolved({"+mixed_precision.bf16=false", "comm_overlap.overlap_moe_expert_parallel_comm=true"});
  const auto precision = std::find_if(fp32.findings.begin(), fp32.findings.end(),
                                      [](const Finding& f) { return f.rule_id == "ep_overlap.precision"; });
  ASSERT_NE(precision, fp32.findings.end());
  EXPECT_EQ(precision->fix, "mixed_precision=None model.fp16=false model.fp8=null model.fp8_recipe=tensorwise "
                            "model.fp8_param=false ddp.grad_reduce_in_fp32=true model.bf16=true");
  EXPECT_NE(error_of([&] { resolved({"mixed_precision=bf16_mixd"}); })
                .find("override mixed_precision: Unknown mixed-precision recipe 'bf16_mixd'. Available recipes: bf16_mixed"),
            std::string::npos);
  // Its fields, as a dump after runtime_config_update writes them; errors at their line.
  const std::string fields = "mixed_precision:\n  bf16: true\n  fp8: e4m3\n  fp8_recipe: mxfp8\n  fp8_param: null\n"
                             "  fp8_param_gather: false\n  grad_reduce_in_fp32: false\nmodel:\n  num_moe_experts: 4\n";
  const CheckReport mx = run_check(load_config_text(fields, "mp.yaml"));
  EXPECT_EQ(mx.resolved.model.fp8, "e4m3");
  EXPECT_EQ(mx.resolved.model.fp8_recipe, "mxfp8");
  EXPECT_FALSE(mx.resolved.model.fp8_param);
  EXPECT_FALSE(mx.resolved.ddp.grad_reduce_in_fp32);
  EXPECT_EQ(error_of([] { run_check(load_config_text("mixed_precision:\n  fp8: hybrid\n  fp4: e2m1\nmodel: {}\n", "f.yaml")); }),
            "f.yaml:2:3: mixed_precision: fp4 and fp8 cannot be used simultaneously. Please choose one.");
  EXPECT_EQ(error_of([] { run_check(load_config_text("mixed_precision:\n  fp8: bogus\nmodel: {}\n", "f.yaml")); }),
            "f.yaml:2:8: mixed_precision.fp8 must be one of e4m3|hybrid, got 'bogus'");
  EXPECT_EQ(error_of([] { run_check(load_config_text("mixed_precision:\n  bf16: maybe\nmodel: {}\n", "f.yaml")); }),
            "f.yaml:2:9: mixed_precision.bf16 expects a bool (true|false), got maybe");
}

}  // namespace
}  // namespace epx
