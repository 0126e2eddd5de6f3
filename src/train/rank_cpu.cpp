#include "rank_cpu.hpp"

#include <sched.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "epx/comm/collectives.hpp"

namespace epx {
namespace {

// The CPUs this process may run on.
std::set<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::set<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.insert(c);
  return cpus;
}

// The cgroup's CPU quota in cores (cgroup v2 cpu.max: "QUOTA PERIOD" or "max PERIOD"); 0: none.
double cgroup_quota_cores() {
  std::ifstream in("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max" || period <= 0) return 0;
  try {
    return std::stod(quota) / period;
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

double cores_per_rank(Communicator& world) {
  // Every rank's "BOOT_ID CPU CPU ...": the ranks with this rank's boot id share its machine.
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  if (boot_id.empty()) boot_id = "unknown";  // then every rank counts as sharing: the cautious floor
  const std::set<int> mine = allowed_cpus();
  std::ostringstream text;
  text << boot_id;
  for (int c : mine) text << ' ' << c;
  std::set<int> machine_cpus;
  int sharing = 0;  // this rank's own entry included: at least 1
  for (const std::string& rank : allgather_text(world, text.str())) {
    std::istringstream in(rank);
    std::string id;
    in >> id;
    if (id != boot_id) continue;
    ++sharing;
    for (int c; in >> c;) machine_cpus.insert(c);
  }
  // The CPUs the machine's ranks may use between them, shared evenly; at most this rank's own.
  double cores = static_cast<double>(std::max<std::size_t>(1, machine_cpus.size())) / sharing;
  cores = std::min(cores, static_cast<double>(std::max<std::size_t>(1, mine.size())));
  if (const double quota = cgroup_quota_cores(); quota > 0) cores = std::min(cores, quota / sharing);
  return cores;
}

}  // namespace epx
