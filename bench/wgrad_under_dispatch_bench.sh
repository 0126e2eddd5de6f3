#!/usr/bin/env bash
# model.overlap_dispatch_backward_with_experts_wgrad (without EP overlap) on 2 emulated nodes
# (scripts/cluster.sh, 1 rank per node): the steady-state step time and the token exchanges in
# flight and exposed (rank 0, per iteration, from the trace), with and without it. The rows
# alternate; REPEATS runs each and the run with the median step time is reported.
#   bash bench/wgrad_under_dispatch_bench.sh [STEPS] [LINK_GBIT] [REPEATS]   (after scripts/setup.sh; root)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
link=${2:-1}
repeats=${3:-3}
epx=${EPX_BIN:-./build/epx}
shape=(model.vocab_size=1024 train.global_batch_size=32)  # as bench/overlap_bench.sh
export OMP_NUM_THREADS=1
[ "$(id -u)" = 0 ] || { echo "wgrad_under_dispatch_bench.sh: the emulated cluster needs root"; exit 1; }
out=$(mktemp -d)
bash scripts/cluster.sh up --nodes 2 --ranks-per-node 1 --link-gbit "$link" >/dev/null
trap 'bash scripts/cluster.sh down >/dev/null 2>&1; rm -rf "$out"' EXIT
for i in $(seq "$repeats"); do
  for on in false true; do
    $epx launch --cluster -- epx run qwen3_30b_a3b_proxy "${shape[@]}" \
      model.overlap_dispatch_backward_with_experts_wgrad=$on --max_steps "$steps" \
      --results "$out/$on.$i.json" --trace "$out/$on.$i.trace.json" >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
    $epx diagnose "$out/$on.$i.json" --trace "$out/$on.$i.trace.json" --json >"$out/$on.$i.d.json"
  done
done
echo "overlap_dispatch_backward_with_experts_wgrad, qwen3_30b_a3b_proxy ${shape[*]}, 2 nodes x 1 rank at $link Gbit/s, $steps steps, median of $repeats"
echo "| experts' wgrad under the dispatch backward | step (s) | token exchanges in flight (s) | exposed (s) | hidden | final loss |"
echo "| --- | --- | --- | --- | --- | --- |"
python3 - "$out" "$repeats" <<'PY'
import json, sys
out, repeats = sys.argv[1], int(sys.argv[2])
for on in ("false", "true"):
    runs = []
    for i in range(1, repeats + 1):
        r = json.load(open(f"{out}/{on}.{i}.json"))
        t = json.load(open(f"{out}/{on}.{i}.d.json"))["trace"]
        runs.append((r["summary"]["mean_step_time_s"], t["token_exchange_s"], t["token_exchange_exposed_s"],
                     r["summary"]["final_lm_loss"]))
    step, flight, exposed, loss = sorted(runs)[len(runs) // 2]
    print(f"| {on} | {step:.3f} | {flight:.3f} | {exposed:.3f} | {100 * (1 - exposed / flight):.0f}% | {loss:.6f} |")
PY
