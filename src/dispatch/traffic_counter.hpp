// Bytes a dispatcher sends, split by whether the peer is on this rank's node: what the dispatch
// benchmark reports as traffic inside and across nodes. Added from the compute thread (counts
// exchanges) and the comm thread (the exchanges), hence atomics.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "epx/dispatch/dispatcher.hpp"

namespace epx {

class TrafficCounter {
 public:
  // node_of: the node of every rank of the group that `peer` indexes; me: this rank in it.
  TrafficCounter(std::vector<int> node_of, int me) : node_of_(std::move(node_of)), me_(me) {}

  void add(int peer, std::int64_t payload, std::int64_t metadata) {
    if (peer == me_) return;
    if (node_of_[static_cast<std::size_t>(peer)] == node_of_[static_cast<std::size_t>(me_)]) {
      intra_ += payload + metadata;
    } else {
      inter_ += payload + metadata;
      inter_metadata_ += metadata;
    }
  }
  void add_to_all(std::int64_t payload, std::int64_t metadata) {
    for (int p = 0; p < static_cast<int>(node_of_.size()); ++p) add(p, payload, metadata);
  }
  TrafficBytes total() const { return {intra_, inter_, inter_metadata_}; }
  const std::vector<int>& node_of() const { return node_of_; }

 private:
  std::vector<int> node_of_;
  int me_;
  std::atomic<std::int64_t> intra_{0}, inter_{0}, inter_metadata_{0};
};

}  // namespace epx
