// Megatron-Bridge's mixed-precision recipes (training/mixed_precision.py) and their setup.
#include "epx/config/mixed_precision.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {
namespace {

// The fields of MixedPrecisionConfig that epx models, at the dataclass's defaults.
struct Precision {
  bool bf16 = false, fp16 = false;
  OptString fp8;
  std::string fp8_recipe = "tensorwise";
  bool fp8_param_gather = false;
  bool grad_reduce_in_fp32 = true;
  OptString fp4;
};

Precision bf16() {
  Precision p;
  p.bf16 = true;
  return p;
}
Precision fp16() {
  Precision p;
  p.fp16 = true;
  p.grad_reduce_in_fp32 = false;
  return p;
}
Precision with_fp8(Precision p, const char* format, const char* recipe, bool param_gather) {
  p.fp8 = format;
  p.fp8_recipe = recipe;
  p.fp8_param_gather = param_gather;
  return p;
}

// MIXED_PRECISION_RECIPES, by name (underscores; Bridge also takes hyphens).
const std::vector<std::pair<std::string, Precision>>& recipes() {
  static const std::vector<std::pair<std::string, Precision>> all = [] {
    Precision nvfp4 = bf16();
    nvfp4.fp4 = "e2m1";
    return std::vector<std::pair<std::string, Precision>>{
        {"bf16_mixed", bf16()},
        {"fp16_mixed", fp16()},
        {"bf16_with_fp8_delayed_scaling_mixed", with_fp8(bf16(), "hybrid", "delayed", true)},
        {"fp16_with_fp8_delayed_scaling_mixed", with_fp8(fp16(), "hybrid", "delayed", true)},
        {"bf16_with_mxfp8_mixed", with_fp8(bf16(), "e4m3", "mxfp8", true)},
        {"fp16_with_mxfp8_mixed", with_fp8(fp16(), "e4m3", "mxfp8", true)},
        {"bf16_with_fp8_current_scaling_mixed", with_fp8(bf16(), "hybrid", "tensorwise", true)},
        {"nemotron_h_bf16_with_fp8_current_scaling_mixed", with_fp8(bf16(), "hybrid", "tensorwise", true)},
        {"nanov2_bf16_with_fp8_current_scaling_mixed", with_fp8(bf16(), "hybrid", "blockwise", true)},
        {"fp16_with_fp8_current_scaling_mixed", with_fp8(fp16(), "hybrid", "tensorwise", true)},
        {"bf16_with_fp8_subchannel_scaling_mixed", with_fp8(bf16(), "hybrid", "blockwise", false)},
        {"fp16_with_fp8_subchannel_scaling_mixed", with_fp8(fp16(), "hybrid", "blockwise", false)},
        {"bf16_with_nvfp4_mixed", nvfp4},
        {"nemotron_3_super_bf16_with_nvfp4_mixed", nvfp4}};
  }();
  return all;
}

// The recipe named so (hyphens as underscores, as get_mixed_precision_config); `at` says where.
Precision recipe(std::string name, const std::string& at) {
  std::replace(name.begin(), name.end(), '-', '_');
  const auto& all = recipes();
  const auto found = std::find_if(all.begin(), all.end(), [&](const auto& r) { return r.first == name; });
  if (found != all.end()) return found->second;
  std::vector<std::string> names;
  for (const auto& r : all) names.push_back(r.first);
  std::sort(names.begin(), names.end());
  throw ConfigError(
      fmt::format("{}: Unknown mixed-precision recipe '{}'. Available recipes: {}.", at, name, fmt::join(names, ", ")));
}

// Where the group or one of its fields was read: the file and line, or the override's key.
std::string where(const Config& c, const std::string& key) {
  const auto at = c.file_locations.find(key);
  return at == c.file_locations.end() ? "override " + key : at->second + ": " + key;
}

bool is_null(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return true;
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  return s == "None" || s == "null" || s == "~";
}

bool read_bool(const Config& c, const YAML::Node& group, const char* field, bool fallback) {
  const YAML::Node n = group[field];
  if (!n.IsDefined()) return fallback;
  bool value = false;  // YAML's spellings (true, yes, on, ...), and 1 / 0 as OmegaConf takes them
  if (n.IsScalar() && (YAML::convert<bool>::decode(n, value) || n.Scalar() == "1" || n.Scalar() == "0"))
    return n.Scalar() == "1" || (n.Scalar() != "0" && value);
  throw ConfigError(fmt::format("{} expects a bool (true|false), got {}", where(c, fmt::format("mixed_precision.{}", field)),
                                n.IsScalar() ? n.Scalar() : "a list or mapping"));
}

OptString read_string(const Config& c, const YAML::Node& group, const char* field, OptString fallback) {
  const YAML::Node n = group[field];
  if (!n.IsDefined()) return fallback;
  if (is_null(n)) return std::nullopt;
  if (!n.IsScalar())
    throw ConfigError(fmt::format("{} expects a string, got a list or mapping", where(c, fmt::format("mixed_precision.{}", field))));
  return n.Scalar();
}

// A MixedPrecisionConfig written out field by field (a dump after runtime_config_update).
Precision read_fields(const Config& c, const YAML::Node& group) {
  Precision p;
  p.bf16 = read_bool(c, group, "bf16", p.bf16);
  p.fp16 = read_bool(c, group, "fp16", p.fp16);
  p.fp8 = read_string(c, group, "fp8", p.fp8);
  p.fp8_recipe = read_string(c, group, "fp8_recipe", p.fp8_recipe).value_or(p.fp8_recipe);
  // The model's choices (schema.cpp), which these fields replace.
  const auto choose = [&](const char* field, const std::string& v, std::initializer_list<const char*> choices) {
    if (std::find(choices.begin(), choices.end(), v) == choices.end())
      throw ConfigError(fmt::format("{} must be one of {}, got '{}'", where(c, fmt::format("mixed_precision.{}", field)),
                                    fmt::join(choices, "|"), v));
  };
  if (p.fp8) choose("fp8", *p.fp8, {"e4m3", "hybrid"});
  choose("fp8_recipe", p.fp8_recipe, {"tensorwise", "delayed", "mxfp8", "blockwise", "custom"});
  // MixedPrecisionConfig's __setattr__ keeps fp8_param and fp8_param_gather equal, and its
  // __init__ sets fp8_param_gather last: the dataclass's fp8_param is always fp8_param_gather's.
  p.fp8_param_gather = read_bool(c, group, "fp8_param_gather", p.fp8_param_gather);
  p.grad_reduce_in_fp32 = read_bool(c, group, "grad_reduce_in_fp32", p.grad_reduce_in_fp32);
  p.fp4 = read_string(c, group, "fp4", p.fp4);
  return p;
}

YAML::Node group_of(const Config& c) { return static_cast<const YAML::Node&>(c.extra_sections.node)["mixed_precision"]; }

// The group's precision: the named recipe's, or its fields'.
Precision group_precision(const Config& c, const YAML::Node& group) {
  if (group.IsScalar()) return recipe(group.Scalar(), where(c, "mixed_precision"));
  if (group.IsMap()) return read_fields(c, group);
  throw ConfigError(fmt::format("{} must be a recipe name (bf16_mixed, ...) or a mapping of MixedPrecisionConfig fields",
                                where(c, "mixed_precision")));
}

// What set the group, for messages: a recipe's name, the harness's -c (epx's own `_source_` key),
// or its fields.
std::string group_name(const YAML::Node& group) {
  if (group.IsScalar()) return group.Scalar();
  const YAML::Node source = group["_source_"];
  return source.IsDefined() && source.IsScalar() ? source.Scalar() : "its fields";
}

}  // namespace

OptString mixed_precision_source(const Config& c) {
  const YAML::Node group = group_of(c);
  if (is_null(group)) return std::nullopt;
  const std::string name = group_name(group);
  return group.IsScalar() ? "mixed_precision=" + name : name.starts_with("-c") ? name : "mixed_precision (its fields)";
}

OptString mixed_precision_fp4(const Config& c) {
  const YAML::Node group = group_of(c);
  return is_null(group) ? std::nullopt : group_precision(c, group).fp4;
}

void apply_mixed_precision(Config& c, std::vector<Finding>& out) {
  const YAML::Node group = group_of(c);
  if (is_null(group)) return;
  const Precision p = group_precision(c, group);
  const std::string name = group_name(group);
  if (p.fp4 && p.fp8)
    throw ConfigError(fmt::format("{}: fp4 and fp8 cannot be used simultaneously. Please choose one.",
                                  where(c, "mixed_precision")));
  const bool fp8_param = p.fp8_param_gather;  // kept equal by MixedPrecisionConfig
  if (p.fp4)
    out.push_back(Finding{"mixed_precision.fp4_not_modelled", Severity::warning,
                          {{"mixed_precision", group_name(group)}, {"mixed_precision.fp4", *p.fp4}},
                          fmt::format("mixed_precision ({}) trains in FP4 ({}), which epx does not model: it checks and "
                                      "plans the run as BF16",
                                      name, *p.fp4),
                          ""});

  // update_config_with_precision_overrides: each field replaces the model's (and the DDP's).
  ModelConfig& m = c.model;
  std::vector<std::pair<std::string, std::string>> changed;  // the user's keys it changes, as "key=value"
  const auto set = [&](const std::string& key, auto& field, const auto& value, const std::string& old_text,
                       const std::string& new_text) {
    if (field == value) return;
    if (c.set_on_command_line(key)) changed.emplace_back(key + "=" + old_text, new_text);
    field = value;
  };
  const auto text = [](const OptString& s) { return s.value_or("null"); };
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  set("model.bf16", m.bf16, p.bf16, flag(m.bf16), flag(p.bf16));
  set("model.fp16", m.fp16, p.fp16, flag(m.fp16), flag(p.fp16));
  set("model.fp8", m.fp8, p.fp8, text(m.fp8), text(p.fp8));
  set("model.fp8_recipe", m.fp8_recipe, OptString(p.fp8_recipe), text(m.fp8_recipe), p.fp8_recipe);
  set("model.fp8_param", m.fp8_param, fp8_param, flag(m.fp8_param), flag(fp8_param));
  set("ddp.grad_reduce_in_fp32", c.ddp.grad_reduce_in_fp32, p.grad_reduce_in_fp32, flag(c.ddp.grad_reduce_in_fp32),
      flag(p.grad_reduce_in_fp32));
  if (changed.empty()) return;
  std::vector<std::pair<std::string, std::string>> values = {
      {"mixed_precision", group_name(group)}};
  std::vector<std::string> what;
  for (const auto& [was, now] : changed) {
    const auto eq = was.find('=');
    values.emplace_back(was.substr(0, eq), was.substr(eq + 1));
    what.push_back(fmt::format("{} -> {}", was, now));
  }
  out.push_back(Finding{"mixed_precision.overwrites_model", Severity::warning, std::move(values),
                        fmt::format("Bridge applies mixed_precision ({}) over the model's precision fields before "
                                    "anything else reads them: {}; set the precision through {}",
                                    name, fmt::join(what, ", "), name.starts_with("-c") ? "-c" : "mixed_precision"),
                        ""});
}

YAML::Node mixed_precision_recipe(const std::string& name) {
  const Precision p = recipe(name, "mixed precision");
  const auto text = [](const OptString& s) { return s ? YAML::Node(*s) : YAML::Node(YAML::NodeType::Null); };
  YAML::Node n(YAML::NodeType::Map);
  n["bf16"] = p.bf16;
  n["fp16"] = p.fp16;
  n["fp8"] = text(p.fp8);
  n["fp8_recipe"] = p.fp8_recipe;
  n["fp8_param_gather"] = p.fp8_param_gather;
  n["grad_reduce_in_fp32"] = p.grad_reduce_in_fp32;
  n["fp4"] = text(p.fp4);
  return n;
}

}  // namespace epx
