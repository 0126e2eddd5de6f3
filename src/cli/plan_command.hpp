// `epx plan CONFIG [overrides] [harness flags] [--json] [--ranks [N]] [--hardware FILE]`: runs
// `epx check` first and plans only a config that passes (src/plan/).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "config_args.hpp"
#include "epx/comm/mpi.hpp"

namespace epx::cli {

struct PlanArgs {
  ConfigArgs config;
  bool json = false;
  bool search = false;
  bool calibrate = false;
  std::optional<int> ranks;            // print the rank map (its first N ranks)
  std::vector<std::string> hardware;   // extra hardware catalog files

  void add_to(CLI::App& app);
};

// `mpi` is set for --calibrate (which measures over the launched ranks), null otherwise.
int run_plan_command(const PlanArgs& args, MpiSession* mpi);

}  // namespace epx::cli
