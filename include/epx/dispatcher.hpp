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

// What a dispatcher keeps about one micro-batch's exchange for the combine and the backward (the
// flex dispatchers' "handle").
struct DispatchHandle {
  virtual ~DispatchHandle() = default;
};

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
  std::unique_ptr<DispatchHandle> handle;
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

// Bytes this rank has sent to other ranks since the dispatcher was made: to ranks on its own node
// and to ranks on other nodes, of which `inter_metadata` is routing metadata (expert ids,
// probabilities, counts) rather than token rows.
struct TrafficBytes {
  std::int64_t intra = 0, inter = 0, inter_metadata = 0;
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
  virtual TrafficBytes traffic() const { return {}; }

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

// E / EP, the experts every EP rank holds; throws ConfigError when EP does not divide E.
std::int64_t experts_per_ep_rank(std::int64_t num_experts, int ep_size);

// Every expert on this rank, no communication: the single-rank MoE layer.
std::unique_ptr<TokenDispatcher> make_local_dispatcher(std::int64_t num_experts);

class ProcessGroups;
// Megatron-Core's MoEAlltoAllTokenDispatcher over the EP, ETP and ETP x EP groups; communication
// runs on `stream`. Both must outlive the dispatcher.
std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(std::int64_t num_experts,
                                                          ProcessGroups& groups, CommStream& stream);

// Megatron-Core's MoEFlexTokenDispatcher over the ETP x EP group, with epx's CPU versions of its
// two backends (docs/ARCHITECTURE.md, "Flex dispatchers"). Both send one copy of a token per
// destination rank, and across domains (nodes) one copy per destination domain, forwarded
// inside the domain; the combine sums inside the domain before crossing back.
struct FlexOptions {
  std::string backend = "deepep";  // deepep | hybridep
  // deepep: moe_flex_dispatcher_num_sms. DeepEP pairs its SMs into channels; here the token range
  // is cut into num_sms / 2 channels, each exchanged as its own message and forwarded inside the
  // node as soon as it lands.
  int num_sms = 20;
  // hybridep: NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN (0: the ranks that share a node); it must
  // divide the ETP x EP size, and a domain's ranks must share memory.
  int ranks_per_domain = 0;
  // hybridep: NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API, the tokens per pipelined chunk.
  int tokens_per_chunk = 64;
};

// The options from a resolved config (model.moe_flex_dispatcher_backend and
// model.moe_flex_dispatcher_num_sms, into which resolving folds the deprecated per-backend knobs)
// and the HybridEP environment variables (the process's, else the recipe's env_vars).
struct Config;
FlexOptions flex_options_from_config(const Config& cfg);

std::unique_ptr<TokenDispatcher> make_flex_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                      CommStream& stream, const FlexOptions& options);

// The dispatcher model.moe_token_dispatcher_type names (alltoall or flex) over `groups`.
std::unique_ptr<TokenDispatcher> make_dispatcher(const Config& cfg, std::int64_t num_experts,
                                                 ProcessGroups& groups, CommStream& stream);

}  // namespace epx
