#!/usr/bin/env bash
# The README's main-job command. Until the training runtime lands, the main job is the
# pre-flight check of a shipped recipe with its resolved configuration, then one MoE layer of the
# proxy recipe forward + backward on this machine, on one process and on 2 MPI ranks with the
# experts sharded (files under runs/layer/).
#   bash scripts/run.sh [RECIPE] [overrides and harness flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
bash scripts/setup.sh >"$log" 2>&1 || { cat "$log"; echo "setup failed" >&2; exit 1; }
rm -f "$log"
recipe=${1:-qwen3_30b_a3b}
shift || true
echo "== epx check $recipe $*"
status=0
./build/epx check "$recipe" "$@" || status=$?
echo
echo "== epx config show $recipe $*"
./build/epx config show "$recipe" "$@"
echo
echo "== epx layer qwen3_30b_a3b_proxy: one MoE layer, forward + backward (runs/layer/)"
mkdir -p runs/layer
./build/epx layer qwen3_30b_a3b_proxy --init-seed 1234 --weights runs/layer/weights.safetensors \
  --input runs/layer/input.safetensors --grad-output runs/layer/grad_output.safetensors \
  --out runs/layer/out.safetensors
echo
echo "== mpirun -np 2 epx layer: the same files on 2 ranks, experts sharded by EP (runs/layer/)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np 2 --oversubscribe ./build/epx layer qwen3_30b_a3b_proxy \
  --weights runs/layer/weights.safetensors --input runs/layer/input.safetensors \
  --grad-output runs/layer/grad_output.safetensors --out runs/layer/out_ep2.safetensors
exit "$status"
