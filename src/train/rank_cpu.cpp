#include "rank_cpu.hpp"

#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "epx/comm/collectives.hpp"

namespace epx {

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double cores_per_rank(Communicator& world) {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  const std::vector<std::string> ids = allgather_text(world, boot_id);
  const std::string& mine = ids[static_cast<std::size_t>(world.rank())];  // as gathered (padded)
  const auto sharing = std::count(ids.begin(), ids.end(), mine);  // this rank included
  const long online = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  cpu_set_t set;
  CPU_ZERO(&set);
  const int allowed = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : static_cast<int>(online);
  // An unreadable boot id ("" on every rank) counts every rank as sharing: the cautious floor.
  return std::min(static_cast<double>(allowed), static_cast<double>(online) / static_cast<double>(sharing));
}

}  // namespace epx
