#include "epx/comm/comm_stream.hpp"

#include "epx/base/cpu_clock.hpp"
#include "epx/trace/trace.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>

namespace epx {

void CommEvent::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mu);
  if (!state_->done) {
    const auto begin = std::chrono::steady_clock::now();
    state_->cv.wait(lock, [&] { return state_->done; });
    trace::record(trace::Track::wait, "wait for communication", begin, std::chrono::steady_clock::now());
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

bool CommEvent::ready() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

CommStream::CommStream(trace::Track track) : track_(track), thread_([this] { loop(); }) {}

CommStream::~CommStream() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

CommEvent CommStream::submit(std::function<void()> task, const char* name) {
  CommEvent ev;
  ev.state_ = std::make_shared<CommEvent::State>();
  {
    std::lock_guard lock(mu_);
    queue_.push_back({std::move(task), name, ev.state_});
  }
  cv_.notify_one();
  return ev;
}

CommStream::Stats CommStream::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void CommStream::reset_stats() {
  std::lock_guard lock(mu_);
  stats_ = Stats{};
}

void CommStream::loop() {
  // The CPU's counterpart of Megatron's high_priority_a2a_comm_stream (a CUDA stream priority,
  // off by default there), on whatever the config says: when compute threads fill every core, the
  // comm thread should not wait a scheduler slice to start or progress an exchange. It sleeps while
  // it waits on MPI, so the priority costs compute little. Best effort: needs CAP_SYS_NICE.
  setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), -10);
  for (;;) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything submitted has run
    auto [task, name, state] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();

    const auto wall0 = std::chrono::steady_clock::now();
    const double cpu0 = cpu_clock_seconds(CLOCK_THREAD_CPUTIME_ID);
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    const double cpu = cpu_clock_seconds(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    const auto wall1 = std::chrono::steady_clock::now();
    const double wall = std::chrono::duration<double>(wall1 - wall0).count();
    trace::record(track_, name, wall0, wall1);

    lock.lock();
    stats_.tasks += 1;
    stats_.busy_s += wall;
    stats_.cpu_s += cpu;
    lock.unlock();
    {
      std::lock_guard event_lock(state->mu);
      state->done = true;
      state->error = error;
    }
    state->cv.notify_all();
  }
}

}  // namespace epx
