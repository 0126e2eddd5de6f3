// The Communicator on Open MPI. Every operation is an MPI non-blocking call; wait() polls it with
// MPI_Test and sleeps between polls (a short spin, then exponential back-off up to
// EPX_COMM_MAX_SLEEP_US), so a rank waiting on a transfer leaves the core to the compute thread.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <deque>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/mpi.hpp"
#include "startup_watchdog.hpp"

namespace epx {
namespace {

// How wait() polls: MPI_Test calls back to back before the first sleep, then sleeps from
// kMinSleepUs doubling to the cap. Read once by MpiSession from EPX_COMM_SPIN_POLLS and
// EPX_COMM_MAX_SLEEP_US. Each step of a rendezvous or of a collective's schedule waits for the
// next poll, so the cap adds to their latency: on the emulated cluster a 500 us cap made the
// issue-20 A/B 5-8% slower than 100 us and left half as much again of the DP reduction exposed
// (bench/RESULTS.md), while a thread waiting at 100 us still uses a few percent of a core.
constexpr int kMinSleepUs = 5;
int g_spin_polls = 32;
int g_max_sleep_us = 100;
std::int64_t g_max_count = INT_MAX;  // EPX_MPI_MAX_COUNT

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(fmt::format("{} failed: {}", what, std::string(text, len)));
}

// An error while a transfer is in flight (MPI_Test, MPI_Improbe): the request cannot be dropped
// (MPI may still write its buffers), so nothing can unwind; the job ends here with MPI's reason,
// as a failed communication rather than a bug in epx.
void check_in_flight(int rc, const std::string& op) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  MpiSession::abort_job(fmt::format("{} failed while in flight: {}; a peer rank failed or the network between the "
                                    "ranks did. Aborting the job.",
                                    op, std::string(text, len)),
                        kExitCommTimeout);
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// BF16 travels as 16-bit words. Each pairwise step of MPI's reduction adds in FP32 and rounds to
// BF16, so with more than two ranks the result is rounded more than once, in MPI's order.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}
MPI_Op g_bf16_sum = MPI_OP_NULL;

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::F32: return MPI_FLOAT;
    case DType::BF16: return MPI_UINT16_T;
    case DType::I64: return MPI_INT64_T;
  }
  throw std::logic_error("unknown dtype");
}
MPI_Op sum_op(DType d) { return d == DType::BF16 ? g_bf16_sum : MPI_SUM; }

int to_int(std::int64_t n, const std::string& op) {
  if (n < 0 || n > INT_MAX)
    throw std::runtime_error(fmt::format("{}: {} elements do not fit MPI's int count", op, n));
  return static_cast<int>(n);
}

// A request that owns the count arrays MPI reads until completion.
class MpiRequest final : public CommRequest {
 public:
  explicit MpiRequest(std::string op, bool cancellable = false) : CommRequest(std::move(op)), cancellable_(cancellable) {}
  // MPI would go on writing into buffers their owners are about to free: never drop a request
  // in flight (an exception between start and wait). A plain receive is cancelled and waited for,
  // so an error that unwinds past posted receives (the pipeline's, a step ahead) ends the job
  // with its own message; anything else ends the job here.
  ~MpiRequest() override {
    if (done_ || req == MPI_REQUEST_NULL) return;
    if (cancellable_ && MPI_Cancel(&req) == MPI_SUCCESS && MPI_Wait(&req, MPI_STATUS_IGNORE) == MPI_SUCCESS) return;
    MpiSession::abort_job(fmt::format("internal error: {} was dropped while in flight", op), 3);
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    check_in_flight(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), op);
    done_ = flag != 0;
    return done_;
  }
  // Counts and packed displacements for a v-collective.
  std::pair<const int*, const int*> counts(std::span<const std::int64_t> c) {
    auto& cnt = arrays_.emplace_back();
    auto& dsp = arrays_.emplace_back();
    std::int64_t offset = 0;
    for (std::int64_t n : c) {
      dsp.push_back(to_int(offset, op));
      cnt.push_back(to_int(n, op));
      offset += n;
    }
    return {cnt.data(), dsp.data()};
  }
  MPI_Request req = MPI_REQUEST_NULL;

 private:
  bool done_ = false;
  const bool cancellable_;
  std::deque<std::vector<int>> arrays_;  // a deque: references stay valid as it grows
};

// Several requests as one: complete once every part is.
class MpiRequests final : public CommRequest {
 public:
  explicit MpiRequests(std::string op) : CommRequest(std::move(op)) {}
  bool test() override {
    for (auto& p : parts)
      if (!p->test()) return false;
    return true;
  }
  std::vector<std::unique_ptr<MpiRequest>> parts;
};

// MPI_Improbe as a request: complete once a matching message has arrived; `message` and
// `status` then hold it.
class MpiProbe final : public CommRequest {
 public:
  MpiProbe(std::string op, MPI_Comm comm, int peer, int tag)
      : CommRequest(std::move(op)), comm_(comm), peer_(peer), tag_(tag) {}
  bool test() override {
    if (found_) return true;
    check_in_flight(MPI_Improbe(peer_, tag_, comm_, &found_, &message, &status), op);
    return found_ != 0;
  }
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status{};

 private:
  MPI_Comm comm_;
  int peer_, tag_;
  int found_ = 0;
};

// A matched message not yet received; MPI_Imrecv takes it (and nulls the handle). Dropping one
// unreceived would leave its sender's data unread: end the job, as for a request in flight.
class MpiProbedMessage final : public ProbedMessage {
 public:
  ~MpiProbedMessage() override {
    if (message != MPI_MESSAGE_NULL)
      MpiSession::abort_job("internal error: a probed message was dropped before it was received", 3);
  }
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Datatype type = MPI_DATATYPE_NULL;
};

// MPI_Win_allocate_shared, kept in a passive-target epoch for its whole life; fence() is
// MPI_Win_sync, a barrier (under the collective timeout), MPI_Win_sync.
class MpiSharedWindow final : public SharedWindow {
 public:
  MpiSharedWindow(Communicator& comm, MPI_Comm mpi_comm, std::int64_t bytes) : comm_(comm) {
    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each segment on its owner's pages
    void* base = nullptr;
    const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(std::max<std::int64_t>(bytes, 8)), 1, info,
                                           mpi_comm, &base, &win_);
    MPI_Info_free(&info);
    check_mpi(rc, "MPI_Win_allocate_shared");
    MPI_Win_lock_all(MPI_MODE_NOCHECK, win_);
    const int n = comm.size();
    for (int r = 0; r < n; ++r) {
      MPI_Aint size = 0;
      int disp = 0;
      void* ptr = nullptr;
      check_mpi(MPI_Win_shared_query(win_, r, &size, &disp, &ptr), "MPI_Win_shared_query");
      segments_.push_back(static_cast<std::byte*>(ptr));
      bytes_.push_back(static_cast<std::int64_t>(size));
    }
  }
  ~MpiSharedWindow() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
  }
  std::byte* segment(int rank) override { return segments_.at(static_cast<std::size_t>(rank)); }
  std::int64_t segment_bytes(int rank) const override { return bytes_.at(static_cast<std::size_t>(rank)); }
  void fence() override {
    MPI_Win_sync(win_);
    comm_.barrier();
    MPI_Win_sync(win_);
  }

 private:
  Communicator& comm_;
  MPI_Win win_ = MPI_WIN_NULL;
  std::vector<std::byte*> segments_;
  std::vector<std::int64_t> bytes_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s, bool owned)
      : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  Request start_alltoallv(const void* send, Counts send_counts, void* recv, Counts recv_counts,
                          DType dt) override {
    auto r = std::make_unique<MpiRequest>("alltoallv");
    expect_size(send_counts, r->op);
    expect_size(recv_counts, r->op);
    auto [sc, sd] = r->counts(send_counts);
    auto [rc, rd] = r->counts(recv_counts);
    check_mpi(MPI_Ialltoallv(send, sc, sd, mpi_type(dt), recv, rc, rd, mpi_type(dt), comm_, &r->req),
              "MPI_Ialltoallv");
    return r;
  }
  Request start_allgatherv(const void* send, void* recv, Counts recv_counts, DType dt) override {
    auto r = std::make_unique<MpiRequest>("allgatherv");
    expect_size(recv_counts, r->op);
    auto [rc, rd] = r->counts(recv_counts);
    check_mpi(MPI_Iallgatherv(send, rc[rank_], mpi_type(dt), recv, rc, rd, mpi_type(dt), comm_, &r->req),
              "MPI_Iallgatherv");
    return r;
  }
  Request start_reduce_scatterv(const void* send, void* recv, Counts recv_counts, DType dt) override {
    auto r = std::make_unique<MpiRequest>("reduce_scatterv");
    expect_size(recv_counts, r->op);
    auto [rc, rd] = r->counts(recv_counts);
    (void)rd;
    check_mpi(MPI_Ireduce_scatter(send, recv, rc, mpi_type(dt), sum_op(dt), comm_, &r->req),
              "MPI_Ireduce_scatter");
    return r;
  }
  // MPI's count is an int and Open MPI 4 has no large-count calls: a longer all-reduce (an
  // embedding's gradient of more than 2^31 elements) runs as consecutive slices, all in flight
  // at once; collectives on one communicator match in the order they start.
  Request start_allreduce(void* data, std::int64_t count, DType dt) override {
    auto r = std::make_unique<MpiRequests>("allreduce");
    std::int64_t at = 0;
    try {
      do {
        const std::int64_t n = std::min(count - at, g_max_count);
        auto& part = r->parts.emplace_back(std::make_unique<MpiRequest>(r->op));
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, static_cast<std::byte*>(data) + at * dtype_size(dt), to_int(n, r->op),
                                 mpi_type(dt), sum_op(dt), comm_, &part->req),
                  "MPI_Iallreduce");
        at += n;
      } while (at < count);
    } catch (...) {  // the slices already started finish first, so the error is this one
      for (auto& part : r->parts)
        if (part->req != MPI_REQUEST_NULL) poll(*part);
      throw;
    }
    return r;
  }
  Request start_barrier() override {
    auto r = std::make_unique<MpiRequest>("barrier");
    check_mpi(MPI_Ibarrier(comm_, &r->req), "MPI_Ibarrier");
    return r;
  }
  Request start_send(const void* data, std::int64_t count, DType dt, int peer, int tag) override {
    auto r = std::make_unique<MpiRequest>(fmt::format("send to {}", peer));
    check_mpi(MPI_Isend(data, to_int(count, r->op), mpi_type(dt), peer, tag, comm_, &r->req), "MPI_Isend");
    return r;
  }
  Request start_recv(void* data, std::int64_t count, DType dt, int peer, int tag) override {
    auto r = std::make_unique<MpiRequest>(fmt::format("recv from {}", peer), true);
    check_mpi(MPI_Irecv(data, to_int(count, r->op), mpi_type(dt), peer, tag, comm_, &r->req), "MPI_Irecv");
    return r;
  }

  std::unique_ptr<ProbedMessage> probe(int peer, int tag, DType dt, std::int64_t unit) override {
    MpiProbe p(fmt::format("probe for a message from {}", peer), comm_, peer, tag);
    poll(p);
    auto m = std::make_unique<MpiProbedMessage>();
    m->type = mpi_type(dt);
    int count = 0;
    check_mpi(MPI_Get_count(&p.status, m->type, &count), "MPI_Get_count");
    if (count == MPI_UNDEFINED || count % unit != 0)  // the sender's bug, with transfers in flight: no unwinding
      MpiSession::abort_job(fmt::format("internal error: probe on {}: a message from {} is not a whole number of "
                                        "{}-element rows of {}", name_, peer, unit, dtype_name(dt)), 3);
    m->count = count;
    m->message = p.message;
    return m;
  }
  Request start_recv(std::unique_ptr<ProbedMessage> message, void* data) override {
    auto& m = dynamic_cast<MpiProbedMessage&>(*message);
    auto r = std::make_unique<MpiRequest>("receive of a probed message");
    check_mpi(MPI_Imrecv(data, static_cast<int>(m.count), m.type, &m.message, &r->req), "MPI_Imrecv");
    return r;
  }

  void wait(Request& r) override {
    if (!r) return;
    poll(*r);
    r.reset();
  }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    return std::make_unique<MpiCommunicator>(sub, std::move(name), timeout_s_, true);
  }
  std::unique_ptr<Communicator> split_shared(std::string name) override {
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub),
              "MPI_Comm_split_type");
    return std::make_unique<MpiCommunicator>(sub, std::move(name), timeout_s_, true);
  }
  std::unique_ptr<SharedWindow> allocate_shared(std::int64_t bytes) override {
    return std::make_unique<MpiSharedWindow>(*this, comm_, bytes);
  }

 private:
  // Tests `r` until it completes: MPI_Test back to back, then sleeps with back-off; past the
  // collective timeout, ends the job.
  void poll(CommRequest& r) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    int sleep_us = kMinSleepUs;
    for (int polls = 0; !r.test(); polls = std::min(polls + 1, g_spin_polls)) {
      if (polls < g_spin_polls) continue;
      const double waited = std::chrono::duration<double>(clock::now() - t0).count();
      if (waited > timeout_s_)
        MpiSession::abort_job(
            fmt::format("{} on group {} did not complete within {:g} s (the collective timeout: "
                        "epx run / layer --collective-timeout, or EPX_COLLECTIVE_TIMEOUT); a peer rank is stuck or "
                        "gone. Aborting the job.",
                        r.op, name_, timeout_s_),
            kExitCommTimeout);
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(g_max_sleep_us, sleep_us * 2);
    }
  }

  void expect_size(Counts c, const std::string& op) const {
    if (static_cast<int>(c.size()) != size_)
      throw std::logic_error(fmt::format("{} on {}: {} counts for {} ranks", op, name_, c.size(), size_));
  }

  MPI_Comm comm_;
  std::string name_;
  double timeout_s_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr;
}

double collective_timeout_from_env(double fallback) {
  EnvKnob knob = env::kCollectiveTimeout;
  knob.fallback = fallback;
  return read_env(knob);
}

MpiSession::MpiSession(double collective_timeout_s) {
  g_spin_polls = static_cast<int>(read_env(env::kCommSpinPolls));
  g_max_sleep_us = static_cast<int>(read_env(env::kCommMaxSleepUs));
  g_max_count = static_cast<std::int64_t>(read_env(env::kMpiMaxCount));
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) throw std::logic_error("MpiSession: MPI is already initialised");
  StartupWatchdog watchdog(collective_timeout_s);
  int provided = 0;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  watchdog.initialized();
  // Errors come back as codes (check_mpi throws, and the CLI takes the job down with the message)
  // rather than Open MPI's own abort; split communicators inherit the handler.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (provided < MPI_THREAD_MULTIPLE)
    abort_job("this MPI library does not provide MPI_THREAD_MULTIPLE, which epx's communication "
              "stream needs; install Debian's openmpi-bin / libopenmpi-dev",
              2);
  MPI_Op_create(&bf16_sum, 1, &g_bf16_sum);
  std::string name = "world [";
  for (int r = 0; r < size_; ++r) {  // appended piece by piece: GCC 12 -Wrestrict false positive
    if (r > 0) name += ' ';
    name += std::to_string(r);
  }
  world_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, name + "]", collective_timeout_s, false);
  // The whole world has met only once every rank is here (MPI_Init alone does not promise it).
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "the start-up barrier");
  watchdog.done();
}

MpiSession::~MpiSession() {
  world_.reset();
  MPI_Op_free(&g_bf16_sum);
  MPI_Finalize();
}

void MpiSession::abort_job(const std::string& message, int code) {
  std::cerr << fmt::format("epx: rank {}: {}\n", world_rank(), message) << std::flush;
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this is for the compiler
}

}  // namespace epx
