// Model FLOPs exactly as Megatron-LM counts them for its "throughput per GPU (TFLOP/s/GPU)" log
// line (megatron/training/training.py, num_floating_point_operations; Megatron-Bridge keeps the
// same in src/megatron/bridge/training/utils/flop_utils.py), so a predicted TFLOP/s/GPU compares
// 1:1 with Megatron's log and the published tables. Forward + backward (x3), 2 FLOPs per
// multiply-add; GQA or MLA attention with the causal halving; dense, routed (top-k) and shared
// expert MLPs (x1.5 with SwiGLU); MTP layers; the logits over the padded vocabulary. Not counted,
// as in Megatron: the router GEMM, permutation, softmax, norms (except MTP's) and recompute.
#pragma once

#include <algorithm>

#include "epx/config/config.hpp"

namespace epx {

struct ModelFlops {
  // Per token, at model.seq_length: the dense and shared-expert MLPs, the routed experts, the
  // attention, MTP's own norms and projection, the logits.
  double mlp = 0, routed_experts = 0, attention = 0, mtp = 0, logits = 0;
  double attention_core = 0;  // QK^T and PV, part of `attention`
  double shared_experts = 0;  // the MoE layers' shared experts, part of `mlp`
  double per_token() const { return mlp + routed_experts + attention + mtp + logits; }
};

// Per layer and token, the attention projections (linear: also the projections' parameter
// count) and QK^T + PV (core, at model.seq_length with the causal halving), in multiply-adds;
// Megatron's standard_self_attn_term and its MLA branch.
struct AttentionMacs {
  double linear = 0, core = 0;
};
AttentionMacs attention_macs(const ModelConfig& m);

// Per token for the config's shape (model.seq_length; vocabulary padded to
// make_vocab_size_divisible_by x TP as Megatron pads it). Throws ConfigError for a shape without
// the sizes the formula needs.
ModelFlops model_flops(const Config& c);
// The same for some of the layers, per token: `decoder_layers` of them, `moe_layers` of those
// and the `mtp` MTP layers MoE layers, and with `loss` the output layer's logits, the loss's and
// every MTP layer's (a pipeline stage's share; model_flops is the whole model's).
ModelFlops layer_flops(const Config& c, double decoder_layers, double moe_layers, double mtp, bool loss);

// How many of layers [first, last) are MoE layers (moe_layer_freq: every N-th, or the 0/1
// pattern, a layer past the pattern's end dense; none without experts).
double moe_layers_in(const ModelConfig& m, Int first, Int last);
// The MTP layers that count as MoE layers: all of them when the last layer is one, else none.
double mtp_moe_layers(const ModelConfig& m);

// How many of layers [first, last) attend over a sliding window (window_size with a left side,
// on the layers window_attn_skip_freq picks), and the share of a full causal layer's QK^T and PV
// each of those runs: a row sees min(i + 1, W) keys, W = left + 1, on average
// W - W (W - 1) / (2 S) against S / 2 (Megatron-Bridge's flop_utils counts it so; Megatron-LM's
// FLOPs, and model_flops, count every layer in full).
double window_layers_in(const ModelConfig& m, Int first, Int last);
double window_core_share(const ModelConfig& m);
// The same share for epx's blocked CPU attention (blocks of `block` query rows): a block
// multiplies the keys from its first row's window start to its last row, rows + window per row.
double blocked_window_core_share(const ModelConfig& m, Int block = 128);

// The rows the routed experts compute per token: top-k, scaled by the capacity factor where the
// experts' inputs are padded to capacity (Megatron's get_capacity: each expert takes
// ceil(factor x tokens x k / experts) rows, empty ones too) or where a factor below 1 drops
// what overflows. Model FLOPs count k (as Megatron's); the time and memory count these.
inline double routed_rows_per_token(const ModelConfig& m) {
  const double k = static_cast<double>(m.moe_router_topk), factor = m.moe_expert_capacity_factor.value_or(1);
  return k * (m.moe_pad_expert_input_to_capacity ? factor : std::min(1.0, factor));
}

// Bytes of one activation or weight element in the compute dtype (BF16/FP16: 2, else 4).
inline double element_bytes(const ModelConfig& m) { return m.bf16 || m.fp16 ? 2 : 4; }

// Megatron's padded vocabulary: vocab_size rounded up to make_vocab_size_divisible_by x TP.
Int padded_vocab_size(const ModelConfig& m);

}  // namespace epx
