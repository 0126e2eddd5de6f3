#!/bin/bash
# ddp.overlap_grad_reduce on 2 ranks: the trace shows several DP gradient buckets per iteration,
# the first of them started before the last micro-batch's backward reached the embedding (so it
# ran under the backward), and none before that backward began; without the knob, one bucket
# after the backward. With ddp.reduce_embedding_rows the embedding's bucket (the earlier
# micro-batches' sum) starts before the last micro-batch's backward, and only that
# micro-batch's rows are all-gathered after its embedding backward.
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
    head = max(e["ts"] for e in inside if e["name"] == "lm head + loss backward")  # the last backward begins
    embedding = max(e["ts"] for e in inside if e["name"] == "embedding backward")
    rows = [e["ts"] for e in inside if e["name"] == "embedding gradient rows all-gather (DP)"]
    return buckets, head, embedding, rows
plain, _, _, _ = last_iteration(sys.argv[1])
buckets, head, embedding, rows = last_iteration(sys.argv[2])
split, split_head, split_embedding, split_rows = last_iteration(sys.argv[3])
print(f"plain: {len(plain)} bucket(s); overlap: {len(buckets)} buckets, the first {(embedding - buckets[0]) / 1e3:.1f} ms "
      "before the last embedding backward began")
assert len(plain) == 1, plain
assert len(buckets) >= 3, buckets
assert head <= buckets[0] < embedding, (buckets, head, embedding)
assert not rows, rows
print(f"rows: {len(split)} buckets, the first {(split_head - split[0]) / 1e3:.1f} ms before the last backward began; "
      f"{len(split_rows)} rows all-gather after the last embedding backward")
assert len(split) == len(buckets) and split[0] < split_head <= split[1], (split, split_head)
assert len(split_rows) == 1 and split_rows[0] >= split_embedding, (split_rows, split_embedding)
PY
