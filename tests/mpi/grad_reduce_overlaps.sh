#!/bin/bash
# ddp.overlap_grad_reduce on 2 ranks: the trace shows several DP gradient buckets per iteration,
# the first of them started before the last micro-batch's backward reached the embedding (so it
# ran under the backward); without the knob, one bucket after the backward.
# Usage: grad_reduce_overlaps.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for mode in plain overlap rows; do
  knobs=()
  [[ $mode != plain ]] && knobs=(ddp.overlap_grad_reduce=true ddp.bucket_size=100000)
  [[ $mode == rows ]] && knobs+=(ddp.reduce_embedding_rows=true)
  "$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy --max_steps 3 "${knobs[@]}" \
    --trace "$dir/$mode.json" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
done
python3 - "$dir/plain.json" "$dir/overlap.json" "$dir/rows.json" <<'PY'
import json, sys
def last_iteration(path):
    d = json.load(open(path))
    ev = [e for e in (d["traceEvents"] if isinstance(d, dict) else d) if e.get("ph") == "X" and e["pid"] == 0]
    opt = sorted(e["ts"] + e["dur"] for e in ev if e["name"] == "optimizer step")
    begin, end = opt[-2], opt[-1]
    inside = [e for e in ev if begin <= e["ts"] < end]
    buckets = sorted(e["ts"] for e in inside if e["name"] == "gradient all-reduce (DP)")
    embedding = max(e["ts"] for e in inside if e["name"] == "embedding backward")
    rows = [e["ts"] for e in inside if e["name"] == "embedding gradient rows all-gather (DP)"]
    return buckets, embedding, rows
plain, _, _ = last_iteration(sys.argv[1])
buckets, embedding, rows = last_iteration(sys.argv[2])
split, split_embedding, split_rows = last_iteration(sys.argv[3])
print(f"plain: {len(plain)} bucket(s); overlap: {len(buckets)} buckets, the first {(embedding - buckets[0]) / 1e3:.1f} ms "
      "before the last embedding backward began")
assert len(plain) == 1, plain
assert len(buckets) >= 3, buckets
assert buckets[0] < embedding, (buckets, embedding)
assert buckets[-1] >= embedding and not rows, (buckets, embedding, rows)  # the embedding's bucket: after
print(f"rows: {len(split)} buckets, the last {(split_embedding - split[-1]) / 1e3:.1f} ms before the last embedding "
      f"backward began; {len(split_rows)} rows all-gather after it")
assert len(split) == len(buckets) and split[-1] < split_embedding, (split, split_embedding)
assert len(split_rows) == 1 and split_rows[0] >= split_embedding, (split_rows, split_embedding)
PY
