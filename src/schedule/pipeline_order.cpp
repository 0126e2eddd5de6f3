#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/schedule/pipeline.hpp"

namespace epx {

std::vector<PipelineStep> pipeline_order(const PipelineSpec& pipeline, int stage, int micro_batches, bool merge) {
  // The merged order's extra warm-up forward is the interleaved schedule's; the job refuses EP
  // overlap with PP but no VPP before it gets here (Megatron-Core asserts the same).
  if (merge && !pipeline.interleaved) throw std::logic_error("pipeline_order: a merged order needs the interleaved schedule");
  const int PP = pipeline.stages, V = pipeline.chunks;
  using Pass = PipelineStep::Pass;
  std::vector<Pass> forwards, backwards;  // this stage's k-th forward and backward
  int warmup = 0;
  if (!pipeline.interleaved) {
    for (int j = 0; j < micro_batches; ++j) forwards.push_back({0, j});
    backwards = forwards;
    warmup = PP - stage - 1;
  } else {
    // get_schedule_table: groups of N micro-batches (microbatch_group_size_per_vp_stage, PP by
    // default; the last group takes the rest), each run through every chunk in turn.
    const int N = pipeline.micro_batch_group();
    for (int first = 0; first < micro_batches; first += N) {
      const int end = first + N >= micro_batches ? micro_batches : first + N;
      for (int v = 0; v < V; ++v)
        for (int j = first; j < end; ++j) forwards.push_back({v, j});
    }
    for (const Pass& f : forwards) backwards.push_back({V - 1 - f.chunk, f.micro_batch});
    warmup = 2 * (PP - stage - 1) + (V - 1) * N + (merge ? 1 : 0);
  }
  const int total = static_cast<int>(forwards.size());
  warmup = std::min(warmup, total);

  std::vector<PipelineStep> steps;
  for (int k = 0; k < warmup; ++k) steps.push_back({forwards[static_cast<std::size_t>(k)], std::nullopt});
  for (int k = 0; k < total - warmup; ++k) {
    const Pass& f = forwards[static_cast<std::size_t>(warmup + k)];
    const Pass& b = backwards[static_cast<std::size_t>(k)];
    if (merge) {
      steps.push_back({f, b});
    } else {
      steps.push_back({f, std::nullopt});
      steps.push_back({std::nullopt, b});
    }
  }
  for (int k = total - warmup; k < total; ++k) steps.push_back({std::nullopt, backwards[static_cast<std::size_t>(k)]});
  return steps;
}

}  // namespace epx
