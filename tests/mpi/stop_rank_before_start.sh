#!/bin/bash
# Usage (under mpirun): stop_rank_before_start.sh RANK COMMAND...
# Every rank runs COMMAND except RANK, which stops itself (SIGSTOP) first: a rank that never
# reaches MPI start-up, for the start-up watchdog's test. mpirun ends it when the others exit.
stopped=$1
shift
[ "${OMPI_COMM_WORLD_RANK:-}" = "$stopped" ] && kill -STOP $$
exec "$@"
