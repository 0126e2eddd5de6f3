// Communicator: the collectives and point-to-point operations epx needs, each started
// non-blocking and then waited on; the blocking forms are start + wait. Buffers are packed by
// peer in rank order (no displacements) and counts are in elements of the given dtype; BF16
// travels as 2 bytes and is reduced by a BF16 sum. Reductions are sums.
//
// wait() never hangs silently: past the collective timeout it aborts the whole job with a
// message naming the rank, the group and the operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epx/tensor/tensor.hpp"

namespace epx {

class CommRequest {
 public:
  explicit CommRequest(std::string op) : op(std::move(op)) {}
  virtual ~CommRequest() = default;
  virtual bool test() = 0;  // true once complete; progresses the transfer
  const std::string op;     // "alltoallv", ... for messages
};
using Request = std::unique_ptr<CommRequest>;

// A message matched by Communicator::probe and not yet received (MPI_Mprobe's handle): the
// receiver learns its size before it chooses where the message goes.
class ProbedMessage {
 public:
  virtual ~ProbedMessage() = default;
  std::int64_t count = 0;  // elements of the dtype it was probed with
};

// Memory every rank of a communicator addresses directly (MPI-3 shared windows): each rank owns
// one segment, and any rank may read or write any segment between fences.
class SharedWindow {
 public:
  virtual ~SharedWindow() = default;  // collective: every rank destroys its window together
  virtual std::byte* segment(int rank) = 0;
  virtual std::int64_t segment_bytes(int rank) const = 0;
  // Collective: every rank's writes before fence() are visible to every rank after it.
  virtual void fence() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group for messages: its kind and world ranks, e.g. "ep [0 2]".
  virtual const std::string& name() const = 0;

  using Counts = std::span<const std::int64_t>;
  virtual Request start_alltoallv(const void* send, Counts send_counts, void* recv,
                                  Counts recv_counts, DType dt) = 0;
  // Sends recv_counts[rank()] elements; receives every rank's in rank order.
  virtual Request start_allgatherv(const void* send, void* recv, Counts recv_counts, DType dt) = 0;
  // send holds sum(recv_counts) elements in rank order; rank r receives the sum of its block.
  virtual Request start_reduce_scatterv(const void* send, void* recv, Counts recv_counts,
                                        DType dt) = 0;
  virtual Request start_allreduce(void* data, std::int64_t count, DType dt) = 0;  // in place
  virtual Request start_barrier() = 0;
  virtual Request start_send(const void* data, std::int64_t count, DType dt, int peer, int tag) = 0;
  virtual Request start_recv(void* data, std::int64_t count, DType dt, int peer, int tag) = 0;
  // Waits as wait() does until a message from `peer` with `tag` has arrived, and matches it, so
  // no other receive can take it; then start_recv(message, data) receives its `count` elements.
  // A message that is not a whole number of `unit` elements (rows of `unit`) is the sender's bug:
  // the job ends as an internal error, since other transfers are in flight.
  virtual std::unique_ptr<ProbedMessage> probe(int peer, int tag, DType dt, std::int64_t unit = 1) = 0;
  virtual Request start_recv(std::unique_ptr<ProbedMessage> message, void* data) = 0;

  // Blocks until `r` completes, without spinning on the core; aborts the job past the timeout.
  virtual void wait(Request& r) = 0;

  // A sub-communicator of the ranks that pass the same color, ordered by key (MPI_Comm_split).
  virtual std::unique_ptr<Communicator> split(int color, int key, std::string name) = 0;
  // The ranks of this group that share this rank's memory, in rank order (one node).
  virtual std::unique_ptr<Communicator> split_shared(std::string name) = 0;
  // Collective: `bytes` on this rank in a window every rank maps. All ranks must share memory.
  virtual std::unique_ptr<SharedWindow> allocate_shared(std::int64_t bytes) = 0;

  // Blocking forms.
  void alltoallv(const void* send, Counts send_counts, void* recv, Counts recv_counts, DType dt) {
    finish(start_alltoallv(send, send_counts, recv, recv_counts, dt));
  }
  void allgatherv(const void* send, void* recv, Counts recv_counts, DType dt) {
    finish(start_allgatherv(send, recv, recv_counts, dt));
  }
  void reduce_scatterv(const void* send, void* recv, Counts recv_counts, DType dt) {
    finish(start_reduce_scatterv(send, recv, recv_counts, dt));
  }
  void allreduce(void* data, std::int64_t count, DType dt) { finish(start_allreduce(data, count, dt)); }
  void barrier() { finish(start_barrier()); }
  void send(const void* data, std::int64_t count, DType dt, int peer, int tag = 0) {
    finish(start_send(data, count, dt, peer, tag));
  }
  void recv(void* data, std::int64_t count, DType dt, int peer, int tag = 0) {
    finish(start_recv(data, count, dt, peer, tag));
  }

 private:
  void finish(Request r) { wait(r); }
};


}  // namespace epx
