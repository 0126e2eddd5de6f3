// This rank's communicators for every group of a ParallelLayout (Megatron's parallel_state).
#pragma once

#include <map>
#include <memory>

#include "epx/comm/comm.hpp"
#include "epx/comm/parallel_layout.hpp"

namespace epx {

class ProcessGroups {
 public:
  // Collective over `world`: every rank calls it with the same layout.
  ProcessGroups(Communicator& world, const ParallelLayout& layout);

  const ParallelLayout& layout() const { return layout_; }
  Communicator& world() { return world_; }
  Communicator& get(GroupKind kind) { return *groups_.at(kind); }
  // A duplicate of the ETP x EP group for the dispatchers' counts all-gathers, which run on the
  // compute thread while the comm stream may be exchanging tokens over the group itself
  // (src/dispatch/counts_exchange.hpp).
  Communicator& dispatch_counts() { return *dispatch_counts_; }
  // A duplicate of the TP x CP x DP group for the global aux loss's counts, summed on the
  // compute thread in the router's forward (Megatron's tp_dp_cp group).
  Communicator& router_counts() { return *router_counts_; }

 private:
  Communicator& world_;
  ParallelLayout layout_;
  std::map<GroupKind, std::unique_ptr<Communicator>> groups_;
  std::unique_ptr<Communicator> dispatch_counts_;
  std::unique_ptr<Communicator> router_counts_;
};

}  // namespace epx
