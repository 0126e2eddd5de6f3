#include "run_command.hpp"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <iostream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/config/scheduler_steps.hpp"
#include "epx/plan/plan.hpp"
#include "epx/train/trainer.hpp"
#include "number_validators.hpp"
#include "same_job.hpp"

namespace epx::cli {
namespace {

// The memory this process may still take, in bytes: /proc/meminfo's MemAvailable, less where a
// cgroup (a container) limits it below that; 0 if unknown.
double available_memory_bytes() {
  double available = 0;
  std::ifstream in("/proc/meminfo");
  for (std::string key; in >> key;) {
    double kib = 0;
    in >> kib;
    if (key == "MemAvailable:") available = kib * 1024;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  double limit = 0, used = 0;  // cgroup v2; "max" reads as no number
  if (std::ifstream("/sys/fs/cgroup/memory.max") >> limit && std::ifstream("/sys/fs/cgroup/memory.current") >> used)
    available = available > 0 ? std::min(available, limit - used) : limit - used;
  return available;
}

// The ranks on this machine: those that share its boot id (the emulated cluster's nodes are
// namespaces of one machine, and MPI counts each as a node of its own).
int ranks_on_this_machine(Communicator& world) {
  std::string id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id;
  std::vector<std::string> ids = allgather_text(world, id);
  for (std::string& s : ids) s.erase(s.find_last_not_of(' ') + 1);  // allgather_text pads with spaces
  return static_cast<int>(std::count(ids.begin(), ids.end(), id));
}

// A model past this machine's memory would grow until the OOM killer ends a rank (or the machine
// swaps for minutes): refused before any allocation, by the planner's count of a rank's peak
// (above epx run's measured one on the proxies), times the ranks on this machine.
void check_host_memory(const Config& resolved, int local_ranks) {
  const double available = available_memory_bytes();
  if (available <= 0) return;
  double per_rank = 0;
  try {
    per_rank = make_plan(resolved).memory.peak();
  } catch (const ConfigError&) {
    return;  // a config the planner cannot count: the run itself will say what it cannot do
  }
  if (per_rank * local_ranks <= available) return;
  throw ConfigError(fmt::format("the planner puts each rank's peak at {:.3g} GiB, {:.3g} GiB for the {} rank(s) on this "
                                "machine, but it has {:.3g} GiB available; shrink the model (model.hidden_size, "
                                "num_layers, vocab_size, seq_length) or the micro-batch, or run fewer ranks here",
                                per_rank / 1073741824.0, per_rank * local_ranks / 1073741824.0, local_ranks,
                                available / 1073741824.0));
}

}  // namespace

namespace {

// The resolved config as JSON (from its YAML dump: numbers, booleans and nulls typed).
nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    nlohmann::json o = nlohmann::json::object();
    for (const auto& kv : n) o[kv.first.as<std::string>()] = yaml_to_json(kv.second);
    return o;
  }
  if (n.IsSequence()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& e : n) a.push_back(yaml_to_json(e));
    return a;
  }
  if (n.IsNull()) return nullptr;
  const std::string s = n.Scalar();
  if (n.Tag() != "!") {  // unquoted: try the YAML types
    if (s == "true" || s == "false") return s == "true";
    if (s == "null" || s == "~") return nullptr;
    try {
      std::size_t used = 0;
      const long long i = std::stoll(s, &used);
      if (used == s.size()) return i;
      const double d = std::stod(s, &used);
      if (used == s.size()) return d;
    } catch (const std::exception&) {
    }
  }
  return s;
}

}  // namespace

void RunArgs::add_to(CLI::App& app) {
  config.add_to(app);
  app.add_option("--mock-data", mock_data,
                 "random: uniform tokens (NullTokenizer mock data); pattern: a learnable cycle, the loss falls towards 0")
      ->check(CLI::IsMember({"random", "pattern"}));
  app.add_option("--steady-from", steady_first, "first iteration of the summary's mean step time (default 3, as the seeds)")
      ->check(kPositive);
  app.add_option("--steady-to", steady_last, "last iteration of the mean (default: the last)")->check(kPositive);
  app.add_option("--results", results, "write the per-iteration figures, the summary and the resolved config as JSON");
  app.add_option("--trace", trace, "write a Chrome / Perfetto trace: compute, communication and gradient-reduction tracks per rank");
  app.add_option("--collective-timeout", collective_timeout,
                 "abort the job when a collective waits longer than this many seconds (default: "
                 "EPX_COLLECTIVE_TIMEOUT, else 300)")
      ->check(kCollectiveTimeout);
}

int run_run_command(const RunArgs& args, MpiSession& mpi) {
  if (args.steady_first && args.steady_last > 0 && *args.steady_first > args.steady_last)
    throw ConfigError(fmt::format("--steady-from {} is after --steady-to {}: the mean needs a range of iterations; set "
                                  "--steady-to {} or more",
                                  *args.steady_first, args.steady_last, *args.steady_first));
  // Outputs first, so a path that cannot be written is refused before any rank computes (rank 0
  // writes both; its error takes the whole job down).
  if (mpi.rank() == 0) {
    // Neither may replace the config file, nor the other.
    std::vector<NamedPath> files;
    if (const auto config = args.config.file()) files.push_back({"the config", *config});
    if (args.results) {
      check_output_path(*args.results, "--results", files);
      files.push_back({"--results", *args.results});
    }
    if (args.trace) check_output_path(*args.trace, "--trace", files);
  }
  Config loaded = args.config.load();
  // The job's ranks are the world, on epx's own CPU runtime whatever GPU the config names for
  // `epx check`; a world set on the command line must be theirs.
  if (loaded.set_on_command_line("target.num_gpus") && loaded.target.num_gpus && *loaded.target.num_gpus != mpi.size())
    throw ConfigError(fmt::format("target.num_gpus={}: epx run trains on the job's {} ranks; launch {} (epx launch -n {} "
                                  "-- epx run ...) or leave the world size unset",
                                  *loaded.target.num_gpus, mpi.size(), *loaded.target.num_gpus, *loaded.target.num_gpus));
  loaded.target.num_gpus = mpi.size();
  // The same for the GPU: epx run trains on this machine's CPU runtime, and its results say so
  // (epx diagnose rates the run against that); a recipe's GPU is for epx check and plan.
  if (loaded.set_on_command_line("target.gpu") && loaded.target.gpu && *loaded.target.gpu != "cpu")
    throw ConfigError(fmt::format("target.gpu={}: epx run trains on this machine's CPU runtime, not on a {}; drop -g or "
                                  "target.gpu (epx check, plan and advise take it)",
                                  *loaded.target.gpu, *loaded.target.gpu));
  loaded.target.gpu = "cpu";
  // The flags too, as typed: every rank takes part in writing the trace, and a rank without it
  // would leave the others waiting.
  require_same_job(mpi.world(), fmt::format("{}--mock-data {}\n--steady-from {}\n--steady-to {}\n--results {}\n--trace {}\n",
                                            dump_yaml(loaded), args.mock_data,
                                            args.steady_first ? std::to_string(*args.steady_first) : "(default)",
                                            args.steady_last > 0 ? std::to_string(args.steady_last) : "(the last)",
                                            args.results.value_or("(none)"), args.trace.value_or("(none)")));
  // Ranks over several nodes (the emulated cluster): the config records the ranks per node, so
  // the results say where the job ran (`epx diagnose` plans it as it was).
  const std::vector<int> nodes = node_of_each_rank(mpi.world());
  std::map<int, int> per_node;
  for (int n : nodes) ++per_node[n];
  if (per_node.size() > 1 && !loaded.target.gpus_per_node && !args.config.flags.gpus_per_node) {
    int most = 0;
    for (const auto& [node, ranks] : per_node) most = std::max(most, ranks);
    loaded.target.gpus_per_node = most;
  }
  CheckReport report = run_check(loaded, args.config.flags.moe_flex_dispatcher_backend);
  // A world the layout does not fold is fixed by the job's rank count, not a setting.
  for (Finding& f : report.findings)
    for (const std::string key : {"target.num_gpus=", "-ng "})
      if (const auto at = f.fix.find(key); at != std::string::npos) {
        const auto end = std::min(f.fix.find(' ', at + key.size()), f.fix.size());
        const std::string n = f.fix.substr(at + key.size(), end - at - key.size());
        f.fix.replace(at, end - at, fmt::format("(launch {} ranks: epx launch -n {} -- epx run ...)", n, n));
      }
  const std::string text = format_report(report);
  if (!report.ok()) {
    if (mpi.rank() == 0) std::cout << text << "epx run: the check found errors; not starting\n" << std::flush;
    return kExitCheckFailed;
  }
  if (mpi.rank() == 0) {  // the warnings (what Megatron would warn of, or change) and advice, then the verdict
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
      if (line.starts_with("warning") || line.starts_with("advice")) std::cout << "epx check: " << line << "\n";
    const auto verdict = text.rfind("verdict:");
    std::cout << "epx check: " << text.substr(verdict == std::string::npos ? 0 : verdict) << std::flush;
  }
  // The steady state inside the run (a range past its end was clamped to the last iteration).
  if (const OptInt iterations = train_iterations(report.resolved)) {
    for (const auto& [flag, at] : {std::pair{"--steady-from", args.steady_first.value_or(0)}, {"--steady-to", args.steady_last}})
      if (at > *iterations)
        throw ConfigError(fmt::format("{} {}: the run has {} iterations; give an iteration of it (or more with "
                                      "--max_steps)",
                                      flag, at, *iterations));
  }
  check_host_memory(report.resolved, ranks_on_this_machine(mpi.world()));
  TrainOptions options;
  options.data = MockData::parse_mode(args.mock_data);
  options.steady_first = args.steady_first.value_or(3);
  options.steady_last = args.steady_last;
  options.trace_path = args.trace;
  options.progress_bar = isatty(STDERR_FILENO) && isatty(STDOUT_FILENO);
  const TrainResult result = train(report.resolved, mpi.world(), options, std::cout);
  if (args.results && mpi.rank() == 0) {
    nlohmann::json j = result.to_json();
    j["config"] = yaml_to_json(YAML::Load(dump_yaml(report.resolved)));
    j["ranks"] = mpi.size();
    j["mock_data"] = args.mock_data;
    write_file_atomically(*args.results, [&](std::ostream& out) { out << json_text(j, 2) << "\n"; });
    std::cout << "wrote the results to " << *args.results << "\n";
  }
  return 0;
}

}  // namespace epx::cli
