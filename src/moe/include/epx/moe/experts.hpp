// FFNs over groups of rows: the routed experts (one group per local expert, variable token
// counts including zero; Megatron-Core's TEGroupedMLP) and, with one group and no routing
// probabilities, the shared expert (SharedExpertMLP) or a dense MLP.
//   fc1: [2F, H] per group, output [gate | up] (+ b1), act = glu(gate, up) * prob (SwiGLU by
//   default); or, not gated, fc1: [F, H] and act = act(h) * prob (epx/kernels/mlp_activation.hpp);
//   fc2: [H, F], output + b2 * prob.
// The biases (add_bias_linear) are added to the GEMMs' FP32 output before its one rounding, as
// a GEMM epilogue; fc2's is scaled by the routing probability as Megatron's TEGroupedMLP does
// (_apply_bias: p * (fc2(x) + b) once p moved before fc2), so its gradient reaches the router.
// Weights are stacked [G, 2F, H] (gated) or [G, F, H] and [G, H, F], biases [G, 2F or F] and [G, H]; the tensor names of
// group g are `<prefix>.linear_fc1.weight<g>` / `.bias<g>` (Transformer Engine's GroupedLinear),
// or without the index for a single dense MLP.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/kernels/mlp_activation.hpp"
#include "epx/tensor/param.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

class GroupedMlp {
 public:
  // Activation recompute (Megatron's recompute_modules): keep fc1's output and the activation
  // (none), drop the activation and recompute it from fc1's output (activation: "moe_act"), or
  // keep only the input and recompute both in the backward (all: "mlp", "shared_experts").
  enum class Recompute { none, activation, all };

  // `grouped`: name weights per group (experts) rather than one dense MLP (shared expert).
  GroupedMlp(std::string prefix, std::int64_t groups, std::int64_t hidden, std::int64_t ffn,
             DType dtype, MlpActivation activation, bool grouped, Recompute recompute = Recompute::none,
             bool bias = false);

  // What one micro-batch's backward needs; dgrad fills dy/dh for wgrad.
  struct Saved {
    Tensor x, h, act;                 // [M, H], [M, 2F or F], [M, F]
    std::vector<std::int64_t> counts;  // rows per group
    std::vector<float> probs;         // [M], empty = no probabilities
    Tensor dy, dh;                    // kept by dgrad for wgrad
  };

  const Recompute recompute;

  // x [M, H] in the compute dtype, rows grouped by `counts`. Returns y [M, H].
  Tensor forward(const Tensor& x, std::vector<std::int64_t> counts, std::vector<float> probs,
                 Saved& s) const;
  // dy [M, H] -> dx [M, H]; dprobs [M] when the forward had probabilities.
  Tensor backward_dgrad(Saved& s, const Tensor& dy, std::vector<float>* dprobs) const;
  // The weights' (and biases') gradients += this micro-batch's contribution; frees what dgrad kept.
  void backward_wgrad(Saved& s);

  std::vector<Param*> params();  // fc1, fc2, and their biases where there are biases
  bool has_bias() const { return fc1_bias.master.numel() > 0; }

  std::int64_t groups() const { return groups_; }
  // The file name of group g's matrix of `p` (fc1 or fc2).
  std::string tensor_name(const Param& p, std::int64_t g) const;

  Param fc1, fc2;
  Param fc1_bias, fc2_bias;  // [G, 2F or F], [G, H]; empty without biases

 private:
  // fc1's output and the activation, where they are not held (first forward, or a recompute).
  void recompute_activations(Saved& s) const;

  std::int64_t groups_, hidden_, ffn_;
  DType dtype_;
  MlpActivation activation_;
  bool grouped_;
};

}  // namespace epx
