// What the rule files (rules_*.cpp) share: the sources Megatron's rules are quoted from, the
// outcome helpers, the model's switches as Megatron reads them, the world-size fixes, and the
// table the rules are appended to in order. Private to the check layer.
#pragma once

#include <algorithm>
#include <functional>
#include <numeric>
#include <type_traits>

#include <fmt/format.h>

#include "epx/check/check.hpp"
#include "epx/check/flex_backend.hpp"
#include "epx/check/pipeline_layout.hpp"
#include "epx/check/pipeline_split.hpp"
#include "epx/config/scheduler_steps.hpp"

namespace epx::rule_helpers {

inline constexpr const char* kBridgeCommOverlap = "Megatron-Bridge training/comm_overlap.py";
inline constexpr const char* kBridgeFlex = "Megatron-Bridge training/flex_dispatcher_backend.py";
inline constexpr const char* kBridgeTopology = "Megatron-Bridge scripts/performance/utils/utils.py";
inline constexpr const char* kBridgeConfig = "Megatron-Bridge training/config.py";
inline constexpr const char* kMcore = "Megatron-Core TransformerConfig";
inline constexpr const char* kMcoreParallel = "Megatron-Core ModelParallelConfig";
inline constexpr const char* kBridgeModel = "Megatron-Bridge models/transformer_config.py";
inline constexpr const char* kMcoreScheduler = "Megatron-Core OptimizerParamScheduler";
inline constexpr const char* kMcoreOptimizer = "Megatron-Core OptimizerConfig";
inline constexpr const char* kTeAttention = "Transformer Engine DotProductAttention";
inline constexpr const char* kTeFp8 = "Transformer Engine fp8 check_fp8_support / check_mxfp8_support";
inline constexpr const char* kSeedOverlap = "seed: moe-comm-overlap / perf-expert-parallel-overlap";
inline constexpr const char* kSeedWorkflow = "seed: moe-optimization-workflow";
inline constexpr const char* kSeedDispatcher = "seed: moe-dispatcher-selection";
inline constexpr const char* kDocs = "Megatron-Bridge docs/training/communication-overlap.md";

inline Outcome pass() { return {}; }
inline Outcome fail(std::string message, std::string fix = "") {
  return {Outcome::fail, std::move(message), std::move(fix)};
}
inline Outcome unknown(std::string what) { return {Outcome::unknown, std::move(what), ""}; }
inline Outcome fail_if(bool bad, std::string message, std::string fix = "") {
  return bad ? fail(std::move(message), std::move(fix)) : pass();
}

// EP overlap / delayed wgrad as the model ends up with them (Megatron-Core validates these).
inline bool ep_overlap(const CheckContext& c) { return c.cfg.model.overlap_moe_expert_parallel_comm; }
inline bool delay_wgrad(const CheckContext& c) { return c.cfg.model.delay_wgrad_compute; }

// Whether Bridge's own asserts run: only when comm_overlap asks for the feature. A switch set
// only on the model (no comm_overlap section) meets Megatron-Core's checks and messages alone.
inline bool bridge_ep_overlap(const CheckContext& c) {
  return c.user.comm_overlap && c.user.comm_overlap->overlap_moe_expert_parallel_comm == true;
}
inline bool bridge_delay_wgrad(const CheckContext& c) {
  return c.user.comm_overlap && c.user.comm_overlap->delay_wgrad_compute == true;
}

// Bridge's message where Bridge's assert runs, else Megatron-Core's.
inline std::string by_path(const CheckContext& c, const std::string& bridge, const std::string& mcore) {
  return bridge_ep_overlap(c) ? bridge : mcore;
}

inline std::string disable_overlap(const CheckContext& c) {
  return c.cfg.comm_overlap ? "comm_overlap.overlap_moe_expert_parallel_comm=false"
                            : "model.overlap_moe_expert_parallel_comm=false";
}

template <class T>
inline bool contains(const std::vector<T>& list, const std::type_identity_t<T>& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

// Bridge's has_cuda_graph_module: the name is in cuda_graph_modules or the legacy scope list.
inline bool has_cuda_graph_module(const ModelConfig& m, const std::string& name) {
  return contains(m.cuda_graph_modules, name) || contains(m.cuda_graph_scope, name);
}

// The graph list a fix rewrites: the one the config as written sets, Bridge's legacy
// cuda_graph_scope or the modules (finalize moves a scope into the modules where they are empty
// or Megatron-Core's default "full").
inline std::string written_graph_list(const CheckContext& c) {
  const ModelConfig& u = c.user.model;
  const bool scope = !u.cuda_graph_scope.empty() && (u.cuda_graph_modules.empty() || u.cuda_graph_modules == StringList{"full"});
  return scope || u.cuda_graph_modules.empty() ? "model.cuda_graph_scope" : "model.cuda_graph_modules";
}

// The whole training step captured: cuda_graph_impl=full_iteration, or the legacy local
// implementation with the full_iteration scope, which Megatron-Core migrates to it.
inline bool full_iteration_graph(const ModelConfig& m) {
  return m.cuda_graph_impl == "full_iteration" ||
         (m.cuda_graph_impl == "local" && has_cuda_graph_module(m, "full_iteration"));
}

// A TE version rule: unknown TE on a GPU target cannot be decided; epx's runtime has no TE. The
// fix: the feature turned off where given, else the TE version.
inline Outcome te_at_least(const CheckContext& c, const char* minimum, std::string message, std::string fix = "") {
  if (!c.cuda()) return pass();
  if (!c.cfg.target.te_version) return unknown("pass --te-version to check");
  return fail_if(!version_at_least(*c.cfg.target.te_version, minimum), std::move(message),
                 fix.empty() ? fmt::format("target.te_version={}", minimum) : std::move(fix));
}

// The smallest multiple of `step` that is >= value (for fixes that must divide).
inline Int round_up(Int value, Int step) { return step <= 0 ? value : ((value + step - 1) / step) * step; }

// TP x PP x CP and ETP x EP x PP, and the world sizes both fold on: their lcm (0 where it does not
// fit 64 bits, or a size is not positive).
struct WorldStep {
  Int mp = 0, emp = 0, step = 0;
};
inline WorldStep world_step(const ModelConfig& m) {
  WorldStep w{m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size,
              effective_etp(m) * m.expert_model_parallel_size * m.pipeline_model_parallel_size, 0};
  if (w.mp <= 0 || w.emp <= 0 || __builtin_mul_overflow(w.mp / std::gcd(w.mp, w.emp), w.emp, &w.step)) w.step = 0;
  return w;
}

// The `count` smallest world sizes from `from` up that fit both sides of the layout (multiples of
// TP x PP x CP and of ETP x EP x PP) and on which the batch divides.
inline std::vector<Int> fitting_world_sizes(const Config& cfg, std::size_t count = 4, Int from = 1) {
  const auto [mp, emp, step] = world_step(cfg.model);
  std::vector<Int> sizes;
  if (step <= 0) return sizes;
  const auto& t = cfg.train;
  const bool batch_set = t.global_batch_size && t.micro_batch_size && *t.micro_batch_size > 0;
  for (Int world = std::max(step, round_up(from, step)); world <= (Int{1} << 20) && sizes.size() < count; world += step) {
    const Int dp = world / mp;
    if (batch_set && *t.micro_batch_size * dp > *t.global_batch_size) break;  // DP only grows
    if (!batch_set || *t.global_batch_size % (*t.micro_batch_size * dp) == 0)
      sizes.push_back(world);
  }
  return sizes;
}

// The fix for a world size that does not fold: the next that folds both sides and divides the
// batch, else the next that folds both sides (none where their lcm is beyond 64 bits).
inline std::string world_fix(const Config& cfg, Int world) {
  const std::vector<Int> fits = fitting_world_sizes(cfg, 1, world);
  const Int step = world_step(cfg.model).step;
  if (fits.empty() && step <= 0) return "";
  return fmt::format("target.num_gpus={}", fits.empty() ? round_up(world, step) : fits.front());
}

// A rule that needs the world size when the user did not give it (a Megatron-Bridge dump has
// none: Bridge takes it from the launcher).
inline Outcome world_not_given(const CheckContext& c) {
  const std::vector<Int> sizes = fitting_world_sizes(c.cfg);
  if (sizes.empty())
    return unknown("world size not given (pass -ng N or set target.num_gpus); no world size "
                   "fits both the layout and the batch");
  return unknown(fmt::format("world size not given (pass -ng N or set target.num_gpus); fits {}, "
                             "... GPUs",
                             fmt::join(sizes, ", ")));
}

inline Outcome gpu_not_given() {
  return unknown("GPU not given (pass -g GPU: h100, b200, gb200, ...)");
}

inline Int microbatches(const Config& cfg) {
  const Int dp = data_parallel_size(cfg);
  if (!cfg.train.global_batch_size || !cfg.train.micro_batch_size || dp <= 0 ||
      *cfg.train.micro_batch_size <= 0)
    return 0;
  return *cfg.train.global_batch_size / (*cfg.train.micro_batch_size * dp);
}

inline constexpr Severity E = Severity::error, W = Severity::warning, A = Severity::advice;

// The rule table, in the order the rules are added (the order reports list them in).
struct RuleTable {
  std::vector<Rule> rules;
  void operator()(std::string id, Severity sev, std::vector<std::string> fields, std::string source,
                  std::string summary, std::function<Outcome(const CheckContext&)> check = {}) {
    rules.push_back({std::move(id), sev, std::move(fields), std::move(source), std::move(summary), std::move(check)});
  }
};

// Each area's rules, appended in the table's order (rules.cpp).
void add_layout_rules(RuleTable& add);
void add_model_rules(RuleTable& add);
void add_activation_rules(RuleTable& add);
void add_attention_rules(RuleTable& add);
void add_ep_overlap_rules(RuleTable& add);
void add_optimizer_rules(RuleTable& add);
void add_delay_wgrad_rules(RuleTable& add);
void add_finalize_rules(RuleTable& add);
void add_flex_rules(RuleTable& add);
void add_first_step_rules(RuleTable& add);
void add_advice_rules(RuleTable& add);
void add_cuda_graph_rules(RuleTable& add);

}  // namespace epx::rule_helpers
