#!/bin/bash
# `epx plan --calibrate` on 2 local ranks measures the intra-node link (rate and latency) beside
# the compute rates, and its output plans `-g cpu` when read back with --hardware.
# Usage: plan_calibrate.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$mpirun" --oversubscribe -np 2 "$epx" plan qwen3_30b_a3b_proxy --calibrate >"$dir/cpu.yaml"
cat "$dir/cpu.yaml"
expect() { grep -qE "$2" "$1" || { echo "missing in $1: $2"; exit 1; }; }
for key in cores shared_core_efficiency bf16_tflops hbm_tb_s gemm_efficiency attention_tflops nvlink_gb_s nvlink_latency_us; do
  expect "$dir/cpu.yaml" "^  $key: [0-9.]+$"
done
expect "$dir/cpu.yaml" 'intra-node link: ranks 0 and 1 on one node, measured'
"$epx" plan qwen3_30b_a3b_proxy -ng 2 -g cpu --hardware "$dir/cpu.yaml" --json >"$dir/plan.json"
expect "$dir/plan.json" '"as_configured": true'
