// Token dispatchers, split into Megatron-Core's phases. Only token_dispatch and token_combine
// (and their backward mirrors) communicate; the pre/post phases are local compute, so a schedule
// can run communication of one micro-batch while it computes another.
//
//   forward:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts ->
//             combine_preprocess -> token_combine -> combine_postprocess
//   backward: the same phases in reverse, each named <phase>_backward.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/comm_stream.hpp"
#include "epx/kernels.hpp"
#include "epx/router.hpp"
#include "epx/tensor.hpp"

namespace epx {

// One micro-batch in flight through a dispatcher. `hidden` and `probs` (one per row) are what
// the current phase hands to the next; `grad` and `grad_probs` the same in the backward.
struct DispatchState {
  std::int64_t num_tokens = 0, hidden_size = 0;
  Permutation perm;  // permutation 1: this rank's tokens in expert-major order
  Tensor hidden;
  std::vector<float> probs;
  std::vector<std::int64_t> tokens_per_local_expert;  // rows per local expert for the experts
  Tensor grad;
  std::vector<float> grad_probs;

  // The exchange plan of a communicating dispatcher, from the counts all-gather: rows sent to and
  // received from each EP rank, rows held by each ETP rank after the ETP all-gather, and the
  // received chunk sizes laid out [ETP][EP][local expert] (source-major).
  std::vector<std::int64_t> send_rows, recv_rows, etp_rows, chunk_rows;
  CommEvent pending;  // the communication in flight; the next phase waits on it

  DispatchState() = default;
  DispatchState(const DispatchState&) = delete;  // a task in flight refers to this object
  DispatchState& operator=(const DispatchState&) = delete;
  // A task still in flight (an exception unwound past its wait) must not outlive the state.
  ~DispatchState() {
    try {
      pending.wait();
    } catch (...) {
    }
  }
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  virtual std::string name() const = 0;
  virtual std::int64_t num_local_experts() const = 0;
  virtual std::int64_t first_local_expert() const = 0;
  // Expert tensor parallelism: each expert's FFN dimension is split over ETP ranks.
  virtual int expert_tp_rank() const { return 0; }
  virtual int expert_tp_size() const { return 1; }

  virtual void dispatch_preprocess(DispatchState& s, const Tensor& x, const Routing& r) = 0;
  virtual void token_dispatch(DispatchState& s) = 0;
  virtual void dispatch_postprocess(DispatchState& s) = 0;
  virtual void combine_preprocess(DispatchState& s, Tensor expert_output) = 0;
  virtual void token_combine(DispatchState& s) = 0;
  virtual Tensor combine_postprocess(DispatchState& s) = 0;

  virtual void combine_postprocess_backward(DispatchState& s, const Tensor& dy) = 0;
  virtual void token_combine_backward(DispatchState& s) = 0;
  // Leaves the gradient of the expert output in s.grad.
  virtual void combine_preprocess_backward(DispatchState& s) = 0;
  // Takes the experts' input gradient and probability gradients.
  virtual void dispatch_postprocess_backward(DispatchState& s, Tensor dx_experts,
                                             std::vector<float> dprobs_experts) = 0;
  virtual void token_dispatch_backward(DispatchState& s) = 0;
  // Returns dx [T, H]; adds the routing-probability gradients into dprobs [T, E] (F32).
  virtual Tensor dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) = 0;
};

// Every expert on this rank, no communication: the single-rank MoE layer.
std::unique_ptr<TokenDispatcher> make_local_dispatcher(std::int64_t num_experts);

class ProcessGroups;
// Megatron-Core's MoEAlltoAllTokenDispatcher over the EP, ETP and ETP x EP groups; communication
// runs on `stream`. Both must outlive the dispatcher.
std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(std::int64_t num_experts,
                                                          ProcessGroups& groups, CommStream& stream);

}  // namespace epx
