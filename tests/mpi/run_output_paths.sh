#!/bin/bash
# `epx run --results/--trace`: a path that cannot be written is refused before any rank computes
# (exit 2 within seconds, nothing left behind), and a disk that fills up while writing leaves no
# partial file. Usage: run_output_paths.sh MPIRUN EPX
set -uo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"
failures=0
small=(qwen3_30b_a3b_proxy --max_steps 3 model.num_layers=1 model.seq_length=64)

# expect CODE MAX_SECONDS PATTERN -- COMMAND...
expect() {
  local want=$1 max=$2 pattern=$3
  shift 4
  local start=$SECONDS output code
  output=$(timeout 120 "$@" 2>&1)
  code=$?
  local took=$((SECONDS - start))
  if [[ $code -ne $want || $took -gt $max ]] || ! grep -qE -- "$pattern" <<<"$output"; then
    echo "FAIL: $* -> exit $code after ${took}s (want $want within ${max}s, output matching: $pattern)"
    tail -5 <<<"$output"
    failures=$((failures + 1))
  else
    echo "ok: exit $code after ${took}s: $(grep -E -- "$pattern" <<<"$output" | head -1)"
  fi
}
nothing_left() {
  local left
  left=$(find "$1" -mindepth 1 2>/dev/null)
  [[ -z $left ]] || { echo "FAIL: left behind in $1: $left"; failures=$((failures + 1)); }
}

run2=("$mpirun" --oversubscribe -np 2 "$epx" run "${small[@]}")
expect 2 10 "--results $dir/missing/r.json: the directory $dir/missing does not exist" -- \
  "${run2[@]}" --results "$dir/missing/r.json"
expect 2 10 "--trace $dir/missing/t.json: the directory .* does not exist" -- \
  "${run2[@]}" --trace "$dir/missing/t.json"
mkdir "$dir/out"
expect 2 10 "--results $dir/out: is a directory" -- "${run2[@]}" --results "$dir/out"
nothing_left "$dir/out"
# An output that is the config it reads, or both outputs one file (through a link too): refused.
"$epx" config show qwen3_30b_a3b_proxy >"$dir/cfg.yaml"
cp "$dir/cfg.yaml" "$dir/cfg.orig"
expect 2 10 "--results $dir/cfg.yaml: the same file as the config" -- \
  "$mpirun" --oversubscribe -np 2 "$epx" run "$dir/cfg.yaml" --max_steps 3 --results "$dir/cfg.yaml"
cmp -s "$dir/cfg.yaml" "$dir/cfg.orig" || { echo "FAIL: the config was changed"; failures=$((failures + 1)); }
ln -s "$dir/r.json" "$dir/link.json"
expect 2 10 "--trace $dir/link.json: the same file as --results $dir/r.json" -- \
  "${run2[@]}" --results "$dir/r.json" --trace "$dir/link.json"
rm "$dir/link.json" "$dir/cfg.yaml" "$dir/cfg.orig"

# A read-only directory (a read-only mount: root ignores permission bits) and a full disk (a
# 12 KiB tmpfs) need a private mount namespace; skip them where this user cannot make one.
if unshare -m true 2>/dev/null; then
  mkdir -p "$dir/ro" "$dir/full"
  expect 2 10 "--results $dir/ro/r.json: cannot create a file in $dir/ro: Read-only file system" -- \
    unshare -m sh -c "mount --bind '$dir/ro' '$dir/ro' && mount -o remount,ro,bind '$dir/ro' &&
      exec ${run2[*]} --results '$dir/ro/r.json'"
  expect 2 120 "cannot write $dir/full/t.json: No space left on device; nothing was written" -- \
    unshare -m sh -c "mount -t tmpfs -o size=12k tmpfs '$dir/full' &&
      ${run2[*]} --results '$dir/full/r.json' --trace '$dir/full/t.json';
      code=\$?; left=\$(ls -A '$dir/full'); [ -z \"\$left\" ] || { echo left: \$left; exit 99; }
      exit \$code"
else
  echo "skipped: read-only directory and full disk (unshare -m is not permitted here)"
fi

[[ $failures -eq 0 ]] && echo PASS || { echo "$failures failed"; exit 1; }
