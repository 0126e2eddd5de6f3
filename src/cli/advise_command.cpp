#include "advise_command.hpp"

#include <iostream>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/plan/advise.hpp"
#include "check_warnings.hpp"

namespace epx::cli {

void AdviseArgs::add_to(CLI::App& app) {
  config.add_to(app);
  app.add_flag("--json", json, "one JSON object: recommended, why, dispatchers, tuning, harness_ab, epx_ab, check_warnings (the rules that warned); on check errors {check, advice: null}");
  app.add_option("--have", have,
                 "the flex backends the target container has, e.g. deepep,hybridep or none (default: not stated)");
  app.add_option("--probe", probe,
                 "a probe file written in the target container: 'deepep: true|false' and 'hybridep: true|false'");
  app.add_option("--hardware", hardware, "a YAML file of hardware entries to add or override (as epx plan)")
      ->allow_extra_args(false);  // one value per occurrence: a following override stays one
}

int run_advise_command(const AdviseArgs& args) {
  if (args.have && args.probe) throw ConfigError("--have and --probe both state the backends; give one");
  const BackendAvailability have = args.have ? parse_have_list(*args.have)
                                   : args.probe ? read_probe_file(*args.probe)
                                                : BackendAvailability{};
  for (const std::string& file : args.hardware) add_hardware_file(file);
  const Config loaded = args.config.load_with_world_and_gpu("advice");
  const CheckReport report = run_check(loaded, args.config.flags.moe_flex_dispatcher_backend);
  if (!report.ok()) {
    if (args.json)
      std::cout << json_text({{"check", report_json(report)}, {"advice", nullptr}}, 2) << "\n";
    else
      std::cout << format_report(report) << "epx advise: the check found errors; fix them first\n";
    return kExitCheckFailed;
  }
  const Advice advice = advise(report.resolved, have);
  if (args.json) {
    nlohmann::json j = advice_json(advice);
    j["check_warnings"] = check_warning_ids(report);
    std::cout << json_text(j, 2) << "\n";
    return kExitOk;
  }
  std::cout << format_advice(advice) << check_warnings_line(report, "advise");
  return kExitOk;
}

}  // namespace epx::cli
