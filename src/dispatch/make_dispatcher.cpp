// Choosing a dispatcher from the (resolved) config: model.moe_token_dispatcher_type, and for flex the
// backend, its SM-count knob and HybridEP's environment variables.
#include <cstdlib>

#include <fmt/format.h>

#include "epx/config.hpp"
#include "epx/dispatcher.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

// A positive whole number from the process environment, else the recipe's env_vars, else
// `fallback`.
int env_count(const Config& cfg, const char* name, int fallback) {
  std::string text;
  if (const char* v = std::getenv(name); v != nullptr && *v != '\0') {
    text = v;
  } else if (auto it = cfg.env_vars.find(name); it != cfg.env_vars.end()) {
    text = it->second;
  } else {
    return fallback;
  }
  char* end = nullptr;
  const long n = std::strtol(text.c_str(), &end, 10);
  if (*end != '\0' || n < 1 || n > 1 << 20)
    throw ConfigError(fmt::format("{} = '{}': expected a positive whole number", name, text));
  return static_cast<int>(n);
}

}  // namespace

std::int64_t experts_per_ep_rank(std::int64_t num_experts, int ep_size) {
  if (num_experts % ep_size != 0)
    throw ConfigError(fmt::format(
        "model.num_moe_experts = {} is not divisible by model.expert_model_parallel_size = {}: "
        "every EP rank holds the same number of experts",
        num_experts, ep_size));
  return num_experts / ep_size;
}

FlexOptions flex_options_from_config(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  FlexOptions o;
  o.backend = m.moe_flex_dispatcher_backend.value_or("deepep");
  if (const OptInt& sms = m.moe_flex_dispatcher_num_sms) {
    if (*sms < 1)
      throw ConfigError(fmt::format("model.moe_flex_dispatcher_num_sms = {}: expected a positive number (default 20)", *sms));
    o.num_sms = static_cast<int>(*sms);
  }
  o.ranks_per_domain = env_count(cfg, "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", 0);
  o.tokens_per_chunk = env_count(cfg, "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API", o.tokens_per_chunk);
  return o;
}

std::unique_ptr<TokenDispatcher> make_dispatcher(const Config& cfg, std::int64_t num_experts,
                                                 ProcessGroups& groups, CommStream& stream) {
  const std::string& type = cfg.model.moe_token_dispatcher_type;
  if (type == "flex") return make_flex_dispatcher(num_experts, groups, stream, flex_options_from_config(cfg));
  if (type == "alltoall") return make_alltoall_dispatcher(num_experts, groups, stream);
  throw ConfigError(fmt::format(
      "model.moe_token_dispatcher_type = {}: epx runs expert parallelism with the alltoall and flex "
      "dispatchers only; set model.moe_token_dispatcher_type=alltoall or flex",
      type));
}

}  // namespace epx
