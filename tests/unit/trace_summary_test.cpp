// trace::break_down, the one definition of exposed communication (epx run's summary, epx
// diagnose and report), against hand-counted timelines; and trace::summarize over a window.
#include <chrono>

#include <gtest/gtest.h>

#include "epx/trace/breakdown.hpp"
#include "epx/trace/trace.hpp"

namespace epx {
namespace {

TEST(TraceBreakdown, ChargesEachStretchToOneKind) {
  // 0-10 compute with a wait on the token counts at 4-5; a dispatch 8-14 (2 s under compute, 4
  // exposed); a DP all-reduce 12-16 (2 s beside the exposed dispatch, 2 s its own); a grad norm
  // 15-17 (1 s its own); a pipeline recv 17-19; idle 19-20.
  const std::vector<trace::Span> spans = {
      {"compute", "layer forward", 0, 10},       {"wait", trace::kDispatchCounts, 4, 5},
      {"comm", trace::kDispatch, 8, 14},         {"comm", "gradient all-reduce", 12, 16},
      {"comm", "grad norm all-reduce", 15, 17},  {"wait", trace::kPipelineRecv, 17, 19},
      {"compute", "outside the window", 25, 30}};
  const trace::Breakdown b = trace::break_down(spans, 0, 20);
  EXPECT_DOUBLE_EQ(b.window_s, 20);
  EXPECT_DOUBLE_EQ(b.compute_s, 9);  // the counts wait is not compute
  EXPECT_DOUBLE_EQ(b.wait_s, 3);
  EXPECT_DOUBLE_EQ(b.idle_s, 20 - 10 - 2);  // neither compute nor a wait
  EXPECT_DOUBLE_EQ(b.token_exchange_s, 1 + 6);  // the counts wait and the dispatch
  EXPECT_DOUBLE_EQ(b.token_exchange_exposed_s, 1 + 4);
  EXPECT_DOUBLE_EQ(b.dp_reduce_s, 4);
  EXPECT_DOUBLE_EQ(b.dp_reduce_exposed_s, 2);
  EXPECT_DOUBLE_EQ(b.other_comm_s, 2);
  EXPECT_DOUBLE_EQ(b.other_comm_exposed_s, 1);
  EXPECT_DOUBLE_EQ(b.comm_s, 1 + 9);  // 4-5 and 8-17
  EXPECT_DOUBLE_EQ(b.exposed_comm_s, 1 + 7);
  EXPECT_DOUBLE_EQ(b.pipeline_wait_s, 2);
  EXPECT_DOUBLE_EQ(b.pipeline_wait_exposed_s, 2);
}

TEST(TraceSummary, CountsTheWindowOnly) {
  using std::chrono::milliseconds;
  trace::enable(true);
  const trace::Clock::time_point t0 = trace::Clock::now();
  // Two steps of 10 ms compute, each followed by a 4 ms exposed DP reduction.
  for (int step = 0; step < 2; ++step) {
    const auto at = t0 + milliseconds(20 * step);
    trace::record(trace::Track::compute, "layer forward", at, at + milliseconds(10));
    trace::record(trace::Track::grad_comm, "gradient all-reduce", at + milliseconds(10), at + milliseconds(14));
  }
  const trace::Breakdown first = trace::summarize(t0, t0 + milliseconds(20));
  const trace::Breakdown both = trace::summarize(t0);
  trace::take_events_json(0, t0);  // clears them
  trace::enable(false);
  EXPECT_NEAR(first.compute_s, 0.010, 1e-9);
  EXPECT_NEAR(first.dp_reduce_s, 0.004, 1e-9);
  EXPECT_NEAR(first.dp_reduce_exposed_s, 0.004, 1e-9);
  EXPECT_NEAR(first.window_s, 0.020, 1e-9);
  EXPECT_NEAR(both.compute_s, 0.020, 1e-9);
  EXPECT_NEAR(both.exposed_comm_s, 0.008, 1e-9);
  EXPECT_NEAR(both.window_s, 0.034, 1e-9);  // to the last event's end
}

}  // namespace
}  // namespace epx
