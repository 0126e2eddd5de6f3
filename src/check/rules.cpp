// The rule table. Order: layout (with the MoE, FP8 and recompute rules), then Megatron-Bridge's
// EP-overlap asserts in its order (with Megatron-Core's extra ones after), epx's gradient
// reduction, delay_wgrad, what finalize raises, flex backends, HybridEP topology, what Megatron
// raises at build or first step, the seeds' pitfalls and advice, then CUDA graphs. Messages quote
// Megatron where Megatron has a message.
#include <algorithm>
#include <numeric>
#include <type_traits>

#include <fmt/format.h>

#include "epx/check/check.hpp"
#include "epx/check/flex_backend.hpp"
#include "epx/check/pipeline_layout.hpp"
#include "epx/check/pipeline_split.hpp"
#include "epx/config/scheduler_steps.hpp"

namespace epx {
namespace {

constexpr const char* kBridgeCommOverlap = "Megatron-Bridge training/comm_overlap.py";
constexpr const char* kBridgeFlex = "Megatron-Bridge training/flex_dispatcher_backend.py";
constexpr const char* kBridgeTopology = "Megatron-Bridge scripts/performance/utils/utils.py";
constexpr const char* kBridgeConfig = "Megatron-Bridge training/config.py";
constexpr const char* kMcore = "Megatron-Core TransformerConfig";
constexpr const char* kMcoreParallel = "Megatron-Core ModelParallelConfig";
constexpr const char* kBridgeModel = "Megatron-Bridge models/transformer_config.py";
constexpr const char* kMcoreScheduler = "Megatron-Core OptimizerParamScheduler";
constexpr const char* kMcoreOptimizer = "Megatron-Core OptimizerConfig";
constexpr const char* kTeAttention = "Transformer Engine DotProductAttention";
constexpr const char* kTeFp8 = "Transformer Engine fp8 check_fp8_support / check_mxfp8_support";
constexpr const char* kSeedOverlap = "seed: moe-comm-overlap / perf-expert-parallel-overlap";
constexpr const char* kSeedWorkflow = "seed: moe-optimization-workflow";
constexpr const char* kSeedDispatcher = "seed: moe-dispatcher-selection";
constexpr const char* kDocs = "Megatron-Bridge docs/training/communication-overlap.md";

Outcome pass() { return {}; }
Outcome fail(std::string message, std::string fix = "") {
  return {Outcome::fail, std::move(message), std::move(fix)};
}
Outcome unknown(std::string what) { return {Outcome::unknown, std::move(what), ""}; }
Outcome fail_if(bool bad, std::string message, std::string fix = "") {
  return bad ? fail(std::move(message), std::move(fix)) : pass();
}

// EP overlap / delayed wgrad as the model ends up with them (Megatron-Core validates these).
bool ep_overlap(const CheckContext& c) { return c.cfg.model.overlap_moe_expert_parallel_comm; }
bool delay_wgrad(const CheckContext& c) { return c.cfg.model.delay_wgrad_compute; }

// Whether Bridge's own asserts run: only when comm_overlap asks for the feature. A switch set
// only on the model (no comm_overlap section) meets Megatron-Core's checks and messages alone.
bool bridge_ep_overlap(const CheckContext& c) {
  return c.user.comm_overlap && c.user.comm_overlap->overlap_moe_expert_parallel_comm == true;
}
bool bridge_delay_wgrad(const CheckContext& c) {
  return c.user.comm_overlap && c.user.comm_overlap->delay_wgrad_compute == true;
}

// Bridge's message where Bridge's assert runs, else Megatron-Core's.
std::string by_path(const CheckContext& c, const std::string& bridge, const std::string& mcore) {
  return bridge_ep_overlap(c) ? bridge : mcore;
}

std::string disable_overlap(const CheckContext& c) {
  return c.cfg.comm_overlap ? "comm_overlap.overlap_moe_expert_parallel_comm=false"
                            : "model.overlap_moe_expert_parallel_comm=false";
}

template <class T>
bool contains(const std::vector<T>& list, const std::type_identity_t<T>& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

// Bridge's has_cuda_graph_module: the name is in cuda_graph_modules or the legacy scope list.
bool has_cuda_graph_module(const ModelConfig& m, const std::string& name) {
  return contains(m.cuda_graph_modules, name) || contains(m.cuda_graph_scope, name);
}

// The whole training step captured: cuda_graph_impl=full_iteration, or the legacy local
// implementation with the full_iteration scope, which Megatron-Core migrates to it.
bool full_iteration_graph(const ModelConfig& m) {
  return m.cuda_graph_impl == "full_iteration" ||
         (m.cuda_graph_impl == "local" && has_cuda_graph_module(m, "full_iteration"));
}

// A TE version rule: unknown TE on a GPU target cannot be decided; epx's runtime has no TE.
Outcome te_at_least(const CheckContext& c, const char* minimum, std::string message) {
  if (!c.cuda()) return pass();
  if (!c.cfg.target.te_version) return unknown("pass --te-version to check");
  return fail_if(!version_at_least(*c.cfg.target.te_version, minimum), std::move(message),
                 fmt::format("target.te_version={}", minimum));
}

// The smallest multiple of `step` that is >= value (for fixes that must divide).
Int round_up(Int value, Int step) { return step <= 0 ? value : ((value + step - 1) / step) * step; }

// TP x PP x CP and ETP x EP x PP, and the world sizes both fold on: their lcm (0 where it does not
// fit 64 bits, or a size is not positive).
struct WorldStep {
  Int mp = 0, emp = 0, step = 0;
};
WorldStep world_step(const ModelConfig& m) {
  WorldStep w{m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size,
              effective_etp(m) * m.expert_model_parallel_size * m.pipeline_model_parallel_size, 0};
  if (w.mp <= 0 || w.emp <= 0 || __builtin_mul_overflow(w.mp / std::gcd(w.mp, w.emp), w.emp, &w.step)) w.step = 0;
  return w;
}

// The `count` smallest world sizes from `from` up that fit both sides of the layout (multiples of
// TP x PP x CP and of ETP x EP x PP) and on which the batch divides.
std::vector<Int> fitting_world_sizes(const Config& cfg, std::size_t count = 4, Int from = 1) {
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
std::string world_fix(const Config& cfg, Int world) {
  const std::vector<Int> fits = fitting_world_sizes(cfg, 1, world);
  const Int step = world_step(cfg.model).step;
  if (fits.empty() && step <= 0) return "";
  return fmt::format("target.num_gpus={}", fits.empty() ? round_up(world, step) : fits.front());
}

// A rule that needs the world size when the user did not give it (a Megatron-Bridge dump has
// none: Bridge takes it from the launcher).
Outcome world_not_given(const CheckContext& c) {
  const std::vector<Int> sizes = fitting_world_sizes(c.cfg);
  if (sizes.empty())
    return unknown("world size not given (pass -ng N or set target.num_gpus); no world size "
                   "fits both the layout and the batch");
  return unknown(fmt::format("world size not given (pass -ng N or set target.num_gpus); fits {}, "
                             "... GPUs",
                             fmt::join(sizes, ", ")));
}

Outcome gpu_not_given() {
  return unknown("GPU not given (pass -g GPU: h100, b200, gb200, ...)");
}

Int microbatches(const Config& cfg) {
  const Int dp = data_parallel_size(cfg);
  if (!cfg.train.global_batch_size || !cfg.train.micro_batch_size || dp <= 0 ||
      *cfg.train.micro_batch_size <= 0)
    return 0;
  return *cfg.train.global_batch_size / (*cfg.train.micro_batch_size * dp);
}

std::vector<Rule> build_rules() {
  std::vector<Rule> r;
  auto add = [&](std::string id, Severity sev, std::vector<std::string> fields, std::string source,
                 std::string summary, std::function<Outcome(const CheckContext&)> check = {}) {
    r.push_back({std::move(id), sev, std::move(fields), std::move(source), std::move(summary),
                 std::move(check)});
  };
  const auto E = Severity::error, W = Severity::warning, A = Severity::advice;

  // ---- Layout -------------------------------------------------------------------------------
  add("parallel.world_divisible", E,
      {"target.num_gpus", "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
       "model.context_parallel_size"},
      kBridgeConfig, "world size divisible by TP*PP*CP (data-parallel size)",
      [](const CheckContext& c) {
        if (!c.world()) return world_not_given(c);
        const auto& m = c.cfg.model;
        const Int mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size *
                       m.context_parallel_size;
        return fail_if(data_parallel_size(c.cfg) == 0,
                       fmt::format("world size {} is not divisible by TP*PP*CP = {}", *c.world(),
                                   mp),
                       world_fix(c.cfg, *c.world()));
      });
  add("parallel.expert_world_divisible", E,
      {"target.num_gpus", "model.expert_tensor_parallel_size", "model.expert_model_parallel_size",
       "model.pipeline_model_parallel_size"},
      kMcore, "world size divisible by ETP*EP*PP (expert data-parallel size)",
      [](const CheckContext& c) {
        if (!c.world()) return world_not_given(c);
        const auto& m = c.cfg.model;
        const Int emp = effective_etp(m) * m.expert_model_parallel_size *
                        m.pipeline_model_parallel_size;
        return fail_if(emp <= 0 || *c.world() % emp != 0,
                       fmt::format("world size {} is not divisible by ETP*EP*PP = {}: the expert "
                                   "side cannot be folded onto the ranks",
                                   *c.world(), emp),
                       world_fix(c.cfg, *c.world()));
      });
  add("parallel.ep_needs_experts", E,
      {"model.expert_model_parallel_size", "model.num_moe_experts"}, kMcore,
      "expert parallelism needs an MoE model", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.expert_model_parallel_size > 1 && !m.num_moe_experts,
                       "num_moe_experts must be non None to use expert-parallel.",
                       "model.expert_model_parallel_size=1");
      });
  add("parallel.experts_divisible_by_ep", E,
      {"model.num_moe_experts", "model.expert_model_parallel_size"}, kMcore,
      "experts split evenly over EP ranks", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts || m.expert_model_parallel_size <= 0) return pass();
        const Int experts = *m.num_moe_experts, ep = m.expert_model_parallel_size;
        if (experts % ep == 0) return pass();
        Int nearest = 1;  // the divisor of the expert count nearest EP, the larger on a tie
        for (Int d = 1; d <= experts && d <= 2 * ep; ++d)
          if (experts % d == 0 && std::abs(d - ep) <= std::abs(nearest - ep)) nearest = d;
        return fail(fmt::format("num_moe_experts ({}) must be divisible by expert_model_parallel_size ({})", experts, ep),
                    fmt::format("model.expert_model_parallel_size={}", nearest));
      });
  add("parallel.heads_divisible_by_tp", E,
      {"model.num_attention_heads", "model.num_query_groups", "model.tensor_model_parallel_size"},
      kMcore, "attention heads split evenly over TP ranks, query groups too or each replicated over TP ranks",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int tp = m.tensor_model_parallel_size;
        if (tp <= 0 || m.num_attention_heads == 0) return pass();
        // TP 1 also takes sequence parallelism off (parallel.sp_needs_tp).
        const std::string no_tp = m.sequence_parallel
                                      ? "model.tensor_model_parallel_size=1 model.sequence_parallel=false"
                                      : "model.tensor_model_parallel_size=1";
        if (m.num_attention_heads % tp != 0)
          return fail(fmt::format("num_attention_heads ({}) must be a multiple of "
                                  "tensor_model_parallel_size ({}).",
                                  m.num_attention_heads, tp),
                      no_tp);
        // Fewer groups than TP ranks: Megatron-Core (since December 2025) sub-shards each one.
        const Int groups = m.num_query_groups.value_or(m.num_attention_heads);
        return fail_if(groups % tp != 0 && tp % groups != 0,
                       fmt::format("num_query_groups ({}) must be a multiple or divisor of "
                                   "tensor_model_parallel_size ({}).",
                                   groups, tp),
                       no_tp);
      });
  // Megatron-Core refuses it ("Cannot use sequence parallelism without tensor parallelism"), but
  // Bridge's model config turns it off first (models/transformer_config.py finalize).
  add("parallel.sp_needs_tp", W, {"model.sequence_parallel", "model.tensor_model_parallel_size"},
      kBridgeModel, "sequence parallelism without TP > 1 is turned off", [](const CheckContext& c) {
        return fail_if(c.user.model.sequence_parallel && c.cfg.model.tensor_model_parallel_size <= 1,
                       "sequence_parallel=true with tensor_model_parallel_size=1: Bridge turns it off (Megatron-Core "
                       "alone would refuse: Cannot use sequence parallelism without tensor parallelism)",
                       "model.sequence_parallel=false");
      });
  add("attention.query_groups_divide_heads", E, {"model.num_attention_heads", "model.num_query_groups"},
      kTeAttention, "each query group serves a whole number of attention heads",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_query_groups || *m.num_query_groups <= 0 || m.num_attention_heads <= 0) return pass();
        // The nearest divisor of the heads below, that TP also splits or replicates.
        const Int tp = std::max<Int>(1, m.tensor_model_parallel_size);
        Int groups = std::min(*m.num_query_groups, m.num_attention_heads);
        while (groups > 1 && (m.num_attention_heads % groups != 0 || (groups % tp != 0 && tp % groups != 0))) --groups;
        return fail_if(m.num_attention_heads % *m.num_query_groups != 0,
                       "The number of attention heads must be divisible by the number of GQA groups!",
                       fmt::format("model.num_query_groups={}", groups));
      });
  add("pipeline.layout", E,
      {"model.pipeline_model_parallel_layout", "model.pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size", "model.num_layers", "model.mtp_num_layers",
       "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage",
       "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split"},
      kMcore, "a pipeline layout places the embedding first, the loss last, every layer once, in PP x VPP stages",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.pipeline_model_parallel_layout) return pass();
        // No layout if the layers split without one, else the split fix's (a layout it generates).
        ModelConfig unlaid = m;
        unlaid.pipeline_model_parallel_layout.reset();
        std::vector<std::string> split_fix;
        if (!layers_split(unlaid)) split_fix = pipeline_split_fix(unlaid);
        if (split_fix.empty() || split_fix.front().find("pipeline_model_parallel_layout") == std::string::npos)
          split_fix.insert(split_fix.begin(), "model.pipeline_model_parallel_layout=null");
        const std::string fix = fmt::format("{}", fmt::join(split_fix, " "));
        const auto py = [](bool b) { return b ? "True" : "False"; };
        const auto py_int = [](const OptInt& v) { return v ? std::to_string(*v) : std::string("None"); };
        if (m.num_layers_in_first_pipeline_stage || m.num_layers_in_last_pipeline_stage ||
            m.account_for_embedding_in_pipeline_split || m.account_for_loss_in_pipeline_split)
          return fail(fmt::format("pipeline_model_parallel_layout cannot be set with other pipeline layout arguments. "
                                  "self.num_layers_in_first_pipeline_stage={}, self.num_layers_in_last_pipeline_stage={}, "
                                  "self.account_for_embedding_in_pipeline_split={}, "
                                  "self.account_for_loss_in_pipeline_split={}.",
                                  py_int(m.num_layers_in_first_pipeline_stage),
                                  py_int(m.num_layers_in_last_pipeline_stage),
                                  py(m.account_for_embedding_in_pipeline_split), py(m.account_for_loss_in_pipeline_split)),
                      "model.pipeline_model_parallel_layout=null");
        std::vector<std::string> stages;
        try {
          stages = parse_pipeline_layout(*m.pipeline_model_parallel_layout);
        } catch (const ConfigError& e) {
          return fail(e.what(), fix);
        }
        const Int pp = m.pipeline_model_parallel_size, count = static_cast<Int>(stages.size());
        if (count % pp != 0)
          return fail(fmt::format("pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size "
                                  "(len(layout)={}, pipeline_model_parallel_size={})",
                                  count, pp),
                      fix);
        if (m.virtual_pipeline_model_parallel_size && *m.virtual_pipeline_model_parallel_size != count / pp)
          return fail(fmt::format("virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout, "
                                  "(self.virtual_pipeline_model_parallel_size={},  detected_vpp_size={})",
                                  *m.virtual_pipeline_model_parallel_size, count / pp),
                      count / pp > 1 ? fmt::format("model.virtual_pipeline_model_parallel_size={}", count / pp)
                                     : "model.virtual_pipeline_model_parallel_size=null");
        std::string layers;  // in layer order
        for (const std::string& stage : stages) layers += stage;
        const auto type = [](char ch) {
          return fmt::format("LayerType.{}", ch == 'E' ? "embedding" : ch == 'L' ? "loss" : ch == 't' ? "decoder" : "mtp");
        };
        if (layers.empty() || layers.front() != 'E')
          return fail(fmt::format("The first layer must be embedding, but got {}", layers.empty() ? "nothing" : type(layers.front())), fix);
        if (layers.back() != 'L') return fail(fmt::format("The last layer must be loss, but got {}", type(layers.back())), fix);
        const auto n = [&](char ch) { return static_cast<Int>(std::count(layers.begin(), layers.end(), ch)); };
        if (n('E') != 1) return fail("Embedding must be specified exactly once", fix);
        if (n('L') != 1) return fail("Loss must be specified exactly once", fix);
        if (n('t') != m.num_layers)
          return fail(fmt::format("Number of decoder layers {}must match num_layers {}", n('t'), m.num_layers), fix);
        if (n('m') != m.mtp_num_layers.value_or(0))
          return fail("Number of mtp layers in layout must match mtp_num_layers", fix);
        const auto first_mtp = layers.find('m');
        if (first_mtp != std::string::npos && layers.find('t', first_mtp) != std::string::npos)
          return fail("decoder layers must be placed before MTP layers", fix);
        // Virtual stage v * PP + p is chunk v of rank p: MTP only in a rank's last chunk, all of it there.
        const Int chunks = count / pp;
        for (Int k = 0; k < count; ++k) {
          const std::string& stage = stages[static_cast<std::size_t>(k)];
          const auto mtp = static_cast<Int>(std::count(stage.begin(), stage.end(), 'm'));
          if (mtp == 0) continue;
          if (k / pp < chunks - 1)
            return fail(fmt::format("Currently we restrict that the MTP should be always in the last virtual pipeline "
                                    "stage of that rank. But got {}",
                                    stage),
                        fix);
          if (mtp != m.mtp_num_layers.value_or(0))
            return fail("All of the MTP layers must be in the same one virtual pipeline stage", fix);
        }
        return pass();
      });
  add("parallel.layers_divisible_by_pp", E,
      {"model.num_layers", "model.pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_layout",
       "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split",
       "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage"},
      kMcore, "layers split evenly over pipeline (and virtual pipeline) stages",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.pipeline_model_parallel_layout || m.num_layers == 0) return pass();  // pipeline.layout's
        try {
          pipeline_split(m);
          return pass();
        } catch (const ConfigError& e) {
          const std::vector<std::string> fix = pipeline_split_fix(m);
          return fail(e.what(), fix.empty() ? "model.pipeline_model_parallel_layout=<layout>"
                                            : fmt::format("{}", fmt::join(fix, " ")));
        }
      });
  add("pipeline.defer_embedding_wgrad", E,
      {"model.defer_embedding_wgrad_compute", "model.pipeline_model_parallel_size",
       "model.gradient_accumulation_fusion", "model.wgrad_deferral_limit"},
      kMcoreParallel, "deferring the embedding's wgrad needs PP, gradient accumulation fusion and a limit >= 0",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.defer_embedding_wgrad_compute) return pass();
        const std::string section = c.cfg.comm_overlap ? "comm_overlap" : "model";  // where finalize took it from
        const std::string off = section + ".defer_embedding_wgrad_compute=false";
        if (m.pipeline_model_parallel_size == 1)
          return fail("Cannot defer embedding wgrad compute when pipeline model parallel is not used", off);
        const std::string limit = section + ".wgrad_deferral_limit=0";
        if (!m.gradient_accumulation_fusion)
          return fail("Cannot defer embedding wgrad compute when gradient accumulation fusion is not used",
                      "model.gradient_accumulation_fusion=true" + (m.wgrad_deferral_limit < 0 ? " " + limit : ""));
        return fail_if(m.wgrad_deferral_limit < 0,
                       "Wgrad deferral limit should be greater than or equal to 0 when it is enabled!", limit);
      });
  add("parallel.vpp_needs_pp", E,
      {"model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
       "model.pipeline_model_parallel_layout"},
      "Megatron-Core parallel_state.py", "the interleaved schedule (VPP, given or a layout's) needs PP > 1",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.pipeline_model_parallel_size == 1 && !m.virtual_pipeline_model_parallel_size && virtual_pipeline_size(m))
          return fail(fmt::format("pipeline_model_parallel_layout has {} stages, so virtual_pipeline_model_parallel_size "
                                  "= {}, with pipeline_model_parallel_size = 1: pipeline-model-parallel size should be "
                                  "greater than 1 with interleaved schedule",
                                  *virtual_pipeline_size(m), *virtual_pipeline_size(m)),
                      "model.pipeline_model_parallel_layout=null");
        return fail_if(m.pipeline_model_parallel_size == 1 && m.virtual_pipeline_model_parallel_size.has_value(),
                       "virtual_pipeline_model_parallel_size is set with pipeline_model_parallel_size = 1: the "
                       "interleaved schedule needs pipeline parallelism",
                       "model.virtual_pipeline_model_parallel_size=null");
      });
  add("pipeline.interleaved_microbatches", E,
      {"model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
       "model.pipeline_model_parallel_layout", "model.microbatch_group_size_per_vp_stage", "train.global_batch_size",
       "train.micro_batch_size", "target.num_gpus"},
      "Megatron-Core pipeline_parallel/schedules.py",
      "the interleaved schedule runs micro-batches in groups of N (PP by default): PP <= N <= M, M mod N 0 or >= PP",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int pp = m.pipeline_model_parallel_size;
        if (pp <= 1 || !virtual_pipeline_size(m)) return pass();  // a layout's VPP too
        if (!c.world()) return world_not_given(c);
        const Int M = microbatches(c.cfg), N = m.microbatch_group_size_per_vp_stage.value_or(pp);
        if (M <= 0) return pass();
        // The smallest group size both of Megatron-Core's checks accept keeps the batch (M itself
        // always does once M >= PP); else a batch of whole groups, at least one (as the batch
        // rule's fix where the batch does not divide).
        const Int per_step = c.cfg.train.micro_batch_size.value_or(1) * data_parallel_size(c.cfg);
        const bool divides = c.cfg.train.global_batch_size.value_or(0) % per_step == 0;
        Int group = 0;
        for (Int n = pp; divides && n <= M && group == 0; ++n)
          if (M % n == 0 || M % n >= pp) group = n;
        const std::string fix =
            group > 0 ? fmt::format("model.microbatch_group_size_per_vp_stage={}", group)
                      : fmt::format("train.global_batch_size={}",
                                    round_up(std::max<Int>(1, c.cfg.train.global_batch_size.value_or(1)),
                                             per_step * std::max(N, pp)));
        if (N > M || N < pp)
          return fail(fmt::format("The number of contiguous micro-batches in a virtual pipeline stage should range in "
                                  "[PP={} , M={}] (microbatch_group_size_per_vp_stage = {})",
                                  pp, M, N),
                      fix);
        const Int rest = M % N;
        return fail_if(rest > 0 && rest < pp,
                       fmt::format("The remainder of M (the total micro-batches) divided by N (number of contiguous "
                                   "micro-batches in a virtual pipeline stage) should be 0, or larger than or equal to "
                                   "the pipeline-parallel size, but it is {} (M = {}, N = {}, PP = {})",
                                   rest, M, N, pp),
                       fix);
      });
  // The MoE layer's forward raises in training (moe/moe_layer.py), whatever the EP size.
  add("parallel.ep_tp_needs_sp", E,
      {"model.num_moe_experts", "model.tensor_model_parallel_size", "model.sequence_parallel"},
      "Megatron-Core moe/moe_layer.py", "MoE with TP needs sequence parallelism", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts.value_or(0) > 0 && m.tensor_model_parallel_size > 1 && !m.sequence_parallel,
                       "During training, performance may degrade if MoE and tensor parallelismare enabled without "
                       "also enabling sequence parallelism.",
                       "model.sequence_parallel=true");
      });
  add("parallel.cp_seq_length", E, {"model.context_parallel_size", "model.seq_length"}, kBridgeConfig,
      "context parallelism splits the sequence into 2 x CP chunks", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int cp = m.context_parallel_size;
        if (cp <= 1 || m.seq_length % (2 * cp) == 0) return pass();
        // The largest smaller CP that splits the sequence and still folds the world and divides the
        // batch, else a longer sequence.
        std::string fix = fmt::format("model.seq_length={}", round_up(m.seq_length, 2 * cp));
        const auto& t = c.cfg.train;
        for (Int smaller = cp - 1; smaller >= 1; --smaller) {
          const Int mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * smaller;
          const bool folds = !c.world() || (*c.world() % mp == 0 &&
                                            (!t.global_batch_size || !t.micro_batch_size ||
                                             *t.global_batch_size % (*t.micro_batch_size * (*c.world() / mp)) == 0));
          if ((smaller == 1 || m.seq_length % (2 * smaller) == 0) && folds) {
            fix = fmt::format("model.context_parallel_size={}", smaller);
            break;
          }
        }
        return fail("Sequence length must be divisible by 2 * context parallel size if context parallel is used.", fix);
      });
  add("scheduler.lr_order", E, {"optimizer.lr", "optimizer.min_lr", "scheduler.lr_warmup_init"},
      kMcoreScheduler, "min_lr and the warmup's start at most the learning rate",
      [](const CheckContext& c) {
        const auto& o = c.cfg.optimizer;
        if (!o.lr) return pass();  // a config without its optimizer section (epx run asks for it)
        if (o.min_lr.value_or(0) > *o.lr)
          return fail(fmt::format("min_lr ({}) is above lr ({}): the scheduler asserts max_lr >= min_lr", *o.min_lr, *o.lr),
                      fmt::format("optimizer.min_lr={}", *o.lr));
        return fail_if(c.cfg.scheduler.lr_warmup_init > *o.lr,
                       fmt::format("lr_warmup_init ({}) is above lr ({}): the scheduler asserts init_lr <= max_lr",
                                   c.cfg.scheduler.lr_warmup_init, *o.lr),
                       "scheduler.lr_warmup_init=0.0");
      });
  add("train.mode", E, {"train.train_iters", "train.train_samples"}, kBridgeConfig,
      "exactly one of train_iters, train_samples (or num_epochs) sets the run's length", [](const CheckContext& c) {
        const auto& t = c.cfg.train;
        // num_epochs (SFT datasets) is not modelled; a Bridge dump keeps it among its other fields.
        const YAML::Node& kept = c.cfg.extra_fields.node;
        const auto kept_train = [&](const char* name) {  // set and not null
          return kept.IsMap() && kept["train"].IsDefined() && kept["train"].IsMap() && kept["train"][name].IsDefined() &&
                 !kept["train"][name].IsNull();
        };
        const bool epochs = kept_train("num_epochs");
        const int modes = (t.train_iters ? 1 : 0) + (t.train_samples ? 1 : 0) + (epochs ? 1 : 0);
        if (modes == 0)
          return fail("One of train_iters, train_samples, or num_epochs must be provided", "train.train_iters=<n>");
        if (modes > 1)
          return fail("Cannot specify more than one of train_iters, train_samples, or num_epochs",
                      t.train_iters ? "train.train_samples=null" : "train.train_iters=null");
        return fail_if(kept_train("rampup_batch_size") && (t.train_samples || epochs),
                       epochs ? "Batch size rampup not supported with epoch-based training"
                              : "Batch size rampup not supported with sample-based training yet",
                       "train.rampup_batch_size=null");
      });
  add("scheduler.iteration_or_sample_fields", E,
      {"scheduler.lr_decay_iters", "scheduler.lr_warmup_iters", "scheduler.lr_decay_samples",
       "scheduler.lr_warmup_samples", "scheduler.lr_warmup_fraction"},
      kBridgeConfig, "the scheduler counts in iterations or in samples, and one warmup field at most",
      [](const CheckContext& c) {
        const auto& s = c.cfg.scheduler;
        const auto none = [](const OptInt& v) { return v ? std::to_string(*v) : std::string("None"); };
        if ((s.lr_decay_iters || s.lr_warmup_iters != 0) && (s.lr_decay_samples || s.lr_warmup_samples != 0))
          return fail(fmt::format("Cannot mix iteration-based and sample-based scheduler fields. Found iteration fields: "
                                  "lr_decay_iters={}, lr_warmup_iters={}, lr_wsd_decay_iters=None. Found sample fields: "
                                  "lr_decay_samples={}, lr_warmup_samples={}, lr_wsd_decay_samples=None. Use either "
                                  "iteration fields OR sample fields, not both.",
                                  none(s.lr_decay_iters), s.lr_warmup_iters, none(s.lr_decay_samples), s.lr_warmup_samples),
                      c.cfg.train.train_samples ? "scheduler.lr_decay_iters=null scheduler.lr_warmup_iters=0"
                                                : "scheduler.lr_decay_samples=null scheduler.lr_warmup_samples=0");
        return fail_if(s.lr_warmup_fraction && (s.lr_warmup_iters != 0 || s.lr_warmup_samples != 0),
                       fmt::format("Cannot specify lr_warmup_fraction={} with lr_warmup_iters={} or lr_warmup_samples={}. "
                                   "Use either lr_warmup_fraction OR lr_warmup_iters OR lr_warmup_samples.",
                                   s.lr_warmup_fraction.value_or(0), s.lr_warmup_iters, s.lr_warmup_samples),
                       "scheduler.lr_warmup_fraction=null");
      });
  add("scheduler.matches_training", E,
      {"train.train_samples", "train.train_iters", "scheduler.max_steps", "scheduler.lr_decay_iters",
       "scheduler.lr_warmup_iters", "scheduler.lr_decay_samples", "scheduler.lr_warmup_samples"},
      kBridgeConfig, "sample-based training takes the sample fields, iteration-based the iteration fields",
      [](const CheckContext& c) {
        const auto& s = c.cfg.scheduler;
        const auto& t = c.cfg.train;
        if (t.train_samples) {
          if (s.max_steps)
            return fail("scheduler.max_steps is only supported for iteration-based training; use sample-based scheduler "
                        "fields with train_samples",
                        "scheduler.max_steps=null");
          if (s.lr_decay_iters)
            return fail("Use lr_decay_samples for sample-based training, not lr_decay_iters", "scheduler.lr_decay_iters=null");
          return fail_if(s.lr_warmup_iters != 0, "Use lr_warmup_samples for sample-based training, not lr_warmup_iters",
                         "scheduler.lr_warmup_iters=0");
        }
        if (s.lr_decay_samples)
          return fail("Use lr_decay_iters for iteration-based training, not lr_decay_samples", "scheduler.lr_decay_samples=null");
        if (s.lr_warmup_samples != 0)
          return fail("Use lr_warmup_iters for iteration-based training, not lr_warmup_samples", "scheduler.lr_warmup_samples=0");
        return fail_if(s.max_steps && t.train_iters && *s.max_steps < *t.train_iters,
                       fmt::format("scheduler.max_steps ({}) must be greater than or equal to train.train_iters ({}).",
                                   s.max_steps.value_or(0), t.train_iters.value_or(0)),
                       fmt::format("scheduler.max_steps={}", t.train_iters.value_or(0)));
      });
  add("scheduler.warmup_capped", W,
      {"scheduler.lr_warmup_iters", "scheduler.lr_decay_iters", "scheduler.lr_warmup_samples",
       "scheduler.lr_decay_samples", "scheduler.lr_warmup_fraction", "scheduler.max_steps", "train.train_iters",
       "train.train_samples", "train.global_batch_size"},
      kBridgeConfig, "a warmup as long as the decay is capped one sample short of it", [](const CheckContext& c) {
        const std::optional<SchedulerSteps> steps = scheduler_steps(c.cfg);
        if (!steps || !steps->capped()) return pass();
        const auto& s = c.cfg.scheduler;
        const Int gbs = c.cfg.train.global_batch_size.value_or(1);
        const std::string fix = s.lr_warmup_fraction ? "scheduler.lr_warmup_fraction=<below 1>"
                                : steps->sample_based ? fmt::format("scheduler.lr_warmup_samples={}", steps->decay - 1)
                                                      : fmt::format("scheduler.lr_warmup_iters={}", steps->decay / gbs - 1);
        return fail(fmt::format("lr_warmup_steps ({}) >= lr_decay_steps ({}); capping lr_warmup_steps to {}. Reduce "
                                "lr_warmup_iters (or lr_warmup_samples) for short training runs.",
                                steps->uncapped_warmup, steps->decay, steps->decay - 1),
                    fix);
      });
  add("train.batch_divisible", E,
      {"train.global_batch_size", "train.micro_batch_size", "comm_overlap.data_parallel_size",
       "target.num_gpus"},
      kBridgeConfig, "global batch = micro batch x DP x micro-batches", [](const CheckContext& c) {
        const auto& t = c.cfg.train;
        if (!c.world() && t.global_batch_size && t.micro_batch_size) {
          // Whatever the world, DP >= 1: a batch the micro-batch does not divide never fits.
          if (*t.micro_batch_size <= 0 || *t.global_batch_size % *t.micro_batch_size != 0)
            return fail(fmt::format("global_batch_size ({}) is not divisible by "
                                    "micro_batch_size ({}), so by no micro_batch_size x "
                                    "data_parallel_size",
                                    *t.global_batch_size, *t.micro_batch_size),
                        fmt::format("train.global_batch_size={}",
                                    round_up(*t.global_batch_size,
                                             std::max<Int>(*t.micro_batch_size, 1))));
          return world_not_given(c);
        }
        const Int dp = data_parallel_size(c.cfg);
        if (!t.global_batch_size || !t.micro_batch_size || dp == 0) return pass();
        const Int step = *t.micro_batch_size * dp;
        // Where the world does not fold the expert side either, the world's fix (a world that
        // folds both sides and divides the batch where one does) is this one's too: two fixes
        // that each assume the other is not applied would not pass together.
        // Likewise the interleaved schedule's groups: a batch of whole groups passes both rules.
        const auto& m = c.cfg.model;
        const Int emp = effective_etp(m) * m.expert_model_parallel_size * m.pipeline_model_parallel_size;
        const Int group = m.pipeline_model_parallel_size > 1 && virtual_pipeline_size(m)
                              ? m.microbatch_group_size_per_vp_stage.value_or(m.pipeline_model_parallel_size)
                              : 1;
        const std::string fix = emp > 0 && *c.world() % emp != 0
                                    ? world_fix(c.cfg, *c.world())
                                    : fmt::format("train.global_batch_size={}",
                                                  round_up(*t.global_batch_size, std::max<Int>(step * group, 1)));
        return fail_if(*t.micro_batch_size <= 0 || *t.global_batch_size % step != 0,
                       fmt::format("global_batch_size ({}) is not divisible by micro_batch_size x "
                                   "data_parallel_size = {} x {}",
                                   *t.global_batch_size, *t.micro_batch_size, dp),
                       fix);
      });
  add("moe.not_moe", A, {"model.num_moe_experts"}, "epx",
      "a config without experts has nothing MoE-specific to check", [](const CheckContext& c) {
        return fail_if(!c.cfg.model.num_moe_experts || *c.cfg.model.num_moe_experts == 0,
                       "num_moe_experts is not set: this is a dense model, so the expert-parallel "
                       "and overlap rules do not apply",
                       "model.num_moe_experts=<experts per MoE layer>");
      });
  add("moe.ffn_without_experts", E, {"model.moe_ffn_hidden_size", "model.num_moe_experts", "model.moe_layer_freq"},
      kMcore, "an expert FFN size without experts, on a model that is not mixed dense/MoE", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(!m.num_moe_experts && m.moe_ffn_hidden_size && !m.moe_layer_freq.has_dense(),
                       "moe_ffn_hidden_size is set but num_moe_experts is None. Please set num_moe_experts or remove "
                       "moe_ffn_hidden_size.",
                       "model.moe_ffn_hidden_size=null");
      });
  add("moe.router_dtype", W, {"model.num_moe_experts", "model.moe_router_dtype"}, kMcore,
      "32 or more experts route in FP32", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && *m.num_moe_experts >= 32 && !m.moe_router_dtype,
                       "Using a large number of experts (e.g. >=32) without fp32 routing. Consider enabling "
                       "moe_router_dtype for better numerical stability.",
                       "model.moe_router_dtype=fp32");
      });
  add("moe.topk_range", E, {"model.moe_router_topk", "model.num_moe_experts"}, kMcore,
      "1 <= top-k <= number of experts", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts) return pass();
        return fail_if(m.moe_router_topk < 1 || m.moe_router_topk > *m.num_moe_experts,
                       fmt::format("moe_router_topk ({}) must be between 1 and num_moe_experts "
                                   "({})",
                                   m.moe_router_topk, *m.num_moe_experts),
                       fmt::format("model.moe_router_topk={}",
                                   std::clamp<Int>(m.moe_router_topk, 1, *m.num_moe_experts)));
      });
  add("moe.topk1_needs_pre_softmax", E,
      {"model.moe_router_topk", "model.moe_router_score_function", "model.moe_router_pre_softmax",
       "model.moe_router_load_balancing_type"},
      kMcore, "top-1 softmax routing takes the softmax before the top-k (after it, the router gets no gradient)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.moe_router_topk == 1 && m.moe_router_score_function == "softmax" &&
                           !m.moe_router_pre_softmax && m.moe_router_load_balancing_type != "sinkhorn",
                       "Please use --moe-router-pre-softmax when topk is 1.", "model.moe_router_pre_softmax=true");
      });
  add("moe.group_limited_routing", E,
      {"model.moe_router_group_topk", "model.moe_router_num_groups", "model.num_moe_experts"}, kMcore,
      "group-limited routing (moe_router_group_topk) has groups that split the experts",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.moe_router_group_topk || *m.moe_router_group_topk == 0 || !m.num_moe_experts) return pass();
        // The fix: the fewest groups that split the experts and leave group_topk to keep.
        Int fewest = std::min(*m.moe_router_group_topk, *m.num_moe_experts);
        while (*m.num_moe_experts % fewest != 0) ++fewest;
        std::string fix = fmt::format("model.moe_router_num_groups={}", fewest);
        if (*m.moe_router_group_topk > fewest) fix += fmt::format(" model.moe_router_group_topk={}", fewest);
        if (!m.moe_router_num_groups || *m.moe_router_num_groups == 0)
          return fail("When using group limited routing, moe_router_num_groups must be specified.", fix);
        const Int groups = *m.moe_router_num_groups;
        if (*m.num_moe_experts % groups != 0)
          return fail(fmt::format("num_moe_experts ({}) should be divisible by moe_router_num_groups ({}).",
                                  *m.num_moe_experts, groups),
                      fix);
        return fail_if(*m.moe_router_group_topk > groups,
                       fmt::format("moe_router_group_topk ({}) should be smaller than moe_router_num_groups ({}).",
                                   *m.moe_router_group_topk, groups),
                       fmt::format("model.moe_router_group_topk={}", groups));
      });
  add("moe.expert_bias_score_function", E, {"model.moe_router_enable_expert_bias", "model.moe_router_score_function"},
      kMcore, "aux-loss-free expert bias needs a sigmoid (or sqrtsoftplus) router", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.moe_router_enable_expert_bias && m.moe_router_score_function != "sigmoid" &&
                           m.moe_router_score_function != "sqrtsoftplus",
                       "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score "
                       "functions. Please set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset "
                       "--moe-router-enable-expert-bias.",
                       "model.moe_router_score_function=sigmoid");
      });
  add("moe.capacity_settings", E,
      {"model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity",
       "model.moe_router_load_balancing_type"},
      kMcore, "padding to capacity needs a capacity factor; a capacity factor needs aux-loss balancing (not sinkhorn)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.moe_expert_capacity_factor && m.moe_router_load_balancing_type == "sinkhorn")
          return fail("moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss or none "
                      "load balancing",
                      "model.moe_router_load_balancing_type=aux_loss");
        return fail_if(m.moe_pad_expert_input_to_capacity && !m.moe_expert_capacity_factor,
                       "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity",
                       "model.moe_expert_capacity_factor=1.0");
      });
  add("moe.bias_needs_etp1", E, {"model.add_bias_linear", "model.expert_tensor_parallel_size", "model.num_moe_experts"},
      kMcore, "biased expert linears need ETP = 1", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && m.add_bias_linear && effective_etp(m) != 1,
                       "Bias in Moe is only supported when ETP==1", "model.expert_tensor_parallel_size=1");
      });
  add("moe.layer_pattern_length", E, {"model.moe_layer_freq", "model.num_layers"}, kMcore,
      "an explicit moe_layer_freq pattern has one entry per layer", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const auto n = static_cast<Int>(m.moe_layer_freq.pattern.size());
        if (n == 0 || n == m.num_layers) return pass();
        // The fix keeps the pattern, cut or padded with its last entry to one per layer.
        auto fixed = m.moe_layer_freq.pattern;
        fixed.resize(static_cast<std::size_t>(std::clamp<Int>(m.num_layers, 1, 1 << 20)), fixed.back());
        return fail(fmt::format("Invalid length of moe_layer_pattern: {}, expected {}", n, m.num_layers),
                    fmt::format("model.moe_layer_freq=[{}]", fmt::join(fixed, ",")));
      });
  add("moe.shared_expert_overlap_dispatcher", E,
      {"model.moe_shared_expert_overlap", "model.moe_token_dispatcher_type",
       "model.moe_shared_expert_intermediate_size"},
      kMcore, "shared-expert overlap works with the alltoall and flex dispatchers (flex since April 2026)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.moe_shared_expert_intermediate_size && m.moe_shared_expert_overlap &&
                           m.moe_token_dispatcher_type != "alltoall" && m.moe_token_dispatcher_type != "flex",
                       "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.",
                       "model.moe_shared_expert_overlap=false");
      });
  add("precision.single_dtype", E, {"model.bf16", "model.fp16"}, kMcore,
      "bf16 and fp16 are exclusive", [](const CheckContext& c) {
        return fail_if(c.cfg.model.bf16 && c.cfg.model.fp16, "bf16 and fp16 cannot both be set",
                       "model.fp16=false");
      });
  add("fp8.param_needs_fp8", E, {"model.fp8_param", "model.fp8"}, kMcore, "FP8 weights need FP8 mode",
      [](const CheckContext& c) {
        return fail_if(c.cfg.model.fp8_param && !c.cfg.model.fp8, "fp8_param must be used together with fp8 mode.",
                       "model.fp8_param=false");
      });
  add("fp8.recompute_moe_act_layernorm", E,
      {"model.fp8", "model.fp8_recipe", "model.recompute_granularity", "model.recompute_modules", "target.te_version"},
      kMcore, "FP8 with moe_act or layernorm recompute needs a scaling recipe other than delayed, and TE 2.6",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.fp8 || m.recompute_granularity != "selective" || !m.recompute_modules ||
            (!contains(*m.recompute_modules, "moe_act") && !contains(*m.recompute_modules, "layernorm")))
          return pass();
        if (m.fp8_recipe == std::optional<std::string>("delayed"))
          return fail("Delayed scaling does not support moe_act and layernorm recompute for fp8.",
                      "model.fp8_recipe=tensorwise");
        return te_at_least(c, "2.6.0", fmt::format("moe_act and layernorm recompute for fp8 needs "
                                                   "transformer-engine>=2.6.0dev0, but your version is {}.",
                                                   c.cfg.target.te_version.value_or("")));
      });
  add("fp8.gpu", E, {"model.fp8", "model.fp8_recipe", "target.gpu"}, kTeFp8,
      "FP8 needs compute capability 8.9 (MXFP8 10.0)", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.fp8) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        if (!c.gpu.cuda()) return pass();  // epx's own runtime refuses FP8 itself (job_spec)
        // Transformer Engine's gates: 8.9 (Ada, Hopper) for FP8, 10.0 (Blackwell) for MXFP8.
        if (c.gpu.major * 10 + c.gpu.minor < 89)
          return fail("Device compute capability 8.9 or higher required for FP8 execution.", "model.fp8=null");
        return fail_if(m.fp8_recipe == std::optional<std::string>("mxfp8") && c.gpu.major < 10,
                       "Device compute capability 10.0 or higher required for MXFP8 execution.",
                       "model.fp8_recipe=tensorwise");
      });
  add("recompute.full_needs_method", E,
      {"model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"},
      kMcore, "full recompute names a method and a layer count", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.recompute_granularity != "full") return pass();
        if (!m.recompute_method)
          return fail("When using recompute_granularity: full, recompute_method must be uniform "
                      "or block",
                      m.recompute_num_layers
                          ? "model.recompute_method=uniform"
                          : "model.recompute_method=uniform model.recompute_num_layers=1");
        return fail_if(!m.recompute_num_layers || *m.recompute_num_layers < 1,
                       "When using recompute_granularity: full, recompute_num_layers must be "
                       "between 1 and the layers per pipeline rank",
                       "model.recompute_num_layers=1");
      });

  add("recompute.selective_no_num_layers", E, {"model.recompute_granularity", "model.recompute_num_layers"}, kMcore,
      "selective recompute takes no layer count", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.recompute_granularity == "selective" && m.recompute_num_layers.has_value(),
                       "When using recompute_granularity: selective recompute_num_layers must be None.",
                       "model.recompute_num_layers=null");
      });
  add("recompute.module_needs_its_feature", E,
      {"model.recompute_granularity", "model.recompute_modules", "model.moe_grouped_gemm",
       "model.multi_latent_attention", "model.moe_shared_expert_intermediate_size", "model.moe_shared_expert_overlap"},
      kMcore, "selective recompute of moe_act, mla_up_proj or shared_experts needs what they recompute",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.recompute_granularity != "selective" || !m.recompute_modules) return pass();
        const StringList& modules = *m.recompute_modules;
        if (contains(modules, "moe_act") && !m.moe_grouped_gemm)
          return fail("moe_act in recompute_modules is only supported with moe_grouped_gemm.",
                      "model.moe_grouped_gemm=true");
        if (contains(modules, "mla_up_proj") && !m.multi_latent_attention) {
          StringList rest;
          for (const std::string& name : modules)
            if (name != "mla_up_proj") rest.push_back(name);
          return fail("mla_up_proj in recompute_modules is only supported with multi_latent_attention.",
                      fmt::format("model.recompute_modules=[{}]", fmt::join(rest, ",")));
        }
        return fail_if(contains(modules, "shared_experts") && m.moe_shared_expert_intermediate_size &&
                           m.moe_shared_expert_overlap,
                       "shared_experts recompute cannot work with --moe-shared-expert-overlap.",
                       "model.moe_shared_expert_overlap=false");
      });

  // ---- EP overlap: Megatron-Bridge's asserts, in its order ------------------------------------
  add("ep_overlap.expert_parallel", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.expert_model_parallel_size"},
      kBridgeCommOverlap, "EP overlap needs EP > 1", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.expert_model_parallel_size <= 1,
                       by_path(c,
                               "overlap_moe_expert_parallel_comm is only supported when "
                               "expert_model_parallel_size > 1",
                               "overlap_moe_expert_parallel_comm is only supported with expert "
                               "model parallelism"),
                       disable_overlap(c));
      });
  add("ep_overlap.num_experts", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.num_moe_experts"},
      kBridgeCommOverlap, "EP overlap needs more than one expert (Bridge only)",
      [](const CheckContext& c) {
        const auto& n = c.cfg.model.num_moe_experts;
        return fail_if(bridge_ep_overlap(c) && (!n || *n <= 1),
                       fmt::format("overlap_moe_expert_parallel_comm is only supported when "
                                   "num_moe_experts > 1, but got {}",
                                   n ? std::to_string(*n) : "None"),
                       disable_overlap(c));
      });
  add("ep_overlap.dispatcher", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_token_dispatcher_type"},
      kBridgeCommOverlap, "EP overlap needs the alltoall or flex dispatcher",
      [](const CheckContext& c) {
        const auto& d = c.cfg.model.moe_token_dispatcher_type;
        return fail_if(ep_overlap(c) && d != "alltoall" && d != "flex",
                       by_path(c,
                               fmt::format("overlap_moe_expert_parallel_comm is only supported "
                                           "when moe_token_dispatcher_type == 'alltoall' or "
                                           "'flex', but got {}",
                                           d),
                               "overlap_moe_expert_parallel_comm is supported with alltoall/flex "
                               "token dispatcher"),
                       "model.moe_token_dispatcher_type=alltoall");
      });
  add("ep_overlap.precision", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.bf16", "model.fp16"},
      kBridgeCommOverlap, "EP overlap needs a bf16 or fp16 model", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && !c.cfg.model.bf16 && !c.cfg.model.fp16,
                       by_path(c,
                               "overlap_moe_expert_parallel_comm is only supported when using "
                               "bf16 or fp16 models",
                               "overlap_moe_expert_parallel_comm is only supported with bf16 or "
                               "fp16 model"),
                       "model.bf16=true");
      });
  add("ep_overlap.torch_version", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "target.torch_version"},
      kBridgeCommOverlap, "EP overlap needs torch >= 2.6.0 (hangs before)",
      [](const CheckContext& c) {
        if (!ep_overlap(c) || !c.cuda()) return pass();
        if (!c.cfg.target.torch_version) return unknown("pass --torch-version to check");
        return fail_if(!version_at_least(*c.cfg.target.torch_version, "2.6.0"),
                       "A2A Overlap encounters hang issue with torch version < 2.6.0",
                       "target.torch_version=2.6.0");
      });
  add("ep_overlap.pp_needs_vpp", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_layout"},
      kBridgeCommOverlap, "EP overlap with PP > 1 needs VPP set (VPP=1 passes, and runs the interleaved schedule)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!ep_overlap(c) || m.pipeline_model_parallel_size <= 1 || m.virtual_pipeline_model_parallel_size) return pass();
        const auto implied = virtual_pipeline_size(m);
        // Without a comm_overlap section Bridge's assert does not run, and Megatron-Core takes VPP
        // from the layout before its own.
        if (implied && !c.user.comm_overlap) return pass();
        return fail(fmt::format("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
                                "pipeline_model_parallel_size > 1{}",
                                implied ? fmt::format(" (the pipeline layout implies VPP {}, but Bridge asserts the field "
                                                      "before Megatron-Core reads the layout)",
                                                      *implied)
                                        : ""),
                    vpp_to_set(m));
      });
  add("ep_overlap.full_recompute", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_granularity"},
      kBridgeCommOverlap, "EP overlap excludes full recompute (seed pitfall)",
      [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.recompute_granularity == "full",
                       "disable full recomputation when enabling overlap_moe_expert_parallel_comm",
                       "model.recompute_granularity=selective");
      });
  add("ep_overlap.recompute_method", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_method"},
      kBridgeCommOverlap, "EP overlap needs recompute_method None", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.recompute_method.has_value(),
                       "disable recomputation method when enabling overlap_moe_expert_parallel_comm",
                       "model.recompute_method=null");
      });
  add("ep_overlap.recompute_num_layers", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_num_layers"},
      kBridgeCommOverlap, "EP overlap needs recompute_num_layers None", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.recompute_num_layers.has_value(),
                       "recompute_num_layers must be None when enabling "
                       "overlap_moe_expert_parallel_comm",
                       "model.recompute_num_layers=null");
      });
  add("ep_overlap.recompute_moe", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.recompute_modules"},
      kBridgeCommOverlap, "EP overlap excludes 'moe' from recompute_modules",
      [](const CheckContext& c) {
        const auto& mods = c.cfg.model.recompute_modules;
        if (!ep_overlap(c) || !mods || !contains(*mods, "moe")) return pass();
        StringList rest;
        for (const auto& m : *mods)
          if (m != "moe") rest.push_back(m);
        return fail("disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm",
                    fmt::format("model.recompute_modules=[{}]", fmt::join(rest, ",")));
      });
  add("ep_overlap.shared_expert_overlap", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_shared_expert_overlap"},
      kBridgeCommOverlap, "EP overlap excludes shared-expert overlap", [](const CheckContext& c) {
        return fail_if(ep_overlap(c) && c.cfg.model.moe_shared_expert_overlap,
                       "disable moe_shared_expert_overlap when enabling "
                       "overlap_moe_expert_parallel_comm",
                       "model.moe_shared_expert_overlap=false");
      });
  add("ep_overlap.mtp_layers", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.mtp_num_layers"},
      kBridgeCommOverlap, "EP overlap allows at most one MTP layer", [](const CheckContext& c) {
        const auto& n = c.cfg.model.mtp_num_layers;
        return fail_if(ep_overlap(c) && n && *n != 0 && *n != 1,
                       "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm.",
                       "model.mtp_num_layers=1");
      });
  // Megatron-Core's extra EP-overlap checks (TransformerConfig.__post_init__).
  add("ep_overlap.cuda_graph_moe_scope", E,
      {"comm_overlap.overlap_moe_expert_parallel_comm", "model.cuda_graph_impl",
       "model.cuda_graph_modules", "model.cuda_graph_scope"},
      kMcore, "EP overlap excludes TE CUDA-graph scopes moe and mlp", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!ep_overlap(c) || m.cuda_graph_impl != "transformer_engine" ||
            (!has_cuda_graph_module(m, "moe") && !has_cuda_graph_module(m, "mlp")))
          return pass();
        // Keep the other scopes; the router and preprocessing are the seeds' dropless choice.
        std::vector<std::string> fixes;
        for (const auto& [name, list] : {std::pair{"cuda_graph_modules", &m.cuda_graph_modules},
                                         std::pair{"cuda_graph_scope", &m.cuda_graph_scope}}) {
          if (!contains(*list, "moe") && !contains(*list, "mlp")) continue;
          StringList keep;
          for (const auto& s : *list)
            if (s != "moe" && s != "mlp") keep.push_back(s);
          if (keep.empty()) keep = {"moe_router", "moe_preprocess"};
          fixes.push_back(fmt::format("model.{}=[{}]", name, fmt::join(keep, ",")));
        }
        return fail("CUDA graph scope on moe and mlp is not supported with "
                    "overlap_moe_expert_parallel_comm",
                    fmt::format("{}", fmt::join(fixes, " ")));
      });
  add("ep_overlap.dispatch_wgrad_exclusive", E,
      {"model.overlap_dispatch_backward_with_experts_wgrad",
       "comm_overlap.overlap_moe_expert_parallel_comm", "comm_overlap.delay_wgrad_compute"},
      kMcore, "overlap_dispatch_backward_with_experts_wgrad excludes EP overlap and delay_wgrad",
      [](const CheckContext& c) {
        return fail_if(c.cfg.model.overlap_dispatch_backward_with_experts_wgrad &&
                           (ep_overlap(c) || delay_wgrad(c)),
                       "overlap_dispatch_backward_with_experts_wgrad cannot be combined with "
                       "overlap_moe_expert_parallel_comm or delay_wgrad_compute",
                       "model.overlap_dispatch_backward_with_experts_wgrad=false");
      });
  add("ep_overlap.dispatch_wgrad_te", E,
      {"model.overlap_dispatch_backward_with_experts_wgrad", "target.te_version"}, kMcore,
      "overlap_dispatch_backward_with_experts_wgrad needs TE >= 2.3.0", [](const CheckContext& c) {
        if (!c.cfg.model.overlap_dispatch_backward_with_experts_wgrad) return pass();
        return te_at_least(c, "2.3.0",
                           "overlap_dispatch_backward_with_experts_wgrad requires TE >= 2.3.0");
      });
  add("ep_overlap.early_attn_release", E,
      {"model.ep_overlap_early_attn_memory_release",
       "comm_overlap.overlap_moe_expert_parallel_comm"},
      kMcore, "ep_overlap_early_attn_memory_release needs EP overlap", [](const CheckContext& c) {
        return fail_if(c.cfg.model.ep_overlap_early_attn_memory_release && !ep_overlap(c),
                       "ep_overlap_early_attn_memory_release requires "
                       "overlap_moe_expert_parallel_comm",
                       "model.ep_overlap_early_attn_memory_release=false");
      });

  add("optimizer.precision_aware_dtypes", E,
      {"optimizer.use_precision_aware_optimizer", "optimizer.main_grads_dtype", "optimizer.main_params_dtype",
       "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype", "optimizer.optimizer"},
      kMcoreOptimizer, "lower-precision optimizer state needs the precision-aware (TE FusedAdam) optimizer",
      [](const CheckContext& c) {
        const OptimizerConfig& o = c.cfg.optimizer;
        if (o.use_precision_aware_optimizer)
          return fail_if(o.optimizer != "adam", "--use-precision-aware-optimizer only supported with adam",
                         "optimizer.use_precision_aware_optimizer=false");
        for (const auto& [name, dtype] : {std::pair{"main_grads_dtype", &o.main_grads_dtype},
                                          std::pair{"main_params_dtype", &o.main_params_dtype},
                                          std::pair{"exp_avg_dtype", &o.exp_avg_dtype},
                                          std::pair{"exp_avg_sq_dtype", &o.exp_avg_sq_dtype}})
          if (*dtype != "fp32")
            return fail(fmt::format("{} can only be fp32 when not using precision-aware optimizer", name),
                        "optimizer.use_precision_aware_optimizer=true");
        return pass();
      });

  // ---- epx's own gradient reduction ----------------------------------------------------------
  add("ddp.embedding_rows", E,
      {"ddp.reduce_embedding_rows", "ddp.overlap_grad_reduce", "model.share_embeddings_and_output_weights"},
      "epx train/grad_reducer.hpp", "reduce_embedding_rows splits the overlapped reduction of an untied embedding",
      [](const CheckContext& c) {
        const auto& d = c.cfg.ddp;
        if (!d.reduce_embedding_rows) return pass();
        if (!d.overlap_grad_reduce)
          return fail_if(true, "reduce_embedding_rows splits the overlapped reduction of the embedding's gradient, "
                               "and overlap_grad_reduce is off",
                         "ddp.overlap_grad_reduce=true");
        return fail_if(c.cfg.model.share_embeddings_and_output_weights,
                       "with share_embeddings_and_output_weights the embedding's gradient also holds the LM head's, "
                       "which is not a set of token rows",
                       "ddp.reduce_embedding_rows=false");
      });

  // ---- delay_wgrad_compute ------------------------------------------------------------------
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
  auto wgrad_in_graph = [](const ModelConfig& m) {
    return has_cuda_graph_module(m, "attn") ||
           (has_cuda_graph_module(m, "moe_router") && m.moe_shared_expert_intermediate_size &&
            !m.moe_shared_expert_overlap);
  };
  add("delay_wgrad.cuda_graph_te", E,
      {"comm_overlap.delay_wgrad_compute", "model.cuda_graph_scope", "model.cuda_graph_modules",
       "target.te_version"},
      kBridgeCommOverlap, "delay_wgrad with wgrad in a CUDA-graph scope needs TE >= 2.12.0",
      [wgrad_in_graph](const CheckContext& c) {
        if (!bridge_delay_wgrad(c) || !wgrad_in_graph(c.cfg.model)) return pass();
        return te_at_least(c, "2.12.0",
                           "CUDA graph with delay_wgrad_compute requires TE version >= 2.12.0.");
      });
  add("delay_wgrad.cuda_graph_grad_accum_fusion", E,
      {"comm_overlap.delay_wgrad_compute", "model.cuda_graph_scope",
       "model.gradient_accumulation_fusion"},
      kBridgeCommOverlap, "delay_wgrad in a CUDA-graph scope needs gradient_accumulation_fusion",
      [wgrad_in_graph](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(bridge_delay_wgrad(c) && wgrad_in_graph(m) && !m.gradient_accumulation_fusion,
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
        return fail_if(bridge_delay_wgrad(c) && has_cuda_graph_module(m, "attn") &&
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

  // ---- Raised while resolving (finalize) ----------------------------------------------------
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
  add("comm_overlap.overwrites_model", W,
      {"model.overlap_moe_expert_parallel_comm", "model.delay_wgrad_compute"}, kBridgeCommOverlap,
      "comm_overlap copies its (unset) overlap switches over the model's");
  add("comm_overlap.overwrites_ddp", W,
      {"ddp.overlap_grad_reduce", "ddp.overlap_param_gather", "ddp.align_param_gather", "ddp.bucket_size"},
      kBridgeCommOverlap, "with the distributed optimizer, comm_overlap's DP settings replace the ddp section's");
  add("flex.deprecated_sm_knob", W, {"model.moe_deepep_num_sms", "model.moe_hybridep_num_sms"},
      kMcore, "deprecated per-backend SM-count knob");
  add("flex.conflicting_sm_knobs", E, {"model.moe_deepep_num_sms", "model.moe_hybridep_num_sms"},
      kMcore, "two deprecated SM-count knobs disagree");

  // ---- Flex dispatcher backends -------------------------------------------------------------
  add("flex.apply_not_moe", W, {"model.num_moe_experts"}, kBridgeFlex,
      "--moe_flex_dispatcher_backend on a model without experts is skipped");
  add("flex.apply_fallback", W, {"target.gpu", "model.moe_flex_dispatcher_backend"}, kBridgeFlex,
      "backend unsupported on the GPU: apply falls back to alltoall");
  add("flex.no_backend", W,
      {"model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend"}, kBridgeFlex,
      "flex without a backend falls back to alltoall");
  add("flex.deepep_gpu", E, {"model.moe_flex_dispatcher_backend", "target.gpu"}, kBridgeFlex,
      "DeepEP needs Ampere, Hopper, B200 or B300", [](const CheckContext& c) {
        if (!c.cuda() || !uses_flex(c.cfg.model, "deepep")) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        return fail_if(!deepep_supported(c.gpu),
                       fmt::format("DeepEP is supported for Ampere, Hopper, and Blackwell "
                                   "(B200/B300) GPUs. Current GPU: {}",
                                   c.gpu.device_name),
                       hybridep_supported(c.gpu) ? "model.moe_flex_dispatcher_backend=hybridep"
                                                 : "model.moe_token_dispatcher_type=alltoall");
      });
  add("flex.hybridep_gpu", E, {"model.moe_flex_dispatcher_backend", "target.gpu"}, kBridgeFlex,
      "HybridEP needs compute capability 8, 9 or 10", [](const CheckContext& c) {
        if (!c.cuda() || !uses_flex(c.cfg.model, "hybridep")) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        return fail_if(!hybridep_supported(c.gpu),
                       "HybridEP is supported for GB200, GB300 with NVL72 and for Ampere, Hopper, "
                       "B200 and B300 GPUs",
                       "model.moe_token_dispatcher_type=alltoall");
      });
  add("flex.backend_without_flex", W,
      {"model.moe_flex_dispatcher_backend", "model.moe_token_dispatcher_type"}, kSeedOverlap,
      "a backend set while the dispatcher is not flex does nothing", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.moe_token_dispatcher_type == "flex" || !m.moe_flex_dispatcher_backend ||
            m.moe_flex_dispatcher_backend == "ncclep")  // an error: flex.backend_needs_flex
          return pass();
        // Megatron's default backend is "deepep" on every config; flag what the user asked for.
        const bool asked = c.user.set_on_command_line("model.moe_flex_dispatcher_backend") ||
                           *m.moe_flex_dispatcher_backend != "deepep";
        return fail_if(asked,
                       fmt::format("moe_flex_dispatcher_backend={} alone does nothing while "
                                   "moe_token_dispatcher_type is '{}'",
                                   *m.moe_flex_dispatcher_backend, m.moe_token_dispatcher_type),
                       "model.moe_token_dispatcher_type=flex");
      });
  add("flex.backend_needs_flex", E,
      {"model.moe_flex_dispatcher_backend", "model.moe_token_dispatcher_type", "model.moe_pad_expert_input_to_capacity"},
      kMcore, "NCCL-EP needs the flex dispatcher; DeepEP does not pad to capacity", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.moe_flex_dispatcher_backend == "ncclep" && m.moe_token_dispatcher_type != "flex")
          return fail("moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'.",
                      "model.moe_token_dispatcher_type=flex");
        return fail_if(m.moe_token_dispatcher_type == "flex" && m.moe_flex_dispatcher_backend == "deepep" &&
                           m.moe_pad_expert_input_to_capacity,
                       "Flex token dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity",
                       "model.moe_pad_expert_input_to_capacity=false");
      });
  add("flex.runtime_package", A, {"model.moe_flex_dispatcher_backend", "target.gpu"},
      kSeedDispatcher, "a flex backend needs its runtime package in the container",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!c.cuda() || m.moe_token_dispatcher_type != "flex" || !m.moe_flex_dispatcher_backend)
          return pass();
        return fail(fmt::format("confirm the {} package imports in the target container before "
                                "reading timings: a missing package fails at model construction, "
                                "an environment limitation, not a timing (alltoall is then the "
                                "only measured fallback)",
                                *m.moe_flex_dispatcher_backend));
      });

  add("flex.cpu_backend", E, {"model.moe_flex_dispatcher_backend", "target.gpu"},
      "epx runtime (src/dispatch/flex_dispatcher.cpp)",
      "on the cpu target the flex backend must be one epx's runtime has (deepep, hybridep)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (c.cuda() || m.moe_token_dispatcher_type != "flex" || !m.moe_flex_dispatcher_backend) return pass();
        const std::string& b = *m.moe_flex_dispatcher_backend;
        return fail_if(b != "deepep" && b != "hybridep",
                       fmt::format("moe_flex_dispatcher_backend={} is not built into epx's CPU runtime "
                                   "(it has deepep and hybridep); the run would fail when the "
                                   "dispatcher is made",
                                   b),
                       "model.moe_flex_dispatcher_backend=deepep");
      });

  // ---- HybridEP topology --------------------------------------------------------------------
  add("hybridep.topology", E, {"model.expert_model_parallel_size", "target.gpu"}, kBridgeTopology,
      "HybridEP has an NVLink-domain layout for this GPU and EP size (epx also maps h200 and "
      "a100 like h100, and cpu to the ranks of one node)", [](const CheckContext& c) {
        if (!uses_flex(c.cfg.model, "hybridep")) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        const HybridEpTopology t = hybridep_topology(c.cfg, c.gpu);
        return fail_if(!t.error.empty(), t.error, "model.moe_token_dispatcher_type=alltoall");
      });
  add("hybridep.domain_divides_ep", E,
      {"model.expert_model_parallel_size", "env_vars." + std::string(kRanksPerDomainVar)}, "epx",
      "the NVLink-domain rank count divides EP", [](const CheckContext& c) {
        if (!uses_flex(c.cfg.model, "hybridep")) return pass();
        auto it = c.cfg.env_vars.find(kRanksPerDomainVar);
        if (it == c.cfg.env_vars.end()) return pass();
        Int ranks = 0;
        try {
          ranks = std::stoll(it->second);
        } catch (...) {
        }
        const Int ep = c.cfg.model.expert_model_parallel_size;
        const HybridEpTopology t = hybridep_topology(c.cfg, c.gpu);
        return fail_if(ranks <= 0 || ep % ranks != 0,
                       fmt::format("{}={} must be a positive divisor of the EP size {}",
                                   kRanksPerDomainVar, it->second, ep),
                       t.error.empty()
                           ? fmt::format("env_vars.{}={}", kRanksPerDomainVar, t.ranks_per_domain)
                           : fmt::format("env_vars.{}=<the EP ranks in one NVLink domain>",
                                         kRanksPerDomainVar));
      });
  add("hybridep.domain_mismatch", W,
      {"env_vars." + std::string(kRanksPerDomainVar), "model.expert_model_parallel_size",
       "target.gpu"},
      kSeedDispatcher, "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN matches the topology",
      [](const CheckContext& c) {
        if (!uses_flex(c.cfg.model, "hybridep")) return pass();
        auto it = c.cfg.env_vars.find(kRanksPerDomainVar);
        if (it == c.cfg.env_vars.end()) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        const HybridEpTopology t = hybridep_topology(c.cfg, c.gpu);
        if (!t.error.empty()) return pass();
        return fail_if(it->second != std::to_string(t.ranks_per_domain),
                       fmt::format("{}={} does not match the NVLink domain of {} x EP{} (expected "
                                   "{}): performance and sometimes correctness will suffer",
                                   kRanksPerDomainVar, it->second, c.gpu.name,
                                   c.cfg.model.expert_model_parallel_size, t.ranks_per_domain),
                       fmt::format("env_vars.{}={}", kRanksPerDomainVar, t.ranks_per_domain));
      });
  add("hybridep.env_without_hybridep", W, {"env_vars." + std::string(kRanksPerDomainVar)},
      kBridgeTopology, "HybridEP topology variables set without the HybridEP backend",
      [](const CheckContext& c) {
        // Bridge drops the topology variables unless the backend is hybridep; with that backend
        // under another dispatcher it sets them, and nothing reads them.
        const bool backend = c.cfg.model.moe_flex_dispatcher_backend == std::optional<std::string>("hybridep");
        return fail_if(!uses_flex(c.cfg.model, "hybridep") &&
                           c.cfg.env_vars.count(kRanksPerDomainVar),
                       fmt::format("{} is set but the dispatcher is not flex+hybridep: {}", kRanksPerDomainVar,
                                   backend ? "Bridge keeps it for the hybridep backend, but the token dispatcher "
                                             "does not use HybridEP, so nothing reads it"
                                           : "Bridge removes it, it has no effect"),
                       fmt::format("~env_vars.{}", kRanksPerDomainVar));
      });

  // ---- What Megatron-Core and Bridge raise when the model is built or first runs ---------------
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
  add("flex.deepep_needs_tp_ep", E, {"model.moe_flex_dispatcher_backend", "model.expert_model_parallel_size",
                                     "model.expert_tensor_parallel_size"},
      "Megatron-Core moe/token_dispatcher.py", "DeepEP needs ETP x EP > 1", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(uses_flex(m, "deepep") && m.expert_model_parallel_size * m.expert_tensor_parallel_size.value_or(1) <= 1,
                       "DeepEP dispatcher requires TPxEP > 1", "model.moe_token_dispatcher_type=alltoall");
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
        return fail_if(m.num_moe_experts && m.moe_router_load_balancing_type == "sinkhorn" && m.moe_aux_loss_coeff != 0,
                       "Sinkhorn routing does not support aux loss.", "model.moe_aux_loss_coeff=0.0");
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

  // ---- Pitfalls and advice from the seeds ---------------------------------------------------
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
  // ---- CUDA graphs: Megatron-Core's asserts on per-layer graphs (local, transformer_engine) -----
  add("cuda_graph.modules", E,
      {"model.cuda_graph_impl", "model.cuda_graph_modules", "model.cuda_graph_scope", "model.num_moe_experts",
       "model.moe_layer_freq", "model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity",
       "model.moe_token_dispatcher_type"},
      kMcore, "per-layer CUDA graph modules fit the model: MoE ones on MoE layers, mlp on dense ones, moe drop-padded",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (full_iteration_graph(m)) {
          // Bridge's legacy scope becomes the modules list; "full" and "full_iteration" are dropped.
          bool modules = false;
          for (const StringList* list : {&m.cuda_graph_modules, &m.cuda_graph_scope})
            for (const std::string& name : *list) modules = modules || (name != "full" && name != "full_iteration");
          const std::string scope = m.cuda_graph_impl == "local" ? "[full_iteration]" : "[]";  // the legacy switch kept
          return fail_if(modules, "cuda_graph_modules must be empty when cuda_graph_impl=\"full_iteration\".",
                         (m.cuda_graph_modules.empty() ? "" : "model.cuda_graph_modules=[] ") + std::string("model.cuda_graph_scope=") + scope);
        }
        if (m.cuda_graph_impl != "local" && m.cuda_graph_impl != "transformer_engine") return pass();
        // The local implementation captures moe_router and moe_preprocess together.
        const bool local = m.cuda_graph_impl == "local";
        const auto has = [&](const char* name) {
          const std::string n = name;
          if (local && (n == "moe_router" || n == "moe_preprocess"))
            return has_cuda_graph_module(m, "moe_router") || has_cuda_graph_module(m, "moe_preprocess");
          return has_cuda_graph_module(m, name);
        };
        // Fixes rewrite the list the config sets: Bridge's legacy cuda_graph_scope, or the modules.
        const std::string key = m.cuda_graph_modules.empty() ? "model.cuda_graph_scope" : "model.cuda_graph_modules";
        const auto set = [&](const char* list) { return fmt::format("{}={}", key, list); };
        if (has("moe") && has("moe_router"))
          return fail("cuda_graph_modules must not contain both moe and moe_router.", set("[moe_router]"));
        if (has("moe_preprocess") && !has("moe_router"))
          return fail("moe_preprocess cuda graph is only supported with moe_router cuda graph.",
                      set("[moe_router,moe_preprocess]"));
        if (!m.num_moe_experts || *m.num_moe_experts <= 1)
          return fail_if(has("moe") || has("moe_router"), "moe cuda graph is only supported for MoE.", set("[attn]"));
        if (!m.moe_layer_freq.has_dense() && has("mlp"))
          return fail("mlp cuda graph is only supported for dense layers, but not found in the model.", set("[attn]"));
        const bool drop_pad = m.moe_expert_capacity_factor && m.moe_pad_expert_input_to_capacity;
        if (!drop_pad && has("moe"))
          return fail("moe cuda graph is only supported with drop-padding MoE.", set("[attn]"));
        // Megatron-Core also counts moe_router_padding_for_fp8 here, which epx does not model (no FP8).
        return fail_if(!drop_pad && m.moe_token_dispatcher_type == "alltoall" && m.moe_expert_capacity_factor &&
                           has("moe_preprocess"),
                       "moe_preprocess cuda graph is not supported when there are DtoH copies and synchronizations in "
                       "the preprocess step.",
                       local ? set("[attn]") : set("[moe_router]"));
      });
  add("cuda_graph.recompute", E,
      {"model.cuda_graph_impl", "model.recompute_granularity", "model.recompute_modules", "model.cuda_graph_modules",
       "model.cuda_graph_scope"},
      kMcore, "per-layer CUDA graphs take selective recompute only, and not of moe around a moe_router graph",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.cuda_graph_impl == "none" || !m.recompute_granularity || full_iteration_graph(m)) return pass();
        if (*m.recompute_granularity != "selective")
          return fail("full recompute is only supported with full iteration CUDA graph.",
                      "model.recompute_granularity=selective model.recompute_method=null model.recompute_num_layers=null");
        return fail_if(m.cuda_graph_impl == "transformer_engine" && m.recompute_modules &&
                           contains(*m.recompute_modules, "moe") && has_cuda_graph_module(m, "moe_router"),
                       "moe recompute is not supported with moe_router CUDA graph with: ",
                       "model.recompute_modules=[core_attn]");
      });
  add("advice.full_graph_dropless", A,
      {"model.cuda_graph_impl", "model.cuda_graph_scope", "model.moe_expert_capacity_factor"}, kSeedWorkflow,
      "full-iteration CUDA graphs suit drop-and-pad, not dropless MoE", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts && full_iteration_graph(m) && !m.moe_expert_capacity_factor,
                       "full-iteration CUDA graphs need static shapes; with dropless MoE start with "
                       "TE-scoped graphs (attn, moe_router, moe_preprocess)",
                       "model.cuda_graph_impl=transformer_engine "
                       "model.cuda_graph_scope=attn,moe_router,moe_preprocess");
      });
  return r;
}

}  // namespace

const std::vector<Rule>& rules() {
  static const std::vector<Rule> table = build_rules();
  return table;
}

const Rule* find_rule(std::string_view id) {
  for (const auto& r : rules())
    if (r.id == id) return &r;
  return nullptr;
}

}  // namespace epx
