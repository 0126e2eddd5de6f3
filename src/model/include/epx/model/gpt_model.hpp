// The GPT model `epx run` trains (Megatron-Core's GPTModel): token embedding, the transformer
// layers, a final RMSNorm, the LM head and the token-mean cross-entropy. With pipeline
// parallelism one GPTModel is one model chunk: a range of the layers, with the embedding only on
// the first virtual stage (pre_process) and the head and loss only on the last (post_process);
// the chunks where tied embeddings or MTP need the embedding keep a copy (shared_embedding).
// Full recompute keeps only the input of each checkpointed run of the chunk's layers and
// recomputes their forward in the backward (Megatron's CheckpointFunction).
// Multi-token prediction (mtp_num_layers) runs in the head: depth k (1-based) takes the previous
// depth's output (the decoder's after its final norm at k = 1) and the input tokens rolled k
// positions left (0 past the sequence's end), predicts the targets rolled k left with the shared
// LM head, and adds mtp_loss_scale times its token-mean cross-entropy over the S - k positions
// that have a target (0 where none) to the objective (Megatron's process_mtp_loss and
// MTPLossAutoScaler); the LM loss returned stays the main one. With mtp_detach_heads the MTP
// takes the decoder's hidden states, the embedding's rows and the output weight as constants:
// its losses train the MTP layers alone (the trainer clips those as a group of their own).
// Its layers run whole, or node by node in the EP-overlap schedule (scheduled_layer); under full
// uniform recompute each reruns its forward before its backward (mtp_layer.hpp). With Megatron's
// standalone MTP stage (a layout's m in a chunk before the loss's), that chunk runs the final norm
// and the MTP layers and sends the decoder's hidden states with each depth's after them
// (mtp_stage_forward); the loss's chunk takes the LM and MTP losses of those rows.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#include "epx/model/model_spec.hpp"
#include "epx/model/mtp_layer.hpp"
#include "epx/model/pipeline_spec.hpp"
#include "epx/model/transformer_layer.hpp"

namespace epx {

// Which part of the model a GPTModel builds (the whole model by default).
struct ModelChunk {
  LayerRange layers{0, -1};  // end -1: every layer
  bool pre_process = true;   // the embedding
  bool post_process = true;  // the LM head and the loss (and the final norm, unless a standalone MTP stage has it)
  // Megatron's standalone MTP stage (not the loss's chunk): the final norm and the MTP layers run
  // here, after the chunk's layers.
  bool mtp_stage = false;
  // The loss's chunk after a standalone MTP stage: its input carries the MTP depths' hidden states.
  bool mtp_before = false;
};

class GPTModel {
 public:
  // `make_dispatcher` is called once per MoE layer, in layer order; every MoE layer runs with
  // `moe_options` (aux-loss scale, rank). Layers keep their whole-model numbers (names, seeds).
  GPTModel(const ModelSpec& spec, const std::function<std::unique_ptr<TokenDispatcher>()>& make_dispatcher,
           const MoELayerOptions& moe_options = {}, ModelChunk chunk = {});

  struct Context {
    Tensor tokens, targets;
    std::vector<std::unique_ptr<TransformerLayer::Context>> layers;  // null while checkpointed
    std::vector<Tensor> checkpoint_input;  // per layer: the input of a checkpoint starting there
    std::vector<RouterReplay> router_replay;  // per layer
    Tensor final_in, final_rstd, final_out, logits, lse;
    double loss = 0, z_loss = 0;  // z and each aux loss summed over the MoE layers
    AuxLossValues aux_losses{};
    // Per MTP depth: the rolled input tokens [T], the layer's context and output, the logits and
    // log-sum-exp of the positions with a target, the loss; the backward's embedding gradient.
    std::vector<Tensor> mtp_tokens, mtp_out, mtp_logits, mtp_lse, mtp_demb;
    std::vector<MtpLayer::Context> mtp;
    std::vector<double> mtp_losses;
    // The MTP layers in the schedule: the forward ran them (scheduled_input); in the backward,
    // each depth's output gradient so far and the final norm's output's.
    bool mtp_in_schedule = false;
    std::vector<Tensor> mtp_dout;
    Tensor mtp_dn;
  };

  // The whole model (pre and post process): tokens, targets [S * B] (I64, Megatron's [S, B]
  // order). Returns the mean cross-entropy.
  double forward(const Tensor& tokens, const Tensor& targets, Context& ctx);
  // Backward of `dloss` times this micro-batch's loss; accumulates into every Param::grad.
  void backward(Context& ctx, float dloss);

  // A pipeline stage's chunk: begin starts a micro-batch's context (embed does too);
  // forward_layers runs the chunk's layers on their input; backward_layers takes the gradient of
  // their output and returns their input's.
  void begin(const Tensor& tokens, const Tensor& targets, Context& ctx);
  Tensor forward_layers(Tensor x, Context& ctx);
  Tensor backward_layers(Context& ctx, Tensor dy);
  const ModelChunk& chunk() const { return chunk_; }
  int num_local_layers() const { return static_cast<int>(layers.size()); }
  int global_layer(int local) const { return chunk_.layers.first + local; }  // for trace labels

  // The pieces around the layers, for schedules that run the layers node by node (Megatron's
  // pre_process and post_process): embed starts a micro-batch's context and returns layer 0's
  // input; layer_output finishes local layer i's forward (TransformerLayer::forward_output) and
  // records its router losses; head_forward returns the loss; head_backward the gradient of the
  // last layer's output; embed_backward takes layer 0's input gradient.
  Tensor embed(const Tensor& tokens, const Tensor& targets, Context& ctx);
  Tensor layer_output(int i, Context& ctx);
  double head_forward(const Tensor& x, Context& ctx);
  // `schedule_mtp`: the schedule runs the MTP layers node by node next (scheduled_layer), so this
  // returns the gradient of the last MTP layer's output, not the decoder's.
  Tensor head_backward(Context& ctx, float dloss, bool schedule_mtp = false);
  void embed_backward(Context& ctx, const Tensor& dx);
  // The standalone MTP stage (chunk().mtp_stage), after its layers: the final norm and the MTP
  // layers (unless the schedule ran them: then x is the last one's transformer output), returning
  // [final norm's output; depth 1's; ...] ([(1 + D) T, H], Megatron's concatenation). The backward
  // takes that output's gradient and returns the gradient of the chunk's last layer's output, or
  // with `schedule_mtp` of the last MTP layer's transformer output (as head_backward).
  Tensor mtp_stage_forward(Tensor x, Context& ctx);
  Tensor mtp_stage_backward(Context& ctx, const Tensor& dy, bool schedule_mtp);

  // The layers a schedule runs node by node (the EP-overlap schedule): the chunk's decoder layers,
  // then the MTP layers' transformer layers where the chunk runs them (Megatron's MTP schedule
  // nodes: the loss's chunk, or a standalone MTP stage). An MTP layer's input comes from scheduled_input (the final norm, or the previous
  // depth's, and the depth's eh_proj), and scheduled_input_backward takes the gradient of it back
  // to the previous layer's output; layer_output finishes any of them. Decoder layer i completes
  // gradient group layer_grad_group(i); the MTP layers complete the head's (0) with depth 0.
  int num_scheduled_layers() const { return num_local_layers() + static_cast<int>(depth_.size()); }
  TransformerLayer& scheduled_layer(int i);
  TransformerLayer::Context* scheduled_context(int i, Context& ctx, bool fresh = false);
  void release_scheduled(int i, Context& ctx);
  Tensor scheduled_input(int i, Tensor x, Context& ctx);
  Tensor scheduled_input_backward(int i, Tensor dx, Context& ctx);
  int scheduled_grad_group(int i) const { return i < num_local_layers() ? layer_grad_group(i) : 0; }
  bool completes_grad_group(int i) const { return i <= num_local_layers(); }
  // This chunk runs the MTP layers (the loss's, or the standalone MTP stage).
  bool runs_mtp() const { return spec_.mtp_layers > 0 && (chunk_.mtp_stage || (chunk_.post_process && !chunk_.mtp_before)); }
  bool has_full_recompute() const;

  // The groups of weights whose gradients complete together in a backward, in the order they
  // complete (Megatron registers its DDP grad hooks per parameter; epx per group): the head
  // (final norm, the output layer unless tied, the MTP layers, the embedding's copy; post_process
  // or the MTP stage only), the chunk's layers last to first, the embedding (with the tied output layer;
  // pre_process only). Schedules call
  // grads_ready(k) when group k's gradients of the micro-batch being run backward are complete;
  // the hook (the trainer's gradient reducer) may start reducing them.
  std::vector<std::vector<Param*>> grad_groups();
  int layer_grad_group(int layer) const { return head_groups() + num_local_layers() - 1 - layer; }
  // The word embedding's group: its own after the layers, or, for the last stage's copy, the head's.
  int embedding_grad_group() const { return chunk_.pre_process ? head_groups() + num_local_layers() : 0; }
  // With tied embeddings or MTP over pipeline stages, the word embedding is kept on the first
  // stage and copied where the tied head or the MTP layers run (Megatron's shared_embedding): the
  // gradients of the copies are summed over those stages after the DP reduction, so they step
  // alike. A copy draws the same initial values (same name, same seed; Megatron zeroes it and
  // all-reduces). Returns this chunk's embedding or copy where another chunk has one too, else null.
  Param* shared_embedding() {
    const bool alone = chunk_.pre_process && (!spec_.tie_embeddings || chunk_.post_process) &&
                       (spec_.mtp_layers == 0 || runs_mtp());
    return has_embedding() && !alone ? &embedding : nullptr;
  }
  bool embedding_copy() const { return has_embedding() && !chunk_.pre_process; }
  void set_grads_ready_hook(std::function<void(int group)> hook) { grads_ready_hook_ = std::move(hook); }
  void grads_ready(int group) const {
    if (grads_ready_hook_) grads_ready_hook_(group);
  }
  // embed_backward offers the hook a micro-batch's embedding gradient as its rows (`tokens` [T],
  // `dx` [T, H]) before adding them into the gradient; the hook (the reducer, with
  // ddp.reduce_embedding_rows) returns true when it took them, and they are not added here.
  void set_embedding_rows_hook(std::function<bool(const Tensor& tokens, const Tensor& dx)> hook) {
    embedding_rows_hook_ = std::move(hook);
  }
  // The forward calls params_needed(k) before it first uses group k's weights (Megatron's
  // forward pre-hook): with overlap_param_gather the hook waits for their all-gather.
  void set_params_needed_hook(std::function<void(int group)> hook) { params_needed_hook_ = std::move(hook); }
  void params_needed(int group) const {
    if (params_needed_hook_) params_needed_hook_(group);
  }

  void init_weights(std::uint64_t seed);
  std::vector<Param*> params();         // every weight of this chunk, each once
  std::vector<Param*> expert_params();  // the routed experts' (reduced over EDP)
  std::vector<Param*> mtp_params();     // the MTP layers' (a gradient-norm group of their own with mtp_detach_heads)
  std::vector<MoELayer*> moe_layers();
  void zero_grad();
  const ModelSpec& spec() const { return spec_; }

  Param embedding;  // embedding.word_embeddings.weight [V, H]; empty without pre_process or a copy
  std::vector<std::unique_ptr<TransformerLayer>> layers;  // the chunk's, in order
  Param final_layernorm;  // decoder.final_layernorm.weight [H]; only where has_final_norm()
  Param output_layer;     // output_layer.weight [V, H]; unused with tied embeddings
  std::vector<std::unique_ptr<MtpLayer>> mtp;  // the MTP layers, where runs_mtp() (one with mtp_use_repeated_layer)

 private:
  Param& lm_head() { return spec_.tie_embeddings ? embedding : output_layer; }
  int head_groups() const { return chunk_.post_process || runs_mtp() ? 1 : 0; }
  // The decoder's final norm: with MTP where its layers run (before them), else in the loss's chunk.
  bool has_final_norm() const { return spec_.mtp_layers > 0 ? runs_mtp() : chunk_.post_process; }
  // The MTP depths whose hidden states or losses this chunk handles.
  std::size_t mtp_depths() const {
    return chunk_.post_process || chunk_.mtp_stage ? static_cast<std::size_t>(spec_.mtp_layers) : 0;
  }
  bool has_embedding() const { return embedding.grad.numel() > 0; }  // (the distributed optimizer may drop the master)
  void add_embedding_grad(const Tensor& tokens, const Tensor& rows);  // rows [T, H] scatter-added at `tokens` [T]
  Tensor run_layer(int i, const Tensor& x, Context& ctx, bool recompute);
  void record_router(int i, Context& ctx);  // layer i's aux / z losses and random draw
  Tensor embedding_rows(const Tensor& tokens) const;  // the embedding's rows of `tokens` [T] -> [T, H]
  void final_norm(const Tensor& x, Context& ctx);
  Tensor final_norm_backward(Context& ctx, const Tensor& dn);  // (with the copy's MTP rows)
  // The first MTP depth's gradient of the decoder's hidden states, into `dn` (mtp_detach_heads:
  // dropped, the hidden states being a constant to the MTP).
  void add_mtp_hidden_grad(Tensor& dn, const Tensor& dh) const;
  void record_mtp_router(std::size_t k, Context& ctx);  // depth k's aux / z losses
  // Depth k + 1 rolls tokens and targets k + 1 positions left: in [S, B] order, (k + 1) * B of
  // the T rows; the last k + 1 positions of each sequence take token 0 and no target.
  std::int64_t mtp_shift(std::size_t k, std::int64_t T) const {
    return std::min(static_cast<std::int64_t>(k + 1) * spec_.micro_batch, T);
  }
  void mtp_layers_forward(Context& ctx);  // each depth's output, the layers run whole
  void mtp_losses_forward(Context& ctx);  // each depth's logits and loss
  void mtp_head_backward(Context& ctx, float dloss);  // each depth's output gradient through the LM head
  Tensor mtp_backward(Context& ctx);  // the gradient of the decoder's output (after its final norm)

  ModelSpec spec_;
  ModelChunk chunk_;
  std::function<void(int)> grads_ready_hook_, params_needed_hook_;
  std::function<bool(const Tensor&, const Tensor&)> embedding_rows_hook_;
  std::vector<int> checkpoint_end_;  // per local layer: the end of the checkpoint starting there, or -1
  std::vector<MtpLayer*> depth_;     // per MTP depth this chunk runs: its layer (mtp's)
};

}  // namespace epx
