// The schema: one row per config field (section, name, type, allowed values, how to read and
// write it). YAML load/dump, dotted overrides, `epx config show` and the checker's field values
// all go through it, so a field is declared exactly once.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "epx/config/config.hpp"

namespace epx {

struct FieldInfo {
  std::string section;
  std::string name;
  std::string type;                  // human-readable: "int", "bool or null", ...
  std::vector<std::string> choices;  // allowed string values (empty: any)
  bool nullable = false;
  std::function<YAML::Node(const Config&)> get;             // null node when unset/absent
  std::function<void(Config&, const YAML::Node&)> set;      // throws ConfigError on bad type
  std::function<void(Config&)> reset;                       // back to Megatron's default

  std::string key() const { return section + "." + name; }
};

// Every field, in dump order.
const std::vector<FieldInfo>& schema();

// The modelled sections, in dump order ("model", "comm_overlap", ...; not env_vars).
const std::vector<std::string>& schema_sections();

// Megatron-Bridge's ConfigContainer groups epx does not model ("dataset", "logger", ...): kept
// and reported, not errors.
const std::vector<std::string>& bridge_only_sections();

// Field by dotted key, accepting the documented aliases (train.seed -> rng.seed, ...).
const FieldInfo* find_field(std::string_view key);

// Aliases: alias key -> canonical key.
const std::vector<std::pair<std::string, std::string>>& field_aliases();

// Up to three known keys closest to `key` (edit distance), for "did you mean" hints.
std::vector<std::string> suggest_keys(std::string_view key);

// Refuses (ConfigError, naming `source` and the line) a YAML document nested deeper or holding
// more values, aliases expanded, than a config can: bounds the work a bad file can cause.
void check_yaml_bounds(const YAML::Node& root, const std::string& source);

// What a YAML input may weigh: a Megatron-Bridge dump is a few tens of kilobytes.
inline constexpr std::size_t kMaxConfigBytes = 2 << 20;

// A YAML document of at most kMaxConfigBytes, within check_yaml_bounds; malformed YAML and oversize
// input are ConfigErrors naming `source_name` (and the line). Every YAML input epx reads (configs,
// hardware files) goes through these.
YAML::Node parse_yaml_bounded(const std::string& text, const std::string& source_name);
std::string read_config_text(const std::filesystem::path& path);

// A config from a node of a document parsed elsewhere (an `epx run --results` file's 'config'),
// within check_yaml_bounds, its merge keys and YAML 1.1 integers read as a file's (the caller
// bounds its bytes), its errors citing `source_name` at the node's marks.
Config load_config_node(YAML::Node node, const std::string& source_name);

// `text` cut to `max` characters (with how long it was), for quoting input in a message.
std::string shorten(std::string_view text, std::size_t max = 80);

// A node's value as YAML flow text, for messages and findings ("null", "true", "[a, b]").
std::string yaml_text(const YAML::Node& node);

// A None that Bridge's dense providers leave in an MoE-only field (Gemma4's moe_router_topk,
// Qwen3-VL's moe_token_dispatcher_type): in a Bridge dump it is recorded in
// Config::none_moe_fields, the field is set to its default, and a dump writes None back. Returns
// whether `value` was one.
bool take_none_moe_field(Config& cfg, const std::string& key, const YAML::Node& value);

// The current value of `key` in `cfg` as YAML flow text. Throws std::logic_error for an unknown
// key (a programming error: rule tables must name real fields).
std::string field_text(const Config& cfg, std::string_view key);

}  // namespace epx
