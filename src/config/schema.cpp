#include "epx/config/schema.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <tuple>
#include <type_traits>

#include <fmt/format.h>

#include "epx/base/edit_distance.hpp"
#include "epx/base/to_lower.hpp"

namespace epx {
namespace {

// ---- Scalar parsing shared by YAML files and command-line overrides -------------------------

[[noreturn]] void type_error(const std::string& key, const std::string& expected,
                             const YAML::Node& n) {
  throw ConfigError(fmt::format("{} expects {}, got {}", key, expected, shorten(yaml_text(n))));
}

// Megatron users write Python's None; YAML writes null or ~.
bool is_null(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return true;
  if (!n.IsScalar()) return false;
  const std::string s = to_lower(n.Scalar());
  return s == "none" || s == "null" || s == "~";
}

// A scalar's text. Only YAML's own null is refused here: "none" is a real value of some string
// fields (cuda_graph_impl, moe_router_load_balancing_type); optional fields test is_null first.
const std::string& scalar(const YAML::Node& n, const std::string& key, const std::string& what) {
  if (!n.IsScalar()) type_error(key, what, n);
  return n.Scalar();
}

void check_choice(const std::string& key, const std::string& v,
                  const std::vector<std::string>& choices) {
  if (choices.empty() || std::find(choices.begin(), choices.end(), v) != choices.end()) return;
  throw ConfigError(fmt::format("{} must be one of {}, got '{}'", key, fmt::join(choices, "|"),
                                shorten(v)));
}

std::optional<Int> parse_int(std::string_view s) {
  Int v = 0;
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

std::optional<double> parse_double(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;  // no nan, inf
  return v;
}

// Shortest text that reads back to the same double, always recognisable as a float.
std::string double_text(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) return s + ".0";
  if (auto e = s.find('e'); e != std::string::npos && s.find('.') == std::string::npos)
    s.insert(e, ".0");
  return s;
}

YAML::Node scalar_node(const std::string& s) { return YAML::Node(s); }

// ---- Codecs: one per C++ field type ---------------------------------------------------------

template <class T>
struct Codec;

template <>
struct Codec<bool> {
  static std::string type_name() { return "a bool (true|false)"; }
  static bool decode(const YAML::Node& n, const std::string& key, const std::vector<std::string>&) {
    const std::string s = to_lower(scalar(n, key, type_name()));
    if (s == "true" || s == "yes" || s == "on" || s == "1" || s == "t" || s == "y") return true;
    if (s == "false" || s == "no" || s == "off" || s == "0" || s == "f" || s == "n") return false;
    type_error(key, type_name(), n);
  }
  static YAML::Node encode(bool v) { return scalar_node(v ? "true" : "false"); }
};

template <>
struct Codec<Int> {
  static std::string type_name() { return "an integer"; }
  static Int decode(const YAML::Node& n, const std::string& key, const std::vector<std::string>&) {
    if (auto v = parse_int(scalar(n, key, type_name()))) return *v;
    type_error(key, type_name(), n);
  }
  static YAML::Node encode(Int v) { return scalar_node(std::to_string(v)); }
};

template <>
struct Codec<double> {
  static std::string type_name() { return "a finite number"; }
  static double decode(const YAML::Node& n, const std::string& key,
                       const std::vector<std::string>&) {
    if (auto v = parse_double(scalar(n, key, type_name()))) return *v;
    type_error(key, type_name(), n);
  }
  static YAML::Node encode(double v) { return scalar_node(double_text(v)); }
};

template <>
struct Codec<std::string> {
  static std::string type_name() { return "a string"; }
  static std::string decode(const YAML::Node& n, const std::string& key,
                            const std::vector<std::string>& choices) {
    const std::string& s = scalar(n, key, type_name());
    check_choice(key, s, choices);
    return s;
  }
  static YAML::Node encode(const std::string& v) { return scalar_node(v); }
};

// A list of names: a YAML sequence, or one string with commas (Bridge splits "a,b" the same way).
template <>
struct Codec<StringList> {
  static std::string type_name() { return "a list of strings"; }
  static StringList decode(const YAML::Node& n, const std::string& key,
                           const std::vector<std::string>& choices) {
    StringList out;
    // A Bridge dump writes an enum member (cuda_graph_modules' CudaGraphModule) as
    // {_target_: the enum, _call_: true, _args_: [value], _name_: member}: the member's name.
    const auto member = [](const YAML::Node& item) {
      return item.IsMap() && item["_target_"].IsDefined() && item["_name_"].IsDefined();
    };
    if (n.IsSequence()) {
      for (const auto& item : n) out.push_back(scalar(member(item) ? item["_name_"] : item, key, "a list of strings"));
    } else if (member(n)) {  // one member, not in a list (Megatron's field takes a single module)
      out.push_back(scalar(n["_name_"], key, "a list of strings"));
    } else if (is_null(n)) {
      // None: the list is empty (a dump after Megatron-Core's post-init has cuda_graph_scope: null).
    } else if (n.IsScalar()) {
      std::string s = n.Scalar();
      // Accept "[a, b]" typed as one scalar on a command line that YAML did not split.
      if (s.size() >= 2 && s.front() == '[' && s.back() == ']') s = s.substr(1, s.size() - 2);
      size_t start = 0;
      while (start <= s.size()) {
        size_t end = s.find(',', start);
        if (end == std::string::npos) end = s.size();
        std::string item = s.substr(start, end - start);
        item.erase(0, item.find_first_not_of(" \t'\""));
        item.erase(item.find_last_not_of(" \t'\"") + 1);
        if (!item.empty()) out.push_back(item);
        start = end + 1;
      }
    } else {
      type_error(key, type_name(), n);
    }
    for (const auto& item : out) check_choice(key, item, choices);
    return out;
  }
  static YAML::Node encode(const StringList& v) {
    YAML::Node n(YAML::NodeType::Sequence);
    for (const auto& s : v) n.push_back(s);
    return n;
  }
};

// One value, or a YAML list of them (Megatron's Union[T, List[T]]).
template <class T>
struct Codec<OneOrList<T>> {
  static std::string type_name() { return Codec<T>::type_name() + ", or a list of them"; }
  static OneOrList<T> decode(const YAML::Node& n, const std::string& key, const std::vector<std::string>& choices) {
    if (!n.IsSequence()) return OneOrList<T>(Codec<T>::decode(n, key, choices));
    std::vector<T> values;
    for (const auto& item : n) values.push_back(Codec<T>::decode(item, key, choices));
    if (values.empty())
      throw ConfigError(fmt::format("{} is an empty list; give one value or a list of at least one", key));
    return OneOrList<T>(std::move(values));
  }
  static YAML::Node encode(const OneOrList<T>& v) {
    if (!v.is_list) return Codec<T>::encode(v.values.front());
    YAML::Node n(YAML::NodeType::Sequence);
    for (const T& x : v.values) n.push_back(Codec<T>::encode(x));
    n.SetStyle(YAML::EmitterStyle::Flow);
    return n;
  }
};

// "([0]*3+[1]*58)", "([1]*3+[0]*1)*3" or "[1,1,0]" as Megatron-LM writes moe_layer_freq and
// window_attn_skip_freq (a Python list expression: lists and parenthesised sums, each repeated by
// `*n`, joined by `+`). Expanded, it is at most as long as the longest list a config may hold (a
// few bytes must not ask for gigabytes).
constexpr Int kMaxPatternLayers = 20000;

class LayerPatternParser {
 public:
  LayerPatternParser(std::string s, const std::string& key) : key_(key) {
    s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); }), s.end());
    s_ = std::move(s);
  }
  std::optional<std::vector<Int>> parse() {
    auto out = sum();
    if (!out || i_ != s_.size() || out->empty()) return std::nullopt;
    return out;
  }

 private:
  // term ('+' term)*
  std::optional<std::vector<Int>> sum() {
    auto out = term();
    while (out && i_ < s_.size() && s_[i_] == '+') {
      ++i_;
      auto more = term();
      if (!more) return std::nullopt;
      append(*out, *more, 1);
    }
    return out;
  }
  // atom ('*' n)?, atom: '[' ints ']' or '(' sum ')'
  std::optional<std::vector<Int>> term() {
    std::optional<std::vector<Int>> atom;
    if (i_ < s_.size() && s_[i_] == '(') {
      if (++depth_ > kMaxDepth) return std::nullopt;  // a scalar of a million '(' must not overflow the stack
      ++i_;
      atom = sum();
      --depth_;
      if (!atom || i_ >= s_.size() || s_[i_] != ')') return std::nullopt;
      ++i_;
    } else if (i_ < s_.size() && s_[i_] == '[') {
      const std::size_t close = s_.find(']', i_);
      if (close == std::string::npos) return std::nullopt;
      atom.emplace();
      const std::string_view body = std::string_view(s_).substr(i_ + 1, close - i_ - 1);
      for (std::size_t p = 0; p <= body.size();) {
        std::size_t comma = body.find(',', p);
        if (comma == std::string_view::npos) comma = body.size();
        const auto v = parse_int(body.substr(p, comma - p));
        if (!v) return std::nullopt;
        atom->push_back(*v);
        p = comma + 1;
      }
      i_ = close + 1;
    } else {
      return std::nullopt;
    }
    if (i_ < s_.size() && s_[i_] == '*') {
      std::size_t end = ++i_;
      while (end < s_.size() && std::isdigit(static_cast<unsigned char>(s_[end]))) ++end;
      const auto r = parse_int(std::string_view(s_).substr(i_, end - i_));
      if (!r || *r < 0) return std::nullopt;
      i_ = end;
      std::vector<Int> repeated;
      append(repeated, *atom, *r);
      return repeated;
    }
    return atom;
  }
  void append(std::vector<Int>& out, const std::vector<Int>& items, Int repeat) const {
    if (repeat > 0 && static_cast<Int>(items.size()) > (kMaxPatternLayers - static_cast<Int>(out.size())) / repeat)
      throw ConfigError(fmt::format("{}: the pattern expands to more than {} layers; write one entry per layer of "
                                    "the model",
                                    key_, kMaxPatternLayers));
    for (Int k = 0; k < repeat; ++k) out.insert(out.end(), items.begin(), items.end());
  }

  static constexpr int kMaxDepth = 32;  // as a config's nesting
  std::string s_;
  std::size_t i_ = 0;
  int depth_ = 0;
  const std::string& key_;
};

std::optional<std::vector<Int>> parse_layer_pattern(std::string s, const std::string& key) {
  return LayerPatternParser(std::move(s), key).parse();
}

template <>
struct Codec<LayerFreq> {
  static std::string type_name() {
    return "an integer, a list of 0/1 per layer, or a pattern like \"([0]*3+[1]*58)\"";
  }
  static LayerFreq decode(const YAML::Node& n, const std::string& key,
                             const std::vector<std::string>&) {
    LayerFreq f;
    if (n.IsSequence()) {
      for (const auto& item : n) f.pattern.push_back(Codec<Int>::decode(item, key, {}));
      if (f.pattern.empty())  // Megatron indexes the list per layer: an empty one is an IndexError
        throw ConfigError(fmt::format("{} is an empty list; give an integer, or one 0/1 per layer", key));
    } else if (n.IsScalar() && !is_null(n)) {
      if (auto v = parse_int(n.Scalar())) {
        f.every = *v;
      } else if (auto p = parse_layer_pattern(n.Scalar(), key)) {
        f.pattern = *p;
      } else {
        type_error(key, type_name(), n);
      }
    } else {
      type_error(key, type_name(), n);
    }
    for (Int v : f.pattern)
      if (v != 0 && v != 1) throw ConfigError(fmt::format("{} pattern entries must be 0 or 1", key));
    if (f.pattern.empty() && f.every < 1)
      throw ConfigError(fmt::format("{} must be >= 1, got {}", key, f.every));
    return f;
  }
  static YAML::Node encode(const LayerFreq& f) {
    if (f.pattern.empty()) return Codec<Int>::encode(f.every);
    YAML::Node n(YAML::NodeType::Sequence);
    for (Int v : f.pattern) n.push_back(v);
    n.SetStyle(YAML::EmitterStyle::Flow);
    return n;
  }
};

// A (left, right) pair: a YAML list of two integers, or one scalar "(127, 0)" / "[127, 0]" (a
// Python tuple as written, or a command-line value YAML did not split).
template <>
struct Codec<AttentionWindow> {
  static std::string type_name() { return "a pair [left, right] of integers, -1 for unbounded"; }
  static AttentionWindow decode(const YAML::Node& n, const std::string& key, const std::vector<std::string>&) {
    std::vector<Int> v;
    if (n.IsSequence()) {
      for (const auto& item : n) v.push_back(Codec<Int>::decode(item, key, {}));
    } else if (n.IsScalar() && n.Scalar().size() >= 2 &&
               ((n.Scalar().front() == '(' && n.Scalar().back() == ')') ||
                (n.Scalar().front() == '[' && n.Scalar().back() == ']'))) {
      const std::string body = n.Scalar().substr(1, n.Scalar().size() - 2);
      for (std::size_t p = 0; p <= body.size();) {
        std::size_t comma = body.find(',', p);
        if (comma == std::string::npos) comma = body.size();
        std::string item = body.substr(p, comma - p);
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        const auto x = parse_int(item);
        if (!x) type_error(key, type_name(), n);
        v.push_back(*x);
        p = comma + 1;
      }
    } else {
      type_error(key, type_name(), n);
    }
    if (v.size() != 2) type_error(key, type_name(), n);
    if (v[0] < -1)  // TE's check_set_window_size asserts it
      throw ConfigError(fmt::format("{}=[{}, {}]: the left side is -1 (unbounded) or at least 0, got {}", key, v[0], v[1],
                                    v[0]));
    return {v[0], v[1]};
  }
  static YAML::Node encode(const AttentionWindow& w) {
    YAML::Node n(YAML::NodeType::Sequence);
    n.push_back(w.left);
    n.push_back(w.right);
    n.SetStyle(YAML::EmitterStyle::Flow);
    return n;
  }
};

template <class T>
struct Codec<std::optional<T>> {
  static std::string type_name() { return Codec<T>::type_name() + " or null"; }
  static std::optional<T> decode(const YAML::Node& n, const std::string& key,
                                 const std::vector<std::string>& choices) {
    if (is_null(n)) return std::nullopt;
    return Codec<T>::decode(n, key, choices);
  }
  static YAML::Node encode(const std::optional<T>& v) {
    return v ? Codec<T>::encode(*v) : YAML::Node(YAML::NodeType::Null);
  }
};

template <class T>
constexpr bool is_optional = false;
template <class T>
constexpr bool is_optional<std::optional<T>> = true;

// ---- Sections and the field builder ---------------------------------------------------------

template <class S>
struct Section {
  using type = S;
  const char* name;
  S* (*mut)(Config&);              // creates an optional section on first write
  const S* (*get)(const Config&);  // nullptr when an optional section is absent
};

const Section<ModelConfig> kModel{
    "model", [](Config& c) { return &c.model; }, [](const Config& c) { return &c.model; }};
const Section<CommOverlapConfig> kCommOverlap{
    "comm_overlap",
    [](Config& c) {
      if (!c.comm_overlap) c.comm_overlap.emplace();
      return &*c.comm_overlap;
    },
    [](const Config& c) -> const CommOverlapConfig* {
      return c.comm_overlap ? &*c.comm_overlap : nullptr;
    }};
const Section<DdpConfig> kDdp{"ddp", [](Config& c) { return &c.ddp; },
                              [](const Config& c) { return &c.ddp; }};
const Section<OptimizerConfig> kOptimizer{"optimizer", [](Config& c) { return &c.optimizer; },
                                          [](const Config& c) { return &c.optimizer; }};
const Section<SchedulerConfig> kScheduler{"scheduler", [](Config& c) { return &c.scheduler; },
                                          [](const Config& c) { return &c.scheduler; }};
const Section<TrainConfig> kTrain{"train", [](Config& c) { return &c.train; },
                                  [](const Config& c) { return &c.train; }};
const Section<RngConfig> kRng{"rng", [](Config& c) { return &c.rng; },
                              [](const Config& c) { return &c.rng; }};
const Section<TargetConfig> kTarget{"target", [](Config& c) { return &c.target; },
                                    [](const Config& c) { return &c.target; }};

template <class S, class T>
FieldInfo make_field(const Section<S>& sec, T S::*member, const char* name,
                     std::vector<std::string> choices = {}) {
  FieldInfo f;
  f.section = sec.name;
  f.name = name;
  f.type = Codec<T>::type_name();
  f.choices = choices;
  f.nullable = is_optional<T>;
  const std::string key = f.key();
  f.get = [sec, member](const Config& c) -> YAML::Node {
    const S* s = sec.get(c);
    return s ? Codec<T>::encode(s->*member) : YAML::Node(YAML::NodeType::Null);
  };
  f.set = [sec, member, key, choices](Config& c, const YAML::Node& n) {
    T value = Codec<T>::decode(n, key, choices);
    sec.mut(c)->*member = std::move(value);
  };
  f.reset = [sec, member](Config& c) {
    if (sec.get(c)) sec.mut(c)->*member = S{}.*member;
  };
  return f;
}

// Megatron-Core takes pipeline_model_parallel_layout as a string or as a list of stages, each a
// list of layer names (PipelineParallelLayerLayout), and Bridge dumps it as given: a list reads
// as its string ("embedding", "decoder", "mtp", "loss" as E, t, m, L; stages joined by '|').
FieldInfo layout_field(FieldInfo f) {
  f.type += ", or a list of stages, each a list of layer names";
  f.set = [set = f.set, key = f.key()](Config& c, const YAML::Node& n) {
    if (!n.IsSequence()) return set(c, n);
    static const std::map<std::string, char> kLayers = {{"embedding", 'E'}, {"decoder", 't'}, {"mtp", 'm'}, {"loss", 'L'}};
    std::vector<std::string> stages;
    for (const YAML::Node& stage : n) {
      if (!stage.IsSequence())
        throw ConfigError(fmt::format("{}: pipeline_model_parallel_layout must be a list of lists, but got {}", key,
                                      shorten(yaml_text(stage))));
      stages.emplace_back();
      for (const YAML::Node& layer : stage) {
        std::string name = to_lower(scalar(layer, key, "a layer name (embedding, decoder, mtp, loss)"));
        name.erase(0, name.find_first_not_of(" \t\n"));
        name.erase(name.find_last_not_of(" \t\n") + 1);
        const auto kind = kLayers.find(name);
        if (kind == kLayers.end())
          throw ConfigError(fmt::format("{}: {} is not a layer epx builds (embedding, decoder, mtp, loss)", key,
                                        shorten(yaml_text(layer))));
        stages.back() += kind->second;
      }
    }
    set(c, YAML::Node(fmt::format("{}", fmt::join(stages, "|"))));
  };
  return f;
}

// A torch dtype as Megatron's --*-dtype flags name it (fp32, bf16, fp16, fp8: torch.uint8), also
// given as torch's name ("torch.bfloat16") or as a Bridge dump writes one ({_target_:
// torch.bfloat16, _call_: false}).
FieldInfo torch_dtype_field(FieldInfo f) {
  f.type += " (fp32, bf16, fp16, fp8, or a torch dtype)";
  f.set = [set = f.set, key = f.key()](Config& c, const YAML::Node& n) {
    const YAML::Node target = n.IsMap() ? n["_target_"] : YAML::Node();
    if (n.IsMap() && !(target.IsDefined() && target.IsScalar()))
      throw ConfigError(fmt::format("{} expects a dtype, got {}", key, shorten(yaml_text(n))));
    const std::string text = n.IsMap() ? target.Scalar() : n.IsScalar() ? n.Scalar() : std::string();
    static const std::map<std::string, std::string> kTorch = {
        {"torch.float32", "fp32"}, {"torch.float", "fp32"},     {"torch.bfloat16", "bf16"},
        {"torch.float16", "fp16"}, {"torch.half", "fp16"},      {"torch.uint8", "fp8"}};
    const auto torch = kTorch.find(text);
    set(c, torch != kTorch.end() ? YAML::Node(torch->second) : n.IsMap() ? YAML::Node(text) : n);
  };
  return f;
}

// A string field that a Bridge recipe may set to a torch dtype ({_target_: torch.float32, _call_:
// false} in a dump): the dtype's name, kept as such (moe_router_dtype compares it with 'fp32').
FieldInfo torch_name_field(FieldInfo f) {
  f.set = [set = f.set](Config& c, const YAML::Node& n) {
    const YAML::Node target = n.IsMap() ? n["_target_"] : YAML::Node();
    set(c, target.IsDefined() && target.IsScalar() ? YAML::Node(target.Scalar()) : n);
  };
  return f;
}

// An activation's short name from a name or module path, Bridge's aliases read as what they alias.
std::string activation_name(std::string name) {
  if (const auto dot = name.rfind('.'); dot != std::string::npos) name = name.substr(dot + 1);
  static const std::map<std::string, std::string> kAliases = {
      {"gelu_pytorch_tanh", "fast_gelu"}, {"openai_gelu", "fast_gelu"}, {"relu2", "squared_relu"}, {"erf_gelu", "gelu"}};
  if (const auto alias = kAliases.find(name); alias != kAliases.end()) return alias->second;
  return name;
}

// An activation function, named as Bridge's activation map names it (src/megatron/bridge/utils/
// activation_map.py), by a module path whose last part is such a name ("torch.nn.functional.silu",
// "megatron.core.activations.fast_gelu"), or as a Bridge dump writes a callable ({_target_:
// <path>, _call_: false}, nothing else, as Bridge's instantiate requires). Read as the short name;
// Bridge's aliases read as what they alias. A dumped functools.partial ({_target_, _partial_: true,
// _args_: []}) is read only with no arguments but torch GELU's `approximate`: "tanh" is fast_gelu's
// math, "none" GELU's.
FieldInfo activation_field(FieldInfo f) {
  f.type += " (an activation's name or module path)";
  f.set = [set = f.set, key = f.key()](Config& c, const YAML::Node& n) {
    if (!n.IsMap()) return set(c, n.IsScalar() ? YAML::Node(activation_name(n.Scalar())) : n);  // the codec names a wrong type
    const YAML::Node target = n["_target_"];
    if (!target.IsDefined() || !target.IsScalar())
      throw ConfigError(fmt::format("{} expects an activation function, got {}", key, shorten(yaml_text(n))));
    const std::string path = target.Scalar(), last = path.substr(path.rfind('.') + 1);
    const auto is = [&](const char* field, const char* value) {
      return n[field].IsDefined() && n[field].IsScalar() && to_lower(n[field].Scalar()) == value;
    };
    const bool callable = is("_call_", "false"), partial = is("_partial_", "true");
    std::string approximate = "none";
    for (const auto& item : n) {
      const std::string field = item.first.IsScalar() ? item.first.Scalar() : yaml_text(item.first);
      const std::string value = item.second.IsScalar() ? item.second.Scalar() : yaml_text(item.second);
      const bool fits = field == "_target_" || (field == "_call_" && callable && !partial) ||
                        (field == "_partial_" && partial && !n["_call_"].IsDefined()) ||
                        (partial && field == "_args_" && item.second.IsSequence() && item.second.size() == 0) ||
                        (partial && field == "approximate" && last == "gelu" && (value == "tanh" || value == "none"));
      if (!fits)
        throw ConfigError(fmt::format("{}: {}={} on {}: epx reads a callable as {{_target_: <path>, _call_: false}} "
                                      "or a partial with no arguments but torch GELU's approximate; write the "
                                      "activation's name",
                                      key, field, shorten(value), path));
      if (field == "approximate") approximate = value;
    }
    if (!callable && !partial)
      throw ConfigError(fmt::format("{}: {{_target_: {}}} without _call_: false is a call of the function, not the "
                                    "function; write {{_target_: {}, _call_: false}} or the activation's name",
                                    key, path, path));
    set(c, YAML::Node(approximate == "tanh" ? std::string("fast_gelu") : activation_name(path)));
  };
  return f;
}

#define EPX_FIELD(sec, member, ...) \
  make_field(sec, &std::remove_cvref_t<decltype(sec)>::type::member, #member, ##__VA_ARGS__)

const std::vector<std::string> kAdamStateDtypes = {"fp32", "fp16", "bf16", "fp8"};
// "full_iteration" is the legacy scope Megatron-Core migrates to cuda_graph_impl=full_iteration,
// "full_iteration_inference" the one it migrates to inference_cuda_graph_scope (no training graph).
const std::vector<std::string> kCudaGraphScopes = {"full", "full_iteration", "full_iteration_inference", "attn", "mlp",
                                                    "moe", "moe_router", "moe_preprocess", "mamba"};

std::vector<FieldInfo> build_schema() {
  return {
      EPX_FIELD(kModel, tensor_model_parallel_size),
      EPX_FIELD(kModel, pipeline_model_parallel_size),
      EPX_FIELD(kModel, virtual_pipeline_model_parallel_size),
      EPX_FIELD(kModel, microbatch_group_size_per_vp_stage),
      EPX_FIELD(kModel, context_parallel_size),
      EPX_FIELD(kModel, cp_comm_type, {"p2p", "a2a", "allgather", "a2a+p2p"}),
      EPX_FIELD(kModel, hierarchical_context_parallel_sizes),
      EPX_FIELD(kModel, expert_model_parallel_size),
      EPX_FIELD(kModel, expert_tensor_parallel_size),
      EPX_FIELD(kModel, sequence_parallel),
      layout_field(EPX_FIELD(kModel, pipeline_model_parallel_layout)),
      EPX_FIELD(kModel, account_for_embedding_in_pipeline_split),
      EPX_FIELD(kModel, account_for_loss_in_pipeline_split),
      EPX_FIELD(kModel, num_layers_in_first_pipeline_stage),
      EPX_FIELD(kModel, num_layers_in_last_pipeline_stage),
      EPX_FIELD(kModel, num_layers),
      EPX_FIELD(kModel, hidden_size),
      EPX_FIELD(kModel, ffn_hidden_size),
      EPX_FIELD(kModel, num_attention_heads),
      EPX_FIELD(kModel, num_query_groups),
      EPX_FIELD(kModel, kv_channels),
      EPX_FIELD(kModel, qk_layernorm),
      EPX_FIELD(kModel, normalization, {"LayerNorm", "RMSNorm"}),
      EPX_FIELD(kModel, layernorm_epsilon),
      EPX_FIELD(kModel, layernorm_zero_centered_gamma),
      EPX_FIELD(kModel, gated_linear_unit),
      activation_field(EPX_FIELD(kModel, activation_func,
                                 {"silu", "quick_gelu", "gelu", "fast_gelu", "relu", "squared_relu", "sigmoid", "tanh"})),
      EPX_FIELD(kModel, activation_func_clamp_value),
      EPX_FIELD(kModel, glu_linear_offset),
      EPX_FIELD(kModel, bias_activation_fusion),
      EPX_FIELD(kModel, use_te_activation_func),
      EPX_FIELD(kModel, add_bias_linear),
      EPX_FIELD(kModel, bias_dropout_fusion),
      EPX_FIELD(kModel, add_qkv_bias),
      EPX_FIELD(kModel, seq_length),
      EPX_FIELD(kModel, vocab_size),
      EPX_FIELD(kModel, make_vocab_size_divisible_by),
      EPX_FIELD(kModel, share_embeddings_and_output_weights),
      EPX_FIELD(kModel, rotary_percent),
      EPX_FIELD(kModel, softmax_scale),
      EPX_FIELD(kModel, position_embedding_type,
                {"learned_absolute", "rope", "yarn", "mrope", "none"}),
      EPX_FIELD(kModel, rotary_base),
      EPX_FIELD(kModel, yarn_rotary_scaling_factor),
      EPX_FIELD(kModel, yarn_original_max_position_embeddings),
      EPX_FIELD(kModel, yarn_beta_fast),
      EPX_FIELD(kModel, yarn_beta_slow),
      EPX_FIELD(kModel, yarn_mscale),
      EPX_FIELD(kModel, yarn_mscale_all_dim),
      EPX_FIELD(kModel, yarn_correction_range_round_to_int),
      EPX_FIELD(kModel, window_size),
      EPX_FIELD(kModel, window_attn_skip_freq),
      EPX_FIELD(kModel, softmax_type, {"vanilla", "off-by-one", "learnable"}),
      EPX_FIELD(kModel, init_method_std),
      EPX_FIELD(kModel, multi_latent_attention),
      EPX_FIELD(kModel, q_lora_rank),
      EPX_FIELD(kModel, kv_lora_rank),
      EPX_FIELD(kModel, qk_head_dim),
      EPX_FIELD(kModel, qk_pos_emb_head_dim),
      EPX_FIELD(kModel, v_head_dim),
      EPX_FIELD(kModel, rope_type, {"rope", "yarn"}),
      EPX_FIELD(kModel, rotary_scaling_factor),
      EPX_FIELD(kModel, original_max_position_embeddings),
      EPX_FIELD(kModel, beta_fast),
      EPX_FIELD(kModel, beta_slow),
      EPX_FIELD(kModel, mscale),
      EPX_FIELD(kModel, mscale_all_dim),
      EPX_FIELD(kModel, num_moe_experts),
      EPX_FIELD(kModel, moe_ffn_hidden_size),
      EPX_FIELD(kModel, moe_router_topk),
      EPX_FIELD(kModel, moe_layer_freq),
      EPX_FIELD(kModel, moe_shared_expert_intermediate_size),
      EPX_FIELD(kModel, moe_shared_expert_overlap),
      EPX_FIELD(kModel, moe_shared_expert_gate),
      // Any name, as Megatron takes it (one it does not know balances nothing:
      // moe.load_balancing_type_unknown); Bridge's DeepSeek-V4 bridge writes noaux_tc.
      EPX_FIELD(kModel, moe_router_load_balancing_type),
      EPX_FIELD(kModel, moe_aux_loss_coeff),
      EPX_FIELD(kModel, moe_router_quantile_balancing_ema),
      EPX_FIELD(kModel, moe_z_loss_coeff),
      EPX_FIELD(kModel, moe_router_pre_softmax),
      EPX_FIELD(kModel, moe_router_score_function, {"softmax", "sigmoid", "sqrtsoftplus"}),
      EPX_FIELD(kModel, moe_router_topk_scaling_factor),
      EPX_FIELD(kModel, moe_router_enable_expert_bias),
      EPX_FIELD(kModel, moe_router_bias_update_rate),
      EPX_FIELD(kModel, moe_router_num_groups),
      EPX_FIELD(kModel, moe_router_group_topk),
      // Any name, as Megatron takes it (Bridge's DeepSeek-V3 GB300 recipes write bf16); only fp32
      // and fp64 upcast the router (moe.router_dtype_torch).
      torch_name_field(EPX_FIELD(kModel, moe_router_dtype)),
      EPX_FIELD(kModel, moe_router_force_load_balancing),
      EPX_FIELD(kModel, moe_grouped_gemm),
      EPX_FIELD(kModel, moe_token_dispatcher_type, {"allgather", "alltoall", "flex"}),
      EPX_FIELD(kModel, moe_flex_dispatcher_backend, {"deepep", "hybridep", "ncclep"}),
      EPX_FIELD(kModel, moe_flex_dispatcher_num_sms),
      EPX_FIELD(kModel, moe_deepep_num_sms),
      EPX_FIELD(kModel, moe_hybridep_num_sms),
      EPX_FIELD(kModel, moe_hybridep_num_sms_preprocessing),
      EPX_FIELD(kModel, moe_permute_fusion_into_hybridep),
      EPX_FIELD(kModel, moe_hybridep_pad_uneven_dispatch_inputs),
      EPX_FIELD(kModel, moe_permute_fusion),
      EPX_FIELD(kModel, moe_router_fusion),
      EPX_FIELD(kModel, moe_expert_capacity_factor),
      EPX_FIELD(kModel, moe_pad_expert_input_to_capacity),
      EPX_FIELD(kModel, moe_token_drop_policy, {"probs", "position"}),
      EPX_FIELD(kModel, high_priority_a2a_comm_stream),
      EPX_FIELD(kModel, tp_comm_overlap),
      EPX_FIELD(kModel, overlap_p2p_comm),
      EPX_FIELD(kModel, batch_p2p_comm),
      EPX_FIELD(kModel, overlap_moe_expert_parallel_comm),
      EPX_FIELD(kModel, delay_wgrad_compute),
      EPX_FIELD(kModel, overlap_dispatch_backward_with_experts_wgrad),
      EPX_FIELD(kModel, ep_overlap_early_attn_memory_release),
      EPX_FIELD(kModel, defer_embedding_wgrad_compute),
      EPX_FIELD(kModel, wgrad_deferral_limit),
      EPX_FIELD(kModel, bf16),
      EPX_FIELD(kModel, fp16),
      EPX_FIELD(kModel, fp8, {"e4m3", "hybrid"}),
      EPX_FIELD(kModel, fp8_recipe, {"tensorwise", "delayed", "mxfp8", "blockwise", "custom"}),
      EPX_FIELD(kModel, fp8_param),
      EPX_FIELD(kModel, gradient_accumulation_fusion),
      EPX_FIELD(kModel, recompute_granularity, {"full", "selective"}),
      EPX_FIELD(kModel, recompute_method, {"uniform", "block"}),
      EPX_FIELD(kModel, recompute_num_layers),
      // Megatron checks the names only for selective recompute: recompute.module_names.
      EPX_FIELD(kModel, recompute_modules),
      EPX_FIELD(kModel, mtp_num_layers),
      EPX_FIELD(kModel, mtp_loss_scaling_factor),
      EPX_FIELD(kModel, mtp_use_repeated_layer),
      EPX_FIELD(kModel, mtp_detach_heads),
      EPX_FIELD(kModel, cuda_graph_impl, {"none", "local", "transformer_engine", "full_iteration"}),
      EPX_FIELD(kModel, use_te_rng_tracker),
      EPX_FIELD(kModel, cuda_graph_scope, kCudaGraphScopes),
      EPX_FIELD(kModel, cuda_graph_modules, kCudaGraphScopes),

      EPX_FIELD(kCommOverlap, tp_comm_overlap),
      EPX_FIELD(kCommOverlap, tp_comm_bootstrap_backend, {"nccl", "mpi", "gloo"}),  // ModelParallelConfig's Literal
      EPX_FIELD(kCommOverlap, overlap_p2p_comm),
      EPX_FIELD(kCommOverlap, batch_p2p_comm),
      EPX_FIELD(kCommOverlap, overlap_grad_reduce),
      EPX_FIELD(kCommOverlap, overlap_param_gather),
      EPX_FIELD(kCommOverlap, overlap_param_gather_with_optimizer_step),
      EPX_FIELD(kCommOverlap, align_param_gather),
      EPX_FIELD(kCommOverlap, bucket_size),
      EPX_FIELD(kCommOverlap, defer_embedding_wgrad_compute),
      EPX_FIELD(kCommOverlap, wgrad_deferral_limit),
      EPX_FIELD(kCommOverlap, overlap_moe_expert_parallel_comm),
      EPX_FIELD(kCommOverlap, delay_wgrad_compute),
      EPX_FIELD(kCommOverlap, data_parallel_size),

      EPX_FIELD(kDdp, overlap_grad_reduce),
      EPX_FIELD(kDdp, overlap_param_gather),
      EPX_FIELD(kDdp, align_param_gather),
      EPX_FIELD(kDdp, use_distributed_optimizer),
      EPX_FIELD(kDdp, bucket_size),
      EPX_FIELD(kDdp, grad_reduce_in_fp32),
      EPX_FIELD(kDdp, reduce_embedding_rows),

      // Megatron builds adam and sgd itself, any other name from its emerging-optimizers registry
      // (muon, adaptive_muon, lion, ...; the deprecated dist_muon): optimizer.known_optimizer.
      EPX_FIELD(kOptimizer, optimizer),
      EPX_FIELD(kOptimizer, lr),
      EPX_FIELD(kOptimizer, min_lr),
      EPX_FIELD(kOptimizer, weight_decay),
      EPX_FIELD(kOptimizer, adam_beta1),
      EPX_FIELD(kOptimizer, adam_beta2),
      EPX_FIELD(kOptimizer, adam_eps),
      EPX_FIELD(kOptimizer, clip_grad),
      EPX_FIELD(kOptimizer, use_distributed_optimizer),
      EPX_FIELD(kOptimizer, overlap_param_gather),
      EPX_FIELD(kOptimizer, overlap_param_gather_with_optimizer_step),
      EPX_FIELD(kOptimizer, align_param_gather),
      EPX_FIELD(kOptimizer, use_precision_aware_optimizer),
      EPX_FIELD(kOptimizer, store_param_remainders),
      // Megatron's choices for --main-grads-dtype, --main-params-dtype, --exp-avg(-sq)-dtype.
      torch_dtype_field(EPX_FIELD(kOptimizer, main_grads_dtype, {"fp32", "bf16"})),
      torch_dtype_field(EPX_FIELD(kOptimizer, main_params_dtype, {"fp32", "fp16"})),
      torch_dtype_field(EPX_FIELD(kOptimizer, exp_avg_dtype, kAdamStateDtypes)),
      torch_dtype_field(EPX_FIELD(kOptimizer, exp_avg_sq_dtype, kAdamStateDtypes)),

      EPX_FIELD(kScheduler, lr_decay_style,
                {"constant", "linear", "cosine", "inverse-square-root", "WSD"}),
      EPX_FIELD(kScheduler, lr_warmup_iters),
      EPX_FIELD(kScheduler, lr_decay_iters),
      EPX_FIELD(kScheduler, lr_warmup_samples),
      EPX_FIELD(kScheduler, lr_decay_samples),
      EPX_FIELD(kScheduler, lr_warmup_fraction),
      EPX_FIELD(kScheduler, max_steps),
      EPX_FIELD(kScheduler, lr_warmup_init),

      EPX_FIELD(kTrain, train_iters),
      EPX_FIELD(kTrain, train_samples),
      EPX_FIELD(kTrain, global_batch_size),
      EPX_FIELD(kTrain, micro_batch_size),
      EPX_FIELD(kTrain, eval_iters),
      EPX_FIELD(kTrain, manual_gc),

      EPX_FIELD(kRng, seed),
      EPX_FIELD(kRng, te_rng_tracker),

      EPX_FIELD(kTarget, gpu),
      EPX_FIELD(kTarget, num_gpus),
      EPX_FIELD(kTarget, gpus_per_node),
      EPX_FIELD(kTarget, torch_version),
      EPX_FIELD(kTarget, te_version),
  };
}

#undef EPX_FIELD

std::vector<std::string> split_words(const std::string& name) {
  std::vector<std::string> words;
  for (size_t p = 0; p < name.size();) {
    size_t end = name.find('_', p);
    if (end == std::string::npos) end = name.size();
    if (end > p) words.push_back(name.substr(p, end - p));
    p = end + 1;
  }
  return words;
}

}  // namespace

const std::vector<FieldInfo>& schema() {
  static const std::vector<FieldInfo> fields = build_schema();
  return fields;
}

const std::vector<std::string>& schema_sections() {
  static const std::vector<std::string> sections = {
      "model", "comm_overlap", "ddp", "optimizer", "scheduler", "train", "rng", "target"};
  return sections;
}

const std::vector<std::string>& bridge_only_sections() {
  static const std::vector<std::string> sections = {
      "dataset",         "logger", "tokenizer",         "checkpoint", "dist",           "profiling",
      "peft",            "mixed_precision", "inprocess_restart", "ft", "straggler", "nvrx_straggler",
      "rerun_state_machine", "tensor_inspect", "mixed_precision_config", "validation",
      "optimizer_config_override_provider"};
  return sections;
}

// The issue-level names for training settings that Megatron-Bridge keeps in other sections.
const std::vector<std::pair<std::string, std::string>>& field_aliases() {
  static const std::vector<std::pair<std::string, std::string>> aliases = {
      {"train.seq_length", "model.seq_length"},
      {"train.seed", "rng.seed"},
      {"train.lr", "optimizer.lr"},
      {"train.min_lr", "optimizer.min_lr"},
      {"train.lr_decay_style", "scheduler.lr_decay_style"},
      {"train.lr_warmup_iters", "scheduler.lr_warmup_iters"},
      {"train.lr_decay_iters", "scheduler.lr_decay_iters"},
  };
  return aliases;
}

const FieldInfo* find_field(std::string_view key) {
  for (const auto& [alias, canonical] : field_aliases())
    if (key == alias) key = canonical;
  for (const auto& f : schema())
    if (key.size() == f.section.size() + 1 + f.name.size() && key.starts_with(f.section) &&
        key[f.section.size()] == '.' && key.ends_with(f.name))
      return &f;
  return nullptr;
}

std::vector<std::string> suggest_keys(std::string_view key) {
  if (key.size() > 128) return {};  // no key is this long; the edit distances would cost seconds
  // Score by edit distance on whole keys and on field names alone (so a field put in the wrong
  // section, "train.num_moe_experts", finds its real one), and count a name whose words all
  // appear in a field ("moe_topk" in "moe_router_topk") as close.
  const auto dot = key.find('.');
  const std::string name(dot == std::string_view::npos ? key : key.substr(dot + 1));
  const std::vector<std::string> words = split_words(name);
  struct Scored {
    size_t score;
    bool other_section;
    size_t distance;
    std::string key;
  };
  std::vector<Scored> scored;
  for (const auto& f : schema()) {
    const size_t distance = std::min(edit_distance(key, f.key()), edit_distance(name, f.name));
    const std::vector<std::string> field_words = split_words(f.name);
    // Every typed word is in the field's name, give or take one typo ("paralel").
    const bool all_words =
        words.size() >= 2 && std::all_of(words.begin(), words.end(), [&](const std::string& w) {
          return std::any_of(field_words.begin(), field_words.end(), [&](const std::string& fw) {
            return edit_distance(w, fw) <= (w.size() > 4 ? 1u : 0u);
          });
        });
    scored.push_back({all_words ? std::min<size_t>(distance, 2) : distance,
                      key.substr(0, dot) != f.section, distance, f.key()});
  }
  std::stable_sort(scored.begin(), scored.end(), [](const Scored& a, const Scored& b) {
    return std::tie(a.score, a.other_section, a.distance) <
           std::tie(b.score, b.other_section, b.distance);
  });
  std::vector<std::string> out;
  const size_t limit = std::max<size_t>(3, name.size() / 3);
  for (const auto& s : scored)
    if (s.score <= limit && out.size() < 3) out.push_back(s.key);
  return out;
}

std::string shorten(std::string_view text, std::size_t max) {
  if (text.size() <= max) return std::string(text);
  return fmt::format("{}... ({} bytes)", text.substr(0, max), text.size());
}

std::string yaml_text(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "null";
  if (node.IsScalar()) return node.Scalar();
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

bool take_none_moe_field(Config& cfg, const std::string& key, const YAML::Node& value) {
  if ((key != "model.moe_router_topk" && key != "model.moe_token_dispatcher_type") || !is_null(value)) return false;
  if (std::find(cfg.none_moe_fields.begin(), cfg.none_moe_fields.end(), key) == cfg.none_moe_fields.end())
    cfg.none_moe_fields.push_back(key);
  find_field(key)->reset(cfg);  // the default stands in for None
  return true;
}

std::string field_text(const Config& cfg, std::string_view key) {
  const FieldInfo* f = find_field(key);
  if (!f) throw std::logic_error("no config field named " + std::string(key));
  if (std::find(cfg.none_moe_fields.begin(), cfg.none_moe_fields.end(), key) != cfg.none_moe_fields.end()) return "null";
  return yaml_text(f->get(cfg));
}

}  // namespace epx
