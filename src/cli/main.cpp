// `epx`: the command-line front end. Subcommands: check, config, plan, advise, diagnose, report,
// layer, run, launch, bench, list.
#include <algorithm>
#include <functional>
#include <iostream>
#include <new>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "bench_command.hpp"
#include "bench_layer_command.hpp"
#include "config_args.hpp"
#include "epx/base/edit_distance.hpp"
#include "epx/base/error.hpp"
#include "epx/base/omp_env.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/comm/mpi.hpp"
#include "launch_command.hpp"
#include "layer_command.hpp"
#include "plan_command.hpp"
#include "advise_command.hpp"
#include "diagnose_command.hpp"
#include "report_command.hpp"
#include "run_command.hpp"

namespace epx::cli {
namespace {

int run_check_command(const ConfigArgs& args, bool json, bool list_rules) {
  if (list_rules) {
    std::cout << (json ? json_text(rule_table_json(), 2) + "\n" : format_rule_table());
    return 0;
  }
  const CheckReport report = run_check(args.load(), args.flags.moe_flex_dispatcher_backend);
  std::cout << (json ? json_text(report_json(report), 2) + "\n" : format_report(report));
  return report.ok() ? kExitOk : kExitCheckFailed;
}

// CLI11 answers a misspelt or missing command with "A subcommand is required": name it instead,
// with the commands there are and the nearest. Walks the leading words down the command tree;
// "" when the words reach a command that takes arguments.
std::string unknown_command(const CLI::App& app, const std::vector<std::string>& args) {
  const auto commands = [](const CLI::App* at) {
    std::vector<std::string> names;
    for (const CLI::App* sub : at->get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
    return names;
  };
  const CLI::App* at = &app;
  std::string path = "epx";
  for (auto word = args.rbegin(); word != args.rend() && !word->starts_with("-"); ++word) {  // parse order: reversed
    const auto subs = at->get_subcommands([&](const CLI::App* sub) { return sub->get_name() == *word; });
    if (!subs.empty()) {
      at = subs.front();
      path += " " + *word;
      continue;
    }
    if (at->get_require_subcommand_min() == 0) return "";
    const std::string nearest = nearest_name(commands(at), *word);
    return fmt::format("unknown command '{}' for '{}'{}; the commands: {}", *word, path,
                       nearest.empty() ? "" : fmt::format(" (did you mean {}?)", nearest), fmt::join(commands(at), ", "));
  }
  if (at->get_require_subcommand_min() == 0) return "";
  return fmt::format("'{}' needs a command: {}", path, fmt::join(commands(at), ", "));
}

// For an option CLI11 did not expect ("--max-steps"), the nearest option of any command
// ("--max_steps"), as " (did you mean --max_steps?)"; "" when none is close.
std::string nearest_option(const CLI::App& app, const std::vector<std::string>& args) {
  std::vector<std::string> known;
  const std::function<void(const CLI::App*)> collect = [&](const CLI::App* at) {
    for (const CLI::Option* o : at->get_options())
      for (const std::string& name : o->get_lnames()) known.push_back("--" + name);
    for (const CLI::App* sub : at->get_subcommands([](const CLI::App*) { return true; })) collect(sub);
  };
  collect(&app);
  for (const std::string& arg : args) {
    if (arg == "--") break;  // the rest is a command's (epx launch -- ...)
    const std::string word = arg.substr(0, arg.find('='));
    if (!word.starts_with("--") || std::find(known.begin(), known.end(), word) != known.end()) continue;
    if (const std::string best = nearest_name(known, word); !best.empty()) return fmt::format(" (did you mean {}?)", best);
  }
  return "";
}

// What a --json command prints when it refuses: one object, the same keys whatever the cause.
std::string refusal_json(const std::string& kind, const std::string& what, int code) {
  return epx::json_text(nlohmann::json{{"error", what}, {"kind", kind}, {"exit_code", code}}, 2) + "\n";
}

int run_config_show(const ConfigArgs& args) {
  const Config loaded = args.load();
  const Config resolved = resolve_config(loaded, args.flags.moe_flex_dispatcher_backend);
  const std::string note = ignored_note(loaded);
  std::cout << fmt::format("# epx config show: {} (resolved)\n", loaded.source);
  if (!note.empty()) std::cout << "# " << note << "\n";
  std::cout << dump_yaml(resolved);
  return 0;
}

}  // namespace
}  // namespace epx::cli

int main(int argc, char** argv) {
  epx::cap_openmp_spin(argv);
  using namespace epx::cli;
  CLI::App app{"epx: expert-parallel MoE training with communication overlap", "epx"};
  app.require_subcommand(1);

  ConfigArgs check_args;
  bool json = false, list_rules = false;
  auto* check = app.add_subcommand(
      "check", "pre-flight check of an MoE training config (exit 0 ok, 1 errors, 2 bad input)");
  check_args.add_to(*check);
  check->add_flag("--json", json, "machine-readable report");
  check->add_flag("--list-rules", list_rules, "print the rule table and exit");

  auto* config = app.add_subcommand("config", "show the resolved config, or list recipes");
  config->require_subcommand(1);
  ConfigArgs show_args;
  auto* show = config->add_subcommand("show", "print the resolved config as YAML");
  show_args.add_to(*show);
  auto* list = config->add_subcommand("list", "list the shipped recipes");

  PlanArgs plan_args;
  auto* plan = app.add_subcommand(
      "plan", "plan a layout without launching it: process groups, memory per GPU, model FLOPs and the step "
              "time of each dispatcher with and without EP overlap (after epx check passes)");
  plan_args.add_to(*plan);

  AdviseArgs advise_args;
  auto* advise = app.add_subcommand(
      "advise", "dispatcher selection (hardware, EP degree, model family, the backends the container has) and "
                "tuning, backed by the planner's step time and memory, with an A/B plan of command lines");
  advise_args.add_to(*advise);

  DiagnoseArgs diagnose_args;
  auto* diagnose = app.add_subcommand(
      "diagnose", "which wall binds a finished run (memory, communication, compute/host), from its results and trace "
                  "or a Megatron log, and the fixes for it with the planner's predicted effect");
  diagnose_args.add_to(*diagnose);

  ReportArgs report_args;
  auto* report = app.add_subcommand(
      "report", "one self-contained HTML page of one or more runs: configuration and verdict, step time, loss and "
                "memory, the three walls, a timeline of one steady-state iteration per rank, side by side");
  report_args.add_to(*report);

  LayerArgs layer_args;
  auto* layer = app.add_subcommand(
      "layer", "run one MoE layer forward (and backward) on safetensors files");
  layer_args.add_to(*layer);

  RunArgs run_args;
  auto* run = app.add_subcommand(
      "run", "mock pretraining of the recipe's model on this job's ranks (under mpirun or epx launch), "
             "after epx check passes: Megatron's log lines, a summary, --results JSON, --trace");
  run_args.add_to(*run);

  LaunchArgs launch_args;
  auto* launch = app.add_subcommand(
      "launch", "run a command on several ranks: mpirun with the options this machine or the "
                "emulated cluster (--cluster) needs; e.g. epx launch --cluster -- epx layer ...");
  launch_args.add_to(*launch);

  auto* bench = app.add_subcommand("bench", "benchmarks that print tables (run under epx launch)");
  bench->require_subcommand(1);
  BenchDispatchArgs bench_dispatch_args;
  auto* bench_dispatch = bench->add_subcommand(
      "dispatch", "dispatch + combine time and bytes inside / across nodes for each dispatcher");
  bench_dispatch_args.add_to(*bench_dispatch);
  BenchLayerArgs bench_layer_args;
  auto* bench_layer = bench->add_subcommand(
      "layer", "the MoE layer's forward + backward repeated: time per phase, model GFLOP/s, the dense GEMM rate");
  bench_layer_args.add_to(*bench_layer);

  try {
    auto args = normalize_harness_flags(argc, argv);
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::vector<std::string> args = normalize_harness_flags(argc, argv);
    const std::string unknown = unknown_command(app, args);
    // A number past what the option holds (CLI11 says only "Could not convert").
    const std::string range = dynamic_cast<const CLI::ConversionError*>(&e) ? ": not a number this option can hold" : "";
    const std::string what = unknown.empty() ? e.what() + range + nearest_option(app, args) : unknown;
    std::cerr << "epx: error: " << what << "\nRun with --help for the options.\n";
    if (std::find(args.begin(), args.end(), "--json") != args.end())
      std::cout << refusal_json("error", what, epx::kExitBadInput);
    return epx::kExitBadInput;
  }

  // Under mpirun, `layer` runs on every rank. An error on one rank then ends the whole job with
  // that rank's message, rather than leaving the others waiting in a collective.
  std::unique_ptr<epx::MpiSession> mpi;
  // With --json, a refusal is also one JSON object on stdout, so a script reading it gets an
  // answer rather than nothing.
  const bool json_out = (*check && json) || (*plan && plan_args.json) || (*advise && advise_args.json) ||
                        (*diagnose && diagnose_args.json);
  const auto fail = [&](const std::string& kind, const std::string& what, int code) {
    const std::string message = kind + ": " + what;
    if (mpi && mpi->size() > 1) epx::MpiSession::abort_job(message, code);
    std::cerr << "epx: " << message << "\n";
    if (json_out) std::cout << refusal_json(kind, what, code);
    return code;
  };
  try {
    epx::check_omp_num_threads();
    if ((*layer && epx::launched_by_mpirun()) || *bench_dispatch || *bench_layer || *run || (*plan && plan_args.calibrate)) {
      epx::share_cores_with_local_ranks();
      const std::optional<double>& given = *layer ? layer_args.collective_timeout : run_args.collective_timeout;
      const bool has_option = *layer || *run;  // bench has no --collective-timeout
      // --calibrate: the other ranks wait while rank 0 trains the model alone, for minutes on a
      // large proxy; an hour unless EPX_COLLECTIVE_TIMEOUT says otherwise.
      const double fallback = *plan ? 3600 : epx::kDefaultCollectiveTimeoutS;
      mpi = std::make_unique<epx::MpiSession>(has_option && given ? *given : epx::collective_timeout_from_env(fallback));
    }
    if (*check) return run_check_command(check_args, json, list_rules);
    if (*show) return run_config_show(show_args);
    if (*plan) return run_plan_command(plan_args, mpi.get());
    if (*advise) return run_advise_command(advise_args);
    if (*diagnose) return run_diagnose_command(diagnose_args);
    if (*report) return run_report_command(report_args);
    if (*layer) return run_layer_command(layer_args, mpi.get());
    if (*run) return run_run_command(run_args, *mpi);
    if (*launch) return run_launch_command(launch_args);
    if (*bench_dispatch) return run_bench_dispatch(bench_dispatch_args, *mpi);
    if (*bench_layer) return run_bench_layer(bench_layer_args, *mpi);
    if (*list) {
      for (const auto& name : epx::list_recipes()) std::cout << name << "\n";
      return 0;
    }
  } catch (const epx::ConfigError& e) {
    return fail("error", e.what(), epx::kExitBadInput);
  } catch (const epx::InputError& e) {
    return fail("error", e.what(), epx::kExitBadInput);
  } catch (const epx::EnvironmentError& e) {
    return fail("environment error", e.what(), epx::kExitEnvironment);
  } catch (const epx::TrainingDiverged& e) {
    return fail("error", e.what(), epx::kExitDiverged);
  } catch (const std::bad_alloc&) {  // a shape past this machine's memory, not a bug
    return fail("environment error",
                "out of memory: the job needs more memory than this machine gives it; `epx plan CONFIG -g cpu "
                "-ng RANKS` gives its peak per rank, and a smaller shape (hidden size, experts, sequence, micro-batch) "
                "fits",
                epx::kExitEnvironment);
  } catch (const std::exception& e) {
    return fail("internal error", e.what(), epx::kExitInternal);
  }
  return 0;
}
