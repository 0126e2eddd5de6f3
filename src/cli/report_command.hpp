// `epx report RUN[:TRACE]... -o report.html [--config C] [-g GPU] [--hardware F]`: one
// self-contained HTML page of one or more runs (configuration and verdict, step time, loss and
// memory per iteration, the three walls, a zoomable timeline of one steady-state iteration per
// rank, the runs side by side).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "run_diagnosis.hpp"

namespace epx::cli {

struct ReportArgs {
  std::vector<std::string> runs;  // RESULTS[:TRACE] or a Megatron log
  std::string output;
  RunSource source;
  std::vector<std::string> hardware;

  void add_to(CLI::App& app);
};

int run_report_command(const ReportArgs& args);

}  // namespace epx::cli
