// OpenMP threads that finish a parallel region spin for a while before sleeping (libgomp's
// default GOMP_SPINCOUNT is 300000 iterations). On this 2-core machine the spinning thread slows
// the serial code between regions by up to 8x (bench/RESULTS.md), so epx's executables cap the
// spin unless the user chose OMP_WAIT_POLICY or GOMP_SPINCOUNT. libgomp reads its environment
// when it loads, before main, hence the re-exec.
#pragma once

namespace epx {

// If neither variable is set: set GOMP_SPINCOUNT=10000 and re-execute this program with the same
// arguments. Returns (keeps running) when a variable is already set or the exec fails.
void cap_openmp_spin(char** argv);

// Under mpirun, ranks on one machine share its cores: unless OMP_NUM_THREADS is set, each rank
// computes with the cores it is bound to, or, when unbound, max(1, cores / local ranks) OpenMP
// threads (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE).
void share_cores_with_local_ranks();

// Throws ConfigError when OMP_NUM_THREADS (a number, or a comma-separated list for nested
// levels) asks for more than kMaxOmpThreads threads: libgomp crashes starting threads past the
// process limit.
inline constexpr long kMaxOmpThreads = 1024;
void check_omp_num_threads();

}  // namespace epx
