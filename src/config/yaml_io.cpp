// YAML in and out: epx recipes, `epx config show` dumps and Megatron-Bridge config dumps.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <map>
#include <ranges>
#include <regex>

#include <fmt/format.h>

#include "epx/base/to_lower.hpp"
#include "epx/config/config.hpp"
#include "epx/config/schema.hpp"

namespace epx {
namespace {

// Bounds on what a config may be, so that a hostile or broken file is refused quickly with a
// message rather than parsed for minutes: a Megatron-Bridge dump is a few tens of kilobytes,
// a few thousand values, nested four or five levels.
constexpr int kMaxDepth = 32;
constexpr std::size_t kMaxValues = 20000;  // counted with aliases expanded (copies expand them)
constexpr Int kMaxDumpedDataParallel = Int{1} << 24;  // check's bound on target.num_gpus

// PyYAML's integer of a plain scalar, as OmegaConf reads Megatron-Bridge's YAML files (YAML 1.1):
// 0b binary, 0 octal (010 is 8), 0x hex, ':' base 60, '_' between digits. Nothing where YAML 1.1
// reads no integer or the value passes 64 bits.
std::optional<Int> yaml11_int(std::string_view s) {
  static const std::regex form(R"([-+]?(0b[01_]+|0[0-7_]+|0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|[1-9][0-9_]*(:[0-5]?[0-9])+))");
  if (s.size() > 100 || !std::regex_match(s.begin(), s.end(), form)) return std::nullopt;
  std::string digits(s);
  std::erase(digits, '_');
  const bool negative = digits.front() == '-';
  if (digits.front() == '-' || digits.front() == '+') digits.erase(0, 1);
  int base = 10;
  if (digits.starts_with("0b") || digits.starts_with("0x")) {
    base = digits[1] == 'b' ? 2 : 16;
    digits.erase(0, 2);
    if (digits.empty()) return std::nullopt;  // 0b_: PyYAML raises
  } else if (digits.size() > 1 && digits.front() == '0') {
    base = 8;
  }
  Int v = 0;
  for (const std::string_view part : std::views::split(std::string_view(digits), ':') | std::views::transform([](auto r) {
                                       return std::string_view(r.begin(), r.end());
                                     })) {
    Int p = 0;  // a base-60 digit, or the whole number
    if (part.empty() || std::from_chars(part.data(), part.data() + part.size(), p, base).ec != std::errc()) return std::nullopt;
    if (__builtin_mul_overflow(v, Int{60}, &v) || __builtin_add_overflow(v, p, &v)) return std::nullopt;
  }
  return static_cast<Int>(negative ? -v : v);
}

// The decimal text of a plain scalar YAML 1.1 reads as an integer written otherwise (010: 8).
std::optional<std::string> yaml11_decimal(const std::string& text) {
  const std::optional<Int> v = yaml11_int(text);
  if (!v || std::to_string(*v) == text) return std::nullopt;
  return std::to_string(*v);
}

// Rewrites the plain (unquoted) scalars that YAML 1.1 reads as integers in decimal, in place
// (their marks stay), so that a field reads what Megatron-Bridge reads from the file.
void read_yaml11_integers(YAML::Node node) {
  if (node.IsScalar()) {
    if (node.Tag() != "?") return;  // quoted: a string
    if (const std::optional<std::string> decimal = yaml11_decimal(node.Scalar())) node = *decimal;
    return;
  }
  if (node.IsMap())
    for (auto item : node) read_yaml11_integers(item.second);
  else if (node.IsSequence())
    for (auto item : node) read_yaml11_integers(item);
}

std::string location(const std::string& source, const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.is_null()) return source;
  return fmt::format("{}:{}:{}", source, m.line + 1, m.column + 1);
}

// YAML 1.1's merge key, as PyYAML (and so OmegaConf) reads it: `<<: *defaults` (or a list of
// mappings) adds their entries to the mapping it sits in, under its own keys, the first mapping
// listed first; merged mappings are merged themselves. The values stay the same nodes, so a
// message cites them where they are written. A quoted '<<' is a plain key.
void merge_keys(YAML::Node node, const std::string& source) {
  if (node.IsSequence()) {
    for (YAML::Node item : node) merge_keys(item, source);
    return;
  }
  if (!node.IsMap()) return;
  YAML::Node merged(YAML::NodeType::Undefined), merge_key;
  for (const auto& kv : node) {
    merge_keys(kv.second, source);
    if (kv.first.IsScalar() && kv.first.Scalar() == "<<" && kv.first.Tag() == "?") merged.reset(kv.second), merge_key.reset(kv.first);
  }
  if (!merged.IsDefined()) return;
  std::vector<YAML::Node> from;  // an empty list merges nothing
  if (merged.IsMap()) from.push_back(merged);
  if (merged.IsSequence())
    for (const YAML::Node& m : merged) from.push_back(m);
  if ((!merged.IsMap() && !merged.IsSequence()) ||
      std::any_of(from.begin(), from.end(), [](const YAML::Node& m) { return !m.IsMap(); }))
    throw ConfigError(fmt::format("{}: the merge key '<<' takes a mapping or a list of mappings (e.g. <<: *defaults, "
                                  "an anchor's alias); quote it ('<<') for a key of that name",
                                  location(source, merge_key)));
  node.remove(merge_key);
  // PyYAML's order (flatten_mapping): the merged mappings' entries, the last listed first, then
  // the mapping's own; a key keeps the place of its first entry and takes its last (so its value
  // and its mark, for messages): the own keys win, then the first mapping listed. By name
  // (check_yaml_bounds refused keys that are not scalars).
  std::vector<std::pair<YAML::Node, YAML::Node>> entries;
  std::map<std::string, std::size_t> place;
  const auto put = [&](const YAML::Node& key, const YAML::Node& value) {
    const auto [at, fresh] = place.emplace(key.Scalar(), entries.size());
    if (fresh)
      entries.emplace_back(key, value);
    else
      entries[at->second] = {key, value};
  };
  for (auto m = from.rbegin(); m != from.rend(); ++m)
    for (const auto& kv : *m) put(kv.first, kv.second);
  std::vector<YAML::Node> own;
  for (const auto& kv : node) put(kv.first, kv.second), own.push_back(kv.first);
  for (const YAML::Node& key : own) node.remove(key);  // by identity: these very nodes
  for (const auto& [key, value] : entries) node.force_insert(key, value);
}

// A field's value where it is written; an empty one (`key:` and nothing) has its mark at the
// next token, so it is cited at its key.
std::string location(const std::string& source, const YAML::Node& key, const YAML::Node& value) {
  const bool empty = value.IsNull() && !value.Mark().is_null() && !key.Mark().is_null() && value.Mark().line != key.Mark().line;
  return location(source, empty ? key : value);
}

std::string did_you_mean(const std::vector<std::string>& options) {
  if (options.empty()) return "";
  return fmt::format(" (did you mean {}?)", fmt::join(options, " or "));
}

std::vector<std::string> suggest_sections(const std::string& name) {
  std::vector<std::string> out;
  for (const auto& s : schema_sections())
    if (s.starts_with(name.substr(0, 3)) || name.starts_with(s.substr(0, 3))) out.push_back(s);
  if (out.empty())
    for (const auto& k : suggest_keys(name + ".x")) out.push_back(k.substr(0, k.find('.')));
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.size() > 3) out.resize(3);
  return out;
}

Config load_config_root(const YAML::Node& root, const std::string& source_name);

bool is_modelled_section(const std::string& s) {
  const auto& all = schema_sections();
  return std::find(all.begin(), all.end(), s) != all.end();
}

void load_section(Config& c, const std::string& sec, const YAML::Node& body) {
  if (sec == "comm_overlap") {
    if (body.IsNull()) {  // Bridge's comm_overlap=None
      c.comm_overlap.reset();
      return;
    }
    c.comm_overlap.emplace();
  }
  if (!body.IsMap())
    throw ConfigError(fmt::format("{}: section '{}' must be a mapping of field: value",
                                  location(c.source, body), sec));
  // Bridge dumps tag each dataclass with _target_; only there do unmodelled fields pass.
  const bool bridge_dump = body["_target_"].IsDefined();
  for (const auto& kv : body) {
    const std::string name = kv.first.as<std::string>();
    const std::string key = sec + "." + name;
    if (name.starts_with("_") || (bridge_dump && !find_field(key))) {
      // force_insert: no search of the fields kept so far, so a long section stays linear.
      if (!c.extra_fields.node[sec].IsMap()) c.extra_fields.node[sec] = YAML::Node(YAML::NodeType::Map);
      c.extra_fields.node[sec].force_insert(name, kv.second);
      c.file_locations[key] = location(c.source, kv.first, kv.second);  // a refusal of it names the line
      continue;
    }
    const FieldInfo* f = find_field(key);
    if (!f)
      throw ConfigError(fmt::format("{}: unknown key '{}'{}", location(c.source, kv.first), key,
                                    did_you_mean(suggest_keys(key))));
    if (bridge_dump && take_none_moe_field(c, key, kv.second)) {
      c.explicit_keys[key] = Config::Origin::file;
      c.file_locations[key] = location(c.source, kv.first, kv.second);
      continue;
    }
    try {
      f->set(c, kv.second);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}: {}", location(c.source, kv.first, kv.second), e.what()));
    }
    c.explicit_keys[f->key()] = Config::Origin::file;
    c.file_locations[f->key()] = location(c.source, kv.first, kv.second);
  }
}

}  // namespace

Config load_config_text(const std::string& text, const std::string& source_name) {
  try {
    return load_config_root(parse_yaml_bounded(text, source_name), source_name);
  } catch (const YAML::Exception& e) {  // e.g. a non-scalar key: still the file's fault
    throw ConfigError(fmt::format("{}:{}:{}: {}", source_name, e.mark.line + 1, e.mark.column + 1,
                                  e.msg));
  }
}

Config load_config_node(YAML::Node node, const std::string& source_name) {
  try {
    check_yaml_bounds(node, source_name);
    merge_keys(node, source_name);
    read_yaml11_integers(node);
    return load_config_root(node, source_name);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}:{}:{}: {}", source_name, e.mark.line + 1, e.mark.column + 1,
                                  e.msg));
  }
}

YAML::Node parse_yaml_bounded(const std::string& text, const std::string& source_name) {
  if (text.size() > kMaxConfigBytes)
    throw ConfigError(fmt::format("{}: more than the {} MiB a YAML input (a config, a hardware or probe file) may "
                                  "have; a Megatron-Bridge dump is a few tens of kilobytes",
                                  source_name, kMaxConfigBytes >> 20));
  YAML::Node root;
  try {
    // Every document, so that a second one (after `---`) is refused rather than silently dropped.
    // An empty one (a trailing `---`) is nothing.
    const std::vector<YAML::Node> documents = YAML::LoadAll(text);
    for (std::size_t k = 1; k < documents.size(); ++k)
      if (!documents[k].IsNull())
        throw ConfigError(fmt::format("{}:{}: a second YAML document (after '---' or '...'); epx reads one: merge "
                                      "them or split the file",
                                      source_name, documents[k].Mark().line + 1));
    if (!documents.empty()) root = documents.front();
  } catch (const YAML::ParserException& e) {
    throw ConfigError(fmt::format("{}:{}:{}: malformed YAML: {}", source_name, e.mark.line + 1,
                                  e.mark.column + 1, e.msg));
  }
  check_yaml_bounds(root, source_name);
  merge_keys(root, source_name);
  read_yaml11_integers(root);
  return root;
}

std::string read_config_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the file: {}", path.string(), std::strerror(errno)));
  std::string text(kMaxConfigBytes + 1, '\0');  // one byte more than allowed: too long is seen
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw ConfigError(fmt::format("{}: cannot read the file: {}", path.string(), std::strerror(errno)));
  text.resize(static_cast<std::size_t>(in.gcount()));
  return text;
}

namespace {

Config load_config_root(const YAML::Node& root, const std::string& source_name) {
  Config c;
  c.source = source_name;
  if (root.IsNull())
    throw ConfigError(fmt::format("{}: the file is empty; a config needs at least a model: "
                                  "section (see recipes/)",
                                  source_name));
  if (!root.IsMap())
    throw ConfigError(fmt::format("{}: a config must be a YAML mapping of sections "
                                  "(model:, comm_overlap:, train:, ...)",
                                  location(source_name, root)));
  for (const auto& kv : root) {
    const std::string sec = kv.first.as<std::string>();
    const YAML::Node& body = kv.second;
    if (sec == "env_vars") {
      if (body.IsNull()) continue;
      if (!body.IsMap())
        throw ConfigError(fmt::format("{}: env_vars must be a mapping NAME: value",
                                      location(source_name, body)));
      for (const auto& var : body) {
        if (!var.second.IsScalar())
          throw ConfigError(fmt::format("{}: env_vars.{} must be a scalar",
                                        location(source_name, var.second),
                                        var.first.as<std::string>()));
        c.env_vars[var.first.as<std::string>()] = var.second.Scalar();
      }
    } else if (is_modelled_section(sec)) {
      load_section(c, sec, body);
    } else if (sec.starts_with("_") ||
               std::find(bridge_only_sections().begin(), bridge_only_sections().end(), sec) !=
                   bridge_only_sections().end()) {
      c.extra_sections.node[sec] = body;
      if (sec == "mixed_precision") {  // read at finalize, from a copy without marks
        c.file_locations[sec] = location(source_name, body);
        if (body.IsMap())
          for (const auto& field : body) c.file_locations[sec + "." + field.first.Scalar()] = location(source_name, field.first, field.second);
      }
    } else {
      throw ConfigError(fmt::format("{}: unknown section '{}'{}; epx models {} and keeps "
                                    "Megatron-Bridge's other groups ({})",
                                    location(source_name, kv.first), sec,
                                    did_you_mean(suggest_sections(sec)),
                                    fmt::join(schema_sections(), ", "),
                                    fmt::join(bridge_only_sections(), ", ")));
    }
  }
  // A Bridge dump has no epx target section but may record its data-parallel size (Bridge
  // derives it at start-up): the world it was dumped for is then DP x TP x PP x CP.
  if (!c.target.num_gpus && c.comm_overlap && c.comm_overlap->data_parallel_size) {
    const ModelConfig& m = c.model;
    const Int dp = *c.comm_overlap->data_parallel_size;
    if (dp < 1 || dp > kMaxDumpedDataParallel)
      throw ConfigError(fmt::format("{}={} is out of range: a run's data-parallel size is 1 to {}",
                                    c.cite("comm_overlap.data_parallel_size"), dp, kMaxDumpedDataParallel));
    // The parallel sizes are range-checked later: a product past 64 bits is left for that check.
    Int world = dp;
    bool overflow = false;
    for (const Int size : {m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size})
      overflow = overflow || __builtin_mul_overflow(world, size, &world);
    if (!overflow && world >= 1) {
      c.target.num_gpus = world;
      if (auto it = c.file_locations.find("comm_overlap.data_parallel_size"); it != c.file_locations.end())
        c.file_locations["target.num_gpus"] = it->second;
    }
  }
  return c;
}

// Walks the document as a copy would (aliases expanded), stopping at the bounds.
void walk_within_bounds(const YAML::Node& node, const std::string& source, int depth,
                       std::size_t& values) {
  if (depth > kMaxDepth)
    throw ConfigError(fmt::format("{}: nested more than {} levels deep; a config is sections of "
                                  "fields with scalar or list values",
                                  location(source, node), kMaxDepth));
  if (++values > kMaxValues)
    throw ConfigError(fmt::format("{}: more than {} values (aliases counted as the copies they "
                                  "make); a config has a few thousand",
                                  location(source, node), kMaxValues));
  std::map<std::string, int> lines;  // a map's scalar keys, at their lines
  if (node.IsMap() || node.IsSequence())
    for (const auto& item : node) {
      if (node.IsMap() && !item.first.IsScalar())
        throw ConfigError(fmt::format("{}: a key that is {}; a key is a plain name", location(source, item.first),
                                      item.first.IsNull() ? "empty (null)" : "a list or mapping"));
      if (node.IsMap()) {
        const auto [at, fresh] = lines.emplace(item.first.Scalar(), item.first.Mark().line + 1);
        if (!fresh)
          throw ConfigError(fmt::format("{}: duplicate key '{}' (also at line {}); which value is meant is "
                                        "ambiguous, keep one",
                                        location(source, item.first), item.first.Scalar(), at->second));
      }
      if (node.IsMap()) {
        walk_within_bounds(item.first, source, depth + 1, values);
        walk_within_bounds(item.second, source, depth + 1, values);
      } else {
        walk_within_bounds(item, source, depth + 1, values);
      }
    }
}

}  // namespace

void check_yaml_bounds(const YAML::Node& root, const std::string& source) {
  std::size_t values = 0;
  walk_within_bounds(root, source, 0, values);
}

bool Config::is_bridge_dump() const {
  if (static_cast<const YAML::Node&>(extra_sections.node)["_target_"].IsDefined()) return true;
  for (const auto& sec : extra_fields.node)
    if (sec.second.IsMap() && sec.second["_target_"].IsDefined()) return true;
  return false;
}

Config load_config_file(const std::filesystem::path& path) {
  return load_config_text(read_config_text(path), path.string());
}

namespace {

// A value as the emitter writes it, quoted where read_yaml11_integers would read the plain text
// as another integer (a string '010'), so that a dump reads back the same.
// Whether PyYAML (YAML 1.1, as OmegaConf reads Bridge's files) reads `text` as something other
// than a string: a bool, a null or a number.
bool reads_as_non_string(const std::string& text) {
  static const std::vector<std::string> kWords = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~", "",
                                                  ".inf", "+.inf", "-.inf", ".nan"};
  const std::string lower = to_lower(text);
  if (std::find(kWords.begin(), kWords.end(), lower) != kWords.end() || yaml11_decimal(text)) return true;
  char* end = nullptr;
  std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size();
}

// `as_string`: the value of a string field, quoted where YAML would read it as another type.
void emit_value(YAML::Emitter& out, const YAML::Node& n, bool as_string = false) {
  if (n.IsScalar() && (yaml11_decimal(n.Scalar()) || (as_string && reads_as_non_string(n.Scalar())))) {
    out << YAML::DoubleQuoted << n.Scalar();
  } else if (n.IsSequence() && as_string) {
    if (n.Style() == YAML::EmitterStyle::Flow) out << YAML::Flow;
    out << YAML::BeginSeq;
    for (const YAML::Node& item : n) emit_value(out, item, true);
    out << YAML::EndSeq;
  } else {
    out << n;
  }
}

}  // namespace

std::string dump_yaml(const Config& cfg) {
  YAML::Emitter out;
  out.SetNullFormat(YAML::LowerNull);
  out << YAML::BeginMap;
  for (const auto& sec : schema_sections()) {
    out << YAML::Key << sec;
    if (sec == "comm_overlap" && !cfg.comm_overlap) {
      out << YAML::Value << YAML::Null;
      continue;
    }
    out << YAML::Value << YAML::BeginMap;
    for (const auto& f : schema())
      if (f.section == sec) {
        out << YAML::Key << f.name << YAML::Value;
        // Megatron tests the legacy cuda_graph_scope against None: an empty one is written as None,
        // as a dump after Megatron-Core's post-init has it.
        const bool none = std::find(cfg.none_moe_fields.begin(), cfg.none_moe_fields.end(), f.key()) != cfg.none_moe_fields.end() ||
                          (f.key() == "model.cuda_graph_scope" && cfg.model.cuda_graph_scope.empty());
        emit_value(out, none ? YAML::Node(YAML::NodeType::Null) : f.get(cfg),
                   f.type.starts_with("a string") || f.type.starts_with("a list of strings"));
      }
    for (const auto& kv : cfg.extra_fields.child_map(sec)) {
      out << YAML::Key << kv.first << YAML::Value;
      emit_value(out, kv.second);
    }
    out << YAML::EndMap;
  }
  out << YAML::Key << "env_vars" << YAML::Value << YAML::BeginMap;
  for (const auto& [k, v] : cfg.env_vars) {
    out << YAML::Key << k << YAML::Value;
    emit_value(out, YAML::Node(v));
  }
  out << YAML::EndMap;
  for (const auto& kv : cfg.extra_sections.node) {
    out << YAML::Key << kv.first << YAML::Value;
    emit_value(out, kv.second);
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string ignored_note(const Config& cfg) {
  std::vector<std::string> sections, fields;
  for (const auto& kv : cfg.extra_sections.node) {
    const std::string name = kv.first.as<std::string>();
    if (name.starts_with("_")) continue;
    // One field of it epx run reads (job_spec.cpp): the note says so.
    const bool nan_check = name == "rerun_state_machine" && kv.second.IsMap() && kv.second["check_for_nan_in_loss"].IsDefined();
    if (name == "mixed_precision") continue;  // applied by finalize (mixed_precision.cpp)
    sections.push_back(nan_check ? name + " (but its check_for_nan_in_loss, which epx run reads)" : name);
  }
  for (const auto& sec : cfg.extra_fields.node)
    for (const auto& kv : sec.second) {
      const std::string name = kv.first.as<std::string>();
      if (!name.starts_with("_")) fields.push_back(sec.first.as<std::string>() + "." + name);
    }
  if (sections.empty() && fields.empty()) return "";
  std::sort(fields.begin(), fields.end());  // stable across dump order
  std::string note = "note: kept but not modelled by epx (ignored):";
  if (!sections.empty()) note += fmt::format(" sections {}", fmt::join(sections, ", "));
  if (!fields.empty()) {
    constexpr size_t kShown = 12;
    note += fmt::format("{} {} field{} ", sections.empty() ? "" : ";", fields.size(),
                        fields.size() == 1 ? "" : "s");
    std::vector<std::string> shown(fields.begin(),
                                   fields.begin() + std::min(kShown, fields.size()));
    note += fmt::format("({}{})", fmt::join(shown, ", "), fields.size() > kShown ? ", ..." : "");
  }
  return note;
}

}  // namespace epx
