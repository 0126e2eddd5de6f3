#!/bin/bash
# `epx diagnose` on runs made to hit each wall here: the proxy on 2 ranks at vocabulary 4096 and
# sequence 512, compute-bound with a margin (compute; ctest runs this test alone),
# tiny micro-batches on one rank, so that no exchange hides the small kernels' low rate, the first run
# judged against a memory budget just above its peak (memory); and its own Megatron-format log
# read back. The emulated cluster's slow link
# (communication) is tests/cluster/diagnose_slow_link.sh.
# Usage: diagnose_walls.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() {  # run NAME RANKS OVERRIDES...
  local name=$1 np=$2; shift 2
  "$mpirun" --oversubscribe -np "$np" "$epx" run qwen3_30b_a3b_proxy model.vocab_size=1024 train.global_batch_size=16 \
    --max_steps 4 "$@" --results "$dir/$name.json" --trace "$dir/$name.trace.json" >"$dir/$name.log" 2>&1 ||
    { cat "$dir/$name.log"; exit 1; }
}
field() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {"d": d}))' "$@"; }
"$mpirun" --oversubscribe -np 2 "$epx" plan qwen3_30b_a3b_proxy --calibrate >"$dir/cpu.yaml"
run normal 2 model.vocab_size=4096 model.seq_length=512
"$epx" diagnose "$dir/normal.json" --trace "$dir/normal.trace.json" --hardware "$dir/cpu.yaml" --json >"$dir/normal.d.json"
# Its exchanges are 6-7% of the step exposed here; once in a CI run a descheduled rank stretched
# them to 25%, the communication wall's threshold. A second run decides such an outlier. Under
# sanitizers (EPX_TEST_SANITIZED=1) the ranks compute ten times slower and unevenly, the one
# waiting on the other shows as exposed exchanges (28-34%), and its verdict is not judged.
judge_normal=$([[ ${EPX_TEST_SANITIZED:-0} == 1 ]] && echo 0 || echo 1)
if [[ $judge_normal == 1 && $(field "$dir/normal.d.json" 'd["binding_wall"]') != compute/host ]]; then
  echo "normal: $(field "$dir/normal.d.json" 'd["why"]'); running it again"
  run normal 2 model.vocab_size=4096 model.seq_length=512
  "$epx" diagnose "$dir/normal.json" --trace "$dir/normal.trace.json" --hardware "$dir/cpu.yaml" --json >"$dir/normal.d.json"
fi
run tiny 1 model.seq_length=16 model.expert_model_parallel_size=1
"$epx" diagnose "$dir/tiny.json" --trace "$dir/tiny.trace.json" --hardware "$dir/cpu.yaml" --json >"$dir/tiny.d.json"
"$epx" diagnose "$dir/tiny.json" --trace "$dir/tiny.trace.json" --hardware "$dir/cpu.yaml"
for f in normal tiny; do echo "$f: $(field "$dir/$f.d.json" 'd["binding_wall"] + " | " + d["why"]')"; done
if [[ $judge_normal == 1 ]]; then
  [[ $(field "$dir/normal.d.json" 'd["binding_wall"]') == compute/host ]]
  [[ $(field "$dir/normal.d.json" 'd["why"].split(":")[0]') == compute ]]
fi
# The tiny run's rate against the calibrated one (18-22% here) is not judged under sanitizers
# either: their instrumented elementwise code runs ten times slower beside oneDNN's uninstrumented
# GEMMs, the calibration puts it all in the layers' efficiency (0.0085), and the small kernels'
# run then reads 59% of it.
if [[ $judge_normal == 1 ]]; then
  [[ $(field "$dir/tiny.d.json" 'd["why"].split(":")[0]') == "compute below its attainable rate (small or unfused kernels)" ]]
  [[ $(field "$dir/tiny.d.json" 'd["fixes"][0]["overrides"][0]') == train.micro_batch_size=2 ]]
fi
# At EP 1 the dispatch and combine are copies within the rank, and say so.
python3 - "$dir/tiny.d.json" "$dir/normal.d.json" <<'PY'
import json, sys
comm = lambda f: next(w["evidence"] for w in json.load(open(f))["walls"] if w["wall"] == "communication")
assert "EP 1, ETP 1: copies within the rank" in comm(sys.argv[1]) and "token exchanges" not in comm(sys.argv[1]), comm(sys.argv[1])
assert "token exchanges" in comm(sys.argv[2]), comm(sys.argv[2])
PY

# A memory budget 5% above the run's peak.
budget=$(field "$dir/normal.json" 'd["summary"]["peak_memory_bytes"] / 0.95 / 2**30')
printf 'cpu:\n  memory_gb: %s\n' "$budget" >"$dir/budget.yaml"
"$epx" diagnose "$dir/normal.json" --hardware "$dir/cpu.yaml" --hardware "$dir/budget.yaml" --json >"$dir/memory.d.json"
[[ $(field "$dir/memory.d.json" 'd["binding_wall"]') == memory ]]
[[ $(field "$dir/memory.d.json" 'd["fixes"][0]["overrides"][0]') == model.recompute_granularity=selective ]]
[[ $(field "$dir/memory.d.json" 'd["fixes"][0]["predicted"]') == planner:* ]]

# The same run as a Megatron log, with its config named.
"$epx" diagnose "$dir/normal.log" --config qwen3_30b_a3b_proxy -g cpu --json >"$dir/log.d.json"
[[ $(field "$dir/log.d.json" 'd["run"]["kind"]') == "Megatron log" ]]
python3 - "$dir/log.d.json" "$dir/normal.json" <<'PY'
import json, sys
log, res = json.load(open(sys.argv[1]))["run"], json.load(open(sys.argv[2]))["summary"]
assert log["steady_state_iterations"] == [3, 4], log
assert abs(log["mean_step_time_s"] / res["mean_step_time_s"] - 1) < 0.01, (log, res)
assert abs(log["peak_memory_gb"] * 2**30 / res["peak_memory_bytes"] - 1) < 0.01, (log, res)
PY
# A log without its world size and a config without one: -ng names it, --override edits the config.
"$epx" diagnose "$dir/normal.log" --config qwen3_30b_a3b_proxy -g cpu --override '~target.num_gpus' >"$dir/noworld.txt" 2>&1 &&
  { echo "a run without a world size was diagnosed"; exit 1; }
grep -q "pass -ng N" "$dir/noworld.txt"
"$epx" diagnose "$dir/normal.log" --config qwen3_30b_a3b_proxy -g cpu --override '~target.num_gpus' -ng 2 \
  --override model.moe_permute_fusion=true --json >"$dir/ng.d.json"
[[ $(field "$dir/ng.d.json" 'd["run"]["kind"]') == "Megatron log" ]]
# A world given here that the run's config cannot take: the option is named, not --config.
"$epx" diagnose "$dir/normal.json" -ng 64 >"$dir/ng64.txt" 2>&1 && { echo "-ng 64 was taken"; exit 1; }
grep -q "with -ng 64 given here: are they the run's?" "$dir/ng64.txt"
echo "diagnose_walls: passed"
