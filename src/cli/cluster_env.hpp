// The emulated cluster's state as scripts/cluster.sh leaves it: $EPX_CLUSTER_DIR (default
// /run/epx-cluster)/cluster.env, key=value lines (nodes, ranks_per_node, subnet, agent,
// link_gbit, ...).
#pragma once

#include <map>
#include <string>

namespace epx::cli {

std::string cluster_env_path();
// The key=value lines; empty when no cluster is up (the file is missing).
std::map<std::string, std::string> read_cluster_env();

}  // namespace epx::cli
