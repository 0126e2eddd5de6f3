// `epx plan`: the layout, the memory and the step time of every dispatcher with and without EP
// overlap, for a config that passed `epx check`.
#include <algorithm>

#include <fmt/format.h>

#include "epx/check/flex_backend.hpp"
#include "epx/plan/plan.hpp"
#include "epx/plan/step_time.hpp"

namespace epx {
namespace {

// Memory in GiB, as Megatron's "gigabytes" (bytes / 2^30) and the catalog's capacities.
constexpr double kGiB = 1073741824.0;

Dispatcher configured_dispatcher(const ModelConfig& m) {
  if (m.moe_token_dispatcher_type != "flex") return Dispatcher::alltoall;
  return m.moe_flex_dispatcher_backend.value_or("deepep") == "hybridep" ? Dispatcher::hybridep : Dispatcher::deepep;
}

// Why a domain that spans nodes is smaller than the rack: Bridge's Slurm segments.
std::string segment_text(const LayoutPlan& l) {
  if (l.segment_nodes == 0 || l.segment_nodes == l.nodes) return "";
  return fmt::format(": Slurm segments of {} node{}, as Bridge's harness requests for {} nodes on racks of {} GPUs",
                     l.segment_nodes, l.segment_nodes == 1 ? "" : "s", l.nodes, l.rack_gpus);
}

}  // namespace

std::vector<std::string> overrides_for(const ModelConfig& m, const Variant& v) {
  std::vector<std::string> out;
  if (v.dispatcher != configured_dispatcher(m)) {
    if (v.dispatcher == Dispatcher::alltoall) {
      out.push_back("model.moe_token_dispatcher_type=alltoall");
      // ncclep is flex-only (flex.backend_needs_flex): it goes with the flex dispatcher.
      if (m.moe_flex_dispatcher_backend == std::optional<std::string>("ncclep"))
        out.push_back("model.moe_flex_dispatcher_backend=null");
    } else {
      if (m.moe_token_dispatcher_type != "flex") out.push_back("model.moe_token_dispatcher_type=flex");
      out.push_back(fmt::format("model.moe_flex_dispatcher_backend={}", to_string(v.dispatcher)));
    }
  }
  if (v.ep_overlap != m.overlap_moe_expert_parallel_comm)
    out.push_back(fmt::format("comm_overlap.overlap_moe_expert_parallel_comm={}", v.ep_overlap));
  if (v.delay_wgrad != m.delay_wgrad_compute)
    out.push_back(fmt::format("comm_overlap.delay_wgrad_compute={}", v.delay_wgrad));
  return out;
}

const Variant& Plan::configured() const {
  for (const Variant& v : variants)
    if (v.as_configured) return v;
  throw std::logic_error("make_plan: no variant as configured");
}

namespace {

// `resolved` with `overrides` applied, checked: the report, and its first error in words.
std::pair<CheckReport, std::string> checked(const Config& resolved, const std::vector<std::string>& overrides) {
  Config changed = resolved;
  for (const std::string& o : overrides) apply_override(changed, o);
  CheckReport r = run_check(changed);
  std::string first;
  std::vector<std::string> more;
  for (const Finding& f : r.findings) {
    if (f.severity != Severity::error) continue;
    if (first.empty()) first = fmt::format("[{}] {}", f.rule_id, f.message);
    else more.push_back(f.rule_id);
  }
  if (!more.empty()) first += fmt::format(" (and {})", fmt::join(more, ", "));
  return {std::move(r), first};
}

}  // namespace

Replanned replan(const Config& resolved, const std::vector<std::string>& overrides) {
  auto [report, refusal] = checked(resolved, overrides);
  if (!refusal.empty()) return {std::nullopt, refusal};
  return {make_plan(report.resolved), ""};
}

std::string check_refusal(const Config& resolved, const std::vector<std::string>& overrides) {
  return checked(resolved, overrides).second;
}

void check_variants(Plan& p, const Config& resolved) {
  for (Variant& v : p.variants)
    if (!v.overrides.empty()) v.refusal = check_refusal(resolved, v.overrides);
}

std::vector<std::string> full_recompute_overrides(const Config& c) {
  const ModelConfig& m = c.model;
  std::vector<std::string> o = {"model.recompute_granularity=full", "model.recompute_method=uniform",
                                "model.recompute_num_layers=1"};
  if (m.cuda_graph_impl != "none") o.push_back("model.cuda_graph_impl=none");
  // EP overlap off where it was set: comm_overlap (which Bridge copies onto the model), or the
  // model alone (a new comm_overlap section would bring its other defaults with it).
  const std::string section = c.comm_overlap ? "comm_overlap" : "model";
  if (m.overlap_moe_expert_parallel_comm)
    o.insert(o.end(), {section + ".overlap_moe_expert_parallel_comm=false", section + ".delay_wgrad_compute=false"});
  return o;
}

std::vector<std::string> selective_recompute_overrides(const ModelConfig& m) {
  std::vector<std::string> o = {"model.recompute_granularity=selective",
                                "model.recompute_modules=[core_attn,moe_act,layernorm]"};
  if (m.recompute_method) o.push_back("model.recompute_method=null");
  if (m.recompute_num_layers) o.push_back("model.recompute_num_layers=null");
  return o;
}

bool tight_fit(double peak_gib, const GpuInfo& gpu) {
  return gpu.cuda() && gpu.rates.memory_gb > 0 && peak_gib > 0.95 * gpu.rates.memory_gb;
}

Plan make_plan(const Config& c) {
  const ModelConfig& m = c.model;
  Plan p;
  p.gpu = target_gpu(c);
  if (!c.train.global_batch_size)
    throw ConfigError("train.global_batch_size=None: a step is a global batch; set train.global_batch_size (or -gb)");
  p.layout = plan_layout(c, p.gpu);
  // 0 in the catalog means "not known": the step time needs the compute rates, NVLink's where a
  // node holds several GPUs and the network's where the layout spans nodes.
  const HardwareRates& hw = p.gpu.rates;
  std::vector<std::pair<const char*, double>> needed = {
      {"bf16_tflops", hw.bf16_tflops}, {"hbm_tb_s", hw.hbm_tb_s}, {"gemm_efficiency", hw.gemm_efficiency}};
  if (p.layout.gpus_per_node > 1) needed.insert(needed.end(), {{"nvlink_gb_s", hw.nvlink_gb_s}, {"nvlink_efficiency", hw.nvlink_efficiency}});
  if (p.layout.nodes > 1) needed.insert(needed.end(), {{"network_gb_s", hw.network_gb_s}, {"network_efficiency", hw.network_efficiency}});
  std::vector<std::string> missing;
  for (const auto& [name, rate] : needed)
    if (rate <= 0) missing.push_back(name);
  // Before Ampere (compute capability 8) a GPU has no BF16 tensor cores, and the planner times
  // every GEMM at the BF16 rate: there is no rate to give.
  if (hw.bf16_tflops <= 0 && p.gpu.major > 0 && p.gpu.major < 8)
    throw ConfigError(fmt::format("target.gpu={} ({}): compute capability {} has no BF16 tensor cores, and the planner "
                                  "times GEMMs at the BF16 rate only; plan on an Ampere or newer GPU (-g a100, -g h100, ...)",
                                  p.gpu.name, p.gpu.device_name, p.gpu.major));
  if (!missing.empty())
    throw ConfigError(fmt::format("target.gpu={}: the hardware catalog{} has no {} for it (0: not known); give {} "
                                  "with --hardware FILE",
                                  p.gpu.name, p.gpu.source.empty() ? "" : fmt::format(" (with {})", p.gpu.source),
                                  fmt::join(missing, ", "), missing.size() > 1 ? "them" : "it"));
  const ParallelLayout& l = p.layout.layout;
  p.flops = model_flops(c);
  const double gbs = static_cast<double>(c.train.global_batch_size.value_or(1));
  const double tokens_per_step = gbs * static_cast<double>(m.seq_length);
  p.flops_per_step = p.flops.per_token() * tokens_per_step;
  p.micro_batches = static_cast<std::int64_t>(micro_batches_per_dp_rank(c, l));
  const Dispatcher configured = configured_dispatcher(m);
  const double capacity = p.gpu.rates.memory_gb * kGiB;
  const int vpp = p.layout.split.chunks;
  // Dispatchers and EP overlap only matter with MoE layers over EP ranks; otherwise one row.
  const bool exchanges = moe_layers_in(m, 0, m.num_layers) > 0 && l.ep > 1;
  // The flex backends where Bridge runs them (it falls back to alltoall elsewhere: DeepEP on
  // GB200, say); epx's own runtime has both.
  std::vector<Dispatcher> dispatchers = {Dispatcher::alltoall};
  for (const auto& [d, supported] : {std::pair{Dispatcher::deepep, deepep_supported(p.gpu)},
                                     std::pair{Dispatcher::hybridep, hybridep_supported(p.gpu)}})
    if (supported || !p.gpu.cuda() || d == configured) dispatchers.push_back(d);
  std::vector<std::pair<bool, bool>> schedules = {{false, false}, {true, false}, {true, true}};
  if (!exchanges) {
    dispatchers = {configured};
    schedules = {{false, false}};
  }
  for (Dispatcher d : dispatchers) {
    const MemoryPlan mem_plain = plan_memory(c, p.layout, d, false), mem_overlap = plan_memory(c, p.layout, d, true);
    const CommPlan comm = plan_comm(c, p.layout, p.gpu, d);
    const StepCosts costs = step_costs(c, p.layout, p.gpu, comm, mem_plain, d);
    if (l.pp > 1) p.stage_compute_s = costs.stage_compute;  // the same for every dispatcher
    for (auto [overlap, delay] : schedules) {
      Variant v;
      v.dispatcher = d;
      v.ep_overlap = overlap;
      v.delay_wgrad = delay;
      v.as_configured = !exchanges || (d == configured && overlap == m.overlap_moe_expert_parallel_comm &&
                                       (overlap ? delay == m.delay_wgrad_compute : true));
      const StepTime t = step_time(costs, static_cast<double>(p.micro_batches), vpp, overlap, delay);
      const MemoryPlan& mem = overlap ? mem_overlap : mem_plain;
      v.step_time_s = t.total;
      v.tflops_per_gpu = p.flops_per_step / t.total / l.world / 1e12;
      v.tokens_per_s_per_gpu = tokens_per_step / t.total / l.world;
      v.peak_memory_gb = mem.peak() / kGiB;
      v.exposed_comm_s = t.exposed_comm;
      v.exposed_dp_s = std::min(t.exposed_dp, t.exposed_comm);
      v.compute_s = t.compute;
      v.bubble_s = t.bubble;
      v.wall = capacity > 0 && mem.peak() > capacity ? "memory" : t.exposed_comm > kCommunicationBinds * t.total ? "communication" : "compute";
      if (!v.as_configured) v.overrides = overrides_for(m, v);
      if (v.as_configured) p.memory = mem;
      p.variants.push_back(v);
    }
  }
  p.fits = capacity <= 0 || p.memory.peak() <= capacity;
  if (m.fp8)
    p.notes.push_back(fmt::format("FP8 ({}, {} scaling): every GEMM is timed at the BF16 rate, so the step times are an "
                                  "upper bound; the planner does not model FP8's gain (the reference has no FP8 run to "
                                  "check it against)",
                                  *m.fp8, m.fp8_recipe.value_or("delayed")));
  if (m.fp8_param)
    p.notes.push_back("fp8_param: the GEMM weights are counted in BF16, so their memory is an upper bound");
  if (m.overlap_dispatch_backward_with_experts_wgrad)
    p.notes.push_back("overlap_dispatch_backward_with_experts_wgrad: the dispatch's backward exchange hidden under the "
                      "experts' wgrad is not modelled, so the rows without EP overlap are an upper bound");
  if (const double w = window_layers_in(m, 0, m.num_layers); w > 0)
    p.notes.push_back(fmt::format("sliding window: {:g} of {} layers attend over {} keys; the step times count {:.3g}% of "
                                  "their QK^T and PV, the model FLOPs (and the TFLOP/s) all of it, as Megatron-LM does",
                                  w, m.num_layers, *sliding_window(m) + 1,
                                  100 * window_core_share(m)));
  if (m.moe_token_dispatcher_type == "flex" && m.moe_flex_dispatcher_backend == std::optional<std::string>("ncclep"))
    p.notes.push_back("ncclep is not modelled apart: the configured run is timed as DeepEP's (the deepep rows)");
  return p;
}

std::string format_plan(const Plan& p) {
  const ParallelLayout& l = p.layout.layout;
  std::string out = fmt::format("layout: {} on {} x {} ({} node{} of {}, NVLink domain {}{})\n", l.describe(), l.world,
                                p.gpu.name.empty() ? "GPU" : p.gpu.name, p.layout.nodes, p.layout.nodes == 1 ? "" : "s",
                                p.layout.gpus_per_node, p.layout.nvlink_domain, segment_text(p.layout));
  out += "groups:";
  for (const GroupPlacement& g : p.layout.groups)
    if (g.size > 1)
      out += fmt::format(" {} {}x{} ({})", group_kind_name(g.kind), g.count, g.size,
                         g.within_nvlink ? "NVLink" : g.within_node ? "node" : "across nodes");
  out += "\n";
  out += fmt::format("model FLOPs: {:.3f} GFLOP per token ({:.3g} per step), Megatron's count\n", p.flops.per_token() / 1e9,
                     p.flops_per_step);
  const MemoryPlan& m = p.memory;
  out += fmt::format(
      "memory per GPU (most-loaded rank, as configured): {:.3g} GiB of {:.0f} GiB -> {}\n"
      "  weights {:.3g} | gradients {:.3g} | optimizer {:.3g} | activations {:.3g} ({:.2g} micro-batch(es) in "
      "flight) | dispatcher buffers {:.3g} | logits {:.3g} | runtime extras {:.3g}{}\n"
      "  parameters on the rank: {:.3g} dense, {:.3g} expert\n",
      m.peak() / kGiB, p.gpu.rates.memory_gb,
      !p.fits                            ? "DOES NOT FIT"
      : tight_fit(m.peak() / kGiB, p.gpu) ? "fits, with under 5% left for the CUDA context, NCCL's buffers and fragmentation"
                                          : "fits", m.weights / kGiB, m.gradients / kGiB,
      m.optimizer / kGiB, m.activations / kGiB, m.in_flight, m.dispatcher_buffers / kGiB, m.logits / kGiB, m.other / kGiB,
      m.step_grads <= 0 ? std::string()
      : m.step_grads > m.activations + m.logits
          ? fmt::format("\n  the optimizer step's FP32 copy of the BF16 grads, {:.3g}, outweighs activations + logits: "
                        "the peak is the step's", m.step_grads / kGiB)
          : fmt::format(" | (at the step, instead of activations + logits: FP32 grads {:.3g})", m.step_grads / kGiB),
      m.dense_params, m.expert_params);
  if (!p.stage_compute_s.empty()) {
    // Which stage sets the pace: the slowest one's compute, every micro-batch.
    std::vector<std::string> stages;
    for (std::size_t k = 0; k < p.stage_compute_s.size(); ++k) stages.push_back(fmt::format("{:.3g}", p.stage_compute_s[k]));
    const auto slowest = std::max_element(p.stage_compute_s.begin(), p.stage_compute_s.end()) - p.stage_compute_s.begin();
    out += fmt::format("pipeline stages' compute per micro-batch (s): {}; stage {} is the slowest and sets the step\n",
                       fmt::join(stages, " | "), slowest);
  }
  out += fmt::format("step ({} micro-batch{} per DP rank):\n", p.micro_batches, p.micro_batches == 1 ? "" : "es");
  out += "  dispatcher  EP overlap  delay_wgrad  step (s)  TFLOP/s/GPU  tokens/s/GPU  peak GiB  exposed comm (s)  wall           override\n";
  std::vector<std::pair<std::string, int>> refusals;  // each refusal and its rows, in order
  for (const Variant& v : p.variants) {
    out += fmt::format("{} {:<10}  {:<10}  {:<11}  {:8.3f}  {:11.1f}  {:12.0f}  {:8.3f}  {:16.3f}  {:<13}  {}\n",
                       v.as_configured ? "*" : v.refusal.empty() ? " " : "!", to_string(v.dispatcher),
                       v.ep_overlap ? "on" : "off", v.delay_wgrad ? "on" : "off", v.step_time_s, v.tflops_per_gpu,
                       v.tokens_per_s_per_gpu, v.peak_memory_gb, v.exposed_comm_s, v.wall,
                       v.as_configured ? "(as configured)" : fmt::format("{}", fmt::join(v.overrides, " ")));
    if (v.refusal.empty()) continue;
    const auto known = std::find_if(refusals.begin(), refusals.end(), [&](const auto& r) { return r.first == v.refusal; });
    if (known == refusals.end()) refusals.emplace_back(v.refusal, 1);
    else ++known->second;
  }
  if (!refusals.empty())
    out += "rows marked ! are timed as if they ran, but epx check refuses them as they stand:\n";
  for (const auto& [refusal, rows] : refusals) out += fmt::format("  {} ({} row{})\n", refusal, rows, rows == 1 ? "" : "s");
  for (const std::string& n : p.notes) out += "note: " + n + "\n";
  return out;
}

nlohmann::json variant_json(const Variant& v) {
  return {{"dispatcher", to_string(v.dispatcher)}, {"ep_overlap", v.ep_overlap}, {"delay_wgrad", v.delay_wgrad},
          {"step_time_s", v.step_time_s}, {"tflops_per_gpu", v.tflops_per_gpu},
          {"tokens_per_s_per_gpu", v.tokens_per_s_per_gpu}, {"peak_memory_gb", v.peak_memory_gb},
          {"exposed_comm_s", v.exposed_comm_s}, {"exposed_dp_s", v.exposed_dp_s}, {"wall", v.wall}, {"as_configured", v.as_configured},
          {"override", fmt::format("{}", fmt::join(v.overrides, " "))}, {"refusal", v.refusal.empty() ? nlohmann::json(nullptr) : nlohmann::json(v.refusal)}};
}

nlohmann::json plan_json(const Plan& p) {
  const ParallelLayout& l = p.layout.layout;
  nlohmann::json groups = nlohmann::json::array();
  for (const GroupPlacement& g : p.layout.groups)
    groups.push_back({{"kind", group_kind_name(g.kind)}, {"size", g.size}, {"count", g.count},
                      {"within_node", g.within_node}, {"within_nvlink_domain", g.within_nvlink}});
  nlohmann::json variants = nlohmann::json::array();
  for (const Variant& v : p.variants) variants.push_back(variant_json(v));
  const MemoryPlan& m = p.memory;
  return {{"layout", {{"world", l.world}, {"tp", l.tp}, {"cp", l.cp}, {"dp", l.dp}, {"pp", l.pp}, {"etp", l.etp},
                      {"ep", l.ep}, {"edp", l.edp}, {"nodes", p.layout.nodes}, {"groups", groups}}},
          {"gpu", p.gpu.name},
          {"flops_per_token", p.flops.per_token()},
          {"micro_batches", p.micro_batches},
          {"fits", p.fits},
          {"memory_gb", {{"weights", m.weights / kGiB}, {"gradients", m.gradients / kGiB}, {"optimizer", m.optimizer / kGiB},
                         {"activations", m.activations / kGiB}, {"dispatcher_buffers", m.dispatcher_buffers / kGiB},
                         {"logits", m.logits / kGiB}, {"step_grads", m.step_grads / kGiB}, {"other", m.other / kGiB},
                         {"peak", m.peak() / kGiB}}},
          {"variants", variants},
          {"stage_compute_s", p.stage_compute_s},
          {"notes", p.notes}};
}

}  // namespace epx
