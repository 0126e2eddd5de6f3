#include "cluster_env.hpp"

#include <fstream>

#include "epx/base/env.hpp"

namespace epx::cli {

std::string cluster_env_path() { return env_path(env::kClusterDir).value_or("/run/epx-cluster") + "/cluster.env"; }

std::map<std::string, std::string> read_cluster_env() {
  std::ifstream in(cluster_env_path());
  std::map<std::string, std::string> kv;
  for (std::string line; std::getline(in, line);)
    if (auto eq = line.find('='); eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
  return kv;
}

}  // namespace epx::cli
