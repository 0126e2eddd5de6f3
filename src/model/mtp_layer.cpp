#include "epx/model/mtp_layer.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"
#include "epx/model/norm_gain.hpp"
#include "epx/tensor/random.hpp"

namespace epx {

MtpLayer::MtpLayer(int depth, const ModelSpec& spec, std::unique_ptr<TokenDispatcher> dispatcher,
                   MoELayerOptions moe_options)
    : prefix(fmt::format("mtp.layers.{}", depth)),
      enorm(prefix + ".enorm.weight", {spec.hidden}, DType::F32),
      hnorm(prefix + ".hnorm.weight", {spec.hidden}, DType::F32),
      eh_proj(prefix + ".eh_proj.weight", {spec.hidden, 2 * spec.hidden}, spec.dtype),
      final_layernorm(prefix + ".final_layernorm.weight", {spec.hidden}, DType::F32),
      layer(spec.num_layers + depth, spec, std::move(dispatcher), moe_options, prefix + ".mtp_model_layer"),
      spec_(spec) {}

std::vector<Param*> MtpLayer::params() {
  std::vector<Param*> out{&enorm, &hnorm, &eh_proj};
  for (Param* p : layer.params()) out.push_back(p);
  out.push_back(&final_layernorm);
  return out;
}

void MtpLayer::init_weights(std::uint64_t seed) {
  // Norms 1 (0 zero-centred); eh_proj Megatron's init_method, N(0, init_std), drawn by name.
  for (Param* p : {&enorm, &hnorm, &final_layernorm}) {
    p->master.fill(norm_init(spec_.zero_centered_gamma));
    p->refresh();
  }
  eh_proj.master.copy_from(random_normal(eh_proj.master.shape(), DType::F32, seed, stream_of(eh_proj.name), spec_.init_std));
  eh_proj.refresh();
  layer.init_weights(seed);
}

Tensor MtpLayer::norm_backward(const Tensor& x, Param& gamma, const Tensor& rstd, const Tensor& dy) const {
  Tensor dx = Tensor::uninitialized(x.shape(), x.dtype());
  rmsnorm_dgrad(x, norm_gain(gamma, spec_.zero_centered_gamma), rstd, dy, dx);
  rmsnorm_wgrad(x, rstd, dy, gamma.grad);
  return dx;
}

void MtpLayer::checkpoint(Context& ctx) const {
  if (spec_.recompute.method != "uniform") return;
  Context kept;
  kept.h = std::move(ctx.h);
  kept.emb = std::move(ctx.emb);
  kept.replay = std::move(ctx.layer.router_replay);
  ctx = std::move(kept);
}

Tensor MtpLayer::forward(const Tensor& h, const Tensor& emb, Context& ctx, const RouterReplay* replay) {
  const Tensor x = forward_in(h, emb, ctx);
  return forward_out(layer.forward(x, ctx.layer, replay), ctx);
}

Tensor MtpLayer::forward_in(const Tensor& h, const Tensor& emb, Context& ctx) {
  const std::int64_t T = h.dim(0), H = spec_.hidden;
  ctx.h = h;
  ctx.emb = emb;
  // [enorm(embedding) | hnorm(h)], Megatron's torch.cat((decoder_input, hidden_states), -1).
  const Tensor e = layer.norm(emb, enorm, ctx.emb_rstd), n = layer.norm(h, hnorm, ctx.h_rstd);
  ctx.cat = Tensor::uninitialized({T, 2 * H}, spec_.dtype);
  const std::size_t row = static_cast<std::size_t>(H) * dtype_size(spec_.dtype);
  auto* cat = static_cast<std::byte*>(ctx.cat.raw());
  for (std::int64_t t = 0; t < T; ++t) {
    std::copy_n(static_cast<const std::byte*>(e.raw()) + t * row, row, cat + 2 * t * row);
    std::copy_n(static_cast<const std::byte*>(n.raw()) + t * row, row, cat + (2 * t + 1) * row);
  }
  Tensor x = Tensor::uninitialized({T, H}, spec_.dtype);
  gemm(mat(ctx.cat), Trans::N, mat(eh_proj.compute), Trans::T, mat_mut(x));
  return x;
}

Tensor MtpLayer::forward_out(Tensor y, Context& ctx) {
  ctx.y = std::move(y);
  return layer.norm(ctx.y, final_layernorm, ctx.y_rstd);
}

std::pair<Tensor, Tensor> MtpLayer::backward(Context& ctx, const Tensor& dout) {
  if (!ctx.cat.defined()) {  // checkpointed: the forward again, the router replaying its draw
    const Tensor h = ctx.h, emb = ctx.emb;
    const RouterReplay replay = std::move(ctx.replay);
    forward(h, emb, ctx, &replay);
  }
  const Tensor dx = layer.backward_dgrad(ctx.layer, backward_out(ctx, dout));
  layer.backward_wgrad(ctx.layer);
  std::pair<Tensor, Tensor> out = backward_in(ctx, dx);
  ctx = Context{};
  return out;
}

Tensor MtpLayer::backward_out(Context& ctx, const Tensor& dout) {
  Tensor dy = norm_backward(ctx.y, final_layernorm, ctx.y_rstd, dout);
  ctx.y = ctx.y_rstd = Tensor();
  return dy;
}

std::pair<Tensor, Tensor> MtpLayer::backward_in(Context& ctx, const Tensor& dx) {
  const std::int64_t T = dx.dim(0), H = spec_.hidden;
  Tensor dcat = Tensor::uninitialized({T, 2 * H}, spec_.dtype);
  gemm(mat(dx), Trans::N, mat(eh_proj.compute), Trans::N, mat_mut(dcat));
  gemm(mat(dx), Trans::T, mat(ctx.cat), Trans::N, mat_mut(eh_proj.grad), true);
  Tensor de = Tensor::uninitialized({T, H}, spec_.dtype), dn = Tensor::uninitialized({T, H}, spec_.dtype);
  const std::size_t row = static_cast<std::size_t>(H) * dtype_size(spec_.dtype);
  const auto* src = static_cast<const std::byte*>(dcat.raw());
  for (std::int64_t t = 0; t < T; ++t) {
    std::copy_n(src + 2 * t * row, row, static_cast<std::byte*>(de.raw()) + t * row);
    std::copy_n(src + (2 * t + 1) * row, row, static_cast<std::byte*>(dn.raw()) + t * row);
  }
  std::pair<Tensor, Tensor> out{norm_backward(ctx.h, hnorm, ctx.h_rstd, dn), norm_backward(ctx.emb, enorm, ctx.emb_rstd, de)};
  ctx.h = ctx.h_rstd = ctx.emb = ctx.emb_rstd = ctx.cat = Tensor();
  return out;
}

}  // namespace epx
