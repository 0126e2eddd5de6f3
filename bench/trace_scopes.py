#!/usr/bin/env python3
"""Per-scope time of rank 0's steady state in `epx run --trace` files, side by side.

    python3 bench/trace_scopes.py PLAIN.json MERGED.json ...

For each trace: the iterations after the second optimizer step (as `epx run`'s steady state),
and per scope name (layer numbers dropped) the milliseconds per iteration on each track:
compute (including the waits nested in a scope), the token exchanges' stream and the gradient
reduction's. Used for issue 20's comparison of the compute that runs while an exchange is in
flight with the same compute in the plain schedule (bench/RESULTS.md).
"""
import collections
import json
import sys

TRACKS = {0: "compute", 1: "exchanges", 2: "grad reduction"}


def scopes(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    rank0 = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") == 0), key=lambda e: e["ts"])
    steps = [e for e in rank0 if e["name"] == "optimizer step"]
    if len(steps) < 3:
        sys.exit(f"{path}: fewer than 3 iterations in the trace")
    begin, end = steps[1]["ts"] + steps[1]["dur"], steps[-1]["ts"] + steps[-1]["dur"]
    n = len(steps) - 2
    total = collections.Counter()
    for e in rank0:
        if begin < e["ts"] < end:
            total[(TRACKS.get(e["tid"], str(e["tid"])), e["name"].rstrip(" 0123456789"))] += e["dur"] / 1000
    return {k: v / n for k, v in total.items()}, (end - begin) / n / 1000


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = [scopes(p) for p in sys.argv[1:]]
    keys = sorted(set().union(*(r[0] for r in runs)))
    print("| track | scope | " + " | ".join(f"ms/iter in {p}" for p in sys.argv[1:]) + " |")
    print("| --- | --- |" + " --- |" * len(runs))
    print("| | step | " + " | ".join(f"{r[1]:.1f}" for r in runs) + " |")
    for k in keys:
        print(f"| {k[0]} | {k[1]} | " + " | ".join(f"{r[0].get(k, 0):.1f}" for r in runs) + " |")


if __name__ == "__main__":
    main()
