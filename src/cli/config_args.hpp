// The arguments every config-reading subcommand takes: RECIPE|FILE, dotted overrides, the
// performance harness's flags and the target environment.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "epx/config/config.hpp"

namespace epx::cli {

struct ConfigArgs {
  std::vector<std::string> positional;  // RECIPE|FILE then overrides (only overrides with --config)
  OptString config_file;                // --config C: the recipe or file, named by option
  HarnessFlags flags;
  std::optional<std::string> moe_a2a_overlap;  // as typed; parsed like the harness's str2bool
  OptString torch_version, te_version;
  // The harness's run identity (so its command lines paste as they are): the model is the
  // recipe's; -mr names the recipe the harness couples flags by; --task and -c are checked.
  OptString model_family, model_recipe, task, compute_dtype, config_variant, tokenizer_type;

  void add_to(CLI::App& app);
  // Load the recipe, apply overrides, then flags (flags win). Throws ConfigError.
  Config load() const;
  // The file the config is read from, as load() finds it (a recipe's in recipes/), if one is found:
  // an output must not replace it.
  std::optional<std::string> file() const;
  // load(), for a command that needs the world size and the GPU (plan, advise): a ConfigError
  // asking for -ng / -g when either is missing.
  Config load_with_world_and_gpu(const std::string& command) const;
};

// The harness spells some flags with one dash and two letters (-ep, -tp, ...), which CLI11
// reads as bundled short flags; rewrite them to their long form first.
std::vector<std::string> normalize_harness_flags(int argc, char** argv);

}  // namespace epx::cli
