// `epx bench dispatch`: dispatch + combine time and the bytes each dispatcher sends inside and
// across nodes, for alltoall, deepep and hybridep over top-k and hidden sizes; run it under
// `epx launch` (on the emulated cluster: --cluster).
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "epx/comm/mpi.hpp"

namespace epx::cli {

struct BenchDispatchArgs {
  std::int64_t tokens = 1024, experts = 32;
  std::string topk = "2,4,8", hidden = "1024,2048,4096", dispatchers = "alltoall,deepep,hybridep";
  int iters = 3, num_sms = 20, chunk = 64;

  void add_to(CLI::App& app);
};

int run_bench_dispatch(const BenchDispatchArgs& args, MpiSession& mpi);

}  // namespace epx::cli
