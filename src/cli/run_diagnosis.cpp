#include "run_diagnosis.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/base/error.hpp"
#include "epx/check/check.hpp"
#include "number_validators.hpp"

namespace epx::cli {

void add_run_source_options(CLI::App& app, RunSource& source) {
  app.add_option("--config", source.config,
                 "the run's config (recipe or YAML) when it does not carry one (a Megatron log): for the planner");
  app.add_option("--override", source.overrides, "KEY=VALUE (+KEY=VALUE, ~KEY) applied to the run's config; repeatable")
      ->allow_extra_args(false);  // one value per occurrence: a following override stays one
  app.add_option("-g,--gpu", source.gpu, "the hardware the run ran on (default: the config's target.gpu)");
  app.add_option("--ng,--num_gpus", source.num_gpus, "-ng: the world size (default: the run's, or the config's)")
      ->check(kPositive);
}

DiagnosedRun diagnose_run(const std::string& run_path, const std::optional<std::string>& trace_path,
                          const RunSource& source) {
  const auto& [config, gpu, num_gpus, overrides] = source;
  DiagnosedRun d;
  d.run = read_run(run_path, trace_path);
  // A run that carries its config (epx results) is planned with it; --config is for the others.
  if (d.run.config) d.config = *d.run.config;
  else if (config) d.config = load_config_file(resolve_recipe(*config));
  if (!d.config && !overrides.empty())
    throw ConfigError(fmt::format("--override {}: {} carries no config to change; name it with --config", overrides.front(),
                                  run_path));
  if (d.config) {
    for (const std::string& o : overrides) apply_override(*d.config, o, Config::Origin::override_arg);
    // Given here, they are no longer the file's: an error about them cites the option.
    if (gpu) d.config->target.gpu = *gpu, d.config->file_locations.erase("target.gpu");
    if (num_gpus) d.config->target.num_gpus = *num_gpus, d.config->file_locations.erase("target.num_gpus");
    if (!d.config->target.num_gpus && d.run.ranks > 0) d.config->target.num_gpus = d.run.ranks;
    if (!d.config->target.num_gpus)
      throw ConfigError(fmt::format("{}: the world size is said neither in the run nor in its config (a Megatron log "
                                    "says it only in its arguments dump); pass -ng N",
                                    run_path));
    const CheckReport report = run_check(*d.config);
    if (!report.ok()) {
      // Where this command changed the config, those changes first.
      std::vector<std::string> given;
      if (gpu) given.push_back("-g " + *gpu);
      if (num_gpus) given.push_back(fmt::format("-ng {}", *num_gpus));
      for (const std::string& o : overrides) given.push_back("--override " + o);
      const std::string hint = !given.empty() ? fmt::format("; with {} given here: are they the run's?", fmt::join(given, ", "))
                               : config       ? ""
                                              : "; name the right one with --config";
      for (const Finding& f : report.findings)
        if (f.severity == Severity::error)
          throw ConfigError(
              fmt::format("{}: the run's config does not pass epx check: [{}] {}{}", run_path, f.rule_id, f.message, hint));
    }
    d.config = report.resolved;
  }
  if (gpu || (d.config && d.config->target.gpu)) {
    const std::string name = gpu ? *gpu : *d.config->target.gpu;
    d.gpu = find_gpu(name);
    if (d.gpu == nullptr) throw ConfigError(fmt::format("-g {}: not in the hardware catalog; see hardware/catalog.yaml", name));
  }
  try {
    d.diagnosis = diagnose(d.run, d.config, d.gpu);
  } catch (const ConfigError& e) {  // the planner's refusal of the config: whose config it is
    throw ConfigError(fmt::format("{}: its config: {}", d.run.config || !config ? run_path : *config, e.what()));
  }
  return d;
}

}  // namespace epx::cli
