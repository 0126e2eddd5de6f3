// What `epx layer` and `epx bench layer` take from `epx check`: the errors of the rules on the
// layer's own math (MoE, precision and the MLP activation's rules: a fused activation Megatron
// refuses, a router setting it raises on). A config Megatron would refuse is refused, not
// computed with other math. The attention's, training's and layout rules are not the layer's: it
// has no attention, folds its groups over its own ranks, and one process takes every expert.
#pragma once

#include <optional>
#include <string>

#include "epx/config/config.hpp"

namespace epx::cli {

// The check's report cut to those errors (findings and verdict), or none when there are none.
std::optional<std::string> layer_check_errors(const Config& loaded, const OptString& flex_backend_flag);

}  // namespace epx::cli
