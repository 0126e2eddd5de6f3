// `epx layer`: one MoE layer forward (and backward) on tensors from safetensors files; on one
// process, or under mpirun with the experts sharded by EP (and ETP) and the tokens split over
// the ranks, reading and writing the same files.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "config_args.hpp"
#include "epx/comm/mpi.hpp"

namespace epx::cli {

struct LayerArgs {
  ConfigArgs config;
  std::string weights, input, out;
  std::optional<std::string> grad_output;
  std::optional<std::uint64_t> init_seed;
  std::optional<double> collective_timeout;  // seconds; else EPX_COLLECTIVE_TIMEOUT, else 300

  void add_to(CLI::App& app);
};

// `mpi`: the job's MPI session when launched by mpirun, else null.
int run_layer_command(const LayerArgs& args, MpiSession* mpi);

}  // namespace epx::cli
