// flex/hybridep: HybridEP (DeepEP's hybrid-ep branch, HybridEPBuffer.dispatch_with_permute /
// combine_with_unpermute) as Megatron-Core's _HybridEPManager drives it
// (megatron/core/transformer/moe/token_dispatcher.py; fused_a2a.py, hybrid_ep_dispatch: "permute +
// dispatch a2a + permute" in one). A domain is NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN ranks
// that share memory; the tokens are cut into chunks of NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API.
// As each chunk lands over the rail, the rail peer writes its rows straight into each
// destination's expert-major rows in the domain's shared window (HybridEP's registered buffer),
// so no permutation is left for after the dispatch; the combine reads them back from there.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "flex_dispatcher.hpp"
#include "packed_rows.hpp"

namespace epx {
namespace {

struct HybridEPHandle final : FlexHandle {
  // Where this rank, as rail peer, writes each rail row of a chunk: the domain rank's window,
  // the row there, and the record slot the row's probability comes from.
  struct Write {
    std::int32_t rail_row, nvl_rank, window_row, slot;
  };
  std::vector<std::vector<Write>> writes;  // [C]
  // The next free window row per (domain rank, local expert, source domain), and the rows of
  // each domain rank's window (its experts' rows, then one probability per row).
  std::vector<std::int64_t> window_next;  // [num_nvl_ranks][L][num_rdma_ranks]
  std::vector<std::int64_t> window_rows;  // [num_nvl_ranks]
};

class HybridEPDispatcher final : public FlexDispatcher {
 public:
  HybridEPDispatcher(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream, const FlexOptions& options)
      : FlexDispatcher(num_experts, groups, stream, FlexBackend::hybridep, options.ranks_per_domain),
        tokens_per_chunk_(options.tokens_per_chunk) {}

  // Each domain rank's window holds its experts' rows, expert-major, sources in rank order (the
  // order the alltoall dispatcher gives them). This rank, as the rail peer of the sources with
  // its nvl_rank, writes their rows; window_next starts at each such source's first row.
  void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) override {
    auto h = std::make_unique<HybridEPHandle>();
    const FlexCounts counts = plan(*h, s, x, r);
    const std::int64_t L = num_local_experts_;
    h->window_rows.assign(static_cast<std::size_t>(num_nvl_ranks_), 0);
    h->window_next.assign(static_cast<std::size_t>(num_nvl_ranks_ * L * num_rdma_ranks_), 0);
    for (std::int64_t nvl = 0; nvl < num_nvl_ranks_; ++nvl) {
      const std::int64_t first = first_expert_of(rank_of(rdma_rank_, nvl));
      std::int64_t row = 0;
      for (std::int64_t l = 0; l < L; ++l)
        for (int src = 0; src < num_ranks_; ++src) {
          if (src % num_nvl_ranks_ == nvl_rank_)
            h->window_next[static_cast<std::size_t>((nvl * L + l) * num_rdma_ranks_ + src / num_nvl_ranks_)] = row;
          row += counts.per_expert(src, first + l);
        }
      h->window_rows[static_cast<std::size_t>(nvl)] = row;
    }
    s.handle = std::move(h);
  }

  // The dispatch left the rows grouped by local expert.
  void dispatch_postprocess(DispatchState& s) override { s.pending.wait(); }
  void combine_preprocess(DispatchState& s, Tensor expert_output) override { s.hidden = std::move(expert_output); }
  void combine_preprocess_backward(DispatchState& s) override { s.pending.wait(); }
  void dispatch_postprocess_backward(DispatchState& s, Tensor dx, std::vector<float> dprobs) override {
    s.grad = std::move(dx);
    s.grad_probs = std::move(dprobs);
  }

 private:
  Chunking chunking(std::int64_t, std::int64_t max_tokens) const override {
    return {std::max<std::int64_t>(1, ceil_div(max_tokens, tokens_per_chunk_)), tokens_per_chunk_};
  }

  // Puts this rank's expert-major rows in `out` (and their probabilities in `probs`).
  void scatter(FlexHandle& base, const Tensor& x, bool first_pass, Tensor& out, std::vector<float>* probs) override {
    HybridEPHandle& h = static_cast<HybridEPHandle&>(base);
    const RowFormat f = dispatch_row(h, x, first_pass);
    ensure_window(h, f.payload);
    RailScatter rail(*this, h, x, f);
    const std::int64_t C = h.chunks, L = num_local_experts_;
    if (first_pass) h.writes.assign(C, {});
    for (std::int64_t c = 0; c < C; ++c) {
      const std::byte* in = rail.chunk(c);
      if (first_pass) {
        std::int64_t i = 0;
        for (std::int64_t src_rdma = 0; src_rdma < num_rdma_ranks_; ++src_rdma)
          for (std::int64_t end = i + h.rail_recv[c * num_rdma_ranks_ + src_rdma]; i < end; ++i)
            for (int slot = 0; slot < h.k; ++slot) {
              Slot sl;
              std::memcpy(&sl, in + i * f.stride + f.payload + slot * sizeof(Slot), sizeof sl);
              if (sl.expert < 0) continue;
              for (int dst : owners(sl.expert)) {
                if (dst / num_nvl_ranks_ != rdma_rank_) continue;
                const std::int64_t dst_nvl = dst % num_nvl_ranks_, l = sl.expert % L;
                const std::int64_t row = h.window_next[(dst_nvl * L + l) * num_rdma_ranks_ + src_rdma]++;
                h.writes[c].push_back({static_cast<std::int32_t>(i), static_cast<std::int32_t>(dst_nvl),
                                       static_cast<std::int32_t>(row), slot});
              }
            }
      }
      const auto& writes = h.writes[c];
#pragma omp parallel for schedule(static)
      for (std::size_t w = 0; w < writes.size(); ++w) {
        const auto& wr = writes[w];
        std::byte* seg = window_->segment(wr.nvl_rank);
        std::memcpy(seg + wr.window_row * f.payload, in + wr.rail_row * f.stride, f.payload);
        if (f.meta) {
          Slot sl;
          std::memcpy(&sl, in + wr.rail_row * f.stride + f.payload + wr.slot * sizeof(Slot), sizeof sl);
          std::memcpy(seg + h.window_rows[wr.nvl_rank] * f.payload + wr.window_row * sizeof(float), &sl.value, sizeof(float));
        }
      }
      for (const auto& wr : writes) traffic_.add(rank_of(rdma_rank_, wr.nvl_rank), f.payload, f.meta ? sizeof(float) : 0);
    }
    window_->fence();
    const std::int64_t mine = h.window_rows[nvl_rank_];
    out = Tensor::uninitialized({mine, f.hidden}, h.dtype);
    const std::byte* seg = window_->segment(nvl_rank_);
    std::memcpy(out.raw(), seg, mine * f.payload);
    if (probs) {
      probs->resize(mine);
      std::memcpy(probs->data(), seg + mine * f.payload, mine * sizeof(float));
    }
    window_->fence();  // the next exchange may overwrite the window
  }

  // `rows` are this rank's expert-major rows and `row_grads` one probability gradient per row:
  // exposed in the window, where each rail peer reads and sums its rail rows' copies.
  Tensor gather(FlexHandle& base, const Tensor& rows, const std::vector<float>* row_grads, std::int64_t num_tokens,
                std::vector<float>* slot_grads) override {
    HybridEPHandle& h = static_cast<HybridEPHandle&>(base);
    const RowFormat f = combine_row(h, rows, row_grads != nullptr);
    const std::int64_t H = f.hidden, k = h.k;
    ensure_window(h, f.payload);
    const std::int64_t mine = h.window_rows[nvl_rank_];
    std::byte* own = window_->segment(nvl_rank_);
    std::memcpy(own, rows.raw(), mine * f.payload);
    if (f.meta) std::memcpy(own + mine * f.payload, row_grads->data(), mine * sizeof(float));
    window_->fence();

    RailCombine rail(*this, h, f);
    for (std::int64_t c = 0; c < h.chunks; ++c) {
      RailCombine::Sums sums = rail.zero_sums(c);
      for (const auto& wr : h.writes[c]) {
        const std::byte* seg = window_->segment(wr.nvl_rank);
        add_row(sums.rows.data() + wr.rail_row * H, seg + wr.window_row * f.payload, f.dtype, H);
        if (f.meta)
          sums.slots[wr.rail_row * k + wr.slot] +=
              load_float(seg + h.window_rows[wr.nvl_rank] * f.payload + wr.window_row * sizeof(float));
      }
      rail.send(c, sums);
    }
    window_->fence();  // the window is free for the next exchange
    return rail.finish(num_tokens, slot_grads);
  }

  // HybridEP's registered buffer: a shared window over the domain, grown (collectively, all
  // domain ranks deciding alike from the gathered counts) when a micro-batch needs more.
  void ensure_window(const HybridEPHandle& h, std::size_t payload) {
    const auto need = [&](int nvl) {
      return h.window_rows[static_cast<std::size_t>(nvl)] * static_cast<std::int64_t>(payload + sizeof(float));
    };
    bool grow = !window_;
    for (int nvl = 0; nvl < num_nvl_ranks_ && !grow; ++nvl) grow = need(nvl) > window_->segment_bytes(nvl);
    if (!grow) return;
    window_.reset();
    window_ = nvl_->allocate_shared(need(nvl_rank_) + need(nvl_rank_) / 4 + (1 << 20));
    for (int nvl = 0; nvl < num_nvl_ranks_; ++nvl)
      if (window_->segment_bytes(nvl) < need(nvl)) throw std::logic_error("shared window smaller than asked");
  }

  const std::int64_t tokens_per_chunk_;
  std::unique_ptr<SharedWindow> window_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_hybridep_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                          CommStream& stream, const FlexOptions& options) {
  return std::make_unique<HybridEPDispatcher>(num_experts, groups, stream, options);
}

}  // namespace epx
