#!/usr/bin/env bash
# Issue 21's compute-efficiency figures on 2 local ranks (one compute thread each):
#  1. `epx bench layer` at the issue's shape (T 2048 tokens per rank, H 1024, F 512, 16 experts
#     top-4, BF16, EP 2) for each dispatcher: the layer's forward + backward per phase, its model
#     GFLOP/s against the dense BF16 GEMM measured in the same processes ([T k x H] x [H x 2F]),
#     and permutation + unpermutation against dispatch + combine.
#  2. `epx run` of the proxy and the medium recipe (and the medium recipe force-balanced): model
#     TFLOP/s per rank against that dense GEMM rate (from step 1's alltoall run), step time and
#     peak memory.
#   bash bench/efficiency_bench.sh [STEPS] [REPEAT]     (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-6}
repeat=${2:-20}
epx=${EPX_BIN:-./build/epx}
export OMP_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
num() { tr -d ' \n' <"$1" | grep -oE "\"$2\":[0-9.eE+-]+" | tail -1 | sed 's/.*://'; }
shape=(model.hidden_size=1024 model.moe_ffn_hidden_size=512 model.num_moe_experts=16 model.moe_router_topk=4
       model.seq_length=2048 model.expert_model_parallel_size=2)

echo "epx bench layer qwen3_30b_a3b_proxy ${shape[*]}, 2 local ranks, --repeat $repeat (median ms per phase)"
echo
echo "| dispatcher | router | permutation | dispatch | expert GEMMs | combine | unpermutation | other | fwd+bwd (min-max) | GFLOP/s | dense GEMM GFLOP/s | layer / dense | (un)permutation / (dispatch + combine) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
dense=""
for d in alltoall deepep hybridep; do
  args=("${shape[@]}")
  if [ "$d" = alltoall ]; then args+=(model.moe_token_dispatcher_type=alltoall); else
    args+=(model.moe_token_dispatcher_type=flex model.moe_flex_dispatcher_backend="$d"); fi
  $epx launch -n 2 -- $epx bench layer qwen3_30b_a3b_proxy -ng 2 "${args[@]}" --repeat "$repeat" --json >"$out/l.json" 2>"$out/err" ||
    { cat "$out/err"; exit 1; }
  [ -n "$dense" ] || dense=$(num "$out/l.json" dense_gemm_gflops_per_s)
  awk -v d="$d" -v r="$(num "$out/l.json" router)" -v p="$(num "$out/l.json" permutation)" -v x="$(num "$out/l.json" dispatch)" \
      -v e="$(num "$out/l.json" expertGEMMs)" -v c="$(num "$out/l.json" combine)" -v u="$(num "$out/l.json" unpermutation)" \
      -v o="$(num "$out/l.json" other)" -v t="$(num "$out/l.json" fwd_bwd_ms_median)" -v lo="$(num "$out/l.json" fwd_bwd_ms_min)" \
      -v hi="$(num "$out/l.json" fwd_bwd_ms_max)" -v g="$(num "$out/l.json" gflops_per_s)" \
      -v dn="$(num "$out/l.json" dense_gemm_gflops_per_s)" 'BEGIN {
    printf "| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f (%.1f-%.1f) | %.1f | %.1f | %.0f%% | %.0f%% |\n",
      d, r, p, x, e, c, u, o, t, lo, hi, g, dn, 100 * g / dn, 100 * (p + u) / (x + c) }'
done

echo
echo "epx run, 2 local ranks, $steps iterations (mean of 3..$steps); dense GEMM rate: $(printf %.1f "$dense") GFLOP/s per rank (above)"
echo
echo "| recipe | step time (s) | model TFLOP/s per rank | of the dense GEMM rate | peak memory (MB) |"
echo "| --- | --- | --- | --- | --- |"
# The last row routes as Bridge's perf recipes do (moe_router_force_load_balancing): the recipe's
# aux-loss routing leaves one rank's experts with up to a quarter more tokens, and the other
# rank waits for them at every exchange.
for row in qwen3_30b_a3b_proxy qwen3_30b_a3b_medium "qwen3_30b_a3b_medium model.moe_router_force_load_balancing=true"; do
  read -r -a run <<<"$row"
  $epx launch -n 2 -- $epx run "${run[@]}" --max_steps "$steps" --results "$out/r.json" >"$out/log" 2>&1 || { cat "$out/log"; exit 1; }
  awk -v n="$row" -v t="$(num "$out/r.json" mean_step_time_s)" -v f="$(num "$out/r.json" tflops_per_rank)" \
      -v m="$(num "$out/r.json" peak_memory_bytes)" -v dn="$dense" 'BEGIN {
    printf "| %s | %.3f | %.4f | %.0f%% | %.1f |\n", n, t, f, 100 * f * 1e3 / dn, m / 1e6 }'
done
