// Token dispatchers, split into Megatron-Core's phases (megatron/core/transformer/moe/
// token_dispatcher.py: MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher).
//
//   forward:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts ->
//             combine_preprocess -> token_combine -> combine_postprocess
//   backward: the same phases in reverse, each named <phase>_backward.
//
// The contract of each phase, for one micro-batch's DispatchState `s` (T tokens of this rank, H
// hidden, E experts, k routed copies per token, R = the rows this rank's local experts receive):
//
//   dispatch_preprocess(s, x [T, H], routes)   BLOCKS on the counts all-gather over ETP x EP (a
//       communicating dispatcher's one blocking exchange, Megatron's host sync point; it runs on
//       the calling thread). Leaves s.perm, s.hidden / s.probs (this rank's rows to send, in the
//       dispatcher's order), the exchange plan (send_rows, recv_rows, etp_rows, chunk_rows, or
//       the flex handle) and s.tokens_per_local_expert. The alltoall dispatcher with ETP = 1 and
//       several local experts does not block: its dispatch messages carry the counts, and the
//       receiving side of the plan is complete after dispatch_postprocess.
//   token_dispatch(s)         LAUNCH ONLY: submits the exchange to the comm stream, sets s.pending.
//   dispatch_postprocess(s)   waits on s.pending; leaves s.hidden [R, H] and s.probs [R] grouped
//                             by local expert (tokens_per_local_expert rows each).
//   combine_preprocess(s, y [R, H])   local: the experts' output back into exchange order.
//   token_combine(s)          LAUNCH ONLY, as token_dispatch.
//   combine_postprocess(s) -> [T, H]  waits; the k copies of each token summed (FP32).
//
//   combine_postprocess_backward(s, dy [T, H])  local: leaves s.grad in exchange order.
//   token_combine_backward(s)                   LAUNCH ONLY.
//   combine_preprocess_backward(s)              waits; leaves s.grad [R, H] by local expert.
//   dispatch_postprocess_backward(s, dx [R, H], dprobs [R])  local: into exchange order.
//   token_dispatch_backward(s)                  LAUNCH ONLY.
//   dispatch_preprocess_backward(s, dprobs) -> dx [T, H]  waits; adds the probability
//                                               gradients into dprobs [T, E] (F32).
//
// A launch-only phase returns at once; the phase after it is the one that waits, so a schedule
// can compute another micro-batch in between. The state must outlive the task it refers to.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/comm/comm_stream.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

// The router's decision for one micro-batch as a dispatcher reads it (Megatron's routing_map and
// probs): views into the router's output, read only inside dispatch_preprocess.
struct TokenRoutes {
  const std::vector<std::uint8_t>& routing_map;  // [T, E], 1 where token t goes to expert e
  const Tensor& probs;                           // [T, E] F32, zero off the routing map
};

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

  // The exchange plan of a communicating dispatcher, from the counts: rows sent to and
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

  virtual void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) = 0;
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
// two backends (src/dispatch/flex_dispatcher.hpp). Both send one copy of a token per
// destination rank, and across domains (nodes) one copy per destination domain, forwarded
// inside the domain; the combine sums inside the domain before crossing back.
enum class FlexBackend { deepep, hybridep };
const char* to_string(FlexBackend b);

struct FlexOptions {
  FlexBackend backend = FlexBackend::deepep;  // model.moe_flex_dispatcher_backend
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

std::unique_ptr<TokenDispatcher> make_flex_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                      CommStream& stream, const FlexOptions& options);

// model.moe_token_dispatcher_type, and the flex options.
enum class DispatcherType { alltoall, flex };
struct DispatcherOptions {
  DispatcherType type = DispatcherType::alltoall;
  FlexOptions flex;
};

// The dispatcher `options` name over `groups` (one EP rank or more).
std::unique_ptr<TokenDispatcher> make_dispatcher(const DispatcherOptions& options, std::int64_t num_experts,
                                                 ProcessGroups& groups, CommStream& stream);

}  // namespace epx
