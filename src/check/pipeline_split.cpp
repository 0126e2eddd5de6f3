// Which decoder layers each pipeline stage builds (Megatron-Core's get_num_layers_to_build).
#include "epx/check/pipeline_split.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "epx/check/pipeline_layout.hpp"

namespace epx {
namespace {

std::string opt(const OptInt& v) { return v ? std::to_string(*v) : "None"; }

// The layout's stages as counts; the check rule pipeline.layout gives Megatron's own message for
// each way a layout can be wrong, this only refuses to build from one.
PipelineSplit from_layout(const ModelConfig& m, const std::string& text, int pp) {
  const std::vector<std::string> stages = parse_pipeline_layout(text);
  const int count = static_cast<int>(stages.size());
  const std::string field = fmt::format("model.pipeline_model_parallel_layout={}", text);
  if (count % pp != 0)
    throw ConfigError(fmt::format("{}: its {} stages do not split over pipeline_model_parallel_size={} "
                                  "(check rule pipeline.layout)",
                                  field, count, pp));
  PipelineSplit s;
  s.stages = pp;
  s.chunks = count / pp;
  const OptInt& vpp = m.virtual_pipeline_model_parallel_size;
  if (vpp && *vpp != s.chunks)
    throw ConfigError(fmt::format("{}: {} stages per pipeline rank, but virtual_pipeline_model_parallel_size={} "
                                  "(check rule pipeline.layout)",
                                  field, s.chunks, *vpp));
  s.interleaved = pp > 1 && (vpp || s.chunks > 1);
  int embeddings = 0, losses = 0, decoders = 0, mtp_layers = 0;
  std::string order;  // every layer in layer order
  for (int k = 0; k < count; ++k) {
    const std::string& stage = stages[static_cast<std::size_t>(k)];
    order += stage;
    const auto n = [&](char c) { return static_cast<int>(std::count(stage.begin(), stage.end(), c)); };
    s.layers.push_back(n('t'));
    decoders += n('t'), embeddings += n('E'), losses += n('L'), mtp_layers += n('m');
    if (n('E')) s.embedding_stage = k;
    if (n('L')) s.loss_stage = k;
    if (n('m')) s.mtp_stage = k;
  }
  if (embeddings != 1 || losses != 1 || order.front() != 'E' || order.back() != 'L' || decoders != m.num_layers ||
      mtp_layers != m.mtp_num_layers.value_or(0))
    throw ConfigError(fmt::format("{}: a layout lists the embedding (E) first, the loss (L) last, each once, and "
                                  "num_layers={} decoder layers (t) and mtp_num_layers={} MTP layers (m); it has {}, "
                                  "{}, {} and {} (check rule pipeline.layout)",
                                  field, m.num_layers, opt(m.mtp_num_layers), embeddings, losses, decoders,
                                  mtp_layers));
  if (mtp_layers == 0) s.mtp_stage = s.loss_stage;
  return s;
}

// The split's layer counts (pipeline_split adds each virtual stage's first layer).
PipelineSplit split_layers(const ModelConfig& m) {
  const Int pp_size = m.pipeline_model_parallel_size, num_layers = m.num_layers;
  if (pp_size < 1 || pp_size > (1 << 20))
    throw ConfigError(fmt::format("model.pipeline_model_parallel_size={}: must be 1 or more", pp_size));
  const int pp = static_cast<int>(pp_size);
  if (m.pipeline_model_parallel_layout) return from_layout(m, *m.pipeline_model_parallel_layout, pp);
  const OptInt& vpp = m.virtual_pipeline_model_parallel_size;
  if (vpp && (*vpp < 1 || *vpp > (1 << 20)))
    throw ConfigError(fmt::format("model.virtual_pipeline_model_parallel_size={}: must be 1 or more (or None)", *vpp));
  if (num_layers < 0 || num_layers > (1 << 24))
    throw ConfigError(fmt::format("model.num_layers={}: out of range", num_layers));
  if (pp_size * vpp.value_or(1) > (1 << 24))
    throw ConfigError(fmt::format("model.pipeline_model_parallel_size={} x virtual_pipeline_model_parallel_size={}: "
                                  "more model chunks than any real run has",
                                  pp_size, *vpp));
  PipelineSplit s;
  s.stages = pp;
  s.chunks = static_cast<int>(vpp.value_or(1));
  s.interleaved = pp > 1 && vpp.has_value();
  s.loss_stage = s.mtp_stage = s.virtual_stages() - 1;
  const int V = s.chunks, L = static_cast<int>(num_layers);
  const OptInt &first_given = m.num_layers_in_first_pipeline_stage, &last_given = m.num_layers_in_last_pipeline_stage;
  const bool embedding_counts = m.account_for_embedding_in_pipeline_split,
             loss_counts = m.account_for_loss_in_pipeline_split;
  if (pp > 1 && (first_given || last_given)) {
    // Uneven: the first / last stage as given, the rest even over the middle stages, each
    // stage's layers even over its chunks.
    if (embedding_counts || loss_counts)
      throw ConfigError(
          "model.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage: cannot be combined with "
          "account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split; set one or the other");
    const Int first = first_given.value_or(0), last = last_given.value_or(0);
    const int middle_stages = pp - (first_given ? 1 : 0) - (last_given ? 1 : 0);
    const Int middle = num_layers - first - last;
    if (first < 0 || last < 0 || middle < 0 || (middle_stages == 0 ? middle != 0 : middle % middle_stages != 0))
      throw ConfigError(fmt::format(
          "model.num_layers_in_first_pipeline_stage={}, num_layers_in_last_pipeline_stage={}: the other {} of "
          "num_layers ({}) must split evenly over the {} middle stage(s); change the first / last stage's layers",
          opt(first_given), opt(last_given), middle, num_layers, middle_stages));
    for (int v = 0; v < V; ++v)
      for (int p = 0; p < pp; ++p) {
        const Int on_stage = p == 0 && first_given ? first : p == pp - 1 && last_given ? last : middle / middle_stages;
        if (on_stage % V != 0)
          throw ConfigError(fmt::format(
              "model.virtual_pipeline_model_parallel_size={}: stage {}'s {} layers do not split evenly over its {} "
              "model chunks; change the first / last stage's layers or the VPP size",
              V, p, on_stage, V));
        s.layers.push_back(static_cast<int>(on_stage / V));
      }
    return s;
  }
  // Even: the embedding and the loss may count as one layer each of the first / last virtual stage.
  const int counted = L + (embedding_counts ? 1 : 0) + (loss_counts ? 1 : 0), K = s.virtual_stages();
  if (counted % K != 0)
    throw ConfigError(fmt::format(
        "model.num_layers={}: {} layers (counting the embedding / loss the split accounts for) do not split evenly "
        "over PP x VPP = {} x {} model chunks; change num_layers, the PP / VPP sizes, or set "
        "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage",
        num_layers, counted, pp, V));
  s.layers.assign(static_cast<std::size_t>(K), counted / K);
  if (embedding_counts) --s.layers.front();
  if (loss_counts) --s.layers.back();
  return s;
}

}  // namespace

std::vector<std::pair<int, int>> PipelineSplit::ranges_on(int stage) const {
  std::vector<std::pair<int, int>> out;
  for (int v = 0; v < chunks; ++v) {
    const auto k = static_cast<std::size_t>(v * stages + stage);
    out.emplace_back(first[k], first[k] + layers[k]);
  }
  return out;
}

std::optional<Int> virtual_pipeline_size(const ModelConfig& m) {
  if (m.virtual_pipeline_model_parallel_size || !m.pipeline_model_parallel_layout || m.pipeline_model_parallel_size < 1)
    return m.virtual_pipeline_model_parallel_size;
  try {
    const Int count = static_cast<Int>(parse_pipeline_layout(*m.pipeline_model_parallel_layout).size());
    const Int pp = m.pipeline_model_parallel_size;
    if (count % pp == 0 && count / pp > 1) return count / pp;
  } catch (const ConfigError&) {
  }
  return std::nullopt;
}

PipelineSplit pipeline_split(const ModelConfig& m) {
  PipelineSplit s = split_layers(m);
  int next = 0;
  for (const int n : s.layers) s.first.push_back(next), next += n;
  return s;
}

}  // namespace epx
