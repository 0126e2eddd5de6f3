#!/usr/bin/env bash
# `epx diagnose` on a long Megatron log: a synthetic log of N iterations (Bridge's iteration line,
# and the (min, max) timers every 10th iteration, as a long run with --log-interval 1 writes
# them), then the wall time of reading and diagnosing it.
#   bash bench/diagnose_bench.sh [ITERATIONS]   (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-100000}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
awk -v n="$n" 'BEGIN {
  for (i = 1; i <= n; i++) {
    printf " [2026-01-01 00:00:00] iteration %8d/%8d | consumed samples: %12d | elapsed time per iteration (ms): 9000.1 | throughput per GPU (TFLOP/s/GPU): 400.1 | learning rate: 3.000000E-04 | global batch size:   256 | lm loss: 1.000000E+01 | load_balancing_loss: 1.0E+00 | loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |\n", i, n, i * 256
    if (i % 10 == 0)
      printf "(min, max) time across ranks (ms):\n    forward-backward ...............................: (8000.00, 8100.00)\n    optimizer ......................................: (100.00, 110.00)\n"
  }
}' >"$log"
echo "log: $n iterations, $(($(stat -c %s "$log") / 1000000)) MB"
start=$(date +%s.%N)
./build/epx diagnose "$log" --config qwen3_30b_a3b -g h100 >/dev/null
end=$(date +%s.%N)
awk -v s="$start" -v e="$end" -v b="$(stat -c %s "$log")" 'BEGIN { printf "epx diagnose: %.2f s, %.1f MB/s\n", e - s, b / 1e6 / (e - s) }'
