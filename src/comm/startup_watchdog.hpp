// Bounds MPI start-up. A rank that never reaches MPI_Init (stopped, crashed, a host that does not
// come up) leaves the others blocked inside MPI_Init with no timeout of Open MPI's own. Each rank
// leaves a marker file before MPI_Init and another once MPI_Init returned, in a directory named
// after the job (PMIX_NAMESPACE); if the world has not met in a barrier within the collective
// timeout, every live rank prints which ranks are missing and exits with the timeout's code.
// Ranks on hosts that do not share the directory's file system show as missing too.
#pragma once

#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

namespace epx {

class StartupWatchdog {
 public:
  // Starts watching when this process is one of several ranks under mpirun; else does nothing.
  explicit StartupWatchdog(double timeout_s);
  ~StartupWatchdog();  // stops watching (as done())

  void initialized();  // MPI_Init returned on this rank
  void done();         // the world met: stop the clock, remove this rank's markers

 private:
  void watch(double timeout_s);
  void mark(const char* stage) const;

  int rank_ = -1, size_ = 0;
  std::filesystem::path dir_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace epx
