// Megatron-Bridge's mixed_precision group: a recipe name or a MixedPrecisionConfig, applied over
// the model's and DDP's precision fields first thing in runtime_config_update.
#pragma once

#include <string>
#include <vector>

#include "epx/config/config.hpp"

namespace epx {

// Applies a config's `mixed_precision` (kept as an unmodelled Bridge group) to model.bf16, fp16,
// fp8, fp8_recipe, fp8_param and ddp.grad_reduce_in_fp32, as MixedPrecisionConfig.setup does:
// every field it has, defaults included, replaces the model's. Warns where that changes a value
// an override or flag set. Throws ConfigError for an unknown recipe name or FP8 with FP4.
void apply_mixed_precision(Config& c, std::vector<Finding>& out);
// The keys apply_mixed_precision replaces (a fix setting one must drop the group first).
inline const std::vector<std::string> kMixedPrecisionKeys = {
    "model.bf16", "model.fp16", "model.fp8", "model.fp8_recipe", "model.fp8_param", "ddp.grad_reduce_in_fp32"};

// The group as the user gave it ("mixed_precision=NAME", or its fields), none when unset: what
// set the model's precision, for a refusal to name.
OptString mixed_precision_source(const Config& c);
// The FP4 format the group trains in (fp4), none when it does not.
OptString mixed_precision_fp4(const Config& c);

// A mixed-precision recipe's fields (MIXED_PRECISION_RECIPES[name]()) as the group's mapping, for
// the harness's -c. Throws ConfigError for an unknown name.
YAML::Node mixed_precision_recipe(const std::string& name);

}  // namespace epx
