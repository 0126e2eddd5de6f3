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

using Mask = std::array<bool, kDims>;  // tp cp ep dp pp

// The rank offsets over the dims whose mask is `masked`, first dim fastest.
std::vector<int> offsets_over(const Sizes& sizes, const Mask& mask, bool masked) {
  Sizes stride{};
  for (int d = 0, s = 1; d < kDims; s *= sizes[d], ++d) stride[d] = s;
  std::vector<int> offsets{0};
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
}

// generate_masked_orthogonal_rank_groups: the ranks that differ only along the masked dims form
// a group. Inside a group and across groups, the first dim varies fastest.
std::vector<RankGroup> masked_groups(const Sizes& sizes, const Mask& mask) {
  const std::vector<int> inner = offsets_over(sizes, mask, true), outer = offsets_over(sizes, mask, false);
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

// Strides are positive, so a group's lowest rank is its outer offset (every masked coordinate 0)
// and its highest adds each masked dim's last coordinate.
std::vector<std::pair<int, int>> offset_bounds(const Sizes& sizes, const Mask& mask) {
  int span = 0;
  for (int d = 0, stride = 1; d < kDims; stride *= sizes[d], ++d)
    if (mask[d]) span += (sizes[d] - 1) * stride;
  std::vector<std::pair<int, int>> bounds;
  for (int o : offsets_over(sizes, mask, false)) bounds.emplace_back(o, o + span);
  return bounds;
}

// The sizes and mask of a kind's grid.
std::pair<Sizes, Mask> grid_of(const ParallelLayout& l, GroupKind kind) {
  const Sizes attn{l.tp, l.cp, 1, l.dp, l.pp}, expert{l.etp, 1, l.ep, l.edp, l.pp};
  switch (kind) {
    case GroupKind::tp: return {attn, Mask{true, false, false, false, false}};
    case GroupKind::cp: return {attn, Mask{false, true, false, false, false}};
    case GroupKind::dp: return {attn, Mask{false, false, false, true, false}};
    case GroupKind::pp: return {attn, Mask{false, false, false, false, true}};
    case GroupKind::tp_cp: return {attn, Mask{true, true, false, false, false}};
    case GroupKind::dp_cp: return {attn, Mask{false, true, false, true, false}};
    case GroupKind::tp_cp_dp: return {attn, Mask{true, true, false, true, false}};
    case GroupKind::etp: return {expert, Mask{true, false, false, false, false}};
    case GroupKind::ep: return {expert, Mask{false, false, true, false, false}};
    case GroupKind::edp: return {expert, Mask{false, false, false, true, false}};
    case GroupKind::tp_ep: return {expert, Mask{true, false, true, false, false}};
  }
  throw std::logic_error("unknown group kind");
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
  // Compared by their bounds (a group's lowest and highest rank; with its size and stride
  // that is the group): the ranks themselves would be the world's worth of allocations, for
  // every layout the planner's search tries.
  if (l.group_bounds(GroupKind::pp) != offset_bounds({etp, 1, ep, l.edp, pp}, Mask{false, false, false, false, true}))
    throw std::logic_error("attention and expert grids have different PP groups");
  return l;
}

std::vector<RankGroup> ParallelLayout::groups(GroupKind kind) const {
  const auto [sizes, mask] = grid_of(*this, kind);
  return masked_groups(sizes, mask);
}

std::vector<std::pair<int, int>> ParallelLayout::group_bounds(GroupKind kind) const {
  const auto [sizes, mask] = grid_of(*this, kind);
  return offset_bounds(sizes, mask);
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
