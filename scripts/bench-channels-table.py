#!/usr/bin/env python3
"""Median busbw per row of scripts/bench-channels.sh output, as a markdown table: each
wiretrain row against the old binary of the same shape, against Gloo with as many processes
as the shape has ranks (2x1: 2, 2x2: 4; loopback only), and all-reduce against the row's own
p2p. Usage: bench-channels-table.py OUT.txt [OUT2.txt ...]"""
import re
import statistics
import sys
from collections import defaultdict

GLOO_OP = {"allreduce": "all-reduce", "allgather": "all-gather", "reducescatter": "reduce-scatter"}
OPS = ["p2p", "all-reduce", "reduce-scatter", "all-gather"]

rows = defaultdict(list)  # (label, op) -> [busbw]
sized = defaultdict(list)  # (label, op) -> [(size, busbw)]
label = None
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith("## "):
            label = line[3:].strip()
            continue
        f = line.split()
        if label is None or len(f) < 5:
            continue
        op = GLOO_OP.get(f[0], f[0])
        if op in OPS:
            try:
                sized[(label, op)].append((int(f[1]), float(f[4])))
            except ValueError:
                pass

# Gloo's script runs 1, 16 and 64 MiB: its rows of the largest size are the comparison.
for key, v in sized.items():
    top = max(size for size, _ in v)
    rows[key] = [b for size, b in v if size == top]

labels = []
for lab, _ in rows:
    if lab not in labels:
        labels.append(lab)


def med(lab, op):
    v = rows.get((lab, op))
    return statistics.median(v) if v else None


def fmt(x, nd=3):
    return "—" if x is None else f"{x:.{nd}f}"


def ratio(a, b):
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}"


print("| row | op | median busbw GB/s | runs | range | / old | / Gloo | all-reduce / p2p |")
print("|---|---|---|---|---|---|---|---|")
for lab in labels:
    if lab.startswith("gloo"):
        continue
    shape = lab.split()[0]
    old = f"{shape} old"
    gloo = {"2x1": "gloo 2", "2x2": "gloo 4"}.get(shape)
    for op in OPS:
        m = med(lab, op)
        if m is None:
            continue
        v = rows[(lab, op)]
        p2p = med(lab, "p2p") if op == "all-reduce" else None
        print(
            f"| {lab} | {op} | {fmt(m)} | {len(v)} | {min(v):.3f}–{max(v):.3f} "
            f"| {ratio(m, med(old, op)) if lab != old else '1'} "
            f"| {ratio(m, med(gloo, op)) if gloo else '—'} | {ratio(m, p2p) if p2p else ''} |"
        )
for lab in labels:
    if lab.startswith("gloo"):
        for op in OPS[1:]:
            v = rows.get((lab, op))
            if v:
                print(f"| {lab} | {op} | {fmt(statistics.median(v))} | {len(v)} | {min(v):.3f}–{max(v):.3f} | | | |")
