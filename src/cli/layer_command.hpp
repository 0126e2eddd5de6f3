// `epx layer`: one MoE layer forward (and backward) on tensors from safetensors files.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/config_args.hpp"

namespace epx::cli {

struct LayerArgs {
  ConfigArgs config;
  std::string weights, input, out;
  std::optional<std::string> grad_output;
  std::optional<std::uint64_t> init_seed;

  void add_to(CLI::App& app);
};

int run_layer_command(const LayerArgs& args);

}  // namespace epx::cli
