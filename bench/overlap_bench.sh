#!/usr/bin/env bash
# The seeds' controlled A/B of EP communication overlap, one knob at a time, with `epx run` on
# 2 emulated nodes (scripts/cluster.sh, 1 rank per node, one core's thread each): no overlap;
# EP overlap (the merged 1F1B schedule); EP overlap + delay_wgrad_compute; for the alltoall
# dispatcher and both flex backends. Then the same on 2 ranks inside one node (no shaped link),
# and shared-expert overlap on the proxy that has a shared expert.
#
# Reports the steady-state mean step time (iterations 3..STEPS), its cut against no overlap, and
# from the trace (rank 0, steady state, per iteration): the token exchanges (dispatch, combine
# and their backward) in flight, the part of them no compute covered (exposed) and the share
# hidden, and all communication exposed (with the DP gradient all-reduce, which EP overlap does
# not touch), rank 0's CPU time (all its threads: with one core a rank, no step is shorter),
# and the peak memory (max over ranks; the merged schedule holds two micro-batches).
# Step times on this 2-core machine vary by 10-20% from run to run: REPEATS > 1 runs each row
# that many times and reports the run with the median step time.
#   bash bench/overlap_bench.sh [STEPS] [LINK_GBIT] [REPEATS] [SECTIONS]
#     SECTIONS: comma list of alltoall, flex, shared, local (default: all)
#     EPX_BIN=path/to/epx runs another build (an A/B of two builds on the same machine)
#     EPX_BENCH_OVERRIDES="ddp.overlap_grad_reduce=true ddp.bucket_size=100000" adds overrides to
#     every row (the issue-20 A/B: overlapped gradient reduction in every row)
#     EPX_BENCH_LINK="--exact-rate" (or "--burst-ms 1") adds options to scripts/cluster.sh up: the
#     link's burst allowance (issue 20's last A/B)
#   (after scripts/setup.sh; needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
link=${2:-0.15}
repeats=${3:-1}
sections=,${4:-alltoall,flex,shared,local},
epx=${EPX_BIN:-./build/epx}
recipe=qwen3_30b_a3b_proxy
# The proxy shape: the recipe with a smaller vocabulary (so the LM head and the DP gradient
# all-reduce, which no EP overlap hides, do not dominate) and 16 micro-batches per rank.
shape=(model.vocab_size=1024 train.global_batch_size=32)
read -r -a extra <<<"${EPX_BENCH_OVERRIDES:-}"
shape+=("${extra[@]}")
export OMP_NUM_THREADS=1  # one compute thread per rank: 2 ranks on the 2 cores
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[ "$(id -u)" = 0 ] || { echo "overlap_bench.sh: the emulated cluster needs root"; exit 1; }

field() { grep -oE "\"$2\": [0-9.eE+-]+" "$1" | tail -1 | awk '{print $2}'; }  # the summary comes last
base=""
row() {  # row LABEL LAUNCH... -- RUN ARGS...; the first row of a table is its baseline
  local label=$1; shift
  local i
  for ((i = 0; i < repeats; i++)); do
    "$@" --max_steps "$steps" --results "$out/r$i.json" --trace "$out/t$i.json" >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
    echo "$(field "$out/r$i.json" mean_step_time_s) $i"
  done | sort -n >"$out/times"
  local m; m=$(awk -v m=$(((repeats + 1) / 2)) 'NR == m {print $2}' "$out/times")
  local r=$out/r$m.json n=$((steps - 2))
  local t; t=$(field "$r" mean_step_time_s)
  # The DP gradient reduction per iteration, in flight and exposed (epx diagnose reads the trace).
  $epx diagnose "$r" --trace "$out/t$m.json" --json >"$out/d.json"
  local dp dpe; dp=$(field "$out/d.json" dp_reduce_s); dpe=$(field "$out/d.json" dp_reduce_exposed_s)
  [ -n "$base" ] || base=$t
  awk -v l="$label" -v t="$t" -v b="$base" -v x="$(field "$r" token_exchange_s)" -v xe="$(field "$r" exposed_token_exchange_s)" \
      -v ce="$(field "$r" exposed_comm_s)" -v mem="$(field "$r" peak_memory_bytes)" -v loss="$(field "$r" final_lm_loss)" \
      -v n="$n" -v dp="$dp" -v dpe="$dpe" -v cpu="$(field "$r" process_cpu_s)" 'BEGIN {
    printf "| %s | %.3f | %+.1f%% | %.3f | %.3f | %.0f%% | %.3f / %.3f | %.3f | %.3f | %.1f | %.6f |\n", l, t, 100 * (t / b - 1),
      x / n, xe / n, (x > 0 ? 100 * (1 - xe / x) : 0), dp, dpe, ce / n, cpu / n, mem / 1e6, loss }'
}
header() {
  base=""
  echo
  echo "$1"
  echo
  echo "| run | step time (s) | vs first row | token exchanges in flight (s/iter) | exposed (s/iter) | hidden | DP reduction in flight / exposed (s/iter) | all comm exposed (s/iter) | rank 0's CPU (s/iter) | peak memory (MB) | final loss |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
}
ab() {  # ab LABEL LAUNCH... -- RUN ARGS...: the three rows
  local label=$1; shift
  row "$label, no overlap" "$@" --moe_a2a_overlap false
  row "$label, EP overlap" "$@" comm_overlap.overlap_moe_expert_parallel_comm=true comm_overlap.delay_wgrad_compute=false
  row "$label, EP overlap + delay_wgrad" "$@" --moe_a2a_overlap true
}

want() { [[ $sections == *",$1,"* ]]; }

bash scripts/cluster.sh up --nodes 2 --ranks-per-node 1 --link-gbit "$link" ${EPX_BENCH_LINK:-} >/dev/null
trap 'bash scripts/cluster.sh down >/dev/null 2>&1; rm -rf "$out"' EXIT
echo "$recipe ${shape[*]}: 2 nodes x 1 rank, $link Gbit/s, EP 2, $steps iterations (mean of 3..$steps)," \
  "median of $repeats run(s)"
if want alltoall; then
  header "alltoall"
  ab "alltoall" $epx launch --cluster -- epx run $recipe "${shape[@]}"
fi
if want flex; then
  # HybridEP's domain is the ranks that share memory: 1 per node here.
  for backend in deepep hybridep; do
    header "flex $backend"
    NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=1 \
      ab "flex $backend" $epx launch --cluster -- epx run $recipe "${shape[@]}" --moe_flex_dispatcher_backend $backend
  done
fi
if want shared; then
  header "shared-expert overlap (deepseek_v3_proxy ${shape[*]}, alltoall, no EP overlap)"
  row "moe_shared_expert_overlap=false" $epx launch --cluster -- epx run deepseek_v3_proxy "${shape[@]}"
  row "moe_shared_expert_overlap=true" $epx launch --cluster -- epx run deepseek_v3_proxy "${shape[@]}" model.moe_shared_expert_overlap=true
fi
bash scripts/cluster.sh down >/dev/null

if want local; then
  header "EP 2 inside one node (2 local ranks, shared memory, no shaped link)"
  ab "alltoall, one node" $epx launch -n 2 -- epx run $recipe "${shape[@]}"
fi
