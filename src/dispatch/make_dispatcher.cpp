// Choosing a dispatcher from its options (built from the config by train/job_spec).
#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/dispatch/dispatcher.hpp"

namespace epx {

const char* to_string(FlexBackend b) { return b == FlexBackend::deepep ? "deepep" : "hybridep"; }

std::int64_t experts_per_ep_rank(std::int64_t num_experts, int ep_size) {
  if (num_experts % ep_size != 0)
    throw ConfigError(fmt::format(
        "[parallel.experts_divisible_by_ep] model.num_moe_experts={} is not divisible by "
        "model.expert_model_parallel_size={}: every EP rank holds the same number of experts",
        num_experts, ep_size));
  return num_experts / ep_size;
}

std::unique_ptr<TokenDispatcher> make_dispatcher(const DispatcherOptions& options, std::int64_t num_experts,
                                                 ProcessGroups& groups, CommStream& stream) {
  if (options.type == DispatcherType::flex) return make_flex_dispatcher(num_experts, groups, stream, options.flex);
  return make_alltoall_dispatcher(num_experts, groups, stream);
}

}  // namespace epx
