#include "epx/schedule/schedule.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "merged_step.hpp"

namespace epx {

std::vector<MicroBatchLosses> forward_backward(GPTModel& model, int num_micro_batches,
                                               const std::function<void(int, Tensor&, Tensor&)>& micro_batch,
                                               const ScheduleOptions& options) {
  const float dloss = static_cast<float>(1.0 / num_micro_batches);
  const double moe_layers = std::max(1, model.spec().num_moe_loss_layers());
  std::vector<MicroBatchLosses> out(static_cast<std::size_t>(num_micro_batches));
  const auto record = [&](int j, const GPTModel::Context& ctx) {
    MicroBatchLosses& l = out[static_cast<std::size_t>(j)];
    l.lm_loss = ctx.loss;
    l.mtp_losses = ctx.mtp_losses;
    for (AuxLoss k : kAuxLosses) at(l.aux_losses, k) = at(ctx.aux_losses, k) / moe_layers;
    l.z_loss = ctx.z_loss / moe_layers;
  };

  if (!options.ep_overlap) {  // forward_backward_no_pipelining
    for (int j = 0; j < num_micro_batches; ++j) {
      Tensor tokens, targets;
      micro_batch(j, tokens, targets);
      GPTModel::Context ctx;
      model.forward(tokens, targets, ctx);
      record(j, ctx);
      model.backward(ctx, dloss);
    }
    return out;
  }
  // The job refuses full recompute with EP overlap before any rank computes (job_spec).
  if (model.has_full_recompute()) throw std::logic_error("forward_backward: EP overlap with full recompute");

  // combined_1f1b_schedule_for_no_pipelining: F(0), then F(j) merged with B(j-1), then B(N-1).
  std::optional<Pass> prev;
  for (int j = 0; j <= num_micro_batches; ++j) {
    std::optional<Pass> next;
    if (j < num_micro_batches) {
      next.emplace();
      Tensor tokens, targets;
      micro_batch(j, tokens, targets);
      next->x = model.embed(tokens, targets, next->ctx);
    }
    Pass* f = next ? &*next : nullptr;
    Pass* b = prev ? &*prev : nullptr;
    if (b) b->x = model.head_backward(b->ctx, dloss, true);  // the MTP layers in the merged step
    merged_step(&model, f, &model, b, options.delay_wgrad);
    if (f) model.head_forward(f->x, f->ctx);  // the loss lands in f->ctx
    if (b) model.embed_backward(b->ctx, b->x);
    if (next) record(j, next->ctx);
    prev = std::move(next);
  }
  return out;
}

}  // namespace epx
