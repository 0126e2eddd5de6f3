// `epx plan --calibrate`: measures this machine for the planner's `cpu` entry and writes it as
// a hardware file (`--hardware FILE` reads it back).
#pragma once

#include <string>

#include "epx/comm/comm.hpp"

namespace epx::cli {

// Collective over `world` (one process, or `epx launch -n 2` to measure the link between ranks
// 0 and 1). Returns, on rank 0, the YAML text of the measured `cpu` entry (empty elsewhere);
// `recipe` is the model whose one-rank `epx run` loop sets the end-to-end efficiency.
std::string calibrate_cpu(const Config& loaded, Communicator& world);

}  // namespace epx::cli
