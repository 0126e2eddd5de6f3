// The rank grid of Megatron-Core's parallel_state (RankGenerator), computed without launching
// ranks: attention side TP x CP x DP x PP, expert side ETP x EP x EDP x PP ("parallel folding"),
// both in the order tp-cp-ep-dp-pp (tp fastest). The PP groups must be the same on both sides.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace epx {

// Every process group kind epx builds (Megatron's uses in brackets). Attention side: tp, cp, dp,
// pp, tp_cp (Megatron: aux-loss token counts), dp_cp (dense gradient reduction), tp_cp_dp (every
// rank of a pipeline stage: epx's router and shared-expert gradient sum).
// Expert side: etp, ep, edp, tp_ep (ETP x EP: the dispatchers' counts all-gather).
enum class GroupKind { tp, cp, dp, pp, tp_cp, dp_cp, tp_cp_dp, etp, ep, edp, tp_ep };
const char* group_kind_name(GroupKind k);
inline constexpr GroupKind kAllGroupKinds[] = {
    GroupKind::tp,    GroupKind::cp,       GroupKind::dp,  GroupKind::pp,
    GroupKind::tp_cp, GroupKind::dp_cp,    GroupKind::tp_cp_dp,
    GroupKind::etp,   GroupKind::ep,       GroupKind::edp, GroupKind::tp_ep};

using RankGroup = std::vector<int>;  // world ranks, in group-rank order

struct ParallelLayout {
  int world = 1;
  int tp = 1, cp = 1, dp = 1, pp = 1;  // attention
  int etp = 1, ep = 1, edp = 1;        // experts (pp shared)

  // DP = world / (TP*CP*PP) and EDP = world / (ETP*EP*PP); throws ConfigError naming the sizes
  // that do not divide the world size.
  static ParallelLayout make(int world, int tp, int cp, int pp, int ep, int etp);

  // Every group of a kind, as Megatron's RankGenerator.get_ranks lists them.
  std::vector<RankGroup> groups(GroupKind kind) const;
  // Each group's lowest and highest rank, in the same order, without listing its ranks (the
  // planner places thousands of layouts of thousands of ranks).
  std::vector<std::pair<int, int>> group_bounds(GroupKind kind) const;
  // The group of `kind` that holds `rank`, and the rank's index in it.
  RankGroup group_of(GroupKind kind, int rank) const;
  int rank_in(GroupKind kind, int rank) const;

  std::string describe() const;  // "world 8 = TP1 CP1 DP8 PP1 | ETP1 EP4 EDP2 PP1"
};

}  // namespace epx
