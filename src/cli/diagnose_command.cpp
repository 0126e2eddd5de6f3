#include "diagnose_command.hpp"

#include <iostream>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/plan/diagnose.hpp"

namespace epx::cli {

void DiagnoseArgs::add_to(CLI::App& app) {
  app.add_option("RUN", run, "an `epx run --results` JSON, or a Megatron training log")->required();
  app.add_option("--trace", trace, "the run's `epx run --trace` file: exposed communication by kind, host gaps");
  app.add_option("--config", config,
                 "the run's config (recipe or YAML) when RUN does not carry it (a Megatron log): for the planner");
  app.add_option("-g,--gpu", gpu, "the hardware the run ran on (default: the config's target.gpu)");
  app.add_option("--hardware", hardware, "a YAML file of hardware entries to add or override (e.g. from --calibrate)");
  app.add_flag("--json", json, "one JSON object: run, binding_wall, why, walls, fixes");
}

int run_diagnose_command(const DiagnoseArgs& args) {
  for (const std::string& file : args.hardware) add_hardware_file(file);
  const RunEvidence run = read_run(args.run, args.trace);
  std::optional<Config> config;
  if (args.config) {
    Config loaded = load_config_file(resolve_recipe(*args.config));
    if (args.gpu) loaded.target.gpu = *args.gpu;
    config = loaded;
  } else if (run.config) {
    config = *run.config;
    if (args.gpu) config->target.gpu = *args.gpu;
  }
  if (config) {
    if (!config->target.num_gpus) config->target.num_gpus = run.ranks;
    const CheckReport report = run_check(*config);
    if (!report.ok()) {
      std::cout << format_report(report) << "epx diagnose: the run's config does not pass the check; fix --config\n";
      return kExitCheckFailed;
    }
    config = report.resolved;
  }
  const GpuInfo* gpu = nullptr;
  if (args.gpu || (config && config->target.gpu)) {
    const std::string name = args.gpu ? *args.gpu : *config->target.gpu;
    gpu = find_gpu(name);
    if (gpu == nullptr) throw ConfigError(fmt::format("-g {}: not in the hardware catalog; see hardware/catalog.yaml", name));
  }
  const Diagnosis d = diagnose(run, config, gpu);
  if (args.json) {
    std::cout << json_text(diagnosis_json(run, d), 2) << "\n";
    return kExitOk;
  }
  std::cout << format_diagnosis(run, d);
  return kExitOk;
}

}  // namespace epx::cli
