// `epx diagnose RUN [--trace TRACE] [--config CONFIG] [--override K=V]... [-g GPU] [-ng N]
// [--hardware FILE] [--json]`: the
// binding wall of a finished run and the fixes for it (src/plan/diagnose.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "run_diagnosis.hpp"

namespace epx::cli {

struct DiagnoseArgs {
  std::string run;
  std::optional<std::string> trace;
  RunSource source;
  std::vector<std::string> hardware;
  bool json = false;

  void add_to(CLI::App& app);
};

int run_diagnose_command(const DiagnoseArgs& args);

}  // namespace epx::cli
