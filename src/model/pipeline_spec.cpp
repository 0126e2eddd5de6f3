#include "epx/model/pipeline_spec.hpp"

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {

PipelineSpec PipelineSpec::from_layer_counts(int pp, int chunks, bool interleaved,
                                             const std::vector<int>& layers_per_virtual_stage) {
  if (pp < 1 || chunks < 1 || layers_per_virtual_stage.size() != static_cast<std::size_t>(pp * chunks))
    throw std::logic_error("PipelineSpec: one layer count per virtual stage");
  PipelineSpec s;
  s.stages = pp;
  s.chunks = chunks;
  s.interleaved = interleaved;
  s.layers.assign(static_cast<std::size_t>(pp), std::vector<LayerRange>(static_cast<std::size_t>(chunks)));
  int next = 0;
  for (int k = 0; k < pp * chunks; ++k) {
    const int n = layers_per_virtual_stage[static_cast<std::size_t>(k)];
    s.layers[static_cast<std::size_t>(k % pp)][static_cast<std::size_t>(k / pp)] = {next, next + n};
    next += n;
  }
  return s;
}

std::string PipelineSpec::describe() const {
  std::vector<std::string> stage_text;
  for (int p = 0; p < stages; ++p) {
    std::vector<std::string> chunk_text;
    for (int c = 0; c < chunks; ++c) {
      const LayerRange& r = layers[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
      chunk_text.push_back(fmt::format("[{},{}){}", r.first, r.end, standalone_mtp(p, c) ? "+MTP" : ""));
    }
    stage_text.push_back(fmt::format("stage {} {}", p, fmt::join(chunk_text, " ")));
  }
  return fmt::format("PP {}{}: {}", stages, interleaved ? fmt::format(" x VPP {}", chunks) : "", fmt::join(stage_text, ", "));
}

}  // namespace epx
