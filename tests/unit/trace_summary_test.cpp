// trace::summarize over a window: only the events that begin in [since, until) count, so a
// steady state that ends before the run does (--steady-to) leaves the later steps out.
#include <chrono>

#include <gtest/gtest.h>

#include "epx/trace/trace.hpp"

namespace epx {
namespace {

TEST(TraceSummary, CountsTheEventsThatBeginInTheWindow) {
  using std::chrono::milliseconds;
  trace::enable(true);
  const trace::Clock::time_point t0 = trace::Clock::now();
  // Two steps of 10 ms compute, each followed by a 4 ms exposed DP reduction.
  for (int step = 0; step < 2; ++step) {
    const auto at = t0 + milliseconds(20 * step);
    trace::record(trace::Track::compute, "layer forward", at, at + milliseconds(10));
    trace::record(trace::Track::grad_comm, "gradient all-reduce", at + milliseconds(10), at + milliseconds(14));
  }
  const trace::Summary first = trace::summarize(t0, t0 + milliseconds(20));
  const trace::Summary both = trace::summarize(t0);
  trace::take_events_json(0, t0);  // clears them
  trace::enable(false);
  EXPECT_NEAR(first.compute_s, 0.010, 1e-9);
  EXPECT_NEAR(first.dp_reduce_s, 0.004, 1e-9);
  EXPECT_NEAR(first.exposed_dp_reduce_s, 0.004, 1e-9);
  EXPECT_NEAR(both.compute_s, 0.020, 1e-9);
  EXPECT_NEAR(both.exposed_comm_s, 0.008, 1e-9);
}

}  // namespace
}  // namespace epx
