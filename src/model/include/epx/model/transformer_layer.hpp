// One transformer layer (Megatron-Core's TransformerLayer, pre-norm):
//   h = x + attention(RMSNorm(x));  out = h + mlp(RMSNorm(h)),
// with the MLP an MoE layer (epx::MoELayer, over the EP ranks) or a dense SwiGLU MLP. Selective
// recompute drops what the recompute_modules name after the forward and recomputes it in the
// backward. dgrad and wgrad are separate calls; the RMSNorm gammas' gradients (tiny) are
// accumulated in dgrad.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/model/attention.hpp"
#include "epx/model/model_spec.hpp"
#include "epx/moe/experts.hpp"
#include "epx/moe/moe_layer.hpp"

namespace epx {

class TransformerLayer {
 public:
  // `dispatcher`: the MoE layer's token dispatcher; null for a dense layer. `moe_options`: how
  // the MoE layer runs in the job (its recompute options come from spec.recompute).
  // `prefix`: the weights' names (default decoder.layers.{index}; an MTP layer's its own).
  TransformerLayer(int index, const ModelSpec& spec, std::unique_ptr<TokenDispatcher> dispatcher,
                   MoELayerOptions moe_options = {}, std::string prefix = "");

  struct Context {
    Tensor x, rstd1, h, rstd2;  // the layer input, the residual after attention, the norms' 1/rms
    SelfAttention::Context attn;
    std::unique_ptr<MoELayer::Context> moe;
    GroupedMlp::Saved mlp;
    Tensor mlp_io;     // a dense layer's MLP input, then its output, between nodes
    Tensor dy, dn2;    // the output gradient and a dense MLP's input gradient, between nodes
    AuxLossValues aux_losses{};  // of the MoE router, for the log
    double z_loss = 0;
    RouterReplay router_replay;  // replayed by a full-recompute forward, or the moe recompute
    Tensor moe_input;            // the moe recompute: the MoE layer's input, all it keeps
  };

  // x [S * B, H] in the compute dtype. `replay`: this is a recompute of an earlier forward.
  Tensor forward(const Tensor& x, Context& ctx, const RouterReplay* replay = nullptr);
  Tensor backward_dgrad(Context& ctx, const Tensor& dy);
  void backward_wgrad(Context& ctx);

  // The same split into Megatron-Core's schedule nodes (TransformerLayerSchedulePlan in
  // megatron/core/models/common/model_chunk_schedule_plan.py: attn, moe_dispatch, mlp,
  // moe_combine), which the merged EP-overlap schedule runs one by one, plus `output` (the
  // combine's postprocess and the residual). A node named launch_* only starts its exchange and
  // returns; the next node of the layer waits for it. A dense layer has no exchanges (its
  // launches are no-ops).
  //   forward:  attn -> launch moe_dispatch -> mlp -> launch moe_combine -> output
  //   backward: launch moe_combine -> mlp -> launch moe_dispatch -> attn,
  //             and the weight gradients of mlp (the experts') and of attn (attention, shared
  //             expert, router) as separate nodes when delayed (delay_wgrad_compute).
  void forward_attn(const Tensor& x, Context& ctx, const RouterReplay* replay = nullptr);
  void launch_moe_dispatch(Context& ctx);
  void forward_mlp(Context& ctx);
  void launch_moe_combine(Context& ctx);
  Tensor forward_output(Context& ctx);  // combine done: unpermute, + shared, + residual
  void launch_moe_combine_backward(Context& ctx, const Tensor& dy);
  void backward_mlp(Context& ctx, bool with_wgrad);
  void launch_moe_dispatch_backward(Context& ctx);
  Tensor backward_attn(Context& ctx, bool with_wgrad);  // returns dx
  void backward_mlp_wgrad(Context& ctx);
  void backward_attn_wgrad(Context& ctx);  // frees the context's last tensors
  // x [T, H] through an RMSNorm with `gamma` at the model's eps and gain (rstd saved); the MTP
  // layer's norms use it too.
  Tensor norm(const Tensor& x, const Param& gamma, Tensor& rstd) const;

  void init_weights(std::uint64_t seed);
  std::vector<Param*> params();

  const std::string prefix;  // "decoder.layers.3"
  Param input_layernorm, pre_mlp_layernorm;
  SelfAttention attention;
  std::unique_ptr<MoELayer> moe;   // MoE layers
  std::optional<GroupedMlp> mlp;   // dense layers

 private:
  bool experts_wgrad_early() const;
  // recompute_modules' moe: the MoE layer's forward again from its input, the router replaying
  // its draw (Megatron's checkpoint of MoELayer.forward), before its backward.
  void recompute_moe(Context& ctx);

  ModelSpec spec_;
};

}  // namespace epx
