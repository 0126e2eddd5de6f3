#!/bin/bash
# `epx bench layer --json` on 2 ranks: the fields the issue names, every phase, positive rates,
# and phases that add up to the pass (each a median, so within a margin).
# Usage: bench_layer_json.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$mpirun" --oversubscribe -np 2 "$epx" bench layer qwen3_30b_a3b_proxy --repeat 3 --warmup 1 --json >"$out"
python3 - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k in ("fwd_bwd_ms_median", "gflops_per_s", "dense_gemm_gflops_per_s", "phases"):
    assert k in r, f"missing {k}: {r}"
p = r["phases"]
names = {"router", "permutation", "dispatch", "expert GEMMs", "combine", "unpermutation", "shared expert", "other"}
assert set(p) == names, p
assert r["fwd_bwd_ms_median"] > 0 and r["gflops_per_s"] > 0 and r["dense_gemm_gflops_per_s"] > 0, r
assert p["expert GEMMs"] > 0 and p["dispatch"] > 0 and p["router"] > 0, p
total = sum(p.values())
assert 0.5 * r["fwd_bwd_ms_median"] < total < 1.5 * r["fwd_bwd_ms_median"], (total, r)
print(f"fwd+bwd {r['fwd_bwd_ms_median']:.1f} ms, phases add to {total:.1f} ms, {r['gflops_per_s']:.1f} GFLOP/s")
PY
