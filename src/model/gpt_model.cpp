#include "epx/model/gpt_model.hpp"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"
#include "epx/model/norm_gain.hpp"
#include "epx/tensor/random.hpp"
#include "epx/trace/trace.hpp"

namespace epx {

namespace {

// ids [T] (I64) from row `shift` on, then zeros to `total` rows: the MTP's roll to the left.
Tensor rolled(const Tensor& ids, std::int64_t shift, std::int64_t total) {
  Tensor out({total}, DType::I64);
  std::copy_n(ids.data<std::int64_t>() + shift, std::min(total, ids.numel() - shift), out.data<std::int64_t>());
  return out;
}

ModelChunk resolved(ModelChunk c, int num_layers) {
  if (c.layers.end < 0) c.layers.end = num_layers;
  if (c.layers.first < 0 || c.layers.first > c.layers.end || c.layers.end > num_layers)
    throw std::invalid_argument(fmt::format("model: chunk layers [{}, {}) outside the model's {}", c.layers.first,
                                            c.layers.end, num_layers));
  if ((c.mtp_stage && c.post_process) || (c.mtp_before && !c.post_process))
    throw std::logic_error("model: a standalone MTP stage is a chunk before the loss's");
  return c;
}

// The blocks of T rows of a standalone MTP stage's output (or its gradient): the decoder's
// hidden states, then each depth's.
std::vector<Tensor> blocks_of(const Tensor& x, std::int64_t T, std::size_t blocks) {
  if (x.dim(0) != static_cast<std::int64_t>(blocks) * T)
    throw std::logic_error(fmt::format("model: {} rows from a standalone MTP stage, expected {} blocks of {}", x.dim(0), blocks, T));
  const std::size_t n = static_cast<std::size_t>(T * x.dim(1)) * dtype_size(x.dtype());
  std::vector<Tensor> out;
  for (std::size_t k = 0; k < blocks; ++k) {
    out.push_back(Tensor::uninitialized({T, x.dim(1)}, x.dtype()));
    std::copy_n(static_cast<const std::byte*>(x.raw()) + k * n, n, static_cast<std::byte*>(out.back().raw()));
  }
  return out;
}

Tensor concatenated(const std::vector<const Tensor*>& parts) {
  const std::int64_t T = parts.front()->dim(0);
  Tensor out = Tensor::uninitialized({T * static_cast<std::int64_t>(parts.size()), parts.front()->dim(1)}, parts.front()->dtype());
  std::byte* o = static_cast<std::byte*>(out.raw());
  for (const Tensor* p : parts) o = std::copy_n(static_cast<const std::byte*>(p->raw()), p->nbytes(), o);
  return out;
}

}  // namespace

GPTModel::GPTModel(const ModelSpec& spec, const std::function<std::unique_ptr<TokenDispatcher>()>& make_dispatcher,
                   const MoELayerOptions& moe_options, ModelChunk chunk)
    : output_layer("output_layer.weight", {spec.tie_embeddings || !chunk.post_process ? 0 : spec.vocab, spec.hidden},
                   spec.dtype),
      spec_(spec),
      chunk_(resolved(chunk, spec.num_layers)),
      checkpoint_end_(static_cast<std::size_t>(chunk_.layers.size()), -1) {
  embedding = Param("embedding.word_embeddings.weight",
                    {chunk_.pre_process || (chunk_.post_process && spec.tie_embeddings) || runs_mtp() ? spec.vocab : 0, spec.hidden},
                    spec.dtype);
  final_layernorm = Param("decoder.final_layernorm.weight", {has_final_norm() ? spec.hidden : 0}, DType::F32);
  for (int i = chunk_.layers.first; i < chunk_.layers.end; ++i)
    layers.push_back(std::make_unique<TransformerLayer>(
        i, spec, spec.is_moe[static_cast<std::size_t>(i)] ? make_dispatcher() : nullptr, moe_options));
  if (runs_mtp()) {
    // mtp_use_repeated_layer: one layer for every depth; its router's aux losses count 1 / D per
    // call, so that the D calls add up to one layer's (Megatron's router; its z-loss's value only).
    MoELayerOptions mtp_options = moe_options;
    if (spec.mtp_repeated) mtp_options.aux_loss_share = 1.0 / spec.mtp_layers;
    for (int k = 0; k < (spec.mtp_repeated ? 1 : spec.mtp_layers); ++k)
      mtp.push_back(std::make_unique<MtpLayer>(
          k, spec, spec.is_moe[static_cast<std::size_t>(spec.num_layers + k)] ? make_dispatcher() : nullptr, mtp_options));
    for (int k = 0; k < spec.mtp_layers; ++k) depth_.push_back(mtp[spec.mtp_repeated ? 0 : static_cast<std::size_t>(k)].get());
  }
  // Megatron checkpoints within each chunk: its recompute_num_layers count the chunk's layers.
  for (const auto& [first, last] : spec.recompute.checkpoints(num_local_layers()))
    checkpoint_end_[static_cast<std::size_t>(first)] = last;
}

std::vector<Param*> GPTModel::params() {
  std::vector<Param*> out;
  if (has_embedding()) out.push_back(&embedding);
  for (auto& l : layers)
    for (Param* p : l->params()) out.push_back(p);
  if (has_final_norm()) out.push_back(&final_layernorm);
  if (chunk_.post_process && !spec_.tie_embeddings) out.push_back(&output_layer);
  for (Param* p : mtp_params()) out.push_back(p);
  return out;
}

std::vector<std::vector<Param*>> GPTModel::grad_groups() {
  std::vector<std::vector<Param*>> out;
  if (head_groups() > 0) {
    out.emplace_back();
    if (has_final_norm()) out.front().push_back(&final_layernorm);
    if (chunk_.post_process && !spec_.tie_embeddings) out.front().push_back(&output_layer);
    for (auto& m : mtp)
      for (Param* p : m->params()) out.front().push_back(p);
    if (embedding_copy()) out.front().push_back(&embedding);
  }
  for (int i = num_local_layers() - 1; i >= 0; --i) out.push_back(layers[static_cast<std::size_t>(i)]->params());
  if (chunk_.pre_process) out.push_back({&embedding});
  return out;
}

std::vector<Param*> GPTModel::expert_params() {
  std::vector<Param*> out;
  for (Param* p : params())
    if (p->expert) out.push_back(p);
  return out;
}

std::vector<Param*> GPTModel::mtp_params() {
  std::vector<Param*> out;
  for (auto& m : mtp)
    for (Param* p : m->params()) out.push_back(p);
  return out;
}

std::vector<MoELayer*> GPTModel::moe_layers() {
  std::vector<MoELayer*> out;
  for (auto& l : layers)
    if (l->moe) out.push_back(l->moe.get());
  for (auto& m : mtp)
    if (m->layer.moe) out.push_back(m->layer.moe.get());
  return out;
}

void GPTModel::zero_grad() {
  for (Param* p : params()) p->grad.zero();
}

void GPTModel::init_weights(std::uint64_t seed) {
  for (Param* p : {&embedding, &output_layer}) {
    if (p->master.numel() == 0) continue;
    p->master.copy_from(random_normal(p->master.shape(), DType::F32, seed, stream_of(p->name), spec_.init_std));
    p->refresh();
  }
  if (final_layernorm.master.numel() > 0) final_layernorm.master.fill(norm_init(spec_.zero_centered_gamma));
  for (auto& l : layers) l->init_weights(seed);
  for (auto& m : mtp) m->init_weights(seed);
}

bool GPTModel::has_full_recompute() const {
  return std::any_of(checkpoint_end_.begin(), checkpoint_end_.end(), [](int e) { return e >= 0; });
}

void GPTModel::record_router(int i, Context& ctx) {
  const auto u = static_cast<std::size_t>(i);
  const TransformerLayer::Context& c = *ctx.layers[u];
  for (AuxLoss k : kAuxLosses) at(ctx.aux_losses, k) += at(c.aux_losses, k);
  ctx.z_loss += c.z_loss;
  ctx.router_replay[u] = c.router_replay;
}

Tensor GPTModel::layer_output(int i, Context& ctx) {
  if (const int k = i - num_local_layers(); k >= 0) {  // an MTP layer's (scheduled_layer)
    Tensor y = depth_[static_cast<std::size_t>(k)]->layer.forward_output(ctx.mtp[static_cast<std::size_t>(k)].layer);
    record_mtp_router(static_cast<std::size_t>(k), ctx);
    return y;
  }
  Tensor y = layers[static_cast<std::size_t>(i)]->forward_output(*ctx.layers[static_cast<std::size_t>(i)]);
  record_router(i, ctx);
  return y;
}

void GPTModel::record_mtp_router(std::size_t k, Context& ctx) {
  const TransformerLayer::Context& layer = ctx.mtp[k].layer;
  for (AuxLoss a : kAuxLosses) at(ctx.aux_losses, a) += at(layer.aux_losses, a);
  ctx.z_loss += layer.z_loss;
}

Tensor GPTModel::run_layer(int i, const Tensor& x, Context& ctx, bool recompute) {
  const auto u = static_cast<std::size_t>(i);
  ctx.layers[u] = std::make_unique<TransformerLayer::Context>();
  if (!recompute) params_needed(layer_grad_group(i));
  trace::Scope scope(trace::Track::compute, recompute ? "recompute layer" : "layer forward", global_layer(i));
  Tensor y = layers[u]->forward(x, *ctx.layers[u], recompute ? &ctx.router_replay[u] : nullptr);
  if (!recompute) record_router(i, ctx);  // a recompute neither counts its losses nor draws anew
  return y;
}

void GPTModel::begin(const Tensor& tokens, const Tensor& targets, Context& ctx) {
  const std::int64_t T = tokens.numel();
  if (T != spec_.seq_length * spec_.micro_batch || targets.numel() != T)
    throw std::invalid_argument(fmt::format("model: {} tokens, expected seq_length x micro_batch = {}", T,
                                            spec_.seq_length * spec_.micro_batch));
  const auto L = static_cast<std::size_t>(num_local_layers());
  ctx.tokens = tokens;
  ctx.targets = targets;
  ctx.layers.clear();
  ctx.layers.resize(L);
  ctx.checkpoint_input.assign(L, Tensor());
  ctx.router_replay.assign(L, RouterReplay{});
  ctx.aux_losses = {};
  ctx.z_loss = 0;
  const auto D = mtp_depths();
  for (auto* v : {&ctx.mtp_tokens, &ctx.mtp_out, &ctx.mtp_logits, &ctx.mtp_lse, &ctx.mtp_demb}) v->assign(D, Tensor());
  ctx.mtp.clear();
  ctx.mtp.resize(D);
  ctx.mtp_losses.assign(D, 0.0);
  ctx.mtp_in_schedule = false;
}

Tensor GPTModel::embedding_rows(const Tensor& tokens) const {
  const std::int64_t T = tokens.numel(), H = spec_.hidden, V = spec_.vocab;
  Tensor x = Tensor::uninitialized({T, H}, spec_.dtype);
  const std::int64_t* tok = tokens.data<std::int64_t>();
  const auto* table = static_cast<const std::byte*>(embedding.compute.raw());
  const std::size_t row = static_cast<std::size_t>(H) * dtype_size(spec_.dtype);
  for (std::int64_t t = 0; t < T; ++t) {
    if (tok[t] < 0 || tok[t] >= V)
      throw std::invalid_argument(fmt::format("model: token {} is outside the vocabulary [0, {})", tok[t], V));
    std::copy_n(table + static_cast<std::size_t>(tok[t]) * row, row, static_cast<std::byte*>(x.raw()) + static_cast<std::size_t>(t) * row);
  }
  return x;
}

Tensor GPTModel::embed(const Tensor& tokens, const Tensor& targets, Context& ctx) {
  begin(tokens, targets, ctx);
  params_needed(embedding_grad_group());
  trace::Scope scope(trace::Track::compute, "embedding forward");
  return embedding_rows(tokens);
}

double GPTModel::forward(const Tensor& tokens, const Tensor& targets, Context& ctx) {
  return head_forward(forward_layers(embed(tokens, targets, ctx), ctx), ctx);
}

Tensor GPTModel::forward_layers(Tensor x, Context& ctx) {
  for (int i = 0; i < num_local_layers();) {
    const int end = checkpoint_end_[static_cast<std::size_t>(i)];
    if (end < 0) {
      x = run_layer(i, x, ctx, false);
      ++i;
      continue;
    }
    ctx.checkpoint_input[static_cast<std::size_t>(i)] = x;  // all a full-recompute run keeps
    for (; i < end; ++i) {
      x = run_layer(i, x, ctx, false);
      ctx.layers[static_cast<std::size_t>(i)].reset();
    }
  }
  return x;
}

void GPTModel::final_norm(const Tensor& x, Context& ctx) {
  ctx.final_in = x;
  ctx.final_out = Tensor::uninitialized(x.shape(), x.dtype());
  ctx.final_rstd = Tensor::uninitialized({x.dim(0)}, DType::F32);
  rmsnorm_forward(x, norm_gain(final_layernorm, spec_.zero_centered_gamma), spec_.eps, ctx.final_out, ctx.final_rstd);
}

double GPTModel::head_forward(const Tensor& x, Context& ctx) {
  params_needed(0);
  if (spec_.tie_embeddings) params_needed(embedding_grad_group());
  trace::Scope scope(trace::Track::compute, "lm head + loss forward");
  const std::int64_t T = ctx.tokens.numel(), V = spec_.vocab;
  if (chunk_.mtp_before) {  // x: the MTP stage's [final norm's output; each depth's]
    std::vector<Tensor> blocks = blocks_of(x, T, 1 + mtp_depths());
    ctx.final_out = std::move(blocks.front());
    std::move(blocks.begin() + 1, blocks.end(), ctx.mtp_out.begin());
  } else if (ctx.mtp_in_schedule) {  // x: the last MTP layer's transformer output; the final norm ran before the first
    ctx.mtp_out.back() = depth_.back()->forward_out(x, ctx.mtp.back());
  } else {
    final_norm(x, ctx);
    if (runs_mtp()) mtp_layers_forward(ctx);
  }
  ctx.logits = Tensor::uninitialized({T, V}, DType::F32);
  gemm(mat(ctx.final_out), Trans::N, mat(lm_head().compute), Trans::T, mat_mut(ctx.logits));
  ctx.lse = Tensor::uninitialized({T}, DType::F32);
  ctx.loss = cross_entropy_forward(ctx.logits, ctx.targets, ctx.lse);
  if (mtp_depths() > 0) mtp_losses_forward(ctx);
  return ctx.loss;
}

void GPTModel::mtp_layers_forward(Context& ctx) {  // (the callers needed group 0 for the final norm)
  params_needed(embedding_grad_group());  // the rolled tokens' rows
  trace::Scope scope(trace::Track::compute, "mtp forward");
  const std::int64_t T = ctx.tokens.numel();
  for (std::size_t k = 0; k < depth_.size(); ++k) {
    ctx.mtp_tokens[k] = rolled(ctx.tokens, mtp_shift(k, T), T);
    const Tensor& h = k == 0 ? ctx.final_out : ctx.mtp_out[k - 1];
    ctx.mtp_out[k] = depth_[k]->forward(h, embedding_rows(ctx.mtp_tokens[k]), ctx.mtp[k]);
    record_mtp_router(k, ctx);
    depth_[k]->checkpoint(ctx.mtp[k]);
  }
}

void GPTModel::mtp_losses_forward(Context& ctx) {
  trace::Scope scope(trace::Track::compute, "mtp loss forward");
  const std::int64_t T = ctx.tokens.numel(), V = spec_.vocab;
  for (std::size_t k = 0; k < mtp_depths(); ++k) {
    const std::int64_t shift = mtp_shift(k, T), R = T - shift;
    if (R <= 0) continue;  // no target this deep in the sequence: a loss of 0, as Megatron's clamped count
    ctx.mtp_logits[k] = Tensor::uninitialized({R, V}, DType::F32);
    gemm(mat(ctx.mtp_out[k], 0, R), Trans::N, mat(lm_head().compute), Trans::T, mat_mut(ctx.mtp_logits[k]));
    ctx.mtp_lse[k] = Tensor::uninitialized({R}, DType::F32);
    ctx.mtp_losses[k] = cross_entropy_forward(ctx.mtp_logits[k], rolled(ctx.targets, shift, R), ctx.mtp_lse[k]);
  }
}

void GPTModel::mtp_head_backward(Context& ctx, float dloss) {
  trace::Scope scope(trace::Track::compute, "mtp head backward");
  const std::int64_t T = ctx.tokens.numel(), H = spec_.hidden;
  ctx.mtp_dout.assign(mtp_depths(), Tensor());
  for (std::size_t k = mtp_depths(); k-- > 0;) {
    const std::int64_t shift = mtp_shift(k, T), R = T - shift;
    Tensor& dout = ctx.mtp_dout[k] = Tensor({T, H}, spec_.dtype);  // zero past the positions with a target
    if (R > 0) {
      Tensor dlogits32 = Tensor::uninitialized(ctx.mtp_logits[k].shape(), DType::F32);
      cross_entropy_backward(ctx.mtp_logits[k], rolled(ctx.targets, shift, R), ctx.mtp_lse[k],
                             static_cast<float>(dloss * spec_.mtp_loss_scale), dlogits32);
      ctx.mtp_logits[k] = ctx.mtp_lse[k] = Tensor();
      const Tensor dlogits = dlogits32.to(spec_.dtype);
      gemm(mat(dlogits), Trans::N, mat(lm_head().compute), Trans::N, mat_mut(dout, 0, R));
      if (!spec_.mtp_detached)  // mtp_detach_heads: the output weight is a constant to the MTP losses
        gemm(mat(dlogits), Trans::T, mat(ctx.mtp_out[k], 0, R), Trans::N, mat_mut(lm_head().grad), true);
    }
    ctx.mtp_out[k] = Tensor();
  }
}

Tensor GPTModel::mtp_backward(Context& ctx) {
  trace::Scope scope(trace::Track::compute, "mtp backward");
  Tensor carry;  // the next depth's gradient of this depth's output
  for (std::size_t k = depth_.size(); k-- > 0;) {
    Tensor& dout = ctx.mtp_dout[k];
    if (carry.defined()) add(dout, carry, dout);
    auto [dh, demb] = depth_[k]->backward(ctx.mtp[k], dout);
    dout = Tensor();
    carry = std::move(dh);
    if (!spec_.mtp_detached) ctx.mtp_demb[k] = std::move(demb);  // (detached: the embedding's a constant)
  }
  return carry;
}

Tensor GPTModel::head_backward(Context& ctx, float dloss, bool schedule_mtp) {
  trace::Scope scope(trace::Track::compute, "lm head + loss backward");
  const std::int64_t T = ctx.tokens.numel(), H = spec_.hidden;
  Tensor dlogits32 = Tensor::uninitialized(ctx.logits.shape(), DType::F32);
  cross_entropy_backward(ctx.logits, ctx.targets, ctx.lse, dloss, dlogits32);
  ctx.logits = ctx.lse = Tensor();
  const Tensor dlogits = dlogits32.to(spec_.dtype);
  dlogits32 = Tensor();
  Tensor dn = Tensor::uninitialized({T, H}, spec_.dtype);
  gemm(mat(dlogits), Trans::N, mat(lm_head().compute), Trans::N, mat_mut(dn));
  gemm(mat(dlogits), Trans::T, mat(ctx.final_out), Trans::N, mat_mut(lm_head().grad), true);
  if (mtp_depths() > 0) mtp_head_backward(ctx, dloss);
  if (chunk_.mtp_before) {  // the gradient of the MTP stage's output, in its order
    std::vector<const Tensor*> parts{&dn};
    for (const Tensor& d : ctx.mtp_dout) parts.push_back(&d);
    Tensor dy = concatenated(parts);
    ctx.mtp_dout.clear();
    ctx.final_out = Tensor();
    grads_ready(0);
    return dy;
  }
  if (!depth_.empty()) {
    if (schedule_mtp) {  // the schedule runs the MTP layers; the gradient of the last one's output
      ctx.mtp_dn = std::move(dn);
      Tensor dy = depth_.back()->backward_out(ctx.mtp.back(), ctx.mtp_dout.back());
      ctx.mtp_dout.back() = Tensor();
      return dy;
    }
    add_mtp_hidden_grad(dn, mtp_backward(ctx));
  }
  Tensor dx = final_norm_backward(ctx, dn);
  grads_ready(0);
  return dx;
}

Tensor GPTModel::mtp_stage_forward(Tensor x, Context& ctx) {
  if (ctx.mtp_in_schedule) {
    ctx.mtp_out.back() = depth_.back()->forward_out(std::move(x), ctx.mtp.back());
  } else {
    params_needed(0);
    final_norm(x, ctx);
    mtp_layers_forward(ctx);
  }
  trace::Scope scope(trace::Track::compute, "mtp stage output");
  std::vector<const Tensor*> parts{&ctx.final_out};
  for (const Tensor& h : ctx.mtp_out) parts.push_back(&h);
  Tensor y = concatenated(parts);
  ctx.final_out = Tensor();
  ctx.mtp_out.assign(depth_.size(), Tensor());
  return y;
}

Tensor GPTModel::mtp_stage_backward(Context& ctx, const Tensor& dy, bool schedule_mtp) {
  trace::Scope scope(trace::Track::compute, "mtp stage backward");
  const std::int64_t T = ctx.tokens.numel();
  std::vector<Tensor> blocks = blocks_of(dy, T, 1 + depth_.size());
  Tensor dn = std::move(blocks.front());
  ctx.mtp_dout.assign(std::make_move_iterator(blocks.begin() + 1), std::make_move_iterator(blocks.end()));
  if (schedule_mtp) {  // as head_backward's
    ctx.mtp_dn = std::move(dn);
    Tensor d = depth_.back()->backward_out(ctx.mtp.back(), ctx.mtp_dout.back());
    ctx.mtp_dout.back() = Tensor();
    return d;
  }
  add_mtp_hidden_grad(dn, mtp_backward(ctx));
  Tensor dx = final_norm_backward(ctx, dn);
  grads_ready(0);
  return dx;
}

void GPTModel::add_mtp_hidden_grad(Tensor& dn, const Tensor& dh) const {
  if (!spec_.mtp_detached) add(dn, dh, dn);
}

Tensor GPTModel::final_norm_backward(Context& ctx, const Tensor& dn) {
  if (embedding_copy() && !depth_.empty()) {  // the rolled tokens' rows, into the copy (embed_backward's at PP 1)
    if (!spec_.mtp_detached)
      for (std::size_t k = 0; k < depth_.size(); ++k) add_embedding_grad(ctx.mtp_tokens[k], ctx.mtp_demb[k]);
    ctx.mtp_tokens.clear();
    ctx.mtp_demb.clear();
  }
  Tensor dx = Tensor::uninitialized(dn.shape(), spec_.dtype);
  rmsnorm_dgrad(ctx.final_in, norm_gain(final_layernorm, spec_.zero_centered_gamma), ctx.final_rstd, dn, dx);
  rmsnorm_wgrad(ctx.final_in, ctx.final_rstd, dn, final_layernorm.grad);
  ctx.final_in = ctx.final_out = ctx.final_rstd = Tensor();
  return dx;
}

TransformerLayer& GPTModel::scheduled_layer(int i) {
  const int L = num_local_layers();
  return i < L ? *layers[static_cast<std::size_t>(i)] : depth_[static_cast<std::size_t>(i - L)]->layer;
}

TransformerLayer::Context* GPTModel::scheduled_context(int i, Context& ctx, bool fresh) {
  const int L = num_local_layers();
  if (i >= L) {
    TransformerLayer::Context& c = ctx.mtp[static_cast<std::size_t>(i - L)].layer;
    if (fresh) c = TransformerLayer::Context{};
    return &c;
  }
  auto& c = ctx.layers[static_cast<std::size_t>(i)];
  if (fresh) c = std::make_unique<TransformerLayer::Context>();
  return c.get();
}

void GPTModel::release_scheduled(int i, Context& ctx) {
  const int L = num_local_layers();
  if (i >= L)
    ctx.mtp[static_cast<std::size_t>(i - L)].layer = TransformerLayer::Context{};
  else
    ctx.layers[static_cast<std::size_t>(i)].reset();
}

Tensor GPTModel::scheduled_input(int i, Tensor x, Context& ctx) {
  const int L = num_local_layers();
  if (i < L) return x;
  const auto k = static_cast<std::size_t>(i - L);
  trace::Scope scope(trace::Track::compute, "mtp input", global_layer(i));
  params_needed(0);
  params_needed(embedding_grad_group());  // the rolled tokens' rows
  if (k == 0)
    final_norm(x, ctx);
  else
    ctx.mtp_out[k - 1] = depth_[k - 1]->forward_out(std::move(x), ctx.mtp[k - 1]);
  ctx.mtp_in_schedule = true;
  const std::int64_t T = ctx.tokens.numel();
  ctx.mtp_tokens[k] = rolled(ctx.tokens, mtp_shift(k, T), T);
  return depth_[k]->forward_in(k == 0 ? ctx.final_out : ctx.mtp_out[k - 1], embedding_rows(ctx.mtp_tokens[k]), ctx.mtp[k]);
}

Tensor GPTModel::scheduled_input_backward(int i, Tensor dx, Context& ctx) {
  const int L = num_local_layers();
  if (i < L) return dx;
  const auto k = static_cast<std::size_t>(i - L);
  trace::Scope scope(trace::Track::compute, "mtp input backward", global_layer(i));
  auto [dh, demb] = depth_[k]->backward_in(ctx.mtp[k], dx);
  if (!spec_.mtp_detached) ctx.mtp_demb[k] = std::move(demb);
  if (k > 0) {  // the previous depth's output, as mtp_backward's carry
    Tensor& dout = ctx.mtp_dout[k - 1];
    add(dout, dh, dout);
    Tensor dy = depth_[k - 1]->backward_out(ctx.mtp[k - 1], dout);
    dout = Tensor();
    return dy;
  }
  add_mtp_hidden_grad(ctx.mtp_dn, dh);  // as head_backward's, then its final norm's backward
  ctx.mtp_dout.clear();
  const Tensor dn = std::move(ctx.mtp_dn);
  return final_norm_backward(ctx, dn);
}

void GPTModel::backward(Context& ctx, float dloss) {
  embed_backward(ctx, backward_layers(ctx, head_backward(ctx, dloss)));
}

Tensor GPTModel::backward_layers(Context& ctx, Tensor dx) {
  // Layers last to first; a checkpointed run is recomputed from its input first.
  const int L = num_local_layers();
  std::vector<int> start_of(static_cast<std::size_t>(L), -1);
  for (int i = 0; i < L; ++i)
    if (checkpoint_end_[static_cast<std::size_t>(i)] >= 0) start_of[static_cast<std::size_t>(checkpoint_end_[static_cast<std::size_t>(i)] - 1)] = i;
  for (int i = L - 1; i >= 0; --i) {
    const int first = start_of[static_cast<std::size_t>(i)];
    if (first >= 0) {
      Tensor x = ctx.checkpoint_input[static_cast<std::size_t>(first)];
      ctx.checkpoint_input[static_cast<std::size_t>(first)] = Tensor();
      for (int j = first; j <= i; ++j) x = run_layer(j, x, ctx, true);
    }
    auto& c = ctx.layers[static_cast<std::size_t>(i)];
    trace::Scope scope(trace::Track::compute, "layer backward", global_layer(i));
    dx = layers[static_cast<std::size_t>(i)]->backward_dgrad(*c, dx);
    layers[static_cast<std::size_t>(i)]->backward_wgrad(*c);
    c.reset();
    grads_ready(layer_grad_group(i));
  }
  return dx;
}

void GPTModel::embed_backward(Context& ctx, const Tensor& dx) {
  trace::Scope scope(trace::Track::compute, "embedding backward");
  Tensor tokens = ctx.tokens, rows = dx;
  if (!depth_.empty() && !spec_.mtp_detached) {  // the input's rows, then each MTP depth's rolled tokens' rows
    const std::int64_t T = ctx.tokens.numel(), H = spec_.hidden, D = static_cast<std::int64_t>(depth_.size());
    const std::size_t row = static_cast<std::size_t>(H) * dtype_size(spec_.dtype);
    tokens = Tensor::uninitialized({T * (1 + D)}, DType::I64);
    rows = Tensor::uninitialized({T * (1 + D), H}, spec_.dtype);
    for (std::int64_t k = 0; k <= D; ++k) {
      const Tensor& ids = k == 0 ? ctx.tokens : ctx.mtp_tokens[static_cast<std::size_t>(k - 1)];
      const Tensor& d = k == 0 ? dx : ctx.mtp_demb[static_cast<std::size_t>(k - 1)];
      std::copy_n(ids.data<std::int64_t>(), T, tokens.data<std::int64_t>() + k * T);
      std::copy_n(static_cast<const std::byte*>(d.raw()), static_cast<std::size_t>(T) * row,
                  static_cast<std::byte*>(rows.raw()) + static_cast<std::size_t>(k * T) * row);
    }
  }
  ctx.mtp_tokens.clear();
  ctx.mtp_demb.clear();
  if (!embedding_rows_hook_ || !embedding_rows_hook_(tokens, rows)) add_embedding_grad(tokens, rows);
  grads_ready(embedding_grad_group());
}

void GPTModel::add_embedding_grad(const Tensor& tokens, const Tensor& rows) {
  const std::int64_t T = tokens.numel(), H = spec_.hidden;
  const std::int64_t* tok = tokens.data<std::int64_t>();
  float* g = embedding.grad.data<float>();
  const Tensor rows32 = rows.to(DType::F32);
  const float* d = rows32.data<float>();
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < H; ++j) g[tok[t] * H + j] += d[t * H + j];
}

}  // namespace epx
