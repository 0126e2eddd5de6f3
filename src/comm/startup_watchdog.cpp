#include "startup_watchdog.hpp"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/comm/mpi.hpp"

namespace epx {
namespace {

namespace fs = std::filesystem;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return -1;
  try {
    return std::stoi(v);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

StartupWatchdog::StartupWatchdog(double timeout_s) {
  const char* job = std::getenv("PMIX_NAMESPACE");
  rank_ = env_int("OMPI_COMM_WORLD_RANK");
  size_ = env_int("OMPI_COMM_WORLD_SIZE");
  if (!job || rank_ < 0 || size_ < 2) return;
  const char* tmp = std::getenv("TMPDIR");
  dir_ = fs::path(tmp && *tmp ? tmp : "/tmp") / fmt::format("epx-start-{}", job);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {  // no markers then; the timeout still holds, without naming ranks
    dir_.clear();
  } else {
    mark("started");
  }
  thread_ = std::thread([this, timeout_s] { watch(timeout_s); });
}

StartupWatchdog::~StartupWatchdog() { done(); }

void StartupWatchdog::mark(const char* stage) const {
  if (dir_.empty()) return;
  std::ofstream(dir_ / fmt::format("rank-{}.{}", rank_, stage)) << "\n";
}

void StartupWatchdog::initialized() { mark("initialized"); }

void StartupWatchdog::done() {
  {
    std::lock_guard lock(mu_);
    if (done_) return;
    done_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (dir_.empty()) return;
  std::error_code ec;
  for (const char* stage : {"started", "initialized"})
    fs::remove(dir_ / fmt::format("rank-{}.{}", rank_, stage), ec);
  fs::remove(dir_, ec);  // succeeds for the last rank out; the others find it not empty
}

void StartupWatchdog::watch(double timeout_s) {
  std::unique_lock lock(mu_);
  if (cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return done_; }))
    return;
  std::vector<int> never_started, stuck_in_init;
  std::error_code ec;
  for (int r = 0; r < size_ && !dir_.empty(); ++r) {
    if (!fs::exists(dir_ / fmt::format("rank-{}.started", r), ec))
      never_started.push_back(r);
    else if (!fs::exists(dir_ / fmt::format("rank-{}.initialized", r), ec))
      stuck_in_init.push_back(r);
  }
  std::string who;
  if (!never_started.empty())
    who += fmt::format("; rank(s) {} never reached MPI start-up (stopped, crashed, or on a host "
                       "that did not start)",
                       fmt::join(never_started, " "));
  if (!stuck_in_init.empty())
    who += fmt::format("; rank(s) {} are waiting inside MPI_Init", fmt::join(stuck_in_init, " "));
  if (who.empty()) who = "; every rank finished MPI_Init but the first barrier did not complete";
  std::cerr << fmt::format("epx: rank {}: error: the MPI world of {} ranks did not come up within "
                           "{:g} s (the collective timeout: epx run / layer --collective-timeout, "
                           "or EPX_COLLECTIVE_TIMEOUT){}; markers in {}\n",
                           rank_, size_, timeout_s, who, dir_.string())
            << std::flush;
  // The markers stay: the other live ranks read them too, and they show what happened.
  std::_Exit(kExitCommTimeout);  // MPI is not up: nothing to abort through
}

}  // namespace epx
