#!/bin/bash
# Usage: run_and_expect_failure.sh EXIT_CODE PATTERN MAX_SECONDS -- COMMAND...
# Passes when COMMAND exits with EXIT_CODE within MAX_SECONDS and its output matches PATTERN.
set -u
want=$1 pattern=$2 max=$3
shift 4
start=$SECONDS
output=$(timeout $((max + 30)) "$@" 2>&1)
code=$?
took=$((SECONDS - start))
echo "$output" | tail -20
echo "exit code $code after ${took}s (want $want within ${max}s)"
[ "$code" -eq "$want" ] || { echo "FAIL: exit code $code, want $want"; exit 1; }
[ "$took" -le "$max" ] || { echo "FAIL: took ${took}s, limit ${max}s"; exit 1; }
echo "$output" | grep -qE -- "$pattern" || { echo "FAIL: output does not match: $pattern"; exit 1; }
echo PASS
