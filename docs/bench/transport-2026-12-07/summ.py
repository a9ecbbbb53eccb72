"""Medians of the old/new runs in out-*.txt: busbw per (shape, op, size) and the training
summary's samples/s, and the overhead ratios."""
import json, re, statistics, sys, os
d = os.path.dirname(os.path.abspath(__file__))
rows = {}
for shape in ["1x4", "2x1", "2x2"]:
    v = None
    for line in open(f"{d}/out-{shape}.txt"):
        m = re.match(r"== round (\d+) (old|new)", line)
        if m:
            v = m.group(2); continue
        f = line.split()
        if len(f) >= 6 and f[1].isdigit() and not line.startswith("#"):
            rows.setdefault((shape, f[0], int(f[1])), {}).setdefault(v, []).append(float(f[4]))
print("| shape | op | size | old busbw GB/s | new busbw GB/s | new / old |")
print("|---|---|---|---|---|---|")
for (shape, op, size), r in rows.items():
    o, n = statistics.median(r["old"]), statistics.median(r["new"])
    print(f"| {shape} | {op} | {size >> 20} MiB | {o:.3f} | {n:.3f} | {n / o:.2f} |")
tr = {}
v = None
for line in open(f"{d}/out-train.txt"):
    m = re.match(r"== round (\d+) (old|new)", line)
    if m:
        v = m.group(2); continue
    if line.startswith("{"):
        s = json.loads(line)
        tr.setdefault(v, []).append((s["samples_per_s"], s["final_loss"]))
for v, r in tr.items():
    print(f"train 2x1 char-lm zero2 {v}: samples/s median {statistics.median(x[0] for x in r):.1f} "
          f"(runs {[round(x[0], 1) for x in r]}), final loss {[x[1] for x in r]}")
ov = {}
v = None
for line in open(f"{d}/out-overhead.txt"):
    m = re.match(r"== round (\d+) (old|new)", line)
    if m:
        v = m.group(2); continue
    f = line.split()
    if len(f) == 3 and re.match(r"^[0-9.]+$", f[2]):
        ov.setdefault(v, []).append(float(f[2]))
for v, r in ov.items():
    print(f"overhead char-lm world 1 ({v}): wiretrain / plain Burn {r}")
