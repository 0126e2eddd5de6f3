// `epx bench layer`: the MoE layer's forward + backward repeated on this job's ranks (under `epx
// launch`), timed per phase from the layer's own trace scopes, with the dense GEMM rate measured
// in the same process for reference.
#pragma once

#include <cstdint>
#include <optional>

#include <CLI/CLI.hpp>

#include "config_args.hpp"
#include "epx/comm/mpi.hpp"

namespace epx::cli {

struct BenchLayerArgs {
  ConfigArgs config;
  int repeat = 10, warmup = 2;
  std::optional<std::int64_t> tokens;  // per rank; default seq_length x micro_batch_size
  bool json = false;

  void add_to(CLI::App& app);
};

int run_bench_layer(const BenchLayerArgs& args, MpiSession& mpi);

}  // namespace epx::cli
