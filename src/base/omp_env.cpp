#include "epx/base/omp_env.hpp"

#include <cstdlib>

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

namespace epx {

void cap_openmp_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  ::setenv("GOMP_SPINCOUNT", "10000", 1);
  ::execv("/proc/self/exe", argv);  // only returns on failure: carry on with the defaults
}

void share_cores_with_local_ranks() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local == nullptr || std::getenv("OMP_NUM_THREADS")) return;
  const int ranks = std::max(1, std::atoi(local));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // mpirun may bind each rank to its own cores: then use those, else share the machine's.
  cpu_set_t set;
  CPU_ZERO(&set);
  const int allowed = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : cores;
  omp_set_num_threads(allowed < cores ? std::max(1, allowed) : std::max(1, cores / ranks));
}

}  // namespace epx
