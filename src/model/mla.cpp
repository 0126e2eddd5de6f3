// Multi-latent attention's projections (Megatron-Core's MLASelfAttention, unfused, TP = CP = 1):
//   q = linear_q_proj(x), or linear_q_up_proj(q_layernorm(linear_q_down_proj(x)));
//   [kv latent | k_pe] = linear_kv_down_proj(x);  [k_nope | v] per head = linear_kv_up_proj(kv_layernorm(latent));
//   query = [q_nope | RoPE(q_pe)], key = [k_nope | RoPE(k_pe)] (one k_pe for every head), value v.
// RoPE follows apply_rotary_pos_emb with mla_rotary_interleaved: the pe channels are de-interleaved
// (even ones, then odd ones) and then rotated by halves. The GEMMs write FP32; the latents are
// normalised in FP32 and rounded once to the compute dtype, the up projections' input.
#include <algorithm>
#include <vector>

#include "epx/kernels/kernels.hpp"
#include "epx/model/attention.hpp"
#include "epx/model/norm_gain.hpp"
#include "epx/model/rope.hpp"

namespace epx {
namespace {

// t[0::2] then t[1::2] (Megatron's MLA de-interleave), and back.
void deinterleave(const float* in, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n / 2; ++i) {
    out[i] = in[2 * i];
    out[n / 2 + i] = in[2 * i + 1];
  }
}
void interleave(const float* in, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n / 2; ++i) {
    out[2 * i] = in[i];
    out[2 * i + 1] = in[n / 2 + i];
  }
}

// x [T, in] times weight [out, in]^T into a new FP32 [T, out].
Tensor project(const Tensor& x, const Param& weight) {
  Tensor y = Tensor::uninitialized({x.dim(0), weight.compute.dim(0)}, DType::F32);
  gemm(mat(x), Trans::N, mat(weight.compute), Trans::T, mat_mut(y));
  return y;
}

// The latent [T, n] F32 through its RMSNorm where the config has one (rstd saved), then rounded
// to the compute dtype.
Tensor normalise(const Tensor& latent, const Param& gamma, bool norm, bool zero_centered, float eps, Tensor& rstd,
                 DType dtype) {
  if (!norm) return latent.to(dtype);
  Tensor y = Tensor::uninitialized(latent.shape(), DType::F32);
  rstd = Tensor::uninitialized({latent.dim(0)}, DType::F32);
  rmsnorm_forward(latent, norm_gain(gamma, zero_centered), eps, y, rstd);
  return y.to(dtype);
}

// The latent's gradient from its normalised form's (dy F32): through the norm (its weight's
// gradient accumulated) where the config has one.
Tensor denormalise(const Tensor& latent, Param& gamma, bool norm, bool zero_centered, const Tensor& rstd,
                   const Tensor& dy) {
  if (!norm) return dy;
  Tensor dx = Tensor::uninitialized(dy.shape(), DType::F32);
  rmsnorm_dgrad(latent, norm_gain(gamma, zero_centered), rstd, dy, dx);
  rmsnorm_wgrad(latent, rstd, dy, gamma.grad);
  return dx;
}

}  // namespace

void SelfAttention::mla_forward(const Tensor& x, std::int64_t seq, Context& ctx) const {
  const MlaSpec& m = *spec_.mla;
  const std::int64_t T = x.dim(0), pe = m.pe_dim, kvl = m.kv_lora_rank;

  // The down projections: the q latent (where there is one), the kv latent and the raw k_pe.
  if (m.q_lora_rank > 0) ctx.q_raw = project(x, linear_q_down_proj);
  const Tensor down = project(x, linear_kv_down_proj);  // [T, kv latent | k_pe]
  ctx.k_raw = Tensor::uninitialized({T, kvl}, DType::F32);
  ctx.k_pe = Tensor::uninitialized({T, pe}, DType::F32);
  for (std::int64_t t = 0; t < T; ++t) {
    std::copy_n(down.data<float>() + t * (kvl + pe), kvl, ctx.k_raw.data<float>() + t * kvl);
    std::copy_n(down.data<float>() + t * (kvl + pe) + kvl, pe, ctx.k_pe.data<float>() + t * pe);
  }
  mla_up(seq, ctx, true);
  if (!spec_.qk_norm) ctx.q_raw = ctx.k_raw = Tensor();  // only the norms' backward reads them
}

void SelfAttention::mla_up(std::int64_t seq, Context& ctx, bool normalise_latents) const {
  const MlaSpec& m = *spec_.mla;
  const std::int64_t T = ctx.x.dim(0), S = seq, B = T / seq, nh = spec_.heads, d = spec_.head_dim, dv = m.v_head_dim;
  const std::int64_t nope = m.qk_head_dim, pe = m.pe_dim, kv_width = nope + dv;
  const bool q_latent = m.q_lora_rank > 0;

  // The latents' norms (where asked), then the up projections.
  if (normalise_latents) {
    if (q_latent)
      ctx.q_latent =
          normalise(ctx.q_raw, q_layernorm, spec_.qk_norm, spec_.zero_centered_gamma, spec_.eps, ctx.q_rstd, spec_.dtype);
    ctx.kv_latent =
        normalise(ctx.k_raw, kv_layernorm, spec_.qk_norm, spec_.zero_centered_gamma, spec_.eps, ctx.k_rstd, spec_.dtype);
  }
  const Tensor q = project(q_latent ? ctx.q_latent : ctx.x, linear_q_up_proj);  // [T, heads * d]
  const Tensor kv = project(ctx.kv_latent, linear_kv_up_proj);                 // [T, heads * (nope + v)]

  ctx.q = Tensor::uninitialized({B, nh, S, d}, DType::F32);
  ctx.k = Tensor::uninitialized({B, nh, S, d}, DType::F32);
  ctx.v = Tensor::uninitialized({B, nh, S, dv}, DType::F32);
  const RopeTable& rope = rope_table(S, rope_spec());
  // One position's pe channels: de-interleaved, then rotated.
  const auto place_pe = [&](const float* in, float* out, std::int64_t s, float* scratch) {
    deinterleave(in, scratch, pe);
    rope.rotate(scratch, out, pe, s, false);
  };
#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<std::size_t>(pe)), k_pe(static_cast<std::size_t>(pe));
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t s = t / B, b = t % B;
      place_pe(ctx.k_pe.data<float>() + t * pe, k_pe.data(), s, scratch.data());
      for (std::int64_t h = 0; h < nh; ++h) {
        const std::int64_t row = (b * nh + h) * S + s;
        const float* qh = q.data<float>() + (t * nh + h) * d;
        const float* kvh = kv.data<float>() + (t * nh + h) * kv_width;
        float* qd = ctx.q.data<float>() + row * d;
        float* kd = ctx.k.data<float>() + row * d;
        std::copy_n(qh, nope, qd);
        place_pe(qh + nope, qd + nope, s, scratch.data());
        std::copy_n(kvh, nope, kd);
        std::copy_n(k_pe.data(), pe, kd + nope);
        std::copy_n(kvh + nope, dv, ctx.v.data<float>() + row * dv);
      }
    }
  }
}

void SelfAttention::mla_release_up(Context& ctx) const {
  if (!spec_.recompute_up_proj) {
    ctx.k_pe = Tensor();
    return;
  }
  ctx.q = ctx.k = ctx.v = Tensor();
  // With the norms, the up projections' inputs are recomputed from the raw latents (as TE's
  // layernorm-linear reruns whole inside Megatron's checkpoint); without, they are the latents.
  if (spec_.qk_norm) ctx.q_latent = ctx.kv_latent = ctx.q_rstd = ctx.k_rstd = Tensor();
}

Tensor SelfAttention::mla_backward(Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv_heads) {
  const MlaSpec& m = *spec_.mla;
  const std::int64_t S = ctx.seq, B = ctx.batch, T = S * B, nh = spec_.heads, d = spec_.head_dim, dv = m.v_head_dim;
  const std::int64_t nope = m.qk_head_dim, pe = m.pe_dim, kvl = m.kv_lora_rank, kv_width = nope + dv;
  const bool q_latent = m.q_lora_rank > 0;

  // Back into the up projections' outputs, and k_pe's gradient summed over the heads in order.
  Tensor dq_up = Tensor::uninitialized({T, nh * d}, DType::F32), dkv_up = Tensor::uninitialized({T, nh * kv_width}, DType::F32);
  Tensor d_down = Tensor::uninitialized({T, kvl + pe}, DType::F32);  // [latent | k_pe]; the latent's filled below
  const RopeTable& rope = rope_table(S, rope_spec());
  const auto unplace_pe = [&](const float* g, float* out, std::int64_t s, float* scratch) {
    rope.rotate(g, scratch, pe, s, true);
    interleave(scratch, out, pe);
  };
#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<std::size_t>(pe)), k_pe(static_cast<std::size_t>(pe));
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t s = t / B, b = t % B;
      std::fill(k_pe.begin(), k_pe.end(), 0.f);
      for (std::int64_t h = 0; h < nh; ++h) {
        const std::int64_t row = (b * nh + h) * S + s;
        const float* gq = dq.data<float>() + row * d;
        const float* gk = dk.data<float>() + row * d;
        float* qh = dq_up.data<float>() + (t * nh + h) * d;
        float* kvh = dkv_up.data<float>() + (t * nh + h) * kv_width;
        std::copy_n(gq, nope, qh);
        unplace_pe(gq + nope, qh + nope, s, scratch.data());
        std::copy_n(gk, nope, kvh);
        for (std::int64_t i = 0; i < pe; ++i) k_pe[static_cast<std::size_t>(i)] += gk[nope + i];
        std::copy_n(dv_heads.data<float>() + row * dv, dv, kvh + nope);
      }
      unplace_pe(k_pe.data(), d_down.data<float>() + t * (kvl + pe) + kvl, s, scratch.data());
    }
  }

  // kv: the up projection's dgrad, the latent's norm, then the down projection's.
  ctx.dkv_up = dkv_up.to(spec_.dtype);
  Tensor d_latent = Tensor::uninitialized({T, kvl}, DType::F32);
  gemm(mat(ctx.dkv_up), Trans::N, mat(linear_kv_up_proj.compute), Trans::N, mat_mut(d_latent));
  d_latent = denormalise(ctx.k_raw, kv_layernorm, spec_.qk_norm, spec_.zero_centered_gamma, ctx.k_rstd, d_latent);
  for (std::int64_t t = 0; t < T; ++t) std::copy_n(d_latent.data<float>() + t * kvl, kvl, d_down.data<float>() + t * (kvl + pe));
  ctx.dkv_down = d_down.to(spec_.dtype);
  Tensor dx = Tensor::uninitialized({T, spec_.hidden}, DType::F32);
  gemm(mat(ctx.dkv_down), Trans::N, mat(linear_kv_down_proj.compute), Trans::N, mat_mut(dx));

  // q: straight into x, or through its latent.
  ctx.dq_up = dq_up.to(spec_.dtype);
  if (q_latent) {
    Tensor d_q_latent = Tensor::uninitialized({T, m.q_lora_rank}, DType::F32);
    gemm(mat(ctx.dq_up), Trans::N, mat(linear_q_up_proj.compute), Trans::N, mat_mut(d_q_latent));
    ctx.dq_down =
        denormalise(ctx.q_raw, q_layernorm, spec_.qk_norm, spec_.zero_centered_gamma, ctx.q_rstd, d_q_latent).to(spec_.dtype);
    gemm(mat(ctx.dq_down), Trans::N, mat(linear_q_down_proj.compute), Trans::N, mat_mut(dx), true);
  } else {
    gemm(mat(ctx.dq_up), Trans::N, mat(linear_q_up_proj.compute), Trans::N, mat_mut(dx), true);
  }
  ctx.q_raw = ctx.k_raw = ctx.q_rstd = ctx.k_rstd = ctx.k_pe = Tensor();
  return dx.to(spec_.dtype);
}

void SelfAttention::mla_wgrad(Context& ctx) {
  const bool q_latent = spec_.mla->q_lora_rank > 0;
  gemm(mat(ctx.dq_up), Trans::T, mat(q_latent ? ctx.q_latent : ctx.x), Trans::N, mat_mut(linear_q_up_proj.grad), true);
  if (q_latent) gemm(mat(ctx.dq_down), Trans::T, mat(ctx.x), Trans::N, mat_mut(linear_q_down_proj.grad), true);
  gemm(mat(ctx.dkv_up), Trans::T, mat(ctx.kv_latent), Trans::N, mat_mut(linear_kv_up_proj.grad), true);
  gemm(mat(ctx.dkv_down), Trans::T, mat(ctx.x), Trans::N, mat_mut(linear_kv_down_proj.grad), true);
}

}  // namespace epx
