// Where one rank's time went over a window of its trace: compute, the compute thread's waits,
// host gaps, and communication in flight and exposed (not covered by compute), by kind. The one
// definition of "exposed" that `epx run`'s summary and `epx diagnose` / `epx report` share.
#pragma once

#include <string>
#include <vector>

namespace epx::trace {

// One event of the rank's timeline in seconds; `category` is the Chrome trace's "cat": compute,
// wait (the compute thread blocked on communication) or comm (either communication stream).
struct Span {
  std::string category, name;
  double begin_s = 0, end_s = 0;
};

// Seconds over the window, each an interval union. Each stretch of communication is charged to
// one kind, in this order: the token exchanges (dispatch, combine, their backward, and the
// compute thread's wait on the token counts), the DP / EDP gradient reduction, the rest (grad
// norm, router counts, ...), then the compute thread's waits on the other pipeline stages
// (bubble and p2p, all exposed: nothing computes meanwhile).
struct Breakdown {
  double window_s = 0, compute_s = 0, wait_s = 0, idle_s = 0;
  double comm_s = 0, exposed_comm_s = 0;  // the three communication kinds together
  double token_exchange_s = 0, token_exchange_exposed_s = 0;
  double dp_reduce_s = 0, dp_reduce_exposed_s = 0;
  double other_comm_s = 0, other_comm_exposed_s = 0;
  double pipeline_wait_s = 0, pipeline_wait_exposed_s = 0;
};

// The spans clipped to [from, to]. Compute spans (a layer's forward) contain the compute
// thread's waits: compute is their union less the waits'.
Breakdown break_down(const std::vector<Span>& spans, double from, double to);

}  // namespace epx::trace
