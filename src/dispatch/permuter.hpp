// Permutation 1 and its inverse, written once for every dispatcher over the kernels of
// src/kernels/permute.cpp (Megatron-Core's permute / unpermute in
// megatron/core/transformer/moe/moe_utils.py). The local and alltoall dispatchers permute this
// rank's tokens into expert-major order before the exchange (DispatchState::perm), as
// MoEAlltoAllTokenDispatcher does; flex/deepep permutes the rows it received, as Megatron's
// _DeepepManager does after DeepEP's dispatch (token_dispatcher.py,
// get_permuted_hidden_states_by_experts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/dispatch/dispatcher.hpp"

namespace epx {

// x's rows in p's order (zeros for padding rows).
Tensor permuted(const Tensor& x, const Permutation& p);
// The same from rows packed `stride` bytes apart, each starting with its `hidden` values (p has
// no padding rows).
Tensor permuted(const std::byte* rows, std::int64_t stride, const Permutation& p, std::int64_t hidden, DType dtype);
// Per row of p: its (token, expert) entry of probs [T, num_experts].
std::vector<float> permuted_probs(const float* probs, std::int64_t num_experts, const Permutation& p);
// [T, H]: each token's rows summed in FP32; the inverse of permuted and its backward.
Tensor unpermuted(const Tensor& rows, const Permutation& p);

// The dispatcher phases that are permutation 1 of this rank's tokens, over s.perm.
// dispatch_preprocess: s.perm from the routing map, s.hidden and s.probs in its order.
void permute_tokens(DispatchState& s, const Tensor& x, const TokenRoutes& r, std::int64_t num_experts);
// combine_postprocess: s.hidden's rows summed into the tokens [T, H]; releases s.hidden.
Tensor unpermute_tokens(DispatchState& s);
// combine_postprocess_backward: s.grad = dy [T, H] in s.perm's order.
void permute_token_grads(DispatchState& s, const Tensor& dy);
// dispatch_preprocess_backward: s.grad's rows summed into dx [T, H], and s.grad_probs added into
// dprobs [T, num_experts]; releases s.grad.
Tensor unpermute_token_grads(DispatchState& s, Tensor& dprobs, std::int64_t num_experts);

}  // namespace epx
