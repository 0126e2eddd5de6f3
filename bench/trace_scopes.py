#!/usr/bin/env python3
"""Per-scope time of rank 0's steady state in `epx run --trace` files, side by side.

    python3 bench/trace_scopes.py PLAIN.json MERGED.json ...

For each trace: the iterations after the second optimizer step (as `epx run`'s steady state),
and per scope name (layer numbers dropped) the milliseconds per iteration on each track:
compute (including the waits nested in a scope), the token exchanges' stream and the gradient
reduction's. Used for issue 20's comparison of the compute that runs while an exchange is in
flight with the same compute in the plain schedule (bench/RESULTS.md).

A second table: per top-level compute scope, the milliseconds per iteration it runs while no
token exchange is in flight (the link idle under compute), and the time the exchanges' stream is
busy at all. Under EP overlap on a saturated link, these are what the step has left to hide.
A third: the compute thread's waits (on an exchange, and the counts all-gather) by the scope
they sit in, i.e. by the slot of the merged layer pair whose exchange was late.
"""
import collections
import json
import sys

TRACKS = {0: "compute", 1: "exchanges", 2: "grad reduction"}


def steady_state(path):
    """Rank 0's events of the iterations after the second optimizer step, and their count."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    rank0 = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") == 0), key=lambda e: (e["ts"], -e["dur"]))
    steps = [e for e in rank0 if e["name"] == "optimizer step" and e["tid"] == 0]
    if len(steps) < 3:
        sys.exit(f"{path}: fewer than 3 iterations in the trace")
    begin, end = steps[1]["ts"] + steps[1]["dur"], steps[-1]["ts"] + steps[-1]["dur"]
    return [e for e in rank0 if begin < e["ts"] < end], len(steps) - 2, end - begin


def name(e):
    return e["name"].rstrip(" 0123456789")


def scopes(path):
    events, n, span = steady_state(path)
    total = collections.Counter()
    for e in events:
        total[(TRACKS.get(e["tid"], str(e["tid"])), name(e))] += e["dur"] / 1000
    return {k: v / n for k, v in total.items()}, span / n / 1000


def link_idle(path):
    """Per top-level compute scope, ms/iter with no token exchange in flight; and the exchanges'
    busy ms/iter (their union)."""
    events, n, _ = steady_state(path)
    busy = []
    for e in sorted((e for e in events if e["tid"] == 1), key=lambda e: e["ts"]):
        if busy and e["ts"] <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e["ts"] + e["dur"])
        else:
            busy.append([e["ts"], e["ts"] + e["dur"]])
    alone, covered_to = collections.Counter(), -1
    for e in (e for e in events if e["tid"] == 0):
        if e["ts"] < covered_to:
            continue  # nested in the scope before
        covered_to = e["ts"] + e["dur"]
        overlap = sum(max(0, min(covered_to, t) - max(e["ts"], s)) for s, t in busy)
        alone[name(e)] += (e["dur"] - overlap) / 1000 / n
    return alone, sum(t - s for s, t in busy) / 1000 / n


def waits(path):
    """ms/iter of waits by their enclosing top-level compute scope."""
    events, n, _ = steady_state(path)
    out, top, top_end = collections.Counter(), None, -1
    for e in (e for e in events if e["tid"] == 0):
        if e["ts"] >= top_end:
            top, top_end = name(e), e["ts"] + e["dur"]
        elif name(e) in ("wait for communication", "dispatch counts"):
            out[f"{name(e)} in {top}"] += e["dur"] / 1000 / n
    return out


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
    idle = [link_idle(p) for p in sys.argv[1:]]
    print()
    print("| compute scope, no token exchange in flight | " + " | ".join(f"ms/iter in {p}" for p in sys.argv[1:]) + " |")
    print("| --- |" + " --- |" * len(runs))
    print("| (the exchanges' stream busy) | " + " | ".join(f"{b:.1f}" for _, b in idle) + " |")
    for k in sorted(set().union(*(a for a, _ in idle)), key=lambda k: -max(a.get(k, 0) for a, _ in idle)):
        print(f"| {k} | " + " | ".join(f"{a.get(k, 0):.1f}" for a, _ in idle) + " |")
    late = [waits(p) for p in sys.argv[1:]]
    print()
    print("| compute thread's wait | " + " | ".join(f"ms/iter in {p}" for p in sys.argv[1:]) + " |")
    print("| --- |" + " --- |" * len(runs))
    for k in sorted(set().union(*late), key=lambda k: -max(w.get(k, 0) for w in late)):
        print(f"| {k} | " + " | ".join(f"{w.get(k, 0):.1f}" for w in late) + " |")


if __name__ == "__main__":
    main()
