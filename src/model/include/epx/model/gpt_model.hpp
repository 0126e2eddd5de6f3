// The GPT model `epx run` trains (Megatron-Core's GPTModel at PP = 1): token embedding, the
// transformer layers, a final RMSNorm, the LM head and the token-mean cross-entropy. Full
// recompute keeps only the input of each checkpointed run of layers and recomputes their forward
// in the backward (Megatron's CheckpointFunction).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "epx/model/model_spec.hpp"
#include "epx/model/transformer_layer.hpp"

namespace epx {

class GPTModel {
 public:
  // `make_dispatcher` is called once per MoE layer, in layer order; every MoE layer runs with
  // `moe_options` (aux-loss scale, rank).
  GPTModel(const ModelSpec& spec, const std::function<std::unique_ptr<TokenDispatcher>()>& make_dispatcher,
           const MoELayerOptions& moe_options = {});

  struct Context {
    Tensor tokens, targets;
    std::vector<std::unique_ptr<TransformerLayer::Context>> layers;  // null while checkpointed
    std::vector<Tensor> checkpoint_input;  // per layer: the input of a checkpoint starting there
    std::vector<std::uint64_t> router_draw;
    Tensor final_in, final_rstd, final_out, logits, lse;
    double loss = 0, aux_loss = 0, z_loss = 0;  // aux and z summed over the MoE layers
  };

  // tokens, targets [S * B] (I64, Megatron's [S, B] order). Returns the mean cross-entropy.
  double forward(const Tensor& tokens, const Tensor& targets, Context& ctx);
  // Backward of `dloss` times this micro-batch's loss; accumulates into every Param::grad.
  void backward(Context& ctx, float dloss);

  // The pieces around the layers, for schedules that run the layers node by node (Megatron's
  // pre_process and post_process): embed starts a micro-batch's context and returns layer 0's
  // input; layer_output finishes layer i's forward (TransformerLayer::forward_output) and records
  // its router losses; head_forward returns the loss; head_backward the gradient of the last
  // layer's output; embed_backward takes layer 0's input gradient.
  Tensor embed(const Tensor& tokens, const Tensor& targets, Context& ctx);
  Tensor layer_output(int i, Context& ctx);
  double head_forward(const Tensor& x, Context& ctx);
  Tensor head_backward(Context& ctx, float dloss);
  void embed_backward(Context& ctx, const Tensor& dx);
  bool has_full_recompute() const;

  // The groups of weights whose gradients complete together in a backward, in the order they
  // complete (Megatron registers its DDP grad hooks per parameter; epx per group): the head
  // (final norm, and the output layer unless tied), the layers last to first, the embedding
  // (with the tied output layer). Schedules call grads_ready(k) when group k's gradients of the
  // micro-batch being run backward are complete; the hook (the trainer's gradient reducer) may
  // start reducing them.
  std::vector<std::vector<Param*>> grad_groups();
  int layer_grad_group(int layer) const { return spec_.num_layers - layer; }
  int embedding_grad_group() const { return spec_.num_layers + 1; }
  void set_grads_ready_hook(std::function<void(int group)> hook) { grads_ready_hook_ = std::move(hook); }
  void grads_ready(int group) const {
    if (grads_ready_hook_) grads_ready_hook_(group);
  }

  void init_weights(std::uint64_t seed);
  std::vector<Param*> params();         // every weight of this rank, each once
  std::vector<Param*> expert_params();  // the routed experts' (reduced over EDP)
  std::vector<MoELayer*> moe_layers();
  void zero_grad();
  const ModelSpec& spec() const { return spec_; }

  Param embedding;  // embedding.word_embeddings.weight [V, H]
  std::vector<std::unique_ptr<TransformerLayer>> layers;
  Param final_layernorm;  // decoder.final_layernorm.weight [H]
  Param output_layer;     // output_layer.weight [V, H]; unused with tied embeddings

 private:
  Param& lm_head() { return spec_.tie_embeddings ? embedding : output_layer; }
  Tensor run_layer(int i, const Tensor& x, Context& ctx, bool recompute);
  void record_router(int i, Context& ctx);  // layer i's aux / z losses and random draw

  ModelSpec spec_;
  std::function<void(int)> grads_ready_hook_;
  std::vector<int> checkpoint_end_;  // per layer: the end of the checkpoint starting there, or -1
};

}  // namespace epx
