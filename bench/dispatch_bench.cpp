// The alltoall dispatcher's dispatch + combine next to a bare MPI_Alltoallv of the same bytes.
// Run under mpirun (2 or 4 ranks): mpirun -np N build/bench/epx_dispatch_bench [--iters K]
//
// Per shape it prints, as the slowest rank's mean over the timed iterations:
//   counts   the counts all-gather over ETP x EP (inside dispatch_preprocess); about 0 where the
//            sizes travel with the dispatch (ETP = 1 and several local experts, as here by
//            default): there the probes are part of a2a
//   perm     permutation 1 + 2 and the un-permutations (all local copies)
//   a2a      the dispatcher's communication phases (token_dispatch + token_combine)
//   total    dispatch + combine, every phase, experts skipped (their output = their input)
//   bare     MPI_Alltoallv of the same per-peer bytes, forward then back (tokens + probabilities)
// and the bytes each rank sends to other ranks per dispatch. The comm stream's CPU time during
// its tasks is reported as a share of their wall time: over shared memory the comm thread copies
// the bytes itself inside MPI_Test, so that share is mostly the copy, not polling; a first line
// measures a wait with nothing to copy.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/base/omp_env.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/comm/mpi.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "epx/moe/router.hpp"
#include "epx/tensor/random.hpp"

namespace {

using clk = std::chrono::steady_clock;
double since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

double max_over_ranks(double v) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

struct Times {
  double counts = 0, perm = 0, a2a = 0, total = 0, bare = 0;
};

}  // namespace

int main(int argc, char** argv) {
  epx::cap_openmp_spin(argv);
  epx::share_cores_with_local_ranks();
  int iters = 10;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--iters") iters = std::max(1, std::atoi(argv[i + 1]));
  epx::MpiSession mpi;
  const int world = mpi.size(), rank = mpi.rank();
  epx::ProcessGroups groups(mpi.world(), epx::ParallelLayout::make(world, 1, 1, 1, world, 1));
  epx::CommStream stream;
  {  // Waiting alone: a barrier with a late peer, on the stream, costs the stream little CPU.
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    stream.run([&] { mpi.world().barrier(); });
    const epx::CommStream::Stats st = stream.stats();
    const double share = max_over_ranks(rank == 0 ? 0 : st.cpu_s / st.busy_s);
    if (rank == 0)
      std::printf("idle wait (a barrier whose peer is 200 ms late): stream CPU %.1f%% of the wait\n", 100 * share);
  }
  const std::int64_t experts = 8 * world;
  auto dispatcher = epx::make_alltoall_dispatcher(experts, groups, stream);
  if (rank == 0)
    std::printf("alltoall dispatcher vs bare MPI_Alltoallv | %d ranks, EP %d, %lld experts, BF16 tokens "
                "+ FP32 probs | %d iterations, slowest rank's mean\n"
                "%6s %5s %3s %10s | %9s %9s %9s %9s | %9s %7s | %s\n",
                world, world, static_cast<long long>(experts), iters, "tokens", "H", "k", "MB sent",
                "counts ms", "perm ms", "a2a ms", "total ms", "bare ms", "ratio", "stream CPU");

  for (std::int64_t tokens : {1024, 4096})
    for (std::int64_t hidden : {1024, 2048})
      for (int k : {2, 8}) {
        const epx::Routing routing = epx::random_topk_routing(tokens, experts, k, 1000 + static_cast<std::uint64_t>(rank));
        const epx::Tensor x = epx::random_normal({tokens, hidden}, epx::DType::BF16, 5, static_cast<std::uint64_t>(rank));
        Times t;
        double sent_bytes = 0;
        stream.reset_stats();
        for (int it = -2; it < iters; ++it) {  // two warm-up iterations
          const bool timed = it >= 0;
          epx::DispatchState s;
          MPI_Barrier(MPI_COMM_WORLD);
          const auto t0 = clk::now();
          dispatcher->dispatch_preprocess(s, x, {routing.routing_map, routing.probs});
          const double pre = since(t0);
          auto t1 = clk::now();
          dispatcher->token_dispatch(s);
          s.pending.wait();
          double comm = since(t1);
          t1 = clk::now();
          dispatcher->dispatch_postprocess(s);
          dispatcher->combine_preprocess(s, s.hidden);
          double perm = since(t1);
          t1 = clk::now();
          dispatcher->token_combine(s);
          s.pending.wait();
          comm += since(t1);
          t1 = clk::now();
          const epx::Tensor out = dispatcher->combine_postprocess(s);
          perm += since(t1);
          const double total = since(t0);

          // The same per-peer bytes through bare MPI_Alltoallv: tokens and probs, there and back.
          std::vector<int> sc(world), rc(world), sd(world), rd(world), psc(world), prc(world), psd(world), prd(world);
          for (int p = 0, so = 0, ro = 0; p < world; ++p) {
            psc[p] = static_cast<int>(s.send_rows[p]);
            prc[p] = static_cast<int>(s.recv_rows[p]);
            psd[p] = so;
            prd[p] = ro;
            so += psc[p];
            ro += prc[p];
            sc[p] = psc[p] * static_cast<int>(hidden);
            rc[p] = prc[p] * static_cast<int>(hidden);
            sd[p] = psd[p] * static_cast<int>(hidden);
            rd[p] = prd[p] * static_cast<int>(hidden);
          }
          std::vector<std::uint16_t> sbuf(static_cast<std::size_t>(std::max(1, sd.back() + sc.back())));
          std::vector<std::uint16_t> rbuf(static_cast<std::size_t>(std::max(1, rd.back() + rc.back())));
          std::vector<float> psbuf(static_cast<std::size_t>(std::max(1, psd.back() + psc.back())));
          std::vector<float> prbuf(static_cast<std::size_t>(std::max(1, prd.back() + prc.back())));
          MPI_Barrier(MPI_COMM_WORLD);
          const auto b0 = clk::now();
          MPI_Alltoallv(sbuf.data(), sc.data(), sd.data(), MPI_UINT16_T, rbuf.data(), rc.data(), rd.data(), MPI_UINT16_T, MPI_COMM_WORLD);
          MPI_Alltoallv(psbuf.data(), psc.data(), psd.data(), MPI_FLOAT, prbuf.data(), prc.data(), prd.data(), MPI_FLOAT, MPI_COMM_WORLD);
          MPI_Alltoallv(rbuf.data(), rc.data(), rd.data(), MPI_UINT16_T, sbuf.data(), sc.data(), sd.data(), MPI_UINT16_T, MPI_COMM_WORLD);
          const double bare = since(b0);
          if (!timed) continue;
          // The counts exchange is the preprocess minus permutation 1 (timed on its own below).
          const auto p0 = clk::now();
          epx::Permutation perm1 = epx::make_permutation(routing.routing_map.data(), tokens, experts);
          epx::Tensor permuted({perm1.rows(), hidden}, x.dtype());
          epx::permute_rows(x, perm1, permuted);
          const double perm1_s = since(p0);
          t.counts += std::max(0.0, pre - perm1_s) / iters;
          t.perm += (perm + perm1_s) / iters;
          t.a2a += comm / iters;
          t.total += total / iters;
          t.bare += bare / iters;
          sent_bytes = 0;
          for (int p = 0; p < world; ++p)
            if (p != rank) sent_bytes += static_cast<double>(s.send_rows[p]) * (static_cast<double>(hidden) * 2 + 4);
        }
        const epx::CommStream::Stats st = stream.stats();
        const double cpu_share = max_over_ranks(st.busy_s > 0 ? st.cpu_s / st.busy_s : 0);
        t.counts = max_over_ranks(t.counts);
        t.perm = max_over_ranks(t.perm);
        t.a2a = max_over_ranks(t.a2a);
        t.total = max_over_ranks(t.total);
        t.bare = max_over_ranks(t.bare);
        sent_bytes = max_over_ranks(sent_bytes);
        if (rank == 0)
          std::printf("%6lld %5lld %3d %10.2f | %9.3f %9.3f %9.3f %9.3f | %9.3f %6.2fx | %.0f%%\n",
                      static_cast<long long>(tokens), static_cast<long long>(hidden), k, sent_bytes / 1e6,
                      t.counts * 1e3, t.perm * 1e3, t.a2a * 1e3, t.total * 1e3, t.bare * 1e3,
                      t.total / t.bare, 100 * cpu_share);
      }
  return 0;
}
