#!/bin/bash
# `epx run` end to end on 2 ranks: the log lines, the summary, the results JSON and the trace.
# Usage: run_writes_results.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
log=$("$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy --max_steps 3 model.num_layers=1 \
  model.seq_length=64 --results "$dir/r.json" --trace "$dir/t.json" 2>&1) || { echo "$log"; exit 1; }
echo "$log"
expect() { grep -qE "$2" "$1" || { echo "missing in $1: $2"; exit 1; }; }
echo "$log" > "$dir/log"
expect "$dir/log" 'iteration +3/ +3 \| consumed samples: +24 \| elapsed time per iteration \(ms\): [0-9.]+ \|.* lm loss: [0-9.E+-]+ \|.* grad norm: [0-9.]+ \|'
# Megatron's load_balancing_loss is the aux loss without its coefficient (1e-3 here): about 1.
expect "$dir/log" 'load_balancing_loss: ([0-9]\.[0-9]+E\+00|[5-9]\.[0-9]+E-01) \|'
expect "$dir/log" 'Step Time : [0-9.]+s GPU utilization: [0-9.]+MODEL_TFLOP/s/GPU'
expect "$dir/log" 'mem-max-allocated-gigabytes: [0-9.]+'
expect "$dir/log" 'steady-state step time: [0-9.]+ s \(mean of iterations 3..3\)'
expect "$dir/r.json" '"mean_step_time_s"'
# The rank's CPU time over the steady state: every thread's, so at least its comm threads'.
expect "$dir/log" 'CPU time \(rank 0, all its threads\): [0-9.]+ s per iteration, [0-9]+% of its [0-9.]+ core\(s\) busy on average'
python3 - "$dir/r.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
assert 0 < s["comm_thread_cpu_s"] <= s["process_cpu_s"], s
PY
expect "$dir/r.json" '"expert_model_parallel_size": 2'
expect "$dir/r.json" '"lm_loss"'
expect "$dir/t.json" '"name":"dispatch"'
expect "$dir/t.json" '"pid":1'
# Two aux losses as a list, each logged by Megatron's name. The global one sums the counts over
# both ranks: about 1 as well.
log=$("$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy --max_steps 2 model.num_layers=1 \
  model.seq_length=64 'model.moe_router_load_balancing_type=[aux_loss,global_aux_loss]' \
  'model.moe_aux_loss_coeff=[1e-3,1e-3]' --results "$dir/lb.json" 2>&1) || { echo "$log"; exit 1; }
echo "$log" > "$dir/lb.log"
expect "$dir/lb.log" ' load_balancing_loss: ([0-9]\.[0-9]+E\+00|[5-9]\.[0-9]+E-01) \| global_load_balancing_loss: ([0-9]\.[0-9]+E\+00|[5-9]\.[0-9]+E-01) \|'
expect "$dir/lb.json" '"global_load_balancing_loss"'
# Another run's trace (1 rank, 2 iterations) is refused, not read as this run's.
"$mpirun" --oversubscribe -np 1 "$epx" run qwen3_30b_a3b_proxy -ep 1 --max_steps 2 model.num_layers=1 \
  model.seq_length=64 --trace "$dir/other.json" >/dev/null 2>&1
set +e
out=$("$epx" diagnose "$dir/r.json" --trace "$dir/other.json" 2>&1)
code=$?
set -e
echo "$out"
[[ $code -eq 2 && $out == *"a trace of 1 rank(s), but"*"ran on 2: not the same run's trace"* ]] || { echo "another run's trace was read"; exit 1; }
# A trace of as many ranks and iterations whose steps are not the results' is refused too.
sed -E 's/"step_time_s": *[0-9.eE+-]+/"step_time_s": 1000/' "$dir/r.json" > "$dir/slow.json"
set +e
out=$("$epx" diagnose "$dir/slow.json" --trace "$dir/t.json" 2>&1)
code=$?
set -e
echo "$out"
[[ $code -eq 2 && $out == *"says 1e+03 s: not the same run's trace"* ]] || { echo "a trace of other steps was read"; exit 1; }
# A Megatron log has no epx trace: one given with it is another run's.
printf ' iteration        1/       2 | elapsed time per iteration (ms): 900.0 | lm loss: 1.0E+01 |\n iteration        2/       2 | elapsed time per iteration (ms): 900.0 | lm loss: 9.0E+00 |\n' >"$dir/m.log"
set +e
out=$("$epx" diagnose "$dir/m.log" --trace "$dir/t.json" --config qwen3_30b_a3b -g h100 2>&1)
code=$?
set -e
[[ $code -eq 2 && $out == *"is a Megatron log (its timers are read from the log); drop the trace"* ]] || { echo "$out"; echo "a trace was read with a Megatron log"; exit 1; }
# Results carry their config: --config is for a Megatron log and is refused here.
set +e
out=$("$epx" diagnose "$dir/r.json" --config qwen3_30b_a3b_proxy 2>&1)
code=$?
set -e
[[ $code -eq 2 && $out == *"carries the config it ran with"* ]] || { echo "$out"; echo "--config replaced the results' config"; exit 1; }
