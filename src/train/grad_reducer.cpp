#include "grad_reducer.hpp"

#include <algorithm>

namespace epx {
namespace {

constexpr const char* kDenseName = "gradient all-reduce (DP)";
constexpr const char* kExpertName = "expert gradient all-reduce (EDP)";

}  // namespace

GradReducer::GradReducer(const std::vector<std::vector<Param*>>& groups, const std::vector<Param*>& params,
                         Communicator& dp, Communicator& edp, CommStream& stream, const GradReduceOptions& options)
    : stream_(stream), overlap_(options.overlap), completions_(groups.size(), 0) {
  const int last = static_cast<int>(groups.size()) - 1;
  for (const bool expert : {false, true}) {
    Communicator& comm = expert ? edp : dp;
    const char* name = expert ? kExpertName : kDenseName;
    const auto close = [&](Bucket& b, int group) {
      if (b.params.empty()) return;
      b.comm = &comm, b.name = name, b.last_group = group;
      buckets_.push_back(std::move(b));
      b = Bucket{};
    };
    Bucket b;
    if (!options.overlap && options.bucket_size <= 0) {  // one bucket, in the model's order
      for (Param* p : params)
        if (p->expert == expert) b.params.push_back(p);
      close(b, last);
      continue;
    }
    std::int64_t n = 0;
    for (int g = 0; g <= last; ++g) {
      for (Param* p : groups[static_cast<std::size_t>(g)])
        if (p->expert == expert) b.params.push_back(p), n += p->grad.numel();
      if (options.bucket_size > 0 && n >= options.bucket_size) close(b, g), n = 0;
    }
    close(b, last);
  }
}

void GradReducer::start(int micro_batches) {
  micro_batches_ = micro_batches;
  std::fill(completions_.begin(), completions_.end(), 0);
  for (Bucket& b : buckets_) b.launched = false;
}

void GradReducer::grads_ready(int group) {
  if (!overlap_ || ++completions_[static_cast<std::size_t>(group)] != micro_batches_) return;
  for (Bucket& b : buckets_)
    if (b.last_group == group && !b.launched) launch(b);
}

void GradReducer::launch(Bucket& b) {
  std::int64_t n = 0;
  for (const Param* p : b.params) n += p->grad.numel();
  b.flat.resize(static_cast<std::size_t>(n));
  std::int64_t at = 0;
  for (const Param* p : b.params) {
    std::copy_n(p->grad.data<float>(), p->grad.numel(), b.flat.data() + at);
    at += p->grad.numel();
  }
  b.launched = true;
  b.done = b.comm->size() > 1 ? stream_.submit([&b, n] { b.comm->allreduce(b.flat.data(), n, DType::F32); }, b.name)
                              : CommEvent{};
}

void GradReducer::finish(float scale) {
  for (Bucket& b : buckets_)
    if (!b.launched) launch(b);
  for (Bucket& b : buckets_) {
    b.done.wait();
    std::int64_t at = 0;
    for (Param* p : b.params) {
      float* g = p->grad.data<float>();
      for (std::int64_t i = 0; i < p->grad.numel(); ++i) g[i] = b.flat[static_cast<std::size_t>(at + i)] * scale;
      at += p->grad.numel();
    }
  }
}

}  // namespace epx
