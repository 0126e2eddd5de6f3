#include "epx/moe/moe_layer.hpp"

#include <cmath>
#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/tensor/random.hpp"
#include "epx/trace/trace.hpp"

namespace epx {

using trace::Scope;
using trace::Track;

std::int64_t MoELayer::expert_ffn_shard(const MoESpec& spec, int etp) {
  if (spec.ffn % etp != 0)
    throw ConfigError(fmt::format(
        "model.moe_ffn_hidden_size={} is not divisible by model.expert_tensor_parallel_size={}: "
        "each ETP rank holds an equal slice of every expert's FFN",
        spec.ffn, etp));
  return spec.ffn / etp;
}

MoELayer::MoELayer(const MoESpec& spec, std::unique_ptr<TokenDispatcher> dispatcher, const MoELayerOptions& options)
    : router(spec),
      experts("mlp.experts", dispatcher->num_local_experts(), spec.hidden,
              expert_ffn_shard(spec, dispatcher->expert_tp_size()), spec.dtype, spec.activation, true,
              options.experts_recompute, spec.bias),
      spec_(spec),
      options_(options),
      dispatcher_(std::move(dispatcher)) {
  router.global_aux_group = options.global_aux_group;
  if (spec.bias && dispatcher_->expert_tp_size() != 1)  // fc2's bias would be summed over the ETP ranks
    throw std::invalid_argument("MoE layer: expert biases need expert_tensor_parallel_size 1 (moe.bias_needs_etp1)");
  if (spec.shared_ffn > 0)
    shared_experts.emplace("mlp.shared_experts", 1, spec.hidden, spec.shared_ffn, spec.dtype, spec.activation, false,
                           options.shared_recompute);  // no biases: Megatron's SharedExpertMLP asserts it
  // Megatron keeps the gate in the parameters' dtype; epx computes it from the FP32 master, as the router.
  if (spec.shared_ffn > 0 && spec.shared_expert_gate)
    shared_gate.emplace("mlp.shared_experts.gate_weight", Shape{1, spec.hidden}, DType::F32);
}

void MoELayer::reduce_gradients(Communicator& dense, Communicator& expert_dp) {
  for (Param* p : params()) (p->expert ? expert_dp : dense).allreduce(p->grad.raw(), p->grad.numel(), DType::F32);
}

std::vector<Param*> MoELayer::params() {
  std::vector<Param*> out{&router.weight};
  if (spec_.bias) out.push_back(&router.bias);
  for (Param* p : experts.params()) out.push_back(p);
  if (shared_experts)
    for (Param* p : shared_experts->params()) out.push_back(p);
  if (shared_gate) out.push_back(&*shared_gate);
  return out;
}

void MoELayer::zero_grad() {
  for (Param* p : params()) p->grad.zero();
}

// ------------------------------------------------------------------------------- forward

void MoELayer::forward_route(Context& ctx, const Tensor& x, bool training,
                             const RouterReplay* replay) {
  if (x.dtype() != spec_.dtype)
    throw InputError(fmt::format("MoE layer input is {}, the layer computes in {} (model.bf16)",
                                 dtype_name(x.dtype()), dtype_name(spec_.dtype)));
  if ((x.rank() != 2 && x.rank() != 3) || x.dim(-1) != spec_.hidden)
    throw InputError(fmt::format("MoE layer input has shape {}; expected [S, B, {}] or [T, {}]",
                                 shape_string(x.shape()), spec_.hidden, spec_.hidden));
  ctx.input_shape = x.shape();
  const std::int64_t seq = x.dim(0);  // S of [S, B, H]; T of [T, H] (one sequence)
  ctx.x = x.reshape({x.numel() / spec_.hidden, spec_.hidden});
  // Megatron computes the shared expert first, on the main stream, when it is not overlapped.
  if (shared_experts && !spec_.shared_expert_overlap) forward_shared(ctx);
  {
    Scope s(Track::compute, trace::kRouter);
    ctx.routing = router.forward(ctx.x, seq, training, options_.aux_loss_scale, options_.rank, replay, options_.aux_loss_share);
  }
  Scope s(Track::compute, trace::kPermute);  // with a dispatcher's counts exchange (a wait), if it has one
  dispatcher_->dispatch_preprocess(ctx.dispatch, ctx.x, {ctx.routing.routing_map, ctx.routing.probs});
}

void MoELayer::forward_shared(Context& ctx) {
  Scope s(Track::compute, trace::kSharedExpert);
  ctx.shared_output = shared_experts->forward(ctx.x, {ctx.x.dim(0)}, {}, ctx.shared);
  if (!shared_gate) return;
  // SharedExpertMLP's gate: output * sigmoid(x . w), one score per token.
  const std::int64_t t_count = ctx.x.dim(0), h = spec_.hidden;
  const Tensor x = ctx.x.to(DType::F32);
  Tensor out = ctx.shared_output.to(DType::F32);
  const float *xs = x.data<float>(), *w = shared_gate->master.data<float>();
  float* o = out.data<float>();
  ctx.shared_gate.assign(static_cast<std::size_t>(t_count), 0.f);
  ctx.shared_ungated = ctx.shared_output;
#pragma omp parallel for schedule(static) if (t_count * h >= (1 << 16))
  for (std::int64_t t = 0; t < t_count; ++t) {
    float logit = 0;
    for (std::int64_t j = 0; j < h; ++j) logit += xs[t * h + j] * w[j];
    const float g = 1 / (1 + std::exp(-logit));
    ctx.shared_gate[static_cast<std::size_t>(t)] = g;
    for (std::int64_t j = 0; j < h; ++j) o[t * h + j] *= g;
  }
  ctx.shared_output = out.to(spec_.dtype);
}

void MoELayer::launch_dispatch(Context& ctx) { dispatcher_->token_dispatch(ctx.dispatch); }

void MoELayer::forward_experts(Context& ctx) {
  if (shared_experts && spec_.shared_expert_overlap) forward_shared(ctx);  // while the dispatch flies
  DispatchState& d = ctx.dispatch;
  {
    Scope s(Track::compute, trace::kPermute);  // the regroup by local expert, after the exchange
    dispatcher_->dispatch_postprocess(d);
  }
  Tensor y;
  {
    Scope s(Track::compute, trace::kExpertGemms);
    y = experts.forward(d.hidden, d.tokens_per_local_expert, std::move(d.probs), ctx.experts);
  }
  d.hidden = Tensor();
  Scope s(Track::compute, trace::kUnpermute);
  dispatcher_->combine_preprocess(d, std::move(y));
}

void MoELayer::launch_combine(Context& ctx) { dispatcher_->token_combine(ctx.dispatch); }

Tensor MoELayer::forward_output(Context& ctx) {
  Tensor out;
  {
    Scope s(Track::compute, trace::kUnpermute);
    out = dispatcher_->combine_postprocess(ctx.dispatch);
  }
  if (shared_experts) {
    // Routed + shared summed in FP32, rounded once to the layer's dtype.
    add(out, ctx.shared_output, out);
    ctx.shared_output = Tensor();
  }
  return out.reshape(ctx.input_shape);
}

Tensor MoELayer::forward(const Tensor& x, Context& ctx, bool training) {
  forward_route(ctx, x, training);
  launch_dispatch(ctx);
  forward_experts(ctx);
  launch_combine(ctx);
  return forward_output(ctx);
}

void MoELayer::release_input(Context& ctx) {
  ctx.x = Tensor();
  ctx.shared.x = Tensor();
}

void MoELayer::restore_input(Context& ctx, const Tensor& x) {
  ctx.x = x.reshape({x.numel() / spec_.hidden, spec_.hidden});
  if (shared_experts) ctx.shared.x = ctx.x;
}

// ------------------------------------------------------------------------------ backward

void MoELayer::launch_combine_backward(Context& ctx, const Tensor& dy) {
  if (dy.shape() != ctx.input_shape)
    throw InputError(fmt::format("output gradient has shape {}; the output is {}",
                                 shape_string(dy.shape()), shape_string(ctx.input_shape)));
  const Tensor g = (dy.dtype() == spec_.dtype ? dy : dy.to(spec_.dtype)).reshape(ctx.x.shape());
  {
    Scope s(Track::compute, trace::kUnpermute);
    dispatcher_->combine_postprocess_backward(ctx.dispatch, g);
  }
  dispatcher_->token_combine_backward(ctx.dispatch);
  if (shared_experts) {
    ctx.dy = g;
    if (spec_.shared_expert_overlap) backward_shared(ctx);  // while the combine-backward flies
  }
}

void MoELayer::backward_shared(Context& ctx) {
  Scope s(Track::compute, trace::kSharedExpert);
  if (!shared_gate) {
    ctx.dx_shared = shared_experts->backward_dgrad(ctx.shared, ctx.dy, nullptr);
    ctx.dy = Tensor();
    return;
  }
  // Through the gate: d(output) = dy * g and d(x . w) = g (1 - g) sum_h dy * output; x's
  // gradient through w is added in backward_route.
  const std::int64_t t_count = ctx.x.dim(0), h = spec_.hidden;
  const Tensor dy = ctx.dy.to(DType::F32), ungated = ctx.shared_ungated.to(DType::F32);
  const float *d = dy.data<float>(), *u = ungated.data<float>();
  Tensor d_ungated = Tensor::uninitialized(dy.shape(), DType::F32);
  float* du = d_ungated.data<float>();
  ctx.shared_gate_dlogit.assign(static_cast<std::size_t>(t_count), 0.f);
#pragma omp parallel for schedule(static) if (t_count * h >= (1 << 16))
  for (std::int64_t t = 0; t < t_count; ++t) {
    const float g = ctx.shared_gate[static_cast<std::size_t>(t)];
    float dg = 0;
    for (std::int64_t j = 0; j < h; ++j) {
      dg += d[t * h + j] * u[t * h + j];
      du[t * h + j] = d[t * h + j] * g;
    }
    ctx.shared_gate_dlogit[static_cast<std::size_t>(t)] = dg * g * (1 - g);
  }
  ctx.dy = Tensor();
  ctx.shared_ungated = Tensor();
  ctx.dx_shared = shared_experts->backward_dgrad(ctx.shared, d_ungated.to(spec_.dtype), nullptr);
}

void MoELayer::backward_experts(Context& ctx) {
  DispatchState& d = ctx.dispatch;
  {
    Scope s(Track::compute, trace::kUnpermute);
    dispatcher_->combine_preprocess_backward(d);
  }
  std::vector<float> dprobs;
  Tensor dx;
  {
    Scope s(Track::compute, trace::kExpertGemms);
    dx = experts.backward_dgrad(ctx.experts, d.grad, &dprobs);
  }
  d.grad = Tensor();
  Scope s(Track::compute, trace::kPermute);
  dispatcher_->dispatch_postprocess_backward(d, std::move(dx), std::move(dprobs));
}

void MoELayer::launch_dispatch_backward(Context& ctx) { dispatcher_->token_dispatch_backward(ctx.dispatch); }

Tensor MoELayer::backward_route(Context& ctx) {
  ctx.dprobs = Tensor({ctx.x.dim(0), spec_.num_experts}, DType::F32);
  Tensor dx;
  {
    Scope s(Track::compute, trace::kPermute);
    dx = dispatcher_->dispatch_preprocess_backward(ctx.dispatch, ctx.dprobs);
  }
  // Not overlapped, Megatron's autograd reaches the shared expert after the routed path.
  if (shared_experts && !spec_.shared_expert_overlap) backward_shared(ctx);
  Tensor dx_router;
  {
    Scope s(Track::compute, trace::kRouter);
    dx_router = router.backward_dgrad(ctx.routing, ctx.dprobs, DType::F32);
  }
  if (shared_gate) {  // x's gradient through the shared expert's gate: d(x . w) * w, in FP32 with the router's
    Scope s(Track::compute, trace::kSharedExpert);
    const std::int64_t t_count = ctx.x.dim(0), h = spec_.hidden;
    const float* w = shared_gate->master.data<float>();
    float* dxr = dx_router.data<float>();
    for (std::int64_t t = 0; t < t_count; ++t)
      for (std::int64_t j = 0; j < h; ++j) dxr[t * h + j] += ctx.shared_gate_dlogit[static_cast<std::size_t>(t)] * w[j];
  }
  // dx = dispatch path + router path (+ shared expert), summed in FP32, rounded once.
  add_f32(dx, dx_router, shared_experts ? &ctx.dx_shared : nullptr, dx);
  ctx.dx_shared = Tensor();
  ctx.dprobs = Tensor();
  return dx.reshape(ctx.input_shape);
}

void MoELayer::backward_expert_wgrad(Context& ctx) {
  Scope s(Track::compute, trace::kExpertGemms);
  experts.backward_wgrad(ctx.experts);
}

void MoELayer::backward_dense_wgrad(Context& ctx) {
  if (shared_experts) {
    Scope s(Track::compute, trace::kSharedExpert);
    if (shared_gate) {  // w's gradient: sum over tokens of d(x . w) * x (the router's FP32 copy of x)
      const std::int64_t t_count = ctx.x.dim(0), h = spec_.hidden;
      const float* xs = ctx.routing.input.data<float>();
      float* dw = shared_gate->grad.data<float>();
      for (std::int64_t t = 0; t < t_count; ++t)
        for (std::int64_t j = 0; j < h; ++j) dw[j] += ctx.shared_gate_dlogit[static_cast<std::size_t>(t)] * xs[t * h + j];
      ctx.shared_gate_dlogit.clear();
    }
    shared_experts->backward_wgrad(ctx.shared);
  }
  Scope s(Track::compute, trace::kRouter);
  router.backward_wgrad(ctx.routing);
}

Tensor MoELayer::backward(Context& ctx, const Tensor& dy) {
  launch_combine_backward(ctx, dy);
  backward_experts(ctx);
  launch_dispatch_backward(ctx);
  const bool early = spec_.experts_wgrad_under_dispatch_backward;
  if (early) backward_expert_wgrad(ctx);  // while the exchange flies
  Tensor dx = backward_route(ctx);
  if (!early) backward_expert_wgrad(ctx);
  backward_dense_wgrad(ctx);
  return dx;
}

}  // namespace epx
