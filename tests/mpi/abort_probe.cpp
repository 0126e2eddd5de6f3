// A tiny MPI program for the no-silent-hang tests (run_and_expect_failure.sh):
//   abort_probe timeout  rank 1 never joins the barrier; rank 0's 1 s collective timeout must end
//                        the job with exit code 4 and a message naming rank, group and operation
//   abort_probe error    rank 1 fails with an error while rank 0 waits in a barrier; the job must
//                        end at once with rank 1's message and exit code 2 (epx's error path)
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "epx/comm/comm_stream.hpp"
#include "epx/comm/mpi.hpp"

int main(int argc, char** argv) {
  const bool timeout = argc > 1 && std::strcmp(argv[1], "timeout") == 0;
  epx::MpiSession mpi(1.0);
  epx::CommStream stream;  // the barrier waits on the comm stream, as the dispatchers' do
  try {
    if (mpi.rank() == 1) {
      if (!timeout) throw std::runtime_error("probe failure on purpose");
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    stream.run([&] { mpi.world().barrier(); });
  } catch (const std::exception& e) {
    epx::MpiSession::abort_job(std::string("error: ") + e.what(), 2);
  }
  return 0;
}
