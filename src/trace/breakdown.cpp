#include "epx/trace/breakdown.hpp"

#include <algorithm>

#include "epx/trace/trace.hpp"

namespace epx::trace {
namespace {

struct Interval {
  double begin, end;
};
using Intervals = std::vector<Interval>;

// The union of `v` as sorted disjoint intervals.
Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  Intervals out;
  for (const Interval& i : v) {
    if (!out.empty() && i.begin <= out.back().end) out.back().end = std::max(out.back().end, i.end);
    else out.push_back(i);
  }
  return out;
}

// `u` less `w` (both sorted and disjoint).
Intervals minus(const Intervals& u, const Intervals& w) {
  Intervals out;
  std::size_t j = 0;
  for (Interval x : u) {
    while (j < w.size() && w[j].end <= x.begin) ++j;
    for (std::size_t k = j; k < w.size() && w[k].begin < x.end; ++k) {
      if (w[k].begin > x.begin) out.push_back({x.begin, w[k].begin});
      x.begin = std::max(x.begin, w[k].end);
    }
    if (x.end > x.begin) out.push_back(x);
  }
  return out;
}

double length(const Intervals& u) {
  double s = 0;
  for (const Interval& i : u) s += i.end - i.begin;
  return s;
}

}  // namespace

Breakdown break_down(const std::vector<Span>& spans, double from, double to) {
  Breakdown b;
  b.window_s = std::max(0.0, to - from);
  Intervals compute, waits, kinds[4];  // kinds: token exchanges, DP reduction, other, pipeline waits
  for (const Span& s : spans) {
    const Interval x{std::max(s.begin_s, from), std::min(s.end_s, to)};
    if (x.end <= x.begin) continue;
    const bool wait = s.category == "wait", comm = s.category == "comm";
    if (s.category == "compute") compute.push_back(x);
    if (wait) waits.push_back(x);
    const bool counts = wait && s.name == kDispatchCounts, pipeline = wait && is_pipeline_wait(s.name);
    if (!comm && !counts && !pipeline) continue;
    kinds[pipeline ? 3 : counts || is_token_exchange(s.name) ? 0 : is_dp_reduction(s.name) ? 1 : 2].push_back(x);
  }
  compute = merged(compute);
  waits = merged(waits);
  Intervals busy = compute;
  busy.insert(busy.end(), waits.begin(), waits.end());
  b.idle_s = b.window_s - length(merged(busy));
  compute = minus(compute, waits);
  b.wait_s = length(waits);
  b.compute_s = length(compute);
  Intervals charged;
  double* in_flight[4] = {&b.token_exchange_s, &b.dp_reduce_s, &b.other_comm_s, &b.pipeline_wait_s};
  double* exposed[4] = {&b.token_exchange_exposed_s, &b.dp_reduce_exposed_s, &b.other_comm_exposed_s,
                        &b.pipeline_wait_exposed_s};
  for (int k = 0; k < 4; ++k) {
    const Intervals u = merged(kinds[k]);
    *in_flight[k] = length(u);
    *exposed[k] = length(minus(minus(u, compute), charged));
    charged.insert(charged.end(), u.begin(), u.end());
    charged = merged(charged);
    if (k == 2) {  // communication proper, before the pipeline's waits
      b.comm_s = length(charged);
      b.exposed_comm_s = length(minus(charged, compute));
    }
  }
  return b;
}

}  // namespace epx::trace
