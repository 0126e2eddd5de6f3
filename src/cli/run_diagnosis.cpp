#include "run_diagnosis.hpp"

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/check/check.hpp"

namespace epx::cli {

DiagnosedRun diagnose_run(const std::string& run_path, const std::optional<std::string>& trace_path,
                          const std::optional<std::string>& config, const std::optional<std::string>& gpu) {
  DiagnosedRun d;
  d.run = read_run(run_path, trace_path);
  if (config) d.config = load_config_file(resolve_recipe(*config));
  else if (d.run.config) d.config = *d.run.config;
  if (d.config) {
    if (gpu) d.config->target.gpu = *gpu;
    if (!d.config->target.num_gpus) d.config->target.num_gpus = d.run.ranks;
    const CheckReport report = run_check(*d.config);
    if (!report.ok()) {
      for (const Finding& f : report.findings)
        if (f.severity == Severity::error)
          throw ConfigError(fmt::format("{}: the run's config does not pass epx check: [{}] {}{}", run_path, f.rule_id,
                                        f.message, config ? "" : "; name the right one with --config"));
    }
    d.config = report.resolved;
  }
  if (gpu || (d.config && d.config->target.gpu)) {
    const std::string name = gpu ? *gpu : *d.config->target.gpu;
    d.gpu = find_gpu(name);
    if (d.gpu == nullptr) throw ConfigError(fmt::format("-g {}: not in the hardware catalog; see hardware/catalog.yaml", name));
  }
  d.diagnosis = diagnose(d.run, d.config, d.gpu);
  return d;
}

}  // namespace epx::cli
