#!/bin/bash
# The gradient all-reduce in slices of 1000 elements (EPX_MPI_MAX_COUNT; buckets close at 500,
# so every weight is its own bucket and most take several calls) gives the same losses and
# gradient norms, bit for bit, as whole calls on 2 ranks.
# Usage: sliced_allreduce_same_losses.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for count in 2147483647 1000; do
  EPX_MPI_MAX_COUNT=$count "$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy --max_steps 3 \
    --results "$dir/$count.json" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
done
python3 - "$dir/2147483647.json" "$dir/1000.json" <<'PY'
import json, sys
whole, sliced = ([(i["lm_loss"], i["grad_norm"]) for i in json.load(open(f))["iterations"]] for f in sys.argv[1:])
print("whole calls:", whole)
print("sliced:     ", sliced)
assert len(whole) == 3 and whole == sliced
PY
