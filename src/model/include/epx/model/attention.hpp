// Causal self-attention with grouped-query attention, QK-norm and rotary embeddings (Megatron-Core's
// SelfAttention with TE's DotProductAttention, at TP = CP = 1):
//   qkv = x Wqkv^T, laid out [q heads | k groups | v groups] per token;
//   q, k = RoPE(RMSNorm_d(q)), RoPE(RMSNorm_d(k))   (per head over head_dim, one gamma each;
//       plain or YaRN RoPE, epx/model/rope.hpp);
//   o = softmax(q k^T / sqrt(d), causal) v, query head h reading group h / (heads / groups), in
//       query blocks that never hold S x S scores (causal_attention_forward, kernels.hpp); under a
//       sliding window a query sees itself and the `window` keys before it, and a softmax with a
//       sink (softmax_type off-by-one or learnable) counts one more logit per head with no value;
//   y = o Wproj^T (+ the biases of linear_qkv and linear_proj where the config has them, added to
//       the FP32 GEMM output before its one rounding).
// Linear layers run in the compute dtype with FP32 accumulation; so do the core attention's GEMMs
// (BF16 operands for a BF16 model, as flash attention), its softmax is FP32.
// Tokens are in Megatron's [S, B] order. dgrad and wgrad are separate calls.
// With multi-latent attention (DeepSeek's; MlaSpec, src/model/mla.cpp) the projections into q, k
// and v are MLA's and every head has its own key and value; the core attention and linear_proj
// are the same.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "epx/model/rope.hpp"
#include "epx/tensor/param.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

struct CausalAttentionMask;  // epx/kernels/kernels.hpp

// Megatron's softmax_type: plain, a sink logit of 0 (Evan Miller's off-by-one), or a learned sink
// logit per head (GPT-OSS).
enum class AttentionSoftmax { vanilla, off_by_one, learnable };

// Megatron-Core's MLASelfAttention: q from x (linear_q_proj) or through a q_lora_rank latent
// (linear_q_down_proj, q_layernorm, linear_q_up_proj); k and v from a kv_lora_rank latent
// (linear_kv_down_proj, whose last pe_dim outputs are the one RoPE key k_pe all heads share,
// kv_layernorm, linear_kv_up_proj). A head's query and key are [qk_head_dim | pe_dim RoPE]
// (head_dim = their sum, rope_dim = pe_dim, rotated after MLA's de-interleave), its value
// v_head_dim wide. The latents' norms exist with qk_norm (qk_layernorm), as Megatron builds them.
struct MlaSpec {
  std::int64_t q_lora_rank = 0;  // 0: linear_q_proj from x
  std::int64_t kv_lora_rank = 0, qk_head_dim = 0, pe_dim = 0, v_head_dim = 0;
};

struct AttentionSpec {
  std::int64_t hidden = 0, heads = 0, groups = 0, head_dim = 0;
  bool qk_norm = false;
  bool qkv_bias = false, proj_bias = false;  // add_bias_linear (both) or add_qkv_bias (linear_qkv's)
  float eps = 1e-6f;
  bool rope = true;
  double rope_base = 10000;
  // RoPE's dim (Megatron's int(kv_channels * rotary_percent)): the first 2 ceil(dim / 2) channels
  // of each head rotate, the rest pass through. 0: head_dim.
  std::int64_t rope_dim = 0;
  std::optional<YarnSpec> yarn = std::nullopt;  // YaRN's frequencies (epx/model/rope.hpp); rope_dim = head_dim (MLA: pe_dim)
  double rope_concentration = 1;  // cos and sin times YaRN's concentration factor, where the config sets one
  bool zero_centered_gamma = false;  // QK-norm's gain is 1 + its weight (epx/model/norm_gain.hpp)
  std::optional<float> softmax_scale = std::nullopt;  // the logits' scale; none: 1 / sqrt(head_dim), Megatron's default
  // A sliding window (TE's window_size (window, 0), on the layers window_attn_skip_freq picks):
  // a query sees keys [i - window, i]; -1: every earlier key.
  std::int64_t window = -1;
  AttentionSoftmax softmax = AttentionSoftmax::vanilla;
  DType dtype = DType::F32;
  std::optional<MlaSpec> mla = std::nullopt;  // groups = heads
  // recompute_modules' mla_up_proj: MLA keeps its latents and raw k_pe instead of q, k and v, and
  // its backward reruns the latents' norms, the up projections and RoPE (Megatron's
  // qkv_up_checkpoint).
  bool recompute_up_proj = false;

  std::int64_t value_dim() const { return mla ? mla->v_head_dim : head_dim; }
};

class SelfAttention {
 public:
  SelfAttention(const std::string& prefix, const AttentionSpec& spec);

  // What one micro-batch's backward needs.
  struct Context {
    std::int64_t seq = 0, batch = 0;
    Tensor x;                 // [T, H] input (the linear_qkv wgrad reads it)
    Tensor q_raw, k_raw;      // [T, heads|groups, d] F32 before QK-norm; MLA: the q and kv latents
    Tensor q_rstd, k_rstd;    // QK-norm's 1/rms per row; MLA: the latents' norms'
    Tensor q, k, v;           // [B, heads|groups, S, d (v: value_dim)] after norm and RoPE, in the compute dtype
    Tensor lse;               // [B, heads, S] F32: each query row's log-sum-exp
    Tensor o;                 // [T, heads * value_dim] compute dtype (linear_proj's input)
    Tensor dy, dqkv;          // kept by dgrad for wgrad
    // MLA: the normalised latents (the up projections' inputs), and the gradients of the up and
    // down projections' outputs, for wgrad; all in the compute dtype.
    Tensor q_latent, kv_latent, dq_up, dkv_up, dq_down, dkv_down;
    Tensor k_pe;  // MLA: [T, pe_dim] F32, the shared rotary key before RoPE (kept for mla_up_proj)
  };

  // x [S * B, H] in the compute dtype. The core attention keeps only its inputs, its output and
  // the log-sum-exp, and its backward recomputes the probabilities block by block (as flash
  // attention does), so recompute_modules' core_attn has nothing left to drop.
  Tensor forward(const Tensor& x, std::int64_t seq, Context& ctx) const;
  // dy [T, H] -> dx [T, H]. The QK-norm gammas' and the sinks' gradients are accumulated here
  // (they are tiny); the linear layers' weight gradients wait for backward_wgrad.
  Tensor backward_dgrad(Context& ctx, const Tensor& dy);
  void backward_wgrad(Context& ctx);

  std::vector<Param*> params();
  const AttentionSpec& spec() const { return spec_; }
  std::int64_t rope_dim() const { return spec_.rope_dim > 0 ? spec_.rope_dim : spec_.head_dim; }
  RopeSpec rope_spec() const { return {rope_dim(), spec_.rope_base, spec_.yarn, spec_.rope_concentration}; }
  float softmax_scale() const {
    return spec_.softmax_scale.value_or(1.f / std::sqrt(static_cast<float>(spec_.head_dim)));
  }

  Param linear_qkv, linear_proj, q_layernorm, k_layernorm;
  // MLA's projections and latent norm (empty otherwise); q_layernorm is the q latent's norm there.
  // linear_q_up_proj is linear_q_proj without a q latent.
  Param linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, kv_layernorm;
  // The learned sink logit per head (softmax_type learnable; FP32 like the norms' gammas).
  Param softmax_offset;
  Param linear_qkv_bias, linear_proj_bias;  // empty without biases

 private:
  CausalAttentionMask mask(std::int64_t head) const;  // the window and the sink of query head `head`
  // The projections into ctx.q, ctx.k, ctx.v ([B, heads|groups, S, d or value_dim] F32), and back
  // from their gradients to dx (with the norms' weight gradients); wgrad the projections'. GQA's
  // here, MLA's in src/model/mla.cpp.
  void gqa_forward(const Tensor& x, std::int64_t seq, Context& ctx) const;
  Tensor gqa_backward(Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv);
  void mla_forward(const Tensor& x, std::int64_t seq, Context& ctx) const;
  // MLA from its latents and raw k_pe to ctx.q, ctx.k, ctx.v: the latents' norms (where
  // `normalise_latents`; else ctx.q_latent and ctx.kv_latent are kept), the up projections and
  // RoPE (mla_up_proj reruns it in the backward); and what the forward drops once the core
  // attention ran.
  void mla_up(std::int64_t seq, Context& ctx, bool normalise_latents) const;
  void mla_release_up(Context& ctx) const;
  void round_qkv(Context& ctx) const;  // q, k, v to the core attention's operand dtype
  Tensor mla_backward(Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv);
  void mla_wgrad(Context& ctx);

  AttentionSpec spec_;
};

}  // namespace epx
