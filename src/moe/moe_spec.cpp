#include "epx/moe/moe_spec.hpp"

#include <cmath>

namespace epx {

std::int64_t MoESpec::capacity(std::int64_t num_tokens) const {
  if (!capacity_factor) return num_tokens;
  const double cap = std::ceil(static_cast<double>(num_tokens) * topk /
                               static_cast<double>(num_experts) * *capacity_factor);
  return std::min<std::int64_t>(num_tokens, static_cast<std::int64_t>(cap));
}

}  // namespace epx
