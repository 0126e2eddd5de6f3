#include "epx/plan/search.hpp"

#include <algorithm>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "epx/check/pipeline_split.hpp"
#include "epx/config/schema.hpp"

namespace epx {
namespace {

std::vector<int> powers_of_two_up_to(Int limit) {
  std::vector<int> out;
  for (int v = 1; v <= limit; v *= 2) out.push_back(v);
  return out;
}

// The overrides that change a value of `given` (the rest restate it).
std::vector<std::string> changes(const Config& given, const std::vector<std::string>& overrides) {
  // A key set twice (a reset, then the split's fix) counts as its last value.
  Config all = given;
  std::vector<std::pair<std::string, std::string>> last;  // key, its last override, in first-set order
  for (const std::string& o : overrides) {
    apply_override(all, o);
    const std::string key = o.substr(0, o.find('='));
    const auto known = std::find_if(last.begin(), last.end(), [&](const auto& k) { return k.first == key; });
    if (known == last.end()) last.emplace_back(key, o);
    else known->second = o;
  }
  std::vector<std::string> out;
  for (const auto& [key, o] : last) {
    const FieldInfo* f = find_field(key);
    if (f == nullptr || YAML::Dump(f->get(all)) != YAML::Dump(f->get(given))) out.push_back(o);
  }
  return out;
}

}  // namespace

SearchResult search_layouts(const Config& loaded, const OptString& flex_flag, int keep) {
  // The config's own values first, as epx plan refuses them (-ng 0, -gb 0, -ep 0): each
  // candidate's refusal is skipped below, which would hide them.
  (void)resolve_config(loaded, flex_flag);
  const ModelConfig& m = loaded.model;
  const Int world = loaded.target.num_gpus.value_or(1);
  const Int per_node = gpus_per_node(loaded).value_or(world) > 0 ? gpus_per_node(loaded).value_or(world) : world;
  const Int experts = m.num_moe_experts.value_or(1);
  SearchResult result;
  std::vector<SearchRow> rows;
  // TP inside a node and dividing the heads; PP dividing the layers; EP dividing the experts.
  for (int tp : powers_of_two_up_to(std::min(per_node, world)))
    for (int pp : powers_of_two_up_to(std::min<Int>(world, m.num_layers)))
      for (int vpp : {1, 2, 4})
        for (int cp : {1, 2})
          for (int ep : powers_of_two_up_to(std::min(experts, world)))
            for (int mbs : {1, 2})
              for (bool full : {false, true}) {
                if (m.num_attention_heads % tp != 0 || pp * vpp > m.num_layers + 2 || experts % ep != 0) continue;
                if ((pp == 1) != (vpp == 1) || world % (tp * cp * pp) != 0 || world % (ep * pp) != 0) continue;
                if (m.seq_length % (2 * cp) != 0) continue;
                ++result.layouts_tried;
                std::vector<std::string> layout = {
                    fmt::format("model.tensor_model_parallel_size={}", tp),
                    fmt::format("model.pipeline_model_parallel_size={}", pp),
                    vpp > 1 ? fmt::format("model.virtual_pipeline_model_parallel_size={}", vpp)
                            : "model.virtual_pipeline_model_parallel_size=null",
                    fmt::format("model.context_parallel_size={}", cp),
                    fmt::format("model.expert_model_parallel_size={}", ep),
                    "model.expert_tensor_parallel_size=1",
                    fmt::format("train.micro_batch_size={}", mbs),
                    "model.sequence_parallel=" + std::string(tp > 1 ? "true" : "false"),
                    // The even split first, replacing a layout or uneven stages; where the layers do
                    // not split so, the check's own fix at this PP and VPP (the embedding and loss
                    // counted, uneven first / last stages, or a layout), as a user would apply it.
                    "model.pipeline_model_parallel_layout=null", "model.num_layers_in_first_pipeline_stage=null",
                    "model.num_layers_in_last_pipeline_stage=null", "model.account_for_embedding_in_pipeline_split=false",
                    "model.account_for_loss_in_pipeline_split=false"};
                if (pp > 1 && m.num_layers % (pp * vpp) != 0) {
                  ModelConfig even = m;
                  even.pipeline_model_parallel_size = pp;
                  even.virtual_pipeline_model_parallel_size = vpp > 1 ? OptInt(vpp) : std::nullopt;
                  even.pipeline_model_parallel_layout = std::nullopt;
                  even.num_layers_in_first_pipeline_stage = even.num_layers_in_last_pipeline_stage = std::nullopt;
                  even.account_for_embedding_in_pipeline_split = even.account_for_loss_in_pipeline_split = false;
                  const std::vector<std::string> fix = pipeline_split_fix(even);
                  if (fix.empty() || fix.front().starts_with("model.virtual_pipeline_model_parallel_size")) continue;
                  layout.insert(layout.end(), fix.begin(), fix.end());
                }
                if (full) {
                  const std::vector<std::string> recompute = full_recompute_overrides(loaded);
                  layout.insert(layout.end(), recompute.begin(), recompute.end());
                } else if (m.recompute_granularity == std::optional<std::string>("full")) {
                  layout.push_back("model.recompute_granularity=null");
                }
                // Each dispatcher and schedule is its own config: the check decides what is legal.
                // Without token exchanges (a dense model, EP 1) they change nothing: one config.
                const bool exchanges = moe_layers_in(m, 0, m.num_layers) > 0 && ep > 1;
                const std::vector<const char*> dispatchers =
                    exchanges ? std::vector<const char*>{"alltoall", "deepep", "hybridep"} : std::vector<const char*>{"alltoall"};
                const std::vector<std::pair<bool, bool>> schedules =
                    exchanges ? std::vector<std::pair<bool, bool>>{{false, false}, {true, false}, {true, true}}
                              : std::vector<std::pair<bool, bool>>{{false, false}};
                for (const char* dispatcher : dispatchers)
                  for (auto [overlap, delay] : schedules) {
                    std::vector<std::string> o = layout;
                    if (std::string(dispatcher) == "alltoall") {
                      o.push_back("model.moe_token_dispatcher_type=alltoall");
                    } else {
                      o.push_back("model.moe_token_dispatcher_type=flex");
                      o.push_back(fmt::format("model.moe_flex_dispatcher_backend={}", dispatcher));
                    }
                    o.push_back(fmt::format("comm_overlap.overlap_moe_expert_parallel_comm={}", overlap));
                    o.push_back(fmt::format("comm_overlap.delay_wgrad_compute={}", delay));
                    Config c = loaded;
                    std::optional<CheckReport> report;
                    try {
                      for (const std::string& text : o) apply_override(c, text);
                      ++result.configs_checked;
                      report = run_check(c, flex_flag);
                    } catch (const ConfigError&) {
                      continue;  // a combination the config cannot hold (the check's own refusal)
                    }
                    if (!report->ok()) continue;
                    ++result.passed_check;
                    result.unchecked.insert(report->unchecked.begin(), report->unchecked.end());
                    const Plan p = make_plan(report->resolved);  // a rate the hardware lacks: the user's to fix
                    result.gpu = p.gpu;
                    if (!p.fits) continue;
                    ++result.fit;
                    for (const Variant& v : p.variants)
                      if (v.as_configured) rows.push_back({o, v});
                  }
              }
  // Faster first (step times in steps of 0.1%, whatever their size: a proxy's step is a
  // millisecond); on a tie, the one that holds less memory. A config within 5% of the GPU's
  // memory ranks after every one with room: what the count leaves out (the CUDA context, NCCL's
  // buffers, fragmentation) may not fit beside it.
  const GpuInfo gpu = result.gpu;
  const auto step_bucket = [](double s) { return std::llround(std::log(std::max(s, 1e-12)) / std::log1p(1e-3)); };
  const auto key = [&](const SearchRow& r) {
    return std::tuple{tight_fit(r.variant.peak_memory_gb, gpu), step_bucket(r.variant.step_time_s),
                      r.variant.peak_memory_gb};
  };
  std::sort(rows.begin(), rows.end(), [&](const SearchRow& a, const SearchRow& b) { return key(a) < key(b); });
  if (rows.size() > static_cast<std::size_t>(keep)) rows.resize(static_cast<std::size_t>(keep));
  for (SearchRow& row : rows) row.overrides = changes(loaded, row.overrides);  // only the rows shown
  result.top = std::move(rows);
  if (result.top.size() >= 2) {
    // The terms of the step that differ between the two.
    const SearchRow &a = result.top[0], &b = result.top[1];
    const double d = b.variant.step_time_s - a.variant.step_time_s;
    if (step_bucket(a.variant.step_time_s) == step_bucket(b.variant.step_time_s))
      result.why = fmt::format("the best and the next tie on step time ({:.4g} s); the best holds {:.1f} GiB less",
                               a.variant.step_time_s, b.variant.peak_memory_gb - a.variant.peak_memory_gb);
    else
      result.why = fmt::format(
        "the best is {:.3g} s faster per step than the next: compute {:+.3g} s, exposed communication {:+.3g} s, "
        "pipeline bubble {:+.3g} s (the next minus the best); peak memory {:.1f} against {:.1f} GiB",
        d, b.variant.compute_s - a.variant.compute_s, b.variant.exposed_comm_s - a.variant.exposed_comm_s, b.variant.bubble_s - a.variant.bubble_s,
        a.variant.peak_memory_gb, b.variant.peak_memory_gb);
  }
  return result;
}

std::string format_search(const SearchResult& r) {
  std::string out = fmt::format("searched {} layouts, {} configs: {} pass epx check, {} fit in memory\n", r.layouts_tried,
                                r.configs_checked, r.passed_check, r.fit);
  bool tight = false;
  for (std::size_t i = 0; i < r.top.size(); ++i) {
    const Variant& v = r.top[i].variant;
    const bool t = tight_fit(v.peak_memory_gb, r.gpu);
    tight = tight || t;
    out += fmt::format("{:2}. {:>7} s  {:6.1f} TFLOP/s/GPU  {:8.0f} tokens/s/GPU  {:5.1f} GiB{}  {:<13}  {}\n", i + 1,
                       fmt::format("{:.4g}", v.step_time_s), v.tflops_per_gpu, v.tokens_per_s_per_gpu, v.peak_memory_gb,
                       t ? "*" : " ", v.wall,
                       fmt::join(r.top[i].overrides, " "));
  }
  if (tight)
    out += fmt::format("* within 5% of the GPU's {:.0f} GiB: what the count leaves out (the CUDA context, NCCL's buffers, "
                       "fragmentation) may not fit\n",
                       r.gpu.rates.memory_gb);
  if (!r.why.empty()) out += "why: " + r.why + "\n";
  // Version-gated rules pass unjudged: a ranked config may still fail one on the target.
  for (const std::string& u : r.unchecked) out += "unchecked " + u + " (a ranked config may fail it)\n";
  if (r.top.empty()) out += "no layout passes the check and fits; see epx check and the memory of epx plan\n";
  return out;
}

nlohmann::json search_json(const SearchResult& r) {
  nlohmann::json top = nlohmann::json::array();
  for (const SearchRow& row : r.top) {
    nlohmann::json v = variant_json(row.variant);
    // A row is its candidate config as planned: the plan's own "as configured" and row override
    // would describe the candidate against itself.
    for (const char* key : {"as_configured", "override", "refusal"}) v.erase(key);
    v["overrides"] = row.overrides;
    v["tight_fit"] = tight_fit(row.variant.peak_memory_gb, r.gpu);
    top.push_back(v);
  }
  return {{"layouts_tried", r.layouts_tried}, {"configs_checked", r.configs_checked}, {"passed_check", r.passed_check},
          {"fit", r.fit}, {"top", top}, {"why", r.why}, {"unchecked", r.unchecked}};
}

}  // namespace epx
