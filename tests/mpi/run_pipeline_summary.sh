#!/bin/bash
# `epx run` with PP 2 x VPP 2 on 2 ranks: the summary names each stage's wait and the ideal
# bubble, the results JSON carries them per stage, and `epx diagnose` reads the waits from the
# trace as the pipeline's part of the communication wall.
# Usage: run_pipeline_summary.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy --max_steps 4 model.num_layers=4 \
  model.pipeline_model_parallel_size=2 model.virtual_pipeline_model_parallel_size=2 model.expert_model_parallel_size=1 \
  --results "$dir/r.json" --trace "$dir/t.json" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
grep -q "pipeline PP 2 x VPP 2: stage 0 \[0,1) \[2,3), stage 1 \[1,2) \[3,4), 8 micro-batches: ideal bubble" "$dir/log" ||
  { cat "$dir/log"; exit 1; }
grep -q "    stage 1: .* waiting on the neighbouring stages" "$dir/log" || { cat "$dir/log"; exit 1; }
"$epx" diagnose "$dir/r.json" --trace "$dir/t.json" --json >"$dir/d.json"
python3 - "$dir/r.json" "$dir/t.json" "$dir/d.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["summary"]["pipeline"]
assert p["stages"] == 2 and p["virtual_stages_per_stage"] == 2 and p["micro_batches"] == 8, p
assert abs(p["ideal_bubble"] - 1 / 16) < 1e-12, p
assert len(p["stage_wait_s"]) == 2 and all(w >= 0 for w in p["stage_wait_s"]), p
assert all(s > 0 for s in p["stage_schedule_s"]), p
# The traces show the waits on the other stage: the last stage's on the first's activations at
# least (the first stage's on the gradients need not block on a loaded machine).
ev = json.load(open(sys.argv[2]))["traceEvents"]
waits = {e["pid"] for e in ev if e.get("ph") == "X" and e["name"] == "pipeline recv"}
assert 1 in waits and waits <= {0, 1}, waits
d = json.load(open(sys.argv[3]))
assert d["trace"]["pipeline_wait_s"] > 0, d["trace"]
comm = [w for w in d["walls"] if w["wall"] == "communication"][0]
assert "pipeline stages (bubble + p2p)" in comm["evidence"], comm
print("stage waits", p["stage_wait_s"], "bubbles", p["stage_bubble"], "diagnose:", d["trace"]["pipeline_wait_s"])
PY
