// Which decoder layers each pipeline stage builds (Megatron-Core's get_num_layers_to_build).
#include "epx/check/pipeline_split.hpp"

#include <algorithm>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

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
  if (mtp_layers == 0) {
    s.mtp_stage = s.loss_stage;
    return s;
  }
  // Megatron's validate_layer_layout: the MTP layers in one stage, the last of its rank, after every decoder layer.
  const std::string& mtp = stages[static_cast<std::size_t>(s.mtp_stage)];
  if (std::count(mtp.begin(), mtp.end(), 'm') != mtp_layers || order.find('t', order.find('m')) != std::string::npos ||
      s.mtp_stage / pp != s.chunks - 1)
    throw ConfigError(fmt::format("{}: a layout puts every MTP layer (m) in one stage, after every decoder layer (t), "
                                  "in the last model chunk of its pipeline rank (check rule pipeline.layout)",
                                  field));
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
  if (first_given || last_given) {  // Megatron-Core checks these at any PP size
    // Uneven: the first / last stage as given, the rest even over the middle stages, each
    // stage's layers even over its chunks. Megatron-Core's checks and messages
    // (TransformerConfig.__post_init__), the fields named first.
    const std::string fields = fmt::format("model.num_layers_in_first_pipeline_stage={}, "
                                           "num_layers_in_last_pipeline_stage={} (num_layers={}, PP={}, VPP={})",
                                           opt(first_given), opt(last_given), num_layers, pp, opt(vpp));
    const auto refuse = [&](const std::string& why) { throw ConfigError(fmt::format("{}: {}", fields, why)); };
    if (embedding_counts || loss_counts)
      refuse("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the same "
             "time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split");
    Int middle = num_layers, middle_stages = pp;
    for (const auto& [given, name] : {std::pair{first_given, "first"}, std::pair{last_given, "last"}}) {
      if (!given) continue;
      if (*given <= 0) refuse(fmt::format("num_layers_in_{}_pipeline_stage must be larger than 0", name));
      if (*given % V != 0)
        refuse(fmt::format("number of layers at {} stage: {} must be divisible by virtual pipeline parallel degree {}",
                           name, *given, V));
      middle -= *given, --middle_stages;
    }
    if ((middle != 0) != (middle_stages != 0))
      refuse(fmt::format("Mismatch: {} middle layers remaining but {} middle PP stages available.", middle,
                         middle_stages));
    if (middle < 0)
      refuse(fmt::format("the first and last stages' layers add up to more than num_layers ({})", num_layers));
    if (middle_stages && middle % middle_stages != 0)
      refuse(fmt::format("number of layers at middle stage: {} must be divisible by the middle pipeline model "
                         "parallel size {}",
                         middle, middle_stages));
    if (middle_stages && (middle / middle_stages) % V != 0)
      refuse(fmt::format("number of layers on each middle pipeline rank: {} must be divisible by virtual pipeline "
                         "parallel degree {}",
                         middle / middle_stages, V));
    for (int v = 0; v < V; ++v)
      for (int p = 0; p < pp; ++p) {
        const Int on_stage = p == 0 && first_given ? *first_given
                             : p == pp - 1 && last_given ? *last_given
                                                         : middle / middle_stages;
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

bool layers_split(const ModelConfig& m) {
  try {
    pipeline_split(m);
    return true;
  } catch (const ConfigError&) {
    return false;
  }
}

std::optional<std::string> interleaved_micro_batch_error(Int pp, Int group, Int micro_batches) {
  const Int N = group, M = micro_batches;
  if (N > M || N < pp)
    return fmt::format("The number of contiguous micro-batches in a virtual pipeline stage should range in [PP={} , "
                       "M={}] (microbatch_group_size_per_vp_stage = {})",
                       pp, M, N);
  const Int rest = M % N;  // N >= PP >= 1 here
  if (rest > 0 && rest < pp)
    return fmt::format("The remainder of M (the total micro-batches) divided by N (number of contiguous micro-batches "
                       "in a virtual pipeline stage) should be 0, or larger than or equal to the pipeline-parallel size, "
                       "but it is {} (M = {}, N = {}, PP = {})",
                       rest, M, N, pp);
  return std::nullopt;
}

std::optional<Int> smallest_splitting_vpp(const ModelConfig& m, Int most) {
  ModelConfig c = m;
  for (Int vpp = 2; vpp <= most; ++vpp) {
    c.virtual_pipeline_model_parallel_size = vpp;
    if (layers_split(c)) return vpp;
  }
  return std::nullopt;
}

std::vector<std::string> pipeline_split_fix(const ModelConfig& m) {
  const Int pp = m.pipeline_model_parallel_size, L = m.num_layers;
  const OptInt& vpp = m.virtual_pipeline_model_parallel_size;
  if (m.pipeline_model_parallel_layout || pp < 1 || L < 0 || L > 4096) return {};
  ModelConfig c = m;
  if (pp == 1) {  // one stage: the uneven fields or the VPP are what does not split
    std::vector<std::string> fix;
    if (m.num_layers_in_first_pipeline_stage || m.num_layers_in_last_pipeline_stage) {
      c.num_layers_in_first_pipeline_stage = c.num_layers_in_last_pipeline_stage = std::nullopt;
      fix = {"model.num_layers_in_first_pipeline_stage=null", "model.num_layers_in_last_pipeline_stage=null"};
    }
    if (vpp && !layers_split(c)) c.virtual_pipeline_model_parallel_size = std::nullopt, fix.push_back("model.virtual_pipeline_model_parallel_size=null");
    return layers_split(c) ? fix : std::vector<std::string>{};
  }
  if (vpp && *vpp < 1) return {};
  for (Int v = std::min(vpp.value_or(1) - 1, L + 2); v >= 2; --v) {  // more chunks than layers + E + L never split
    c.virtual_pipeline_model_parallel_size = v;
    if (layers_split(c)) return {fmt::format("model.virtual_pipeline_model_parallel_size={}", v)};
  }
  c = m;
  c.num_layers_in_first_pipeline_stage = c.num_layers_in_last_pipeline_stage = std::nullopt;
  c.account_for_embedding_in_pipeline_split = c.account_for_loss_in_pipeline_split = true;
  if (layers_split(c)) {
    std::vector<std::string> fix = {"model.account_for_embedding_in_pipeline_split=true",
                                    "model.account_for_loss_in_pipeline_split=true"};
    if (m.num_layers_in_first_pipeline_stage) fix.push_back("model.num_layers_in_first_pipeline_stage=null");
    if (m.num_layers_in_last_pipeline_stage) fix.push_back("model.num_layers_in_last_pipeline_stage=null");
    return fix;
  }
  // The uneven split whose largest stage is smallest, then whose first and last stages are
  // closest: k layers on each of the PP - 2 middle stages, the rest on the first and last, each a
  // multiple of VPP and above 0.
  const Int V = vpp.value_or(1), middle_stages = pp - 2;
  std::optional<std::tuple<Int, Int, Int, Int>> best;  // largest stage, first - last, first, last
  for (Int k = middle_stages > 0 ? V : 0; k * middle_stages <= L; k += V) {
    const Int ends = L - k * middle_stages;
    if (ends >= 2 * V && ends % V == 0) {
      const Int first = (ends / V + 1) / 2 * V, last = ends - first;
      const std::tuple candidate{std::max({first, last, k}), first - last, first, last};
      if (!best || candidate < *best) best = candidate;
    }
    if (middle_stages == 0) break;
  }
  c = m;
  c.account_for_embedding_in_pipeline_split = c.account_for_loss_in_pipeline_split = false;
  if (best) c.num_layers_in_first_pipeline_stage = std::get<2>(*best), c.num_layers_in_last_pipeline_stage = std::get<3>(*best);
  if (best && layers_split(c)) {
    std::vector<std::string> fix = {fmt::format("model.num_layers_in_first_pipeline_stage={}", std::get<2>(*best)),
                                    fmt::format("model.num_layers_in_last_pipeline_stage={}", std::get<3>(*best))};
    if (m.account_for_embedding_in_pipeline_split) fix.push_back("model.account_for_embedding_in_pipeline_split=false");
    if (m.account_for_loss_in_pipeline_split) fix.push_back("model.account_for_loss_in_pipeline_split=false");
    return fix;
  }
  c = m;
  c.virtual_pipeline_model_parallel_size = std::nullopt;
  if (vpp && layers_split(c)) return {"model.virtual_pipeline_model_parallel_size=null"};
  // Else a layout: the layers as even as they go over the PP x VPP virtual stages, the ones left
  // over on the middle stages first (the first and last also hold the embedding and the loss),
  // the MTP layers beside the loss, as Bridge's DeepSeek-V3 layouts place them.
  const Int K = pp * V;
  if (K < 2 || K > 4096) return {};
  std::vector<Int> counts(static_cast<std::size_t>(K), L / K);
  Int left = L % K;
  for (std::size_t k = 1; k + 1 < counts.size() && left > 0; ++k, --left) ++counts[k];
  if (left > 0) ++counts.front(), --left;
  if (left > 0) ++counts.back();
  c = m;
  c.pipeline_model_parallel_layout = pipeline_layout_text(counts, m.mtp_num_layers.value_or(0));
  c.num_layers_in_first_pipeline_stage = c.num_layers_in_last_pipeline_stage = std::nullopt;
  c.account_for_embedding_in_pipeline_split = c.account_for_loss_in_pipeline_split = false;
  if (!layers_split(c)) return {};
  return layout_overrides(m, *c.pipeline_model_parallel_layout);
}

std::string vpp_to_set(const ModelConfig& m) {
  if (m.pipeline_model_parallel_layout) try {
      return fmt::format("model.virtual_pipeline_model_parallel_size={}", pipeline_split(m).chunks);
    } catch (const ConfigError&) {
    }
  return fmt::format("model.virtual_pipeline_model_parallel_size={}",
                     smallest_splitting_vpp(m, std::min<Int>(8, m.num_layers)).value_or(1));
}

std::vector<std::string> layout_overrides(const ModelConfig& m, const std::string& layout) {
  std::vector<std::string> o = {fmt::format("model.pipeline_model_parallel_layout='{}'", layout)};
  if (m.num_layers_in_first_pipeline_stage) o.push_back("model.num_layers_in_first_pipeline_stage=null");
  if (m.num_layers_in_last_pipeline_stage) o.push_back("model.num_layers_in_last_pipeline_stage=null");
  if (m.account_for_embedding_in_pipeline_split) o.push_back("model.account_for_embedding_in_pipeline_split=false");
  if (m.account_for_loss_in_pipeline_split) o.push_back("model.account_for_loss_in_pipeline_split=false");
  return o;
}

}  // namespace epx
