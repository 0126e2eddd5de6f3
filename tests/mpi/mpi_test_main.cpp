// main() of the MPI test binary, run by ctest under `mpirun -np N --oversubscribe`: one
// MpiSession for all tests; only rank 0 prints gtest's progress (every rank still fails the job
// on its own failures, since mpirun returns nonzero when any rank does).
#include <gtest/gtest.h>

#include "mpi_test_support.hpp"

namespace epx::test {
namespace {
MpiSession* g_session = nullptr;
}
MpiSession& mpi() { return *g_session; }
}  // namespace epx::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  epx::MpiSession session(epx::collective_timeout_from_env(60));
  epx::test::g_session = &session;
  if (session.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  if (rc != 0)
    std::fprintf(stderr, "rank %d of %d: tests failed\n", session.rank(), session.size());
  return rc;
}
