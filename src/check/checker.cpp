// Running the checker: resolve the config as Bridge would, evaluate the rule table, report.
#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "epx/base/edit_distance.hpp"
#include "epx/check/check.hpp"
#include "epx/check/flex_backend.hpp"
#include "epx/config/mixed_precision.hpp"
#include "epx/config/schema.hpp"

namespace epx {
namespace {

void check_versions(const Config& cfg) {
  // Reject unreadable versions up front, naming the field (unusable input).
  for (const auto& [key, value] : {std::pair{"target.torch_version", cfg.target.torch_version},
                                   std::pair{"target.te_version", cfg.target.te_version}}) {
    if (!value) continue;
    try {
      version_at_least(*value, "0");
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}: {}", cfg.cite(key), e.what()));
    }
  }
}

// Sizes beyond any machine, and counts below their least meaningful value (a model of zero
// width, a negative parallel size), are unusable input, refused before the rules multiply or
// divide by them: a product of three parallel sizes then stays well inside 64 bits.
void check_size_ranges(const Config& cfg) {
  constexpr Int kMaxParallel = Int{1} << 20, kMaxCount = Int{1} << 24;
  constexpr Int kMaxSms = 1024;  // a GPU's SMs: 132 on H100, 148 on B200 (epx's DeepEP cuts num_sms / 2 chunks)
  struct Range {
    const char* key;
    Int min, max;
    bool zero_is_unset = false;
  };
  // The shape's num_layers, hidden_size and num_attention_heads may be 0: not given (a
  // parallelism-only config); moe_router_topk's low end is the rule moe.topk_range's.
  const Range ranges[] = {
      {"model.tensor_model_parallel_size", 1, kMaxParallel},
      {"model.pipeline_model_parallel_size", 1, kMaxParallel},
      {"model.virtual_pipeline_model_parallel_size", 1, kMaxParallel},
      {"model.microbatch_group_size_per_vp_stage", 1, kMaxParallel},
      {"model.context_parallel_size", 1, kMaxParallel},
      {"model.expert_model_parallel_size", 1, kMaxParallel},
      {"model.expert_tensor_parallel_size", 1, kMaxParallel},
      {"model.num_layers", 0, kMaxParallel, true},
      {"model.num_layers_in_first_pipeline_stage", 1, kMaxParallel},
      {"model.num_layers_in_last_pipeline_stage", 1, kMaxParallel},
      {"model.hidden_size", 0, kMaxCount, true},
      {"model.num_attention_heads", 0, kMaxParallel, true},
      {"model.num_query_groups", 1, kMaxParallel},
      {"model.kv_channels", 1, kMaxCount},
      {"model.ffn_hidden_size", 1, kMaxCount},
      {"model.seq_length", 1, kMaxCount},
      {"model.vocab_size", 1, kMaxCount},
      {"model.make_vocab_size_divisible_by", 1, kMaxCount},
      {"model.num_moe_experts", 1, kMaxParallel},
      {"model.moe_ffn_hidden_size", 1, kMaxCount},
      {"model.moe_shared_expert_intermediate_size", 1, kMaxCount},
      {"model.moe_router_topk", -kMaxParallel, kMaxParallel},
      {"model.moe_router_num_groups", 0, kMaxParallel},
      {"model.q_lora_rank", 1, kMaxCount},
      {"model.kv_lora_rank", 1, kMaxCount},
      {"model.qk_head_dim", 1, kMaxCount},
      {"model.qk_pos_emb_head_dim", 0, kMaxCount},
      {"model.v_head_dim", 1, kMaxCount},
      {"model.moe_flex_dispatcher_num_sms", 1, kMaxSms},
      {"model.moe_deepep_num_sms", 1, kMaxSms},
      {"model.moe_hybridep_num_sms", 1, kMaxSms},
      {"model.moe_hybridep_num_sms_preprocessing", 1, kMaxSms},
      {"model.mtp_num_layers", 0, kMaxParallel},
      {"model.recompute_num_layers", 0, kMaxParallel},
      {"ddp.bucket_size", 1, Int{1} << 40},
      {"comm_overlap.bucket_size", 1, Int{1} << 40},
      {"comm_overlap.wgrad_deferral_limit", -1, kMaxCount},  // -1: Bridge's "no limit"
      {"train.eval_iters", 0, kMaxCount},
      {"model.moe_router_group_topk", 0, kMaxParallel},
      {"target.num_gpus", 1, kMaxCount},
      {"target.gpus_per_node", 1, kMaxCount},
      {"train.train_iters", 1, kMaxCount},
      {"train.train_samples", 1, Int{1} << 40},
      {"scheduler.lr_warmup_iters", 0, kMaxCount},
      {"scheduler.lr_decay_iters", 1, kMaxCount},
      {"scheduler.max_steps", 1, kMaxCount},
      {"scheduler.lr_warmup_samples", 0, Int{1} << 40},
      {"scheduler.lr_decay_samples", 1, Int{1} << 40},
      {"train.global_batch_size", 1, kMaxCount},
      {"train.micro_batch_size", 1, kMaxCount}};
  for (const auto& [key, min, max, zero_is_unset] : ranges) {
    const std::string text = field_text(cfg, key);
    if (text == "null") continue;
    const Int v = std::stoll(text);  // the schema stored an integer: it reads back
    if (v > max)
      throw ConfigError(fmt::format("{}={} is out of range: at most {} (beyond any real run)",
                                    cfg.cite(key), v, max));
    if (v < min)
      throw ConfigError(fmt::format("{}={} is out of range: it must be at least {}{}", cfg.cite(key),
                                    v, min, zero_is_unset ? " (0: not given)" : ""));
  }
  // The shape is given whole or not at all: one 0 beside the others is a size left out, which
  // the FLOPs, the memory and the runtime all need.
  const ModelConfig& m = cfg.model;
  const std::pair<const char*, Int> shape[] = {
      {"model.num_layers", m.num_layers}, {"model.hidden_size", m.hidden_size}, {"model.num_attention_heads", m.num_attention_heads}};
  const auto given = std::count_if(std::begin(shape), std::end(shape), [](const auto& f) { return f.second > 0; });
  if (given > 0 && given < 3)
    for (const auto& [key, v] : shape)
      if (v == 0)
        throw ConfigError(fmt::format("{}=0 (not given) while the model's other sizes are: a model shape needs "
                                      "num_layers, hidden_size and num_attention_heads all set; set {} to the model's "
                                      "size (or all three to 0 for a parallelism-only check)",
                                      cfg.cite(key), key));
}

// Rates, coefficients and scales outside what they can mean (a negative learning rate or weight
// decay, an Adam beta of 1 or more) are unusable input too; torch's Adam refuses the optimizer's
// the same way.
void check_real_ranges(const Config& cfg) {
  struct Range {
    const char* key;
    bool positive;    // > 0, else >= 0
    bool below_one;   // and < 1
  };
  const Range ranges[] = {{"model.layernorm_epsilon", true, false},
                          {"model.init_method_std", false, false},
                          {"model.moe_z_loss_coeff", false, false},
                          {"model.mtp_loss_scaling_factor", false, false},
                          {"model.moe_router_topk_scaling_factor", true, false},
                          {"model.moe_router_bias_update_rate", false, false},
                          {"optimizer.lr", false, false},
                          {"optimizer.min_lr", false, false},
                          {"optimizer.weight_decay", false, false},
                          {"optimizer.adam_beta1", false, true},
                          {"optimizer.adam_beta2", false, true},
                          {"optimizer.adam_eps", false, false},
                          {"optimizer.clip_grad", false, false},
                          {"scheduler.lr_warmup_init", false, false},
                          {"scheduler.lr_warmup_fraction", false, false}};
  for (const auto& [key, positive, below_one] : ranges) {
    const std::string text = field_text(cfg, key);
    if (text == "null") continue;
    const double v = std::strtod(text.c_str(), nullptr);  // a finite number (stod throws on a subnormal)
    if ((positive ? v > 0 : v >= 0) && (!below_one || v < 1)) continue;
    throw ConfigError(fmt::format("{}={} is out of range: it must be {}{}", cfg.cite(key), text,
                                  positive ? "above 0" : "at least 0", below_one ? " and below 1" : ""));
  }
  for (double base : cfg.model.rotary_base.values)
    if (!(base > 0))
      throw ConfigError(fmt::format("{}={} is out of range: every base must be above 0", cfg.cite("model.rotary_base"),
                                    field_text(cfg, "model.rotary_base")));
  for (double coeff : cfg.model.moe_aux_loss_coeff.values)
    if (!(coeff >= 0))
      throw ConfigError(fmt::format("{}={} is out of range: every coefficient must be at least 0",
                                    cfg.cite("model.moe_aux_loss_coeff"), field_text(cfg, "model.moe_aux_loss_coeff")));
  if (const double ema = cfg.model.moe_router_quantile_balancing_ema; !(ema >= 0 && ema <= 1))
    throw ConfigError(fmt::format("{}={} is out of range: an EMA weight is between 0 and 1",
                                  cfg.cite("model.moe_router_quantile_balancing_ema"), ema));
  // A negative capacity factor is Megatron-Core's dropless (finalize makes it None); 0 drops every token.
  if (cfg.model.moe_expert_capacity_factor == 0.0)
    throw ConfigError(fmt::format("{}=0.0 is out of range: it drops every token; set a factor above 0, or null "
                                  "(or a negative one) for dropless",
                                  cfg.cite("model.moe_expert_capacity_factor")));
}

// A Bridge dump's unmodelled fields are kept and ignored, so a misspelt one (moe_router_top_k)
// leaves the field it meant at its default. Of the 601 fields of Megatron-Core's and Bridge's
// config dataclasses (TransformerConfig, ModelParallelConfig, OptimizerConfig, DDP, Bridge's
// training, comm-overlap, mixed-precision and GPT / DeepSeek providers), these are the ones this
// close to a modelled field.
const std::vector<std::string> kRealNearMisses = {"fp4", "fp4_param", "fp4_recipe",
                                                  // SchedulerConfig's derived step counts (in samples)
                                                  "lr_decay_steps", "lr_warmup_steps", "wd_incr_steps", "wsd_decay_steps"};

void flag_misspelt_fields(const Config& user, std::vector<Finding>& findings) {
  const YAML::Node& kept = user.extra_fields.node;
  if (!kept.IsMap()) return;
  for (const auto& section : kept) {
    if (!section.second.IsMap()) continue;
    const std::string sec = section.first.as<std::string>();
    for (const auto& field : section.second) {
      const std::string name = field.first.as<std::string>(), key = sec + "." + name;
      if (name.starts_with("_") ||
          std::find(kRealNearMisses.begin(), kRealNearMisses.end(), name) != kRealNearMisses.end())
        continue;
      for (const FieldInfo& f : schema()) {
        if (f.section != sec || edit_distance(name, f.name) > (f.name.size() < 8 ? 1u : 2u)) continue;
        const std::string value = field.second.IsNull() ? "null" : YAML::Dump(field.second);
        findings.push_back({"config.misspelt_field", Severity::warning,
                            {{key, value}, {f.key(), field_text(user, f.key())}},
                            fmt::format("{} is kept but not modelled, so {} stays as it is: misspelt?", key, f.key()),
                            field.second.IsScalar() ? fmt::format("{}={} ~{}", f.key(), value, key) : ""});
        break;
      }
    }
  }
}

std::string value_text(const Config& cfg, const std::string& key) {
  if (key.starts_with("env_vars.")) {
    auto it = cfg.env_vars.find(key.substr(9));
    return it == cfg.env_vars.end() ? "unset" : it->second;
  }
  if (find_field(key)) return field_text(cfg, key);
  // A field a Bridge dump keeps without epx modelling it (a rule may read one).
  const auto dot = key.find('.');
  const YAML::Node n = cfg.extra_fields.child_map(key.substr(0, dot))[key.substr(dot + 1)];
  if (!n.IsDefined()) return "unset";
  return n.IsNull() ? "null" : YAML::Dump(n);
}

int severity_rank(Severity s) { return static_cast<int>(s); }

// "16 x h100", or what was assumed where the user gave no world size or GPU.
std::string target_text(const Config& cfg) {
  const auto& t = cfg.target;
  const GpuInfo& gpu = target_gpu(cfg);
  const std::string world = t.num_gpus ? std::to_string(*t.num_gpus) : "?";
  std::string text = fmt::format("{} x {}", world, gpu.named() ? gpu.name : "GPU");
  std::vector<std::string> assumed;
  if (!t.num_gpus) assumed.push_back("world size: not given");
  if (!gpu.named()) assumed.push_back("GPU: not given");
  if (!t.gpu && !gpu.cuda()) assumed.push_back("GPU: not given, cpu assumed");
  if (!assumed.empty()) text += fmt::format(" ({})", fmt::join(assumed, "; "));
  return text;
}

// A fix's override of a key that a harness flag set does nothing: the flag wins (as in the
// harness, where argparse overrides Hydra). Such a key's override is given as its flag (repeated
// flags take the last value, as argparse does); a key a flag only implies gets a note to drop it.
std::string fix_for_flags(const Config& user, const Config& resolved, const OptString& flex_backend_flag,
                          const std::string& fix) {
  // Bridge's mixed_precision replaces its keys after the overrides: a fix setting one drops the
  // group first and keeps the others at what the group set.
  const bool precision_group = mixed_precision_source(user).has_value();
  bool drop_precision_group = false;
  static const std::map<std::string, std::string> kFlagOf = [] {
    std::map<std::string, std::string> of = {
        {"model.virtual_pipeline_model_parallel_size", "-vp"},
        {"target.gpu", "-g"},
        {"model.cuda_graph_impl", "--cuda_graph_impl"},
        {"target.torch_version", "--torch-version"},
        {"target.te_version", "--te-version"},
        {"model.moe_flex_dispatcher_backend", "--moe_flex_dispatcher_backend"},
        {"model.pipeline_model_parallel_layout", "--pipeline_model_parallel_layout"}};
    for (const HarnessIntFlag& flag : kHarnessIntFlags) of.emplace(flag.key, flag.flag);
    return of;
  }();
  // Keys a flag sets beside its own: the flags to drop before the override can apply.
  static const std::vector<std::pair<std::string, std::string>> kImpliedBy = {
      {"model.sequence_parallel", "-tp"},
      {"model.cuda_graph_scope", "--cuda_graph_scope"},
      {"comm_overlap.overlap_moe_expert_parallel_comm", "--moe_a2a_overlap true"},
      {"comm_overlap.delay_wgrad_compute", "--moe_a2a_overlap true"},
      {"model.moe_shared_expert_overlap", "--moe_a2a_overlap true"},
      {"model.moe_token_dispatcher_type", "--moe_flex_dispatcher_backend"}};
  std::vector<std::string> out, drop;
  for (std::size_t at = 0; at < fix.size();) {
    const std::size_t end = std::min(fix.find(' ', at), fix.size());
    std::string token = fix.substr(at, end - at);
    at = end + 1;
    const auto eq = token.find('=');
    const std::string key = eq == std::string::npos ? "" : token.substr(0, eq);
    if (precision_group && std::find(kMixedPrecisionKeys.begin(), kMixedPrecisionKeys.end(), key) != kMixedPrecisionKeys.end())
      drop_precision_group = true;
    // The flex backend flag selects the flex dispatcher after the overrides: alltoall is the flag's None.
    if (token == "model.moe_token_dispatcher_type=alltoall" && flex_backend_flag && *flex_backend_flag != "None") {
      out.push_back("--moe_flex_dispatcher_backend None");
      continue;
    }
    if (key.empty() || !user.set_on_command_line(key) || user.explicit_keys.at(key) != Config::Origin::flag) {
      out.push_back(std::move(token));
      continue;
    }
    std::string value = token.substr(eq + 1);
    if (value.size() >= 2 && value.front() == '\'' && value.back() == '\'') value = value.substr(1, value.size() - 2);
    // null is the harness's None only for -vp and the backend flag.
    if (const auto flag = kFlagOf.find(key);
        flag != kFlagOf.end() && (value != "null" || flag->second == "-vp" || flag->second.ends_with("backend"))) {
      const bool quote = value.find_first_of("|*()") != std::string::npos;  // a layout, for the shell
      out.push_back(fmt::format("{} {}", flag->second, value == "null" ? "None" : quote ? "'" + value + "'" : value));
      continue;
    }
    out.push_back(std::move(token));
    std::string by = kFlagOf.contains(key) ? kFlagOf.at(key) : "";
    if (key.starts_with("model.recompute_"))  // -rl sets full recompute, --recompute_modules selective
      by = user.model.recompute_granularity.value_or("") == "selective" ? "--recompute_modules" : "-rl";
    for (const auto& [prefix, flag] : kImpliedBy)
      if (by.empty() && key.starts_with(prefix)) by = flag;
    if (!by.empty() && std::find(drop.begin(), drop.end(), by) == drop.end()) drop.push_back(by);
  }
  if (drop_precision_group) {
    std::vector<std::string> kept = {"mixed_precision=None"};
    for (const std::string& key : kMixedPrecisionKeys)
      if (fix.find(key + "=") == std::string::npos) kept.push_back(key + "=" + field_text(resolved, key));
    out.insert(out.begin(), kept.begin(), kept.end());
  }
  std::string text = fmt::format("{}", fmt::join(out, " "));
  if (!drop.empty())
    text += fmt::format(" (without {}: a harness flag wins over overrides)", fmt::join(drop, ", "));
  return text;
}

}  // namespace

const char* to_string(Severity s) {
  switch (s) {
    case Severity::error: return "error";
    case Severity::warning: return "warning";
    case Severity::advice: return "advice";
  }
  return "?";
}

int CheckReport::count(Severity s) const {
  return static_cast<int>(std::count_if(findings.begin(), findings.end(),
                                        [s](const Finding& f) { return f.severity == s; }));
}

Config resolve_config(const Config& loaded, const OptString& flex_backend_flag,
                      std::vector<Finding>* findings) {
  std::vector<Finding> local;
  std::vector<Finding>& out = findings ? *findings : local;
  Config cfg = loaded;
  const GpuInfo& gpu = target_gpu(cfg);
  check_versions(cfg);
  check_size_ranges(cfg);
  check_real_ranges(cfg);
  // Bridge's order: the harness applies the backend, runtime_config_update finalizes, then
  // ConfigContainer.validate() runs the flex backend validation; the harness sets HybridEP's
  // topology environment.
  if (flex_backend_flag && *flex_backend_flag != "None")
    apply_flex_dispatcher_backend(cfg, *flex_backend_flag, gpu, out);
  FinalizeOptions options;
  options.have_te = gpu.cuda() && cfg.target.te_version.value_or("") != "none";
  for (auto& f : finalize(cfg, options)) out.push_back(std::move(f));
  validate_flex_dispatcher_backend(cfg, out);
  apply_hybridep_topology_env(cfg, gpu);
  return cfg;
}

CheckReport run_check(const Config& loaded, const OptString& flex_backend_flag) {
  CheckReport report;
  report.user = loaded;
  report.ignored_note = ignored_note(loaded);
  report.resolved = resolve_config(loaded, flex_backend_flag, &report.findings);
  const CheckContext ctx{report.user, report.resolved, target_gpu(report.resolved)};

  for (const Rule& rule : rules()) {
    if (!rule.check) continue;
    const Outcome o = rule.check(ctx);
    if (o.kind == Outcome::unknown) {
      report.unchecked.push_back(fmt::format("{}: {}", rule.id, o.message));
    } else if (o.kind == Outcome::fail) {
      report.findings.push_back({rule.id, rule.severity, {}, o.message, o.fix});
    }
  }
  flag_misspelt_fields(report.user, report.findings);
  for (Finding& f : report.findings) f.fix = fix_for_flags(report.user, report.resolved, flex_backend_flag, f.fix);
  // Values as resolved, for every field the rule reads (resolve-step findings carry their own).
  for (Finding& f : report.findings) {
    if (!f.values.empty()) continue;
    const Rule* rule = find_rule(f.rule_id);
    for (std::string key : rule->fields) {
      // Without a comm_overlap section the switch is the model's own field (Megatron-Core's path).
      if (key.starts_with("comm_overlap.") && !report.resolved.comm_overlap &&
          find_field("model." + key.substr(13)))
        key = "model." + key.substr(13);
      f.values.emplace_back(key, value_text(report.resolved, key));
    }
  }
  std::stable_sort(report.findings.begin(), report.findings.end(),
                   [](const Finding& a, const Finding& b) {
                     return severity_rank(a.severity) < severity_rank(b.severity);
                   });
  return report;
}

std::string format_report(const CheckReport& r) {
  std::string out;
  if (!r.ignored_note.empty()) out += r.ignored_note + "\n";
  for (const Finding& f : r.findings) {
    std::vector<std::string> values;
    for (const auto& [k, v] : f.values) values.push_back(k + "=" + shorten(v, 120));  // a long list's start (--json has it all)
    out += fmt::format("{:<7} {} {}{}", to_string(f.severity), f.rule_id,
                       values.empty() ? "" : fmt::format("[{}] ", fmt::join(values, " ")), f.message);
    if (!f.fix.empty()) out += fmt::format(" | fix: {}", f.fix);
    out += "\n";
  }
  for (const auto& u : r.unchecked) out += fmt::format("unchecked {}\n", u);
  const int errors = r.count(Severity::error), warnings = r.count(Severity::warning),
            advice = r.count(Severity::advice);
  out += fmt::format("verdict: {} ({} error{}, {} warning{}, {} advice{}) for {} on {}\n",
                     r.ok() ? "PASS" : "FAIL", errors, errors == 1 ? "" : "s", warnings,
                     warnings == 1 ? "" : "s", advice,
                     r.unchecked.empty() ? "" : fmt::format(", {} unchecked", r.unchecked.size()),
                     r.user.source, target_text(r.resolved));
  return out;
}

nlohmann::json report_json(const CheckReport& r) {
  nlohmann::json findings = nlohmann::json::array();
  for (const Finding& f : r.findings) {
    nlohmann::json values = nlohmann::json::object();
    for (const auto& [k, v] : f.values) values[k] = v;
    const Rule* rule = find_rule(f.rule_id);
    findings.push_back({{"id", f.rule_id},
                        {"severity", to_string(f.severity)},
                        {"fields", values},
                        {"message", f.message},
                        {"fix", f.fix},
                        {"source", rule ? rule->source : ""}});
  }
  const auto& t = r.resolved.target;
  const GpuInfo& gpu = target_gpu(r.resolved);
  const auto or_null = [](const auto& v) { return v ? nlohmann::json(*v) : nlohmann::json(); };
  return {{"config", r.user.source},
          {"target",
           {{"gpu", gpu.named() ? nlohmann::json(gpu.name) : nlohmann::json()},
            {"gpu_given", t.gpu.has_value()},
            {"num_gpus", or_null(t.num_gpus)},
            {"nodes", or_null(num_nodes(r.resolved))}}},
          {"findings", findings},
          {"unchecked", r.unchecked},
          {"ignored", r.ignored_note},
          {"errors", r.count(Severity::error)},
          {"warnings", r.count(Severity::warning)},
          {"advice", r.count(Severity::advice)},
          {"verdict", r.ok() ? "pass" : "fail"}};
}

std::string format_rule_table() {
  std::string out = fmt::format("{:<40} {:<8} {:<46} {}\n", "id", "severity", "source", "summary");
  for (const Rule& r : rules()) {
    out += fmt::format("{:<40} {:<8} {:<46} {}\n", r.id, to_string(r.severity), r.source, r.summary);
    out += fmt::format("{:<40} {:<8} reads: {}\n", "", "", fmt::join(r.fields, ", "));
  }
  out += fmt::format("{} rules\n", rules().size());
  return out;
}

nlohmann::json rule_table_json() {
  nlohmann::json table = nlohmann::json::array();
  for (const Rule& r : rules())
    table.push_back({{"id", r.id},
                     {"severity", to_string(r.severity)},
                     {"fields", r.fields},
                     {"source", r.source},
                     {"summary", r.summary},
                     {"stage", r.check ? "check" : "resolve"}});
  return table;
}

}  // namespace epx
