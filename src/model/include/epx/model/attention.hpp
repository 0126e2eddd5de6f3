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
  std::optional<YarnSpec> yarn = std::nullopt;  // YaRN's frequencies (epx/model/rope.hpp); rope_dim = head_dim
  double rope_concentration = 1;  // cos and sin times YaRN's concentration factor, where the config sets one
  bool zero_centered_gamma = false;  // QK-norm's gain is 1 + its weight (epx/model/norm_gain.hpp)
  std::optional<float> softmax_scale = std::nullopt;  // the logits' scale; none: 1 / sqrt(head_dim), Megatron's default
  // A sliding window (TE's window_size (window, 0), on the layers window_attn_skip_freq picks):
  // a query sees keys [i - window, i]; -1: every earlier key.
  std::int64_t window = -1;
  AttentionSoftmax softmax = AttentionSoftmax::vanilla;
  DType dtype = DType::F32;
};

class SelfAttention {
 public:
  SelfAttention(const std::string& prefix, const AttentionSpec& spec);

  // What one micro-batch's backward needs.
  struct Context {
    std::int64_t seq = 0, batch = 0;
    Tensor x;                 // [T, H] input (the linear_qkv wgrad reads it)
    Tensor q_raw, k_raw;      // [T, heads|groups, d] F32 before QK-norm
    Tensor q_rstd, k_rstd;    // QK-norm's 1/rms per row
    Tensor q, k, v;           // [B, heads|groups, S, d] after norm and RoPE, in the compute dtype
    Tensor lse;               // [B, heads, S] F32: each query row's log-sum-exp
    Tensor o;                 // [T, heads * d] compute dtype (linear_proj's input)
    Tensor dy, dqkv;          // kept by dgrad for wgrad
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
  // The learned sink logit per head (softmax_type learnable; FP32 like the norms' gammas).
  Param softmax_offset;
  Param linear_qkv_bias, linear_proj_bias;  // empty without biases

 private:
  CausalAttentionMask mask(std::int64_t head) const;  // the window and the sink of query head `head`

  AttentionSpec spec_;
};

}  // namespace epx
