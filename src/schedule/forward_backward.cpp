#include "epx/schedule/schedule.hpp"

#include <algorithm>
#include <optional>

#include "epx/base/error.hpp"
#include "epx/trace/trace.hpp"

namespace epx {
namespace {

using trace::Scope;
using trace::Track;

// One micro-batch in flight through the merged schedule.
struct Pass {
  GPTModel::Context ctx;
  Tensor x;   // forward: the next layer's input; backward: the gradient of the last output
  double loss = 0;
};

// Megatron-Core's TransformerModelChunkSchedulePlan.run at PP = 1: the forward of `f` and the
// backward of `b` (either may be absent: the first forward and the last backward run alone),
// layer pair by layer pair as TransformerLayerSchedulePlan.run. On a GPU the host issues nodes
// to two streams and each starts when its inputs are ready; here the compute thread is the
// compute stream, so each exchange is started as soon as its input exists and the compute that
// can cover it runs after (megatron/core/models/common/model_chunk_schedule_plan.py).
void merged_step(GPTModel& model, Pass* f, Pass* b, float dloss, bool delay_wgrad) {
  const int L = static_cast<int>(model.layers.size());
  if (b) b->x = model.head_backward(b->ctx, dloss);
  int deferred_dw = -1;  // a backward layer whose attention wgrad waits (delay_wgrad)
  const auto run_deferred_dw = [&] {
    if (deferred_dw < 0) return;
    Scope s(Track::compute, "attention + router wgrad", deferred_dw);
    auto& c = b->ctx.layers[static_cast<std::size_t>(deferred_dw)];
    model.layers[static_cast<std::size_t>(deferred_dw)]->backward_attn_wgrad(*c);
    c.reset();
    model.grads_ready(model.layer_grad_group(deferred_dw));
    deferred_dw = -1;
  };
  for (int i = 0; i < L; ++i) {
    TransformerLayer* fl = f ? model.layers[static_cast<std::size_t>(i)].get() : nullptr;
    TransformerLayer* bl = b ? model.layers[static_cast<std::size_t>(L - 1 - i)].get() : nullptr;
    TransformerLayer::Context* fc = nullptr;
    TransformerLayer::Context* bc = b ? b->ctx.layers[static_cast<std::size_t>(L - 1 - i)].get() : nullptr;
    if (fl) {
      f->ctx.layers[static_cast<std::size_t>(i)] = std::make_unique<TransformerLayer::Context>();
      fc = f->ctx.layers[static_cast<std::size_t>(i)].get();
    }

    if (bl) {
      Scope s(Track::compute, "unpermute backward", L - 1 - i);
      bl->launch_moe_combine_backward(*bc, b->x);  // ‖ the forward's attention
    }
    run_deferred_dw();  // after the combine-backward started
    if (fl) {
      if (i > 0) {
        Scope s(Track::compute, "unpermute + residual", i - 1);
        f->x = model.layer_output(i - 1, f->ctx);  // the previous layer's combine
      }
      {
        Scope s(Track::compute, fl->moe ? "attention + router forward" : "attention forward", i);
        fl->forward_attn(f->x, *fc);
      }
      fl->launch_moe_dispatch(*fc);  // ‖ the backward's expert dgrad
    }
    if (bl) {
      {
        Scope s(Track::compute, bl->moe ? (delay_wgrad ? "expert dgrad" : "expert dgrad + wgrad") : "mlp backward", L - 1 - i);
        bl->backward_mlp(*bc, !delay_wgrad);
      }
      bl->launch_moe_dispatch_backward(*bc);  // ‖ expert wgrad (delayed), then the forward's experts
      if (delay_wgrad) {
        Scope s(Track::compute, bl->moe ? "expert wgrad" : "mlp wgrad", L - 1 - i);
        bl->backward_mlp_wgrad(*bc);
      }
    }
    if (fl) {
      {
        Scope s(Track::compute, fl->moe ? "experts forward" : "mlp forward", i);
        fl->forward_mlp(*fc);
      }
      fl->launch_moe_combine(*fc);  // ‖ the backward's attention dgrad
    }
    if (bl) {
      Scope s(Track::compute, delay_wgrad ? "attention dgrad" : "attention dgrad + wgrad", L - 1 - i);
      b->x = bl->backward_attn(*bc, !delay_wgrad);
      if (delay_wgrad) {
        deferred_dw = L - 1 - i;
      } else {
        b->ctx.layers[static_cast<std::size_t>(L - 1 - i)].reset();
        model.grads_ready(model.layer_grad_group(L - 1 - i));
      }
    }
  }
  run_deferred_dw();
  if (f) {
    Tensor y;
    {
      Scope s(Track::compute, "unpermute + residual", L - 1);
      y = model.layer_output(L - 1, f->ctx);
    }
    f->loss = model.head_forward(y, f->ctx);
  }
  if (b) model.embed_backward(b->ctx, b->x);
}

}  // namespace


std::vector<MicroBatchLosses> forward_backward(GPTModel& model, int num_micro_batches,
                                               const std::function<void(int, Tensor&, Tensor&)>& micro_batch,
                                               const ScheduleOptions& options) {
  const float dloss = static_cast<float>(1.0 / num_micro_batches);
  const double moe_layers = std::max(1, model.spec().num_moe_layers());
  std::vector<MicroBatchLosses> out(static_cast<std::size_t>(num_micro_batches));
  const auto record = [&](int j, const GPTModel::Context& ctx) {
    out[static_cast<std::size_t>(j)] = {ctx.loss, ctx.aux_loss / moe_layers};
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
  if (model.has_full_recompute())
    throw ConfigError(
        "[ep_overlap.full_recompute] model.recompute_granularity=full: the EP-overlap schedule runs the layers node by node "
        "and cannot replay checkpointed layers; use selective recompute or set "
        "comm_overlap.overlap_moe_expert_parallel_comm=false");

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
    merged_step(model, next ? &*next : nullptr, prev ? &*prev : nullptr, dloss, options.delay_wgrad);
    if (next) record(j, next->ctx);
    prev = std::move(next);
  }
  return out;
}

}  // namespace epx
