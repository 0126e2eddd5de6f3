// The Communicator's operations and the comm stream on 1, 2 and 4 real MPI ranks.
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "epx/comm/comm_stream.hpp"
#include "mpi_test_support.hpp"

namespace epx {
namespace {

using test::mpi;

// Rank r sends (r + p) % 3 elements to p, each naming (sender, receiver, index): uneven, with zeros.
TEST(Communicator, AlltoallvUnevenWithEmptyPeers) {
  Communicator& w = mpi().world();
  const int n = w.size(), me = w.rank();
  std::vector<std::int64_t> send_counts(n), recv_counts(n);
  std::vector<float> send;
  for (int p = 0; p < n; ++p) {
    send_counts[p] = (me + p) % 3;
    recv_counts[p] = (p + me) % 3;
    for (int i = 0; i < send_counts[p]; ++i) send.push_back(static_cast<float>(100 * me + 10 * p + i));
  }
  std::vector<float> recv(static_cast<std::size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), 0L)), -1.f);
  w.alltoallv(send.data(), send_counts, recv.data(), recv_counts, DType::F32);
  std::size_t k = 0;
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < recv_counts[p]; ++i) EXPECT_EQ(recv[k++], static_cast<float>(100 * p + 10 * me + i));
}

// Every rank sends each peer two messages of sizes the receiver does not know (one empty, one of
// (sender + receiver) % 4 + 1 elements) on two tags; probing learns the sizes, and probing the
// second tag first still matches its own message.
TEST(Communicator, ProbeLearnsTheSizeBeforeTheReceive) {
  Communicator& w = mpi().world();
  const int n = w.size(), me = w.rank();
  std::vector<std::vector<std::int64_t>> sent(static_cast<std::size_t>(n));
  std::vector<Request> sends;
  for (int p = 0; p < n; ++p) {
    auto& v = sent[static_cast<std::size_t>(p)];
    for (int i = 0; i < (me + p) % 4 + 1; ++i) v.push_back(1000 * me + 10 * p + i);
    sends.push_back(w.start_send(nullptr, 0, DType::I64, p, 0));
    sends.push_back(w.start_send(v.data(), static_cast<std::int64_t>(v.size()), DType::I64, p, 1));
  }
  for (int p = 0; p < n; ++p) {
    auto full = w.probe(p, 1, DType::I64);
    auto empty = w.probe(p, 0, DType::I64);
    ASSERT_EQ(full->count, (p + me) % 4 + 1);
    EXPECT_EQ(empty->count, 0);
    std::vector<std::int64_t> got(static_cast<std::size_t>(full->count), -1);
    Request r = w.start_recv(std::move(full), got.data());
    Request r0 = w.start_recv(std::move(empty), nullptr);
    w.wait(r);
    w.wait(r0);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], 1000 * p + 10 * me + static_cast<std::int64_t>(i));
  }
  for (Request& r : sends) w.wait(r);
}

TEST(Communicator, AllgathervAndReduceScattervBf16AndF32) {
  Communicator& w = mpi().world();
  const int n = w.size(), me = w.rank();
  std::vector<std::int64_t> counts(n);
  for (int p = 0; p < n; ++p) counts[p] = p % 2 == 0 ? p + 1 : 0;  // odd ranks contribute nothing
  const std::int64_t total = std::accumulate(counts.begin(), counts.end(), 0L);
  std::vector<float> mine(static_cast<std::size_t>(counts[me]), static_cast<float>(me + 1));
  std::vector<float> all(static_cast<std::size_t>(total));
  w.allgatherv(mine.data(), all.data(), counts, DType::F32);
  std::size_t k = 0;
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < counts[p]; ++i) EXPECT_EQ(all[k++], static_cast<float>(p + 1));

  // Reduce-scatter: every rank sends (rank + 1) * (element index + 1); sums are exact in BF16.
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor send({total}, dt), recv({std::max<std::int64_t>(counts[me], 1)}, dt);
    for (std::int64_t i = 0; i < total; ++i) send.set(i, static_cast<float>((me + 1) * (i + 1)));
    w.reduce_scatterv(send.raw(), recv.raw(), counts, dt);
    const std::int64_t first = std::accumulate(counts.begin(), counts.begin() + me, 0L);
    const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
    for (std::int64_t i = 0; i < counts[me]; ++i)
      EXPECT_EQ(recv.get(i), ranks_sum * static_cast<float>(first + i + 1)) << dtype_name(dt);
  }
}

TEST(Communicator, AllreduceAndPointToPoint) {
  Communicator& w = mpi().world();
  const int n = w.size(), me = w.rank();
  std::vector<std::int64_t> v{me, 1, 1L << 40};
  w.allreduce(v.data(), 3, DType::I64);
  EXPECT_EQ(v, (std::vector<std::int64_t>{n * (n - 1) / 2, n, n * (1L << 40)}));

  // Longer than the slices EPX_MPI_MAX_COUNT sets in mpi.np2_sliced_allreduce (each a call of its
  // own), in both dtypes.
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor t({10}, dt);
    for (int i = 0; i < 10; ++i) t.set(i, static_cast<float>(me + i));
    w.allreduce(t.raw(), 10, dt);
    for (int i = 0; i < 10; ++i) EXPECT_EQ(t.get(i), static_cast<float>(n * (n - 1) / 2 + n * i)) << dtype_name(dt);
  }

  // A ring, both directions started before either is waited on.
  float out = static_cast<float>(me), in = -1;
  Request r = w.start_recv(&in, 1, DType::F32, (me + n - 1) % n, 7);
  Request s = w.start_send(&out, 1, DType::F32, (me + 1) % n, 7);
  w.wait(s);
  w.wait(r);
  EXPECT_EQ(in, static_cast<float>((me + n - 1) % n));
  w.barrier();
}

TEST(CommStream, RunsTasksInOrderAndRethrows) {
  CommStream stream;
  std::vector<int> order;
  CommEvent a = stream.submit([&] { order.push_back(1); });
  CommEvent b = stream.submit([&] { throw std::runtime_error("task failed"); });
  CommEvent c = stream.submit([&] { order.push_back(3); });
  c.wait();
  a.wait();
  EXPECT_TRUE(b.ready());
  EXPECT_THROW(b.wait(), std::runtime_error);
  EXPECT_EQ(order, (std::vector<int>{1, 3}));
  EXPECT_EQ(stream.stats().tasks, 3);
}

// While a collective waits on a late peer, the stream thread sleeps between polls: its CPU time
// stays a small part of the time in flight (the compute core is not stolen).
TEST(CommStream, WaitingDoesNotSpinOnTheCore) {
  Communicator& w = mpi().world();
  if (w.size() < 2) GTEST_SKIP() << "needs a late peer";
  CommStream stream;
  if (w.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stream.run([&] { w.barrier(); });
  const CommStream::Stats s = stream.stats();
  if (w.rank() != 0) {
    EXPECT_GT(s.busy_s, 0.2);
    EXPECT_LT(s.cpu_s, 0.25 * s.busy_s) << "CPU " << s.cpu_s << " s in " << s.busy_s << " s";
  }
}

}  // namespace
}  // namespace epx
