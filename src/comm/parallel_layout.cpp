#include "epx/comm/parallel_layout.hpp"

#include <algorithm>
#include <array>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/base/error.hpp"

namespace epx {
namespace {

// Megatron's dimension order, fastest first.
enum Dim { kTp, kCp, kEp, kDp, kPp, kDims };
using Sizes = std::array<int, kDims>;

// generate_masked_orthogonal_rank_groups: the ranks that differ only along the masked dims form
// a group. Inside a group and across groups, the first dim varies fastest.
std::vector<RankGroup> masked_groups(const Sizes& sizes, const std::array<bool, kDims>& mask) {
  Sizes stride{};
  for (int d = 0, s = 1; d < kDims; s *= sizes[d], ++d) stride[d] = s;
  auto enumerate = [&](bool masked) {
    std::vector<int> offsets{0};  // rank offsets over the chosen dims, first dim fastest
    for (int d = 0; d < kDims; ++d) {
      if (mask[d] != masked) continue;
      // Earlier dims stay fastest: the new dim's coordinate c takes indices [c*n, (c+1)*n).
      const std::size_t n = offsets.size();
      std::vector<int> ordered(n * static_cast<std::size_t>(sizes[d]));
      for (int c = 0; c < sizes[d]; ++c)
        for (std::size_t i = 0; i < n; ++i) ordered[c * n + i] = offsets[i] + c * stride[d];
      offsets = std::move(ordered);
    }
    return offsets;
  };
  const std::vector<int> inner = enumerate(true), outer = enumerate(false);
  std::vector<RankGroup> groups;
  groups.reserve(outer.size());
  for (int o : outer) {
    RankGroup g;
    g.reserve(inner.size());
    for (int i : inner) g.push_back(o + i);
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

const char* group_kind_name(GroupKind k) {
  switch (k) {
    case GroupKind::tp: return "tp";
    case GroupKind::cp: return "cp";
    case GroupKind::dp: return "dp";
    case GroupKind::pp: return "pp";
    case GroupKind::tp_cp: return "tp-cp";
    case GroupKind::dp_cp: return "dp-cp";
    case GroupKind::tp_cp_dp: return "tp-cp-dp";
    case GroupKind::etp: return "etp";
    case GroupKind::ep: return "ep";
    case GroupKind::edp: return "edp";
    case GroupKind::tp_ep: return "etp-ep";
  }
  return "?";
}

ParallelLayout ParallelLayout::make(int world, int tp, int cp, int pp, int ep, int etp) {
  const auto positive = [](const char* field, int v) {
    if (v < 1)
      throw ConfigError(fmt::format("model.{}={}: a parallel size must be at least 1", field, v));
  };
  positive("tensor_model_parallel_size", tp);
  positive("context_parallel_size", cp);
  positive("pipeline_model_parallel_size", pp);
  positive("expert_model_parallel_size", ep);
  positive("expert_tensor_parallel_size", etp);
  if (world < 1) throw ConfigError(fmt::format("world size {}: need at least one rank", world));
  // Each grid's product must divide the world: name the sizes and the fields that set them.
  const auto must_divide = [world](const char* dims, const char* fields, int a, int b, int c) {
    if (world % (a * b * c) == 0) return;
    throw ConfigError(fmt::format(
        "world size {} is not divisible by {} = {} x {} x {} = {} ({}): launch a multiple of {} "
        "ranks or change those sizes",
        world, dims, a, b, c, a * b * c, fields, a * b * c));
  };
  must_divide("TP x CP x PP",
              "model.tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size",
              tp, cp, pp);
  must_divide("ETP x EP x PP",
              "model.expert_tensor_parallel_size, expert_model_parallel_size, "
              "pipeline_model_parallel_size",
              etp, ep, pp);
  ParallelLayout l;
  l.world = world;
  l.tp = tp, l.cp = cp, l.pp = pp, l.dp = world / (tp * cp * pp);
  l.etp = etp, l.ep = ep, l.edp = world / (etp * ep * pp);
  // Megatron asserts this; with both grids in tp-cp-ep-dp-pp order and pp slowest it always
  // holds, but a later change to the orders must not break it silently.
  if (l.groups(GroupKind::pp) != masked_groups({etp, 1, ep, l.edp, pp}, {false, false, false, false, true}))
    throw std::logic_error("attention and expert grids have different PP groups");
  return l;
}

std::vector<RankGroup> ParallelLayout::groups(GroupKind kind) const {
  const Sizes attn{tp, cp, 1, dp, pp}, expert{etp, 1, ep, edp, pp};
  using M = std::array<bool, kDims>;  // tp cp ep dp pp
  switch (kind) {
    case GroupKind::tp: return masked_groups(attn, M{true, false, false, false, false});
    case GroupKind::cp: return masked_groups(attn, M{false, true, false, false, false});
    case GroupKind::dp: return masked_groups(attn, M{false, false, false, true, false});
    case GroupKind::pp: return masked_groups(attn, M{false, false, false, false, true});
    case GroupKind::tp_cp: return masked_groups(attn, M{true, true, false, false, false});
    case GroupKind::dp_cp: return masked_groups(attn, M{false, true, false, true, false});
    case GroupKind::tp_cp_dp: return masked_groups(attn, M{true, true, false, true, false});
    case GroupKind::etp: return masked_groups(expert, M{true, false, false, false, false});
    case GroupKind::ep: return masked_groups(expert, M{false, false, true, false, false});
    case GroupKind::edp: return masked_groups(expert, M{false, false, false, true, false});
    case GroupKind::tp_ep: return masked_groups(expert, M{true, false, true, false, false});
  }
  throw std::logic_error("unknown group kind");
}

RankGroup ParallelLayout::group_of(GroupKind kind, int rank) const {
  for (RankGroup& g : groups(kind))
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  throw std::out_of_range(fmt::format("rank {} is not in a world of {}", rank, world));
}

int ParallelLayout::rank_in(GroupKind kind, int rank) const {
  const RankGroup g = group_of(kind, rank);
  return static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
}

std::string ParallelLayout::describe() const {
  return fmt::format("world {} = TP{} CP{} DP{} PP{} | ETP{} EP{} EDP{} PP{}", world, tp, cp, dp, pp,
                     etp, ep, edp, pp);
}

}  // namespace epx
