// `epx advise CONFIG [overrides] [harness flags] [--have LIST | --probe FILE] [--json]`: the
// seeds' dispatcher selection and tuning for a config that passes `epx check`, backed by the
// planner (src/plan/advise.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "config_args.hpp"

namespace epx::cli {

struct AdviseArgs {
  ConfigArgs config;
  bool json = false;
  std::optional<std::string> have, probe;
  std::vector<std::string> hardware;

  void add_to(CLI::App& app);
};

int run_advise_command(const AdviseArgs& args);

}  // namespace epx::cli
