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

#include "epx/attention.hpp"
#include "epx/experts.hpp"
#include "epx/model_spec.hpp"
#include "epx/moe_layer.hpp"

namespace epx {

class TransformerLayer {
 public:
  // `dispatcher`: the MoE layer's token dispatcher; null for a dense layer.
  TransformerLayer(int index, const ModelSpec& spec, std::unique_ptr<TokenDispatcher> dispatcher);

  struct Context {
    Tensor x, rstd1, h, rstd2;  // the layer input, the residual after attention, the norms' 1/rms
    SelfAttention::Context attn;
    std::unique_ptr<MoELayer::Context> moe;
    GroupedMlp::Saved mlp;
    double aux_loss = 0, z_loss = 0;  // of the MoE router, for the log
    std::uint64_t router_draw = 0;     // replayed by a full-recompute forward
  };

  // x [S * B, H] in the compute dtype. `replay_draw`: this is a recompute of an earlier forward.
  Tensor forward(const Tensor& x, Context& ctx, std::optional<std::uint64_t> replay_draw = std::nullopt);
  Tensor backward_dgrad(Context& ctx, const Tensor& dy);
  void backward_wgrad(Context& ctx);

  void init_weights(std::uint64_t seed);
  std::vector<Param*> params();
  std::vector<Param*> expert_params();  // reduced over EDP; the rest over DP

  const std::string prefix;  // "decoder.layers.3"
  Param input_layernorm, pre_mlp_layernorm;
  SelfAttention attention;
  std::unique_ptr<MoELayer> moe;   // MoE layers
  std::optional<GroupedMlp> mlp;   // dense layers

 private:
  Tensor norm(const Tensor& x, const Param& gamma, Tensor& rstd) const;

  ModelSpec spec_;
};

}  // namespace epx
