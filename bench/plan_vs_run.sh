#!/usr/bin/env bash
# `epx plan -g cpu` against `epx run` on this machine: calibrate (`epx plan --calibrate` on two
# ranks, at the recipe's own shape: global batch 8, vocabulary 4096), then
# for each row run the proxy for STEPS iterations and plan the same config; print the measured
# and predicted step time and peak memory and the errors.
#   bash bench/plan_vs_run.sh [STEPS] [SECTIONS]   SECTIONS: local,shapes,recompute,pipeline,cluster (cluster: root)
# EPX_BASELINE_BIN=path/to/another/epx adds that build's prediction, on its own calibration taken
# right after this build's (a planner change's A/B on the same runs).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-6}
sections=,${2:-local},
epx=${EPX_BIN:-./build/epx}
recipe=qwen3_30b_a3b_proxy
shape=(model.vocab_size=1024 train.global_batch_size=32)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
field() { grep -oE "\"$2\": [0-9.eE+-]+" "$1" | tail -1 | awk '{print $2}'; }

row() {  # row LABEL NP GPUS_PER_NODE LAUNCH... -- ARGS...
  local label=$1 np=$2 gn=$3; shift 3
  local launch=() args=()
  while [[ $1 != -- ]]; do launch+=("$1"); shift; done
  shift
  args=("$@")
  "$epx" "${launch[@]}" -- epx run $recipe "${shape[@]}" "${args[@]}" --max_steps "$steps" --results "$out/r.json" \
    >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
  local t m
  t=$(field "$out/r.json" mean_step_time_s)
  m=$(field "$out/r.json" peak_memory_bytes)
  "$epx" plan $recipe "${shape[@]}" "${args[@]}" -ng "$np" -gn "$gn" -g cpu --hardware "$out/cpu.yaml" |
    awk -v l="$label" -v t="$t" -v m="$m" '$1 == "*" {
      printf "| %s | %.3f | %.3f | %+.0f%% | %.1f | %.1f | %+.0f%% |", l, t, $5, 100 * ($5 / t - 1), m / 1e6,
        $8 * 1073.741824, 100 * ($8 * 1073741824 / m - 1) }'
  if [[ -n ${EPX_BASELINE_BIN:-} ]]; then
    "$EPX_BASELINE_BIN" plan $recipe "${shape[@]}" "${args[@]}" -ng "$np" -gn "$gn" -g cpu --hardware "$out/cpu_baseline.yaml" |
      awk -v t="$t" '$1 == "*" { printf " %.3f (%+.0f%%) |", $5, 100 * ($5 / t - 1) }'
  fi
  echo
}

"$epx" launch -n 2 -- epx plan $recipe --calibrate >"$out/cpu.yaml"  # with the intra-node link
if [[ -n ${EPX_BASELINE_BIN:-} ]]; then
  "$epx" launch -n 2 -- "$(realpath "$EPX_BASELINE_BIN")" plan $recipe --calibrate >"$out/cpu_baseline.yaml"
fi
sed -n '/^cpu:/,$p' "$out/cpu.yaml" | tr '\n' ' '
echo
echo
if [[ -n ${EPX_BASELINE_BIN:-} ]]; then
  echo "| run | measured step (s) | predicted (s) | error | measured peak (MB) | predicted (MB) | error | baseline's prediction (s) |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
else
  echo "| run | measured step (s) | predicted (s) | error | measured peak (MB) | predicted (MB) | error |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
fi
if [[ $sections == *,local,* ]]; then
  row "1 rank" 1 1 launch -n 1 -- -ep 1
  for d in alltoall deepep hybridep; do
    flex=()
    [[ $d == alltoall ]] || flex=(--moe_flex_dispatcher_backend "$d")
    row "2 local ranks, $d" 2 2 launch -n 2 -- "${flex[@]}"
    row "2 local ranks, $d, EP overlap" 2 2 launch -n 2 -- "${flex[@]}" --moe_a2a_overlap true
  done
fi
if [[ $sections == *,shapes,* ]]; then  # away from the calibrated model
  row "2 local ranks, alltoall, seq 512" 2 2 launch -n 2 -- model.seq_length=512
  row "2 local ranks, alltoall, 4 layers" 2 2 launch -n 2 -- model.num_layers=4
  row "2 local ranks, alltoall, hidden 512, EP overlap" 2 2 launch -n 2 -- model.hidden_size=512 --moe_a2a_overlap true
fi
if [[ $sections == *,recompute,* ]]; then  # 4 layers: block and uniform chunks differ
  full=(model.recompute_granularity=full)
  row "2 local ranks, 4 layers, no recompute" 2 2 launch -n 2 -- model.num_layers=4
  row "2 local ranks, 4 layers, full uniform 1" 2 2 launch -n 2 -- model.num_layers=4 "${full[@]}" \
    model.recompute_method=uniform model.recompute_num_layers=1
  row "2 local ranks, 4 layers, full uniform 2" 2 2 launch -n 2 -- model.num_layers=4 "${full[@]}" \
    model.recompute_method=uniform model.recompute_num_layers=2
  row "2 local ranks, 4 layers, full block 1" 2 2 launch -n 2 -- model.num_layers=4 "${full[@]}" \
    model.recompute_method=block model.recompute_num_layers=1
  row "2 local ranks, 4 layers, selective moe_act, layernorm" 2 2 launch -n 2 -- model.num_layers=4 \
    model.recompute_granularity=selective "model.recompute_modules=[moe_act,layernorm]"
fi
if [[ $sections == *,pipeline,* ]]; then  # PP 4 on 4 ranks time-shares the 2 cores; heavy heads unbalance the stages
  pp=(-ep 1 model.num_layers=8 train.global_batch_size=8)
  row "4 local ranks, PP 4, vocab 16384" 4 4 launch -n 4 -- -pp 4 "${pp[@]}" model.vocab_size=16384
  row "4 local ranks, PP 4, vocab 1024" 4 4 launch -n 4 -- -pp 4 "${pp[@]}"
  row "4 local ranks, PP 4 x VPP 2, vocab 16384" 4 4 launch -n 4 -- -pp 4 -vp 2 "${pp[@]}" model.vocab_size=16384
  row "4 local ranks, PP 2 x DP 2, vocab 16384" 4 4 launch -n 4 -- -pp 2 "${pp[@]}" model.vocab_size=16384
  row "2 local ranks, PP 2, vocab 16384" 2 2 launch -n 2 -- -pp 2 "${pp[@]}" model.vocab_size=16384
  row "2 local ranks, PP 2, vocab 16384, Et*6|ttL" 2 2 launch -n 2 -- -pp 2 "${pp[@]}" model.vocab_size=16384 \
    "model.pipeline_model_parallel_layout=Et*6|ttL"
  recipe=deepseek_v3_mla_proxy  # cut to 4 layers, the MTP layer beside the loss and in a stage of its own
  mla=(model.pipeline_model_parallel_size=4 -ep 1 model.num_layers=4 "model.moe_layer_freq=[0,1,1,1]"
    model.vocab_size=4096 train.global_batch_size=8)
  row "4 local ranks, MLA proxy, PP 4 x VPP 2, E|t|t|t|t|||mL" 4 4 launch -n 4 -- "${mla[@]}" \
    "model.pipeline_model_parallel_layout=E|t|t|t|t|||mL"
  row "4 local ranks, MLA proxy, PP 4 x VPP 2, E|t|t|t|t||m|L" 4 4 launch -n 4 -- "${mla[@]}" \
    "model.pipeline_model_parallel_layout=E|t|t|t|t||m|L"
  recipe=qwen3_30b_a3b_proxy
fi
if [[ $sections == *,cluster,* ]]; then
  bash scripts/cluster.sh up --nodes 2 --ranks-per-node 1 --link-gbit 0.15 >/dev/null
  trap 'bash scripts/cluster.sh down >/dev/null 2>&1; rm -rf "$out"' EXIT
  "$epx" launch --cluster -- epx plan $recipe --calibrate >"$out/cpu.yaml"  # now across the link
  if [[ -n ${EPX_BASELINE_BIN:-} ]]; then
    "$epx" launch --cluster -- "$(realpath "$EPX_BASELINE_BIN")" plan $recipe --calibrate >"$out/cpu_baseline.yaml"
  fi
  echo "| (calibrated across the nodes: $(grep -E '^  network_(gb_s|latency_us)' "$out/cpu.yaml" | tr -s ' \n' ' ')) |"
  for d in alltoall deepep; do
    flex=()
    [[ $d == alltoall ]] || flex=(--moe_flex_dispatcher_backend "$d")
    row "2 nodes x 1 rank, $d" 2 1 launch --cluster -- "${flex[@]}"
    row "2 nodes x 1 rank, $d, EP overlap" 2 1 launch --cluster -- "${flex[@]}" --moe_a2a_overlap true
  done
fi
