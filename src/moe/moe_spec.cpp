#include "epx/moe/moe_spec.hpp"

#include <cmath>

#include <fmt/format.h>

namespace epx {

namespace {

// Per AuxLoss: moe_router_load_balancing_type's name, and the training log's.
constexpr std::array<std::array<const char*, 2>, kAuxLosses.size()> kAuxLossNames = {{
    {"aux_loss", "load_balancing_loss"},
    {"seq_aux_loss", "seq_load_balancing_loss"},
    {"global_aux_loss", "global_load_balancing_loss"}}};

}  // namespace

const char* aux_loss_type(AuxLoss k) { return kAuxLossNames[static_cast<std::size_t>(k)][0]; }
const char* aux_loss_log_name(AuxLoss k) { return kAuxLossNames[static_cast<std::size_t>(k)][1]; }

std::string quantile_balancing_uneven(std::int64_t tokens, int topk, std::int64_t experts) {
  if ((tokens * topk) % experts == 0) return "";
  return fmt::format("Quantile balancing requires the number of routed assignments ({} tokens * top-{}) to be divisible "
                     "by {} experts.",
                     tokens, topk, experts);
}

std::int64_t MoESpec::capacity(std::int64_t num_tokens) const {
  if (!capacity_factor) return num_tokens;
  const double cap = std::ceil(static_cast<double>(num_tokens) * topk /
                               static_cast<double>(num_experts) * *capacity_factor);
  return std::min<std::int64_t>(num_tokens, static_cast<std::int64_t>(cap));
}

}  // namespace epx
