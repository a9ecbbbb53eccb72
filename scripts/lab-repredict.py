#!/usr/bin/env python3
# Recomputes the planner predictions of a wiring-lab CSV (scripts/lab.sh) from its measured
# rows with the current `wiretrain plan`, using the same calibration as lab.sh (the unshaped
# run of each strategy gives the compute rate and the fixed per-step cost). Prints the CSV.
#
#   scripts/lab-repredict.py target/debug/wiretrain docs/bench/lab-2026-12-02.csv > new.csv
import csv, json, subprocess, sys
b, path = sys.argv[1], sys.argv[2]
BATCH = 32
rows = list(csv.DictReader(open(path)))
calib = {r["strategy"]: r for r in rows if r["rate_mbit"] == "none"}
for r in rows:
    st, rate = r["strategy"], r["rate_mbit"]
    c = calib[st]
    c_step, c_compute, c_optim = float(c["step_ms"]), float(c["compute_ms"]), float(c["optim_ms"])
    if rate == "none":
        pred = c_step
    else:
        params, nodes = float(r["params"]), int(r["nodes"])
        busy_s = (c_compute + c_optim) / 1e3
        tflops = 6 * params * BATCH / nodes / busy_s / 1e12
        out = subprocess.run([b, "plan", "--params", str(params), "--nodes", str(nodes), "--gpus-per-node", "1",
            "--seq", "1", "--micro-batch", str(BATCH // nodes), "--global-batch", str(BATCH), "--precision", "f32",
            "--wire", "f32", "--tflops", str(tflops), "--inter-gbps", str(float(rate) / 1000), "--inter-latency-us", "100",
            "--device-mem", "1000", "--json"], capture_output=True, text=True, check=True).stdout
        p = {json.loads(l)["strategy"]: json.loads(l) for l in out.splitlines()}[st]
        pred = p["step_s"] * 1e3 + (c_step - c_compute - c_optim)
    r["predicted_step_ms"] = repr(pred)
    r["predicted_over_measured"] = f"{pred / float(r['step_ms']):.3f}"
w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0].keys()), lineterminator="\n")
w.writeheader()
w.writerows(rows)
