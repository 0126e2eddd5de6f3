// A timeline of what each rank computed and communicated, written as a Chrome / Perfetto trace
// (`epx run --trace FILE.json`): one process per rank, a compute track and a communication track.
// Recording is off until enable(); then a Scope costs two clock reads and a locked push.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace epx {
class Communicator;
}

namespace epx::trace {

// compute and wait share the compute thread's track: a wait is the compute thread blocked on
// communication, so it does not count as compute covering it.
enum class Track { compute = 0, comm = 1, wait = 2 };
using Clock = std::chrono::steady_clock;

void enable(bool on);
bool enabled();
// One interval; `index` >= 0 is appended to the name ("layer forward 3").
void record(Track track, std::string name, Clock::time_point begin, Clock::time_point end, int index = -1);

class Scope {
 public:
  Scope(Track track, const char* name, int index = -1)
      : track_(track), name_(name), index_(index), begin_(enabled() ? Clock::now() : Clock::time_point{}) {}
  ~Scope() {
    if (begin_ != Clock::time_point{}) record(track_, name_, begin_, Clock::now(), index_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Track track_;
  const char* name_;
  int index_;
  Clock::time_point begin_;
};

// Summed lengths of this rank's recorded intervals since `since`: compute (less its waits),
// communication, and the part of it during which the compute thread was not computing (the
// exposed communication); the same for the MoE token exchanges alone (the dispatchers' tasks
// "dispatch", "combine" and their backward), the communication EP overlap can hide.
struct Summary {
  double compute_s = 0, comm_s = 0, exposed_comm_s = 0;
  double token_exchange_s = 0, exposed_token_exchange_s = 0;
};
Summary summarize(Clock::time_point since);

// Collective over `world`: rank 0 writes every rank's events to `path` (times relative to
// `origin`). Clears the recorded events.
void write(Communicator& world, const std::string& path, Clock::time_point origin);

}  // namespace epx::trace
