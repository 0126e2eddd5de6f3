// The MLPs' activation as Megatron-Core's MLPs and experts compute it (src/kernels/mlp_activation.cpp):
// the function by name, gated (fc1 [M, 2F] = [gate | up]) or not (fc1 [M, F]), a gated unit's
// clamp and linear offset, and the routing probability applied after the activation. The product
// is rounded once; Megatron's unfused path rounds act(h) to BF16 before the probability's multiply,
// so BF16 routed experts may differ by one rounding.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "epx/tensor/tensor.hpp"

namespace epx {

// Megatron-Core's activation_func, by the name Bridge's activation map gives it: silu (SwiGLU
// when gated), quick_gelu (x sigmoid(1.702 x), GPT-OSS), gelu (erf), fast_gelu (the tanh
// approximation, Gemma's gelu_pytorch_tanh), relu, squared_relu (Nemotron-H), sigmoid, tanh.
enum class ActivationFn { silu, quick_gelu, gelu, fast_gelu, relu, squared_relu, sigmoid, tanh };
inline constexpr ActivationFn kActivationFns[] = {ActivationFn::silu,         ActivationFn::quick_gelu,
                                                  ActivationFn::gelu,         ActivationFn::fast_gelu,
                                                  ActivationFn::relu,         ActivationFn::squared_relu,
                                                  ActivationFn::sigmoid,      ActivationFn::tanh};
std::optional<ActivationFn> activation_fn_from_name(std::string_view name);
const char* activation_fn_name(ActivationFn fn);

// gated_linear_unit, with Megatron's activation_func_clamp_value (the gate clamped to at most c,
// the linear half to [-c, c]) and glu_linear_offset (added to the linear half). Megatron reads
// both only in its glu(); a unit that is not gated has neither.
struct MlpActivation {
  ActivationFn fn = ActivationFn::silu;
  std::optional<float> clamp;
  float linear_offset = 0.f;
  bool gated = true;

  std::int64_t fc1_width(std::int64_t ffn) const { return gated ? 2 * ffn : ffn; }  // fc1's output columns
};

// h [M, fc1_width(F)] to out [M, F]: gated, h's rows are [gate | up] and out = act(gate) * (up +
// offset) * prob, gate and up clamped first when the activation has a clamp; not gated, out =
// act(h) * prob. prob = 1 without probs.
void mlp_activation_forward(const MlpActivation& a, const Tensor& h, const float* probs, Tensor& out);
// dh [M, fc1_width(F)] from dout [M, F]; dprobs[m] = sum_j out[m, j] / prob * dout[m, j] (when
// dprobs != nullptr), summed in order in FP64.
void mlp_activation_backward(const MlpActivation& a, const Tensor& h, const float* probs, const Tensor& dout,
                             Tensor& dh, float* dprobs);

}  // namespace epx
