// Megatron-Core's MoEFlexTokenDispatcher (megatron/core/transformer/moe/token_dispatcher.py) over
// the ETP x EP group, with CPU versions of its DeepEP and HybridEP backends: the part both share.
// Megatron picks the backend's manager (_DeepepManager, _HybridEPManager) once, when the
// dispatcher is made; here make_flex_dispatcher makes the backend's subclass, DeepEPDispatcher
// (flex_deepep.cpp) or HybridEPDispatcher (flex_hybridep.cpp).
//
// The group's num_ranks ranks form num_rdma_ranks domains of num_nvl_ranks consecutive ranks
// (DeepEP: a node; HybridEP: an NVLink domain, NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN), named
// as DeepEP names them (csrc/deep_ep.cpp, Buffer::Buffer): rank = rdma_rank * num_nvl_ranks +
// nvl_rank. A rank's rail is the ranks with its nvl_rank in every domain (DeepEP's RDMA peers).
//
//   dispatch_preprocess  the dispatch layout: per token the k record slots (expert, probability)
//                        and its destination ranks and domains; per chunk the tokens for each
//                        rank and domain; counts all-gathered over the group (the host sync);
//                        then the backend's plan inside the domain
//   token_dispatch       per chunk: one copy of a token per destination domain over the rail
//                        (one message per chunk, all in flight at once); as each chunk lands the
//                        rail peer forwards it inside its domain, one copy per destination rank
//                        (the backend's part)
//   token_combine        the mirror: each domain sums its ranks' rows of a token (FP32) and sends
//                        one row back over the rail; the source sums over domains (FP32), so a
//                        token crosses between domains once per destination domain each way.
// The backward of dispatch is a combine (carrying the probability gradients in the record
// slots), the backward of combine a dispatch over the cached layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dispatcher_base.hpp"

namespace epx {

// A token's record slot: a routed expert (-1: empty) and its probability, or in the backward
// the probability's gradient (then only the float travels).
struct Slot {
  std::int32_t expert = -1;
  float value = 0.f;
};
static_assert(sizeof(Slot) == 8);

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// One micro-batch's exchange plan, the part both backends' handles share. Rail rows of a chunk
// are ordered by source domain, then token.
struct FlexHandle : DispatchHandle {
  DType dtype = DType::F32;
  std::int64_t chunks = 1;
  int k = 1;
  std::vector<Slot> records;                           // [T][k] this rank's tokens
  std::vector<std::vector<std::int32_t>> send_tokens;  // [C][num_rdma_ranks] own tokens per domain
  std::vector<std::int64_t> rail_recv;                 // [C][num_rdma_ranks] rows per source domain
  std::int64_t rail_rows(std::int64_t c, int num_rdma_ranks) const {
    const auto first = rail_recv.begin() + c * num_rdma_ranks;
    return std::accumulate(first, first + num_rdma_ranks, std::int64_t{0});
  }
};

// Every group rank's counts from dispatch_preprocess's all-gather (DeepEP's get_dispatch_layout
// and notify_dispatch): per expert [E], per chunk the tokens for each destination rank [C][n] and
// for each destination domain [C][N].
struct FlexCounts {
  std::int64_t num_experts, chunks, num_ranks, num_rdma_ranks;
  std::vector<std::int64_t> all;  // [source rank][size()]

  std::int64_t size() const { return num_experts + chunks * num_ranks + chunks * num_rdma_ranks; }
  // Where each count sits in a rank's block.
  std::int64_t expert_at(std::int64_t e) const { return e; }
  std::int64_t rank_at(std::int64_t c, std::int64_t dst) const { return num_experts + c * num_ranks + dst; }
  std::int64_t domain_at(std::int64_t c, std::int64_t dst_rdma) const {
    return num_experts + chunks * num_ranks + c * num_rdma_ranks + dst_rdma;
  }
  // Group rank src's counts.
  std::int64_t per_expert(std::int64_t src, std::int64_t e) const { return of(src, expert_at(e)); }
  std::int64_t per_rank(std::int64_t src, std::int64_t c, std::int64_t dst) const { return of(src, rank_at(c, dst)); }
  std::int64_t per_domain(std::int64_t src, std::int64_t c, std::int64_t dst_rdma) const {
    return of(src, domain_at(c, dst_rdma));
  }

 private:
  std::int64_t of(std::int64_t src, std::int64_t at) const { return all[static_cast<std::size_t>(src * size() + at)]; }
};

// One row of a flex exchange: `hidden` values of `dtype` (`payload` bytes), then `meta` bytes
// (the record slots on a dispatch's first pass, the probability gradients in the backward of
// dispatch), `stride` bytes in all.
struct RowFormat {
  RowFormat(std::int64_t hidden, DType dtype, std::size_t meta)
      : hidden(hidden),
        dtype(dtype),
        payload(static_cast<std::size_t>(hidden) * dtype_size(dtype)),
        meta(meta),
        stride(static_cast<std::int64_t>(payload + meta)) {}
  std::int64_t hidden;
  DType dtype;
  std::size_t payload, meta;
  std::int64_t stride;
  // The 16-bit words `rows` rows take on the wire (packed_rows.hpp: buffers travel as BF16).
  template <class N>
  std::int64_t words(N rows) const { return static_cast<std::int64_t>(rows) * stride / 2; }
};

class FlexDispatcher : public DispatcherBase {
 public:
  std::string name() const final;

  // dispatch_preprocess, dispatch_postprocess, combine_preprocess and their backward are the
  // backend's; these phases are the same for both.
  void token_dispatch(DispatchState& s) final;
  void token_combine(DispatchState& s) final;
  Tensor combine_postprocess(DispatchState& s) final;
  void combine_postprocess_backward(DispatchState& s, const Tensor& dy) final;
  void token_combine_backward(DispatchState& s) final;
  void token_dispatch_backward(DispatchState& s) final;
  Tensor dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) final;

 protected:
  // ranks_per_domain: 0 for the ranks of a node. Collective over the group: splits it into rails
  // and domains.
  FlexDispatcher(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream, FlexBackend backend,
                 int ranks_per_domain);

  // A micro-batch's tokens cut into `chunks` chunks of `tokens` tokens (the chunk count is the
  // same on every rank).
  struct Chunking {
    std::int64_t chunks, tokens;
  };
  virtual Chunking chunking(std::int64_t num_tokens, std::int64_t max_tokens) const = 0;

  // dispatch_preprocess's shared part: the sizes and input in s, the layout in h, the counts
  // all-gather, the rail plan and s.tokens_per_local_expert. Returns the counts for the backend's
  // plan inside the domain.
  FlexCounts plan(FlexHandle& h, DispatchState& s, const Tensor& x, const TokenRoutes& r);

  // Tokens -> expert rows: the dispatch (first_pass: the records travel along; `probs` gets the
  // probabilities where the backend lands them at once) and the backward of the combine.
  virtual void scatter(FlexHandle& h, const Tensor& x, bool first_pass, Tensor& out, std::vector<float>* probs) = 0;
  // Expert rows -> tokens, summed: the combine, and the backward of the dispatch, which carries
  // the probability gradients `row_grads` and sums them into `slot_grads` [T][k] at the source.
  // Returns [T, H].
  virtual Tensor gather(FlexHandle& h, const Tensor& rows, const std::vector<float>* row_grads,
                        std::int64_t num_tokens, std::vector<float>* slot_grads) = 0;

  static RowFormat dispatch_row(const FlexHandle& h, const Tensor& x, bool first_pass) {
    return {x.dim(1), h.dtype, first_pass ? h.k * sizeof(Slot) : 0};
  }
  static RowFormat combine_row(const FlexHandle& h, const Tensor& rows, bool with_grads) {
    return {rows.dim(1), rows.dtype(), with_grads ? h.k * sizeof(float) : 0};
  }

  // The rail half of a scatter: each chunk's rows (records too on a first pass) packed by
  // destination domain and sent to the rail peer there, every chunk in flight at once.
  class RailScatter {
   public:
    RailScatter(FlexDispatcher& d, const FlexHandle& h, const Tensor& x, const RowFormat& f);
    // Waits for chunk c; its h.rail_rows(c) rows, by source domain, then token.
    const std::byte* chunk(std::int64_t c);

   private:
    FlexDispatcher& d_;
    std::vector<Tensor> send_, recv_;
    std::vector<Request> requests_;
  };

  // The rail half of a gather: per chunk the FP32 sums of the domain's rows of each rail row go
  // back to their source domain; the source sums over domains (FP32) and rounds once.
  class RailCombine {
   public:
    // One chunk's sums per rail row: [rows][H] values and [rows][k] slot gradients.
    struct Sums {
      std::vector<float> rows, slots;
    };
    RailCombine(FlexDispatcher& d, const FlexHandle& h, const RowFormat& f);
    Sums zero_sums(std::int64_t c) const;
    // Starts sending chunk c's sums back over the rail.
    void send(std::int64_t c, const Sums& sums);
    // Waits for every chunk; returns [T, H], and the slot gradients in slot_grads.
    Tensor finish(std::int64_t num_tokens, std::vector<float>* slot_grads);

   private:
    FlexDispatcher& d_;
    const FlexHandle& h_;
    RowFormat f_;
    std::vector<Tensor> send_, recv_;
    std::vector<Request> requests_;
  };

  template <class Handle = FlexHandle>
  static Handle& handle(DispatchState& s) {
    return static_cast<Handle&>(*s.handle);
  }
  int rank_of(std::int64_t rdma_rank, std::int64_t nvl_rank) const {
    return static_cast<int>(rdma_rank * num_nvl_ranks_ + nvl_rank);
  }

  const FlexBackend backend_;
  const int rank_, num_ranks_;  // in the ETP x EP group
  const int num_nvl_ranks_;     // ranks per domain
  const int num_rdma_ranks_;    // domains
  const int rdma_rank_, nvl_rank_;
  const std::unique_ptr<Communicator> rail_;  // the ranks with this nvl_rank, by rdma_rank
  const std::unique_ptr<Communicator> nvl_;   // this domain's ranks, by nvl_rank

 private:
  int domain_size(int ranks_per_domain) const;
};

std::unique_ptr<TokenDispatcher> make_deepep_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                        CommStream& stream, const FlexOptions& options);
std::unique_ptr<TokenDispatcher> make_hybridep_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                          CommStream& stream, const FlexOptions& options);

}  // namespace epx
