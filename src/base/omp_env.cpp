#include "epx/base/omp_env.hpp"

#include <cstdlib>

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <ranges>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "epx/base/error.hpp"

namespace epx {

void cap_openmp_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  ::setenv("GOMP_SPINCOUNT", "10000", 1);
  ::execv("/proc/self/exe", argv);  // only returns on failure: carry on with the defaults
}

void check_omp_num_threads() {
  const char* text = std::getenv("OMP_NUM_THREADS");
  if (!text) return;
  for (const auto level : std::views::split(std::string_view(text), ',')) {
    const std::string_view v(level.begin(), level.end());
    long n = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    if (ec == std::errc::result_out_of_range || (ec == std::errc() && n > kMaxOmpThreads))
      throw ConfigError(fmt::format("OMP_NUM_THREADS={}: at most {} threads per process (the machine has {} cores); "
                                    "set fewer, or unset it and epx shares the cores between its ranks",
                                    text, kMaxOmpThreads, std::max(1u, std::thread::hardware_concurrency())));
  }
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
