// `epx launch [--cluster] -- CMD...`: mpirun with what the machine needs, so a user never types
// MCA options: on this machine (more ranks than cores: --oversubscribe), or on the emulated
// cluster of scripts/cluster.sh (its hosts, launch agent, TCP/shared-memory transports and
// interfaces).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace epx::cli {

struct LaunchArgs {
  bool cluster = false;
  std::optional<int> nodes, ranks_per_node, np;
  std::vector<std::string> command;
  bool dry_run = false;

  void add_to(CLI::App& app);
};

// The mpirun command line (argv) for `args`. Throws ConfigError for a cluster that is not up or
// a shape it does not have.
std::vector<std::string> launch_command_line(const LaunchArgs& args, const std::string& self_exe);

// Replaces this process with mpirun (or prints the command line with --dry-run).
int run_launch_command(const LaunchArgs& args);

}  // namespace epx::cli
