// `epx run RECIPE [flags] [overrides]`: mock pretraining on this job's ranks (under mpirun or
// `epx launch`), after `epx check` passes. Megatron's log lines per iteration, then a summary;
// --results writes it all as JSON with the resolved config, --trace a Chrome / Perfetto trace.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "config_args.hpp"
#include "epx/comm/mpi.hpp"

namespace epx::cli {

struct RunArgs {
  ConfigArgs config;
  std::string mock_data = "random";
  std::optional<int> steady_first;  // None: 3, as the seeds (or 1 for a shorter --steady-to)
  int steady_last = 0;
  std::optional<std::string> results, trace;
  std::optional<double> collective_timeout;

  void add_to(CLI::App& app);
};

int run_run_command(const RunArgs& args, MpiSession& mpi);

}  // namespace epx::cli
