// A pipeline layout that evens out a run's measured stage times (`epx diagnose`): the stage
// that computes longest sets the pace of every other, which waits for it on top of the bubble.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "epx/config/config.hpp"

namespace epx {

struct PipelineBalance {
  int slowest_stage = 0;                        // the stage the others wait for, as measured
  std::vector<Int> layers_now, layers_balanced;  // decoder layers per stage
  double per_layer_s = 0;                       // one decoder layer's time, per iteration
  double slowest_now_s = 0, slowest_balanced_s = 0;  // the longest stage's compute, per iteration
  std::string layout;                           // pipeline_model_parallel_layout text
  // Whether the placement shortens the slowest stage by 5% or more.
  bool helps() const { return slowest_balanced_s <= 0.95 * slowest_now_s; }
};

// From each stage's compute per iteration (its schedule time less its waits on the other
// stages), a layer's time and what each stage spends besides its layers (the embedding, the
// LM head and loss) are estimated; the layers are then placed one by one on the stage that
// would finish first. Empty when the split is not known, with MTP layers, or when no stage holds
// a layer that times one.
std::optional<PipelineBalance> balance_pipeline(const ModelConfig& m, const std::vector<double>& stage_compute_s);

}  // namespace epx
