#!/usr/bin/env bash
# The README's main-job command: set up, then mock pretraining of a proxy recipe on 2 local MPI
# ranks (epx run: the pre-flight check, Megatron's log lines per iteration, then the summary),
# with the results, a Chrome / Perfetto trace, the diagnosis and an HTML report under runs/run/.
#   bash scripts/run.sh [RECIPE] [overrides and harness flags...]   (default: qwen3_30b_a3b_proxy)
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
bash scripts/setup.sh >"$log" 2>&1 || { cat "$log"; echo "setup failed" >&2; exit 1; }
rm -f "$log"
recipe=${1:-qwen3_30b_a3b_proxy}
shift || true
mkdir -p runs/run
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "== epx launch -n 2 -- epx run $recipe --max_steps 6 $*"
./build/epx launch -n 2 -- epx run "$recipe" --max_steps 6 --results runs/run/results.json \
  --trace runs/run/trace.json "$@"
echo "== epx diagnose runs/run/results.json --trace runs/run/trace.json"
./build/epx diagnose runs/run/results.json --trace runs/run/trace.json
./build/epx report runs/run/results.json:runs/run/trace.json -o runs/run/report.html
