// GradReducer::finish hands out the buckets whose reductions are complete before it waits for
// the rest (src/train/grad_reducer.cpp), on a fake group whose all-reduce completes only when
// the test opens it: no MPI, so the order is the only thing that can hold it up.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/comm/comm.hpp"
#include "epx/comm/comm_stream.hpp"
#include "grad_reducer.hpp"

namespace epx {
namespace {

// A group of `size` ranks whose all-reduce leaves the data as it is and completes once `open`
// is set (or, so a wrong order fails the test instead of hanging it, after 10 s: `timed_out`).
class GatedGroup : public Communicator {
 public:
  explicit GatedGroup(int size) : size_(size) {}
  std::atomic<bool> open{false}, timed_out{false};

  int rank() const override { return 0; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Request start_allreduce(void*, std::int64_t, DType) override { return std::make_unique<Gate>(*this); }
  void wait(Request& r) override {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!r->test()) {
      if (std::chrono::steady_clock::now() > until) timed_out = open = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  Request start_alltoallv(const void*, Counts, void*, Counts, DType) override { throw unused(); }
  Request start_allgatherv(const void*, void*, Counts, DType) override { throw unused(); }
  Request start_reduce_scatterv(const void*, void*, Counts, DType) override { throw unused(); }
  Request start_barrier() override { throw unused(); }
  Request start_send(const void*, std::int64_t, DType, int, int) override { throw unused(); }
  Request start_recv(void*, std::int64_t, DType, int, int) override { throw unused(); }
  std::unique_ptr<ProbedMessage> probe(int, int, DType, std::int64_t) override { throw unused(); }
  Request start_recv(std::unique_ptr<ProbedMessage>, void*) override { throw unused(); }
  std::unique_ptr<Communicator> split(int, int, std::string) override { throw unused(); }
  std::unique_ptr<Communicator> split_shared(std::string) override { throw unused(); }
  std::unique_ptr<SharedWindow> allocate_shared(std::int64_t) override { throw unused(); }

 private:
  struct Gate : CommRequest {
    explicit Gate(const GatedGroup& g) : CommRequest("allreduce"), group(g) {}
    bool test() override { return group.open; }
    const GatedGroup& group;
  };
  static std::logic_error unused() { return std::logic_error("GatedGroup: not used by the gradient reducer"); }
  int size_;
  std::string name_ = "gated";
};

void fill(Param& p, float v) {
  float* g = p.grad.data<float>();
  for (std::int64_t i = 0; i < p.grad.numel(); ++i) g[i] = v;
}

TEST(GradReducer, FinishHandsOutTheReducedBucketsBeforeItWaitsForTheRest) {
  // One dense weight over a DP group of 2 whose all-reduce is held, one expert weight over an
  // EDP group of 1 (nothing to send). finish must hand out the expert's bucket while the dense
  // one is in flight; the callback then lets the dense one complete.
  Param dense("dense", {8}, DType::F32), expert("expert", {8}, DType::F32);
  expert.expert = true;
  fill(dense, 2.f), fill(expert, 4.f);
  GatedGroup dp(2), edp(1);
  CommStream stream;
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped buckets" : "buckets after the backward");
    dp.open = false;
    GradReduceOptions options;
    options.overlap = overlap;
    GradReducer reducer({{&dense, &expert}}, {0}, {&dense, &expert}, dp, edp, stream, options);
    reducer.start(1);
    if (overlap) reducer.grads_ready(0);  // the last micro-batch's backward completed the group
    std::vector<std::string> handed_out;
    reducer.finish(0.5f, [&](const std::vector<Param*>& params) {
      for (const Param* p : params) handed_out.push_back(p->name);
      dp.open = true;
    });
    EXPECT_EQ(handed_out, (std::vector<std::string>{"expert", "dense"}));
    EXPECT_FALSE(dp.timed_out) << "finish waited for the dense bucket first";
    EXPECT_EQ(dense.grad.data<float>()[7], 1.f);  // the fake sum is the rank's own, times 1/2
    EXPECT_EQ(expert.grad.data<float>()[7], 2.f);
    fill(dense, 2.f), fill(expert, 4.f);
  }
}

}  // namespace
}  // namespace epx
