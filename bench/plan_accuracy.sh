#!/usr/bin/env bash
# The planner against the published runs of the reference (Qwen3-30B-A3B, 16 x H100, GBS 1024,
# MBS 1, seq 4096, EP 16): `epx plan`'s configured row for each run's settings, the published
# step time and memory, and the error. bash bench/plan_accuracy.sh (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
epx=${EPX_BIN:-./build/epx}
ab="model.moe_token_dispatcher_type=alltoall model.moe_permute_fusion=false model.moe_permute_fusion_into_hybridep=false"
# Published memory is Megatron's log line, mem-max-allocated-gigabytes = bytes / 1e9; the planner
# prints GiB (bytes / 2^30): the error compares bytes.
row() {  # row LABEL PUBLISHED_STEP_S PUBLISHED_MEMORY_GB|- OVERRIDES...
  local label=$1 step=$2 mem=$3; shift 3
  "$epx" plan qwen3_30b_a3b "$@" | awk -v l="$label" -v s="$step" -v m="$mem" '$1 == "*" {
    printf "| %s | %.2f | %.2f | %+.1f%% | %s | %.1f | %s |\n", l, s, $5, 100 * ($5 / s - 1),
      (m == "-" ? "-" : sprintf("%s GB = %.2f GiB", m, m / 1.073741824)), $8,
      (m == "-" ? "-" : sprintf("%+.1f%%", 100 * ($8 * 1.073741824 / m - 1))) }'
}
echo "| run | published step (s) | predicted (s) | error | published peak | predicted (GiB) | error |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
# shellcheck disable=SC2086
row "seed A/B, alltoall, no EP overlap" 41.25 - $ab model.cuda_graph_impl=none comm_overlap.overlap_moe_expert_parallel_comm=false
# shellcheck disable=SC2086
row "seed A/B, alltoall, EP overlap" 31.31 - $ab model.cuda_graph_impl=none comm_overlap.overlap_moe_expert_parallel_comm=true
# shellcheck disable=SC2086
row "seed A/B, alltoall, EP overlap + delay_wgrad" 31.20 - $ab model.cuda_graph_impl=none \
  comm_overlap.overlap_moe_expert_parallel_comm=true comm_overlap.delay_wgrad_compute=true
# shellcheck disable=SC2086
row "seed smoke, alltoall, TE graph scopes" 45.65 61.351 $ab comm_overlap.overlap_moe_expert_parallel_comm=false
row "Bridge A/B, HybridEP, EP overlap off" 24.714 - comm_overlap.overlap_moe_expert_parallel_comm=false
row "Bridge A/B, HybridEP, EP overlap on" 20.992 62.166
