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
  const int nf = f ? fm->num_local_layers() : 0, nb = b ? bm->num_local_layers() : 0;
  int deferred_dw = -1;  // a backward layer whose attention wgrad waits (delay_wgrad)
  const auto run_deferred_dw = [&] {
    if (deferred_dw < 0) return;
    Scope s(Track::compute, "attention + router wgrad", bm->global_layer(deferred_dw));
    auto& c = b->ctx.layers[static_cast<std::size_t>(deferred_dw)];
    bm->layers[static_cast<std::size_t>(deferred_dw)]->backward_attn_wgrad(*c);
    c.reset();
    bm->grads_ready(bm->layer_grad_group(deferred_dw));
    deferred_dw = -1;
  };
  for (int i = 0; i < std::max(nf, nb); ++i) {
    const int bi = nb - 1 - i;  // the backward's layer
    TransformerLayer* fl = i < nf ? fm->layers[static_cast<std::size_t>(i)].get() : nullptr;
    TransformerLayer* bl = bi >= 0 ? bm->layers[static_cast<std::size_t>(bi)].get() : nullptr;
    TransformerLayer::Context* fc = nullptr;
    TransformerLayer::Context* bc = bl ? b->ctx.layers[static_cast<std::size_t>(bi)].get() : nullptr;
    if (fl) {
      f->ctx.layers[static_cast<std::size_t>(i)] = std::make_unique<TransformerLayer::Context>();
      fc = f->ctx.layers[static_cast<std::size_t>(i)].get();
    }

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
      fm->params_needed(fm->layer_grad_group(i));
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
      Scope s(Track::compute, delay_wgrad ? "attention dgrad" : "attention dgrad + wgrad", bm->global_layer(bi));
      b->x = bl->backward_attn(*bc, !delay_wgrad);
      if (delay_wgrad) {
        deferred_dw = bi;
      } else {
        b->ctx.layers[static_cast<std::size_t>(bi)].reset();
        bm->grads_ready(bm->layer_grad_group(bi));
      }
    }
  }
  run_deferred_dw();
  if (nf > 0) {
    Scope s(Track::compute, "unpermute + residual", fm->global_layer(nf - 1));
    f->x = fm->layer_output(nf - 1, f->ctx);
  }
}

}  // namespace epx
