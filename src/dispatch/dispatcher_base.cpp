#include "dispatcher_base.hpp"

#include "epx/comm/collectives.hpp"
#include "epx/comm/process_groups.hpp"

namespace epx {

DispatcherBase::DispatcherBase(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream)
    : num_experts_(num_experts),
      ep_(groups.get(GroupKind::ep)),
      etp_(groups.get(GroupKind::etp)),
      tp_ep_(groups.get(GroupKind::tp_ep)),
      stream_(stream),
      counts_(groups.dispatch_counts()),
      traffic_(node_of_each_rank(tp_ep_), tp_ep_.rank()),
      num_local_experts_(experts_per_ep_rank(num_experts, ep_.size())),
      first_local_expert_(ep_.rank() * num_local_experts_) {}

}  // namespace epx
