// The layout without ranks: every group of every kind from the same ParallelLayout that `epx
// run` builds its communicators from, placed on nodes of gpus_per_node consecutive ranks.
#include <algorithm>

#include <fmt/format.h>

#include "epx/plan/plan.hpp"

namespace epx {

int slurm_segment_nodes(int nodes, int rack_nodes) {
  if (nodes <= rack_nodes) return nodes;
  for (int s = rack_nodes; s > 1; --s)
    if (nodes % s == 0) return s;
  return 1;
}

LayoutPlan plan_layout(const Config& c, const GpuInfo& gpu) {
  const ModelConfig& m = c.model;
  const int world = static_cast<int>(c.target.num_gpus.value_or(1));
  LayoutPlan p;
  p.layout = ParallelLayout::make(world, static_cast<int>(m.tensor_model_parallel_size),
                                  static_cast<int>(m.context_parallel_size),
                                  static_cast<int>(m.pipeline_model_parallel_size),
                                  static_cast<int>(m.expert_model_parallel_size), static_cast<int>(effective_etp(m)));
  p.split = pipeline_split(m);
  p.gpus_per_node = static_cast<int>(gpus_per_node(c).value_or(world));
  if (p.gpus_per_node < 1) p.gpus_per_node = world;
  p.nodes = (world + p.gpus_per_node - 1) / p.gpus_per_node;
  // The node, whatever size the config gives it (an H100 node of 4 has a domain of 4, not the
  // HGX's 8), up to the catalog's domain (a "node" of 16 H100s is two NVLink domains), unless the catalog's domain spans nodes (GB200's rack of 72 over nodes of 4) and the
  // job uses them as they are. There Bridge's harness (scripts/performance/utils/executors.py)
  // asks Slurm for `--segment` blocks of nodes that share a rack: all of them up to a rack's
  // worth, else the largest divisor of the node count that fits one. Only a segment is sure to
  // share a domain: 64 nodes run as 4 racks of 16 nodes, 64 GPUs each, and 76 nodes in segments
  // of 4.
  p.nvlink_domain = gpu.nvlink_domain > 0 ? std::min(p.gpus_per_node, gpu.nvlink_domain) : p.gpus_per_node;
  if (gpu.nvlink_domain > gpu.gpus_per_node && p.gpus_per_node == gpu.gpus_per_node) {  // the harness's condition
    p.rack_gpus = gpu.nvlink_domain;
    p.segment_nodes = slurm_segment_nodes(p.nodes, std::max(1, gpu.nvlink_domain / p.gpus_per_node));
    p.nvlink_domain = p.segment_nodes * p.gpus_per_node;
  }
  for (GroupKind kind : kAllGroupKinds) {
    const std::vector<std::pair<int, int>> bounds = p.layout.group_bounds(kind);
    GroupPlacement g{kind, world / static_cast<int>(bounds.size()), static_cast<int>(bounds.size())};
    // Groups of one rank are within anything; past the first group that crosses both, the rest
    // change nothing (the search plans thousands of layouts of up to 10^5 ranks).
    for (std::size_t i = 0; g.size > 1 && i < bounds.size() && (g.within_node || g.within_nvlink); ++i) {
      const auto [lo, hi] = bounds[i];
      g.within_node = g.within_node && lo / p.gpus_per_node == hi / p.gpus_per_node;
      g.within_nvlink = g.within_nvlink && lo / p.nvlink_domain == hi / p.nvlink_domain;
    }
    p.groups.push_back(g);
  }
  return p;
}

double micro_batches_per_dp_rank(const Config& c, const ParallelLayout& l) {
  return static_cast<double>(c.train.global_batch_size.value_or(1)) /
         (static_cast<double>(c.train.micro_batch_size.value_or(1)) * l.dp);
}

std::string format_rank_map(const LayoutPlan& p, int max_ranks) {
  std::string out = "rank  node";
  for (GroupKind k : kAllGroupKinds) out += fmt::format(" {:>8}", group_kind_name(k));
  out += "\n";
  // Each rank's index in each kind, from the groups (a rank's position in its group).
  std::vector<std::vector<int>> index(std::size(kAllGroupKinds), std::vector<int>(static_cast<std::size_t>(p.layout.world)));
  for (std::size_t k = 0; k < std::size(kAllGroupKinds); ++k)
    for (const RankGroup& g : p.layout.groups(kAllGroupKinds[k]))
      for (std::size_t i = 0; i < g.size(); ++i) index[k][static_cast<std::size_t>(g[i])] = static_cast<int>(i);
  const int shown = std::min(p.layout.world, max_ranks);
  for (int r = 0; r < shown; ++r) {
    out += fmt::format("{:>4} {:>5}", r, r / p.gpus_per_node);
    for (std::size_t k = 0; k < std::size(kAllGroupKinds); ++k) out += fmt::format(" {:>8}", index[k][static_cast<std::size_t>(r)]);
    out += "\n";
  }
  if (shown < p.layout.world) out += fmt::format("... {} more ranks (--ranks N shows N)\n", p.layout.world - shown);
  return out;
}

}  // namespace epx
