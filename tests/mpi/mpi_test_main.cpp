// main() of the MPI test binary, run by ctest under `mpirun -np N --oversubscribe`: one
// MpiSession for all tests; only rank 0 prints gtest's progress (every rank still fails the job
// on its own failures, since mpirun returns nonzero when any rank does); the other ranks print
// only their failed assertions.
#include <gtest/gtest.h>

#include "epx/base/omp_env.hpp"
#include "mpi_test_support.hpp"

namespace epx::test {
namespace {
MpiSession* g_session = nullptr;
}
MpiSession& mpi() { return *g_session; }

class FailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "rank %d: %s:%d: failure\n%s\n", g_session->rank(), r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.message());
  }
};
}  // namespace epx::test

int main(int argc, char** argv) {
  // As epx's own executables: oversubscribed ranks must not spin OpenMP threads on shared cores.
  epx::cap_openmp_spin(argv);
  epx::share_cores_with_local_ranks();
  ::testing::InitGoogleTest(&argc, argv);
  epx::MpiSession session(epx::collective_timeout_from_env(60));
  epx::test::g_session = &session;
  if (session.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new epx::test::FailurePrinter);
  }
  const int rc = RUN_ALL_TESTS();
  if (rc != 0)
    std::fprintf(stderr, "rank %d of %d: tests failed\n", session.rank(), session.size());
  return rc;
}
