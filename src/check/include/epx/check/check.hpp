// The pre-flight checker (`epx check`): Megatron-Bridge's and Megatron-Core's validation rules,
// the flex-dispatcher backend apply/validate steps by GPU, and the seeds' pitfalls, as a table of
// rules that `--list-rules` prints from the same data the checker runs.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/config/config.hpp"
#include "epx/config/finding.hpp"

namespace epx {

// ---- Environment facts ----------------------------------------------------------------------

// What the planner needs of a GPU (hardware/catalog.yaml explains each field).
struct HardwareRates {
  double memory_gb = 0, bf16_tflops = 0, fp8_tflops = 0, hbm_tb_s = 0;
  double nvlink_gb_s = 0, nvlink_efficiency = 1, network_gb_s = 0, network_efficiency = 1;
  double nvlink_latency_us = 0, network_latency_us = 0;  // per exchange (0: in the host costs)
  double attention_tflops = 0;  // > 0: epx's blocked attention (the cpu runtime)
  double gemm_efficiency = 1, gemm_half_rows = 0;
  double cores = 0;  // cpu: the machine's cores, shared by its ranks (rates are per core)
  double shared_core_efficiency = 1;  // cpu: a rank's speed while every core runs one
};

struct GpuInfo {
  std::string name;         // the -g/--gpu spelling: "h100" (empty: a GPU not named)
  std::string device_name;  // what torch.cuda.get_device_properties(0).name reports
  int major = 0;            // compute capability major (0: no CUDA device; -1: not named)
  int minor = 0;            // and minor (Ada's 8.9)
  int gpus_per_node = 8;
  int nvlink_domain = 8;    // GPUs in one NVLink domain
  HardwareRates rates;
  std::string source;       // the --hardware file that last set fields of it (empty: the built-in catalog)
  bool cuda() const { return major != 0; }   // a GPU target, named or not
  bool named() const { return major >= 0; }  // cpu or a GPU from the catalog
};

// The catalog: hardware/catalog.yaml as built into epx, plus what add_hardware_file added.
const std::deque<GpuInfo>& gpu_catalog();
const GpuInfo* find_gpu(std::string_view name);
// Adds the entries of a YAML file with the catalog's keys (a known name: the fields given
// replace the catalog's). Errors name the file, line and key (ConfigError).
void add_hardware_file(const std::string& path);

// The GPU a config targets: target.gpu (ConfigError, citing the file and line, for a name not
// in the catalog); when it is not given, a CUDA GPU of unknown kind if the config describes a
// GPU container (a torch or TE version, or a Megatron-Bridge dump), else `cpu`, epx's runtime.
const GpuInfo& target_gpu(const Config& cfg);

// PEP 440-style comparison, as torch and TE version checks use: pre-releases (2.6.0a0, rc1,
// dev) sort before the release, a local part (+git1234) is ignored. Throws ConfigError for text
// that is not a version.
bool version_at_least(const std::string& version, const std::string& minimum);

// The harness's `-c` for the model's precision: bf16, or its FP8 scaling's name there (fp8_cs
// tensorwise, fp8_mx mxfp8, fp8_sc blockwise); empty for an FP8 scaling the harness has not.
std::string harness_compute_dtype(const ModelConfig& m);

// GPUs per node for the target (the -gn flag, else the GPU kind's; cpu: all ranks on one node)
// and the node count; none when they depend on a world size that is not given.
OptInt gpus_per_node(const Config& cfg);
OptInt num_nodes(const Config& cfg);

// ---- Rules ----------------------------------------------------------------------------------

struct CheckContext {
  const Config& user;  // as loaded, with overrides and flags, before finalize
  const Config& cfg;   // resolved (finalized, flex backend applied)
  const GpuInfo& gpu;
  bool cuda() const { return gpu.cuda(); }
  bool gpu_named() const { return gpu.named(); }
  const OptInt& world() const { return cfg.target.num_gpus; }
};

struct Outcome {
  enum Kind { pass, fail, unknown } kind = pass;
  std::string message;  // fail: the reason; unknown: what is missing to decide
  std::string fix;
};

struct Rule {
  std::string id;
  Severity severity;
  std::vector<std::string> fields;  // config keys the rule reads, shown with their values
  std::string source;               // where the rule comes from
  std::string summary;
  // Evaluates the rule; empty for rules raised while resolving the config (finalize,
  // flex-backend apply/validate), whose findings carry the same id.
  std::function<Outcome(const CheckContext&)> check;
};

const std::vector<Rule>& rules();
const Rule* find_rule(std::string_view id);

// ---- Running a check ------------------------------------------------------------------------

struct CheckReport {
  Config user;
  Config resolved;
  std::vector<Finding> findings;
  std::vector<std::string> unchecked;  // "rule id: what is missing"
  std::string ignored_note;
  int count(Severity s) const;
  bool ok() const { return count(Severity::error) == 0; }
};

// Resolve the config as Bridge does (flex backend apply from the harness flag, finalize, flex
// validate, HybridEP topology), then evaluate every rule. Throws ConfigError for an unknown GPU
// or an unreadable version (unusable input).
CheckReport run_check(const Config& loaded, const OptString& flex_backend_flag = std::nullopt);

// Resolve only (what `epx config show` prints); findings of the resolve steps are returned too.
Config resolve_config(const Config& loaded, const OptString& flex_backend_flag,
                      std::vector<Finding>* findings = nullptr);

std::string format_report(const CheckReport& report);
nlohmann::json report_json(const CheckReport& report);
std::string format_rule_table();
nlohmann::json rule_table_json();

}  // namespace epx
