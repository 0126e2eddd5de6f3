#!/bin/bash
# `epx advise` on epx's own runtime: its A/B lines are real `epx run` command lines; the last one
# (the recommended dispatcher with EP overlap and delay_wgrad) runs here on 2 ranks.
# Usage: advise_ab_runs.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$epx" advise qwen3_30b_a3b_proxy -g cpu -ng 2 --json >"$dir/advice.json"
line=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["epx_ab"][-1].splitlines()[-1])' "$dir/advice.json")
echo "$line"
[[ $line == "epx launch -n 2 -- epx run "* ]] || { echo "not an epx run line: $line"; exit 1; }
args=${line#epx launch -n 2 -- epx run }
args=${args/--max_steps 8/--max_steps 3}
args=${args/--results ab/--results $dir\/ab}
# shellcheck disable=SC2086
(cd "$dir" && "$mpirun" --oversubscribe -np 2 "$epx" run $args)
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["config"]["comm_overlap"]["overlap_moe_expert_parallel_comm"] is True, r["config"]["comm_overlap"]' "$dir"/ab*.json
