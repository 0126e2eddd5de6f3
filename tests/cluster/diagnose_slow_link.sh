#!/usr/bin/env bash
# ctest cluster.diagnose_slow_link: the proxy on 2 emulated nodes behind a 0.15 Gbit/s link is
# bound by its token exchanges; `epx diagnose` must name the communication wall from the trace,
# and put a flex dispatcher first among the fixes. Exit 77 (skipped) without root.
#   diagnose_slow_link.sh CLUSTER_SH EPX
set -uo pipefail
cluster=$1 epx=$2
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "skipped: the emulated cluster needs root, ip and tc"
  exit 77
fi
dir=$(mktemp -d)
trap '"$cluster" down >/dev/null 2>&1; rm -rf "$dir"' EXIT
set -e
"$cluster" up --nodes 2 --ranks-per-node 1 --link-gbit 0.15 >/dev/null
"$epx" launch --cluster -- "$epx" run qwen3_30b_a3b_proxy model.vocab_size=1024 train.global_batch_size=16 \
  --max_steps 4 --results "$dir/r.json" --trace "$dir/t.json" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
"$epx" diagnose "$dir/r.json" --trace "$dir/t.json"
"$epx" diagnose "$dir/r.json" --trace "$dir/t.json" --json >"$dir/d.json"
python3 - "$dir/d.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["binding_wall"] == "communication", d["why"]
assert d["fixes"][0]["overrides"] == ["model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep"], d["fixes"][0]
PY
echo "cluster.diagnose_slow_link: passed"
