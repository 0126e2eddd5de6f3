// Hydra-style dotted overrides and the performance harness's flags.
#include <algorithm>
#include <cctype>
#include <filesystem>

#include <fmt/format.h>

#include "epx/config/config.hpp"
#include "epx/base/to_lower.hpp"
#include "epx/config/schema.hpp"

namespace epx {
namespace {

std::string did_you_mean(const std::string& key) {
  auto options = suggest_keys(key);
  if (options.empty()) return "";
  return fmt::format(" (did you mean {}?)", fmt::join(options, " or "));
}

constexpr std::size_t kMaxOverrideBytes = 64 << 10;

// The value side of `key=value`, read as YAML so lists, quotes and null work as in Hydra.
YAML::Node parse_value(const std::string& key, const std::string& text) {
  // A plain word or number is the scalar YAML would make of it: no parser (`plan --search`
  // applies tens of thousands of overrides).
  const bool plain = !text.empty() && text.front() != '.' &&
                     std::all_of(text.begin(), text.end(), [](char ch) {
                       return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.';
                     });
  if (plain && text != "null" && text != "Null" && text != "NULL") return YAML::Node(text);
  YAML::Node node;
  try {
    node = YAML::Load(text);
  } catch (const YAML::Exception&) {
    return YAML::Node(text);  // not YAML on its own: take the text literally
  }
  check_yaml_bounds(node, "the value of " + key);
  return node;
}

// Keys outside the schema: env_vars.NAME and fields of kept Bridge sections.
bool apply_free_key(Config& cfg, const std::string& key, const std::string& section,
                    const std::string& name, bool adding, bool deleting,
                    const std::string& value) {
  if (section == "env_vars") {
    if (name.empty()) throw ConfigError("env_vars needs a variable name: env_vars.NAME=value");
    const bool exists = cfg.env_vars.count(name) > 0;
    if (deleting) {
      if (!exists) throw ConfigError(fmt::format("cannot delete {}: it is not set", key));
      cfg.env_vars.erase(name);
    } else if (!exists && !adding) {
      throw ConfigError(fmt::format("{} is not set; add it with +{}={}", key, key, value));
    } else {
      cfg.env_vars[name] = value;
    }
    return true;
  }
  // ConfigContainer.mixed_precision takes a recipe's name (or None), which finalize applies.
  if (section == "mixed_precision") {
    cfg.file_locations.erase(key);  // no longer the file's
    // A field of a recipe's name: Hydra cannot add a key under a string, and a mapping of one
    // field would take every other field's default.
    const YAML::Node group = static_cast<const YAML::Node&>(cfg.extra_sections.node)["mixed_precision"];
    if (!name.empty() && group.IsDefined() && group.IsScalar())
      throw ConfigError(fmt::format("{}: mixed_precision is the recipe name '{}', which has no fields to set; give "
                                    "mixed_precision=NAME for another recipe, or all its fields as a YAML mapping in "
                                    "the config file",
                                    key, group.Scalar()));
  }
  if (section == "mixed_precision" && name.empty() && !deleting) {
    const YAML::Node v = parse_value(key, value);
    if (!v.IsScalar() && !v.IsNull())
      throw ConfigError(fmt::format("{}: mixed_precision takes a recipe's name (bf16_mixed, "
                                    "bf16_with_fp8_current_scaling_mixed, ...) or None",
                                    key));
    cfg.extra_sections.node[section] = v;
    return true;
  }
  // Unmodelled fields of a Megatron-Bridge dump's tagged section (model.fp8, ...), kept as the
  // groups' are: Bridge takes any of its dataclass's fields there.
  const YAML::Node& tagged = cfg.extra_fields.node;  // const: yaml-cpp's mutable [] would insert
  const auto& modelled = schema_sections();
  if (!name.empty() && std::find(modelled.begin(), modelled.end(), section) != modelled.end() &&
      tagged[section].IsDefined() && tagged[section].IsMap()) {
    YAML::Node fields = cfg.extra_fields.node[section];
    const bool exists = static_cast<const YAML::Node&>(fields)[name].IsDefined();
    cfg.file_locations.erase(key);  // a refusal of the value names the override, not the file's line
    if (deleting) {
      if (!fields.remove(name)) throw ConfigError(fmt::format("cannot delete {}: no such key", key));
    } else if (!exists && !adding) {
      throw ConfigError(fmt::format("{} is not a field epx models{}; to add it to the dump's {} anyway: +{}={}", key,
                                    did_you_mean(key), section, key, value));
    } else {
      fields[name] = parse_value(key, value);
    }
    return true;
  }
  // Look up through a const view: yaml-cpp's mutable operator[] would insert the key.
  const YAML::Node& kept = cfg.extra_sections.node;
  const auto& bridge = bridge_only_sections();
  const bool present = kept[section].IsDefined(), group = present && kept[section].IsMap();
  if (!group && std::find(bridge.begin(), bridge.end(), section) != bridge.end()) {  // absent, or null (peft: null)
    if (deleting && present && name.empty()) {
      cfg.extra_sections.node.remove(section);
      return true;
    }
    if (deleting) throw ConfigError(fmt::format("cannot delete {}: the config has no {} group", key, section));
    if (!adding || name.empty())
      throw ConfigError(fmt::format("{}: the config has no {} group (Megatron-Bridge's, kept but not modelled by epx); "
                                    "add a key to it with +{}.KEY=VALUE",
                                    key, section, section));
    cfg.extra_sections.node[section] = YAML::Node(YAML::NodeType::Map);  // +dataset.x=1 starts the group
  }
  YAML::Node sec = kept[section];
  if (!sec.IsDefined() || !sec.IsMap()) return false;
  cfg.file_locations.erase(key);
  if (deleting) {
    if (name.empty()) {
      cfg.extra_sections.node.remove(section);
    } else if (!sec.remove(name)) {
      throw ConfigError(fmt::format("cannot delete {}: no such key", key));
    }
    return true;
  }
  if (!static_cast<const YAML::Node&>(sec)[name].IsDefined() && !adding)
    throw ConfigError(fmt::format("{} does not exist; add it with +{}={}", key, key, value));
  sec[name] = parse_value(key, value);
  return true;
}

}  // namespace

void apply_override(Config& cfg, const std::string& text, Config::Origin origin) {
  if (text.size() > kMaxOverrideBytes)
    throw ConfigError(fmt::format("override '{}' is {} bytes long; an override is key=value and "
                                  "at most {} KiB",
                                  shorten(text), text.size(), kMaxOverrideBytes >> 10));
  std::string body = text;
  bool adding = false, forcing = false, deleting = false;
  if (body.starts_with("++")) {
    adding = forcing = true;
    body.erase(0, 2);
  } else if (body.starts_with("+")) {
    adding = true;
    body.erase(0, 1);
  } else if (body.starts_with("~")) {
    deleting = true;
    body.erase(0, 1);
  }
  const auto eq = body.find('=');
  std::string key = body.substr(0, eq);
  const std::string value = eq == std::string::npos ? "" : body.substr(eq + 1);
  if (key.empty())
    throw ConfigError(fmt::format("cannot read override '{}': expected key=value, +key=value or "
                                  "~key",
                                  text));
  if (!deleting && eq == std::string::npos) {
    std::error_code ec;
    if (key.find('/') != std::string::npos || std::filesystem::is_regular_file(key, ec))  // a second file
      throw ConfigError(fmt::format("'{}' after the config is a file, not an override (key=value): an option takes "
                                    "one file per occurrence (--hardware a.yaml --hardware b.yaml), and the config "
                                    "is one",
                                    text));
    throw ConfigError(fmt::format("override '{}' has no value: write {}=VALUE (or ~{} to reset "
                                  "it to the default)",
                                  text, key, key));
  }
  if (deleting && eq != std::string::npos)
    throw ConfigError(fmt::format("override '{}': a deletion takes no value, write ~{}", text, key));

  const auto dot = key.find('.');
  const std::string section = key.substr(0, dot);
  const std::string name = dot == std::string::npos ? "" : key.substr(dot + 1);

  // Whole-section forms: ~comm_overlap, comm_overlap=null.
  if (section == "comm_overlap" && name.empty()) {
    if (deleting || to_lower(value) == "none" || parse_value(key, value).IsNull()) {  // Bridge's comm_overlap=None
      cfg.comm_overlap.reset();
      return;
    }
    throw ConfigError("comm_overlap can only be set to null as a whole; set its fields with "
                      "comm_overlap.FIELD=VALUE");
  }

  if (const FieldInfo* f = find_field(key)) {
    // Hydra's + adds a key: on one that already holds a value (not None) it refuses a scalar
    // ("Could not append to config"), as Bridge's override parser does; ++ sets it either way.
    if (adding && !forcing && !f->get(cfg).IsNull() && parse_value(f->key(), value).IsScalar())
      throw ConfigError(fmt::format("override '{}': {} already holds a value, and Hydra's + only adds a key (Bridge "
                                    "refuses it: 'Could not append to config'); write {}={} (or ++{}={})",
                                    shorten(text), f->key(), f->key(), shorten(value), f->key(), shorten(value)));
    std::erase(cfg.none_moe_fields, f->key());
    if (deleting) {
      f->reset(cfg);
      cfg.explicit_keys.erase(f->key());
      cfg.file_locations.erase(f->key());
      return;
    }
    const YAML::Node node = parse_value(f->key(), value);
    if (!(cfg.is_bridge_dump() && take_none_moe_field(cfg, f->key(), node))) f->set(cfg, node);
    cfg.explicit_keys[f->key()] = origin;
    cfg.file_locations.erase(f->key());
    return;
  }
  if (apply_free_key(cfg, key, section, name, adding, deleting, value)) {
    // Set or removed here, an environment variable is the user's: the harness's flags leave it.
    if (section == "env_vars") cfg.explicit_keys[key] = origin;
    return;
  }
  throw ConfigError(fmt::format("override '{}': unknown key '{}'{}", shorten(text), shorten(key),
                                did_you_mean(key)));
}

void apply_harness_flags(Config& cfg, const HarnessFlags& f) {
  auto set = [&](const std::string& key, const std::string& value) {
    apply_override(cfg, key + "=" + value, Config::Origin::flag);
  };
  auto set_int = [&](const std::string& key, const OptInt& v) {
    if (v) set(key, std::to_string(*v));
  };
  for (const HarnessIntFlag& flag : kHarnessIntFlags) set_int(flag.key, f.*flag.value);
  if (f.tp) set("model.sequence_parallel", *f.tp > 1 ? "true" : "false");  // as the harness sets it
  if (f.vp && *f.vp != "-1") set("model.virtual_pipeline_model_parallel_size", *f.vp);  // None: null
  if (f.pipeline_layout) set("model.pipeline_model_parallel_layout", "'" + *f.pipeline_layout + "'");
  if (f.gpu) set("target.gpu", *f.gpu);
  if (f.cuda_graph_impl) {
    set("model.cuda_graph_impl", *f.cuda_graph_impl);
    // The harness's _set_cuda_graph_overrides: graphs need TE's RNG tracker.
    const std::string tracker = *f.cuda_graph_impl != "none" ? "true" : "false";
    set("model.use_te_rng_tracker", tracker);
    set("rng.te_rng_tracker", tracker);
  }
  // The harness's set_cuda_graph_overrides: with graphs off the scope is not read; full_iteration
  // stands alone and captures the whole step (set_full_iteration_cuda_graph), never with TE's
  // per-layer graphs.
  if (f.cuda_graph_scope && cfg.model.cuda_graph_impl == "none") {
    // ignored, as the harness returns before reading it
  } else if (f.cuda_graph_scope && f.cuda_graph_scope->find("full_iteration") != std::string::npos) {
    if (*f.cuda_graph_scope != "full_iteration")
      throw ConfigError(fmt::format("--cuda_graph_scope {}: full_iteration cannot be combined with other scopes (the "
                                    "harness raises); give --cuda_graph_scope full_iteration alone",
                                    *f.cuda_graph_scope));
    if (cfg.model.cuda_graph_impl == "transformer_engine")
      throw ConfigError("--cuda_graph_scope full_iteration cannot use cuda_graph_impl=transformer_engine (the harness "
                        "raises); add --cuda_graph_impl local");
    set("model.cuda_graph_impl", "full_iteration");
    set("model.cuda_graph_modules", "[]");
    set("model.cuda_graph_scope", "[]");
  } else if (f.cuda_graph_scope) {
    set("model.cuda_graph_scope", "'" + *f.cuda_graph_scope + "'");
  }
  if (f.recompute_num_layers && f.recompute_modules)
    throw ConfigError("-rl (full recompute) and --recompute_modules (selective recompute) "
                      "conflict: give one of them");
  if (f.recompute_num_layers) {  // -rl: full recompute, block method
    set("model.recompute_granularity", "full");
    set("model.recompute_method", "block");
    set_int("model.recompute_num_layers", f.recompute_num_layers);
  }
  if (f.recompute_modules) {
    set("model.recompute_granularity", "selective");
    set("model.recompute_modules", "'" + *f.recompute_modules + "'");
  }
  if (f.moe_flex_dispatcher_backend && *f.moe_flex_dispatcher_backend == "None") {
    set("model.moe_flex_dispatcher_backend", "null");
    set("model.moe_token_dispatcher_type", "alltoall");
  }
  // --moe_a2a_overlap true: EP overlap and delayed wgrad on, shared-expert overlap off, creating
  // comm_overlap (TP overlap only when TP > 1) if the recipe has none. false changes nothing.
  if (f.moe_a2a_overlap && *f.moe_a2a_overlap) {
    if (!cfg.comm_overlap) {
      cfg.comm_overlap.emplace();
      cfg.comm_overlap->tp_comm_overlap = cfg.model.tensor_model_parallel_size > 1;
    }
    set("comm_overlap.overlap_moe_expert_parallel_comm", "true");
    set("comm_overlap.delay_wgrad_compute", "true");
    set("model.moe_shared_expert_overlap", "false");
  }
}

}  // namespace epx
