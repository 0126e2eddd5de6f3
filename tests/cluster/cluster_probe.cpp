// Run across the emulated cluster (tests/cluster/cluster_test.sh): checks that every rank sits on
// the node it should (rank r on epxnode<r / G>) and that traffic between nodes really crosses the
// shaped link: the node's interface counts the bytes, and the measured rate is near the
// configured one, while traffic inside a node (shared memory) is much faster.
//   cluster_probe NODES RANKS_PER_NODE LINK_GBIT
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

long long tx_bytes() {
  std::ifstream in("/sys/class/net/eth0/statistics/tx_bytes");
  long long n = -1;
  in >> n;
  return n;
}

// Median seconds for `bytes` from rank `from` to rank `to` (and a 1-byte reply).
double transfer_seconds(int me, int from, int to, std::vector<char>& buf) {
  std::vector<double> times;
  for (int rep = 0; rep < 3; ++rep) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    char ack = 0;
    if (me == from) {
      MPI_Send(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, to, 0, MPI_COMM_WORLD);
      MPI_Recv(&ack, 1, MPI_CHAR, to, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else if (me == to) {
      MPI_Recv(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(&ack, 1, MPI_CHAR, from, 1, MPI_COMM_WORLD);
    }
    times.push_back(MPI_Wtime() - t0);
  }
  std::sort(times.begin(), times.end());
  return times[1];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int me = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 4) {
    if (me == 0) std::fprintf(stderr, "usage: cluster_probe NODES RANKS_PER_NODE LINK_GBIT\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const int nodes = std::atoi(argv[1]), rpn = std::atoi(argv[2]);
  const double link_bytes_per_s = std::atof(argv[3]) * 1e9 / 8;
  int failures = 0;
  const auto check = [&](bool ok, const std::string& what) {
    if (me == 0) std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    failures += !ok;
  };

  char host[64] = {};
  gethostname(host, sizeof host - 1);
  std::vector<char> hosts(64 * static_cast<std::size_t>(size));
  MPI_Gather(host, 64, MPI_CHAR, hosts.data(), 64, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (me == 0) check(size == nodes * rpn, "world size " + std::to_string(size) + " = nodes x ranks per node");
  for (int r = 0; r < size && me == 0; ++r) {
    const std::string want = "epxnode" + std::to_string(r / rpn), got = &hosts[64 * static_cast<std::size_t>(r)];
    check(got == want, "rank " + std::to_string(r) + " on " + got + " (expected " + want + ")");
  }

  std::vector<char> buf(24 << 20, 1);  // 24 MiB: about 0.2 s at 1 Gbit/s
  const long long before = tx_bytes();
  const double inter = transfer_seconds(me, 0, rpn, buf);
  const long long sent = tx_bytes() - before;
  if (me == 0) {
    const double rate = static_cast<double>(buf.size()) / inter;
    std::printf("     node 0 -> node 1: %.1f MB/s (link %.1f MB/s, %.0f%%); eth0 sent %lld bytes for %zu x 3\n",
                rate / 1e6, link_bytes_per_s / 1e6, 100 * rate / link_bytes_per_s, sent, buf.size());
    check(sent >= 3 * static_cast<long long>(buf.size()), "the transfers crossed node 0's shaped interface");
    check(rate >= 0.75 * link_bytes_per_s && rate <= 1.10 * link_bytes_per_s,
          "inter-node rate within 75-110% of the configured link rate");
  }
  if (rpn >= 2) {
    const double intra = transfer_seconds(me, 0, 1, buf);
    if (me == 0) {
      const double rate = static_cast<double>(buf.size()) / intra;
      std::printf("     inside node 0:    %.1f MB/s\n", rate / 1e6);
      check(rate >= 2 * link_bytes_per_s, "inside a node (shared memory) at least twice the link rate");
    }
  }
  MPI_Bcast(&failures, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return failures ? 1 : 0;
}
