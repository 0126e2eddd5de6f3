// `epx advise`: the seeds' dispatcher selection by hardware, EP degree and model family, the
// backend availability gate, and the tuning and A/B lines, on the shipped recipes.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/base/error.hpp"
#include "epx/check/check.hpp"
#include "epx/plan/advise.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

Advice advise_on(const std::string& recipe, const std::vector<std::string>& overrides, const BackendAvailability& have = {}) {
  const CheckReport r = run_check(test::load_with(recipe, overrides));
  EXPECT_TRUE(r.ok()) << format_report(r);
  return advise(r.resolved, have);
}

const Tip* tip(const Advice& a, const std::string& topic) {
  for (const Tip& t : a.tuning)
    if (t.topic == topic) return &t;
  return nullptr;
}

TEST(Advise, HardwareEpAndFamilyRulesOfTheSeeds) {
  const Advice h100 = advise_on("qwen3_30b_a3b", {});
  EXPECT_EQ(h100.seeds_choice, Dispatcher::deepep);
  EXPECT_NE(h100.ep_rule.find("medium EP"), std::string::npos) << h100.ep_rule;  // EP 16 over 2 nodes of 8
  EXPECT_NE(h100.family_rule.find("Qwen3 30B"), std::string::npos);
  EXPECT_EQ(h100.recommended, Dispatcher::deepep);  // available, and the planner agrees within its error
  EXPECT_NE(h100.gate.front().find("not stated"), std::string::npos);

  const Advice gb200 = advise_on("qwen3_235b_a22b", {"target.gpu=gb200", "target.num_gpus=256", "target.gpus_per_node=4"});
  EXPECT_EQ(gb200.seeds_choice, Dispatcher::hybridep);
  // 64 nodes run in Slurm segments of 16 (64 GPUs): each EP 32 group inside one.
  EXPECT_NE(gb200.ep_rule.find("EP 32 inside one NVLink domain"), std::string::npos) << gb200.ep_rule;
  // 44 nodes run in segments of 11 (44 GPUs), which EP 16 groups straddle; 32 or 48 nodes would not.
  const Advice gb200_44 = advise_on("qwen3_235b_a22b", {"target.gpu=gb200", "target.num_gpus=176", "target.gpus_per_node=4",
                                                        "model.expert_model_parallel_size=16", "model.pipeline_model_parallel_size=1",
                                                        "model.virtual_pipeline_model_parallel_size=null",
                                                        "train.global_batch_size=8448"});
  EXPECT_NE(gb200_44.ep_rule.find("segments of 11 nodes (44 GPUs), which some EP groups straddle"), std::string::npos)
      << gb200_44.ep_rule;
  EXPECT_NE(gb200_44.ep_rule.find("32 or 48 nodes"), std::string::npos) << gb200_44.ep_rule;
  const Advice gb200_72 = advise_on("qwen3_235b_a22b", {"target.gpu=gb200", "target.num_gpus=256", "target.gpus_per_node=4",
                                                        "model.expert_model_parallel_size=8"});  // 72 = 9 x 8
  EXPECT_NE(gb200_72.ep_rule.find("inside one NVLink domain"), std::string::npos) << gb200_72.ep_rule;
  EXPECT_NE(gb200.family_rule.find("Qwen3 235B"), std::string::npos);

  const Advice dsv3 = advise_on("deepseek_v3", {});
  EXPECT_NE(dsv3.ep_rule.find("large EP"), std::string::npos) << dsv3.ep_rule;
  EXPECT_NE(dsv3.family_rule.find("DeepSeek-V3"), std::string::npos);

  const Advice cpu = advise_on("qwen3_30b_a3b_proxy", {"target.num_gpus=2"});
  EXPECT_EQ(cpu.seeds_choice, Dispatcher::alltoall);  // first bring-up on epx's own runtime
  EXPECT_NE(cpu.ep_rule.find("small EP"), std::string::npos);
}

TEST(Advise, TheHarnessLinesNameTheRecipeAndTheLayout) {
  // A shipped recipe by its name; the layout flags always, whatever the recipe's defaults.
  const Advice recipe = advise_on("qwen3_30b_a3b", {});
  EXPECT_NE(recipe.harness_ab.front().find("-m qwen -mr qwen3_30b_a3b "), std::string::npos) << recipe.harness_ab.front();
  EXPECT_NE(recipe.harness_ab.front().find(" -tp 1 -pp 1 -cp 1 -vp None -ep 16 -et 1 -gb 1024 -mb 1 "), std::string::npos)
      << recipe.harness_ab.front();
  // A Bridge dump: by its model's hf_model_id, else said to be unknown, not made up from the file name.
  const auto dump = [](const std::vector<std::string>& overrides) {
    Config c = load_config_file(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
    for (const std::string& o : overrides) apply_override(c, o);
    const CheckReport r = run_check(c);
    EXPECT_TRUE(r.ok()) << format_report(r);
    return advise(r.resolved, {});
  };
  const Advice unknown = dump({"target.gpu=h100"});
  EXPECT_NE(unknown.harness_ab.front().find("-m / -mr: not known"), std::string::npos) << unknown.harness_ab.front();
  EXPECT_EQ(unknown.harness_ab[1].find("bridge_dump"), std::string::npos) << unknown.harness_ab[1];
  const Advice named = dump({"target.gpu=h100", "+model.hf_model_id=Qwen/Qwen3-30B-A3B"});
  EXPECT_NE(named.harness_ab.front().find("-m qwen -mr qwen3_30b_a3b "), std::string::npos) << named.harness_ab.front();
  const Advice kimi = dump({"target.gpu=h100", "+model.hf_model_id=moonshotai/Kimi-K2-Instruct"});  // the longest prefix
  EXPECT_NE(kimi.harness_ab.front().find("-m kimi -mr kimi_k2 "), std::string::npos) << kimi.harness_ab.front();
  const Advice llama = dump({"target.gpu=h100", "+model.hf_model_id=meta-llama/Llama-3.1-405B"});  // no MoE recipe
  EXPECT_NE(llama.harness_ab.front().find("-m / -mr: not known"), std::string::npos) << llama.harness_ab.front();
}

TEST(Advise, AMissingBackendIsNeverRanked) {
  BackendAvailability none = parse_have_list("none");
  const Advice a = advise_on("qwen3_235b_a22b", {"target.gpu=gb200", "target.num_gpus=256"}, none);
  EXPECT_EQ(a.recommended, Dispatcher::alltoall);  // the only measured fallback
  ASSERT_EQ(a.options.size(), 2u);  // DeepEP does not run on GB200 (Bridge falls back to alltoall)
  EXPECT_EQ(a.options.front().dispatcher, Dispatcher::alltoall);
  for (const DispatcherOption& o : a.options) EXPECT_EQ(o.available, o.dispatcher == Dispatcher::alltoall);
  ASSERT_EQ(a.gate.size(), 2u);
  EXPECT_NE(a.gate.front().find("hybridep is not installed"), std::string::npos) << a.gate.front();
  EXPECT_NE(a.gate.back().find("deepep does not run on gb200"), std::string::npos) << a.gate.back();
  EXPECT_NE(a.why.find("worth installing"), std::string::npos) << a.why;  // HybridEP is faster there
  for (const std::string& line : a.harness_ab) EXPECT_EQ(line.find("hybridep"), std::string::npos) << line;
  EXPECT_EQ(tip(a, "hybridep SMs and topology"), nullptr);

  const Advice deepep_only = advise_on("qwen3_235b_a22b", {"target.gpu=gb200", "target.num_gpus=256"},
                                       parse_have_list("deepep"));
  EXPECT_NE(deepep_only.recommended, Dispatcher::hybridep);
  EXPECT_THROW(parse_have_list("deepep,nccl"), InputError);
  for (const char* list : {"none,deepep", "", ",", "deepep,,hybridep"}) EXPECT_THROW(parse_have_list(list), InputError) << list;
}

TEST(Advise, ProbeFilesNameTheFileAndLine) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("epx_probe_{}.yaml", getpid());
  std::ofstream(path) << "deepep: true\nhybridep: false\n";
  const BackendAvailability a = read_probe_file(path.string());
  EXPECT_TRUE(a.has(Dispatcher::deepep));
  EXPECT_FALSE(a.has(Dispatcher::hybridep));
  std::ofstream(path) << "deepep: true\nhybridep: maybe\n";
  const std::string bad_value = test::error_of<InputError>([&] { read_probe_file(path.string()); });
  EXPECT_NE(bad_value.find(path.string() + ":2:"), std::string::npos) << bad_value;
  // A key that is not a name (a flow sequence), and malformed YAML: the file and line, not a
  // yaml-cpp conversion error.
  for (const char* text : {"deepep: true\n? [a]\n: true\n", "deepep: true\nhybridep: [\n"}) {
    std::ofstream(path) << text;
    try {
      read_probe_file(path.string());
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::runtime_error& e) {
      EXPECT_TRUE(dynamic_cast<const InputError*>(&e) || dynamic_cast<const ConfigError*>(&e)) << e.what();
      EXPECT_NE(std::string(e.what()).find(path.string() + ":"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(path);
  EXPECT_THROW(read_probe_file(path.string()), ConfigError);
}

TEST(Advise, TuningFollowsThePlan) {
  // Force-balanced routing for the A/B when the recipe routes dropless.
  const Advice a = advise_on("qwen3_30b_a3b", {"model.moe_router_force_load_balancing=false"});
  ASSERT_NE(tip(a, "routing"), nullptr);
  EXPECT_EQ(tip(a, "routing")->overrides, std::vector<std::string>{"model.moe_router_force_load_balancing=true"});
  for (const std::string& line : a.harness_ab)
    EXPECT_NE(line.find("model.moe_router_force_load_balancing=true"), std::string::npos);
  // The exchanges are visible on 16 x H100: EP overlap is advised, with the planner's figures.
  ASSERT_NE(tip(a, "EP overlap"), nullptr);
  EXPECT_EQ(tip(a, "EP overlap")->overrides.front(), "comm_overlap.overlap_moe_expert_parallel_comm=true");
  // One knob per A/B row: baseline, the dispatcher, + EP overlap, + delay_wgrad.
  ASSERT_EQ(a.harness_ab.size(), 4u);
  EXPECT_NE(a.harness_ab[0].find("--moe_flex_dispatcher_backend None"), std::string::npos);
  for (const std::string& line : a.harness_ab) EXPECT_EQ(line.find("runs out of memory"), std::string::npos) << line;
  // A layout that does not fit: every A/B run says so, beside the tuning's memory fix.
  const Advice big = advise_on("qwen3_30b_a3b", {"train.micro_batch_size=4"});
  ASSERT_FALSE(big.harness_ab.empty());
  for (const std::string& line : big.harness_ab)
    EXPECT_NE(line.find("past the GPU's 80 GiB: it runs out of memory as it stands"), std::string::npos) << line;
  EXPECT_NE(big.harness_ab.back().find("that keeps EP overlap (selective recompute"), std::string::npos);
  EXPECT_NE(a.harness_ab[3].find("comm_overlap.delay_wgrad_compute=true"), std::string::npos);
  // PP without VPP refuses EP overlap: the advice adds VPP.
  const std::vector<std::string> no_overlap = {"comm_overlap.overlap_moe_expert_parallel_comm=false",
                                               "comm_overlap.delay_wgrad_compute=false"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), no_overlap.begin(), no_overlap.end());
    return more;
  };
  const Advice pp = advise_on("qwen3_30b_a3b", with({"model.pipeline_model_parallel_size=2", "target.num_gpus=32"}));
  ASSERT_NE(tip(pp, "EP overlap"), nullptr);
  ASSERT_FALSE(tip(pp, "EP overlap")->overrides.empty()) << tip(pp, "EP overlap")->advice;
  EXPECT_EQ(tip(pp, "EP overlap")->overrides.back(), "model.virtual_pipeline_model_parallel_size=2");
  // Full recompute where selective fits: selective is advised.
  const Advice full = advise_on("qwen3_30b_a3b", with({"model.cuda_graph_impl=none", "model.recompute_granularity=full", "model.recompute_method=uniform",
                                                       "model.recompute_num_layers=1"}));
  ASSERT_NE(tip(full, "recompute"), nullptr);
  EXPECT_EQ(tip(full, "recompute")->overrides.front(), "model.recompute_granularity=selective") << tip(full, "recompute")->advice;
  // EP 1 has no token exchanges: one dispatcher row, no SM sweeps, one A/B line predicted at the
  // plan's step; a layout no recompute fits says so rather than advising recompute.
  const Advice ep1 = advise_on("qwen3_30b_a3b", with({"model.expert_model_parallel_size=1", "target.num_gpus=8", "env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=1"}));
  EXPECT_NE(ep1.why.find("no token exchanges here"), std::string::npos) << ep1.why;
  EXPECT_EQ(tip(ep1, "hybridep SMs and topology"), nullptr);
  ASSERT_EQ(ep1.harness_ab.size(), 1u);
  EXPECT_EQ(ep1.harness_ab[0].find("predicted 0 s/step"), std::string::npos) << ep1.harness_ab[0];
  ASSERT_NE(tip(ep1, "recompute"), nullptr);
  EXPECT_NE(tip(ep1, "recompute")->advice.find("even with full recompute"), std::string::npos) << tip(ep1, "recompute")->advice;
  EXPECT_TRUE(tip(ep1, "recompute")->overrides.empty());
}

}  // namespace
}  // namespace epx
