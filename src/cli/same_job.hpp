// Every rank of an MPI job runs the same job: a rank started with another config would wait in
// a collective the others never reach, or exchange rows of another width.
#pragma once

#include <string>

#include "epx/comm/comm.hpp"

namespace epx::cli {

// Compares every rank's `job` (the resolved config as YAML, and what else the command was asked
// for) with rank 0's before any group is made. Throws ConfigError on every rank, naming the first
// rank and line that differ, when one does.
void require_same_job(Communicator& world, const std::string& job);

}  // namespace epx::cli
