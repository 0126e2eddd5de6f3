#!/bin/bash
# The evidence fuzzer's seeds from a real run: the proxy on 2 ranks for 4 steps under EP overlap
# (its results, trace and Megatron-format log), then epx_evidence_fuzz on them.
# Usage: evidence_fuzz.sh MPIRUN EPX FUZZER [FUZZER OPTIONS...]
set -euo pipefail
mpirun=$1 epx=$2 fuzzer=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# Open MPI keeps allocations past MPI_Finalize by design: no leak report for the seed run (the
# fuzzed diagnose and report runs, without MPI, keep theirs).
ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 \
  "$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy model.vocab_size=1024 --moe_a2a_overlap true \
  --max_steps 4 --results "$dir/results.json" --trace "$dir/trace.json" >"$dir/run.log" 2>&1 ||
  { cat "$dir/run.log"; exit 1; }
"$fuzzer" "$epx" "$dir/results.json" "$dir/trace.json" "$dir/run.log" "$@"
