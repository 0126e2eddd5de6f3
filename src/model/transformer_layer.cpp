#include "epx/model/transformer_layer.hpp"

#include <cmath>

#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"
#include "epx/model/norm_gain.hpp"
#include "epx/tensor/random.hpp"
#include "epx/trace/trace.hpp"

namespace epx {

TransformerLayer::TransformerLayer(int index, const ModelSpec& spec, std::unique_ptr<TokenDispatcher> dispatcher,
                                   MoELayerOptions moe_options, std::string prefix_)
    : prefix(prefix_.empty() ? fmt::format("decoder.layers.{}", index) : std::move(prefix_)),
      input_layernorm(prefix + ".input_layernorm.weight", {spec.hidden}, DType::F32),
      pre_mlp_layernorm(prefix + ".pre_mlp_layernorm.weight", {spec.hidden}, DType::F32),
      attention(prefix + ".self_attention", spec.attention_of(index)),
      spec_(spec) {
  if (dispatcher) {
    using R = GroupedMlp::Recompute;
    moe_options.experts_recompute = spec.recompute.moe_act ? R::activation : R::none;
    moe_options.shared_recompute = spec.recompute.shared_experts ? R::all : R::none;
    moe = std::make_unique<MoELayer>(*spec.moe, std::move(dispatcher), moe_options);
  } else {
    mlp.emplace(prefix + ".mlp", 1, spec.hidden, spec.ffn, spec.dtype, spec.activation, false,
                spec.recompute.mlp ? GroupedMlp::Recompute::all : GroupedMlp::Recompute::none, spec.bias);
  }
}

std::vector<Param*> TransformerLayer::params() {
  std::vector<Param*> out{&input_layernorm, &pre_mlp_layernorm};
  for (Param* p : attention.params()) out.push_back(p);
  if (moe)
    for (Param* p : moe->params()) out.push_back(p);
  if (mlp)
    for (Param* p : mlp->params()) out.push_back(p);
  return out;
}

void TransformerLayer::init_weights(std::uint64_t seed) {
  // Megatron: norms 1, sinks (TE's) and the linears' biases 0, linears N(0, std), the projections
  // into the residual stream (linear_proj, fc2) N(0, std / sqrt(2 * num_layers)). Drawn per tensor
  // name: the same on every rank.
  const double out_std = spec_.init_std / std::sqrt(2.0 * spec_.num_layers);
  const auto draw = [&](Param& p, double std) {
    p.master.copy_from(random_normal(p.master.shape(), DType::F32, seed, stream_of(p.name), std));
    p.refresh();
  };
  for (Param* p : {&attention.softmax_offset, &attention.linear_qkv_bias, &attention.linear_proj_bias}) {
    p->master.zero();
    p->refresh();
  }
  for (Param* p : {&input_layernorm, &pre_mlp_layernorm, &attention.q_layernorm, &attention.k_layernorm,
                   &attention.kv_layernorm}) {
    p->master.fill(norm_init(spec_.zero_centered_gamma));
    p->refresh();
  }
  for (Param* p : {&attention.linear_qkv, &attention.linear_q_down_proj, &attention.linear_q_up_proj,
                   &attention.linear_kv_down_proj, &attention.linear_kv_up_proj})  // MLA's are empty otherwise
    draw(*p, spec_.init_std);
  draw(attention.linear_proj, out_std);
  if (mlp) {
    draw(mlp->fc1, spec_.init_std);
    draw(mlp->fc2, out_std);
    for (Param* p : {&mlp->fc1_bias, &mlp->fc2_bias}) {
      p->master.zero();
      p->refresh();
    }
  }
  if (moe) moe->init_weights(splitmix64(seed ^ stream_of(prefix)));
}

Tensor TransformerLayer::norm(const Tensor& x, const Param& gamma, Tensor& rstd) const {
  Tensor y = Tensor::uninitialized(x.shape(), x.dtype());
  rstd = Tensor::uninitialized({x.dim(0)}, DType::F32);
  rmsnorm_forward(x, norm_gain(gamma, spec_.zero_centered_gamma), spec_.eps, y, rstd);
  return y;
}

Tensor TransformerLayer::forward(const Tensor& x, Context& ctx, const RouterReplay* replay) {
  forward_attn(x, ctx, replay);
  launch_moe_dispatch(ctx);
  forward_mlp(ctx);
  launch_moe_combine(ctx);
  return forward_output(ctx);
}

// overlap_dispatch_backward_with_experts_wgrad: the routed experts' wgrad fills the dispatch's
// backward exchange instead of following the layer's dgrad.
bool TransformerLayer::experts_wgrad_early() const {
  return moe && moe->spec().experts_wgrad_under_dispatch_backward;
}

Tensor TransformerLayer::backward_dgrad(Context& ctx, const Tensor& dy) {
  launch_moe_combine_backward(ctx, dy);
  backward_mlp(ctx, false);
  launch_moe_dispatch_backward(ctx);
  if (experts_wgrad_early()) backward_mlp_wgrad(ctx);
  return backward_attn(ctx, false);
}

void TransformerLayer::backward_wgrad(Context& ctx) {
  if (!experts_wgrad_early()) backward_mlp_wgrad(ctx);
  backward_attn_wgrad(ctx);
}

// ----------------------------------------------------------------------------- forward nodes

void TransformerLayer::forward_attn(const Tensor& x, Context& ctx, const RouterReplay* replay) {
  const std::int64_t S = spec_.seq_length, T = x.dim(0), H = spec_.hidden;
  ctx.x = x;
  const Tensor n1 = norm(x, input_layernorm, ctx.rstd1);
  const Tensor a = attention.forward(n1, S, ctx.attn);
  ctx.h = Tensor::uninitialized(x.shape(), x.dtype());
  add(x, a, ctx.h);
  Tensor n2 = norm(ctx.h, pre_mlp_layernorm, ctx.rstd2);
  if (moe) {
    ctx.moe = std::make_unique<MoELayer::Context>();
    moe->forward_route(*ctx.moe, n2.reshape({S, T / S, H}), true, replay);
  } else {
    ctx.mlp_io = std::move(n2);
  }
}

void TransformerLayer::launch_moe_dispatch(Context& ctx) {
  if (moe) moe->launch_dispatch(*ctx.moe);
}

void TransformerLayer::forward_mlp(Context& ctx) {
  if (moe) moe->forward_experts(*ctx.moe);
  else ctx.mlp_io = mlp->forward(ctx.mlp_io, {ctx.mlp_io.dim(0)}, {}, ctx.mlp);
}

void TransformerLayer::launch_moe_combine(Context& ctx) {
  if (moe) moe->launch_combine(*ctx.moe);
}

Tensor TransformerLayer::forward_output(Context& ctx) {
  Tensor m;
  if (moe) {
    MoELayer::Context& c = *ctx.moe;
    m = moe->forward_output(c).reshape(ctx.h.shape());
    ctx.aux_losses = c.routing.aux_losses;
    ctx.z_loss = c.routing.z_loss;
    ctx.router_replay = std::move(c.routing.replay);
  } else {
    m = std::move(ctx.mlp_io);
  }
  Tensor out = Tensor::uninitialized(ctx.h.shape(), ctx.h.dtype());
  add(ctx.h, m, out);
  if (moe && spec_.recompute.moe) {  // the whole MoE layer: keep its input (unless the norm's recomputed)
    if (!spec_.recompute.layernorm) ctx.moe_input = ctx.moe->x;
    ctx.moe.reset();
  }
  if (spec_.recompute.layernorm) {  // keep only the norms' inputs (x and h, saved anyway)
    ctx.attn.x = Tensor();
    if (moe && ctx.moe) moe->release_input(*ctx.moe);
    else if (!moe) ctx.mlp.x = Tensor();
  }
  return out;
}

void TransformerLayer::recompute_moe(Context& ctx) {
  trace::Scope scope(trace::Track::compute, "recompute moe");
  const std::int64_t S = spec_.seq_length, T = ctx.h.dim(0), H = spec_.hidden;
  Tensor input = std::move(ctx.moe_input);
  if (!input.defined()) {  // layernorm recompute too: the norm again from the residual
    Tensor rstd;
    input = norm(ctx.h, pre_mlp_layernorm, rstd);
  }
  ctx.moe = std::make_unique<MoELayer::Context>();
  moe->forward_route(*ctx.moe, input.reshape({S, T / S, H}), true, &ctx.router_replay);
  moe->launch_dispatch(*ctx.moe);
  moe->forward_experts(*ctx.moe);
  moe->launch_combine(*ctx.moe);
  moe->forward_output(*ctx.moe);
}

// ---------------------------------------------------------------------------- backward nodes

void TransformerLayer::launch_moe_combine_backward(Context& ctx, const Tensor& dy) {
  const std::int64_t S = spec_.seq_length, T = dy.dim(0), H = spec_.hidden;
  if (moe && spec_.recompute.moe) {
    recompute_moe(ctx);
  } else if (spec_.recompute.layernorm) {
    Tensor rstd;
    const Tensor n2 = norm(ctx.h, pre_mlp_layernorm, rstd);
    if (moe) moe->restore_input(*ctx.moe, n2);
    else ctx.mlp.x = n2;
  }
  ctx.dy = dy;
  if (moe) moe->launch_combine_backward(*ctx.moe, dy.reshape({S, T / S, H}));
}

void TransformerLayer::backward_mlp(Context& ctx, bool with_wgrad) {
  if (moe) moe->backward_experts(*ctx.moe);
  else ctx.dn2 = mlp->backward_dgrad(ctx.mlp, ctx.dy, nullptr);
  if (with_wgrad) backward_mlp_wgrad(ctx);
}

void TransformerLayer::launch_moe_dispatch_backward(Context& ctx) {
  if (moe) moe->launch_dispatch_backward(*ctx.moe);
}

Tensor TransformerLayer::backward_attn(Context& ctx, bool with_wgrad) {
  const Tensor dy = std::move(ctx.dy);
  const Tensor dn2 = moe ? moe->backward_route(*ctx.moe).reshape(dy.shape()) : std::move(ctx.dn2);
  // dh = dy + RMSNorm'(h)^T dn2.
  Tensor tmp = Tensor::uninitialized(dy.shape(), dy.dtype());
  rmsnorm_dgrad(ctx.h, norm_gain(pre_mlp_layernorm, spec_.zero_centered_gamma), ctx.rstd2, dn2, tmp);
  rmsnorm_wgrad(ctx.h, ctx.rstd2, dn2, pre_mlp_layernorm.grad);
  Tensor dh = Tensor::uninitialized(dy.shape(), dy.dtype());
  add(dy, tmp, dh);

  if (spec_.recompute.layernorm) {
    Tensor rstd;
    ctx.attn.x = norm(ctx.x, input_layernorm, rstd);
  }
  const Tensor dn1 = attention.backward_dgrad(ctx.attn, dh);
  rmsnorm_dgrad(ctx.x, norm_gain(input_layernorm, spec_.zero_centered_gamma), ctx.rstd1, dn1, tmp);
  rmsnorm_wgrad(ctx.x, ctx.rstd1, dn1, input_layernorm.grad);
  Tensor dx = Tensor::uninitialized(dy.shape(), dy.dtype());
  add(dh, tmp, dx);
  ctx.x = ctx.h = ctx.rstd1 = ctx.rstd2 = Tensor();
  if (with_wgrad) backward_attn_wgrad(ctx);
  return dx;
}

void TransformerLayer::backward_mlp_wgrad(Context& ctx) {
  if (moe) moe->backward_expert_wgrad(*ctx.moe);
  else mlp->backward_wgrad(ctx.mlp);
}

void TransformerLayer::backward_attn_wgrad(Context& ctx) {
  attention.backward_wgrad(ctx.attn);
  if (moe) {
    moe->backward_dense_wgrad(*ctx.moe);
    ctx.moe.reset();
  }
}

}  // namespace epx
