// Helpers shared by the MPI tests.
#pragma once

#include "epx/comm/mpi.hpp"

namespace epx::test {

MpiSession& mpi();  // the test binary's session (mpi_test_main.cpp)

}  // namespace epx::test
