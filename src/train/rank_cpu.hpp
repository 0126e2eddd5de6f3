// The cores a rank has. On a machine whose cores the ranks share (the emulated cluster: every node
// is this machine), the rank's CPU time per iteration (epx/base/cpu_clock.hpp, the process clock)
// over these cores is the floor of its step once overlap hides its waits.
#pragma once

#include "epx/comm/comm.hpp"

namespace epx {

// The cores this rank has: the CPUs the ranks on its machine (the same kernel, by boot id, which
// the emulated cluster's namespaces share) may run on between them, divided by those ranks; at
// most the CPUs its own affinity allows, and its share of a cgroup CPU quota (cpu.max).
// Collective over `world`.
double cores_per_rank(Communicator& world);

}  // namespace epx
