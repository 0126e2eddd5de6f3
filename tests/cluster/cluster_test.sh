#!/usr/bin/env bash
# ctest cluster.2x2: bring up 2 nodes x 2 ranks at 1 Gbit/s, check placement and the link with
# the probe, run the flex-vs-alltoall MPI tests across the nodes, check the --exact-rate link,
# and tear the cluster down, also when a step fails. Exit 77 (skipped) without root or network
# namespaces.
#   cluster_test.sh CLUSTER_SH EPX PROBE MPI_TESTS
set -uo pipefail
cluster=$1 epx=$2 probe=$3 mpi_tests=$4
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "skipped: the emulated cluster needs root, ip and tc"
  exit 77
fi
trap '"$cluster" down >/dev/null 2>&1' EXIT
set -e
"$cluster" up --nodes 2 --ranks-per-node 2 --link-gbit 1
"$epx" launch --cluster -- "$probe" 2 2 1
# Flex against alltoall with real nodes as the deepep domains, the alltoall layer itself, and
# the EP-overlap schedule against the plain one (HybridEP's domain: the 2 ranks of a node).
NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=2 "$epx" launch --cluster -- "$mpi_tests" --gtest_brief=1 \
  --gtest_filter='FlexDispatcher.*:DistributedLayer.EpAllRanksTop2*:DistributedLayer.Etp2Ep2Top4:EpOverlap.*:SharedExpertOverlap.*'
# --exact-rate (peak rate metered in 64 KB segments) keeps the link near its rate, and a bad
# --peak-frame (or one without --exact-rate) is refused before anything changes.
"$cluster" up --nodes 2 --ranks-per-node 1 --link-gbit 1 --exact-rate
"$epx" launch --cluster -- "$probe" 2 1 1
if "$cluster" up --exact-rate --peak-frame 100 2>"${TMPDIR:-/tmp}/peak_frame.err"; then
  echo "cluster.sh accepted --peak-frame 100"; exit 1
fi
grep -q "peak-frame = '100'" "${TMPDIR:-/tmp}/peak_frame.err"
if "$cluster" up --peak-frame 9000 2>"${TMPDIR:-/tmp}/peak_frame.err"; then
  echo "cluster.sh accepted --peak-frame without --exact-rate"; exit 1
fi
grep -q "add --exact-rate" "${TMPDIR:-/tmp}/peak_frame.err"
grep -q "link_peak_frame=65536" "${EPX_CLUSTER_DIR:-/run/epx-cluster}/cluster.env"  # the cluster was left as it was
echo "cluster.2x2: passed"
