#!/usr/bin/env bash
# Load balancing in `epx run` for bench/RESULTS.md: each of Megatron's balancing methods on the
# Qwen3 proxy (2 local ranks, EP 2), STEPS iterations: the expert load (the busiest expert's
# tokens against the mean, mean over the MoE layers and the last 10 iterations), the EP ranks'
# load (the busiest rank's local experts against the mean rank's, the same means), the step time
# over the same iterations and the final loss. Each row is one run; EXTRA overrides go to all.
#   bash bench/load_balancing_bench.sh [STEPS] [EXTRA...]      (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
shift || true
epx=./build/epx
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

field() { grep -oE "\"$2\": [0-9.eE+-]+" "$1" | tail -1 | awk '{print $2}'; }  # the summary comes last
row() {  # row LABEL OVERRIDES...
  local label=$1; shift
  $epx launch -n 2 -- epx run qwen3_30b_a3b_proxy --max_steps "$steps" --steady-from $((steps > 10 ? steps - 9 : 1)) \
    "$@" --results "$out/r.json" >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
  printf "| %s | %.3f | %.3f | %.3f | %.6f |\n" "$label" "$(field "$out/r.json" expert_load_max_over_mean)" \
    "$(field "$out/r.json" ep_rank_load_max_over_mean)" \
    "$(field "$out/r.json" mean_step_time_s)" "$(field "$out/r.json" final_lm_loss)"
}

echo "| balancing | expert load (max / mean) | EP-rank load (max / mean) | step time (s) | final loss |"
echo "| --- | --- | --- | --- | --- |"
row "none" model.moe_router_load_balancing_type=none "$@"
row "aux_loss 1e-2" model.moe_router_load_balancing_type=aux_loss model.moe_aux_loss_coeff=1e-2 "$@"
row "seq_aux_loss 1e-2" model.moe_router_load_balancing_type=seq_aux_loss model.moe_aux_loss_coeff=1e-2 "$@"
row "global_aux_loss 1e-2" model.moe_router_load_balancing_type=global_aux_loss model.moe_aux_loss_coeff=1e-2 "$@"
row "[aux_loss, global_aux_loss] 1e-2 each" "model.moe_router_load_balancing_type=[aux_loss,global_aux_loss]" \
  "model.moe_aux_loss_coeff=[1e-2,1e-2]" "$@"
row "quantile_balancing, ema 0" model.moe_router_load_balancing_type=quantile_balancing model.moe_aux_loss_coeff=0 "$@"
row "quantile_balancing, ema 0.9" model.moe_router_load_balancing_type=quantile_balancing model.moe_aux_loss_coeff=0 \
  model.moe_router_quantile_balancing_ema=0.9 "$@"
row "expert bias (sigmoid, rate 1e-2)" model.moe_router_load_balancing_type=none model.moe_router_score_function=sigmoid \
  model.moe_router_enable_expert_bias=true model.moe_router_bias_update_rate=1e-2 "$@"
