#include "plan_command.hpp"

#include <iostream>

#include <fmt/format.h>

#include "calibrate_command.hpp"
#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/plan/plan.hpp"
#include "epx/plan/search.hpp"
#include "check_warnings.hpp"
#include "number_validators.hpp"

namespace epx::cli {

void PlanArgs::add_to(CLI::App& app) {
  config.add_to(app);
  app.add_flag("--json", json, "one JSON object: layout, flops_per_token, fits, memory_gb (GiB), variants, check_warnings (the rules that warned); with --search the ranked rows; on check errors {check, plan: null}");
  app.add_option("--ranks", ranks, "print every rank's node and its index in each group (the first N ranks)")
      ->expected(0, 1)
      ->default_str("256")
      ->check(kPositive);
  app.add_flag("--search", search,
               "enumerate layouts (TP, PP, VPP, CP, EP, micro-batch, recompute, dispatcher, overlap) that pass "
               "epx check and fit, best 10 by predicted throughput");
  app.add_flag("--calibrate", calibrate,
               "measure this machine for -g cpu (one core's GEMM and memory rates, epx's end-to-end efficiency "
               "on CONFIG's model, the emulated link) and print it as a hardware file for --hardware");
  app.add_option("--hardware", hardware,
                 "a YAML file of hardware entries (the keys of hardware/catalog.yaml) to add or override")
      ->allow_extra_args(false);  // one value per occurrence: a following override stays one
}

int run_plan_command(const PlanArgs& args, MpiSession* mpi) {
  if (args.calibrate) {
    // One process and one core on CONFIG's model (with its overrides): the layout and target
    // flags have nothing to set there, and were ignored.
    const HarnessFlags& f = args.config.flags;
    std::vector<std::string> layout_flags;
    for (const auto& [flag, given] : {std::pair{"-tp", f.tp.has_value()}, {"-pp", f.pp.has_value()}, {"-cp", f.cp.has_value()},
                                      {"-ep", f.ep.has_value()}, {"-et", f.et.has_value()}, {"-vp", f.vp.has_value()},
                                      {"-g", f.gpu.has_value()}, {"-ng", f.num_gpus.has_value()},
                                      {"-gn", f.gpus_per_node.has_value()}})
      if (given) layout_flags.push_back(flag);
    if (args.json || args.search)
      throw ConfigError(fmt::format("--calibrate prints this machine's hardware entry as YAML (for --hardware); {} "
                                    "does not apply to it: drop it",
                                    args.json ? "--json" : "--search"));
    if (!layout_flags.empty())
      throw ConfigError(fmt::format("--calibrate measures this machine on one process with the model alone (TP, EP, "
                                    "the GPU and the world do not apply): drop {}",
                                    fmt::join(layout_flags, " ")));
    ConfigArgs config = args.config;
    if (config.positional.empty() && !config.config_file) config.positional = {"qwen3_30b_a3b_proxy"};
    const Config loaded = config.load();
    const ModelConfig& m = loaded.model;
    for (const auto& [key, size] : {std::pair{"model.tensor_model_parallel_size", m.tensor_model_parallel_size},
                                    {"model.pipeline_model_parallel_size", m.pipeline_model_parallel_size},
                                    {"model.context_parallel_size", m.context_parallel_size},
                                    {"model.expert_tensor_parallel_size", m.expert_tensor_parallel_size.value_or(1)}})
      if (size > 1)
        throw ConfigError(fmt::format("{}={}: --calibrate runs the model on one process; set it to 1 (the planner "
                                      "scales the measured rates to any layout)",
                                      loaded.cite(key), size));
    std::cout << calibrate_cpu(loaded, mpi->world()) << std::flush;
    return kExitOk;
  }
  for (const std::string& file : args.hardware) add_hardware_file(file);
  const Config loaded = args.config.load_with_world_and_gpu("a plan");
  if (args.search) {
    const SearchResult r = search_layouts(loaded, args.config.flags.moe_flex_dispatcher_backend);
    if (args.json)
      std::cout << json_text(search_json(r), 2) << "\n";
    else
      std::cout << fmt::format("epx plan --search: {} on {} x {}\n", loaded.source, *loaded.target.num_gpus, *loaded.target.gpu)
              << format_search(r);
    return r.top.empty() ? kExitCheckFailed : kExitOk;
  }
  const CheckReport report = run_check(loaded, args.config.flags.moe_flex_dispatcher_backend);
  if (!report.ok()) {
    if (args.json)
      std::cout << json_text({{"check", report_json(report)}, {"plan", nullptr}}, 2) << "\n";
    else
      std::cout << format_report(report) << "epx plan: the check found errors; fix them to plan this layout\n";
    return kExitCheckFailed;
  }
  Plan plan = make_plan(report.resolved);
  check_variants(plan, report.resolved);
  if (args.json) {
    nlohmann::json j = plan_json(plan);
    j["check_warnings"] = check_warning_ids(report);
    std::cout << json_text(j, 2) << "\n";
    return kExitOk;
  }
  std::cout << fmt::format("epx plan: {}\n", report.resolved.source) << format_plan(plan);
  if (args.ranks) std::cout << format_rank_map(plan.layout, *args.ranks);
  std::cout << check_warnings_line(report, "plan");
  return kExitOk;
}

}  // namespace epx::cli
