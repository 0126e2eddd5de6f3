#include "launch_command.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <ranges>
#include <thread>

#include <fmt/format.h>

#include "cluster_env.hpp"
#include "epx/base/error.hpp"
#include "number_validators.hpp"

extern char** environ;

namespace epx::cli {
namespace {

// The cluster's state, with the lines the launch needs.
std::map<std::string, std::string> cluster_state() {
  const std::string path = cluster_env_path();
  std::map<std::string, std::string> kv = read_cluster_env();
  if (kv.empty())
    throw ConfigError(fmt::format("--cluster: no emulated cluster is up ({} not found); bring one up "
                                  "with: scripts/cluster.sh up --nodes 2 --ranks-per-node 2 --link-gbit 1",
                                  path));
  for (const char* key : {"nodes", "ranks_per_node", "subnet", "agent"})
    if (!kv.count(key) || kv.at(key).empty())
      throw ConfigError(fmt::format("{}: no '{}' line (or an empty one); run scripts/cluster.sh up again", path, key));
  return kv;
}

// A count of the cluster's state (nodes, ranks per node): a whole number from 1 to kMaxCount.
constexpr int kMaxCount = 4096;
int cluster_count(const std::map<std::string, std::string>& kv, const char* key) {
  const std::string& text = kv.at(key);
  const std::optional<std::int64_t> v = whole_number(text, 1, kMaxCount);
  if (!v)
    throw ConfigError(fmt::format("{}: {}={}: not a whole number from 1 to {}; run scripts/cluster.sh up again",
                                  cluster_env_path(), key, text, kMaxCount));
  return static_cast<int>(*v);
}

// An argument as a POSIX shell reads it back: quoted unless it is plain.
std::string shell_quoted(const std::string& arg) {
  const bool plain = !arg.empty() && arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                           "0123456789_-+=/.,:@%") == std::string::npos;
  if (plain) return arg;
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Variables epx and its tests read, passed on to every rank (mpirun starts remote ranks with a
// fresh environment).
bool forwarded(const std::string& name) {
  for (const char* prefix : {"EPX_", "NUM_OF_", "OMP_", "ASAN_", "UBSAN_", "GTEST_"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

}  // namespace

void LaunchArgs::add_to(CLI::App& app) {
  app.add_flag("--cluster", cluster, "run on the emulated cluster of scripts/cluster.sh");
  app.add_option("--nodes", nodes, "with --cluster: use the first N nodes (default: all)")->check(kPositive);
  app.add_option("--ranks-per-node", ranks_per_node,
                 "with --cluster: ranks on each node (default: the cluster's)")
      ->check(kPositive);
  app.add_option("-n,--np", np, "without --cluster: the number of ranks (default 2)")->check(kPositive);
  app.add_flag("--dry-run", dry_run, "print the mpirun command line instead of running it");
  app.add_option("command", command, "the command every rank runs, after --; 'epx' means this epx")
      ->required();
}

std::vector<std::string> launch_command_line(const LaunchArgs& args, const std::string& self_exe) {
  std::vector<std::string> argv = {"mpirun"};
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");
  argv.push_back("--oversubscribe");
  if (args.cluster) {
    const auto kv = cluster_state();
    const int have_nodes = cluster_count(kv, "nodes"), have_rpn = cluster_count(kv, "ranks_per_node");
    const int nodes = args.nodes.value_or(have_nodes), rpn = args.ranks_per_node.value_or(have_rpn);
    if (nodes > have_nodes)
      throw ConfigError(fmt::format("--nodes {}: the emulated cluster has {} nodes; bring up a bigger "
                                    "one with scripts/cluster.sh up --nodes {}",
                                    nodes, have_nodes, nodes));
    if (args.np) throw ConfigError("--np is for local runs; on the cluster use --nodes and --ranks-per-node");
    if (rpn > kMaxCount)
      throw ConfigError(fmt::format("--ranks-per-node {}: at most {} (each rank is a process on this machine)", rpn,
                                    kMaxCount));
    std::string hosts;
    for (int i = 0; i < nodes; ++i) hosts += fmt::format("{}epxnode{}:{}", i ? "," : "", i, rpn);
    const std::string subnet = kv.at("subnet");
    argv.insert(argv.end(), {"--mca", "plm_rsh_agent", kv.at("agent"), "--mca", "oob_tcp_if_include", subnet,
                             "--mca", "btl_tcp_if_include", subnet, "--mca", "btl", "self,vader,tcp",
                             "--map-by", "slot", "-H", hosts, "-np", std::to_string(nodes * rpn)});
    // Every emulated node is this machine: mpirun would bind each node's first rank to core 0,
    // so all nodes' ranks would share one core. Leave placement to the kernel and split the
    // cores between all the ranks.
    argv.insert(argv.end(), {"--bind-to", "none"});
    if (!std::getenv("OMP_NUM_THREADS")) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      argv.insert(argv.end(), {"-x", fmt::format("OMP_NUM_THREADS={}", std::max(1, cores / (nodes * rpn)))});
    }
  } else {
    if (args.nodes || args.ranks_per_node) throw ConfigError("--nodes and --ranks-per-node need --cluster");
    if (args.np.value_or(2) > kMaxCount)
      throw ConfigError(fmt::format("--np {}: at most {} (each rank is a process on this machine)", *args.np, kMaxCount));
    argv.insert(argv.end(), {"-np", std::to_string(args.np.value_or(2))});
  }
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    const std::string name = var.substr(0, var.find('='));
    if (forwarded(name)) argv.insert(argv.end(), {"-x", name});
  }
  for (std::size_t i = 0; i < args.command.size(); ++i)
    argv.push_back(i == 0 && args.command[0] == "epx" ? self_exe : args.command[i]);
  return argv;
}

// Whether `name` runs: an executable file at a path, or found on PATH as execvp finds it. mpirun
// would end with its own exit code above 128 for one that does not.
bool runnable(const std::string& name) {
  const auto executable = [](const std::filesystem::path& p) {
    std::error_code ec;
    return std::filesystem::is_regular_file(p, ec) && access(p.c_str(), X_OK) == 0;
  };
  if (name.empty()) return false;
  if (name.find('/') != std::string::npos) return executable(name);
  const char* path = std::getenv("PATH");
  for (const auto dir : std::views::split(std::string_view(path ? path : ""), ':'))
    if (executable(std::filesystem::path(std::string_view(dir.begin(), dir.end())) / name)) return true;
  return false;
}

int run_launch_command(const LaunchArgs& args) {
  if (!args.command.empty() && args.command[0] != "epx" && !runnable(args.command[0]))
    throw ConfigError(fmt::format("command '{}': no such executable file{}; give a path to one, or a program on PATH "
                                  "('epx' means this epx)",
                                  args.command[0], args.command[0].find('/') == std::string::npos ? " on PATH" : ""));
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();
  const std::vector<std::string> line = launch_command_line(args, self);
  if (args.dry_run) {
    for (std::size_t i = 0; i < line.size(); ++i) std::cout << (i ? " " : "") << shell_quoted(line[i]);
    std::cout << "\n";
    return 0;
  }
  std::vector<char*> argv;
  for (const auto& a : line) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  throw EnvironmentError(fmt::format("could not start mpirun: {} (Debian: apt-get install openmpi-bin)",
                                     std::strerror(errno)));
}

}  // namespace epx::cli
