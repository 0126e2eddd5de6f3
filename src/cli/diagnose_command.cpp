#include "diagnose_command.hpp"

#include <iostream>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "run_diagnosis.hpp"

namespace epx::cli {

void DiagnoseArgs::add_to(CLI::App& app) {
  app.add_option("RUN", run, "an `epx run --results` JSON, or a Megatron training log")->required();
  app.add_option("--trace", trace, "the run's `epx run --trace` file: exposed communication by kind, host gaps");
  add_run_source_options(app, source);
  app.add_option("--hardware", hardware, "a YAML file of hardware entries to add or override (e.g. from --calibrate)")
      ->allow_extra_args(false);  // one value per occurrence: a following override stays one
  app.add_flag("--json", json, "one JSON object: run, binding_wall, why, walls, fixes");
}

int run_diagnose_command(const DiagnoseArgs& args) {
  for (const std::string& file : args.hardware) add_hardware_file(file);
  const DiagnosedRun d = diagnose_run(args.run, args.trace, args.source);
  if (args.source.config && d.run.config)
    throw ConfigError(fmt::format("--config {}: {} carries the config it ran with; change it with --override KEY=VALUE",
                                  *args.source.config, args.run));
  if (args.json) {
    std::cout << json_text(diagnosis_json(d.run, d.diagnosis), 2) << "\n";
    return kExitOk;
  }
  std::cout << format_diagnosis(d.run, d.diagnosis);
  return kExitOk;
}

}  // namespace epx::cli
