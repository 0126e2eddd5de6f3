// `epx advise`: the seeds' dispatcher-selection guide (hardware, EP degree, model family, the
// backend availability gate, tuning) applied to one config, every choice weighed by the
// planner's step time and memory for the alternatives.
#include "epx/plan/advise.hpp"

#include <algorithm>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "epx/base/error.hpp"
#include "epx/base/to_lower.hpp"
#include "epx/check/check.hpp"
#include "epx/check/flex_backend.hpp"
#include "epx/config/schema.hpp"

namespace epx {
namespace {

// Two predictions closer than this are a toss-up for the model (its errors are larger).
constexpr double kSecondOrder = 0.05;
// EP overlap is worth a run when the exchanges leave this share of the step exposed.
constexpr double kVisibleExchanges = 0.10;

std::string recipe_name(const Config& c) { return std::filesystem::path(c.source).stem().string(); }

// The performance harness's MoE recipes (-m family, -mr recipe), as scripts/performance lists them.
const std::vector<std::pair<std::string, std::string>> kHarnessRecipes = {
    {"deepseek", "deepseek_v3"},        {"deepseek", "deepseek_v4_pro"},    {"gpt_oss", "gpt_oss_120b"},
    {"gpt_oss", "gpt_oss_20b"},         {"kimi", "kimi_k2"},                {"qwen", "qwen3_235b_a22b"},
    {"qwen", "qwen3_30b_a3b"},          {"qwen", "qwen3_next_80b_a3b"},     {"qwen_vl", "qwen3_vl_235b_a22b"},
    {"qwen_vl", "qwen3_vl_30b_a3b"},    {"qwen_vl", "qwen35_vl_35b_a3b"},   {"qwen_vl", "qwen35_vl_122b_a10b"},
    {"qwen_vl", "qwen35_vl_397b_a17b"}};

// The harness recipe (family, name) a config stands for: a shipped recipe's own name; else the
// harness recipe its model's hf_model_id names ("moonshotai/Kimi-K2-Instruct" -> kimi_k2: the
// longest recipe the id, lower-cased with '_' for '-' and '.', starts with); else none (a
// user's file says nothing of the recipe it came from).
std::optional<std::pair<std::string, std::string>> harness_recipe(const Config& c) {
  const auto family_of = [](const std::string& recipe) {
    for (const auto& [family, name] : kHarnessRecipes)
      if (name == recipe) return family;
    return recipe.substr(0, recipe.find('_'));
  };
  const std::string stem = recipe_name(c);
  const std::vector<std::string> shipped = list_recipes();
  std::error_code ec;
  if (std::find(shipped.begin(), shipped.end(), stem) != shipped.end() &&
      std::filesystem::equivalent(resolve_recipe(stem), c.source, ec))
    return std::pair{family_of(stem), stem};
  // A const node's missing key is an invalid node: only IsDefined may be asked of it.
  const YAML::Node model = static_cast<const YAML::Node&>(c.extra_fields.node)["model"];
  const YAML::Node id = model.IsDefined() && model.IsMap() ? model["hf_model_id"] : YAML::Node();
  if (!id.IsDefined() || !id.IsScalar()) return std::nullopt;
  std::string name = to_lower(id.Scalar().substr(id.Scalar().rfind('/') + 1));
  std::replace_if(name.begin(), name.end(), [](char ch) { return ch == '-' || ch == '.'; }, '_');
  std::optional<std::pair<std::string, std::string>> best;
  for (const auto& [family, recipe] : kHarnessRecipes)
    if (name.starts_with(recipe) && (name.size() == recipe.size() || name[recipe.size()] == '_') &&
        (!best || recipe.size() > best->second.size()))
      best = std::pair{family, recipe};
  return best;
}

// The seeds' "By hardware" table.
std::pair<Dispatcher, std::string> hardware_rule(const GpuInfo& g) {
  const std::string n = g.name;
  if (n == "h100" || n == "h200")
    return {Dispatcher::deepep, fmt::format("{}: DeepEP, if the runtime package is installed (the strong default for "
                                            "cross-node EP on Hopper)", n)};
  if (n == "b200" || n == "b300")
    return {Dispatcher::deepep, fmt::format("{}: DeepEP, if the runtime package is installed (unless a platform-specific "
                                            "HybridEP path is available)", n)};
  if (n == "gb200" || n == "gb300")
    return {Dispatcher::hybridep, fmt::format("{} NVL72: HybridEP, if the runtime package is installed (NVLink-domain-aware "
                                              "dispatch, lower memory pressure)", n)};
  if (n == "cpu")
    return {Dispatcher::alltoall, "cpu (epx's own runtime, first bring-up): alltoall, the easiest path for correctness "
                                  "and debugging; all three dispatchers run here"};
  return {Dispatcher::alltoall, fmt::format("{}: not in the seeds' table, so unknown or first bring-up: alltoall, the "
                                            "easiest path for correctness and debugging", n.empty() ? "an unnamed GPU" : n)};
}

// The seeds' "By EP degree" table: small stays inside the fast interconnect (a node, or an
// NVL72 rack's NVLink domain), large is 64 ranks and more.
std::string ep_rule(const LayoutPlan& lp) {
  const ParallelLayout& l = lp.layout;
  const int ranks = l.ep * l.etp, node = std::max(1, lp.gpus_per_node);
  // Where the groups fall, not only their size: 32 ranks from rank 64 on cross a 72-GPU domain.
  bool in_node = ranks <= node, in_domain = ranks <= lp.nvlink_domain;
  for (const GroupPlacement& g : lp.groups)
    if (g.kind == GroupKind::tp_ep) in_node = g.within_node, in_domain = g.within_nvlink;
  if (in_node || in_domain)
    return fmt::format("EP {} inside one {} (small EP): dispatcher choice is usually second-order; start with "
                       "alltoall or DeepEP",
                       l.ep, in_node ? "node" : "NVLink domain");
  if (lp.rack_gpus > 0 && ranks <= lp.rack_gpus) {
    // A rack would hold each group, but the Slurm segments Bridge's harness asks for do not:
    // name the nearest node counts whose segments do.
    const int rack_nodes = std::max(1, lp.rack_gpus / node);
    std::vector<int> better;
    for (int d = 1; d <= lp.nodes && better.size() < 2; ++d)
      for (const int n : {lp.nodes - d, lp.nodes + d})
        if (n > 0 && better.size() < 2 && slurm_segment_nodes(n, rack_nodes) * node % ranks == 0) better.push_back(n);
    std::sort(better.begin(), better.end());
    return fmt::format("EP {} fits a rack of {} GPUs, but for {} nodes Bridge's harness asks Slurm for segments of {} "
                       "node{} ({} GPUs), which some EP groups {}, so they cross the network (medium EP){}",
                       l.ep, lp.rack_gpus, lp.nodes, lp.segment_nodes, lp.segment_nodes == 1 ? "" : "s",
                       lp.nvlink_domain, ranks <= lp.nvlink_domain ? "straddle" : "outgrow",
                       better.empty() ? ""
                                      : fmt::format("; {} nodes would keep each group in one segment (if the layout and "
                                                    "the batch fit them)",
                                                    fmt::join(better, " or ")));
  }
  if (ranks <= lp.nvlink_domain)
    return fmt::format("EP {}: small enough for one NVLink domain of {}, but some EP groups straddle two (the domain "
                       "is not a multiple of {} ranks), so they cross the network (medium EP): DeepEP often becomes "
                       "worthwhile",
                       l.ep, lp.nvlink_domain, ranks);
  if (l.ep >= 64) return fmt::format("EP {} (large EP): HybridEP is usually the best target on NVL72 systems", l.ep);
  return fmt::format("EP {} across {} nodes (medium EP): DeepEP often becomes worthwhile", l.ep, (ranks + node - 1) / node);
}

// The seeds' "Model-family patterns", by recipe name, else by shape.
std::string family_rule(const Config& c) {
  const ModelConfig& m = c.model;
  const auto recipe = harness_recipe(c);
  const std::string name = to_lower(recipe ? recipe->second : recipe_name(c));
  const Int experts = m.num_moe_experts.value_or(0);
  if (name.find("vl") != std::string::npos)
    return "MoE VLM: start simple, then test HybridEP on GB200-class systems (vision workloads are sensitive to both "
           "memory and host overhead)";
  if (name.find("deepseek") != std::string::npos || (m.multi_latent_attention && experts >= 256))
    return "DeepSeek-V3 at large scale: HybridEP on GB200 or GB300, DeepEP on H100 (the choice matters more as EP "
           "and PP both grow)";
  if (name.find("next") != std::string::npos || experts == 512)
    return "Qwen3-Next: a close race in BF16, HybridEP stronger in FP8 or memory-tight runs (test, do not assume)";
  if (name.find("235b") != std::string::npos || (experts == 128 && m.hidden_size == 4096))
    return "Qwen3 235B: DeepEP on H100, HybridEP on GB200 (usually modestly faster than alltoall there, and often "
           "noticeably more memory headroom)";
  if (name.find("30b") != std::string::npos || (experts == 128 && m.hidden_size == 2048))
    return "Qwen3 30B: DeepEP (smaller models still benefit, but the absolute gap is smaller)";
  return "";
}

double gap(const Variant& a, const Variant& b) { return b.step_time_s / a.step_time_s - 1; }

std::string describe(const Variant& v) {
  return fmt::format("{:.3g} s/step, {:.3g} GiB ({})", v.step_time_s, v.peak_memory_gb,
                     v.ep_overlap ? (v.delay_wgrad ? "EP overlap + delay_wgrad" : "EP overlap") : "no EP overlap");
}

std::string backend_flag(Dispatcher d) { return d == Dispatcher::alltoall ? "None" : to_string(d); }

// Whether the plan has token exchanges (MoE layers over EP ranks): it then has EP-overlap rows.
bool has_exchanges(const Plan& p) {
  return std::any_of(p.variants.begin(), p.variants.end(), [](const Variant& v) { return v.ep_overlap; });
}

std::vector<Tip> tuning_tips(const Config& c, const Advice& a) {
  const ModelConfig& m = c.model;
  std::vector<Tip> tips;
  const auto option = [&](Dispatcher d) -> const DispatcherOption* {
    for (const DispatcherOption& o : a.options)
      if (o.dispatcher == d && o.available) return &o;
    return nullptr;
  };

  tips.push_back(m.moe_router_force_load_balancing
                     ? Tip{"routing", "routing is force-balanced: keep it so in every run of the A/B", {}}
                     : Tip{"routing",
                           "for dispatcher benchmarking, force-balanced routing is the safer default: it usually "
                           "outperforms dropless routing at scale and makes backends comparable; keep the routing "
                           "mode the same in every run you compare",
                           {"model.moe_router_force_load_balancing=true"}});

  // The flex backends' knobs only matter where tokens are exchanged (the plan has EP overlap rows).
  const bool exchanges = has_exchanges(a.plan);
  if (const DispatcherOption* o = option(Dispatcher::deepep); o && exchanges)
    tips.push_back({"deepep SMs",
                    fmt::format("DeepEP's moe_deepep_num_sms (default 20) is a starting point, rarely optimal: sweep it "
                                "one run per value (predicted {} as is)",
                                describe(o->best)),
                    {"model.moe_flex_dispatcher_num_sms=16", "model.moe_flex_dispatcher_num_sms=24",
                     "model.moe_flex_dispatcher_num_sms=32"}});
  if (const DispatcherOption* o = option(Dispatcher::hybridep); o && exchanges) {
    Config h = c;
    h.model.moe_token_dispatcher_type = "flex";
    h.model.moe_flex_dispatcher_backend = "hybridep";
    const HybridEpTopology t = hybridep_topology(h, a.plan.gpu);
    std::vector<std::string> set = {"model.moe_flex_dispatcher_num_sms=16", "model.moe_flex_dispatcher_num_sms=24",
                                    "model.moe_flex_dispatcher_num_sms=32"};
    std::string topology;
    if (!t.error.empty()) {
      topology = " HybridEP cannot run this topology: " + t.error;
    } else {
      const auto it = c.env_vars.find(kRanksPerDomainVar);
      const std::string want = std::to_string(t.ranks_per_domain);
      topology = it == c.env_vars.end()
                     ? fmt::format(" Set {}={} (the EP ranks in one NVLink domain of {}).", kRanksPerDomainVar, want,
                                   a.plan.gpu.name)
                     : it->second == want ? fmt::format(" {}={} matches the topology.", kRanksPerDomainVar, want)
                                          : fmt::format(" {}={} does not match the topology ({} expected): performance "
                                                        "and sometimes correctness suffer.",
                                                        kRanksPerDomainVar, it->second, want);
      if (it == c.env_vars.end() || it->second != want) set.push_back(fmt::format("env_vars.{}={}", kRanksPerDomainVar, want));
    }
    tips.push_back({"hybridep SMs and topology",
                    fmt::format("HybridEP's moe_hybridep_num_sms (default 16; the harness uses 32): sweep 16 to 32 "
                                "(predicted {} as is).{}",
                                describe(o->best), topology),
                    set});
  }

  // EP overlap: worth it when the chosen dispatcher's exchanges are visible.
  if (const DispatcherOption* o = option(a.recommended); o && a.plan.layout.layout.ep > 1) {
    const Variant* overlap = nullptr;
    const Variant* delayed = nullptr;
    for (const Variant& v : a.plan.variants)
      if (v.dispatcher == a.recommended && v.ep_overlap) (v.delay_wgrad ? delayed : overlap) = &v;
    const double exposed = o->plain.exposed_comm_s / o->plain.step_time_s;
    if (overlap && delayed) {
      const double gain = 1 - delayed->step_time_s / o->plain.step_time_s;
      if (exposed >= kVisibleExchanges && gain > 0.02) {
        std::vector<std::string> set = {"comm_overlap.overlap_moe_expert_parallel_comm=true",
                                        "comm_overlap.delay_wgrad_compute=true"};
        std::string why = fmt::format(
            "{} leaves {:.0f}% of the step in exposed communication without overlap: after bring-up, EP overlap is "
            "predicted to take the step from {:.3g} s to {:.3g} s ({:.0f}% less), {:.3g} s with delay_wgrad; peak memory "
            "{:.1f} -> {:.1f} GiB",
            to_string(a.recommended), 100 * exposed, o->plain.step_time_s, overlap->step_time_s,
            100 * (1 - overlap->step_time_s / o->plain.step_time_s), delayed->step_time_s, o->plain.peak_memory_gb,
            delayed->peak_memory_gb);
        const ParallelLayout& l = a.plan.layout.layout;
        if (l.pp > 1 && m.pipeline_model_parallel_layout && !m.virtual_pipeline_model_parallel_size) {
          // Bridge asks for a VPP before Megatron-Core reads it from the layout.
          const int vpp = pipeline_split(m).chunks;
          why += fmt::format("; PP {} without VPP refuses EP overlap, so give the layout's {} model chunk(s) per stage",
                             l.pp, vpp);
          set.push_back(fmt::format("model.virtual_pipeline_model_parallel_size={}", vpp));
        } else if (l.pp > 1 && !m.pipeline_model_parallel_layout && m.virtual_pipeline_model_parallel_size.value_or(1) <= 1) {
          int vpp = 2;
          while (vpp <= m.num_layers && m.num_layers % (l.pp * vpp) != 0) ++vpp;
          why += fmt::format("; PP {} without VPP refuses EP overlap, so interleave the stages", l.pp);
          if (vpp <= m.num_layers) set.push_back(fmt::format("model.virtual_pipeline_model_parallel_size={}", vpp));
        }
        tips.push_back({"EP overlap", why, set});
      } else {
        tips.push_back({"EP overlap",
                        fmt::format("{} leaves {:.0f}% of the step exposed; EP overlap is predicted to gain {:.0f}%: "
                                    "not worth it until dispatch is visible in a profile",
                                    to_string(a.recommended), 100 * exposed, 100 * gain),
                        {}});
      }
    }
  }

  // Selective recompute before full.
  if (m.recompute_granularity == std::optional<std::string>("full")) {
    const std::vector<std::string> selective = selective_recompute_overrides(m);
    if (const Replanned p = replan(c, selective); p.plan && p.plan->fits) {
      const Variant &now = a.plan.configured(), &then = p.plan->configured();
      tips.push_back({"recompute",
                      fmt::format("full recompute is set, but selective recompute (core_attn, moe_act, layernorm) "
                                  "fits: {:.1f} GiB of {:.0f}, {:.3g} s/step instead of {:.3g} s",
                                  then.peak_memory_gb, a.plan.gpu.rates.memory_gb, then.step_time_s, now.step_time_s),
                      selective});
    } else {
      tips.push_back({"recompute", "full recompute is set and selective recompute does not fit: keep full", {}});
    }
  } else if (!a.plan.fits) {
    // Selective first, full only if it still does not fit; neither: the layout itself.
    const double capacity = a.plan.gpu.rates.memory_gb;
    const std::vector<std::string> selective = selective_recompute_overrides(m), full = full_recompute_overrides(c);
    const Replanned with_selective = replan(c, selective), with_full = replan(c, full);
    const auto peak = [](const Replanned& r) {
      return r.plan ? fmt::format("{:.1f} GiB", r.plan->configured().peak_memory_gb) : "refused: " + r.refusal;
    };
    if (with_selective.plan && with_selective.plan->fits)
      tips.push_back({"recompute",
                      fmt::format("the layout does not fit: selective recompute (core_attn, moe_act, layernorm) does, "
                                  "{} of {:.0f}, {:.3g} s/step",
                                  peak(with_selective), capacity, with_selective.plan->configured().step_time_s),
                      selective});
    else if (with_full.plan && with_full.plan->fits)
      tips.push_back({"recompute",
                      fmt::format("the layout does not fit, nor with selective recompute ({} of {:.0f}): full "
                                  "recompute does, {}, {:.3g} s/step",
                                  peak(with_selective), capacity, peak(with_full), with_full.plan->configured().step_time_s),
                      full});
    else
      tips.push_back({"recompute",
                      fmt::format("the layout does not fit, even with full recompute ({} of {:.0f}): recompute "
                                  "is not enough; spread the model wider (EP, PP or TP){} or add GPUs (`epx plan "
                                  "--search` ranks the layouts that fit)",
                                  peak(with_full), capacity,
                                  c.ddp.use_distributed_optimizer ? "" : ", shard the optimizer (ddp.use_distributed_optimizer)"),
                      {}});
  }
  return tips;
}

}  // namespace

bool BackendAvailability::has(Dispatcher d) const {
  if (d == Dispatcher::deepep) return deepep.value_or(true);
  if (d == Dispatcher::hybridep) return hybridep.value_or(true);
  return true;
}

BackendAvailability parse_have_list(const std::string& list) {
  BackendAvailability a;
  a.deepep = a.hybridep = false;
  a.source = "--have " + list;
  std::stringstream in(list);
  bool none = false, any = false;
  for (std::string word; std::getline(in, word, ',');) {
    word = to_lower(word);
    if (word == "deepep") a.deepep = true;
    else if (word == "hybridep") a.hybridep = true;
    else if (word == "none") none = true;
    else if (word != "alltoall")
      throw InputError(fmt::format("--have {}: '{}' is not a backend; list what the container has from deepep, "
                                   "hybridep (or none; alltoall, always there, may be listed too)",
                                   list, word));
    any = true;
  }
  if (!any) throw InputError("--have: an empty list; list what the container has from deepep, hybridep (or none)");
  if (none && (*a.deepep || *a.hybridep))
    throw InputError(fmt::format("--have {}: 'none' beside a backend; give none alone, or the backends the container has",
                                 list));
  return a;
}

BackendAvailability read_probe_file(const std::string& path) {
  const YAML::Node root = parse_yaml_bounded(read_config_text(path), path);
  if (!root.IsMap())
    throw InputError(fmt::format("{}:1: expected 'deepep: true|false' and 'hybridep: true|false' lines", path));
  BackendAvailability a;
  a.source = path;
  for (const auto& kv : root) {
    const std::string key = kv.first.Scalar();  // parse_yaml_bounded refused keys that are not names
    std::optional<bool>* slot = key == "deepep" ? &a.deepep : key == "hybridep" ? &a.hybridep : nullptr;
    bool value = false;
    if (slot == nullptr || !YAML::convert<bool>::decode(kv.second, value))
      throw InputError(fmt::format("{}:{}: {}: {}; the probe file has 'deepep: true|false' and 'hybridep: true|false'",
                                   path, kv.first.Mark().line + 1, key,
                                   slot == nullptr ? "not a backend" : "not true or false"));
    *slot = value;
  }
  return a;
}

Advice advise(const Config& c, const BackendAvailability& have) {
  Advice a;
  a.plan = make_plan(c);
  std::tie(a.seeds_choice, a.hardware_rule) = hardware_rule(a.plan.gpu);
  a.ep_rule = ep_rule(a.plan.layout);
  a.family_rule = family_rule(c);

  for (Dispatcher d : {Dispatcher::alltoall, Dispatcher::deepep, Dispatcher::hybridep}) {
    DispatcherOption o;
    o.dispatcher = d;
    o.available = have.has(d);
    const Variant* best = nullptr;
    const Variant* best_fitting = nullptr;
    for (const Variant& v : a.plan.variants) {
      if (v.dispatcher != d) continue;
      if (!v.ep_overlap) o.plain = v;
      if (!best || v.step_time_s < best->step_time_s) best = &v;
      if (v.wall != "memory" && (!best_fitting || v.step_time_s < best_fitting->step_time_s)) best_fitting = &v;
    }
    if (!best) continue;
    o.fits = best_fitting != nullptr;
    o.best = best_fitting ? *best_fitting : *best;
    a.options.push_back(o);
  }
  std::stable_sort(a.options.begin(), a.options.end(), [](const DispatcherOption& x, const DispatcherOption& y) {
    if (x.available != y.available) return x.available;
    if (x.fits != y.fits) return x.fits;
    return x.best.step_time_s < y.best.step_time_s;
  });

  // The gate.
  const auto planned = [&](Dispatcher d) {
    return std::any_of(a.options.begin(), a.options.end(), [&](const DispatcherOption& o) { return o.dispatcher == d; });
  };
  const bool cpu = !a.plan.gpu.cuda();  // epx's own runtime
  if (cpu && !have.stated()) {
    a.gate.push_back("epx's CPU runtime has all three dispatchers (the flex backends are its emulations)");
  } else if (!have.stated()) {
    a.gate.push_back(
        "backend availability not stated: deepep and hybridep are ranked as if installed. A missing package fails at "
        "model construction, before any timing: confirm it imports in the target container first (--have, or --probe "
        "FILE written there)");
  } else {
    for (Dispatcher d : {Dispatcher::deepep, Dispatcher::hybridep}) {
      if (!planned(d)) continue;
      if (!have.has(d))
        a.gate.push_back(fmt::format("{} is not installed ({}): an environment limitation, not performance data; not "
                                     "ranked. alltoall is the only measured fallback until it is installed",
                                     to_string(d), have.source));
      else if (!(d == Dispatcher::deepep ? have.deepep : have.hybridep))
        a.gate.push_back(fmt::format("{} is not stated in {}: ranked as if installed; confirm it imports in the target "
                                     "container",
                                     to_string(d), have.source));
    }
  }
  for (Dispatcher d : {Dispatcher::deepep, Dispatcher::hybridep})
    if (!planned(d) && !cpu && a.plan.layout.layout.ep > 1)
      a.gate.push_back(fmt::format("{} does not run on {}: Megatron-Bridge falls back to alltoall there ({}); not ranked",
                                   to_string(d), a.plan.gpu.name,
                                   d == Dispatcher::deepep ? "DeepEP: Ampere, Hopper, B200 and B300"
                                                           : "HybridEP: compute capability 8 to 10"));

  // Without token exchanges (EP 1, or no MoE layer) the plan has the configured dispatcher's
  // one row: nothing to choose, tune or A/B but the layout as it is.
  const bool exchanges = has_exchanges(a.plan);
  const DispatcherOption& fastest = a.options.front();
  if (!exchanges) {
    a.recommended = fastest.dispatcher;
    a.why = fmt::format("{}: {}; no token exchanges here (EP {}: every rank holds its experts), so the dispatcher and EP "
                        "overlap do not change the step",
                        to_string(a.recommended), describe(fastest.best), a.plan.layout.layout.ep);
    if (!fastest.fits) a.why += "; it does not fit in memory (see the recompute advice)";
  } else {
    // The recommendation: the planner's fastest available dispatcher that fits; the seeds' choice
    // when it is available and within the model's error of it.
    a.recommended = fastest.dispatcher;
    for (const DispatcherOption& o : a.options)
      if (o.dispatcher == a.seeds_choice && o.available && o.fits && gap(fastest.best, o.best) < kSecondOrder)
        a.recommended = o.dispatcher;
    std::vector<std::string> others;
    const DispatcherOption* chosen = nullptr;
    for (const DispatcherOption& o : a.options)
      if (o.dispatcher == a.recommended) chosen = &o;
    int close = 0, available = 0;
    for (const DispatcherOption& o : a.options) {
      if (!o.available) continue;
      ++available;
      if (o.dispatcher == a.recommended) continue;
      close += std::abs(gap(chosen->best, o.best)) < kSecondOrder;
      others.push_back(fmt::format("{} {} ({:+.0f}%)", to_string(o.dispatcher), describe(o.best), 100 * gap(chosen->best, o.best)));
    }
    a.second_order = available > 1 && close == available - 1;
    a.why = fmt::format("{}: {}{}{}", to_string(a.recommended), describe(chosen->best),
                        others.empty() ? "" : "; against ", fmt::format("{}", fmt::join(others, "; ")));
    if (a.second_order)
      a.why += fmt::format("; every available dispatcher is within {:.0f}% here: the choice is second-order",
                           100 * kSecondOrder);
    if (a.recommended != a.seeds_choice && have.has(a.seeds_choice))
      a.why += fmt::format("; the seeds' first choice for this hardware is {}, predicted {:+.0f}%: worth one A/B run",
                           to_string(a.seeds_choice), [&] {
                             for (const DispatcherOption& o : a.options)
                               if (o.dispatcher == a.seeds_choice) return 100 * gap(chosen->best, o.best);
                             return 0.0;
                           }());
    for (const DispatcherOption& o : a.options)
      if (!o.available && o.fits && gap(chosen->best, o.best) < -kSecondOrder)
        a.why += fmt::format("; {} (not installed) is predicted {:.0f}% faster: worth installing", to_string(o.dispatcher),
                             -100 * gap(chosen->best, o.best));
    if (!chosen->fits) a.why += "; no schedule of it fits in memory (see the recompute advice)";
  }
  a.tuning = tuning_tips(c, a);

  // The A/B: one knob per run, routing fixed, CUDA graphs off, as the seeds' verification
  // section; predicted and checked as the harness lines run it.
  Config ab = c;
  ab.model.cuda_graph_impl = "none";
  const Plan ab_plan = c.model.cuda_graph_impl == "none" ? a.plan : make_plan(ab);
  const ParallelLayout& l = a.plan.layout.layout;
  const auto recipe = harness_recipe(c);
  const ModelConfig& m = c.model;
  const std::string fixed = c.model.moe_router_force_load_balancing ? "" : " model.moe_router_force_load_balancing=true";
  const std::string compute = harness_compute_dtype(m);  // empty: no -c for delayed or custom scaling
  const std::string harness = fmt::format(
      "uv run python scripts/performance/run_script.py -m {} -mr {} --task pretrain -g {} -c {} -ng {} -gn {} "
      "--max_steps 8 --config_variant v1 --cuda_graph_impl none --tokenizer_type NullTokenizer",
      recipe ? recipe->first : "<family>", recipe ? recipe->second : "<recipe>", a.plan.gpu.name,
      compute.empty() ? "<fp8 recipe>" : compute, l.world,
      a.plan.layout.gpus_per_node) +
      // The parallel sizes and batch as the config has them, whatever the recipe's defaults (ETP
      // None is TP's, as Megatron takes it); a pipeline layout or uneven stages are not flags.
      fmt::format(" -tp {} -pp {} -cp {} -vp {} {} -et {}{} -mb {}", m.tensor_model_parallel_size,
                  m.pipeline_model_parallel_size, m.context_parallel_size,
                  m.virtual_pipeline_model_parallel_size ? std::to_string(*m.virtual_pipeline_model_parallel_size) : "None",
                  // -ep on a HybridEP recipe where the harness raises: the EP size as an override
                  m.moe_flex_dispatcher_backend == std::optional<std::string>("hybridep") &&
                          !harness_hybridep_ep_error(a.plan.gpu, m.expert_model_parallel_size).empty()
                      ? fmt::format("model.expert_model_parallel_size={}", m.expert_model_parallel_size)
                      : fmt::format("-ep {}", m.expert_model_parallel_size),
                  m.expert_tensor_parallel_size.value_or(m.tensor_model_parallel_size),
                  c.train.global_batch_size ? fmt::format(" -gb {}", *c.train.global_batch_size) : "",
                  c.train.micro_batch_size.value_or(1));
  const std::string proxy = (recipe ? recipe->second : recipe_name(c)).starts_with("deepseek") ? "deepseek_v3_proxy" : "qwen3_30b_a3b_proxy";
  const std::string here = fmt::format("epx launch -n 2 -- epx run {} --max_steps 8", proxy);
  struct Row {
    std::string label;
    Dispatcher d;
    bool overlap, delay;
  };
  std::vector<Row> rows;
  if (!exchanges) {  // the one row the plan has
    rows = {{"baseline", a.recommended, false, false}};
  } else {
    rows = {{"baseline", Dispatcher::alltoall, false, false}};
    if (a.recommended != Dispatcher::alltoall) rows.push_back({"the dispatcher", a.recommended, false, false});
    rows.push_back({"+ EP overlap", a.recommended, true, false});
    rows.push_back({"+ delay_wgrad", a.recommended, true, true});
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    double predicted = 0, peak = 0;
    for (const Variant& v : ab_plan.variants)
      if (v.dispatcher == r.d && v.ep_overlap == r.overlap && v.delay_wgrad == r.delay)
        predicted = v.step_time_s, peak = v.peak_memory_gb;
    const double capacity = ab_plan.gpu.rates.memory_gb;
    const std::string memory =
        capacity > 0 && peak > capacity
            ? fmt::format("\n# the planner puts its peak at {:.1f} GiB, past the GPU's {:.0f} GiB: it runs out of memory "
                          "as it stands; fit it first with the tuning's memory fix{}",
                          peak, capacity,
                          r.overlap ? " that keeps EP overlap (selective recompute, or the layout: Megatron refuses "
                                      "full recompute beside it)"
                                    : "")
            : "";
    const std::string knobs = fmt::format(
        " --moe_flex_dispatcher_backend {} --moe_a2a_overlap false comm_overlap.overlap_moe_expert_parallel_comm={} "
        "comm_overlap.delay_wgrad_compute={} model.moe_shared_expert_overlap=false{}",
        backend_flag(r.d), r.overlap, r.delay, fixed);
    // The run as the target would take it: epx check on the config with the row's knobs.
    Variant row;
    row.dispatcher = r.d, row.ep_overlap = r.overlap, row.delay_wgrad = r.delay;
    std::vector<std::string> overrides = overrides_for(c.model, row);
    overrides.push_back("model.moe_shared_expert_overlap=false");
    const std::string refusal = check_refusal(ab, overrides);
    if (i == 0 && !recipe)
      a.harness_ab.push_back("# -m / -mr: not known for " + c.source +
                             " (not a shipped recipe, no model.hf_model_id): the harness recipe it came from");
    if (i == 0 && compute.empty())
      a.harness_ab.push_back(fmt::format("# -c: the harness has no FP8 {} scaling (fp8_cs: tensorwise, fp8_mx: "
                                         "mxfp8, fp8_sc: blockwise)",
                                         m.fp8_recipe.value_or("delayed")));
    a.harness_ab.push_back(fmt::format("# {}. {} (predicted {:.3g} s/step){}{}\n{}{}", i + 1, r.label, predicted,
                                       refusal.empty() ? "" : "\n# epx check refuses this run as it stands: " + refusal,
                                       memory, harness, knobs));
    a.epx_ab.push_back(fmt::format("# {}. {}\n{}{} --results ab{}.json", i + 1, r.label, here, knobs, i + 1));
  }
  return a;
}

std::string format_advice(const Advice& a) {
  std::string out = fmt::format("epx advise: {} x {}, {}\n\n", a.plan.layout.layout.world, a.plan.gpu.name,
                                a.plan.layout.layout.describe());
  out += "The seeds' guide for this run:\n";
  out += fmt::format("  hardware: {}\n  EP degree: {}\n", a.hardware_rule, a.ep_rule);
  if (!a.family_rule.empty()) out += fmt::format("  model family: {}\n", a.family_rule);
  for (const std::string& g : a.gate) out += fmt::format("  availability: {}\n", g);
  out += fmt::format("\nRecommended dispatcher: {}\n  {}\n\n", to_string(a.recommended), a.why);
  out += "  dispatcher  available  best schedule             step (s)  peak GiB  fits\n";
  for (const DispatcherOption& o : a.options)
    out += fmt::format("  {:<10}  {:<9}  {:<24}  {:>8.3g}  {:>8.3g}  {}\n", to_string(o.dispatcher),
                       o.available ? "yes" : "no", o.best.ep_overlap ? (o.best.delay_wgrad ? "EP overlap + delay_wgrad" : "EP overlap") : "no EP overlap",
                       o.best.step_time_s, o.best.peak_memory_gb, o.fits ? "yes" : "no");
  out += "\nTuning, in order:\n";
  for (std::size_t i = 0; i < a.tuning.size(); ++i) {
    out += fmt::format("  {}. {}: {}\n", i + 1, a.tuning[i].topic, a.tuning[i].advice);
    for (const std::string& o : a.tuning[i].overrides) out += fmt::format("       {}\n", o);
  }
  out += "\nA/B plan on the target (the seeds' harness, one knob per run):\n";
  for (const std::string& line : a.harness_ab) out += line + "\n";
  out += "\nThe same A/B with epx's runtime here (the proxy model; for the emulated 2-node cluster, run\n"
         "`bash scripts/cluster.sh up --nodes 2 --ranks-per-node 1 --link-gbit 0.15` and use `epx launch --cluster`):\n";
  for (const std::string& line : a.epx_ab) out += line + "\n";
  return out;
}

nlohmann::json advice_json(const Advice& a) {
  nlohmann::json j;
  j["recommended"] = to_string(a.recommended);
  j["seeds_choice"] = to_string(a.seeds_choice);
  j["second_order"] = a.second_order;
  j["why"] = a.why;
  j["rules"] = {{"hardware", a.hardware_rule}, {"ep_degree", a.ep_rule}, {"model_family", a.family_rule}};
  j["availability"] = a.gate;
  for (const DispatcherOption& o : a.options)
    j["dispatchers"].push_back({{"dispatcher", to_string(o.dispatcher)},
                                {"available", o.available},
                                {"fits", o.fits},
                                {"ep_overlap", o.best.ep_overlap},
                                {"delay_wgrad", o.best.delay_wgrad},
                                {"step_time_s", o.best.step_time_s},
                                {"peak_memory_gb", o.best.peak_memory_gb}});
  for (const Tip& t : a.tuning) j["tuning"].push_back({{"topic", t.topic}, {"advice", t.advice}, {"overrides", t.overrides}});
  j["harness_ab"] = a.harness_ab;
  j["epx_ab"] = a.epx_ab;
  return j;
}

}  // namespace epx
