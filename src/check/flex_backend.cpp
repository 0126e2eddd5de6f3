#include "epx/check/flex_backend.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace epx {
namespace {

void fallback_to_alltoall(ModelConfig& m) {
  m.moe_token_dispatcher_type = "alltoall";
  m.moe_flex_dispatcher_backend.reset();
}

}  // namespace

bool deepep_supported(const GpuInfo& gpu) {
  return gpu.major == 8 || gpu.major == 9 || gpu.device_name.starts_with("NVIDIA B200") ||
         gpu.device_name.starts_with("NVIDIA B300");
}

bool hybridep_supported(const GpuInfo& gpu) {
  return gpu.major == 8 || gpu.major == 9 || gpu.major == 10;
}

bool uses_flex(const ModelConfig& m, const char* backend) {
  return m.moe_token_dispatcher_type == "flex" && m.moe_flex_dispatcher_backend == backend;
}

void apply_flex_dispatcher_backend(Config& cfg, const std::string& backend, const GpuInfo& gpu,
                                   std::vector<Finding>& out) {
  ModelConfig& m = cfg.model;
  if (!m.num_moe_experts || *m.num_moe_experts == 0) {
    out.push_back({"flex.apply_not_moe", Severity::warning, {{"model.num_moe_experts", "null"}},
                   "DeepEP and HybridEP are only applicable to MoE models. Model config does not "
                   "use MoE (num_moe_experts is not set or is 0). Skipping DeepEP configuration.",
                   ""});
    return;
  }
  // No CUDA device (epx's own runtime), or a GPU not named: select the backend without a GPU
  // check (for an unnamed GPU the flex.*_gpu rules are reported unchecked).
  bool supported = !gpu.cuda() || !gpu.named();
  if (!supported) supported = backend == "deepep" ? deepep_supported(gpu) : hybridep_supported(gpu);
  if (!supported) {
    const std::string message =
        backend == "deepep"
            ? fmt::format("DeepEP is only applicable to Ampere, Hopper, and Blackwell (B200/B300) "
                          "GPUs. Current GPU: {}. Falling back to alltoall.",
                          gpu.device_name)
            : fmt::format("HybridEP is only applicable for GB200, GB300 with NVL72 and for Ampere, "
                          "Hopper, B200 and B300 GPUs. Current GPU: {}. Falling back to alltoall.",
                          gpu.device_name);
    out.push_back({"flex.apply_fallback", Severity::warning, {{"target.gpu", gpu.name}}, message,
                   // HybridEP where it runs; else the fallback as asked for (alltoall)
                   backend == "deepep" && hybridep_supported(gpu) ? "--moe_flex_dispatcher_backend hybridep"
                                                                  : "--moe_flex_dispatcher_backend None"});
    fallback_to_alltoall(m);
    return;
  }
  m.moe_token_dispatcher_type = "flex";
  m.moe_flex_dispatcher_backend = backend;
  m.moe_shared_expert_overlap = false;
  cfg.explicit_keys["model.moe_token_dispatcher_type"] = Config::Origin::flag;
  cfg.explicit_keys["model.moe_flex_dispatcher_backend"] = Config::Origin::flag;
}

void validate_flex_dispatcher_backend(Config& cfg, std::vector<Finding>& out) {
  ModelConfig& m = cfg.model;
  if (m.moe_token_dispatcher_type != "flex" || m.moe_flex_dispatcher_backend) return;
  out.push_back({"flex.no_backend", Severity::warning,
                 {{"model.moe_token_dispatcher_type", "flex"},
                  {"model.moe_flex_dispatcher_backend", "null"}},
                 "flex dispatcher with no backend: Bridge falls back to the alltoall dispatcher",
                 "model.moe_flex_dispatcher_backend=deepep"});
  fallback_to_alltoall(m);
}

HybridEpTopology hybridep_topology(const Config& cfg, const GpuInfo& gpu) {
  HybridEpTopology t;
  const Int ep = cfg.model.expert_model_parallel_size;
  if (ep <= 0) {
    t.error = "HybridEP expert parallel size must be positive.";
  } else if (!gpu.named()) {
    t.error = "the NVLink domain depends on the GPU, which is not given (pass -g GPU)";
  } else if (!gpu.cuda()) {
    // epx's runtime: the ranks that share a node form one shared-memory domain (all the EP
    // ranks when the world size is not given).
    const Int per_node = gpus_per_node(cfg).value_or(ep);
    t = {std::min(ep, per_node), per_node, 0, ""};
  } else if (gpu.nvlink_domain == 72) {
    if (ep > 72)
      t.error = "HybridEP expert parallel size must not exceed the 72-rank NVLink domain.";
    else
      t = {ep, 72, 1, ""};
  } else if (gpu.major >= 8) {  // h100/b200/b300 in Bridge; h200/a100 alike (8-GPU NVLink)
    t = {std::min<Int>(ep, 8), 8, 0, ""};
  } else {
    t.error = fmt::format("Unsupported GPU type for HybridEP topology: '{}'.", gpu.name);
  }
  return t;
}

std::string harness_hybridep_ep_error(const GpuInfo& gpu, Int ep) {
  if (gpu.nvlink_domain == 72)
    return ep > 72 ? "HybridEP expert parallel size must not exceed the 72-rank NVLink domain" : "";
  if (gpu.name == "h100" || gpu.name == "b200" || gpu.name == "b300") return "";
  return fmt::format("the harness has no HybridEP topology for {} (it knows h100, b200, b300 and the 72-GPU racks)",
                     gpu.name);
}

void apply_hybridep_topology_env(Config& cfg, const GpuInfo& gpu) {
  if (!uses_flex(cfg.model, "hybridep")) return;
  const HybridEpTopology t = hybridep_topology(cfg, gpu);
  if (!t.error.empty()) return;  // reported by the hybridep.topology rule
  cfg.env_vars.try_emplace(kRanksPerDomainVar, std::to_string(t.ranks_per_domain));
  cfg.env_vars.try_emplace("NVLINK_DOMAIN_SIZE", std::to_string(t.nvlink_domain_size));
  cfg.env_vars.try_emplace("USE_MNNVL", std::to_string(t.use_mnnvl));
}

}  // namespace epx
