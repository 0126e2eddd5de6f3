#include "epx/comm/process_groups.hpp"

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {

ProcessGroups::ProcessGroups(Communicator& world, const ParallelLayout& layout)
    : world_(world), layout_(layout) {
  if (world.size() != layout.world)
    throw std::logic_error(fmt::format("layout for {} ranks on a world of {}", layout.world, world.size()));
  for (GroupKind kind : kAllGroupKinds) {
    const std::vector<RankGroup> all = layout.groups(kind);
    for (std::size_t color = 0; color < all.size(); ++color) {
      const RankGroup& g = all[color];
      for (std::size_t key = 0; key < g.size(); ++key) {
        if (g[key] != world.rank()) continue;
        groups_[kind] = world.split(static_cast<int>(color), static_cast<int>(key),
                                    fmt::format("{} [{}]", group_kind_name(kind), fmt::join(g, " ")));
      }
    }
  }
  Communicator& tp_ep = get(GroupKind::tp_ep);
  dispatch_counts_ = tp_ep.split(0, tp_ep.rank(), tp_ep.name() + " counts");
  Communicator& tp_cp_dp = get(GroupKind::tp_cp_dp);
  router_counts_ = tp_cp_dp.split(0, tp_cp_dp.rank(), tp_cp_dp.name() + " router counts");
}

}  // namespace epx
