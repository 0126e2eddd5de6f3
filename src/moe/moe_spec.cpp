#include "epx/moe/moe_spec.hpp"

#include <cmath>

#include <fmt/format.h>

namespace epx {

const char* aux_loss_type(AuxLoss k) {
  switch (k) {
    case AuxLoss::aux_loss: return "aux_loss";
    case AuxLoss::seq_aux_loss: return "seq_aux_loss";
    case AuxLoss::global_aux_loss: return "global_aux_loss";
  }
  return "";
}

std::string quantile_balancing_uneven(std::int64_t tokens, int topk, std::int64_t experts) {
  if ((tokens * topk) % experts == 0) return "";
  return fmt::format("Quantile balancing requires the number of routed assignments ({} tokens * top-{}) to be divisible "
                     "by {} experts.",
                     tokens, topk, experts);
}

const char* aux_loss_log_name(AuxLoss k) {
  switch (k) {
    case AuxLoss::aux_loss: return "load_balancing_loss";
    case AuxLoss::seq_aux_loss: return "seq_load_balancing_loss";
    case AuxLoss::global_aux_loss: return "global_load_balancing_loss";
  }
  return "";
}

std::int64_t MoESpec::capacity(std::int64_t num_tokens) const {
  if (!capacity_factor) return num_tokens;
  const double cap = std::ceil(static_cast<double>(num_tokens) * topk /
                               static_cast<double>(num_experts) * *capacity_factor);
  return std::min<std::int64_t>(num_tokens, static_cast<std::int64_t>(cap));
}

}  // namespace epx
