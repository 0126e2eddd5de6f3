#!/bin/bash
# model.overlap_dispatch_backward_with_experts_wgrad on 2 ranks: the routed experts' wgrad runs
# while the dispatch's backward exchange is in flight (their spans overlap on rank 0's trace,
# never without it), and the losses and gradient norms are the same, bit for bit.
# Usage: experts_wgrad_under_dispatch_backward.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for on in false true; do
  "$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy --max_steps 3 \
    model.overlap_dispatch_backward_with_experts_wgrad=$on --results "$dir/$on.json" --trace "$dir/$on.trace.json" \
    >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
done
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def losses(on):
    return [(i["lm_loss"], i["grad_norm"]) for i in json.load(open(f"{d}/{on}.json"))["iterations"]]
def overlaps(on):
    events = json.load(open(f"{d}/{on}.trace.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = lambda name: [(e["ts"], e["ts"] + e["dur"]) for e in events
                          if e.get("ph") == "X" and e.get("pid") == 0 and e.get("name") == name]
    return sum(1 for b, e in spans("expert GEMMs") for b2, e2 in spans("dispatch backward") if b < e2 and b2 < e)
print("off:", losses("false"), "overlaps", overlaps("false"))
print("on: ", losses("true"), "overlaps", overlaps("true"))
assert len(losses("false")) == 3 and losses("false") == losses("true")
assert overlaps("false") == 0 and overlaps("true") > 0
PY
