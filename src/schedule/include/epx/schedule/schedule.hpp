// The forward/backward schedule of one training iteration at PP = 1 (Megatron-Core's
// forward_backward_no_pipelining, and combined_1f1b_schedule_for_no_pipelining when
// comm_overlap.overlap_moe_expert_parallel_comm is on); pipeline.hpp runs PP > 1.
//
// Without EP overlap every micro-batch runs forward then backward, each layer's dispatch and
// combine exchanges exposed. With it (megatron/core/pipeline_parallel/combined_1f1b.py): F(0); then
// for i = 1..N-1 one merged step interleaving the forward of micro-batch i with the backward of
// micro-batch i-1, layer by layer (forward layer j with backward layer L-1-j); then B(N-1). In a
// merged layer pair each exchange of one micro-batch runs on the communication stream while the
// compute thread works on the other micro-batch:
//
//   comm:    combine-bwd (b)      | dispatch (f)  dispatch-bwd (b)              | combine (f)
//   compute: attention fwd (f)    | expert dgrad (b)  [expert wgrad (b)]  experts fwd (f)
//                                                                               | attention dgrad (b)
//
// With delay_wgrad_compute the experts' weight gradients fill the dispatch-backward, and the
// attention / shared-expert / router weight gradients run after the next layer's combine-backward
// has started. Every micro-batch sees the same operations on the same data in either schedule,
// and each weight's gradient still accumulates micro-batch by micro-batch in order, so the
// gradients are bitwise those of the plain schedule.
#pragma once

#include <functional>
#include <vector>

#include "epx/model/gpt_model.hpp"

namespace epx {

struct ScheduleOptions {
  bool ep_overlap = false;   // comm_overlap.overlap_moe_expert_parallel_comm (model's, resolved)
  bool delay_wgrad = false;  // comm_overlap.delay_wgrad_compute
};

struct MicroBatchLosses {
  double lm_loss = 0;
  AuxLossValues aux_losses{};  // each load-balancing loss, averaged over the MoE layers
  double z_loss = 0;           // the router's z-loss, averaged over the MoE layers
  std::vector<double> mtp_losses;  // each MTP depth's cross-entropy (the head's chunk)
};

// Runs forward and backward of `num_micro_batches` micro-batches, gradients accumulated into every
// Param::grad with each micro-batch's loss scaled by 1 / num_micro_batches. `micro_batch(j,
// tokens, targets)` fills micro-batch j. Throws ConfigError for EP overlap with full recompute.
std::vector<MicroBatchLosses> forward_backward(GPTModel& model, int num_micro_batches,
                                               const std::function<void(int, Tensor&, Tensor&)>& micro_batch,
                                               const ScheduleOptions& options);

}  // namespace epx
