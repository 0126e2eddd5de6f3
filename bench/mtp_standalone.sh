#!/bin/bash
# The MTP layers beside the loss against Megatron's standalone MTP stage (bench/RESULTS.md):
# deepseek_v3_mla_proxy cut to 4 layers, PP 4 x VPP 2 on 4 local ranks, 3 runs per layout. Prints
# per run: layout, mean step (s), peak over the ranks (MiB), final LM and MTP loss, each stage's
# compute (its time in the schedule less its waits on the other stages, s per iteration).
# Run from the repository root after building (build/epx).
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for rep in 1 2 3; do for lay in "E|t|t|t|t|||mL" "E|t|t|t|t||m|L"; do
  ./build/epx launch -n 4 -- epx run deepseek_v3_mla_proxy --max_steps 6 model.pipeline_model_parallel_size=4 \
    model.expert_model_parallel_size=1 model.num_layers=4 "model.moe_layer_freq=[0,1,1,1]" \
    "model.pipeline_model_parallel_layout=$lay" --results "$tmp/r.json" > "$tmp/run.log" 2>&1
  python3 - "$lay" "$tmp" <<'PY'
import json,sys,re
d=json.load(open(sys.argv[2] + '/r.json')); s=d['summary']; it=d['iterations'][-1]
waits=re.findall(r"stage (\d): ([0-9.]+) s per iteration in the schedule, ([0-9.]+) s of it waiting", open(sys.argv[2] + '/run.log').read())
print(sys.argv[1], f"{s['mean_step_time_s']:.3f}", f"{s['peak_memory_bytes']/2**20:.1f}", it['lm_loss'], it['mtp_1_loss'], " ".join(f"{float(a)-float(b):.3f}" for _,a,b in waits))
PY
done; done
