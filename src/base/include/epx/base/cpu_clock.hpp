// A CPU-time clock in seconds: CLOCK_THREAD_CPUTIME_ID (the calling thread's, as the comm streams
// report theirs) or CLOCK_PROCESS_CPUTIME_ID (every thread of the process, as epx run's summary).
#pragma once

#include <time.h>

namespace epx {

inline double cpu_clock_seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace epx
