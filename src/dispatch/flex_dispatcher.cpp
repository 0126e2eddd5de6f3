#include "flex_dispatcher.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "counts_exchange.hpp"
#include "epx/base/error.hpp"
#include "epx/trace/trace.hpp"
#include "packed_rows.hpp"

namespace epx {

FlexDispatcher::FlexDispatcher(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream,
                               FlexBackend backend, int ranks_per_domain)
    : DispatcherBase(num_experts, groups, stream),
      backend_(backend),
      rank_(tp_ep_.rank()),
      num_ranks_(tp_ep_.size()),
      num_nvl_ranks_(domain_size(ranks_per_domain)),
      num_rdma_ranks_(num_ranks_ / num_nvl_ranks_),
      rdma_rank_(rank_ / num_nvl_ranks_),
      nvl_rank_(rank_ % num_nvl_ranks_),
      rail_(tp_ep_.split(nvl_rank_, rdma_rank_, fmt::format("{} rail {}", tp_ep_.name(), nvl_rank_))),
      nvl_(tp_ep_.split(rdma_rank_, nvl_rank_, fmt::format("{} domain {}", tp_ep_.name(), rdma_rank_))) {}

std::string FlexDispatcher::name() const { return std::string("flex/") + to_string(backend_); }

// DeepEP: the ranks of a node (they must be consecutive in the group). HybridEP: the configured
// domain size, which must divide the group and whose ranks must share memory.
int FlexDispatcher::domain_size(int ranks_per_domain) const {
  const std::vector<int>& node_of = traffic_.node_of();
  const auto node = [&](int r) { return node_of[static_cast<std::size_t>(r)]; };
  int on_my_node = 0;
  for (int r = 0; r < num_ranks_; ++r) on_my_node += node(r) == node(rank_);
  const auto nodes_contiguous = [&](int d) {
    if (num_ranks_ % d != 0) return false;
    for (int r = 0; r < num_ranks_; ++r)
      if (node(r) != node(r - r % d)) return false;
    return true;
  };
  const std::string where = fmt::format("the ETP x EP group {} spans nodes {}", tp_ep_.name(), fmt::join(node_of, " "));
  if (ranks_per_domain == 0) {
    if (!nodes_contiguous(on_my_node))
      throw EnvironmentError(fmt::format(
          "flex/{} needs the ranks of each node to be consecutive and equal in number within the "
          "expert group, but {} (the node of each group rank); launch with mpirun's default "
          "--map-by slot, or set model.moe_token_dispatcher_type=alltoall",
          to_string(backend_), where));
    return on_my_node;
  }
  const int d = ranks_per_domain;
  if (num_ranks_ % d != 0)
    throw ConfigError(fmt::format(
        "[hybridep.domain_divides_ep] NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={} does not divide the "
        "expert group size {} (expert_tensor_parallel_size x expert_model_parallel_size); set it to a "
        "divisor, for example NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={}",
        d, num_ranks_, std::gcd(d, num_ranks_)));
  for (int r = 0; r < num_ranks_; ++r)
    if (node(r) != node(r - r % d))
      throw EnvironmentError(fmt::format(
          "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={} puts ranks of different nodes in one "
          "domain, but a domain exchanges through shared memory ({}); set it to at most the "
          "ranks per node, NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={}",
          d, where, on_my_node));
  return d;
}

FlexCounts FlexDispatcher::plan(FlexHandle& h, DispatchState& s, const Tensor& x, const TokenRoutes& r) {
  const std::int64_t T = x.dim(0), E = num_experts_;
  s.num_tokens = T;
  s.hidden_size = x.dim(1);
  s.hidden = x;
  h.dtype = x.dtype();

  // Header: tokens and the most experts a token is routed to (top-k, more with pad fillers).
  std::int64_t k_local = 0;
  for (std::int64_t t = 0; t < T; ++t)
    k_local = std::max<std::int64_t>(k_local, std::count(r.routing_map.begin() + t * E, r.routing_map.begin() + (t + 1) * E, 1));
  const std::int64_t header[2] = {T, k_local};
  const std::vector<std::int64_t> headers = allgather_counts(counts_, header, 2);
  std::int64_t max_tokens = 0, k = 1;
  for (int i = 0; i < num_ranks_; ++i) {
    max_tokens = std::max(max_tokens, headers[2 * i]);
    k = std::max(k, headers[2 * i + 1]);
  }
  h.k = static_cast<int>(k);
  const Chunking chunks = chunking(T, max_tokens);
  h.chunks = chunks.chunks;
  const std::int64_t C = h.chunks;

  // The layout: records, and per chunk the tokens for each rank and domain.
  FlexCounts counts{E, C, num_ranks_, num_rdma_ranks_, {}};
  std::vector<std::int64_t> mine(static_cast<std::size_t>(counts.size()), 0);
  h.records.assign(static_cast<std::size_t>(T * k), Slot{});
  h.send_tokens.assign(static_cast<std::size_t>(C * num_rdma_ranks_), {});
  const float* probs = r.probs.data<float>();
  std::vector<std::uint8_t> to_rank(static_cast<std::size_t>(num_ranks_)), to_domain(static_cast<std::size_t>(num_rdma_ranks_));
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t c = t / chunks.tokens;
    std::fill(to_rank.begin(), to_rank.end(), 0);
    int slot = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      if (!r.routing_map[static_cast<std::size_t>(t * E + e)]) continue;
      h.records[static_cast<std::size_t>(t * k + slot++)] = {static_cast<std::int32_t>(e), probs[t * E + e]};
      ++mine[static_cast<std::size_t>(counts.expert_at(e))];
      for (int dst : owners(e)) to_rank[static_cast<std::size_t>(dst)] = 1;
    }
    std::fill(to_domain.begin(), to_domain.end(), 0);
    for (int dst = 0; dst < num_ranks_; ++dst)
      if (to_rank[static_cast<std::size_t>(dst)]) {
        ++mine[static_cast<std::size_t>(counts.rank_at(c, dst))];
        to_domain[static_cast<std::size_t>(dst / num_nvl_ranks_)] = 1;
      }
    for (std::int64_t dst_rdma = 0; dst_rdma < num_rdma_ranks_; ++dst_rdma)
      if (to_domain[static_cast<std::size_t>(dst_rdma)]) {
        ++mine[static_cast<std::size_t>(counts.domain_at(c, dst_rdma))];
        h.send_tokens[static_cast<std::size_t>(c * num_rdma_ranks_ + dst_rdma)].push_back(static_cast<std::int32_t>(t));
      }
  }
  counts.all = allgather_counts(counts_, mine.data(), counts.size());
  traffic_.add_to_all(0, counts.size() * 8 + 16);

  h.rail_recv.assign(static_cast<std::size_t>(C * num_rdma_ranks_), 0);
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t src_rdma = 0; src_rdma < num_rdma_ranks_; ++src_rdma)
      h.rail_recv[static_cast<std::size_t>(c * num_rdma_ranks_ + src_rdma)] =
          counts.per_domain(rank_of(src_rdma, nvl_rank_), c, rdma_rank_);
  s.tokens_per_local_expert.assign(static_cast<std::size_t>(num_local_experts_), 0);
  for (std::int64_t l = 0; l < num_local_experts_; ++l)
    for (int src = 0; src < num_ranks_; ++src)
      s.tokens_per_local_expert[static_cast<std::size_t>(l)] += counts.per_expert(src, first_local_expert_ + l);
  return counts;
}

// ------------------------------------------------------------------ the phases both share

void FlexDispatcher::token_dispatch(DispatchState& s) {
  s.pending = stream_.submit([this, &s] {
    const Tensor x = std::move(s.hidden);
    scatter(handle(s), x, true, s.hidden, &s.probs);
  }, trace::kDispatch);
}

void FlexDispatcher::token_combine(DispatchState& s) {
  s.pending = stream_.submit([this, &s] {
    const Tensor rows = std::move(s.hidden);
    s.hidden = gather(handle(s), rows, nullptr, s.num_tokens, nullptr);
  }, trace::kCombine);
}

Tensor FlexDispatcher::combine_postprocess(DispatchState& s) {
  s.pending.wait();
  return std::move(s.hidden);
}

void FlexDispatcher::combine_postprocess_backward(DispatchState& s, const Tensor& dy) { s.grad = dy; }

void FlexDispatcher::token_combine_backward(DispatchState& s) {
  s.pending = stream_.submit([this, &s] {
    const Tensor dy = std::move(s.grad);
    scatter(handle(s), dy, false, s.grad, nullptr);
  }, trace::kCombineBackward);
}

void FlexDispatcher::token_dispatch_backward(DispatchState& s) {
  s.pending = stream_.submit([this, &s] {
    const Tensor rows = std::move(s.grad);
    const std::vector<float> row_grads = std::move(s.grad_probs);
    s.grad = gather(handle(s), rows, &row_grads, s.num_tokens, &s.grad_probs);
  }, trace::kDispatchBackward);
}

Tensor FlexDispatcher::dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) {
  s.pending.wait();
  const FlexHandle& h = handle(s);
  float* dp = dprobs.data<float>();
  for (std::int64_t t = 0; t < s.num_tokens; ++t)
    for (int j = 0; j < h.k; ++j) {
      const Slot& sl = h.records[static_cast<std::size_t>(t * h.k + j)];
      if (sl.expert >= 0) dp[t * num_experts_ + sl.expert] += s.grad_probs[static_cast<std::size_t>(t * h.k + j)];
    }
  s.grad_probs.clear();
  return std::move(s.grad);
}

// ------------------------------------------------------------------------------ the rail

FlexDispatcher::RailScatter::RailScatter(FlexDispatcher& d, const FlexHandle& h, const Tensor& x, const RowFormat& f)
    : d_(d), send_(static_cast<std::size_t>(h.chunks)), recv_(send_.size()), requests_(send_.size()) {
  const std::int64_t num_rdma = d.num_rdma_ranks_;
  const std::byte* src = bytes_of(x);
  for (std::int64_t c = 0; c < h.chunks; ++c) {
    std::vector<std::int64_t> out_words(num_rdma), in_words(num_rdma);
    std::int64_t rows = 0;
    for (std::int64_t dst_rdma = 0; dst_rdma < num_rdma; ++dst_rdma) rows += h.send_tokens[c * num_rdma + dst_rdma].size();
    send_[c] = byte_buffer(rows * f.stride);
    recv_[c] = byte_buffer(h.rail_rows(c, num_rdma) * f.stride);
    std::byte* o = bytes_of(send_[c]);
    for (std::int64_t dst_rdma = 0; dst_rdma < num_rdma; ++dst_rdma) {
      const auto& tokens = h.send_tokens[c * num_rdma + dst_rdma];
      for (std::int32_t t : tokens) {
        std::memcpy(o, src + t * f.payload, f.payload);
        if (f.meta) std::memcpy(o + f.payload, &h.records[static_cast<std::size_t>(t) * h.k], f.meta);
        o += f.stride;
      }
      out_words[dst_rdma] = f.words(tokens.size());
      in_words[dst_rdma] = f.words(h.rail_recv[c * num_rdma + dst_rdma]);
      d.traffic_.add(d.rank_of(dst_rdma, d.nvl_rank_), tokens.size() * f.payload, tokens.size() * f.meta);
    }
    requests_[c] = d.rail_->start_alltoallv(send_[c].raw(), out_words, recv_[c].raw(), in_words, DType::BF16);
  }
}

const std::byte* FlexDispatcher::RailScatter::chunk(std::int64_t c) {
  d_.rail_->wait(requests_[c]);
  return bytes_of(recv_[c]);
}

FlexDispatcher::RailCombine::RailCombine(FlexDispatcher& d, const FlexHandle& h, const RowFormat& f)
    : d_(d), h_(h), f_(f), send_(static_cast<std::size_t>(h.chunks)), recv_(send_.size()), requests_(send_.size()) {}

FlexDispatcher::RailCombine::Sums FlexDispatcher::RailCombine::zero_sums(std::int64_t c) const {
  const std::int64_t rows = h_.rail_rows(c, d_.num_rdma_ranks_);
  return {std::vector<float>(rows * f_.hidden, 0.f), std::vector<float>(f_.meta ? rows * h_.k : 0, 0.f)};
}

void FlexDispatcher::RailCombine::send(std::int64_t c, const Sums& sums) {
  const std::int64_t num_rdma = d_.num_rdma_ranks_, H = f_.hidden, k = h_.k;
  const std::int64_t rows = h_.rail_rows(c, num_rdma);
  send_[c] = byte_buffer(rows * f_.stride);
  std::byte* o = bytes_of(send_[c]);
  for (std::int64_t i = 0; i < rows; ++i) {
    store_row(o + i * f_.stride, sums.rows.data() + i * H, f_.dtype, H);
    if (f_.meta) std::memcpy(o + i * f_.stride + f_.payload, sums.slots.data() + i * k, f_.meta);
  }
  std::vector<std::int64_t> out_words(num_rdma), in_words(num_rdma);
  std::int64_t in_rows = 0;
  for (std::int64_t src_rdma = 0; src_rdma < num_rdma; ++src_rdma) {
    const std::int64_t back = h_.rail_recv[c * num_rdma + src_rdma];
    const std::size_t tokens = h_.send_tokens[c * num_rdma + src_rdma].size();
    out_words[src_rdma] = f_.words(back);
    in_words[src_rdma] = f_.words(tokens);
    in_rows += tokens;
    d_.traffic_.add(d_.rank_of(src_rdma, d_.nvl_rank_), back * f_.payload, back * f_.meta);
  }
  recv_[c] = byte_buffer(in_rows * f_.stride);
  requests_[c] = d_.rail_->start_alltoallv(send_[c].raw(), out_words, recv_[c].raw(), in_words, DType::BF16);
}

Tensor FlexDispatcher::RailCombine::finish(std::int64_t num_tokens, std::vector<float>* slot_grads) {
  const std::int64_t num_rdma = d_.num_rdma_ranks_, H = f_.hidden, k = h_.k;
  std::vector<float> out(num_tokens * H, 0.f);
  if (slot_grads) slot_grads->assign(num_tokens * k, 0.f);
  for (std::int64_t c = 0; c < h_.chunks; ++c) {
    d_.rail_->wait(requests_[c]);
    const std::byte* in = bytes_of(recv_[c]);
    for (std::int64_t dst_rdma = 0; dst_rdma < num_rdma; ++dst_rdma)
      for (std::int32_t t : h_.send_tokens[c * num_rdma + dst_rdma]) {
        add_row(out.data() + t * H, in, f_.dtype, H);
        for (std::int64_t s = 0; s < (f_.meta ? k : 0); ++s)
          (*slot_grads)[t * k + s] += load_float(in + f_.payload + s * sizeof(float));
        in += f_.stride;
      }
  }
  auto result = Tensor::uninitialized({num_tokens, H}, f_.dtype);
  for (std::int64_t t = 0; t < num_tokens; ++t) store_row(bytes_of(result) + t * f_.payload, out.data() + t * H, f_.dtype, H);
  return result;
}

// ---------------------------------------------------------------------------- the factory

std::unique_ptr<TokenDispatcher> make_flex_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                      CommStream& stream, const FlexOptions& options) {
  return options.backend == FlexBackend::deepep ? make_deepep_dispatcher(num_experts, groups, stream, options)
                                                : make_hybridep_dispatcher(num_experts, groups, stream, options);
}

}  // namespace epx
