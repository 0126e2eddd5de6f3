#include "merged_step.hpp"

#include <algorithm>

#include "epx/trace/trace.hpp"

namespace epx {

using trace::Scope;
using trace::Track;

// Layer pair by layer pair as TransformerLayerSchedulePlan.run (forward layer i with backward
// layer nb-1-i; the longer chunk's leftover layers run alone). On a GPU the host issues nodes to
// two streams and each starts when its inputs are ready; here the compute thread is the compute
// stream, so each exchange is started as soon as its input exists and the compute that can cover
// it runs after (megatron/core/models/common/model_chunk_schedule_plan.py).
void merged_step(GPTModel* fm, Pass* f, GPTModel* bm, Pass* b, bool delay_wgrad) {
  // The chunks' decoder layers, then (where the chunk runs them) the MTP layers: GPTModel::scheduled_layer.
  const int nf = f ? fm->num_scheduled_layers() : 0, nb = b ? bm->num_scheduled_layers() : 0;
  int deferred_dw = -1;  // a backward layer whose attention wgrad waits (delay_wgrad)
  const auto layer_done = [&](int bi) {
    bm->release_scheduled(bi, b->ctx);
    if (bm->completes_grad_group(bi)) bm->grads_ready(bm->scheduled_grad_group(bi));
  };
  const auto run_deferred_dw = [&] {
    if (deferred_dw < 0) return;
    Scope s(Track::compute, "attention + router wgrad", bm->global_layer(deferred_dw));
    bm->scheduled_layer(deferred_dw).backward_attn_wgrad(*bm->scheduled_context(deferred_dw, b->ctx));
    layer_done(deferred_dw);
    deferred_dw = -1;
  };
  for (int i = 0; i < std::max(nf, nb); ++i) {
    const int bi = nb - 1 - i;  // the backward's layer
    TransformerLayer* fl = i < nf ? &fm->scheduled_layer(i) : nullptr;
    TransformerLayer* bl = bi >= 0 ? &bm->scheduled_layer(bi) : nullptr;
    TransformerLayer::Context* fc = fl ? fm->scheduled_context(i, f->ctx, true) : nullptr;
    TransformerLayer::Context* bc = bl ? bm->scheduled_context(bi, b->ctx) : nullptr;

    if (bl) {
      Scope s(Track::compute, "unpermute backward", bm->global_layer(bi));
      bl->launch_moe_combine_backward(*bc, b->x);  // ‖ the forward's attention
    }
    run_deferred_dw();  // after the combine-backward started
    if (fl) {
      if (i > 0) {
        Scope s(Track::compute, "unpermute + residual", fm->global_layer(i - 1));
        f->x = fm->layer_output(i - 1, f->ctx);  // the previous layer's combine
      }
      f->x = fm->scheduled_input(i, std::move(f->x), f->ctx);  // an MTP layer's input
      fm->params_needed(fm->scheduled_grad_group(i));
      {
        Scope s(Track::compute, fl->moe ? "attention + router forward" : "attention forward", fm->global_layer(i));
        fl->forward_attn(f->x, *fc);
      }
      fl->launch_moe_dispatch(*fc);  // ‖ the backward's expert dgrad
    }
    if (bl) {
      {
        Scope s(Track::compute, bl->moe ? (delay_wgrad ? "expert dgrad" : "expert dgrad + wgrad") : "mlp backward",
                bm->global_layer(bi));
        bl->backward_mlp(*bc, !delay_wgrad);
      }
      bl->launch_moe_dispatch_backward(*bc);  // ‖ expert wgrad (delayed), then the forward's experts
      if (delay_wgrad) {
        Scope s(Track::compute, bl->moe ? "expert wgrad" : "mlp wgrad", bm->global_layer(bi));
        bl->backward_mlp_wgrad(*bc);
      }
    }
    if (fl) {
      {
        Scope s(Track::compute, fl->moe ? "experts forward" : "mlp forward", fm->global_layer(i));
        fl->forward_mlp(*fc);
      }
      fl->launch_moe_combine(*fc);  // ‖ the backward's attention dgrad
    }
    if (bl) {
      {
        Scope s(Track::compute, delay_wgrad ? "attention dgrad" : "attention dgrad + wgrad", bm->global_layer(bi));
        b->x = bl->backward_attn(*bc, !delay_wgrad);
      }
      b->x = bm->scheduled_input_backward(bi, std::move(b->x), b->ctx);  // an MTP layer's input, back
      if (delay_wgrad)
        deferred_dw = bi;
      else
        layer_done(bi);
    }
  }
  run_deferred_dw();
  if (nf > 0) {
    Scope s(Track::compute, "unpermute + residual", fm->global_layer(nf - 1));
    f->x = fm->layer_output(nf - 1, f->ctx);
  }
}

}  // namespace epx
