// One merged step of the EP-overlap schedule (Megatron-Core's TransformerModelChunkSchedulePlan.run):
// the forward of one micro-batch's model chunk interleaved layer by layer with the backward of
// another's, each exchange of one on the communication stream while the compute thread works on
// the other (schedule.hpp draws the layer pair).
#pragma once

#include "epx/model/gpt_model.hpp"

namespace epx {

// One micro-batch in flight through a model chunk.
struct Pass {
  GPTModel::Context ctx;
  Tensor x;  // forward: the next layer's input; backward: the gradient of the last output
};

// The forward of `f` through chunk `fm` and the backward of `b` through chunk `bm` (either may be
// absent). On entry f->x is the chunk's input and b->x the gradient of the chunk's output (the
// caller ran the embedding / head backward, or received them from the neighbouring stage); on
// return f->x is the chunk's output and b->x the gradient of its input. In the loss's chunk the MTP
// layers run as layers after the decoder's (GPTModel::scheduled_layer): f->x is then the last MTP
// layer's output for head_forward, and b->x on entry head_backward's with schedule_mtp.
void merged_step(GPTModel* fm, Pass* f, GPTModel* bm, Pass* b, bool delay_wgrad);

}  // namespace epx
