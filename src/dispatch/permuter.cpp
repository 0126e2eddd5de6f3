#include "permuter.hpp"

#include <cstring>

namespace epx {

Tensor permuted(const Tensor& x, const Permutation& p) {
  auto out = Tensor::uninitialized({p.rows(), x.dim(1)}, x.dtype());
  permute_rows(x, p, out);
  return out;
}

Tensor permuted(const std::byte* rows, std::int64_t stride, const Permutation& p, std::int64_t hidden, DType dtype) {
  auto out = Tensor::uninitialized({p.rows(), hidden}, dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(dtype);
  auto* o = static_cast<std::byte*>(out.raw());
#pragma omp parallel for schedule(static)
  for (std::int64_t row = 0; row < p.rows(); ++row)
    std::memcpy(o + row * row_bytes, rows + p.row_token[row] * stride, row_bytes);
  return out;
}

std::vector<float> permuted_probs(const float* probs, std::int64_t num_experts, const Permutation& p) {
  std::vector<float> out(static_cast<std::size_t>(p.rows()));
  gather_probs(probs, num_experts, p, out.data());
  return out;
}

Tensor unpermuted(const Tensor& rows, const Permutation& p) {
  auto out = Tensor::uninitialized({p.num_tokens, rows.dim(1)}, rows.dtype());
  unpermute_rows(rows, p, out);
  return out;
}

void permute_tokens(DispatchState& s, const Tensor& x, const TokenRoutes& r, std::int64_t num_experts) {
  s.num_tokens = x.dim(0);
  s.hidden_size = x.dim(1);
  s.perm = make_permutation(r.routing_map.data(), s.num_tokens, num_experts);
  s.hidden = permuted(x, s.perm);
  s.probs = permuted_probs(r.probs.data<float>(), num_experts, s.perm);
}

Tensor unpermute_tokens(DispatchState& s) {
  Tensor out = unpermuted(s.hidden, s.perm);
  s.hidden = Tensor();
  return out;
}

void permute_token_grads(DispatchState& s, const Tensor& dy) { s.grad = permuted(dy, s.perm); }

Tensor unpermute_token_grads(DispatchState& s, Tensor& dprobs, std::int64_t num_experts) {
  Tensor dx = unpermuted(s.grad, s.perm);
  if (!s.grad_probs.empty()) scatter_probs(s.grad_probs.data(), num_experts, s.perm, dprobs.data<float>());
  s.grad = Tensor();
  return dx;
}

}  // namespace epx
