#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "epx/schedule/pipeline.hpp"
#include "epx/trace/trace.hpp"
#include "merged_step.hpp"

namespace epx {
namespace {

using Clock = std::chrono::steady_clock;

// The activations and gradients in flight between this stage and its neighbours: [T, H] rows, or
// (1 + D) times as many after a standalone MTP stage (Megatron's mtp_standalone, which sends the
// shapes ahead; here each stage knows them from the layout).
class StageTransfers {
 public:
  StageTransfers(Communicator& pp, const PipelineSpec& pipeline, std::int64_t rows, std::int64_t hidden, int mtp_depths,
                 DType dtype)
      : pp_(pp),
        pipeline_(pipeline),
        stage_(pp.rank()),
        prev_((stage_ + pipeline.stages - 1) % pipeline.stages),
        next_((stage_ + 1) % pipeline.stages),
        rows_(rows),
        hidden_(hidden),
        mtp_depths_(mtp_depths),
        dtype_(dtype) {}

  // Posts the receives `step` needs (once each).
  void post(const PipelineStep& step) {
    if (const auto f = step.forward; f && !pipeline_.first_virtual(stage_, f->chunk))  // the previous virtual stage's output
      post_recv(tag(kForward, f->chunk, f->micro_batch), prev_, pipeline_.virtual_stage(stage_, f->chunk) - 1);
    if (const auto b = step.backward; b && !pipeline_.last_virtual(stage_, b->chunk))  // this one's output's gradient
      post_recv(tag(kBackward, b->chunk, b->micro_batch), next_, pipeline_.virtual_stage(stage_, b->chunk));
  }
  // Chunk `chunk`'s input activation / output gradient of a micro-batch (posted before).
  Tensor activation(int chunk, int micro_batch) { return take(tag(kForward, chunk, micro_batch)); }
  Tensor gradient(int chunk, int micro_batch) { return take(tag(kBackward, chunk, micro_batch)); }
  // Chunk `chunk`'s output to the next virtual stage / input gradient to the previous one.
  void send_activation(const Tensor& y, int chunk, int micro_batch) {
    send(y, next_, tag(kForward, stage_ == pipeline_.stages - 1 ? chunk + 1 : chunk, micro_batch));
  }
  void send_gradient(const Tensor& dx, int chunk, int micro_batch) {
    send(dx, prev_, tag(kBackward, stage_ == 0 ? chunk - 1 : chunk, micro_batch));
  }
  // Waits for every send to complete (the neighbours' receives).
  void finish() {
    for (auto& [t, r] : outgoing_) wait(r, trace::kPipelineSend);
    outgoing_.clear();
  }
  double wait_s() const { return wait_s_; }

 private:
  enum Direction { kForward = 0, kBackward = 1 };
  // The receiver's chunk and the micro-batch: unique per transfer in an iteration.
  int tag(Direction d, int chunk, int micro_batch) const { return (micro_batch * pipeline_.chunks + chunk) * 2 + d; }

  // `output_of`: the virtual stage whose output (or its gradient) this is.
  void post_recv(int tag, int peer, int output_of) {
    if (incoming_.count(tag)) return;
    Tensor buf = Tensor::uninitialized({rows_ * (pipeline_.carries_mtp(output_of) ? 1 + mtp_depths_ : 1), hidden_}, dtype_);
    Request r = pp_.start_recv(buf.raw(), buf.numel(), dtype_, peer, tag);
    incoming_.emplace(tag, std::make_pair(std::move(buf), std::move(r)));
  }
  Tensor take(int tag) {
    auto it = incoming_.find(tag);
    wait(it->second.second, trace::kPipelineRecv);
    Tensor t = std::move(it->second.first);
    incoming_.erase(it);
    return t;
  }
  void send(const Tensor& t, int peer, int tag) {
    // Drop the sends that completed, so their tensors are freed.
    std::erase_if(outgoing_, [](std::pair<Tensor, Request>& o) { return o.second->test(); });
    outgoing_.emplace_back(t, pp_.start_send(t.raw(), t.numel(), t.dtype(), peer, tag));
  }
  void wait(Request& r, const char* what) {
    if (r->test()) return;
    const Clock::time_point t0 = Clock::now();
    {
      trace::Scope s(trace::Track::wait, what);
      pp_.wait(r);
    }
    wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  Communicator& pp_;
  const PipelineSpec& pipeline_;
  const int stage_, prev_, next_;
  const std::int64_t rows_, hidden_;
  const int mtp_depths_;
  const DType dtype_;
  std::map<int, std::pair<Tensor, Request>> incoming_;
  std::vector<std::pair<Tensor, Request>> outgoing_;
  double wait_s_ = 0;
};

}  // namespace

std::vector<MicroBatchLosses> forward_backward_pipelining(const std::vector<GPTModel*>& chunks, Communicator& pp,
                                                          const PipelineSpec& pipeline, int num_micro_batches,
                                                          const std::function<void(int, Tensor&, Tensor&)>& micro_batch,
                                                          const ScheduleOptions& options, PipelineTiming* timing) {
  const Clock::time_point t0 = Clock::now();
  const int stage = pp.rank();
  const ModelSpec& spec = chunks.front()->spec();
  const float dloss = static_cast<float>(1.0 / num_micro_batches);
  const double moe_layers = std::max(1, spec.num_moe_loss_layers());
  const std::vector<PipelineStep> steps = pipeline_order(pipeline, stage, num_micro_batches, options.ep_overlap);
  StageTransfers transfers(pp, pipeline, spec.seq_length * spec.micro_batch, spec.hidden, spec.mtp_layers, spec.dtype);
  std::vector<MicroBatchLosses> out(static_cast<std::size_t>(num_micro_batches));
  std::map<std::pair<int, int>, Pass> passes;  // (chunk, micro-batch) between its forward and backward

  for (std::size_t s = 0; s < steps.size(); ++s) {
    const PipelineStep& step = steps[s];
    transfers.post(step);
    if (s + 1 < steps.size()) transfers.post(steps[s + 1]);  // a step ahead, as overlap_p2p_comm

    GPTModel* fm = step.forward ? chunks[static_cast<std::size_t>(step.forward->chunk)] : nullptr;
    GPTModel* bm = step.backward ? chunks[static_cast<std::size_t>(step.backward->chunk)] : nullptr;
    Pass* f = nullptr;
    Pass* b = nullptr;
    if (fm) {
      const auto [v, j] = *step.forward;
      f = &passes[{v, j}];
      Tensor tokens, targets;
      micro_batch(j, tokens, targets);
      if (pipeline.first_virtual(stage, v)) {
        f->x = fm->embed(tokens, targets, f->ctx);
      } else {
        fm->begin(tokens, targets, f->ctx);
        f->x = transfers.activation(v, j);
      }
    }
    if (bm) {
      const auto [v, j] = *step.backward;
      b = &passes.at({v, j});
      // Merged with a forward, the step runs the MTP layers node by node.
      if (pipeline.last_virtual(stage, v))
        b->x = bm->head_backward(b->ctx, dloss, f != nullptr);
      else if (bm->chunk().mtp_stage)
        b->x = bm->mtp_stage_backward(b->ctx, transfers.gradient(v, j), f != nullptr);
      else
        b->x = transfers.gradient(v, j);
    }

    if (f && b)
      merged_step(fm, f, bm, b, options.delay_wgrad);
    else if (f)
      f->x = fm->forward_layers(std::move(f->x), f->ctx);
    else
      b->x = bm->backward_layers(b->ctx, std::move(b->x));

    if (f) {
      const auto [v, j] = *step.forward;
      MicroBatchLosses& l = out[static_cast<std::size_t>(j)];
      if (pipeline.last_virtual(stage, v)) {
        l.lm_loss = fm->head_forward(f->x, f->ctx);
        l.mtp_losses = f->ctx.mtp_losses;
      } else {
        if (fm->chunk().mtp_stage) f->x = fm->mtp_stage_forward(std::move(f->x), f->ctx);
        transfers.send_activation(f->x, v, j);
      }
      f->x = Tensor();
      for (AuxLoss k : kAuxLosses)  // this chunk's MoE layers' share of the mean
        at(l.aux_losses, k) += at(f->ctx.aux_losses, k) / moe_layers;
      l.z_loss += f->ctx.z_loss / moe_layers;
    }
    if (b) {
      const auto [v, j] = *step.backward;
      if (pipeline.first_virtual(stage, v))
        bm->embed_backward(b->ctx, b->x);
      else
        transfers.send_gradient(b->x, v, j);
      passes.erase({v, j});
    }
  }
  transfers.finish();
  if (timing) {
    timing->schedule_s += std::chrono::duration<double>(Clock::now() - t0).count();
    timing->wait_s += transfers.wait_s();
  }
  return out;
}

}  // namespace epx
