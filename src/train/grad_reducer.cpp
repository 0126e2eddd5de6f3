#include "grad_reducer.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "epx/base/env.hpp"
#include "epx/base/error.hpp"

namespace epx {
namespace {

// The trace's names (epx diagnose sorts them by these words).
const char* reduce_name(bool expert) { return expert ? "expert gradient all-reduce (EDP)" : "gradient all-reduce (DP)"; }
const char* gather_name(bool expert) { return expert ? "parameter all-gather (EDP)" : "parameter all-gather (DP)"; }
constexpr const char* kRowsName = "embedding gradient rows all-gather (DP)";
// Over the pipeline's ends, not DP, but counted with the gradient reduction it follows
// (trace::is_dp_reduction; Megatron's finalize_model_grads), as the planner does.
constexpr const char* kSharedName = "embedding gradient all-reduce (pipeline stages)";

// A weight the all-gather sends as its BF16 compute copy; the rest (FP32 models, norms, the
// router) go as their FP32 masters, which the forward reads. In 2-byte units per element.
bool sent_as_bf16(const Param* p) { return p->compute.dtype() == DType::BF16; }
std::int64_t units(const Param* p) { return sent_as_bf16(p) ? 1 : 2; }

// Calls f(param, first, end) for the elements [first, end) of each param (its own numbering)
// that fall in the bucket's flat range [lo, hi), in the bucket's order.
template <class F>
void for_each_in(const std::vector<Param*>& params, std::int64_t lo, std::int64_t hi, F&& f) {
  std::int64_t at = 0;
  for (Param* p : params) {
    const std::int64_t n = p->grad.numel(), first = std::max(at, lo), end = std::min(at + n, hi);
    if (first < end) f(p, first - at, end - at);
    at += n;
  }
}

}  // namespace

GradReducer::GradReducer(const std::vector<std::vector<Param*>>& groups, std::vector<int> group_chunk,
                         const std::vector<Param*>& params, Communicator& dp, Communicator& edp, CommStream& stream,
                         const GradReduceOptions& options, int embedding_group, Param* shared_embedding)
    : stream_(stream),
      overlap_(options.overlap),
      distributed_(options.distributed),
      reduce_dtype_(options.reduce_dtype),
      group_chunk_(std::move(group_chunk)),
      completions_(groups.size(), 0),
      shared_embedding_(shared_embedding) {
  if (group_chunk_.size() != groups.size()) throw std::logic_error("GradReducer: one chunk per group");
  if (options.embedding_rows && overlap_ && dp.size() > 1) embedding_group_ = embedding_group;
  const int last = static_cast<int>(groups.size()) - 1;
  const auto max_bucket = static_cast<std::int64_t>(read_env(env::kMpiMaxCount)) / 2;
  for (const bool expert : {false, true}) {
    Communicator& comm = expert ? edp : dp;
    int first = 0;  // the group of the bucket's first weight
    const auto close = [&](Bucket& b, int group) {
      if (b.params.empty()) return;
      b.comm = &comm, b.expert = expert, b.first_group = first, b.last_group = group;
      buckets_.push_back(std::move(b));
      b = Bucket{};
    };
    Bucket b;
    std::int64_t n = 0;
    // MPI counts are ints, and the parameter all-gather counts FP32 weights in 2-byte units: a
    // bucket closes before it passes INT_MAX / 2 elements (EPX_MPI_MAX_COUNT / 2), however large bucket_size is. A
    // single weight beyond that stays one bucket: the all-reduce slices it, and the distributed
    // optimizer refuses it below.
    // `group`: the weight's; a bucket closed here is complete with group `closes_at`.
    const auto add = [&](Param* p, int group, int closes_at) {
      const bool alone = distributed_ && p == shared_embedding_;
      if (n > 0 && (alone || n + p->grad.numel() > max_bucket)) close(b, closes_at), n = 0;
      if (b.params.empty()) first = group;
      b.params.push_back(p), n += p->grad.numel();
      if (alone) close(b, closes_at), n = 0;
    };
    if (!options.overlap && options.bucket_size <= 0) {  // one bucket, in the model's order
      for (Param* p : params)
        if (p->expert == expert) add(p, 0, last);
      close(b, last);
      continue;
    }
    for (int g = 0; g <= last; ++g) {
      // The rows split's bucket, and the first stage's shared embedding (a group of its own).
      const std::vector<Param*>& group = groups[static_cast<std::size_t>(g)];
      const bool alone = !expert && (g == embedding_group_ || (distributed_ && group == std::vector<Param*>{shared_embedding_}));
      // Megatron wraps each model chunk in a DDP of its own: no bucket spans two chunks.
      const bool new_chunk = g > 0 && group_chunk_[static_cast<std::size_t>(g)] != group_chunk_[static_cast<std::size_t>(g - 1)];
      if (alone || new_chunk) close(b, g - 1), n = 0;
      for (Param* p : group)
        if (p->expert == expert) add(p, g, g);
      if (alone || (options.bucket_size > 0 && n >= options.bucket_size)) close(b, g), n = 0;
    }
    close(b, last);
  }
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    if (!buckets_[i].expert && embedding_group_ >= 0 && buckets_[i].first_group == embedding_group_)
      embedding_bucket_ = static_cast<int>(i);
    if (buckets_[i].params.front() == shared_embedding_) shared_bucket_ = static_cast<int>(i);
  }
  for (Bucket& bucket : buckets_) {
    for (const Param* p : bucket.params) bucket.size += p->grad.numel();
    if (distributed_ && bucket.comm->size() > 1 && bucket.size > max_bucket)
      throw ConfigError(fmt::format(
          "ddp.use_distributed_optimizer=true: the weight {} has {} elements, more than the {} that the "
          "distributed optimizer's reduce-scatter and all-gather carry in one MPI call (MPI counts are "
          "ints); set ddp.use_distributed_optimizer=false (its all-reduce is sliced), or make the weight "
          "smaller (a larger expert_model_parallel_size for an expert weight, a smaller vocabulary or "
          "hidden size)",
          bucket.params.front()->name, bucket.size, max_bucket));
    const std::int64_t d = bucket.comm->size(), share = (bucket.size + d - 1) / d;
    for (std::int64_t r = 0; r < d; ++r)
      bucket.shard_counts.push_back(std::clamp<std::int64_t>(bucket.size - r * share, 0, share));
    std::tie(bucket.shard_begin, bucket.shard_end) = bucket.shard_of(bucket.comm->rank());
    for (std::int64_t r = 0; r < d; ++r) {
      std::int64_t u = 0;
      const auto [lo, hi] = bucket.shard_of(r);
      for_each_in(bucket.params, lo, hi, [&](const Param* p, std::int64_t first, std::int64_t end) { u += (end - first) * units(p); });
      bucket.gather_units.push_back(u);
    }
  }
}

void GradReducer::start(int micro_batches) {
  micro_batches_ = micro_batches;
  launches_ = 0;
  std::fill(completions_.begin(), completions_.end(), 0);
  for (Bucket& b : buckets_) b.launch_order = -1;
}

void GradReducer::grads_ready(int group) {
  if (!overlap_ || ++completions_[static_cast<std::size_t>(group)] != needed(group)) return;
  // Groups need not complete in order (model chunks run their backward last chunk first): a
  // bucket starts once all of its groups are complete.
  const auto complete = [&](int g) { return completions_[static_cast<std::size_t>(g)] >= needed(g); };
  for (Bucket& b : buckets_)
    if (!b.launched() && b.first_group <= group && group <= b.last_group) {
      bool all = true;
      for (int g = b.first_group; g <= b.last_group && all; ++g) all = complete(g);
      if (all) launch(b);
    }
}

bool GradReducer::take_embedding_rows(const Tensor& tokens, const Tensor& dx) {
  if (!rows_split() || completions_[static_cast<std::size_t>(embedding_group_)] != micro_batches_ - 1) return false;
  Bucket& b = buckets_[static_cast<std::size_t>(embedding_bucket_)];
  if (!b.launched()) launch(b);  // the earlier micro-batches' sum, if no hook started it
  const std::int64_t d = b.comm->size(), T = tokens.numel(), H = dx.dim(1);
  rows_ids_ = tokens.clone();
  rows_grad_ = dx.clone();
  all_ids_ = Tensor::uninitialized({d * T}, DType::I64);
  all_grad_ = Tensor::uninitialized({d * T, H}, dx.dtype());
  rows_done_ = stream_.submit(
      [this, &b, d, T, H] {
        const std::vector<std::int64_t> ids(static_cast<std::size_t>(d), T), rows(static_cast<std::size_t>(d), T * H);
        b.comm->allgatherv(rows_ids_.raw(), all_ids_.raw(), ids, DType::I64);
        b.comm->allgatherv(rows_grad_.raw(), all_grad_.raw(), rows, rows_grad_.dtype());
      },
      kRowsName);
  return true;
}

// Every DP rank's last-micro-batch rows into the embedding's reduced gradient, rank after rank
// (the same order everywhere, so every rank's sum is the same; distributed: this rank's shard).
void GradReducer::add_embedding_rows(float scale) {
  rows_done_.wait();
  const Bucket& b = buckets_[static_cast<std::size_t>(embedding_bucket_)];
  float* g = b.params.front()->grad.data<float>();
  const std::int64_t n = all_ids_.numel(), H = all_grad_.dim(1);
  const std::int64_t lo = distributed_ ? b.shard_begin : 0, hi = distributed_ ? b.shard_end : b.size;
  const Tensor rows = all_grad_.to(DType::F32);
  const std::int64_t* ids = all_ids_.data<std::int64_t>();
  const float* r = rows.data<float>();
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0, at = ids[t] * H; j < H; ++j, ++at)
      if (at >= lo && at < hi) g[at] += r[t * H + j] * scale;
  rows_ids_ = rows_grad_ = all_ids_ = all_grad_ = Tensor();
  rows_done_ = CommEvent{};
}

void GradReducer::launch(Bucket& b) {
  b.launch_order = launches_++;
  if (b.comm->size() == 1) {  // nothing to send: the gradients stay where they are, finish scales them
    b.done = CommEvent{};
    return;
  }
  const std::int64_t n = b.size;
  const DType dt = reduce_dtype_;
  b.flat = Tensor::uninitialized({n}, dt);
  std::int64_t at = 0;
  for (const Param* p : b.params) {
    const float* g = p->grad.data<float>();
    if (dt == DType::F32) {
      std::copy_n(g, p->grad.numel(), b.flat.data<float>() + at);
    } else {
      std::uint16_t* f = b.flat.data<std::uint16_t>() + at;
      for (std::int64_t i = 0, n = p->grad.numel(); i < n; ++i) f[i] = float_to_bf16(g[i]);
    }
    at += p->grad.numel();
  }
  if (distributed_) {
    b.shard = Tensor::uninitialized({std::max<std::int64_t>(1, b.shard_end - b.shard_begin)}, dt);
    b.done = stream_.submit(
        [&b, dt] { b.comm->reduce_scatterv(b.flat.raw(), b.shard.raw(), b.shard_counts, dt); },
        reduce_name(b.expert));
  } else {
    b.done = stream_.submit([&b, n, dt] { b.comm->allreduce(b.flat.raw(), n, dt); }, reduce_name(b.expert));
  }
}

void GradReducer::finish(float scale, const std::function<void(const std::vector<Param*>&)>& final_grads) {
  for (Bucket& b : buckets_)
    if (!b.launched()) launch(b);
  // The buckets whose reductions are complete first, then the rest in launch order (the stream's),
  // so that final_grads' work runs while the last ones are in flight. The rows split's bucket is
  // final only once the rows are in.
  const Bucket* late = all_grad_.defined() ? &buckets_[static_cast<std::size_t>(embedding_bucket_)] : nullptr;
  std::vector<Bucket*> left;
  for (Bucket& b : buckets_) left.push_back(&b);
  std::sort(left.begin(), left.end(), [](const Bucket* x, const Bucket* y) { return x->launch_order < y->launch_order; });
  while (!left.empty()) {
    auto next = std::find_if(left.begin(), left.end(), [](const Bucket* b) { return b->done.ready(); });
    if (next == left.end()) next = left.begin();
    Bucket& b = **next;
    left.erase(next);
    b.done.wait();
    copy_out(b, scale);
    if (final_grads && &b != late) final_grads(b.params);
  }
  if (late) {
    add_embedding_rows(scale);
    if (final_grads) final_grads(late->params);
  }
}

void GradReducer::copy_out(Bucket& b, float scale) {
  if (b.comm->size() == 1) {  // not copied at launch
    for (Param* p : b.params) {
      float* g = p->grad.data<float>();
      for (std::int64_t i = 0, n = p->grad.numel(); i < n; ++i) g[i] *= scale;
    }
    return;
  }
  const Tensor& sums = b.flat;  // every element's sum; distributed: only the shard's, the rest zero
  if (distributed_) {
    const std::size_t es = dtype_size(sums.dtype());
    std::memset(b.flat.raw(), 0, static_cast<std::size_t>(b.size) * es);
    std::memcpy(static_cast<std::byte*>(b.flat.raw()) + static_cast<std::size_t>(b.shard_begin) * es, b.shard.raw(),
                static_cast<std::size_t>(b.shard_end - b.shard_begin) * es);
  }
  std::int64_t at = 0;
  for (Param* p : b.params) {
    float* g = p->grad.data<float>();
    const std::int64_t n = p->grad.numel();
    if (sums.dtype() == DType::F32) {
      const float* f = sums.data<float>() + at;
      for (std::int64_t i = 0; i < n; ++i) g[i] = f[i] * scale;
    } else {
      const std::uint16_t* f = sums.data<std::uint16_t>() + at;
      for (std::int64_t i = 0; i < n; ++i) g[i] = bf16_to_float(f[i]) * scale;
    }
    at += n;
  }
  b.flat = b.shard = Tensor();
}

void GradReducer::sum_shared_embedding(Communicator& stages) {
  if (!shared_embedding_ || stages.size() == 1) return;
  std::int64_t lo = 0, hi = shared_embedding_->grad.numel();
  if (distributed_) {
    const Bucket& b = buckets_.at(static_cast<std::size_t>(shared_bucket_));
    lo = b.shard_begin, hi = b.shard_end;
  }
  float* g = shared_embedding_->grad.data<float>() + lo;
  // Every rank gets the same sum (epx run checks that the copies stay bitwise equal).
  stream_.run([&] { stages.allreduce(g, hi - lo, DType::F32); }, kSharedName);
}

std::vector<ParamRange> GradReducer::owned_ranges() const {
  std::vector<ParamRange> out;
  for (const Bucket& b : buckets_)
    for_each_in(b.params, b.shard_begin, b.shard_end,
                [&](Param* p, std::int64_t first, std::int64_t end) { out.push_back({p, first, end}); });
  return out;
}

void GradReducer::gather_params(bool overlap) {
  // In the order the forward needs them, as Megatron dispatches its all-gathers: chunk by chunk,
  // and within a chunk the latest groups (embedding, first layers) first.
  std::vector<Bucket*> order;
  for (Bucket& b : buckets_) order.push_back(&b);
  const auto chunk = [&](const Bucket* b) { return group_chunk_[static_cast<std::size_t>(b->last_group)]; };
  std::stable_sort(order.begin(), order.end(), [&](const Bucket* x, const Bucket* y) {
    return chunk(x) != chunk(y) ? chunk(x) < chunk(y) : x->last_group > y->last_group;
  });
  for (Bucket* bp : order) {
    Bucket& b = *bp;
    if (b.comm->size() == 1) continue;
    if (b.gathering) throw std::logic_error("gather_params: the previous step's all-gather is still in flight");
    const std::int64_t me = b.comm->rank(), total = std::accumulate(b.gather_units.begin(), b.gather_units.end(), std::int64_t{0});
    b.mine = Tensor::uninitialized({std::max<std::int64_t>(1, b.gather_units[static_cast<std::size_t>(me)])}, DType::BF16);
    b.gathered = Tensor::uninitialized({std::max<std::int64_t>(1, total)}, DType::BF16);
    auto* mine = static_cast<std::byte*>(b.mine.raw());
    for_each_in(b.params, b.shard_begin, b.shard_end, [&](const Param* p, std::int64_t first, std::int64_t end) {
      const Tensor& from = sent_as_bf16(p) ? p->compute : p->master;
      const std::size_t es = dtype_size(from.dtype());
      std::memcpy(mine, static_cast<const std::byte*>(from.raw()) + static_cast<std::size_t>(first) * es,
                  static_cast<std::size_t>(end - first) * es);
      mine += static_cast<std::size_t>(end - first) * es;
    });
    b.gathering = true;
    b.gather_done = stream_.submit([&b] { b.comm->allgatherv(b.mine.raw(), b.gathered.raw(), b.gather_units, DType::BF16); },
                                   gather_name(b.expert));
    if (!overlap) finish_gather(b);
  }
}

void GradReducer::finish_gather(Bucket& b) {
  b.gather_done.wait();
  // Every rank's shard in rank order, each packed as gather_params packs this rank's; the own
  // shard comes back unchanged.
  const auto* from = static_cast<const std::byte*>(b.gathered.raw());
  for (std::int64_t r = 0; r < b.comm->size(); ++r) {
    const auto [lo, hi] = b.shard_of(r);
    for_each_in(b.params, lo, hi, [&](Param* p, std::int64_t first, std::int64_t end) {
      Tensor& to = sent_as_bf16(p) ? p->compute : p->master;
      const std::size_t es = dtype_size(to.dtype()), bytes = static_cast<std::size_t>(end - first) * es;
      std::memcpy(static_cast<std::byte*>(to.raw()) + static_cast<std::size_t>(first) * es, from, bytes);
      from += bytes;
    });
  }
  b.mine = b.gathered = Tensor();
  b.gathering = false;
}

void GradReducer::params_needed(int group) {
  for (Bucket& b : buckets_)
    if (b.gathering && b.first_group <= group && group <= b.last_group) finish_gather(b);
}

GradReducer::~GradReducer() {
  // An exception may unwind mid-iteration with tasks queued on the stream that read and write
  // the buckets: they finish before the buckets go (the stream outlives this reducer).
  const auto settle = [](const CommEvent& e) {
    try {
      e.wait();
    } catch (...) {
    }
  };
  for (const Bucket& b : buckets_) settle(b.done), settle(b.gather_done);
  settle(rows_done_);
}

void GradReducer::finish_param_gathers() {
  for (Bucket& b : buckets_)
    if (b.gathering) finish_gather(b);
}

}  // namespace epx
