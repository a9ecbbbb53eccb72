//! The trainer through the real binary: DDP, ZeRO-1, ZeRO-2, ZeRO-3, hybrid and HSDP at world
//! sizes 2 (2 nodes x 1 rank) and 4 (2 x 2, and 4 x 1 for the sharded ones, over QUIC)
//! match single-process training within 1e-5, on Burn's CPU backend for every combination and
//! on lavapipe (wgpu, Vulkan pinned) for ZeRO-2 at 2 x 2 and ZeRO-3 at 2 x 1 (lavapipe's first
//! step compiles its kernels for ~40 s per process on 2 cores, so CI runs two lavapipe runs).
//! A job mixing device kinds (a lavapipe rank and a CPU-backend rank per node) matches too.
//! Memory accounting follows the ZeRO formulas; bad input exits 2.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

const STEPS: &str = "20";
const BATCH: &str = "32";

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("train", name)
}

fn train_args<'a>(
    strategy: &'a str,
    device: &'a str,
    metrics: &'a str,
    params: &'a str,
) -> Vec<&'a str> {
    let mut v = vec!["train"];
    v.extend(common::mlp(strategy, STEPS, BATCH, "3", device));
    v.extend(["--metrics", metrics, "--save-params", params]);
    v
}

fn read_metrics(p: &Path) -> (Vec<f64>, serde_json::Value) {
    let text = std::fs::read_to_string(p).unwrap();
    let mut losses = vec![];
    let mut summary = serde_json::Value::Null;
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        if v.get("summary").is_some() {
            summary = v;
        } else {
            for f in ["step", "loss", "samples_per_s", "step_ms", "comm_ms"] {
                assert!(v.get(f).is_some(), "metrics line lacks {f}: {l}");
            }
            losses.push(v["loss"].as_f64().unwrap());
        }
    }
    (losses, summary)
}

fn reference(device: &str) -> (Vec<f32>, Vec<f64>) {
    let d = dir(&format!("reference-{}", device.replace(':', "-")));
    let (m, p) = (d.join("m.jsonl"), d.join("p.f32"));
    let out = common::run(
        &train_args("ddp", device, m.to_str().unwrap(), p.to_str().unwrap()),
        &[],
        Duration::from_secs(600),
    );
    assert!(out.status.success(), "{}", common::text(&out));
    (common::read_f32(&p), read_metrics(&m).0)
}

fn distributed(
    strategy: &str,
    device: &str,
    nodes: usize,
    ranks: usize,
    accumulate: usize,
) -> (Vec<f32>, Vec<f64>, serde_json::Value) {
    distributed_with(strategy, device, nodes, ranks, accumulate, &[])
}

fn distributed_with(
    strategy: &str,
    device: &str,
    nodes: usize,
    ranks: usize,
    accumulate: usize,
    extra: &[&str],
) -> (Vec<f32>, Vec<f64>, serde_json::Value) {
    let d = dir(&format!(
        "{strategy}-{}-{nodes}x{ranks}-acc{accumulate}-{}",
        device.replace(':', "-"),
        extra.join("").replace(',', "-")
    ));
    let acc = accumulate.to_string();
    let (m, p) = (d.join("m.jsonl"), d.join("p.f32"));
    let n = nodes.to_string();
    let k = ranks.to_string();
    let mut args = common::local(
        &n,
        &k,
        &train_args(strategy, device, m.to_str().unwrap(), p.to_str().unwrap()),
    );
    args.extend(["--accumulate", &acc]);
    args.extend_from_slice(extra);
    let out = common::run(&args, &[], Duration::from_secs(900));
    assert!(out.status.success(), "{}", common::text(&out));
    let (losses, summary) = read_metrics(&m);
    (common::read_f32(&p), losses, summary)
}

/// Within 1e-5 relative: the difference vector relative to the reference vector (L2), and
/// every element within 1e-5 x max(|reference|, 1), i.e. rtol = atol = 1e-5 (lavapipe's
/// autotuner may pick different kernels, hence summation orders, from run to run; elements
/// near zero would otherwise turn rounding noise into large ratios).
fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let mut worst = 0.0f64;
    let (mut diff2, mut ref2) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        worst = worst.max((x - y).abs() / y.abs().max(1.0));
        diff2 += (x - y) * (x - y);
        ref2 += y * y;
    }
    let norm_rel = (diff2 / ref2).sqrt();
    eprintln!("{what}: worst element {worst:e}, norm-relative {norm_rel:e}");
    assert!(worst <= 1e-5, "{what}: worst relative difference {worst:e}");
    assert!(
        norm_rel <= 1e-5,
        "{what}: norm-relative difference {norm_rel:e}"
    );
}

/// Runs of (strategy, nodes, ranks per node, micro-batches accumulated per step).
fn compare(device: &str, runs: &[(&str, usize, usize, usize)]) -> Vec<serde_json::Value> {
    compare_with(device, device, runs)
}

/// As [`compare`], with the reference on `ref_device` and the runs on `device`.
fn compare_with(
    ref_device: &str,
    device: &str,
    runs: &[(&str, usize, usize, usize)],
) -> Vec<serde_json::Value> {
    let mut summaries = vec![];
    let (ref_params, ref_losses) = reference(ref_device);
    assert_eq!(ref_losses.len(), 20);
    assert!(
        ref_losses[19] < ref_losses[0],
        "the reference run learns: {ref_losses:?}"
    );
    for &(strategy, nodes, ranks, acc) in runs {
        let what = format!("{strategy} {nodes}x{ranks} accumulate {acc} on {device}");
        let (params, losses, summary) = distributed(strategy, device, nodes, ranks, acc);
        assert_close(&format!("{what} parameters"), &params, &ref_params);
        assert_eq!(losses.len(), ref_losses.len(), "{what}");
        for (s, (l, r)) in losses.iter().zip(&ref_losses).enumerate() {
            assert!(
                ((l - r) / r).abs() <= 1e-5,
                "{what} step {s}: loss {l} vs {r}"
            );
        }
        check_memory(&what, strategy, ranks, &summary);
        summaries.push(summary);
    }
    summaries
}

#[test]
fn strategies_match_single_process_training_cpu_backend() {
    let mut runs = vec![];
    for strategy in ["ddp", "zero1", "zero2", "zero3", "hybrid", "hsdp"] {
        for (nodes, ranks) in [(2, 1), (2, 2)] {
            runs.push((strategy, nodes, ranks, 1));
        }
    }
    // World size 4 as 4 node processes, for the sharded strategies.
    runs.push(("zero3", 4, 1, 1));
    runs.push(("hybrid", 4, 1, 1));
    runs.push(("hsdp", 4, 1, 1));
    let summaries = compare("cpu", &runs);
    // Bytes each rank sends to the other node per step (2 nodes x 1 rank, medians): ZeRO-1,
    // ZeRO-2 and hybrid send what DDP sends (reduce-scatter + all-gather = all-reduce);
    // ZeRO-3 also all-gathers the parameters in backward: (1 + (1 - last unit/Ψ) + 1) / 2 of
    // DDP, 1.45x for the mlp, whose last unit holds 650 of 6922 parameters.
    let sent = |strategy: &str| {
        let s = summaries
            .iter()
            .find(|s| s["strategy"] == strategy && s["world"] == 2)
            .unwrap();
        s["median"]["sent_bytes"].as_f64().unwrap()
    };
    let ddp = sent("ddp");
    assert!(
        ddp >= 4.0 * 6922.0,
        "ddp sends at least the gradient: {ddp}"
    );
    for (strategy, lo, hi) in [
        ("zero1", 0.95, 1.1),
        ("zero2", 0.95, 1.1),
        ("hybrid", 0.95, 1.1),
        ("zero3", 1.35, 1.55),
        // One rank per node: HSDP gathers nothing across nodes, only gradients travel.
        ("hsdp", 0.95, 1.1),
    ] {
        let ratio = sent(strategy) / ddp;
        eprintln!("{strategy}: {ratio:.3} x ddp's bytes per step");
        assert!((lo..=hi).contains(&ratio), "{strategy}: {ratio} x ddp");
    }
}

/// `--accumulate K` (K micro-batches per step, one communication) equals one step on the
/// whole global batch: 32 samples as 2 ranks x 4 micro-batches of 4, and 4 ranks x 2 of 4.
#[test]
fn gradient_accumulation_matches_single_process_training() {
    compare("cpu", &[("ddp", 2, 1, 4), ("zero2", 2, 2, 2)]);
}

#[test]
fn zero2_and_zero3_match_single_process_training_on_lavapipe() {
    compare("wgpu:cpu", &[("zero2", 2, 2, 1), ("zero3", 2, 1, 1)]);
}

/// Mixed device kinds in one job: on every node, local rank 0 trains on lavapipe (wgpu, with
/// the fused WGSL AdamW) and local rank 1 on Burn's CPU backend; the result matches
/// single-process training on the CPU backend within 1e-5.
#[test]
fn mixed_device_kinds_match_single_process_training() {
    compare_with(
        "cpu",
        "wgpu:cpu,cpu",
        &[("zero2", 2, 2, 1), ("ddp", 1, 2, 1)],
    );
}

/// Deliberately unequal shares of the global batch (13, 3, 9, 7 of 32), gradients weighted by
/// share: every strategy still equals single-process training on the whole batch (1e-5).
#[test]
fn uneven_shares_match_single_process_training() {
    let (ref_params, ref_losses) = reference("cpu");
    for (strategy, nodes, ranks, shares) in [
        ("ddp", 2, 1, "27,5"),
        ("zero1", 2, 2, "13,3,9,7"),
        ("zero2", 2, 2, "13,3,9,7"),
        ("zero3", 2, 1, "1,31"),
        ("hybrid", 2, 2, "13,3,9,7"),
    ] {
        let what = format!("{strategy} {nodes}x{ranks} shares {shares}");
        let (params, losses, summary) =
            distributed_with(strategy, "cpu", nodes, ranks, 1, &["--shares", shares]);
        assert_close(&format!("{what} parameters"), &params, &ref_params);
        for (s, (l, r)) in losses.iter().zip(&ref_losses).enumerate() {
            assert!(
                ((l - r) / r).abs() <= 1e-5,
                "{what} step {s}: loss {l} vs {r}"
            );
        }
        assert_eq!(summary["balance"], "fixed");
        let got: Vec<u64> = summary["shares"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let want: Vec<u64> = shares.split(',').map(|x| x.parse().unwrap()).collect();
        assert_eq!(got, want, "{what}");
    }
}

/// ZeRO-1 optimizer state = total/N per rank (AdamW: m and v, 8 bytes per element, within one
/// element per bucket); ZeRO-2 gradients <= total/N + one bucket; DDP holds everything.
fn check_memory(what: &str, strategy: &str, ranks_per_node: usize, s: &serde_json::Value) {
    let total = s["params_total"].as_u64().unwrap() as f64;
    let world = s["world"].as_u64().unwrap() as f64;
    let buckets = (total * 4.0 / 4096.0).ceil();
    let ranks = s["memory_per_rank"].as_array().unwrap();
    assert_eq!(ranks.len() as f64, world, "{what}");
    // The ZeRO paper's model-state bytes per rank (f32 + Adam, 16 bytes per parameter), plus
    // what a strategy holds on top: a full gradient bucket (ZeRO-2, hybrid), or (1 + prefetch)
    // units of parameters and one unit of gradient (ZeRO-3). Within 10 %.
    let (n, k) = (world, ranks_per_node as f64);
    let unit = 4.0 * s["largest_bucket_elems"].as_f64().unwrap();
    let prefetch = s["prefetch"].as_f64().unwrap();
    let expected = match strategy {
        "ddp" => 16.0 * total,
        "zero1" => 8.0 * total + 8.0 * total / n,
        "zero2" if s["overlap"] == true => 4.0 * total + 12.0 * total / n + 2.0 * unit,
        "zero2" => 4.0 * total + 12.0 * total / n + unit,
        "zero3" => 16.0 * total / n + (2.0 + prefetch) * unit,
        "hybrid" if s["overlap"] == true => 4.0 * total + 12.0 * total / k + 2.0 * unit,
        "hybrid" => 4.0 * total + 12.0 * total / k + unit,
        "hsdp" => 16.0 * total / k + (2.0 + prefetch) * unit,
        other => panic!("no formula for {other}"),
    };
    for r in ranks {
        let state = r["model_state_bytes"].as_f64().unwrap();
        assert!(
            (state - expected).abs() <= 0.1 * expected,
            "{what}: model states {state} bytes, ZeRO formula {expected}"
        );
    }
    for r in ranks {
        let optim = r["optim_bytes"].as_f64().unwrap();
        let grads = r["grads_bytes"].as_f64().unwrap();
        match strategy {
            "ddp" => assert_eq!(optim, 8.0 * total, "{what}"),
            // Sharded among the node's ranks only, replicated across nodes.
            "hybrid" | "hsdp" => assert!(
                (optim - 8.0 * total / ranks_per_node as f64).abs() <= 8.0 * buckets,
                "{what}: optim {optim}"
            ),
            _ => assert!(
                (optim - 8.0 * total / world).abs() <= 8.0 * buckets,
                "{what}: optim {optim}"
            ),
        }
        if strategy == "zero2" || strategy == "hybrid" {
            let n = if strategy == "zero2" {
                world
            } else {
                ranks_per_node as f64
            };
            // Overlapped (two nodes: `--overlap auto`), the buckets are the units and two of
            // them are held at once (one flattened, one in flight); a shard rounds up by an
            // element per unit.
            let held = if s["overlap"] == true {
                2.0 * unit + 4.0 * 8.0
            } else {
                4.0 * buckets + 4096.0
            };
            assert!(
                grads <= 4.0 * total / n + held,
                "{what}: grads {grads}, total {total}, n {n}, unit {unit}"
            );
        }
        if strategy == "zero3" || strategy == "hsdp" {
            let world = if strategy == "zero3" { world } else { k };
            // The mlp's units are its layers; the largest (64x64 + 64) bounds one unit.
            let unit = 4160.0;
            let params = r["params_bytes"].as_f64().unwrap();
            assert!(
                params <= 4.0 * (total / world + 8.0 + 2.0 * unit),
                "{what}: params {params}"
            );
            assert!(
                grads <= 4.0 * (total / world + 8.0 + unit),
                "{what}: grads {grads}"
            );
        }
    }
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    let d = dir("bad");
    let cfg = d.join("run.toml");
    std::fs::write(&cfg, "strategy = \"zero2\"\nsteps = 1\nnot_a_field = 3\n").unwrap();
    let cfg_s = cfg.to_str().unwrap();
    for (args, needle) in [
        (common::words("train --strategy zero9"), "--strategy"),
        (common::words("train --example resnet"), "--example"),
        (
            common::words("train --global-batch 30 --ranks-per-node 4"),
            "--global-batch",
        ),
        (vec!["train", "--config", cfg_s], "not_a_field"),
        (
            common::words("train --config /nonexistent/run.toml"),
            "--config",
        ),
        (common::words("train --device tpu"), "--device"),
        // Built without the `cuda` feature (as CI builds): how to get it, and the Vulkan way.
        #[cfg(not(feature = "cuda"))]
        (
            common::words("train --device cuda:0 --steps 1"),
            "--features cuda",
        ),
        (common::words("train --accumulate 0"), "--accumulate"),
        (
            common::words("train --accumulate 2 --strategy zero3"),
            "--accumulate: zero3",
        ),
        (
            common::words("train --accumulate 2 --strategy hsdp"),
            "--accumulate: hsdp",
        ),
        (common::words("train --shares 3,x"), "--shares"),
        (common::words("train --balance fastest"), "--balance"),
        (
            common::words("train --global-batch 32 --shares 30,3"),
            "--shares",
        ),
        (
            common::words("train --global-batch 8 --ranks-per-node 2 --accumulate 3"),
            "--global-batch",
        ),
    ] {
        let err = common::refused(&args);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
}
