// The communication "stream" of a rank (ARCHITECTURE.md): one thread that runs communication
// tasks in the order they were submitted, while the calling (compute) thread goes on computing.
// submit() returns an event; waiting on it blocks on a condition variable, not a spin.
//
// The stream must not steal the compute core: its tasks wait through Communicator::wait, which
// sleeps between polls. stats() reports the thread CPU time the stream spent against the wall
// time its tasks were in flight, so that claim is measured, not assumed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "epx/trace/trace.hpp"

namespace epx {

class CommEvent {
 public:
  CommEvent() = default;  // an event that is already complete
  // Blocks until the task ran; rethrows its exception.
  void wait() const;
  bool ready() const;

 private:
  friend class CommStream;
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  std::shared_ptr<State> state_;
};

class CommStream {
 public:
  // `track`: where its tasks appear on the trace (Track::grad_comm for the gradient reduction's).
  explicit CommStream(trace::Track track = trace::Track::comm);
  ~CommStream();  // finishes the queued tasks, then joins
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  // `name` labels the task on the trace's communication track (epx/trace.hpp).
  CommEvent submit(std::function<void()> task, const char* name = "comm");
  // Runs `task` on the stream and waits for it: an ordered, blocking communication.
  void run(std::function<void()> task, const char* name = "comm") { submit(std::move(task), name).wait(); }
  void synchronize() { run([] {}, "synchronize"); }

  struct Stats {
    std::int64_t tasks = 0;
    double busy_s = 0;  // wall time with a task running
    double cpu_s = 0;   // CPU time of the stream thread in those tasks
  };
  Stats stats() const;
  void reset_stats();

 private:
  void loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Task {
    std::function<void()> fn;
    const char* name;
    std::shared_ptr<CommEvent::State> state;
  };
  std::deque<Task> queue_;
  bool stopping_ = false;
  Stats stats_;
  trace::Track track_;
  std::thread thread_;
};

}  // namespace epx
