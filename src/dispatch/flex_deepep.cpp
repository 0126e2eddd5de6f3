// flex/deepep: DeepEP's normal (high-throughput) dispatch and combine across nodes
// (csrc/deep_ep.cpp, Buffer::internode_dispatch / internode_combine), as Megatron-Core's
// _DeepepManager drives them (megatron/core/transformer/moe/token_dispatcher.py, fused_a2a.py).
// A domain is a node. The tokens are cut into num_sms / 2 chunks, as DeepEP runs num_sms / 2
// channels of two SMs each (Buffer::intranode_dispatch, num_channels); each chunk crosses the
// rail as its own message, and as it lands the rail peer forwards its rows to the node's ranks
// that hold one of their experts, by an all-to-all-v inside the node. The received rows come
// unpermuted: Megatron permutes them by local expert after the dispatch
// (get_permuted_hidden_states_by_experts) and unpermutes them before the combine.
#include <algorithm>
#include <cstring>

#include "flex_dispatcher.hpp"
#include "packed_rows.hpp"
#include "permuter.hpp"

namespace epx {
namespace {

struct DeepEPHandle final : FlexHandle {
  // Per chunk: the rail rows this rank forwards to each rank of its node, and the rows it
  // receives from each of them (its forwarders).
  std::vector<std::vector<std::int32_t>> forward_rows;  // [C][num_nvl_ranks]
  std::vector<std::int64_t> nvl_recv;                    // [C][num_nvl_ranks]
  // The received rows (packed, `received_stride` bytes apart) and Megatron's local permutation
  // of them, with the record slot of each expert row.
  Tensor received;
  std::int64_t received_stride = 0;
  Permutation local;
  std::vector<std::int32_t> row_slot;
};

class DeepEPDispatcher final : public FlexDispatcher {
 public:
  DeepEPDispatcher(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream, const FlexOptions& options)
      : FlexDispatcher(num_experts, groups, stream, FlexBackend::deepep, 0),
        channels_(std::max(1, options.num_sms / 2)) {}

  void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) override {
    auto h = std::make_unique<DeepEPHandle>();
    const FlexCounts counts = plan(*h, s, x, r);
    h->nvl_recv.assign(static_cast<std::size_t>(h->chunks * num_nvl_ranks_), 0);
    for (std::int64_t c = 0; c < h->chunks; ++c)
      for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl)  // from forwarder nvl: its rail's sources
        for (std::int64_t src_rdma = 0; src_rdma < num_rdma_ranks_; ++src_rdma)
          h->nvl_recv[static_cast<std::size_t>(c * num_nvl_ranks_ + nvl)] += counts.per_rank(rank_of(src_rdma, nvl), c, rank_);
    s.handle = std::move(h);
  }

  // Megatron's local permutation after DeepEP: the received rows -> this rank's experts.
  void dispatch_postprocess(DispatchState& s) override {
    s.pending.wait();
    DeepEPHandle& h = handle<DeepEPHandle>(s);
    const std::int64_t R = h.received_stride ? h.received.nbytes() / h.received_stride : 0;
    const std::int64_t L = num_local_experts_, first = first_local_expert_;
    const std::size_t payload = static_cast<std::size_t>(s.hidden_size) * dtype_size(h.dtype);
    std::vector<std::uint8_t> map(static_cast<std::size_t>(R * L), 0);
    std::vector<float> prob(map.size());
    std::vector<std::int32_t> slot_of(map.size());
    const std::byte* in = bytes_of(h.received);
    for (std::int64_t i = 0; i < R; ++i)
      for (int slot = 0; slot < h.k; ++slot) {
        Slot sl;
        std::memcpy(&sl, in + i * h.received_stride + payload + slot * sizeof(Slot), sizeof sl);
        if (sl.expert < first || sl.expert >= first + L) continue;
        const auto at = static_cast<std::size_t>(i * L + sl.expert - first);
        map[at] = 1;
        prob[at] = sl.value;
        slot_of[at] = slot;
      }
    h.local = make_permutation(map.data(), R, L);
    s.hidden = permuted(in, h.received_stride, h.local, s.hidden_size, h.dtype);
    s.probs = permuted_probs(prob.data(), L, h.local);
    h.row_slot.resize(static_cast<std::size_t>(h.local.rows()));
    for (std::int64_t row = 0; row < h.local.rows(); ++row)
      h.row_slot[static_cast<std::size_t>(row)] =
          slot_of[static_cast<std::size_t>(h.local.row_token[row] * L + h.local.row_expert[row])];
    h.received = Tensor();
  }

  // Megatron's local unpermutation before DeepEP's combine.
  void combine_preprocess(DispatchState& s, Tensor expert_output) override {
    s.hidden = unpermuted(expert_output, handle<DeepEPHandle>(s).local);
  }

  void combine_preprocess_backward(DispatchState& s) override {
    s.pending.wait();
    DeepEPHandle& h = handle<DeepEPHandle>(s);
    s.grad = permuted(bytes_of(h.received), h.received_stride, h.local, s.hidden_size, h.dtype);
    h.received = Tensor();
  }

  // The local unpermutation, and each row's probability gradient into its token's record slot.
  void dispatch_postprocess_backward(DispatchState& s, Tensor dx, std::vector<float> dprobs) override {
    const DeepEPHandle& h = handle<DeepEPHandle>(s);
    s.grad = unpermuted(dx, h.local);
    s.grad_probs.assign(static_cast<std::size_t>(h.local.num_tokens * h.k), 0.f);
    for (std::int64_t row = 0; row < h.local.rows(); ++row)
      s.grad_probs[static_cast<std::size_t>(h.local.row_token[row] * h.k + h.row_slot[row])] += dprobs[static_cast<std::size_t>(row)];
  }

 private:
  Chunking chunking(std::int64_t num_tokens, std::int64_t) const override {
    return {channels_, std::max<std::int64_t>(1, ceil_div(num_tokens, channels_))};
  }

  // Leaves the received rows in h.received for dispatch_postprocess or
  // combine_preprocess_backward.
  void scatter(FlexHandle& base, const Tensor& x, bool first_pass, Tensor&, std::vector<float>*) override {
    DeepEPHandle& h = static_cast<DeepEPHandle&>(base);
    const RowFormat f = dispatch_row(h, x, first_pass);
    RailScatter rail(*this, h, x, f);
    const std::int64_t C = h.chunks;
    if (first_pass) h.forward_rows.assign(C * num_nvl_ranks_, {});
    std::int64_t total = 0;
    for (auto n : h.nvl_recv) total += n;
    h.received = byte_buffer(total * f.stride);
    h.received_stride = f.stride;
    std::vector<Tensor> forward(C);
    std::vector<Request> requests(C);
    std::int64_t offset = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const std::byte* in = rail.chunk(c);
      const std::int64_t rows = h.rail_rows(c, num_rdma_ranks_);
      std::vector<std::uint8_t> to(num_nvl_ranks_);
      if (first_pass)  // forward each rail row to the node's ranks holding one of its experts
        for (std::int64_t i = 0; i < rows; ++i) {
          std::fill(to.begin(), to.end(), 0);
          for (int slot = 0; slot < h.k; ++slot) {
            Slot sl;
            std::memcpy(&sl, in + i * f.stride + f.payload + slot * sizeof(Slot), sizeof sl);
            if (sl.expert < 0) continue;
            for (int dst : owners(sl.expert))
              if (dst / num_nvl_ranks_ == rdma_rank_) to[dst % num_nvl_ranks_] = 1;
          }
          for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl)
            if (to[nvl]) h.forward_rows[c * num_nvl_ranks_ + nvl].push_back(static_cast<std::int32_t>(i));
        }
      std::vector<std::int64_t> out_words(num_nvl_ranks_), in_words(num_nvl_ranks_);
      std::int64_t forward_count = 0;
      for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl) forward_count += h.forward_rows[c * num_nvl_ranks_ + nvl].size();
      forward[c] = byte_buffer(forward_count * f.stride);
      std::byte* o = bytes_of(forward[c]);
      for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl) {
        const auto& list = h.forward_rows[c * num_nvl_ranks_ + nvl];
        for (std::int32_t i : list) {
          std::memcpy(o, in + i * f.stride, f.stride);
          o += f.stride;
        }
        out_words[nvl] = f.words(list.size());
        in_words[nvl] = f.words(h.nvl_recv[c * num_nvl_ranks_ + nvl]);
        traffic_.add(rank_of(rdma_rank_, nvl), list.size() * f.payload, list.size() * f.meta);
      }
      requests[c] = nvl_->start_alltoallv(forward[c].raw(), out_words, bytes_of(h.received) + offset, in_words, DType::BF16);
      for (auto w : in_words) offset += w * 2;
    }
    for (auto& r : requests) nvl_->wait(r);
  }

  // `rows` are the received rows (after the local unpermutation) and `row_grads` their [R][k]
  // slot gradients: back to their forwarders inside the node, summed there, then over the rail.
  Tensor gather(FlexHandle& base, const Tensor& rows, const std::vector<float>* row_grads, std::int64_t num_tokens,
                std::vector<float>* slot_grads) override {
    DeepEPHandle& h = static_cast<DeepEPHandle&>(base);
    const RowFormat f = combine_row(h, rows, row_grads != nullptr);
    const std::int64_t H = f.hidden, C = h.chunks, k = h.k;
    const std::byte* src = bytes_of(rows);
    Tensor packed;
    if (f.meta) {  // rows and their k slot gradients side by side
      packed = byte_buffer(rows.dim(0) * f.stride);
      std::byte* o = bytes_of(packed);
      for (std::int64_t i = 0; i < rows.dim(0); ++i) {
        std::memcpy(o + i * f.stride, src + i * f.payload, f.payload);
        std::memcpy(o + i * f.stride + f.payload, row_grads->data() + i * k, f.meta);
      }
      src = bytes_of(packed);
    }
    std::vector<Tensor> back(C);
    std::vector<Request> requests(C);
    std::int64_t offset = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      std::vector<std::int64_t> out_words(num_nvl_ranks_), in_words(num_nvl_ranks_);
      std::int64_t in_rows = 0;
      for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl) {
        const std::int64_t n = h.nvl_recv[c * num_nvl_ranks_ + nvl];
        const std::size_t forwarded = h.forward_rows[c * num_nvl_ranks_ + nvl].size();
        out_words[nvl] = f.words(n);
        in_words[nvl] = f.words(forwarded);
        in_rows += forwarded;
        traffic_.add(rank_of(rdma_rank_, nvl), n * f.payload, n * f.meta);
      }
      back[c] = byte_buffer(in_rows * f.stride);
      requests[c] = nvl_->start_alltoallv(src + offset, out_words, back[c].raw(), in_words, DType::BF16);
      for (auto w : out_words) offset += w * 2;
    }

    RailCombine rail(*this, h, f);
    for (std::int64_t c = 0; c < C; ++c) {
      RailCombine::Sums sums = rail.zero_sums(c);
      nvl_->wait(requests[c]);
      const std::byte* in = bytes_of(back[c]);
      for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl)
        for (std::int32_t i : h.forward_rows[c * num_nvl_ranks_ + nvl]) {
          add_row(sums.rows.data() + i * H, in, f.dtype, H);
          for (std::int64_t s = 0; s < (f.meta ? k : 0); ++s) sums.slots[i * k + s] += load_float(in + f.payload + s * sizeof(float));
          in += f.stride;
        }
      rail.send(c, sums);
    }
    return rail.finish(num_tokens, slot_grads);
  }

  const std::int64_t channels_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_deepep_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                        CommStream& stream, const FlexOptions& options) {
  return std::make_unique<DeepEPDispatcher>(num_experts, groups, stream, options);
}

}  // namespace epx
