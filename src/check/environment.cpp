// Environment facts: the GPU kinds a config can target, and version comparison.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <regex>

#include <fmt/format.h>

#include "epx/check/check.hpp"
#include "epx/config/schema.hpp"
#include "epx/base/to_lower.hpp"
#include "hardware_catalog.hpp"

namespace epx {

namespace {

// One catalog entry from YAML: every field given replaces `g`'s; the name is the key.
void read_entry(const YAML::Node& node, const std::string& source, GpuInfo& g) {
  const auto where = [&](const YAML::Node& n, const std::string& key) {
    return fmt::format("{}:{}:{}: {}.{}", source, n.Mark().line + 1, n.Mark().column + 1, g.name, key);
  };
  if (!node.IsMap()) throw ConfigError(fmt::format("{}: expected a mapping of the hardware's fields", where(node, "")));
  const std::map<std::string, double*> rates = {
      {"memory_gb", &g.rates.memory_gb},         {"bf16_tflops", &g.rates.bf16_tflops},
      {"fp8_tflops", &g.rates.fp8_tflops},       {"hbm_tb_s", &g.rates.hbm_tb_s},
      {"nvlink_gb_s", &g.rates.nvlink_gb_s},     {"nvlink_efficiency", &g.rates.nvlink_efficiency},
      {"network_gb_s", &g.rates.network_gb_s},   {"network_efficiency", &g.rates.network_efficiency},
      {"gemm_efficiency", &g.rates.gemm_efficiency}, {"gemm_half_rows", &g.rates.gemm_half_rows},
      {"nvlink_latency_us", &g.rates.nvlink_latency_us}, {"network_latency_us", &g.rates.network_latency_us},
      {"attention_tflops", &g.rates.attention_tflops},
      {"cores", &g.rates.cores}, {"shared_core_efficiency", &g.rates.shared_core_efficiency}};
  const std::map<std::string, int*> counts = {{"gpus_per_node", &g.gpus_per_node}, {"nvlink_domain", &g.nvlink_domain}};
  for (const auto& kv : node) {
    if (!kv.first.IsScalar())
      throw ConfigError(fmt::format("{}: a field name must be a plain word", where(kv.first, "")));
    const std::string key = kv.first.Scalar();
    const YAML::Node& v = kv.second;
    try {
      if (key == "device_name") {
        g.device_name = v.as<std::string>();
      } else if (key == "compute_capability") {  // MAJOR or MAJOR.MINOR, as torch reports it (8.9)
        const std::string text = v.as<std::string>();
        const auto dot = text.find('.');
        const std::string major = text.substr(0, dot), minor = dot == std::string::npos ? "0" : text.substr(dot + 1);
        const auto digits = [](const std::string& s) {
          return !s.empty() && s.size() <= 3 && s.find_first_not_of("0123456789") == std::string::npos;
        };
        if (!digits(major) || !digits(minor)) throw YAML::Exception(v.Mark(), "");
        g.major = std::stoi(major), g.minor = std::stoi(minor);
      } else if (auto r = rates.find(key); r != rates.end()) {
        const double x = v.as<double>();
        if (!(x >= 0 && x < 1e9)) throw YAML::Exception(v.Mark(), "");
        // A rate past a float's range in the planner's products (1e-320 times a peak is 0, and a
        // step time infinite): not a measurement either.
        if (x > 0 && x < 1e-6)
          throw ConfigError(fmt::format("{}: {:g}: a rate is 0 (not known) or at least 1e-6", where(v, key), x));
        if (key == "memory_gb" && x == 0)
          throw ConfigError(fmt::format("{}: 0: a GPU's memory is above 0 GiB (every layout would fit in it)", where(v, key)));
        // 0 is "not known" for a rate the planner asks for where it needs it; ranks sharing the
        // cores are always counted, and at 0 every step would be infinite.
        if (key.ends_with("_efficiency") && (x > 1 || (x == 0 && key == "shared_core_efficiency")))
          throw ConfigError(fmt::format("{}: {} is {}: an efficiency is the share of the rate reached ({}at most 1)",
                                        where(v, key), x, x == 0 ? "0" : "above 1", x == 0 ? "above 0, " : ""));
        if (key == "cores" && x != std::floor(x))
          throw ConfigError(fmt::format("{}: {}: a number of cores is a whole number", where(v, key), x));
        *r->second = x;
      } else if (auto c = counts.find(key); c != counts.end()) {
        const int x = v.as<int>();
        if (x < 0 || x > 1 << 20) throw YAML::Exception(v.Mark(), "");
        *c->second = x;
      } else if (key == "attention_fp32_tflops") {
        throw ConfigError(fmt::format("{}: renamed attention_tflops, and it now means the blocked attention "
                                      "kernel's rate at Megatron's causal FLOPs; run `epx plan --calibrate` again",
                                      where(kv.first, key)));
      } else {
        throw ConfigError(fmt::format("{}: unknown field; the fields are device_name, compute_capability, "
                                      "gpus_per_node, nvlink_domain and the rates of hardware/catalog.yaml",
                                      where(kv.first, key)));
      }
    } catch (const YAML::Exception&) {
      throw ConfigError(fmt::format("{}: '{}' is not a valid value (a rate: 0 or a number from 1e-6 to 1e9; gpus_per_node, "
                                    "nvlink_domain: a whole number from 0 to 2^20; compute_capability: MAJOR.MINOR; "
                                    "device_name: text)",
                                    where(v, key), shorten(YAML::Dump(v))));
    }
  }
}

std::deque<GpuInfo>& mutable_catalog() {
  static std::deque<GpuInfo> gpus = [] {
    std::deque<GpuInfo> out;
    const YAML::Node root = parse_yaml_bounded(builtin_hardware_yaml(), "hardware/catalog.yaml");
    for (const auto& kv : root) {
      GpuInfo g;
      g.name = kv.first.as<std::string>();
      read_entry(kv.second, "hardware/catalog.yaml", g);
      out.push_back(std::move(g));
    }
    return out;
  }();
  return gpus;
}

}  // namespace

const std::deque<GpuInfo>& gpu_catalog() { return mutable_catalog(); }

void add_hardware_file(const std::string& path) {
  const YAML::Node root = parse_yaml_bounded(read_config_text(path), path);
  if (!root.IsMap())
    throw ConfigError(fmt::format("{}: expected a mapping of hardware names to their fields (as hardware/catalog.yaml)", path));
  // Every entry is read into a copy first: a file with an error changes nothing.
  std::deque<GpuInfo> catalog = mutable_catalog();
  for (const auto& kv : root) {
    if (!kv.first.IsScalar() || kv.first.Scalar().empty() || kv.first.Scalar().size() > 64)
      throw ConfigError(fmt::format("{}:{}:{}: '{}': a hardware name is a plain word of 1 to 64 characters", path,
                                    kv.first.Mark().line + 1, kv.first.Mark().column + 1, shorten(YAML::Dump(kv.first))));
    const std::string name = to_lower(kv.first.Scalar());
    auto it = std::find_if(catalog.begin(), catalog.end(), [&](const GpuInfo& e) { return e.name == name; });
    if (it == catalog.end()) {
      GpuInfo fresh;
      fresh.name = name;
      fresh.device_name = name;
      fresh.major = 9;  // a CUDA GPU unless the file says otherwise
      it = catalog.insert(catalog.end(), std::move(fresh));
    }
    read_entry(kv.second, path, *it);
    it->source = path;
    // The CPU runtime's fields time epx's own ranks; on a CUDA GPU they would slow its plans
    // silently (a GPU's rates are the whole GPU's, its attention the GEMMs' rate).
    const HardwareRates& r = it->rates;
    if (it->cuda() && (r.cores > 0 || r.attention_tflops > 0 || r.shared_core_efficiency != 1))
      throw ConfigError(fmt::format("{}:{}:{}: {}: cores, attention_tflops and shared_core_efficiency describe epx's "
                                    "CPU runtime (compute_capability 0), and {} is a CUDA GPU (compute capability {}); "
                                    "drop them, or give compute_capability: 0",
                                    path, kv.second.Mark().line + 1, kv.second.Mark().column + 1, name, name,
                                    it->major));
  }
  // Entries are updated in place and new ones appended, so pointers into the catalog stay valid.
  std::deque<GpuInfo>& live = mutable_catalog();
  for (std::size_t i = 0; i < catalog.size(); ++i)
    if (i < live.size()) live[i] = catalog[i];
    else live.push_back(catalog[i]);
}

namespace {

const GpuInfo& unnamed_gpu() {
  static const GpuInfo gpu{"", "a CUDA GPU (not named)", -1, 0, 8, 8, {}};
  return gpu;
}

}  // namespace

const GpuInfo* find_gpu(std::string_view name) {
  const std::string lower = to_lower(name);
  for (const auto& g : gpu_catalog())
    if (g.name == lower) return &g;
  return nullptr;
}

const GpuInfo& target_gpu(const Config& cfg) {
  if (cfg.target.gpu) {
    if (const GpuInfo* gpu = find_gpu(*cfg.target.gpu)) return *gpu;
    std::vector<std::string> names;
    for (const auto& g : gpu_catalog()) names.push_back(g.name);
    throw ConfigError(fmt::format("{}: unknown GPU '{}'; known: {}", cfg.cite("target.gpu"),
                                  *cfg.target.gpu, fmt::join(names, ", ")));
  }
  const bool describes_gpu_container =
      cfg.target.torch_version || cfg.target.te_version || cfg.is_bridge_dump();
  return describes_gpu_container ? unnamed_gpu() : *find_gpu("cpu");
}

OptInt gpus_per_node(const Config& cfg) {
  if (cfg.target.gpus_per_node) return *cfg.target.gpus_per_node;
  const GpuInfo& gpu = target_gpu(cfg);
  if (gpu.gpus_per_node == 0) return cfg.target.num_gpus;  // cpu: the whole job on one node
  return gpu.gpus_per_node;
}

OptInt num_nodes(const Config& cfg) {
  const OptInt per_node = gpus_per_node(cfg);
  if (!cfg.target.num_gpus || !per_node) return std::nullopt;
  return (*cfg.target.num_gpus + std::max<Int>(*per_node, 1) - 1) / std::max<Int>(*per_node, 1);
}

namespace {

// release numbers plus a pre-release rank: dev < a < b < rc < release.
struct Version {
  std::vector<int> release;
  int pre_rank = 4;
  int pre_number = 0;
};

Version parse_version(const std::string& text) {
  static const std::regex re(R"(^\s*v?(\d+(?:\.\d+)*)(?:[.-]?(a|b|rc|dev|alpha|beta)(\d*))?(?:\+.*)?\s*$)",
                             std::regex::icase);
  // libstdc++'s regex recurses per character: bound the text before matching it.
  if (text.size() > 64)
    throw ConfigError(fmt::format("a {}-character text is not a version number (expected "
                                  "something like 2.6.0 or 2.7.0a0+git1234)",
                                  text.size()));
  std::smatch m;
  if (!std::regex_match(text, m, re))
    throw ConfigError(fmt::format("'{}' is not a version number (expected something like 2.6.0 "
                                  "or 2.7.0a0+git1234)",
                                  text));
  // Digits only, by the pattern; more than nine would not fit an int (and no version has them).
  auto number = [&text](const std::string& digits) {
    if (digits.size() > 9)
      throw ConfigError(fmt::format("'{}' is not a version number: the component {} is too large",
                                    text, digits));
    return std::stoi(digits);
  };
  Version v;
  std::string rel = m[1];
  for (size_t start = 0; start <= rel.size();) {
    size_t dot = rel.find('.', start);
    if (dot == std::string::npos) dot = rel.size();
    v.release.push_back(number(rel.substr(start, dot - start)));
    start = dot + 1;
  }
  while (v.release.size() > 1 && v.release.back() == 0) v.release.pop_back();
  if (m[2].matched) {
    const std::string tag = to_lower(m[2].str());
    v.pre_rank = tag == "dev" ? 0 : (tag == "a" || tag == "alpha") ? 1
                                  : (tag == "b" || tag == "beta")  ? 2
                                                                   : 3;
    v.pre_number = m[3].length() ? number(m[3]) : 0;
  }
  return v;
}

}  // namespace

std::string harness_compute_dtype(const ModelConfig& m) {
  if (!m.fp8) return "bf16";
  const std::string r = m.fp8_recipe.value_or("delayed");
  return r == "tensorwise" ? "fp8_cs" : r == "mxfp8" ? "fp8_mx" : r == "blockwise" ? "fp8_sc" : "";
}

bool version_at_least(const std::string& version, const std::string& minimum) {
  const Version a = parse_version(version), b = parse_version(minimum);
  if (a.release != b.release) return a.release > b.release;
  if (a.pre_rank != b.pre_rank) return a.pre_rank > b.pre_rank;
  return a.pre_number >= b.pre_number;
}

}  // namespace epx
