// The dispatcher of a single rank: permutation 1 and its inverse, nothing to send.
#include "epx/dispatch/dispatcher.hpp"

namespace epx {
namespace {

class LocalDispatcher final : public TokenDispatcher {
 public:
  explicit LocalDispatcher(std::int64_t num_experts) : num_experts_(num_experts) {}
  std::string name() const override { return "local"; }
  std::int64_t num_local_experts() const override { return num_experts_; }
  std::int64_t first_local_expert() const override { return 0; }

  void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) override {
    s.num_tokens = x.dim(0);
    s.hidden_size = x.dim(1);
    s.perm = make_permutation(r.routing_map.data(), s.num_tokens, num_experts_);
    s.hidden = Tensor({s.perm.rows(), s.hidden_size}, x.dtype());
    permute_rows(x, s.perm, s.hidden);
    s.probs.assign(static_cast<std::size_t>(s.perm.rows()), 0.f);
    gather_probs(r.probs.data<float>(), num_experts_, s.perm, s.probs.data());
  }
  void token_dispatch(DispatchState&) override {}
  void dispatch_postprocess(DispatchState& s) override { s.tokens_per_local_expert = s.perm.tokens_per_expert; }
  void combine_preprocess(DispatchState& s, Tensor expert_output) override { s.hidden = std::move(expert_output); }
  void token_combine(DispatchState&) override {}
  Tensor combine_postprocess(DispatchState& s) override {
    Tensor out({s.num_tokens, s.hidden_size}, s.hidden.dtype());
    unpermute_rows(s.hidden, s.perm, out);
    s.hidden = Tensor();
    return out;
  }

  void combine_postprocess_backward(DispatchState& s, const Tensor& dy) override {
    s.grad = Tensor({s.perm.rows(), s.hidden_size}, dy.dtype());
    permute_rows(dy, s.perm, s.grad);
  }
  void token_combine_backward(DispatchState&) override {}
  void combine_preprocess_backward(DispatchState&) override {}
  void dispatch_postprocess_backward(DispatchState& s, Tensor dx, std::vector<float> dprobs) override {
    s.grad = std::move(dx);
    s.grad_probs = std::move(dprobs);
  }
  void token_dispatch_backward(DispatchState&) override {}
  Tensor dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) override {
    Tensor dx({s.num_tokens, s.hidden_size}, s.grad.dtype());
    unpermute_rows(s.grad, s.perm, dx);
    if (!s.grad_probs.empty()) scatter_probs(s.grad_probs.data(), num_experts_, s.perm, dprobs.data<float>());
    s.grad = Tensor();
    return dx;
  }

 private:
  std::int64_t num_experts_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_local_dispatcher(std::int64_t num_experts) {
  return std::make_unique<LocalDispatcher>(num_experts);
}

}  // namespace epx
