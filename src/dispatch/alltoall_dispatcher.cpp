// Megatron-Core's MoEAlltoAllTokenDispatcher (megatron/core/transformer/moe/token_dispatcher.py)
// on MPI.
//
//   dispatch_preprocess   permutation 1 (expert-major = EP-rank-major); counts all-gather over
//                         ETP x EP, the one blocking exchange (Megatron's host sync point),
//                         except on the fused path below, whose messages carry the counts
//   token_dispatch        all-to-all-v over EP (tokens, then probabilities), all-gather-v over ETP
//   dispatch_postprocess  permutation 2: chunks [ETP][EP][local expert] -> [local expert][ETP][EP]
//   combine_preprocess    the inverse of permutation 2
// With ETP = 1 and several local experts, permutation 2 and its inverse are fused into the
// exchanges: each (rank, local expert) chunk is its own message, received where the expert-major
// (or the token side's EP-rank-major) layout puts it, so no pass over the rows is left to do. The
// dispatch then needs no counts all-gather: every chunk is sent, empty ones too, and the
// receiver probes each for its size before it receives it (dispatch_probed).
//   token_combine         reduce-scatter-v over ETP (FP32 sums of the partial FFN outputs),
//                         all-to-all-v over EP back to the tokens' ranks
//   combine_postprocess   un-permutation 1: the k copies of a token summed
// The backward runs the mirror: all-to-all-v in the other direction, all-gather <-> reduce-scatter.
//
// Communication phases submit one task to the comm stream and return; the next phase waits on
// its event. A task refers to the DispatchState, which the MoE layer's Context keeps alive until
// that wait.
#include <cstddef>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "counts_exchange.hpp"
#include "dispatcher_base.hpp"
#include "epx/trace/trace.hpp"
#include "permuter.hpp"

namespace epx {
namespace {

std::int64_t sum(const std::vector<std::int64_t>& v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); }

std::vector<std::int64_t> times(const std::vector<std::int64_t>& rows, std::int64_t h) {
  std::vector<std::int64_t> out(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * h;
  return out;
}

class AlltoallDispatcher final : public DispatcherBase {
 public:
  AlltoallDispatcher(std::int64_t num_experts, ProcessGroups& groups, CommStream& stream)
      : DispatcherBase(num_experts, groups, stream) {}

  std::string name() const override { return "alltoall"; }

  // ------------------------------------------------------------------------ forward

  void dispatch_preprocess(DispatchState& s, const Tensor& x, const TokenRoutes& r) override {
    permute_tokens(s, x, r, num_experts_);
    const int ep = ep_.size(), etp = etp_.size();
    const std::int64_t local = num_local_experts_;
    s.send_rows.assign(static_cast<std::size_t>(ep), 0);
    for (std::int64_t e = 0; e < num_experts_; ++e)
      s.send_rows[static_cast<std::size_t>(e / local)] += s.perm.tokens_per_expert[static_cast<std::size_t>(e)];
    s.chunk_rows.assign(static_cast<std::size_t>(etp * ep * local), 0);
    if (fused_regroup()) return;  // the dispatch's messages carry the counts (dispatch_probed)

    // Counts exchange: every rank's [E] counts, gathered over ETP x EP.
    const std::vector<std::int64_t> all = allgather_counts(counts_, s.perm.tokens_per_expert.data(), num_experts_);
    traffic_.add_to_all(0, num_experts_ * 8);
    for (int src_t = 0; src_t < etp; ++src_t)
      for (int src = 0; src < ep; ++src)
        for (std::int64_t l = 0; l < local; ++l)
          s.chunk_rows[static_cast<std::size_t>((src_t * ep + src) * local + l)] =
              all[static_cast<std::size_t>(group_rank(src, src_t) * num_experts_ + first_local_expert_ + l)];
    plan_receives(s);
  }

  void token_dispatch(DispatchState& s) override {
    if (fused_regroup()) return dispatch_probed(s);
    s.pending = stream_.submit([this, &s] {
      const std::int64_t h = s.hidden_size;
      auto x = Tensor::uninitialized({sum(s.recv_rows), h}, s.hidden.dtype());
      std::vector<float> p(static_cast<std::size_t>(x.dim(0)));
      Request rx = ep_.start_alltoallv(s.hidden.raw(), times(s.send_rows, h), x.raw(),
                                       times(s.recv_rows, h), x.dtype());
      Request rp = ep_.start_alltoallv(s.probs.data(), s.send_rows, p.data(), s.recv_rows, DType::F32);
      count_ep(s.send_rows, h * dtype_size(x.dtype()), 4);
      ep_.wait(rx);
      ep_.wait(rp);
      if (etp_.size() > 1) {
        count_etp_all(x.dim(0) * h * dtype_size(x.dtype()), x.dim(0) * 4);
        auto gx = Tensor::uninitialized({sum(s.etp_rows), h}, x.dtype());
        std::vector<float> gp(static_cast<std::size_t>(gx.dim(0)));
        rx = etp_.start_allgatherv(x.raw(), gx.raw(), times(s.etp_rows, h), x.dtype());
        rp = etp_.start_allgatherv(p.data(), gp.data(), s.etp_rows, DType::F32);
        etp_.wait(rx);
        etp_.wait(rp);
        x = std::move(gx);
        p = std::move(gp);
      }
      s.hidden = std::move(x);
      s.probs = std::move(p);
    }, trace::kDispatch);
  }

  void dispatch_postprocess(DispatchState& s) override {
    s.pending.wait();
    if (num_local_experts_ > 1 && !fused_regroup()) {
      s.hidden = regrouped(s, s.hidden, true);
      s.probs = regrouped(s, s.probs, true);
    }
  }

  void combine_preprocess(DispatchState& s, Tensor expert_output) override {
    s.hidden = num_local_experts_ > 1 && !fused_regroup() ? regrouped(s, expert_output, false) : std::move(expert_output);
  }

  void token_combine(DispatchState& s) override {
    if (fused_regroup()) return submit_fused(s, s.hidden, nullptr, false, trace::kCombine);
    s.pending = stream_.submit([this, &s] {
      const std::int64_t h = s.hidden_size;
      Tensor y = std::move(s.hidden);
      if (etp_.size() > 1) {
        // Each ETP rank holds a partial sum of every row (fc2 [H, F] is split by its F columns, a
        // row-parallel linear): add them in FP32.
        const Tensor partial = y.to(DType::F32);
        auto mine = Tensor::uninitialized({sum(s.recv_rows), h}, DType::F32);
        etp_.reduce_scatterv(partial.raw(), mine.raw(), times(s.etp_rows, h), DType::F32);
        count_etp(s.etp_rows, h * 4, 0);
        y = mine.to(y.dtype());
      }
      count_ep(s.recv_rows, h * dtype_size(y.dtype()), 0);
      auto out = Tensor::uninitialized({s.perm.rows(), h}, y.dtype());
      ep_.alltoallv(y.raw(), times(s.recv_rows, h), out.raw(), times(s.send_rows, h), y.dtype());
      s.hidden = std::move(out);
    }, trace::kCombine);
  }

  Tensor combine_postprocess(DispatchState& s) override {
    s.pending.wait();
    return unpermute_tokens(s);
  }

  // ----------------------------------------------------------------------- backward

  void combine_postprocess_backward(DispatchState& s, const Tensor& dy) override { permute_token_grads(s, dy); }

  void token_combine_backward(DispatchState& s) override {
    if (fused_regroup()) return submit_fused(s, s.grad, nullptr, true, trace::kCombineBackward);
    s.pending = stream_.submit([this, &s] {
      const std::int64_t h = s.hidden_size;
      auto g = Tensor::uninitialized({sum(s.recv_rows), h}, s.grad.dtype());
      ep_.alltoallv(s.grad.raw(), times(s.send_rows, h), g.raw(), times(s.recv_rows, h), g.dtype());
      count_ep(s.send_rows, h * dtype_size(g.dtype()), 0);
      if (etp_.size() > 1) {  // the backward of the reduce-scatter: every ETP rank needs all rows
        count_etp_all(g.dim(0) * h * dtype_size(g.dtype()), 0);
        auto all = Tensor::uninitialized({sum(s.etp_rows), h}, g.dtype());
        etp_.allgatherv(g.raw(), all.raw(), times(s.etp_rows, h), g.dtype());
        g = std::move(all);
      }
      s.grad = std::move(g);
    }, trace::kCombineBackward);
  }

  void combine_preprocess_backward(DispatchState& s) override {
    s.pending.wait();
    if (num_local_experts_ > 1 && !fused_regroup()) s.grad = regrouped(s, s.grad, true);
  }

  void dispatch_postprocess_backward(DispatchState& s, Tensor dx, std::vector<float> dprobs) override {
    const bool regroup = num_local_experts_ > 1 && !fused_regroup();
    s.grad = regroup ? regrouped(s, dx, false) : std::move(dx);
    s.grad_probs = regroup ? regrouped(s, dprobs, false) : std::move(dprobs);
  }

  void token_dispatch_backward(DispatchState& s) override {
    if (fused_regroup()) return submit_fused(s, s.grad, &s.grad_probs, false, trace::kDispatchBackward);
    s.pending = stream_.submit([this, &s] {
      const std::int64_t h = s.hidden_size;
      Tensor g = std::move(s.grad);
      std::vector<float> gp = std::move(s.grad_probs);
      if (etp_.size() > 1) {  // the backward of the all-gather: sum the partial input gradients
        const Tensor partial = g.to(DType::F32);
        auto mine = Tensor::uninitialized({sum(s.recv_rows), h}, DType::F32);
        std::vector<float> mine_p(static_cast<std::size_t>(mine.dim(0)));
        Request rx = etp_.start_reduce_scatterv(partial.raw(), mine.raw(), times(s.etp_rows, h), DType::F32);
        Request rp = etp_.start_reduce_scatterv(gp.data(), mine_p.data(), s.etp_rows, DType::F32);
        count_etp(s.etp_rows, h * 4, 4);
        etp_.wait(rx);
        etp_.wait(rp);
        g = mine.to(g.dtype());
        gp = std::move(mine_p);
      }
      auto out = Tensor::uninitialized({s.perm.rows(), h}, g.dtype());
      std::vector<float> out_p(static_cast<std::size_t>(s.perm.rows()));
      Request rx = ep_.start_alltoallv(g.raw(), times(s.recv_rows, h), out.raw(), times(s.send_rows, h), g.dtype());
      Request rp = ep_.start_alltoallv(gp.data(), s.recv_rows, out_p.data(), s.send_rows, DType::F32);
      count_ep(s.recv_rows, h * dtype_size(g.dtype()), 4);
      ep_.wait(rx);
      ep_.wait(rp);
      s.grad = std::move(out);
      s.grad_probs = std::move(out_p);
    }, trace::kDispatchBackward);
  }

  Tensor dispatch_preprocess_backward(DispatchState& s, Tensor& dprobs) override {
    s.pending.wait();
    return unpermute_token_grads(s, dprobs, num_experts_);
  }

 private:
  bool fused_regroup() const { return etp_.size() == 1 && num_local_experts_ > 1; }

  // What this rank receives, from s.chunk_rows ([ETP][EP][local expert]): rows per EP rank (from
  // its own ETP rank's column), per ETP rank, and per local expert.
  void plan_receives(DispatchState& s) const {
    const int ep = ep_.size(), etp = etp_.size(), t = etp_.rank();
    const std::int64_t local = num_local_experts_;
    s.recv_rows.assign(static_cast<std::size_t>(ep), 0);
    s.etp_rows.assign(static_cast<std::size_t>(etp), 0);
    s.tokens_per_local_expert.assign(static_cast<std::size_t>(local), 0);
    for (int src_t = 0; src_t < etp; ++src_t)
      for (int src = 0; src < ep; ++src)
        for (std::int64_t l = 0; l < local; ++l) {
          const std::int64_t n = s.chunk_rows[static_cast<std::size_t>((src_t * ep + src) * local + l)];
          if (src_t == t) s.recv_rows[static_cast<std::size_t>(src)] += n;
          s.etp_rows[static_cast<std::size_t>(src_t)] += n;
          s.tokens_per_local_expert[static_cast<std::size_t>(l)] += n;
        }
  }

  // Row offsets of each (EP rank p, local expert l) chunk, indexed p * local + l, on the token
  // side (EP-rank-major, the permutation's expert order) and on the expert side (expert-major).
  std::vector<std::int64_t> token_offsets(const DispatchState& s) const {
    std::vector<std::int64_t> at(s.perm.tokens_per_expert.size());
    for (std::size_t i = 1; i < at.size(); ++i) at[i] = at[i - 1] + s.perm.tokens_per_expert[i - 1];
    return at;
  }
  std::vector<std::int64_t> expert_offsets(const DispatchState& s) const {
    const int ep = ep_.size();
    const std::int64_t local = num_local_experts_;
    std::vector<std::int64_t> at(static_cast<std::size_t>(ep * local));
    std::int64_t row = 0;
    for (std::int64_t l = 0; l < local; ++l)
      for (int p = 0; p < ep; ++p) {
        at[static_cast<std::size_t>(p * local + l)] = row;
        row += s.chunk_rows[static_cast<std::size_t>(p * local + l)];
      }
    return at;
  }

  // The fused dispatch (ETP = 1) without a counts all-gather before it: every (EP rank, local
  // expert) chunk is sent, empty ones too, and the receiver learns each chunk's size from its
  // arriving message (MPI_Improbe), then receives it where the expert-major layout puts it. This
  // takes Megatron's blocking counts exchange off the compute thread: a round trip per dispatch
  // that, in a merged schedule, waited behind the other micro-batch's exchange on the link.
  // Its cost: no receive is posted before every chunk has been probed, so MPI holds the early
  // chunks as unexpected messages (a copy each, or a rendezvous that waits for its receive).
  void dispatch_probed(DispatchState& s) {
    s.pending = stream_.submit([this, &s] {
      const int ep = ep_.size();
      const std::int64_t local = num_local_experts_, h = s.hidden_size;
      const DType dt = s.hidden.dtype();
      const std::size_t row_bytes = static_cast<std::size_t>(h) * dtype_size(dt);
      // The receive buffers before the requests: an error unwinding past them cancels the
      // requests (or waits for them) while the buffers still stand.
      Tensor out;
      std::vector<float> out_probs;
      std::vector<Request> requests;
      const std::vector<std::int64_t> token_at = token_offsets(s);
      for (int p = 0; p < ep; ++p)
        for (std::int64_t l = 0; l < local; ++l) {
          const std::size_t i = static_cast<std::size_t>(p * local + l);
          const std::int64_t rows = s.perm.tokens_per_expert[i], at = token_at[i];
          const int tag = static_cast<int>(l);
          requests.push_back(ep_.start_send(static_cast<std::byte*>(s.hidden.raw()) + at * row_bytes, rows * h, dt, p, tag));
          if (rows > 0) requests.push_back(ep_.start_send(s.probs.data() + at, rows, DType::F32, p, tag + static_cast<int>(local)));
        }
      std::vector<std::unique_ptr<ProbedMessage>> messages;
      for (int p = 0; p < ep; ++p)
        for (std::int64_t l = 0; l < local; ++l) {
          auto m = ep_.probe(p, static_cast<int>(l), dt, h);
          s.chunk_rows[static_cast<std::size_t>(p * local + l)] = m->count / h;
          messages.push_back(std::move(m));
        }
      plan_receives(s);
      out = Tensor::uninitialized({sum(s.recv_rows), h}, dt);
      out_probs.assign(static_cast<std::size_t>(out.dim(0)), 0.f);
      const std::vector<std::int64_t> expert_at = expert_offsets(s);
      for (int p = 0; p < ep; ++p)
        for (std::int64_t l = 0; l < local; ++l) {
          const std::size_t i = static_cast<std::size_t>(p * local + l);
          const std::int64_t rows = s.chunk_rows[i], at = expert_at[i];
          requests.push_back(ep_.start_recv(std::move(messages[i]), static_cast<std::byte*>(out.raw()) + at * row_bytes));
          if (rows > 0) requests.push_back(ep_.start_recv(out_probs.data() + at, rows, DType::F32, p, static_cast<int>(l + local)));
        }
      count_ep(s.send_rows, h * dtype_size(dt), 4);
      for (Request& r : requests) ep_.wait(r);
      s.hidden = std::move(out);
      s.probs = std::move(out_probs);
    }, trace::kDispatch);
  }

  // One fused exchange on the comm stream (`name` in the trace): `rows` (s.hidden or s.grad) and,
  // when given, `probs` (one float per row) go to the experts' side or back, and are replaced by
  // what arrives.
  void submit_fused(DispatchState& s, Tensor& rows, std::vector<float>* probs, bool to_experts, const char* name) {
    s.pending = stream_.submit([this, &s, &rows, probs, to_experts] {
      const std::int64_t h = s.hidden_size;
      auto out = Tensor::uninitialized({to_experts ? sum(s.recv_rows) : s.perm.rows(), h}, rows.dtype());
      std::vector<float> out_probs(probs ? static_cast<std::size_t>(out.dim(0)) : 0);
      count_ep(to_experts ? s.send_rows : s.recv_rows, h * dtype_size(out.dtype()), probs ? 4 : 0);
      exchange_chunks(s, rows.raw(), out.raw(), h, out.dtype(), to_experts, probs ? probs->data() : nullptr,
                      probs ? out_probs.data() : nullptr);
      rows = std::move(out);
      if (probs) *probs = std::move(out_probs);
    }, name);
  }

  // The all-to-all with permutation 2 fused (ETP = 1): chunk (p, l) is the rows of local expert
  // l of EP rank p. On the token side they sit EP-rank-major (the permutation's expert order:
  // tokens_per_expert[p * local + l] rows); on the expert side expert-major ([l][p]:
  // chunk_rows[p * local + l] rows). `to_experts`: from the token side to the expert side
  // (dispatch, combine backward), else back. Every nonempty chunk is one message tagged with its
  // local expert; all receives are posted before any send. `probs`, when given, travel the same
  // way one float per row (the tag offset by the local expert count).
  void exchange_chunks(const DispatchState& s, const void* send, void* recv, std::int64_t h, DType dt, bool to_experts,
                       const float* probs = nullptr, float* recv_probs = nullptr) {
    const int ep = ep_.size();
    const std::int64_t local = num_local_experts_;
    const std::size_t row_bytes = static_cast<std::size_t>(h) * dtype_size(dt);
    const std::vector<std::int64_t> token_at = token_offsets(s), expert_at = expert_offsets(s);
    const auto rows_token = [&](std::size_t i) { return s.perm.tokens_per_expert[i]; };
    const auto rows_expert = [&](std::size_t i) { return s.chunk_rows[i]; };
    std::vector<Request> requests;
    const auto post = [&](bool receive) {
      for (int p = 0; p < ep; ++p)
        for (std::int64_t l = 0; l < local; ++l) {
          const std::size_t i = static_cast<std::size_t>(p * local + l);
          // A receive takes this side's layout of its destination; a send reads this side's.
          const bool expert_side = receive == to_experts;
          const std::int64_t rows = expert_side ? rows_expert(i) : rows_token(i);
          const std::int64_t row0 = expert_side ? expert_at[i] : token_at[i];
          if (rows == 0) continue;
          const int tag = static_cast<int>(l);
          if (receive) {
            requests.push_back(ep_.start_recv(static_cast<std::byte*>(recv) + row0 * row_bytes, rows * h, dt, p, tag));
            if (recv_probs) requests.push_back(ep_.start_recv(recv_probs + row0, rows, DType::F32, p, tag + static_cast<int>(local)));
          } else {
            requests.push_back(ep_.start_send(static_cast<const std::byte*>(send) + row0 * row_bytes, rows * h, dt, p, tag));
            if (probs) requests.push_back(ep_.start_send(probs + row0, rows, DType::F32, p, tag + static_cast<int>(local)));
          }
        }
    };
    post(true);
    post(false);
    for (Request& r : requests) ep_.wait(r);
  }

  // Traffic: `rows[p]` rows to EP rank p, or to ETP rank t, of row_bytes payload and meta_bytes
  // metadata each.
  void count_ep(const std::vector<std::int64_t>& rows, std::int64_t row_bytes, std::int64_t meta_bytes) {
    for (int p = 0; p < ep_.size(); ++p)
      traffic_.add(group_rank(p, etp_.rank()), rows[static_cast<std::size_t>(p)] * row_bytes,
                   rows[static_cast<std::size_t>(p)] * meta_bytes);
  }
  void count_etp(const std::vector<std::int64_t>& rows, std::int64_t row_bytes, std::int64_t meta_bytes) {
    for (int t = 0; t < etp_.size(); ++t)
      traffic_.add(group_rank(ep_.rank(), t), rows[static_cast<std::size_t>(t)] * row_bytes,
                   rows[static_cast<std::size_t>(t)] * meta_bytes);
  }
  void count_etp_all(std::int64_t payload, std::int64_t metadata) {  // the same block to every ETP rank
    count_etp(std::vector<std::int64_t>(static_cast<std::size_t>(etp_.size()), 1), payload, metadata);
  }

  // Permutation 2 ([ETP][EP][local expert] -> [local expert][ETP][EP]) and its inverse, on the
  // rows of a tensor or on one probability per row.
  void regroup(const DispatchState& s, const void* in, void* out, std::size_t row_bytes,
               bool to_expert_major) const {
    const std::int64_t sources = static_cast<std::int64_t>(ep_.size()) * etp_.size();
    const std::int64_t local = num_local_experts_;
    if (to_expert_major) transpose_chunks(in, out, row_bytes, s.chunk_rows, sources, local);
    else transpose_chunks(in, out, row_bytes, transposed_chunk_rows(s.chunk_rows, sources, local), local, sources);
  }
  Tensor regrouped(const DispatchState& s, const Tensor& in, bool to_expert_major) const {
    auto out = Tensor::uninitialized(in.shape(), in.dtype());
    regroup(s, in.raw(), out.raw(), static_cast<std::size_t>(in.dim(1)) * dtype_size(in.dtype()), to_expert_major);
    return out;
  }
  std::vector<float> regrouped(const DispatchState& s, const std::vector<float>& in, bool to_expert_major) const {
    std::vector<float> out(in.size());
    regroup(s, in.data(), out.data(), sizeof(float), to_expert_major);
    return out;
  }
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(std::int64_t num_experts,
                                                          ProcessGroups& groups, CommStream& stream) {
  return std::make_unique<AlltoallDispatcher>(num_experts, groups, stream);
}

}  // namespace epx
