// Pipeline parallelism: the order of a stage's forward and backward passes (Megatron-Core's
// forward_backward_pipelining_without_interleaving, the 1F1B schedule, and _with_interleaving,
// the interleaved schedule over model chunks), and running it with the activations and their
// gradients sent point-to-point between neighbouring stages (megatron/core/pipeline_parallel/
// schedules.py).
//
// Transfers: every send is started non-blocking as soon as its tensor exists and completes in the
// background; every receive is posted a step ahead and waited for only when its step needs it.
// A stage thus blocks only on data its neighbour has not produced yet, so any order that respects
// the data dependencies (Megatron's do) cannot deadlock, whatever the micro-batch count.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "epx/comm/comm.hpp"
#include "epx/model/gpt_model.hpp"
#include "epx/model/pipeline_spec.hpp"
#include "epx/schedule/schedule.hpp"

namespace epx {

// One step of a stage: a forward, a backward, or both merged into one (EP overlap).
struct PipelineStep {
  struct Pass {
    int chunk = 0, micro_batch = 0;
    bool operator==(const Pass&) const = default;
  };
  std::optional<Pass> forward, backward;
};

// Stage `stage`'s steps over `micro_batches` micro-batches. 1F1B: PP - stage - 1 warm-up
// forwards, then one forward and one backward alternating, then the remaining backwards.
// Interleaved (pipeline.interleaved): the (micro-batch, chunk) order of get_schedule_table with
// groups of N micro-batches (microbatch_group_size_per_vp_stage, PP by default),
// 2 (PP - stage - 1) + (VPP - 1) N warm-up forwards, the backward
// running the chunks in reverse. With `merge` (EP overlap; interleaved only) one more warm-up
// forward, and each steady-state forward and backward form one merged step.
std::vector<PipelineStep> pipeline_order(const PipelineSpec& pipeline, int stage, int micro_batches, bool merge);

// This stage's time in forward_backward_pipelining (each call adds to it): its wall time, and the time its
// compute thread waited on the neighbouring stages (the pipeline bubble plus exposed transfers).
struct PipelineTiming {
  double schedule_s = 0, wait_s = 0;
};

// Runs this stage's order. `chunks`: this stage's model chunks (chunk v holds virtual stage
// v x PP + stage); `pp`: the pipeline group (rank = stage). Only the last stage computes the
// loss: the other stages' MicroBatchLosses carry their own layers' aux loss and no LM loss.
std::vector<MicroBatchLosses> forward_backward_pipelining(const std::vector<GPTModel*>& chunks, Communicator& pp,
                                                          const PipelineSpec& pipeline, int num_micro_batches,
                                                          const std::function<void(int, Tensor&, Tensor&)>& micro_batch,
                                                          const ScheduleOptions& options, PipelineTiming* timing = nullptr);

}  // namespace epx
