// Megatron-Core's MoEFlexTokenDispatcher (reference: megatron-core-design.md §1.3, §5) with CPU
// versions of its DeepEP and HybridEP backends (peers.md §2, §3), over the ETP x EP group.
//
// The group's n ranks form N = n / D domains of D consecutive ranks (DeepEP: a node; HybridEP:
// an NVLink domain, NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN). Rank q = b * D + g sits in domain
// b at local index g; its "rail" is the ranks with the same g in every domain.
//
//   dispatch_preprocess  the dispatch layout: per token the k record slots (expert, probability)
//                        and its destination ranks and domains; per chunk the tokens for each
//                        rank and domain; counts all-gathered over the group (the host sync)
//   token_dispatch       per chunk: one copy of a token per destination domain over the rail
//                        (one message per chunk, all in flight at once); as each chunk lands the
//                        rail peer forwards it inside its domain, one copy per destination rank
//                          deepep:   all-to-all-v inside the node, then the local permutation
//                                    (dispatch_postprocess), as Megatron does after DeepEP
//                          hybridep: written straight into each destination's expert-major rows
//                                    in an MPI-3 shared window (the permutation fused)
//   token_combine        the mirror: each domain sums its ranks' rows of a token (FP32) and sends
//                        one row back over the rail; the source sums over domains (FP32), so a
//                        token crosses between domains once per destination domain each way.
// The backward of dispatch is a combine (carrying the probability gradients in the record
// slots), the backward of combine a dispatch over the cached layout.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <span>

#include <fmt/format.h>

#include "epx/dispatch/dispatcher.hpp"
#include "epx/trace/trace.hpp"
#include "epx/base/error.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/process_groups.hpp"
#include "counts_exchange.hpp"
#include "traffic_counter.hpp"

namespace epx {
namespace {

// A token's record slot: a routed expert (-1: empty) and its probability, or in the backward
// the probability's gradient (then only the float travels).
struct Slot {
  std::int32_t expert = -1;
  float value = 0.f;
};
static_assert(sizeof(Slot) == 8);

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// A raw byte buffer from the tensor cache; exchanged as 16-bit words (every stride is even).
Tensor byte_buffer(std::int64_t bytes) { return Tensor::uninitialized({std::max<std::int64_t>(bytes, 2) / 2}, DType::BF16); }
std::byte* bytes_of(Tensor& t) { return static_cast<std::byte*>(t.raw()); }
const std::byte* bytes_of(const Tensor& t) { return static_cast<const std::byte*>(t.raw()); }

void add_row(float* acc, const std::byte* row, DType dt, std::int64_t h) {
  if (dt == DType::F32) {
    const auto* r = reinterpret_cast<const float*>(row);
    for (std::int64_t i = 0; i < h; ++i) acc[i] += r[i];
  } else {
    const auto* r = reinterpret_cast<const std::uint16_t*>(row);
    for (std::int64_t i = 0; i < h; ++i) acc[i] += bf16_to_float(r[i]);
  }
}
void store_row(std::byte* row, const float* acc, DType dt, std::int64_t h) {
  if (dt == DType::F32) {
    std::memcpy(row, acc, static_cast<std::size_t>(h) * sizeof(float));
  } else {
    auto* r = reinterpret_cast<std::uint16_t*>(row);
    for (std::int64_t i = 0; i < h; ++i) r[i] = float_to_bf16(acc[i]);
  }
}
float load_float(const std::byte* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One micro-batch's exchange plan (DeepEP's and HybridEP's handle). Rail rows of a chunk are
// ordered by source domain, then token.
struct FlexHandle final : DispatchHandle {
  DType dtype = DType::F32;
  std::int64_t chunks = 1;
  int k = 1;
  std::vector<Slot> records;                             // [T][k] this rank's tokens
  std::vector<std::vector<std::int32_t>> send_tokens;    // [C][N] own tokens for domain b
  std::vector<std::int64_t> rail_recv;                   // [C][N] rows from source domain a
  std::int64_t rail_rows(std::int64_t c, int domains) const {
    return std::accumulate(rail_recv.begin() + c * domains, rail_recv.begin() + (c + 1) * domains, std::int64_t{0});
  }
  // deepep: rail rows of chunk c forwarded to local rank j, rows received from each forwarder,
  // the received rows (packed, for dispatch_postprocess) and their local permutation.
  std::vector<std::vector<std::int32_t>> forward_rows;   // [C][D]
  std::vector<std::int64_t> local_recv;                  // [C][D]
  Tensor received;
  std::int64_t received_stride = 0;
  Permutation local;
  std::vector<std::int32_t> row_slot;                    // per expert row: its record slot
  // hybridep: where each rail row of a chunk is written (rank j's window row, record slot),
  // the next free window row per (j, local expert, source domain), and rows per domain rank.
  struct Write {
    std::int32_t rail_row, rank, window_row, slot;
  };
  std::vector<std::vector<Write>> writes;                // [C]
  std::vector<std::int64_t> window_next;                 // [D][L][N]
  std::vector<std::int64_t> window_rows;                 // [D]
};

class FlexDispatcher final : public TokenDispatcher {
 public:
  FlexDispatcher(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream, FlexOptions opt)
      : num_experts_(num_experts),
        opt_(std::move(opt)),
        group_(groups.get(GroupKind::tp_ep)),
        ep_(groups.get(GroupKind::ep)),
        etp_(groups.get(GroupKind::etp)),
        stream_(stream),
        counts_(groups.dispatch_counts()),
        node_of_(node_of_each_rank(group_)),
        traffic_(node_of_, group_.rank()) {
    local_ = experts_per_ep_rank(num_experts, ep_.size());
    first_ = ep_.rank() * local_;
    n_ = group_.size();
    q_ = group_.rank();
    domain_ = domain_size();
    domains_ = n_ / domain_;
    b_ = q_ / domain_;
    g_ = q_ % domain_;
    for (int r = 0; r < n_; ++r) owners_.push_back(r);  // EP rank p's ETP ranks are p * ETP + t
    rail_ = group_.split(g_, b_, fmt::format("{} rail {}", group_.name(), g_));
    dom_ = group_.split(b_, g_, fmt::format("{} domain {}", group_.name(), b_));
  }

  std::string name() const override { return std::string("flex/") + to_string(opt_.backend); }
  std::int64_t num_local_experts() const override { return local_; }
  std::int64_t first_local_expert() const override { return first_; }
  int expert_tp_rank() const override { return etp_.rank(); }
  int expert_tp_size() const override { return etp_.size(); }
  TrafficBytes traffic() const override { return traffic_.total(); }

  // ------------------------------------------------------------------------ forward

  void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) override {
    auto hp = std::make_unique<FlexHandle>();
    FlexHandle& h = *hp;
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
    std::int64_t t_max = 0, k = 1;
    for (int i = 0; i < n_; ++i) {
      t_max = std::max(t_max, headers[2 * i]);
      k = std::max(k, headers[2 * i + 1]);
    }
    h.k = static_cast<int>(k);
    std::int64_t chunk_tokens = 0;
    if (opt_.backend == FlexBackend::deepep) {
      h.chunks = std::max(1, opt_.num_sms / 2);
      chunk_tokens = std::max<std::int64_t>(1, ceil_div(T, h.chunks));
    } else {
      chunk_tokens = opt_.tokens_per_chunk;
      h.chunks = std::max<std::int64_t>(1, ceil_div(t_max, chunk_tokens));
    }
    const std::int64_t C = h.chunks, N = domains_, D = domain_;

    // The layout: records, and per chunk the tokens for each rank and domain.
    const std::int64_t V = E + C * n_ + C * N;  // per-rank counts: [E], [C][n], [C][N]
    std::vector<std::int64_t> mine(static_cast<std::size_t>(V), 0);
    h.records.assign(static_cast<std::size_t>(T * k), Slot{});
    h.send_tokens.assign(static_cast<std::size_t>(C * N), {});
    const float* probs = r.probs.data<float>();
    std::vector<std::uint8_t> to_rank(static_cast<std::size_t>(n_)), to_domain(static_cast<std::size_t>(N));
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t c = t / chunk_tokens;
      std::fill(to_rank.begin(), to_rank.end(), 0);
      int slot = 0;
      for (std::int64_t e = 0; e < E; ++e) {
        if (!r.routing_map[static_cast<std::size_t>(t * E + e)]) continue;
        h.records[static_cast<std::size_t>(t * k + slot++)] = {static_cast<std::int32_t>(e), probs[t * E + e]};
        ++mine[static_cast<std::size_t>(e)];
        for (int o : owners(e)) to_rank[static_cast<std::size_t>(o)] = 1;
      }
      std::fill(to_domain.begin(), to_domain.end(), 0);
      for (int o = 0; o < n_; ++o)
        if (to_rank[static_cast<std::size_t>(o)]) {
          ++mine[static_cast<std::size_t>(E + c * n_ + o)];
          to_domain[static_cast<std::size_t>(o / D)] = 1;
        }
      for (std::int64_t b = 0; b < N; ++b)
        if (to_domain[static_cast<std::size_t>(b)]) {
          ++mine[static_cast<std::size_t>(E + C * n_ + c * N + b)];
          h.send_tokens[static_cast<std::size_t>(c * N + b)].push_back(static_cast<std::int32_t>(t));
        }
    }
    const std::vector<std::int64_t> all = allgather_counts(counts_, mine.data(), V);
    traffic_.add_to_all(0, V * 8 + 16);
    const auto per_expert = [&](std::int64_t src, std::int64_t e) { return all[static_cast<std::size_t>(src * V + e)]; };
    const auto per_rank = [&](std::int64_t src, std::int64_t c, std::int64_t o) {
      return all[static_cast<std::size_t>(src * V + E + c * n_ + o)];
    };
    const auto per_domain = [&](std::int64_t src, std::int64_t c, std::int64_t b) {
      return all[static_cast<std::size_t>(src * V + E + C * n_ + c * N + b)];
    };

    h.rail_recv.assign(static_cast<std::size_t>(C * N), 0);
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t a = 0; a < N; ++a) h.rail_recv[static_cast<std::size_t>(c * N + a)] = per_domain(a * D + g_, c, b_);
    s.tokens_per_local_expert.assign(static_cast<std::size_t>(local_), 0);
    for (std::int64_t l = 0; l < local_; ++l)
      for (int src = 0; src < n_; ++src) s.tokens_per_local_expert[static_cast<std::size_t>(l)] += per_expert(src, first_ + l);

    if (opt_.backend == FlexBackend::deepep) {
      h.local_recv.assign(static_cast<std::size_t>(C * D), 0);
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t j = 0; j < D; ++j)
          for (std::int64_t a = 0; a < N; ++a) h.local_recv[static_cast<std::size_t>(c * D + j)] += per_rank(a * D + j, c, q_);
    } else {
      // Each domain rank's window holds its experts' rows, expert-major, sources in rank order
      // (the order the alltoall dispatcher gives them). This rank, as the rail peer of sources
      // a * D + g, writes their rows; window_next starts at each source's first row.
      h.window_rows.assign(static_cast<std::size_t>(D), 0);
      h.window_next.assign(static_cast<std::size_t>(D * local_ * N), 0);
      for (std::int64_t j = 0; j < D; ++j) {
        const std::int64_t first = expert_rank_of(b_ * D + j) * local_;
        std::int64_t row = 0;
        for (std::int64_t l = 0; l < local_; ++l)
          for (int src = 0; src < n_; ++src) {
            if (src % D == g_) h.window_next[static_cast<std::size_t>((j * local_ + l) * N + src / D)] = row;
            row += per_expert(src, first + l);
          }
        h.window_rows[static_cast<std::size_t>(j)] = row;
      }
    }
    s.handle = std::move(hp);
  }

  void token_dispatch(DispatchState& s) override {
    s.pending = stream_.submit([this, &s] {
      FlexHandle& h = handle(s);
      const Tensor x = std::move(s.hidden);
      scatter(h, x, true, s.hidden, &s.probs);
    }, trace::kDispatch);
  }

  void dispatch_postprocess(DispatchState& s) override {
    s.pending.wait();
    if (opt_.backend != FlexBackend::deepep) return;
    // Megatron's local permutation after DeepEP: received rows -> this rank's experts.
    FlexHandle& h = handle(s);
    const std::int64_t R = h.received_stride ? h.received.nbytes() / h.received_stride : 0;
    const std::size_t rb = row_bytes(s);
    std::vector<std::uint8_t> map(static_cast<std::size_t>(R * local_), 0);
    std::vector<float> prob(map.size());
    std::vector<std::int32_t> slot_of(map.size());
    const std::byte* in = bytes_of(h.received);
    for (std::int64_t i = 0; i < R; ++i)
      for (int j = 0; j < h.k; ++j) {
        Slot sl;
        std::memcpy(&sl, in + i * h.received_stride + rb + j * sizeof(Slot), sizeof sl);
        if (sl.expert < first_ || sl.expert >= first_ + local_) continue;
        const auto at = static_cast<std::size_t>(i * local_ + sl.expert - first_);
        map[at] = 1;
        prob[at] = sl.value;
        slot_of[at] = j;
      }
    h.local = make_permutation(map.data(), R, local_);
    s.hidden = gather_rows(in, h.received_stride, h.local, s.hidden_size, h.dtype);
    s.probs.resize(static_cast<std::size_t>(h.local.rows()));
    h.row_slot.resize(s.probs.size());
    for (std::int64_t row = 0; row < h.local.rows(); ++row) {
      const auto at = static_cast<std::size_t>(h.local.row_token[row] * local_ + h.local.row_expert[row]);
      s.probs[static_cast<std::size_t>(row)] = prob[at];
      h.row_slot[static_cast<std::size_t>(row)] = slot_of[at];
    }
    h.received = Tensor();
  }

  void combine_preprocess(DispatchState& s, Tensor expert_output) override {
    if (opt_.backend == FlexBackend::deepep) {  // Megatron's local unpermutation before DeepEP's combine
      FlexHandle& h = handle(s);
      auto out = Tensor::uninitialized({h.local.num_tokens, s.hidden_size}, expert_output.dtype());
      unpermute_rows(expert_output, h.local, out);
      s.hidden = std::move(out);
    } else {
      s.hidden = std::move(expert_output);
    }
  }

  void token_combine(DispatchState& s) override {
    s.pending = stream_.submit([this, &s] {
      const Tensor rows = std::move(s.hidden);
      s.hidden = gather(handle(s), rows, nullptr, s.num_tokens, nullptr);
    }, trace::kCombine);
  }

  Tensor combine_postprocess(DispatchState& s) override {
    s.pending.wait();
    return std::move(s.hidden);
  }

  // ----------------------------------------------------------------------- backward

  void combine_postprocess_backward(DispatchState& s, const Tensor& dy) override { s.grad = dy; }

  void token_combine_backward(DispatchState& s) override {
    s.pending = stream_.submit([this, &s] {
      const Tensor dy = std::move(s.grad);
      scatter(handle(s), dy, false, s.grad, nullptr);
    }, trace::kCombineBackward);
  }

  void combine_preprocess_backward(DispatchState& s) override {
    s.pending.wait();
    if (opt_.backend != FlexBackend::deepep) return;
    FlexHandle& h = handle(s);
    s.grad = gather_rows(bytes_of(h.received), h.received_stride, h.local, s.hidden_size, h.dtype);
    h.received = Tensor();
  }

  void dispatch_postprocess_backward(DispatchState& s, Tensor dx, std::vector<float> dprobs) override {
    if (opt_.backend == FlexBackend::deepep) {
      // Local unpermutation, and each row's probability gradient into its token's record slot.
      FlexHandle& h = handle(s);
      auto summed = Tensor::uninitialized({h.local.num_tokens, s.hidden_size}, dx.dtype());
      unpermute_rows(dx, h.local, summed);
      s.grad = std::move(summed);
      s.grad_probs.assign(static_cast<std::size_t>(h.local.num_tokens * h.k), 0.f);
      for (std::int64_t row = 0; row < h.local.rows(); ++row)
        s.grad_probs[static_cast<std::size_t>(h.local.row_token[row] * h.k + h.row_slot[row])] += dprobs[static_cast<std::size_t>(row)];
    } else {
      s.grad = std::move(dx);
      s.grad_probs = std::move(dprobs);
    }
  }

  void token_dispatch_backward(DispatchState& s) override {
    s.pending = stream_.submit([this, &s] {
      const Tensor rows = std::move(s.grad);
      const std::vector<float> row_grads = std::move(s.grad_probs);
      s.grad = gather(handle(s), rows, &row_grads, s.num_tokens, &s.grad_probs);
    }, trace::kDispatchBackward);
  }

  Tensor dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) override {
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

 private:
  static FlexHandle& handle(DispatchState& s) { return static_cast<FlexHandle&>(*s.handle); }
  static std::size_t row_bytes(const DispatchState& s) {
    return static_cast<std::size_t>(s.hidden_size) * dtype_size(handle_of(s).dtype);
  }
  static const FlexHandle& handle_of(const DispatchState& s) { return static_cast<const FlexHandle&>(*s.handle); }
  std::int64_t expert_rank_of(std::int64_t group_rank) const { return group_rank / etp_.size(); }
  // The group ranks that hold expert e: its EP rank's ETP ranks (group rank = ep * ETP + etp).
  std::span<const int> owners(std::int64_t e) const {
    const std::size_t etp = static_cast<std::size_t>(etp_.size());
    return {owners_.data() + static_cast<std::size_t>(e / local_) * etp, etp};
  }

  // DeepEP: the ranks of a node (they must be consecutive in the group). HybridEP: the
  // configured domain size, which must divide the group and whose ranks must share memory.
  int domain_size() const {
    int on_my_node = 0;
    for (int o = 0; o < n_; ++o) on_my_node += node_of_[static_cast<std::size_t>(o)] == node_of_[static_cast<std::size_t>(q_)];
    const auto nodes_contiguous = [&](int d) {
      if (n_ % d != 0) return false;
      for (int o = 0; o < n_; ++o)
        if (node_of_[static_cast<std::size_t>(o)] != node_of_[static_cast<std::size_t>(o - o % d)]) return false;
      return true;
    };
    const std::string where = fmt::format("the ETP x EP group {} spans nodes {}", group_.name(), fmt::join(node_of_, " "));
    if (opt_.backend == FlexBackend::deepep || opt_.ranks_per_domain == 0) {
      if (!nodes_contiguous(on_my_node))
        throw EnvironmentError(fmt::format(
            "flex/{} needs the ranks of each node to be consecutive and equal in number within the "
            "expert group, but {} (the node of each group rank); launch with mpirun's default "
            "--map-by slot, or set model.moe_token_dispatcher_type=alltoall",
            to_string(opt_.backend), where));
      return on_my_node;
    }
    const int d = opt_.ranks_per_domain;
    if (n_ % d != 0)
      throw ConfigError(fmt::format(
          "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN = {} does not divide the expert group size {} "
          "(expert_tensor_parallel_size x expert_model_parallel_size); set it to a divisor, for "
          "example {}",
          d, n_, std::gcd(d, n_)));
    for (int o = 0; o < n_; ++o)
      if (node_of_[static_cast<std::size_t>(o)] != node_of_[static_cast<std::size_t>(o - o % d)])
        throw EnvironmentError(fmt::format(
            "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN = {} puts ranks of different nodes in one "
            "domain, but a domain exchanges through shared memory ({}); set it to at most the "
            "ranks per node, {}",
            d, where, on_my_node));
    return d;
  }

  void count(int peer, std::int64_t payload, std::int64_t metadata) { traffic_.add(peer, payload, metadata); }

  // Rows of a packed buffer (stride bytes apart) in a permutation's order.
  static Tensor gather_rows(const std::byte* in, std::int64_t stride, const Permutation& p, std::int64_t h, DType dt) {
    auto out = Tensor::uninitialized({p.rows(), h}, dt);
    const std::size_t rb = static_cast<std::size_t>(h) * dtype_size(dt);
    std::byte* o = bytes_of(out);
#pragma omp parallel for schedule(static)
    for (std::int64_t row = 0; row < p.rows(); ++row) std::memcpy(o + row * rb, in + p.row_token[row] * stride, rb);
    return out;
  }

  // HybridEP's registered buffer: a shared window over the domain, grown (collectively, all
  // domain ranks deciding alike from the gathered counts) when a micro-batch needs more.
  void ensure_window(const FlexHandle& h, std::size_t rb) {
    const auto need = [&](std::int64_t j) {
      return h.window_rows[static_cast<std::size_t>(j)] * static_cast<std::int64_t>(rb + sizeof(float));
    };
    bool grow = !window_;
    for (int j = 0; j < domain_ && !grow; ++j) grow = need(j) > window_->segment_bytes(j);
    if (!grow) return;
    window_.reset();
    window_ = dom_->allocate_shared(need(g_) + need(g_) / 4 + (1 << 20));
    for (int j = 0; j < domain_; ++j)
      if (window_->segment_bytes(j) < need(j)) throw std::logic_error("shared window smaller than asked");
  }

  // Tokens -> expert rows. Packs each chunk's rows (and records, on the first pass) for every
  // domain, starts all rail exchanges, and delivers each chunk inside the domain as it lands.
  // Result: deepep leaves the received rows in h.received for the local permutation; hybridep
  // puts this rank's expert-major rows in `out` (and probabilities in `probs`).
  void scatter(FlexHandle& h, const Tensor& x, bool first_pass, Tensor& out, std::vector<float>* probs) {
    const std::int64_t H = x.dim(1), C = h.chunks, N = domains_, D = domain_;
    const std::size_t rb = static_cast<std::size_t>(H) * dtype_size(h.dtype);
    const std::size_t meta = first_pass ? h.k * sizeof(Slot) : 0;
    const std::int64_t stride = static_cast<std::int64_t>(rb + meta);
    const std::byte* src = bytes_of(x);
    const bool deepep = opt_.backend == FlexBackend::deepep;
    if (!deepep) ensure_window(h, rb);

    std::vector<Tensor> send(C), recv(C);
    std::vector<Request> rail(C);
    for (std::int64_t c = 0; c < C; ++c) {
      std::vector<std::int64_t> out_words(N), in_words(N);
      std::int64_t rows = 0;
      for (std::int64_t b = 0; b < N; ++b) rows += h.send_tokens[c * N + b].size();
      send[c] = byte_buffer(rows * stride);
      recv[c] = byte_buffer(h.rail_rows(c, N) * stride);
      std::byte* o = bytes_of(send[c]);
      for (std::int64_t b = 0; b < N; ++b) {
        const auto& toks = h.send_tokens[c * N + b];
        for (std::int32_t t : toks) {
          std::memcpy(o, src + t * rb, rb);
          if (meta) std::memcpy(o + rb, &h.records[static_cast<std::size_t>(t) * h.k], meta);
          o += stride;
        }
        out_words[b] = static_cast<std::int64_t>(toks.size()) * stride / 2;
        in_words[b] = h.rail_recv[c * N + b] * stride / 2;
        count(static_cast<int>(b * D + g_), toks.size() * rb, toks.size() * meta);
      }
      rail[c] = rail_->start_alltoallv(send[c].raw(), out_words, recv[c].raw(), in_words, DType::BF16);
    }

    if (deepep) {
      if (first_pass) h.forward_rows.assign(C * D, {});
      std::int64_t total = 0;
      for (auto n : h.local_recv) total += n;
      h.received = byte_buffer(total * stride);
      h.received_stride = stride;
      std::vector<Tensor> fwd(C);
      std::vector<Request> local(C);
      std::int64_t offset = 0;
      for (std::int64_t c = 0; c < C; ++c) {
        rail_->wait(rail[c]);
        const std::byte* in = bytes_of(recv[c]);
        const std::int64_t rows = h.rail_rows(c, N);
        std::vector<std::uint8_t> to(D);
        if (first_pass)  // forward each rail row to the local ranks holding one of its experts
          for (std::int64_t i = 0; i < rows; ++i) {
            std::fill(to.begin(), to.end(), 0);
            for (int j = 0; j < h.k; ++j) {
              Slot sl;
              std::memcpy(&sl, in + i * stride + rb + j * sizeof(Slot), sizeof sl);
              if (sl.expert < 0) continue;
              for (int o : owners(sl.expert))
                if (o / D == b_) to[o % D] = 1;
            }
            for (std::int64_t j = 0; j < D; ++j)
              if (to[j]) h.forward_rows[c * D + j].push_back(static_cast<std::int32_t>(i));
          }
        std::vector<std::int64_t> out_words(D), in_words(D);
        std::int64_t fwd_rows = 0;
        for (std::int64_t j = 0; j < D; ++j) fwd_rows += h.forward_rows[c * D + j].size();
        fwd[c] = byte_buffer(fwd_rows * stride);
        std::byte* o = bytes_of(fwd[c]);
        for (std::int64_t j = 0; j < D; ++j) {
          const auto& list = h.forward_rows[c * D + j];
          for (std::int32_t i : list) {
            std::memcpy(o, in + i * stride, stride);
            o += stride;
          }
          out_words[j] = static_cast<std::int64_t>(list.size()) * stride / 2;
          in_words[j] = h.local_recv[c * D + j] * stride / 2;
          count(static_cast<int>(b_ * D + j), list.size() * rb, list.size() * meta);
        }
        local[c] = dom_->start_alltoallv(fwd[c].raw(), out_words, bytes_of(h.received) + offset, in_words, DType::BF16);
        for (auto w : in_words) offset += w * 2;
      }
      for (auto& r : local) dom_->wait(r);
      return;
    }

    // hybridep: write each landed chunk straight into the destinations' expert-major rows.
    if (first_pass) h.writes.assign(C, {});
    for (std::int64_t c = 0; c < C; ++c) {
      rail_->wait(rail[c]);
      const std::byte* in = bytes_of(recv[c]);
      if (first_pass) {
        std::int64_t i = 0;
        for (std::int64_t a = 0; a < N; ++a)
          for (std::int64_t end = i + h.rail_recv[c * N + a]; i < end; ++i)
            for (int j = 0; j < h.k; ++j) {
              Slot sl;
              std::memcpy(&sl, in + i * stride + rb + j * sizeof(Slot), sizeof sl);
              if (sl.expert < 0) continue;
              for (int o : owners(sl.expert)) {
                if (o / D != b_) continue;
                const std::int64_t dj = o % D, l = sl.expert % local_;
                const std::int64_t row = h.window_next[(dj * local_ + l) * N + a]++;
                h.writes[c].push_back({static_cast<std::int32_t>(i), static_cast<std::int32_t>(dj),
                                       static_cast<std::int32_t>(row), j});
              }
            }
      }
      const auto& writes = h.writes[c];
#pragma omp parallel for schedule(static)
      for (std::size_t w = 0; w < writes.size(); ++w) {
        const auto& wr = writes[w];
        std::byte* seg = window_->segment(wr.rank);
        std::memcpy(seg + wr.window_row * rb, in + wr.rail_row * stride, rb);
        if (meta) {
          Slot sl;
          std::memcpy(&sl, in + wr.rail_row * stride + rb + wr.slot * sizeof(Slot), sizeof sl);
          std::memcpy(seg + h.window_rows[wr.rank] * rb + wr.window_row * sizeof(float), &sl.value, sizeof(float));
        }
      }
      for (const auto& wr : writes) count(static_cast<int>(b_ * D + wr.rank), rb, meta ? sizeof(float) : 0);
    }
    window_->fence();
    const std::int64_t mine = h.window_rows[g_];
    out = Tensor::uninitialized({mine, H}, h.dtype);
    const std::byte* seg = window_->segment(g_);
    std::memcpy(out.raw(), seg, mine * rb);
    if (probs) {
      probs->resize(mine);
      std::memcpy(probs->data(), seg + mine * rb, mine * sizeof(float));
    }
    window_->fence();  // the next exchange may overwrite the window
  }

  // Expert rows -> tokens, summed. `rows` are the received-order rows (deepep, after the local
  // unpermutation) or this rank's expert-major rows (hybridep); `row_grads` the probability
  // gradients (deepep: [received][k] slots; hybridep: one per expert row), summed into
  // `slot_grads` [T][k] at the source. Returns [T, H].
  Tensor gather(FlexHandle& h, const Tensor& rows, const std::vector<float>* row_grads, std::int64_t T,
                std::vector<float>* slot_grads) {
    const DType dt = rows.dtype();
    const std::int64_t H = rows.dim(1), C = h.chunks, N = domains_, D = domain_, k = h.k;
    const std::size_t rb = static_cast<std::size_t>(H) * dtype_size(dt);
    const std::size_t meta = row_grads ? k * sizeof(float) : 0;
    const std::int64_t stride = static_cast<std::int64_t>(rb + meta);
    const bool deepep = opt_.backend == FlexBackend::deepep;

    // Inside the domain: deepep sends the rows back to their forwarders; hybridep exposes them
    // in the window for the forwarders to read.
    std::vector<Tensor> back(C);
    std::vector<Request> local(C);
    Tensor packed;
    if (deepep) {
      const std::byte* src = bytes_of(rows);
      if (meta) {  // rows and their k slot gradients side by side
        packed = byte_buffer(rows.dim(0) * stride);
        std::byte* o = bytes_of(packed);
        for (std::int64_t i = 0; i < rows.dim(0); ++i) {
          std::memcpy(o + i * stride, src + i * rb, rb);
          std::memcpy(o + i * stride + rb, row_grads->data() + i * k, meta);
        }
        src = bytes_of(packed);
      }
      std::int64_t offset = 0;
      for (std::int64_t c = 0; c < C; ++c) {
        std::vector<std::int64_t> out_words(D), in_words(D);
        std::int64_t in_rows = 0;
        for (std::int64_t j = 0; j < D; ++j) {
          out_words[j] = h.local_recv[c * D + j] * stride / 2;
          in_words[j] = static_cast<std::int64_t>(h.forward_rows[c * D + j].size()) * stride / 2;
          in_rows += h.forward_rows[c * D + j].size();
          count(static_cast<int>(b_ * D + j), h.local_recv[c * D + j] * rb, h.local_recv[c * D + j] * meta);
        }
        back[c] = byte_buffer(in_rows * stride);
        local[c] = dom_->start_alltoallv(src + offset, out_words, back[c].raw(), in_words, DType::BF16);
        for (auto w : out_words) offset += w * 2;
      }
    } else {
      ensure_window(h, rb);
      const std::int64_t mine = h.window_rows[g_];
      std::byte* seg = window_->segment(g_);
      std::memcpy(seg, rows.raw(), mine * rb);
      if (meta) std::memcpy(seg + mine * rb, row_grads->data(), mine * sizeof(float));
      window_->fence();
    }

    // Each chunk: sum the domain's rows of every rail row in FP32, send them back over the rail.
    std::vector<Tensor> send(C), recv(C);
    std::vector<Request> rail(C);
    for (std::int64_t c = 0; c < C; ++c) {
      const std::int64_t rows_c = h.rail_rows(c, N);
      std::vector<float> acc(rows_c * H, 0.f), acc_slots(meta ? rows_c * k : 0, 0.f);
      if (deepep) {
        dom_->wait(local[c]);
        const std::byte* in = bytes_of(back[c]);
        for (std::int64_t j = 0; j < D; ++j)
          for (std::int32_t i : h.forward_rows[c * D + j]) {
            add_row(acc.data() + i * H, in, dt, H);
            for (std::int64_t s = 0; s < (meta ? k : 0); ++s) acc_slots[i * k + s] += load_float(in + rb + s * sizeof(float));
            in += stride;
          }
      } else {
        for (const auto& wr : h.writes[c]) {
          const std::byte* seg = window_->segment(wr.rank);
          add_row(acc.data() + wr.rail_row * H, seg + wr.window_row * rb, dt, H);
          if (meta) acc_slots[wr.rail_row * k + wr.slot] += load_float(seg + h.window_rows[wr.rank] * rb + wr.window_row * sizeof(float));
        }
      }
      send[c] = byte_buffer(rows_c * stride);
      std::byte* o = bytes_of(send[c]);
      for (std::int64_t i = 0; i < rows_c; ++i) {
        store_row(o + i * stride, acc.data() + i * H, dt, H);
        if (meta) std::memcpy(o + i * stride + rb, acc_slots.data() + i * k, meta);
      }
      std::vector<std::int64_t> out_words(N), in_words(N);
      std::int64_t in_rows = 0;
      for (std::int64_t a = 0; a < N; ++a) {
        out_words[a] = h.rail_recv[c * N + a] * stride / 2;
        in_words[a] = static_cast<std::int64_t>(h.send_tokens[c * N + a].size()) * stride / 2;
        in_rows += h.send_tokens[c * N + a].size();
        count(static_cast<int>(a * D + g_), h.rail_recv[c * N + a] * rb, h.rail_recv[c * N + a] * meta);
      }
      recv[c] = byte_buffer(in_rows * stride);
      rail[c] = rail_->start_alltoallv(send[c].raw(), out_words, recv[c].raw(), in_words, DType::BF16);
    }
    if (!deepep) window_->fence();  // the window is free for the next exchange

    // The source: sum over domains in FP32, round once.
    std::vector<float> out(T * H, 0.f);
    if (slot_grads) slot_grads->assign(T * k, 0.f);
    for (std::int64_t c = 0; c < C; ++c) {
      rail_->wait(rail[c]);
      const std::byte* in = bytes_of(recv[c]);
      for (std::int64_t b = 0; b < N; ++b)
        for (std::int32_t t : h.send_tokens[c * N + b]) {
          add_row(out.data() + t * H, in, dt, H);
          for (std::int64_t s = 0; s < (meta ? k : 0); ++s) (*slot_grads)[t * k + s] += load_float(in + rb + s * sizeof(float));
          in += stride;
        }
    }
    auto result = Tensor::uninitialized({T, H}, dt);
    for (std::int64_t t = 0; t < T; ++t) store_row(bytes_of(result) + t * rb, out.data() + t * H, dt, H);
    return result;
  }

  std::int64_t num_experts_, local_ = 1, first_ = 0;
  FlexOptions opt_;
  Communicator &group_, &ep_, &etp_;
  CommStream& stream_;
  Communicator& counts_;  // for the counts all-gathers (counts_exchange.hpp)
  std::vector<int> node_of_;  // of each group rank
  TrafficCounter traffic_;
  int n_ = 1, q_ = 0, domain_ = 1, domains_ = 1, b_ = 0, g_ = 0;
  std::unique_ptr<Communicator> rail_, dom_;
  std::vector<int> owners_;  // [EP][ETP] group ranks
  std::unique_ptr<SharedWindow> window_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_flex_dispatcher(std::int64_t num_experts, ProcessGroups& groups,
                                                      CommStream& stream, const FlexOptions& options) {
  return std::make_unique<FlexDispatcher>(num_experts, groups, stream, options);
}

}  // namespace epx
