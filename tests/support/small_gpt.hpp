// The small GPT config the tests share: 2 layers (dense, then MoE with 8 experts, top-2 and a
// shared expert), 16 tokens per micro-batch, 8 samples per iteration. The unit tests override
// a few fields (model_test.cpp).
#pragma once

namespace epx::test {

inline const char* kSmallGpt = R"(
model:
  num_layers: 2
  hidden_size: 32
  ffn_hidden_size: 48
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 8
  qk_layernorm: true
  normalization: RMSNorm
  gated_linear_unit: true
  activation_func: silu
  add_bias_linear: false
  seq_length: 16
  vocab_size: 48
  share_embeddings_and_output_weights: false
  position_embedding_type: rope
  num_moe_experts: 8
  moe_ffn_hidden_size: 16
  moe_shared_expert_intermediate_size: 16
  moe_router_topk: 2
  moe_layer_freq: [0, 1]
  moe_aux_loss_coeff: 1.0e-2
  moe_token_dispatcher_type: alltoall
  init_method_std: 0.05
optimizer: {lr: 1.0e-2, min_lr: 1.0e-3}
scheduler: {lr_decay_style: cosine, lr_warmup_iters: 1}
train: {train_iters: 5, global_batch_size: 8, micro_batch_size: 1}
target: {gpu: cpu}
)";

}  // namespace epx::test
