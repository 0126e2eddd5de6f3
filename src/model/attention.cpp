#include "epx/model/attention.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <type_traits>
#include <vector>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"
#include "epx/model/norm_gain.hpp"
#include "epx/model/rope.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {
namespace {

template <class E>
E as(float x) {
  if constexpr (std::is_same_v<E, float>) return x;
  else return float_to_bf16(x);
}
template <class E>
float to_float(E x) {
  if constexpr (std::is_same_v<E, float>) return x;
  else return bf16_to_float(x);
}
template <class E>
const E* at(const Tensor& t, std::int64_t offset) {
  return static_cast<const E*>(t.raw()) + offset;
}

// fn(task) for task in [0, n) over the OpenMP threads (one task per sequence and key/value group);
// the first exception is rethrown after the loop, since one must not leave an OpenMP region.
template <class F>
void for_each_group_task(std::int64_t n, F&& fn) {
  std::exception_ptr error;
#pragma omp parallel for schedule(static)
  for (std::int64_t task = 0; task < n; ++task) {
    try {
      fn(task);
    } catch (...) {
#pragma omp critical(epx_attention_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// MLA's parameters' shapes (empty without MLA, or where the config has none).
struct MlaShapes {
  Shape q_down{0}, q_up{0}, kv_down{0}, kv_up{0}, q_norm{0}, kv_norm{0};
};
MlaShapes mla_shapes(const AttentionSpec& s) {
  if (!s.mla) return {};
  const MlaSpec& m = *s.mla;
  const bool q_latent = m.q_lora_rank > 0;
  return {{m.q_lora_rank, q_latent ? s.hidden : 0},
          {s.heads * s.head_dim, q_latent ? m.q_lora_rank : s.hidden},
          {m.kv_lora_rank + m.pe_dim, s.hidden},
          {s.heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank},
          {s.qk_norm ? m.q_lora_rank : 0},
          {s.qk_norm ? m.kv_lora_rank : 0}};
}

}  // namespace

CausalAttentionMask SelfAttention::mask(std::int64_t head) const {
  static constexpr float kZero = 0.f;
  switch (spec_.softmax) {
    case AttentionSoftmax::vanilla: return {spec_.window, nullptr};
    case AttentionSoftmax::off_by_one: return {spec_.window, &kZero};
    case AttentionSoftmax::learnable: return {spec_.window, softmax_offset.compute.data<float>() + head};
  }
  throw std::logic_error("attention: unknown softmax type");
}

SelfAttention::SelfAttention(const std::string& prefix, const AttentionSpec& spec)
    : linear_qkv(prefix + ".linear_qkv.weight",
                 spec.mla ? Shape{0} : Shape{(spec.heads + 2 * spec.groups) * spec.head_dim, spec.hidden}, spec.dtype),
      linear_proj(prefix + ".linear_proj.weight", {spec.hidden, spec.heads * spec.value_dim()}, spec.dtype),
      q_layernorm(prefix + ".q_layernorm.weight", spec.mla ? mla_shapes(spec).q_norm : Shape{spec.head_dim}, DType::F32),
      k_layernorm(prefix + ".k_layernorm.weight", {spec.mla ? 0 : spec.head_dim}, DType::F32),
      linear_q_down_proj(prefix + ".linear_q_down_proj.weight", mla_shapes(spec).q_down, spec.dtype),
      linear_q_up_proj(prefix + (spec.mla && spec.mla->q_lora_rank == 0 ? ".linear_q_proj.weight" : ".linear_q_up_proj.weight"),
                       mla_shapes(spec).q_up, spec.dtype),
      linear_kv_down_proj(prefix + ".linear_kv_down_proj.weight", mla_shapes(spec).kv_down, spec.dtype),
      linear_kv_up_proj(prefix + ".linear_kv_up_proj.weight", mla_shapes(spec).kv_up, spec.dtype),
      kv_layernorm(prefix + ".kv_layernorm.weight", mla_shapes(spec).kv_norm, DType::F32),
      softmax_offset(prefix + ".core_attention.softmax_offset",
                     {spec.softmax == AttentionSoftmax::learnable ? spec.heads : 0}, DType::F32),
      linear_qkv_bias(prefix + ".linear_qkv.bias", {spec.qkv_bias ? (spec.heads + 2 * spec.groups) * spec.head_dim : 0},
                      spec.dtype),
      linear_proj_bias(prefix + ".linear_proj.bias", {spec.proj_bias ? spec.hidden : 0}, spec.dtype),
      spec_(spec) {
  linear_qkv_bias.bias = linear_proj_bias.bias = true;
  if (spec.heads % spec.groups != 0)
    throw std::invalid_argument(fmt::format("attention: {} heads do not divide into {} query groups", spec.heads, spec.groups));
  if (spec.window < -1) throw std::invalid_argument(fmt::format("attention: window {} is below -1 (none)", spec.window));
  if (spec.rope && (rope_dim() < 1 || (rope_dim() + 1) / 2 * 2 > spec.head_dim))
    throw std::invalid_argument(fmt::format("attention: RoPE at dim {} rotates {} of a head's {} channels", rope_dim(),
                                            (rope_dim() + 1) / 2 * 2, spec.head_dim));
  if (const auto& m = spec.mla;
      m && (spec.groups != spec.heads || spec.head_dim != m->qk_head_dim + m->pe_dim || m->pe_dim % 2 != 0 ||
            m->kv_lora_rank < 1 || m->v_head_dim < 1 || m->q_lora_rank < 0 || spec.qkv_bias || !spec.rope ||
            rope_dim() != m->pe_dim))
    throw std::invalid_argument(fmt::format("attention: MLA needs a key and value per head, head_dim = qk_head_dim + "
                                            "an even pe_dim that RoPE rotates whole, and no qkv bias (heads {}, groups "
                                            "{}, head_dim {}, pe_dim {})",
                                            spec.heads, spec.groups, spec.head_dim, m->pe_dim));
  for (Param* norm : {&q_layernorm, &k_layernorm, &kv_layernorm}) norm->master.fill(norm_init(spec.zero_centered_gamma));
}

std::vector<Param*> SelfAttention::params() {
  std::vector<Param*> out;
  if (spec_.mla) {
    if (spec_.mla->q_lora_rank > 0) out.push_back(&linear_q_down_proj);
    for (Param* p : {&linear_q_up_proj, &linear_kv_down_proj, &linear_kv_up_proj, &linear_proj}) out.push_back(p);
    if (spec_.qk_norm && spec_.mla->q_lora_rank > 0) out.push_back(&q_layernorm);
    if (spec_.qk_norm) out.push_back(&kv_layernorm);
  } else {
    out = {&linear_qkv, &linear_proj};
    if (spec_.qk_norm) {
      out.push_back(&q_layernorm);
      out.push_back(&k_layernorm);
    }
  }
  if (spec_.softmax == AttentionSoftmax::learnable) out.push_back(&softmax_offset);
  if (spec_.qkv_bias) out.push_back(&linear_qkv_bias);
  if (spec_.proj_bias) out.push_back(&linear_proj_bias);
  return out;
}

// linear_qkv, QK-norm and RoPE into ctx.q, ctx.k, ctx.v ([B, heads|groups, S, d] F32).
void SelfAttention::gqa_forward(const Tensor& x, std::int64_t seq, Context& ctx) const {
  const std::int64_t T = x.dim(0), nh = spec_.heads, ng = spec_.groups, d = spec_.head_dim;
  const std::int64_t S = seq, B = T / seq, width = (nh + 2 * ng) * d;
  Tensor qkv = Tensor::uninitialized({T, width}, DType::F32);
  gemm(mat(x), Trans::N, mat(linear_qkv.compute), Trans::T, mat_mut(qkv));
  if (spec_.qkv_bias) add_bias_rows(qkv, {0, T}, linear_qkv_bias.compute.to(DType::F32).data<float>(), nullptr);

  // Split per head, QK-norm, then RoPE into the [B, head, S, d] layout of the core attention.
  ctx.q_raw = Tensor::uninitialized({T * nh, d}, DType::F32);
  ctx.k_raw = Tensor::uninitialized({T * ng, d}, DType::F32);
  ctx.q = Tensor::uninitialized({B, nh, S, d}, DType::F32);
  ctx.k = Tensor::uninitialized({B, ng, S, d}, DType::F32);
  ctx.v = Tensor::uninitialized({B, ng, S, d}, DType::F32);
  const float* src = qkv.data<float>();
  float *qr = ctx.q_raw.data<float>(), *kr = ctx.k_raw.data<float>(), *v = ctx.v.data<float>();
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t s = t / B, b = t % B;
    std::copy_n(src + t * width, nh * d, qr + t * nh * d);
    std::copy_n(src + t * width + nh * d, ng * d, kr + t * ng * d);
    for (std::int64_t g = 0; g < ng; ++g)
      std::copy_n(src + t * width + (nh + ng + g) * d, d, v + ((b * ng + g) * S + s) * d);
  }
  Tensor qn = ctx.q_raw, kn = ctx.k_raw;
  if (spec_.qk_norm) {
    qn = Tensor::uninitialized(ctx.q_raw.shape(), DType::F32);
    kn = Tensor::uninitialized(ctx.k_raw.shape(), DType::F32);
    ctx.q_rstd = Tensor::uninitialized({T * nh}, DType::F32);
    ctx.k_rstd = Tensor::uninitialized({T * ng}, DType::F32);
    rmsnorm_forward(ctx.q_raw, norm_gain(q_layernorm, spec_.zero_centered_gamma), spec_.eps, qn, ctx.q_rstd);
    rmsnorm_forward(ctx.k_raw, norm_gain(k_layernorm, spec_.zero_centered_gamma), spec_.eps, kn, ctx.k_rstd);
  }
  const RopeTable* rope = spec_.rope ? &rope_table(S, rope_spec()) : nullptr;
  const auto place = [&](const Tensor& from, Tensor& to, std::int64_t heads) {
    const float* f = from.data<float>();
    float* o = to.data<float>();
#pragma omp parallel for schedule(static)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t s = t / B, b = t % B;
        float* dst = o + ((b * heads + h) * S + s) * d;
        if (rope) rope->rotate(f + (t * heads + h) * d, dst, d, s, false);
        else std::copy_n(f + (t * heads + h) * d, d, dst);
      }
  };
  place(qn, ctx.q, nh);
  place(kn, ctx.k, ng);
  if (!spec_.qk_norm) ctx.q_raw = ctx.k_raw = Tensor();  // only QK-norm's backward reads them
}

void SelfAttention::round_qkv(Context& ctx) const {
  if (spec_.dtype != DType::BF16) return;  // BF16 operands for the core attention's GEMMs, as flash attention
  ctx.q = ctx.q.to(DType::BF16);
  ctx.k = ctx.k.to(DType::BF16);
  ctx.v = ctx.v.to(DType::BF16);
}

Tensor SelfAttention::forward(const Tensor& x, std::int64_t seq, Context& ctx) const {
  const std::int64_t T = x.dim(0), nh = spec_.heads, ng = spec_.groups, d = spec_.head_dim, dv = spec_.value_dim();
  if (x.rank() != 2 || x.dim(1) != spec_.hidden || x.dtype() != spec_.dtype || seq < 1 || T % seq != 0)
    throw std::invalid_argument(fmt::format("attention: input {} {} is not [S * B, {}] {}", shape_string(x.shape()),
                                            dtype_name(x.dtype()), spec_.hidden, dtype_name(spec_.dtype)));
  const std::int64_t S = seq, B = T / seq;
  ctx.seq = S;
  ctx.batch = B;
  ctx.x = x;
  if (spec_.mla) mla_forward(x, S, ctx);
  else gqa_forward(x, S, ctx);
  round_qkv(ctx);

  // Each (sequence, key/value group) is one task; its query heads run in turn.
  const float scale = softmax_scale();
  Tensor o32 = Tensor::uninitialized({T, nh * dv}, DType::F32);
  ctx.lse = Tensor::uninitialized({B, nh, S}, DType::F32);
  with_operand_type(spec_.dtype, [&](auto tag) {
    using E = decltype(tag);
    for_each_group_task(B * ng, [&](std::int64_t task) {
      const std::int64_t b = task / ng, g = task % ng;
      std::vector<float> head_out(static_cast<std::size_t>(S * dv));
      for (std::int64_t h = g * (nh / ng); h < (g + 1) * (nh / ng); ++h) {
        causal_attention_forward(at<E>(ctx.q, (b * nh + h) * S * d), at<E>(ctx.k, (b * ng + g) * S * d),
                                 at<E>(ctx.v, (b * ng + g) * S * dv), S, d, dv, scale, head_out.data(),
                                 ctx.lse.data<float>() + (b * nh + h) * S, mask(h));
        for (std::int64_t s = 0; s < S; ++s)
          std::copy_n(head_out.data() + s * dv, dv, o32.data<float>() + (s * B + b) * nh * dv + h * dv);
      }
    });
  });
  ctx.o = o32.to(spec_.dtype);
  if (spec_.mla) mla_release_up(ctx);
  Tensor y = Tensor::uninitialized({T, spec_.hidden}, spec_.proj_bias ? DType::F32 : spec_.dtype);
  gemm(mat(ctx.o), Trans::N, mat(linear_proj.compute), Trans::T, mat_mut(y));
  if (!spec_.proj_bias) return y;
  add_bias_rows(y, {0, T}, linear_proj_bias.compute.to(DType::F32).data<float>(), nullptr);
  return y.to(spec_.dtype);
}

Tensor SelfAttention::backward_dgrad(Context& ctx, const Tensor& dy) {
  const std::int64_t S = ctx.seq, B = ctx.batch, T = S * B, nh = spec_.heads, ng = spec_.groups, d = spec_.head_dim;
  const std::int64_t dv = spec_.value_dim();
  if (dy.shape() != Shape{T, spec_.hidden} || dy.dtype() != spec_.dtype)
    throw std::invalid_argument("attention: output gradient shape or dtype mismatch");
  ctx.dy = dy;
  Tensor d_o = Tensor::uninitialized({T, nh * dv}, DType::F32);
  gemm(mat(dy), Trans::N, mat(linear_proj.compute), Trans::N, mat_mut(d_o));
  if (spec_.mla && spec_.recompute_up_proj) {  // mla_up_proj: q, k and v again from the latents
    mla_up(S, ctx, spec_.qk_norm);  // the normalised latents were dropped with the norms (mla_release_up)
    round_qkv(ctx);
  }

  const float scale = softmax_scale();
  Tensor dq = Tensor::uninitialized({B, nh, S, d}, DType::F32), dk({B, ng, S, d}, DType::F32),
         dval({B, ng, S, dv}, DType::F32);
  Tensor deltas = Tensor::uninitialized({B, nh, S}, DType::F32);
  with_operand_type(spec_.dtype, [&](auto tag) {
    using E = decltype(tag);
    for_each_group_task(B * ng, [&](std::int64_t task) {
      const std::int64_t b = task / ng, g = task % ng;
      std::vector<E> dout(static_cast<std::size_t>(S * dv));
      const E* o = at<E>(ctx.o, 0);
      const float* grad_o = d_o.data<float>();
      for (std::int64_t h = g * (nh / ng); h < (g + 1) * (nh / ng); ++h) {
        float* delta = deltas.data<float>() + (b * nh + h) * S;
        // This head's dO in the operand dtype, and delta = rowsum(dO * O) from that same dO and
        // the output as linear_proj saw it (so each row of dS sums to zero, as flash attention).
        for (std::int64_t s = 0; s < S; ++s) {
          const std::int64_t t = s * B + b;
          float sum = 0.f;
          for (std::int64_t j = 0; j < dv; ++j) {
            const E x = as<E>(grad_o[t * nh * dv + h * dv + j]);
            dout[static_cast<std::size_t>(s * dv + j)] = x;
            sum += to_float(x) * to_float(o[t * nh * dv + h * dv + j]);
          }
          delta[s] = sum;
        }
        const std::int64_t head = (b * nh + h) * S, group = (b * ng + g) * S;
        causal_attention_backward(at<E>(ctx.q, head * d), at<E>(ctx.k, group * d), at<E>(ctx.v, group * dv),
                                  ctx.lse.data<float>() + head, delta, dout.data(), S, d, dv, scale,
                                  dq.data<float>() + head * d, dk.data<float>() + group * d,
                                  dval.data<float>() + group * dv, mask(h));
      }
    });
  });
  // The learned sinks' gradients, summed over the sequences in order (the same bits on any thread count).
  if (spec_.softmax == AttentionSoftmax::learnable)
    for (std::int64_t h = 0; h < nh; ++h) {
      double g = 0;
      for (std::int64_t b = 0; b < B; ++b)
        g += attention_sink_grad(ctx.lse.data<float>() + (b * nh + h) * S, deltas.data<float>() + (b * nh + h) * S, S,
                                 softmax_offset.compute.data<float>()[h]);
      softmax_offset.grad.data<float>()[h] += static_cast<float>(g);
    }
  ctx.lse = ctx.q = ctx.k = ctx.v = Tensor();

  return spec_.mla ? mla_backward(ctx, dq, dk, dval) : gqa_backward(ctx, dq, dk, dval);
}

// Back through RoPE and QK-norm into dqkv [T, (heads + 2 groups) d], and through linear_qkv.
Tensor SelfAttention::gqa_backward(Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const std::int64_t S = ctx.seq, B = ctx.batch, T = S * B, nh = spec_.heads, ng = spec_.groups, d = spec_.head_dim;
  const std::int64_t width = (nh + 2 * ng) * d;
  const RopeTable* rope = spec_.rope ? &rope_table(S, rope_spec()) : nullptr;
  const auto unplace = [&](const Tensor& from, std::int64_t heads) {
    Tensor out = Tensor::uninitialized({T * heads, d}, DType::F32);
    const float* f = from.data<float>();
    float* o = out.data<float>();
#pragma omp parallel for schedule(static)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t s = t / B, b = t % B;
        const float* g = f + ((b * heads + h) * S + s) * d;
        if (rope) rope->rotate(g, o + (t * heads + h) * d, d, s, true);
        else std::copy_n(g, d, o + (t * heads + h) * d);
      }
    return out;
  };
  Tensor dqn = unplace(dq, nh), dkn = unplace(dk, ng);
  if (spec_.qk_norm) {
    Tensor dqr = Tensor::uninitialized(dqn.shape(), DType::F32), dkr = Tensor::uninitialized(dkn.shape(), DType::F32);
    rmsnorm_dgrad(ctx.q_raw, norm_gain(q_layernorm, spec_.zero_centered_gamma), ctx.q_rstd, dqn, dqr);
    rmsnorm_dgrad(ctx.k_raw, norm_gain(k_layernorm, spec_.zero_centered_gamma), ctx.k_rstd, dkn, dkr);
    rmsnorm_wgrad(ctx.q_raw, ctx.q_rstd, dqn, q_layernorm.grad);
    rmsnorm_wgrad(ctx.k_raw, ctx.k_rstd, dkn, k_layernorm.grad);
    dqn = dqr;
    dkn = dkr;
  }
  ctx.q_raw = ctx.k_raw = ctx.q_rstd = ctx.k_rstd = Tensor();
  Tensor dqkv32 = Tensor::uninitialized({T, width}, DType::F32);
  float* out = dqkv32.data<float>();
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t s = t / B, b = t % B;
    std::copy_n(dqn.data<float>() + t * nh * d, nh * d, out + t * width);
    std::copy_n(dkn.data<float>() + t * ng * d, ng * d, out + t * width + nh * d);
    for (std::int64_t g = 0; g < ng; ++g)
      std::copy_n(dv.data<float>() + ((b * ng + g) * S + s) * d, d, out + t * width + (nh + ng + g) * d);
  }
  ctx.dqkv = dqkv32.to(spec_.dtype);
  Tensor dx = Tensor::uninitialized({T, spec_.hidden}, spec_.dtype);
  gemm(mat(ctx.dqkv), Trans::N, mat(linear_qkv.compute), Trans::N, mat_mut(dx));
  return dx;
}

void SelfAttention::backward_wgrad(Context& ctx) {
  if (!ctx.dy.defined()) throw std::logic_error("attention: wgrad before dgrad");
  gemm(mat(ctx.dy), Trans::T, mat(ctx.o), Trans::N, mat_mut(linear_proj.grad), true);
  if (spec_.mla) {
    mla_wgrad(ctx);
  } else {
    gemm(mat(ctx.dqkv), Trans::T, mat(ctx.x), Trans::N, mat_mut(linear_qkv.grad), true);
    if (spec_.qkv_bias) add_row_sums(ctx.dqkv, {0, ctx.dqkv.dim(0)}, nullptr, linear_qkv_bias.grad.data<float>());
  }
  if (spec_.proj_bias) add_row_sums(ctx.dy, {0, ctx.dy.dim(0)}, nullptr, linear_proj_bias.grad.data<float>());
  ctx = Context{};
}

}  // namespace epx
