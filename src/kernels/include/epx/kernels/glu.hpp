// Gated linear units as Megatron-Core's MLPs and experts compute them (src/kernels/glu.cpp): the
// activation by name, its clamp and linear offset, and the kernels over [M, 2F] fc1 outputs.
#pragma once

#include <optional>
#include <string_view>

#include "epx/tensor/tensor.hpp"

namespace epx {

// Megatron-Core's activation_func in a gated MLP, by the name Bridge's activation map gives it:
// silu (SwiGLU), quick_gelu (x sigmoid(1.702 x), GPT-OSS), gelu (erf), fast_gelu (the tanh
// approximation, Gemma's gelu_pytorch_tanh), relu, squared_relu, sigmoid, tanh.
enum class GluFn { silu, quick_gelu, gelu, fast_gelu, relu, squared_relu, sigmoid, tanh };
inline constexpr GluFn kGluFns[] = {GluFn::silu, GluFn::quick_gelu, GluFn::gelu,    GluFn::fast_gelu,
                                    GluFn::relu, GluFn::squared_relu, GluFn::sigmoid, GluFn::tanh};
std::optional<GluFn> glu_fn_from_name(std::string_view name);
const char* glu_fn_name(GluFn fn);

// The activation with Megatron's activation_func_clamp_value (the gate clamped to at most c, the
// linear half to [-c, c]) and glu_linear_offset (added to the linear half).
struct GluActivation {
  GluFn fn = GluFn::silu;
  std::optional<float> clamp;
  float linear_offset = 0.f;
};

// h [M, 2F] laid out [gate | up] per row: out = act(gate) * (up + offset) * prob (prob = 1
// without probs), gate and up clamped first when the activation has a clamp.
void glu_forward(const GluActivation& a, const Tensor& h, const float* probs, Tensor& out);
// dh [M, 2F] from dout [M, F]; dprobs[m] = sum_j act(gate) * (up + offset) * dout (when dprobs != nullptr).
void glu_backward(const GluActivation& a, const Tensor& h, const float* probs, const Tensor& dout, Tensor& dh,
                  float* dprobs);

}  // namespace epx
