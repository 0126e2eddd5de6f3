// `epx plan --calibrate`: measures this machine for the planner's `cpu` entry and writes it as
// a hardware file (`--hardware FILE` reads it back).
#pragma once

#include <string>

namespace epx::cli {

// Returns the YAML text of the measured `cpu` entry; `recipe` is the model whose one-rank
// forward + backward sets the end-to-end efficiency.
std::string calibrate_cpu(const std::string& recipe);

}  // namespace epx::cli
