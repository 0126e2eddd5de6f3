// The dispatcher of a single rank: permutation 1 and its inverse, nothing to send.
#include "epx/dispatch/dispatcher.hpp"
#include "permuter.hpp"

namespace epx {
namespace {

class LocalDispatcher final : public TokenDispatcher {
 public:
  explicit LocalDispatcher(std::int64_t num_experts) : num_experts_(num_experts) {}
  std::string name() const override { return "local"; }
  std::int64_t num_local_experts() const override { return num_experts_; }
  std::int64_t first_local_expert() const override { return 0; }

  void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) override {
    permute_tokens(s, x, r, num_experts_);
  }
  void token_dispatch(DispatchState&) override {}
  void dispatch_postprocess(DispatchState& s) override { s.tokens_per_local_expert = s.perm.tokens_per_expert; }
  void combine_preprocess(DispatchState& s, Tensor expert_output) override { s.hidden = std::move(expert_output); }
  void token_combine(DispatchState&) override {}
  Tensor combine_postprocess(DispatchState& s) override { return unpermute_tokens(s); }

  void combine_postprocess_backward(DispatchState& s, const Tensor& dy) override { permute_token_grads(s, dy); }
  void token_combine_backward(DispatchState&) override {}
  void combine_preprocess_backward(DispatchState&) override {}
  void dispatch_postprocess_backward(DispatchState& s, Tensor dx, std::vector<float> dprobs) override {
    s.grad = std::move(dx);
    s.grad_probs = std::move(dprobs);
  }
  void token_dispatch_backward(DispatchState&) override {}
  Tensor dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) override {
    return unpermute_token_grads(s, dprobs, num_experts_);
  }

 private:
  std::int64_t num_experts_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_local_dispatcher(std::int64_t num_experts) {
  return std::make_unique<LocalDispatcher>(num_experts);
}

}  // namespace epx
