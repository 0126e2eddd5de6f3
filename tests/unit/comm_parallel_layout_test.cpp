// Process groups from the rank grid, computed without launching ranks (Megatron's RankGenerator).
#include <algorithm>
#include <set>

#include <gtest/gtest.h>

#include "epx/comm/parallel_layout.hpp"
#include "epx/config/config.hpp"

namespace epx {
namespace {

RankGroup range(int first, int n, int step = 1) {
  RankGroup g;
  for (int i = 0; i < n; ++i) g.push_back(first + i * step);
  return g;
}

// The reference's parallel-folding example: attention TP4 CP2 DP8 PP4, experts ETP1 EP64 EDP1.
TEST(ParallelLayout, FoldingExampleOn256Ranks) {
  const ParallelLayout l = ParallelLayout::make(256, 4, 2, 4, 64, 1);
  EXPECT_EQ(l.dp, 8);
  EXPECT_EQ(l.edp, 1);
  EXPECT_EQ(l.group_of(GroupKind::tp, 0), range(0, 4));
  EXPECT_EQ(l.group_of(GroupKind::cp, 0), range(0, 2, 4));
  EXPECT_EQ(l.group_of(GroupKind::dp, 0), range(0, 8, 8));
  EXPECT_EQ(l.group_of(GroupKind::pp, 0), range(0, 4, 64));
  EXPECT_EQ(l.group_of(GroupKind::tp_cp, 9), (RankGroup{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(l.group_of(GroupKind::tp_cp_dp, 70), range(64, 64));
  // EP64 folds TP, CP and DP of a stage into one expert-parallel group.
  EXPECT_EQ(l.group_of(GroupKind::ep, 70), range(64, 64));
  EXPECT_EQ(l.group_of(GroupKind::etp, 70), RankGroup{70});
  EXPECT_EQ(l.group_of(GroupKind::edp, 70), RankGroup{70});
  EXPECT_EQ(l.rank_in(GroupKind::ep, 70), 6);
  EXPECT_EQ(l.groups(GroupKind::ep).size(), 4u);
  EXPECT_EQ(l.groups(GroupKind::dp).size(), 32u);
}

// Every kind partitions the world into equal groups of the right size, on many layouts; the
// expert side's PP groups equal the attention side's.
TEST(ParallelLayout, GroupsPartitionTheWorld) {
  struct Case { int world, tp, cp, pp, ep, etp; };
  for (const Case c : {Case{1, 1, 1, 1, 1, 1}, Case{2, 1, 1, 1, 2, 1}, Case{4, 2, 1, 1, 2, 2},
                       Case{4, 1, 1, 1, 2, 2}, Case{8, 2, 2, 1, 4, 1}, Case{16, 2, 1, 2, 4, 2},
                       Case{24, 2, 3, 2, 2, 3}, Case{64, 4, 2, 2, 8, 1}, Case{256, 4, 2, 4, 64, 1}}) {
    const ParallelLayout l = ParallelLayout::make(c.world, c.tp, c.cp, c.pp, c.ep, c.etp);
    SCOPED_TRACE(l.describe());
    const auto size_of = [&](GroupKind k) {
      switch (k) {
        case GroupKind::tp: return l.tp;
        case GroupKind::cp: return l.cp;
        case GroupKind::dp: return l.dp;
        case GroupKind::pp: return l.pp;
        case GroupKind::tp_cp: return l.tp * l.cp;
        case GroupKind::dp_cp: return l.dp * l.cp;
        case GroupKind::tp_cp_dp: return l.tp * l.cp * l.dp;
        case GroupKind::etp: return l.etp;
        case GroupKind::ep: return l.ep;
        case GroupKind::edp: return l.edp;
        case GroupKind::tp_ep: return l.etp * l.ep;
      }
      return 0;
    };
    for (GroupKind k : kAllGroupKinds) {
      // The planner's bounds are each listed group's lowest and highest rank.
      const std::vector<RankGroup> groups = l.groups(k);
      const std::vector<std::pair<int, int>> bounds = l.group_bounds(k);
      ASSERT_EQ(bounds.size(), groups.size()) << group_kind_name(k);
      for (std::size_t i = 0; i < groups.size(); ++i) {
        const auto [lo, hi] = std::minmax_element(groups[i].begin(), groups[i].end());
        EXPECT_EQ(bounds[i], std::make_pair(*lo, *hi)) << group_kind_name(k) << " group " << i;
      }
      std::set<int> seen;
      for (const RankGroup& g : groups) {
        EXPECT_EQ(static_cast<int>(g.size()), size_of(k)) << group_kind_name(k);
        for (int r : g) EXPECT_TRUE(seen.insert(r).second) << group_kind_name(k) << " repeats " << r;
      }
      EXPECT_EQ(static_cast<int>(seen.size()), c.world) << group_kind_name(k);
    }
    // tp-cp-ep-dp-pp order: a TP group is consecutive ranks; ETP x EP is ETP-fastest.
    EXPECT_EQ(l.group_of(GroupKind::tp, 0), range(0, l.tp));
    const RankGroup tp_ep = l.group_of(GroupKind::tp_ep, 0), ep = l.group_of(GroupKind::ep, 0);
    for (int i = 0; i < l.ep; ++i) EXPECT_EQ(tp_ep[static_cast<std::size_t>(i * l.etp)], ep[static_cast<std::size_t>(i)]);
  }
}

TEST(ParallelLayout, SizesThatDoNotDivideTheWorldAreNamed) {
  try {
    ParallelLayout::make(96, 4, 2, 4, 64, 1);
    FAIL() << "EP64 x PP4 cannot divide 96 ranks";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("world size 96 is not divisible by ETP x EP x PP = 1 x 64 x 4 = 256"), std::string::npos) << m;
    EXPECT_NE(m.find("expert_model_parallel_size"), std::string::npos) << m;
  }
  try {
    ParallelLayout::make(6, 4, 1, 1, 2, 1);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("TP x CP x PP = 4 x 1 x 1 = 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ParallelLayout::make(4, 0, 1, 1, 1, 1), ConfigError);
}

}  // namespace
}  // namespace epx
