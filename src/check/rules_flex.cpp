// The flex dispatcher's backends (DeepEP, HybridEP, NCCL EP) and HybridEP's topology.
#include <charconv>

#include "epx/base/env.hpp"
#include "epx/base/python_int.hpp"
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_flex_rules(RuleTable& add) {
  add("flex.apply_not_moe", W, {"model.num_moe_experts"}, kBridgeFlex,
      "--moe_flex_dispatcher_backend on a model without experts is skipped");
  add("flex.apply_fallback", W, {"target.gpu", "model.moe_flex_dispatcher_backend"}, kBridgeFlex,
      "backend unsupported on the GPU: apply falls back to alltoall");
  add("flex.no_backend", W,
      {"model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend"}, kBridgeFlex,
      "flex without a backend falls back to alltoall");
  add("flex.deepep_gpu", E, {"model.moe_flex_dispatcher_backend", "target.gpu"}, kBridgeFlex,
      "DeepEP needs Ampere, Hopper, B200 or B300", [](const CheckContext& c) {
        if (!c.cuda() || !uses_flex(c.cfg.model, "deepep")) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        return fail_if(!deepep_supported(c.gpu),
                       fmt::format("DeepEP is supported for Ampere, Hopper, and Blackwell "
                                   "(B200/B300) GPUs. Current GPU: {}",
                                   c.gpu.device_name),
                       hybridep_supported(c.gpu) ? "model.moe_flex_dispatcher_backend=hybridep"
                                                 : "model.moe_token_dispatcher_type=alltoall");
      });
  add("flex.hybridep_gpu", E, {"model.moe_flex_dispatcher_backend", "target.gpu"}, kBridgeFlex,
      "HybridEP needs compute capability 8, 9 or 10", [](const CheckContext& c) {
        if (!c.cuda() || !uses_flex(c.cfg.model, "hybridep")) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        return fail_if(!hybridep_supported(c.gpu),
                       "HybridEP is supported for GB200, GB300 with NVL72 and for Ampere, Hopper, "
                       "B200 and B300 GPUs",
                       "model.moe_token_dispatcher_type=alltoall");
      });
  add("flex.backend_without_flex", W,
      {"model.moe_flex_dispatcher_backend", "model.moe_token_dispatcher_type"}, kSeedOverlap,
      "a backend set while the dispatcher is not flex does nothing", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.moe_token_dispatcher_type == "flex" || !m.moe_flex_dispatcher_backend ||
            m.moe_flex_dispatcher_backend == "ncclep")  // an error: flex.backend_needs_flex
          return pass();
        // Megatron's default backend is "deepep" on every config; flag what the user asked for.
        const bool asked = c.user.set_on_command_line("model.moe_flex_dispatcher_backend") ||
                           *m.moe_flex_dispatcher_backend != "deepep";
        return fail_if(asked,
                       fmt::format("moe_flex_dispatcher_backend={} alone does nothing while "
                                   "moe_token_dispatcher_type is '{}'",
                                   *m.moe_flex_dispatcher_backend, m.moe_token_dispatcher_type),
                       "model.moe_token_dispatcher_type=flex");
      });
  add("flex.backend_needs_flex", E,
      {"model.moe_flex_dispatcher_backend", "model.moe_token_dispatcher_type", "model.moe_pad_expert_input_to_capacity"},
      kMcore, "NCCL-EP needs the flex dispatcher; DeepEP does not pad to capacity", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.moe_flex_dispatcher_backend == "ncclep" && m.moe_token_dispatcher_type != "flex")
          return fail("moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'.",
                      "model.moe_token_dispatcher_type=flex");
        return fail_if(m.moe_token_dispatcher_type == "flex" && m.moe_flex_dispatcher_backend == "deepep" &&
                           m.moe_pad_expert_input_to_capacity,
                       "Flex token dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity",
                       "model.moe_pad_expert_input_to_capacity=false");
      });
  add("flex.runtime_package", A, {"model.moe_flex_dispatcher_backend", "target.gpu"},
      kSeedDispatcher, "a flex backend needs its runtime package in the container",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!c.cuda() || m.moe_token_dispatcher_type != "flex" || !m.moe_flex_dispatcher_backend)
          return pass();
        return fail(fmt::format("confirm the {} package imports in the target container before "
                                "reading timings: a missing package fails at model construction, "
                                "an environment limitation, not a timing (alltoall is then the "
                                "only measured fallback)",
                                *m.moe_flex_dispatcher_backend));
      });

  add("flex.cpu_backend", E, {"model.moe_flex_dispatcher_backend", "target.gpu"},
      "epx runtime (src/dispatch/flex_dispatcher.cpp)",
      "on the cpu target the flex backend must be one epx's runtime has (deepep, hybridep)",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (c.cuda() || m.moe_token_dispatcher_type != "flex" || !m.moe_flex_dispatcher_backend) return pass();
        const std::string& b = *m.moe_flex_dispatcher_backend;
        return fail_if(b != "deepep" && b != "hybridep",
                       fmt::format("moe_flex_dispatcher_backend={} is not built into epx's CPU runtime "
                                   "(it has deepep and hybridep); the run would fail when the "
                                   "dispatcher is made",
                                   b),
                       "model.moe_flex_dispatcher_backend=deepep");
      });

  // ---- HybridEP topology --------------------------------------------------------------------
  add("hybridep.topology", E, {"model.expert_model_parallel_size", "target.gpu"}, kBridgeTopology,
      "HybridEP has an NVLink-domain layout for this GPU and EP size (epx also maps h200 and "
      "a100 like h100, and cpu to the ranks of one node)", [](const CheckContext& c) {
        if (!uses_flex(c.cfg.model, "hybridep")) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        const HybridEpTopology t = hybridep_topology(c.cfg, c.gpu);
        return fail_if(!t.error.empty(), t.error, "model.moe_token_dispatcher_type=alltoall");
      });
  add("hybridep.domain_divides_ep", E,
      {"model.expert_model_parallel_size", "env_vars." + std::string(kRanksPerDomainVar)}, "epx",
      "the NVLink-domain rank count divides EP", [](const CheckContext& c) {
        if (!uses_flex(c.cfg.model, "hybridep")) return pass();
        auto it = c.cfg.env_vars.find(kRanksPerDomainVar);
        if (it == c.cfg.env_vars.end()) return pass();
        Int ranks = 0;
        try {
          ranks = std::stoll(it->second);
        } catch (...) {
        }
        const Int ep = c.cfg.model.expert_model_parallel_size;
        const HybridEpTopology t = hybridep_topology(c.cfg, c.gpu);
        return fail_if(ranks <= 0 || ep % ranks != 0,
                       fmt::format("{}={} must be a positive divisor of the EP size {}",
                                   kRanksPerDomainVar, it->second, ep),
                       t.error.empty()
                           ? fmt::format("env_vars.{}={}", kRanksPerDomainVar, t.ranks_per_domain)
                           : fmt::format("env_vars.{}=<the EP ranks in one NVLink domain>",
                                         kRanksPerDomainVar));
      });
  // HybridEP reads its chunk size with int() and cuts the tokens by it.
  add("hybridep.tokens_per_chunk", E, {"env_vars." + std::string(env::kHybridEpTokensPerChunk.name)}, "epx",
      "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API is a positive whole number of tokens", [](const CheckContext& c) {
        const auto& knob = env::kHybridEpTokensPerChunk;
        const auto it = c.cfg.env_vars.find(knob.name);
        if (!uses_flex(c.cfg.model, "hybridep") || it == c.cfg.env_vars.end()) return pass();
        const std::optional<std::string> text = python_int_text(it->second);
        Int tokens = 0;
        const bool whole = text && std::from_chars(text->data(), text->data() + text->size(), tokens).ec == std::errc();
        return fail_if(!whole || tokens < knob.min || tokens > knob.max,
                       fmt::format("{}='{}' must be a whole number of tokens from {:.0f} to {:.0f} (HybridEP's "
                                   "pipelined dispatch chunk, read with int())",
                                   knob.name, it->second, knob.min, knob.max),
                       fmt::format("env_vars.{}={:.0f}", knob.name, knob.fallback));
      });
  add("hybridep.domain_mismatch", W,
      {"env_vars." + std::string(kRanksPerDomainVar), "model.expert_model_parallel_size",
       "target.gpu"},
      kSeedDispatcher, "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN matches the topology",
      [](const CheckContext& c) {
        if (!uses_flex(c.cfg.model, "hybridep")) return pass();
        auto it = c.cfg.env_vars.find(kRanksPerDomainVar);
        if (it == c.cfg.env_vars.end()) return pass();
        if (!c.gpu_named()) return gpu_not_given();
        const HybridEpTopology t = hybridep_topology(c.cfg, c.gpu);
        if (!t.error.empty()) return pass();
        return fail_if(it->second != std::to_string(t.ranks_per_domain),
                       fmt::format("{}={} does not match the NVLink domain of {} x EP{} (expected "
                                   "{}): performance and sometimes correctness will suffer",
                                   kRanksPerDomainVar, it->second, c.gpu.name,
                                   c.cfg.model.expert_model_parallel_size, t.ranks_per_domain),
                       fmt::format("env_vars.{}={}", kRanksPerDomainVar, t.ranks_per_domain));
      });
  add("hybridep.env_without_hybridep", W, {"env_vars." + std::string(kRanksPerDomainVar)},
      kBridgeTopology, "HybridEP topology variables set without the HybridEP backend",
      [](const CheckContext& c) {
        // Bridge drops the topology variables unless the backend is hybridep; with that backend
        // under another dispatcher it sets them, and nothing reads them.
        const bool backend = c.cfg.model.moe_flex_dispatcher_backend == std::optional<std::string>("hybridep");
        return fail_if(!uses_flex(c.cfg.model, "hybridep") &&
                           c.cfg.env_vars.count(kRanksPerDomainVar),
                       fmt::format("{} is set but the dispatcher is not flex+hybridep: {}", kRanksPerDomainVar,
                                   backend ? "Bridge keeps it for the hybridep backend, but the token dispatcher "
                                             "does not use HybridEP, so nothing reads it"
                                           : "Bridge removes it, it has no effect"),
                       fmt::format("~env_vars.{}", kRanksPerDomainVar));
      });
}

}  // namespace epx::rule_helpers
