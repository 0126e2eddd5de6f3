// Environment facts: the GPU kinds a config can target, and version comparison.
#include <algorithm>
#include <cctype>
#include <regex>

#include <fmt/format.h>

#include "epx/check/check.hpp"

namespace epx {

const std::vector<GpuInfo>& gpu_catalog() {
  // device_name and major are what torch reports on each; Bridge's backend rules read them.
  static const std::vector<GpuInfo> gpus = {
      {"h100", "NVIDIA H100 80GB HBM3", 9, 8, 8},
      {"h200", "NVIDIA H200", 9, 8, 8},
      {"b200", "NVIDIA B200", 10, 8, 8},
      {"b300", "NVIDIA B300", 10, 8, 8},
      {"gb200", "NVIDIA GB200", 10, 4, 72},
      {"gb300", "NVIDIA GB300", 10, 4, 72},
      {"a100", "NVIDIA A100-SXM4-80GB", 8, 8, 8},
      {"v100", "Tesla V100-SXM2-32GB", 7, 8, 8},
      // epx's own runtime on this machine: MPI ranks, no CUDA, no Transformer Engine.
      {"cpu", "cpu", 0, 0, 0},
  };
  return gpus;
}

namespace {

const GpuInfo& unnamed_gpu() {
  static const GpuInfo gpu{"", "a CUDA GPU (not named)", -1, 8, 8};
  return gpu;
}

}  // namespace

const GpuInfo* find_gpu(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
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
    std::string tag = m[2];
    std::transform(tag.begin(), tag.end(), tag.begin(), ::tolower);
    v.pre_rank = tag == "dev" ? 0 : (tag == "a" || tag == "alpha") ? 1
                                  : (tag == "b" || tag == "beta")  ? 2
                                                                   : 3;
    v.pre_number = m[3].length() ? number(m[3]) : 0;
  }
  return v;
}

}  // namespace

bool version_at_least(const std::string& version, const std::string& minimum) {
  const Version a = parse_version(version), b = parse_version(minimum);
  if (a.release != b.release) return a.release > b.release;
  if (a.pre_rank != b.pre_rank) return a.pre_rank > b.pre_rank;
  return a.pre_number >= b.pre_number;
}

}  // namespace epx
