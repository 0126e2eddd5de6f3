// What the communicating dispatchers (alltoall, flex) share, as Megatron-Core's
// MoETokenDispatcher base holds it for its subclasses (megatron/core/transformer/moe/
// token_dispatcher.py: ep_group, tp_group, tp_ep_group, num_local_experts,
// local_expert_indices): the process groups, the experts this rank holds, the comm stream the
// exchanges run on, the communicator of the counts all-gather and the traffic counter.
#pragma once

#include <cstdint>
#include <ranges>

#include "epx/comm/comm.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "traffic_counter.hpp"

namespace epx {

class DispatcherBase : public TokenDispatcher {
 public:
  std::int64_t num_local_experts() const final { return num_local_experts_; }
  std::int64_t first_local_expert() const final { return first_local_expert_; }
  int expert_tp_rank() const final { return etp_.rank(); }
  int expert_tp_size() const final { return etp_.size(); }
  TrafficBytes traffic() const final { return traffic_.total(); }

 protected:
  // Collective over the ETP x EP group (it learns every rank's node); throws ConfigError when EP
  // does not divide num_experts.
  DispatcherBase(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream);

  // The ETP x EP group has ETP fastest (Megatron's expert rank order "tp-ep-dp-pp",
  // megatron/core/parallel_state.py): EP rank p's ETP rank t is group rank p * ETP + t.
  int group_rank(int ep_rank, int etp_rank) const { return ep_rank * etp_.size() + etp_rank; }
  // The group ranks that hold expert e (experts are placed on EP ranks contiguously).
  auto owners(std::int64_t e) const {
    const int first = group_rank(static_cast<int>(e / num_local_experts_), 0);
    return std::views::iota(first, first + etp_.size());
  }
  // The first expert that group rank `rank` holds.
  std::int64_t first_expert_of(int rank) const { return rank / etp_.size() * num_local_experts_; }

  const std::int64_t num_experts_;
  Communicator &ep_, &etp_;
  Communicator& tp_ep_;  // the ETP x EP group
  CommStream& stream_;
  Communicator& counts_;    // for the counts all-gathers (counts_exchange.hpp)
  TrafficCounter traffic_;  // indexed by tp_ep_ rank
  const std::int64_t num_local_experts_, first_local_expert_;
};

}  // namespace epx
