// The shape and options of the whole GPT model epx trains (`epx run`): Megatron-Core's GPTModel
// with TransformerLayers of RMSNorm, causal GQA self-attention and a dense or MoE MLP, with the
// activation-recompute plan. Built from the config by train/job_spec.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "epx/model/attention.hpp"
#include "epx/moe/moe_spec.hpp"

namespace epx {

// Megatron's activation recompute. Selective: the modules of recompute_modules drop what they
// would save and recompute it in the backward. Full: whole layers keep only their input.
// core_attn is kept for the description only: the blocked attention already recomputes its
// probabilities in every backward and keeps nothing a recompute could drop (attention.hpp), as
// with flash attention on a GPU.
struct RecomputeSpec {
  bool layernorm = false, core_attn = false, moe_act = false, mlp = false, shared_experts = false, mla_up_proj = false;
  bool moe = false;  // the whole MoE layer (router, exchanges, experts) rerun before its backward
  std::string method;  // full recompute: "uniform" or "block"; empty = no full recompute
  int num_layers = 0;  // recompute_num_layers

  // The runs of layers [first, last) recomputed as one checkpoint: uniform splits every layer
  // into chunks of num_layers; block checkpoints each of the first num_layers layers.
  std::vector<std::pair<int, int>> checkpoints(int layers) const;
  std::string describe() const;  // "selective (core_attn, moe_act)", "full uniform x1", "none"
};

struct ModelSpec {
  std::int64_t vocab = 0, hidden = 0, ffn = 0;  // ffn: the dense MLP's width
  // The vocabulary padded to make_vocab_size_divisible_by, as Megatron's model FLOPs count the LM
  // head; epx computes the `vocab` columns (0: vocab).
  std::int64_t padded_vocab = 0;
  MlpActivation activation;                      // the dense MLP's (the MoE layers' is moe->activation)
  bool bias = false;                             // add_bias_linear: the dense MLP's biases (the attention's: attention)
  int num_layers = 0;
  // Per layer (moe_layer_freq), then one per MTP layer: the last layer's kind, as Megatron builds
  // MTP layers from the decoder's last layer spec (so num_moe_layers counts MoE MTP layers, as
  // Megatron's MoE metrics and FLOPs do).
  std::vector<bool> is_moe;
  int mtp_layers = 0;            // mtp_num_layers: MTP depths after the decoder (gpt_model.hpp)
  double mtp_loss_scale = 0;     // each depth's loss weight: mtp_loss_scaling_factor / mtp_layers
  bool mtp_repeated = false;     // mtp_use_repeated_layer: one MTP layer run at every depth
  // mtp_detach_heads: the MTP layers take the decoder's hidden states, the embedding's rows and
  // the output weight as constants, so the MTP losses train the MTP layers alone.
  bool mtp_detached = false;
  AttentionSpec attention;   // its window applies on the layers is_window marks
  std::vector<bool> is_window;  // per layer (window_attn_skip_freq); empty: none
  std::optional<MoESpec> moe;  // when any layer is MoE
  bool tie_embeddings = false;
  float eps = 1e-5f;
  bool zero_centered_gamma = false;  // every norm's gain is 1 + its weight (epx/model/norm_gain.hpp)
  double init_std = 0.02;
  std::uint64_t seed = 1234;
  std::int64_t seq_length = 0, micro_batch = 1;
  DType dtype = DType::F32;
  RecomputeSpec recompute;

  int num_moe_layers() const;
  // The MoE layers as built: a repeated MTP layer once (Megatron's training_log divides the MoE
  // losses by this; epx's expert-load mean too).
  int num_moe_loss_layers() const {
    return num_moe_layers() - (mtp_repeated && mtp_layers > 1 && is_moe.back() ? mtp_layers - 1 : 0);
  }
  AttentionSpec attention_of(int layer) const;  // layer's attention: the window or none
  // Model FLOPs of one token's forward and backward (3x the forward's multiply-adds x 2), as
  // Megatron's num_floating_point_operations counts them for TFLOP/s/GPU: every GEMM, causal
  // attention at half the S x S work, the top-k routed experts, the shared expert and the LM
  // head at the padded vocabulary, and each MTP layer with its norms, eh_proj and LM head; not
  // the router's GEMM, which Megatron leaves out. Recompute is not counted (model, not hardware
  // FLOPs).
  double flops_per_token() const;
};

}  // namespace epx
