// The dispatchers' counts all-gather (Megatron's host sync point in dispatch_preprocess). It runs
// on the compute thread over ProcessGroups::dispatch_counts(), not on the comm stream: a merged
// schedule has another micro-batch's token exchange in flight there, and the counts must not
// queue behind it (on a GPU they travel on the compute stream). Every rank calls it in program
// order, so one communicator serves every layer. The trace shows it as a wait.
#pragma once

#include <vector>

#include "epx/comm/comm.hpp"
#include "epx/trace/trace.hpp"

namespace epx {

// Every rank's `n` counts, in rank order.
inline std::vector<std::int64_t> allgather_counts(Communicator& counts, const std::int64_t* mine, std::int64_t n) {
  trace::Scope wait(trace::Track::wait, trace::kDispatchCounts);
  std::vector<std::int64_t> all(static_cast<std::size_t>(n * counts.size()));
  counts.allgatherv(mine, all.data(), std::vector<std::int64_t>(static_cast<std::size_t>(counts.size()), n), DType::I64);
  return all;
}

}  // namespace epx
