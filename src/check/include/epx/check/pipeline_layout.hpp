// Megatron-Core's pipeline_model_parallel_layout strings ("Et|(tt|)*30mL"): one stage per '|',
// each a run of layers, E the embedding, t a decoder layer, m an MTP layer, L the loss.
#pragma once

#include <string>
#include <vector>

#include "epx/config/config.hpp"

namespace epx {

// The stages of `text`, each its layer characters, as PipelineParallelLayerLayout.parse_str_to_list
// reads it: commas dropped, "(...)*n" and then "x*n" unrolled. Throws ConfigError with Megatron's
// message for an unknown character, and for a layout that unrolls beyond 2^20 layers.
std::vector<std::string> parse_pipeline_layout(const std::string& text);

// The layout of `layers` decoder layers per virtual stage (in virtual-stage order), the
// embedding first and the loss last, `mtp` MTP layers before it: "Et*3|t*4|tmL" (runs of more
// than two written x*n).
std::string pipeline_layout_text(const std::vector<Int>& layers, Int mtp = 0);

}  // namespace epx
