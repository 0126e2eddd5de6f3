#include "epx/model/pipeline_spec.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/base/error.hpp"

namespace epx {

PipelineSpec PipelineSpec::split(int num_layers, int pp, std::optional<int> vpp, std::optional<int> first_stage_layers,
                                 std::optional<int> last_stage_layers, bool embedding_counts, bool loss_counts) {
  if (pp < 1) throw ConfigError(fmt::format("model.pipeline_model_parallel_size={}: must be 1 or more", pp));
  if (vpp && *vpp < 1)
    throw ConfigError(fmt::format("model.virtual_pipeline_model_parallel_size={}: must be 1 or more (or None)", *vpp));
  PipelineSpec s;
  s.stages = pp;
  s.chunks = vpp.value_or(1);
  s.interleaved = pp > 1 && vpp.has_value();
  const int V = s.chunks;
  // Each stage's layer count, then each chunk's: the stage's share split evenly over its chunks.
  std::vector<int> per_stage(static_cast<std::size_t>(pp));
  if (pp > 1 && (first_stage_layers || last_stage_layers)) {
    if (embedding_counts || loss_counts)
      throw ConfigError(
          "model.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage: cannot be combined with "
          "account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split; set one or the other");
    const int first = first_stage_layers.value_or(0), last = last_stage_layers.value_or(0);
    const int middle_stages = pp - (first_stage_layers ? 1 : 0) - (last_stage_layers ? 1 : 0);
    const int middle = num_layers - first - last;
    if (first < 0 || last < 0 || middle < 0 || (middle_stages == 0 ? middle != 0 : middle % middle_stages != 0))
      throw ConfigError(fmt::format(
          "model.num_layers_in_first_pipeline_stage={}, num_layers_in_last_pipeline_stage={}: the other {} of "
          "num_layers ({}) must split evenly over the {} middle stage(s); change the first / last stage's layers",
          first_stage_layers ? std::to_string(first) : "None", last_stage_layers ? std::to_string(last) : "None",
          middle, num_layers, middle_stages));
    for (int p = 0; p < pp; ++p)
      per_stage[static_cast<std::size_t>(p)] = p == 0 && first_stage_layers ? first
                                               : p == pp - 1 && last_stage_layers ? last
                                                                                  : middle / middle_stages;
    for (int p = 0; p < pp; ++p)
      if (per_stage[static_cast<std::size_t>(p)] % V != 0)
        throw ConfigError(fmt::format(
            "model.virtual_pipeline_model_parallel_size={}: stage {}'s {} layers do not split evenly over its {} "
            "model chunks; change the first / last stage's layers or the VPP size",
            V, p, per_stage[static_cast<std::size_t>(p)], V));
    // Chunks in virtual-stage order (chunk-major), each taking the next layers.
    s.layers.assign(static_cast<std::size_t>(pp), std::vector<LayerRange>(static_cast<std::size_t>(V)));
    int next = 0;
    for (int v = 0; v < V; ++v)
      for (int p = 0; p < pp; ++p) {
        const int n = per_stage[static_cast<std::size_t>(p)] / V;
        s.layers[static_cast<std::size_t>(p)][static_cast<std::size_t>(v)] = {next, next + n};
        next += n;
      }
    return s;
  }
  // Even: the embedding and loss may count as one layer each of the first / last virtual stage.
  const int counted = num_layers + (embedding_counts ? 1 : 0) + (loss_counts ? 1 : 0);
  if (counted % (pp * V) != 0)
    throw ConfigError(fmt::format(
        "model.num_layers={}: {} layers (counting the embedding / loss the split accounts for) do not split evenly "
        "over PP x VPP = {} x {} model chunks; change num_layers, the PP / VPP sizes, or set "
        "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage",
        num_layers, counted, pp, V));
  const int n = counted / (pp * V), shift = embedding_counts ? 1 : 0;
  s.layers.assign(static_cast<std::size_t>(pp), std::vector<LayerRange>(static_cast<std::size_t>(V)));
  for (int v = 0; v < V; ++v)
    for (int p = 0; p < pp; ++p) {
      const int k = v * pp + p;
      s.layers[static_cast<std::size_t>(p)][static_cast<std::size_t>(v)] = {
          std::clamp(k * n - shift, 0, num_layers), std::clamp((k + 1) * n - shift, 0, num_layers)};
    }
  return s;
}

std::string PipelineSpec::describe() const {
  std::vector<std::string> stage_text;
  for (int p = 0; p < stages; ++p) {
    std::vector<std::string> chunk_text;
    for (const LayerRange& r : layers[static_cast<std::size_t>(p)]) chunk_text.push_back(fmt::format("[{},{})", r.first, r.end));
    stage_text.push_back(fmt::format("stage {} {}", p, fmt::join(chunk_text, " ")));
  }
  return fmt::format("PP {}{}: {}", stages, interleaved ? fmt::format(" x VPP {}", chunks) : "", fmt::join(stage_text, ", "));
}

}  // namespace epx
