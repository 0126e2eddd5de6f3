// Balancing the pipeline's stages from their measured compute times.
#include "epx/plan/pipeline_balance.hpp"

#include <algorithm>

#include "epx/check/pipeline_layout.hpp"
#include "epx/check/pipeline_split.hpp"

namespace epx {

std::optional<PipelineBalance> balance_pipeline(const ModelConfig& m, const std::vector<double>& stage_compute_s) {
  if (m.mtp_num_layers.value_or(0) > 0) return std::nullopt;
  PipelineSplit split;
  try {
    split = pipeline_split(m);
  } catch (const ConfigError&) {
    return std::nullopt;
  }
  const auto stages = static_cast<std::size_t>(split.stages);
  if (stages < 2 || stage_compute_s.size() != stages) return std::nullopt;
  PipelineBalance b;
  b.layers_now.assign(stages, 0);
  for (std::size_t k = 0; k < split.layers.size(); ++k)
    b.layers_now[static_cast<std::size_t>(split.stage_of(static_cast<int>(k)))] += split.layers[k];
  // A layer's time: the mean over the stages that hold layers but neither the embedding nor the
  // loss; with none such (PP 2), the embedding's stage, its lookup counted as free.
  const int embedding = split.stage_of(split.embedding_stage), loss = split.stage_of(split.loss_stage);
  const auto per_layer = [&](bool with_embedding) {
    double sum = 0;
    int n = 0;
    for (std::size_t p = 0; p < stages; ++p) {
      const bool plain = static_cast<int>(p) != loss && (with_embedding || static_cast<int>(p) != embedding);
      if (plain && b.layers_now[p] > 0) sum += stage_compute_s[p] / static_cast<double>(b.layers_now[p]), ++n;
    }
    return n ? sum / n : 0.0;
  };
  b.per_layer_s = per_layer(false) > 0 ? per_layer(false) : per_layer(true);
  if (b.per_layer_s <= 0) return std::nullopt;
  std::vector<double> fixed(stages);  // what a stage spends besides its layers
  for (std::size_t p = 0; p < stages; ++p)
    fixed[p] = std::max(0.0, stage_compute_s[p] - b.per_layer_s * static_cast<double>(b.layers_now[p]));
  b.layers_balanced.assign(stages, 0);
  const auto time = [&](std::size_t p, Int extra) {
    return fixed[p] + b.per_layer_s * static_cast<double>(b.layers_balanced[p] + extra);
  };
  for (Int layer = 0; layer < m.num_layers; ++layer) {
    std::size_t best = 0;
    for (std::size_t p = 1; p < stages; ++p)
      if (time(p, 1) < time(best, 1)) best = p;
    ++b.layers_balanced[best];
  }
  b.slowest_stage = static_cast<int>(std::max_element(stage_compute_s.begin(), stage_compute_s.end()) - stage_compute_s.begin());
  b.slowest_now_s = stage_compute_s[static_cast<std::size_t>(b.slowest_stage)];
  for (std::size_t p = 0; p < stages; ++p) b.slowest_balanced_s = std::max(b.slowest_balanced_s, time(p, 0));
  // Each stage's layers over its model chunks (virtual stage v * PP + p), the earlier chunks
  // taking what does not divide.
  const auto chunks = static_cast<std::size_t>(split.chunks);
  std::vector<Int> virtual_layers(stages * chunks);
  for (std::size_t p = 0; p < stages; ++p)
    for (std::size_t v = 0; v < chunks; ++v)
      virtual_layers[v * stages + p] = b.layers_balanced[p] / static_cast<Int>(chunks) +
                                       (static_cast<Int>(v) < b.layers_balanced[p] % static_cast<Int>(chunks) ? 1 : 0);
  b.layout = pipeline_layout_text(virtual_layers);
  return b;
}

}  // namespace epx
