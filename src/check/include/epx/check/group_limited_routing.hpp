// Whether Megatron-Core's group-limited routing can route: one source for the check's rule
// (moe.group_limited_routing) and epx run's router.
#pragma once

#include "epx/config/config.hpp"

namespace epx {

// group_limited_topk (moe_utils.py) over `experts` in `groups` groups, keeping `group_topk` of
// them: each group is ranked by the sum of its best topk // group_topk scores (torch's topk raises
// when a group has fewer experts), then the top-k is taken among the kept groups' experts (when
// they are fewer, it picks masked experts of score -inf). Needs group_topk >= 1 and groups that
// split the experts.
inline bool group_limited_routes(Int experts, Int groups, Int group_topk, Int topk) {
  const Int per_group = experts / groups;
  return topk / group_topk <= per_group && group_topk * per_group >= topk;
}

}  // namespace epx
