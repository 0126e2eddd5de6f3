// Every spec the layers below train/ run on, built once from the resolved Config and checked
// here, so that nothing below train/ reads the config. Each function throws ConfigError naming
// the field, its value and what to set (citing the check rule's id where `epx check` has one:
// the checker runs first, so those are the library's own guard).
#pragma once

#include <cstdint>

#include "epx/comm/parallel_layout.hpp"
#include "epx/config/config.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "epx/model/model_spec.hpp"
#include "epx/model/pipeline_spec.hpp"
#include "epx/moe/moe_spec.hpp"
#include "epx/schedule/schedule.hpp"
#include "epx/train/optimizer.hpp"

namespace epx {

// The rank grid for `world` ranks. epx runs attention with data and pipeline parallelism only, so
// TP and CP must be 1; ETP and EP split the experts.
ParallelLayout parallel_layout_from_config(const Config& c, int world);
// The same for one MoE layer (`epx layer`, `epx bench layer`): PP must be 1 too.
ParallelLayout layer_layout_from_config(const Config& c, int world);
// Only its TP = CP = PP = 1 (one process without MPI takes every expert, whatever EP says).
void check_layer_parallelism(const Config& c);
// One MoE layer's shape and routing.
MoESpec moe_spec_from_config(const Config& c);
// The whole GPT model, its MoE layers (moe_spec_from_config) and the recompute plan.
ModelSpec model_spec_from_config(const Config& c);
// model.moe_token_dispatcher_type, the flex backend and its knobs, and HybridEP's environment
// variables (the process's, else the recipe's env_vars). A backend this build lacks is an
// EnvironmentError.
DispatcherOptions dispatcher_options_from_config(const Config& c);
// Which layers each pipeline stage and model chunk builds (model.pipeline_model_parallel_size,
// virtual_pipeline_model_parallel_size, num_layers_in_first/last_pipeline_stage,
// account_for_embedding/loss_in_pipeline_split, or pipeline_model_parallel_layout: the check
// layer's pipeline_split); refuses what epx cannot run with PP > 1.
PipelineSpec pipeline_spec_from_config(const Config& c);
// comm_overlap as resolved onto the model: EP overlap, delayed wgrad.
ScheduleOptions schedule_options_from_config(const Config& c);
// Megatron's OptimizerParamScheduler from optimizer.* and scheduler.*.
LrSchedule lr_schedule_from_config(const Config& c);

// What `epx run` trains: all of the above for this job's ranks, and the batch arithmetic.
// ddp.overlap_grad_reduce and ddp.bucket_size (elements; 0: one bucket per kind, dense and expert; Megatron's
// default with overlap: max(40M, 1M x DP) elements), and the distributed optimizer
// (ddp.use_distributed_optimizer: gradients reduce-scattered, Adam on this rank's shard, the
// parameters all-gathered).
struct GradReduceOptions {
  bool overlap = false;
  bool distributed = false;
  bool overlap_param_gather = false;  // ddp.overlap_param_gather (distributed optimizer only)
  // The buckets' dtype: BF16 for a BF16 model unless ddp.grad_reduce_in_fp32, as Megatron's DDP
  // (epx accumulates the micro-batches' gradients in FP32 either way).
  DType reduce_dtype = DType::F32;
  std::int64_t bucket_size = 0;
  bool embedding_rows = false;  // ddp.reduce_embedding_rows (GradReducer::take_embedding_rows)
};
GradReduceOptions grad_reduce_options_from_config(const Config& resolved, int dp);

struct JobSpec {
  ParallelLayout layout;
  ModelSpec model;
  PipelineSpec pipeline;
  DispatcherOptions dispatcher;
  ScheduleOptions schedule;
  GradReduceOptions grad_reduce;
  LrSchedule lr;
  std::int64_t iterations = 0;
  std::int64_t global_batch = 0;   // sequences per iteration, over all DP ranks
  std::int64_t micro_batches = 0;  // per DP rank per iteration (gradient accumulation)
  // Stop at a NaN or infinite loss: Bridge's rerun_state_machine.check_for_nan_in_loss (True
  // unless the config's kept rerun_state_machine section turns it off, as the performance
  // recipes do).
  bool check_for_nan_in_loss = true;

  // Also requires target.num_gpus to equal `world`, the batch to divide over DP, and the
  // micro-batch count to suit the pipeline schedule.
  static JobSpec from_config(const Config& resolved, int world);
};

}  // namespace epx
