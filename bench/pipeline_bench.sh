#!/usr/bin/env bash
# Pipeline bubbles: `epx run` of the Qwen3-30B-A3B proxy with 8 layers on 2 local ranks as
# PP = 2 (EP 1), the 1F1B schedule and the interleaved one with VPP 2 and 4, over m micro-batches
# per iteration. Reports each stage's steady-state time waiting on the other (bubble + exposed
# p2p), as a share of its compute, against the ideal (PP-1)/m and (PP-1)/(VPP m), the step time,
# the peak memory (max over ranks), and stage 0's activation peak (rank 0's mem-max-allocated
# less what stays allocated between iterations) against the layers in flight the schedule
# implies: 1F1B holds up to min(PP, m) micro-batches of a stage's L / PP layers on stage 0; the
# interleaved schedule up to 2 (PP-1) + (VPP-1) PP + 1 chunks of L / (PP VPP) layers (its warm-up
# and the first steady forward). Two PP 1 runs of one micro-batch, 8 and 4 layers, give the
# bytes per layer.
#   bash bench/pipeline_bench.sh [STEPS] [MICRO_BATCHES...]   (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-6}
shift || true
mbs=("${@:-2 4 8 16}")
read -r -a mbs <<<"${mbs[*]}"
epx=${EPX_BIN:-./build/epx}
export OMP_NUM_THREADS=1  # one compute thread per rank: 2 ranks on the 2 cores
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shape=(model.num_layers=8 model.vocab_size=1024 model.expert_model_parallel_size=1)
field() { tr -d ' \n' <"$1" | grep -oE "\"$2\":\[?[0-9.eE+-]+(,[0-9.eE+-]+)*" | tail -1 | sed 's/.*:\[\{0,1\}//'; }

echo "qwen3_30b_a3b_proxy ${shape[*]}: 2 local ranks, $steps iterations (mean of 3..$steps)"
echo
layers=8
last() { tr -d ' \n' <"$1" | grep -oE "\"$2\":[0-9.eE+-]+" | tail -1 | sed 's/.*://'; }  # the last iteration's
activations() { echo $(($(last "$1" mem_max_allocated_bytes) - $(last "$1" mem_allocated_bytes))); }
for n in $layers $((layers / 2)); do  # the bytes per layer: the difference of two depths
  $epx run qwen3_30b_a3b_proxy -ng 1 "${shape[@]}" model.num_layers=$n train.global_batch_size=1 --max_steps 3 \
    --results "$out/p$n.json" >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
done
per_layer=$((($(activations "$out/p$layers.json") - $(activations "$out/p$((layers / 2)).json")) / (layers / 2)))
echo "activations per micro-batch and layer (PP 1, one micro-batch, $layers less $((layers / 2)) layers): $((per_layer / 1000)) kB"
echo
echo "| schedule | m | step time (s) | stage 0 / 1 waiting (s/iter) | bubble stage 0 / 1 | ideal | peak memory (MB) | stage 0 activations: measured / layers in flight x per layer (MB) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for m in "${mbs[@]}"; do
  for vpp in none 2 4; do
    args=("${shape[@]}" model.pipeline_model_parallel_size=2 train.global_batch_size="$m")
    [ "$vpp" = none ] || args+=(model.virtual_pipeline_model_parallel_size="$vpp")
    [ "$vpp" = none ] || [ $((m % 2)) = 0 ] || continue
    $epx launch -n 2 -- $epx run qwen3_30b_a3b_proxy -ng 2 "${args[@]}" --max_steps "$steps" \
      --results "$out/r.json" >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
    if [ "$vpp" = none ]; then in_flight=$(((m < 2 ? m : 2) * layers / 2)); else
      chunks=$((2 + (vpp - 1) * 2 + 1)); [ "$chunks" -le $((m * vpp)) ] || chunks=$((m * vpp))
      in_flight=$((chunks * layers / (2 * vpp))); fi
    awk -v s="$([ "$vpp" = none ] && echo 1F1B || echo "interleaved VPP $vpp")" -v m="$m" \
        -v act="$(activations "$out/r.json")" -v inf="$in_flight" -v pl="$per_layer" \
        -v t="$(field "$out/r.json" mean_step_time_s)" -v w="$(field "$out/r.json" stage_wait_s)" \
        -v b="$(field "$out/r.json" stage_bubble)" -v i="$(field "$out/r.json" ideal_bubble)" \
        -v mem="$(field "$out/r.json" peak_memory_bytes)" 'BEGIN {
      split(w, W, ","); split(b, B, ",")
      printf "| %s | %d | %.3f | %.3f / %.3f | %.0f%% / %.0f%% | %.0f%% | %.1f | %.1f / %d x %.2f = %.1f |\n", s, m, t, W[1], W[2],
        100 * B[1], 100 * B[2], 100 * i, mem / 1e6, act / 1e6, inf, pl / 1e6, inf * pl / 1e6 }'
  done
done
