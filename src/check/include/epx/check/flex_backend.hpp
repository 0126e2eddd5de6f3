// Megatron-Bridge's flex-dispatcher backend steps (training/flex_dispatcher_backend.py) and the
// HybridEP topology environment (scripts/performance/utils/utils.py), by target GPU.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "epx/check/check.hpp"

namespace epx {

// apply_flex_dispatcher_backend: what `--moe_flex_dispatcher_backend deepep|hybridep` does.
void apply_flex_dispatcher_backend(Config& cfg, const std::string& backend, const GpuInfo& gpu,
                                   std::vector<Finding>& out);

// validate_flex_dispatcher_backend's non-raising part: flex with no backend falls back to
// alltoall. (The raising part is the flex.deepep_gpu / flex.hybridep_gpu rules.)
void validate_flex_dispatcher_backend(Config& cfg, std::vector<Finding>& out);

struct HybridEpTopology {
  Int ranks_per_domain = 0;  // NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN
  Int nvlink_domain_size = 0;
  int use_mnnvl = 0;
  std::string error;  // non-empty: Bridge raises ValueError with this text
};

// The NVLink-domain settings HybridEP needs for this GPU and EP size.
HybridEpTopology hybridep_topology(const Config& cfg, const GpuInfo& gpu);

inline constexpr const char* kRanksPerDomainVar = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN";

// Why the harness raises on `-ep N` for a HybridEP recipe on this GPU (overrides.py: past a
// 72-GPU rack, or a GPU it has no topology for: it knows h100, b200, b300 and the racks); empty
// when it does not. The ranks it then sets are hybridep_topology's.
std::string harness_hybridep_ep_error(const GpuInfo& gpu, Int ep);

// For flex+hybridep, set the topology variables the recipe left unset (as Bridge's harness does).
void apply_hybridep_topology_env(Config& cfg, const GpuInfo& gpu);

bool uses_flex(const ModelConfig& m, const char* backend);

// Bridge's GPU gates: DeepEP on Ampere, Hopper, B200, B300; HybridEP on compute capability 8-10.
bool deepep_supported(const GpuInfo& gpu);
bool hybridep_supported(const GpuInfo& gpu);

}  // namespace epx
