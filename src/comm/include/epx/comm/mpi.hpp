// Open MPI underneath the Communicator: the session (init with MPI_THREAD_MULTIPLE, finalize),
// the world communicator, and taking the whole job down from any rank.
#pragma once

#include <memory>
#include <string>

#include "epx/base/env.hpp"
#include "epx/base/error.hpp"
#include "epx/comm/comm.hpp"

namespace epx {

inline constexpr double kDefaultCollectiveTimeoutS = env::kCollectiveTimeout.fallback;

// True when this process was started by mpirun (Open MPI's environment is present).
bool launched_by_mpirun();

class MpiSession {
 public:
  // Initialises MPI once per process. `collective_timeout_s` bounds every wait().
  explicit MpiSession(double collective_timeout_s = kDefaultCollectiveTimeoutS);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  Communicator& world() { return *world_; }

  // Prints "epx: rank R: <message>" to stderr and ends every rank of the job with `code`.
  [[noreturn]] static void abort_job(const std::string& message, int code);

 private:
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Communicator> world_;
};

// The timeout from EPX_COLLECTIVE_TIMEOUT (seconds), else `fallback`; throws ConfigError when
// the variable is not a number in range.
double collective_timeout_from_env(double fallback = kDefaultCollectiveTimeoutS);

}  // namespace epx
