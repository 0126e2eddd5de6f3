// One multi-token prediction layer (Megatron-Core's MultiTokenPredictionLayer, DeepSeek-V3's MTP
// module): from the previous depth's hidden states h (the decoder's output after its final norm
// at depth 1) and the embedding of the input tokens rolled one more position left,
//   x = eh_proj([enorm(embedding) | hnorm(h)]),  out = final_layernorm(TransformerLayer(x)).
// The transformer layer is built as the decoder's last (MoE where it is one). GPTModel runs the
// layers in its head, with the shared LM head and the rolled targets, or node by node in the
// EP-overlap schedule through the pieces below (gpt_model.hpp). Under full
// recompute with the uniform method the layer keeps only its inputs and reruns its forward just
// before its backward (Megatron's MTP _checkpointed_forward; the block method recomputes none).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "epx/model/model_spec.hpp"
#include "epx/model/transformer_layer.hpp"

namespace epx {

class MtpLayer {
 public:
  // `depth` 0-based (Megatron's mtp.layers.{depth}); `dispatcher` null for a dense layer.
  MtpLayer(int depth, const ModelSpec& spec, std::unique_ptr<TokenDispatcher> dispatcher, MoELayerOptions moe_options);

  struct Context {
    Tensor h, h_rstd, emb, emb_rstd, cat;  // the inputs, their norms' 1/rms, eh_proj's input
    Tensor y, y_rstd;                      // the transformer layer's output, the final norm's 1/rms
    TransformerLayer::Context layer;
    RouterReplay replay;  // checkpointed: the router's draw, for the rerun
  };

  // h, emb [T, H] in the compute dtype -> [T, H]. `replay`: the rerun of a checkpointed forward.
  Tensor forward(const Tensor& h, const Tensor& emb, Context& ctx, const RouterReplay* replay = nullptr);
  // Under full uniform recompute, drops all but the inputs and the router's draw (after the
  // caller read the layer's losses); the backward reruns the forward first.
  void checkpoint(Context& ctx) const;
  // dout [T, H] -> the gradients of h and emb; every weight gradient accumulated.
  std::pair<Tensor, Tensor> backward(Context& ctx, const Tensor& dout);

  // The pieces around the transformer layer, for a schedule that runs it node by node (the
  // EP-overlap schedule): forward_in returns its input, forward_out takes its output y and returns
  // the depth's output; backward_out returns the gradient of y, backward_in takes that of the
  // layer's input and returns the gradients of h and emb (the layer's context left to the caller).
  Tensor forward_in(const Tensor& h, const Tensor& emb, Context& ctx);
  Tensor forward_out(Tensor y, Context& ctx);
  Tensor backward_out(Context& ctx, const Tensor& dout);
  std::pair<Tensor, Tensor> backward_in(Context& ctx, const Tensor& dx);

  void init_weights(std::uint64_t seed);
  std::vector<Param*> params();

  const std::string prefix;
  Param enorm, hnorm, eh_proj, final_layernorm;  // eh_proj [H, 2H]
  TransformerLayer layer;

 private:
  Tensor norm_backward(const Tensor& x, Param& gamma, const Tensor& rstd, const Tensor& dy) const;
  ModelSpec spec_;
};

}  // namespace epx
