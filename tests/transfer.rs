//! Device-resident DDP through the real binary: the same per-step losses and final parameters
//! as the host path it replaces, and the bytes that cross between each rank's device and the
//! host, asserted exactly from the metrics every step reports: at world 1 only the loss
//! scalar leaves the device; at 2 x 1 on an f32 wire each gradient byte crosses once each way
//! (4P down, 4P up, plus the loss), with one blocking wait per bucket plus the loss's: the
//! mlp example's 6,922 parameters in 4 KiB buckets are 7 buckets, the last one partial
//! (`--overlap off`), or its 3 units with overlap.

mod common;

use std::time::Duration;

const STEPS: &str = "12";

/// Per-step lines and the summary of `train --example mlp` (under `launch --local nodes`
/// when `nodes` > 0), with `extra` flags; its final parameters.
fn run(
    name: &str,
    nodes: usize,
    device: &str,
    extra: &[&str],
) -> (Vec<serde_json::Value>, serde_json::Value, Vec<f32>) {
    let d = common::fresh_dir("transfer", name);
    let p = d.join("p.f32");
    let mut train = vec!["train"];
    train.extend(common::mlp("ddp", STEPS, "32", "3", device));
    train.extend(["--save-params", p.to_str().unwrap()]);
    train.extend_from_slice(extra);
    let n = nodes.to_string();
    let args = if nodes > 0 {
        common::local(&n, "1", &train)
    } else {
        train
    };
    let mut rows = common::train_metrics(name, &args, &[], Duration::from_secs(600));
    let summary = rows.pop().expect("a summary line");
    assert_eq!(
        summary["summary"], true,
        "{name}: the last line is the summary"
    );
    let params = common::read_f32(&p);
    let _ = std::fs::remove_dir_all(&d);
    (rows, summary, params)
}

/// Per-step lines (no summary) and final parameters of `train --example mlp` under
/// `launch --local 2` (one rank each) with `strategy` on `device`, `--overlap off` and `flags`;
/// the parameters are saved under `d` as `name`.
fn steps_2x1(
    d: &std::path::Path,
    name: &str,
    (strategy, device): (&str, &str),
    flags: &[&str],
) -> (Vec<serde_json::Value>, Vec<f32>) {
    let out = d.join(format!("{name}.f32"));
    let mut train = vec!["train"];
    train.extend(common::mlp(strategy, STEPS, "32", "3", device));
    train.extend(["--overlap", "off", "--save-params", out.to_str().unwrap()]);
    train.extend_from_slice(flags);
    let args = common::local("2", "1", &train);
    let mut rows = common::train_metrics(name, &args, &[], Duration::from_secs(600));
    rows.retain(|r| r.get("summary").is_none());
    (rows, common::read_f32(&out))
}

fn losses(rows: &[serde_json::Value]) -> Vec<f64> {
    rows.iter().map(|r| r["loss"].as_f64().unwrap()).collect()
}

fn field(r: &serde_json::Value, k: &str) -> u64 {
    r[k].as_u64()
        .unwrap_or_else(|| panic!("metrics line lacks {k}: {r}"))
}

/// Same losses and parameters within `tol` (relative, at least 1 in the denominator).
fn assert_same(what: &str, a: &(Vec<f64>, Vec<f32>), b: &(Vec<f64>, Vec<f32>), tol: f64) {
    assert_eq!(a.0.len(), b.0.len(), "{what}: steps");
    let loss = common::worst_rel(&a.0, &b.0, 1.0);
    let pa: Vec<f64> = a.1.iter().map(|&x| f64::from(x)).collect();
    let pb: Vec<f64> = b.1.iter().map(|&x| f64::from(x)).collect();
    assert_eq!(pa.len(), pb.len(), "{what}: parameter count");
    let params = common::worst_rel(&pa, &pb, 1.0);
    eprintln!("{what}: losses differ by {loss:e}, parameters by {params:e}");
    assert!(loss <= tol, "{what}: losses differ by {loss:e}");
    assert!(params <= tol, "{what}: parameters differ by {params:e}");
}

#[test]
fn device_resident_ddp_moves_each_gradient_byte_once_each_way_and_matches_the_host_path() {
    let (rows, summary, params) = run("resident-2x1", 2, "cpu", &["--overlap", "off"]);
    let p = summary["params_total"].as_u64().unwrap();
    assert_eq!(p, 6922);
    let buckets = p.div_ceil(1024);
    for r in &rows {
        assert_eq!(
            field(r, "d2h_bytes"),
            4 * p + 4,
            "gradients once, and the loss: {r}"
        );
        assert_eq!(
            field(r, "h2d_bytes"),
            4 * p,
            "the reduced gradient once: {r}"
        );
        assert_eq!(
            field(r, "device_waits"),
            buckets + 1,
            "a wait per bucket: {r}"
        );
    }
    assert_eq!(summary["median"]["d2h_bytes"], (4 * p + 4) as f64);
    let per_rank = summary["memory_per_rank"].as_array().unwrap();
    assert_eq!(per_rank.len(), 2);
    for r in per_rank {
        assert_eq!(field(r, "h2d_bytes_per_step"), 4 * p, "every rank: {r}");
    }
    // The host path it replaces: parameters go up and come back every step besides.
    let host = ["--host-path", "--overlap", "off"];
    let (host_rows, _, host_params) = run("host-2x1", 2, "cpu", &host);
    for r in &host_rows {
        assert_eq!(field(r, "d2h_bytes"), 8 * p + 4, "host path: {r}");
        assert_eq!(field(r, "h2d_bytes"), 12 * p, "host path: {r}");
    }
    assert_same(
        "resident vs host path, 2x1 cpu",
        &(losses(&rows), params),
        &(losses(&host_rows), host_params),
        1e-6,
    );
    // With overlap (2 nodes: on by default), the buckets are the 3 units: still once each way.
    let (rows, summary, _) = run("resident-2x1-overlap", 2, "cpu", &[]);
    assert_eq!(summary["overlap"], true);
    for r in &rows {
        assert_eq!(field(r, "d2h_bytes"), 4 * p + 4, "{r}");
        assert_eq!(field(r, "h2d_bytes"), 4 * p, "{r}");
        assert_eq!(field(r, "device_waits"), 3 + 1, "a wait per unit: {r}");
    }
}

/// On a 16-bit wire each gradient bucket is narrowed on the device before it is read: half
/// the bytes come down (2P). The host path reads f32 and lets the wire round, where the ring's
/// receiving rank adds its own contribution unrounded, so the two differ by a rounding; the
/// narrowed run must stay as close to the f32-wire run as the host path does (mean
/// parameter error within 1.5x of it: each rank's contribution is rounded, against one of the two
/// in the ring). DDP on f16 and ZeRO-2 on bf16, 2 x 1.
#[test]
fn on_a_16_bit_wire_gradients_come_down_narrowed_and_train_as_well() {
    let p = 6922u64;
    for (strategy, wire, owned) in [("ddp", "f16", p), ("zero2", "bf16", p / 2)] {
        let d = common::fresh_dir("transfer", &format!("narrow-{strategy}"));
        let run = |name: &str, wire: &str, extra: &[&str]| {
            let flags = [&["--wire-dtype", wire][..], extra].concat();
            steps_2x1(&d, name, (strategy, "cpu"), &flags)
        };
        let (rows, narrowed) = run(&format!("narrow-{strategy}"), wire, &[]);
        // DDP reads nothing else; ZeRO-2 reads its updated master (f32) too.
        let master = if strategy == "ddp" { 0 } else { 4 * owned };
        for r in &rows {
            assert_eq!(
                field(r, "d2h_bytes"),
                2 * p + master + 4,
                "{strategy} on {wire}: gradients 2 bytes an element: {r}"
            );
        }
        let (host_rows, by_wire) = run(&format!("narrow-{strategy}-host"), wire, &["--host-path"]);
        for r in &host_rows {
            assert!(
                field(r, "d2h_bytes") >= 4 * p + 4,
                "host path reads f32: {r}"
            );
        }
        let (_, exact) = run(&format!("narrow-{strategy}-f32"), "f32", &[]);
        let err = |v: &[f32]| {
            v.iter()
                .zip(&exact)
                .map(|(a, b)| f64::from((a - b).abs()))
                .sum::<f64>()
                / exact.len() as f64
        };
        let (e_narrow, e_wire) = (err(&narrowed), err(&by_wire));
        eprintln!(
            "{strategy} on {wire}: mean parameter error against the f32 wire {e_narrow:.3e} \
             narrowed on the device, {e_wire:.3e} rounded by the wire"
        );
        assert!(e_wire > 0.0, "{wire} rounds something");
        assert!(e_narrow <= 1.5 * e_wire, "{e_narrow} against {e_wire}");
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// DiLoCo over device-resident DDP, 2 nodes of one rank, 4 inner steps a round: an inner step
/// moves only the loss (its node holds one rank: the mean is its own gradient, on the
/// device); the step that ends a round reads the parameters once for the outer step and puts
/// the result back once. Same losses and parameters as the host path.
#[test]
fn diloco_inner_steps_stay_on_the_device_and_the_outer_step_moves_the_parameters_once() {
    let p = 6922u64;
    let d = common::fresh_dir("transfer", "diloco");
    let run = |name: &str, extra: &[&str]| {
        let flags = [&["--inner-steps", "4"][..], extra].concat();
        steps_2x1(&d, name, ("diloco", "cpu"), &flags)
    };
    let (rows, params) = run("diloco", &[]);
    assert_eq!(rows.len(), 12);
    for (i, r) in rows.iter().enumerate() {
        let outer = (i + 1) % 4 == 0;
        let (down, up, waits) = if outer {
            (4 * p + 4, 4 * p, 2)
        } else {
            (4, 0, 1)
        };
        let what = if outer {
            "the outer step"
        } else {
            "an inner step"
        };
        assert_eq!(field(r, "d2h_bytes"), down, "{what}, step {}: {r}", i + 1);
        assert_eq!(field(r, "h2d_bytes"), up, "{what}, step {}: {r}", i + 1);
        assert_eq!(
            field(r, "device_waits"),
            waits,
            "{what}, step {}: {r}",
            i + 1
        );
    }
    let (host_rows, host_params) = run("diloco-host", &["--host-path"]);
    assert_same(
        "diloco: resident vs host path",
        &(losses(&rows), params),
        &(losses(&host_rows), host_params),
        1e-6,
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// ZeRO-1 and ZeRO-2 on the CPU backend (Burn's AdamW): each gradient bucket down once, the
/// owned master and gradient up and the updated master down (P/2 each at 2 x 1), the gathered
/// parameters up once; a wait per bucket, the optimizer's read and the loss's. (The CPU
/// backend's device is host memory: the master is not kept there twice.) Hybrid at 2 x 1 owns
/// everything (one rank per node).
#[test]
fn sharded_strategies_move_what_their_shards_need_counted_exactly() {
    let p = 6922u64;
    let buckets = p.div_ceil(1024);
    for (strategy, owned) in [("zero1", p / 2), ("zero2", p / 2), ("hybrid", p)] {
        let mut train = vec!["train"];
        train.extend(common::mlp(strategy, STEPS, "32", "3", "cpu"));
        train.extend(["--overlap", "off"]);
        let args = common::local("2", "1", &train);
        let rows = common::train_metrics(strategy, &args, &[], Duration::from_secs(600));
        for r in rows.iter().filter(|r| r.get("summary").is_none()) {
            assert_eq!(
                field(r, "d2h_bytes"),
                4 * p + 4 * owned + 4,
                "{strategy}: {r}"
            );
            assert_eq!(field(r, "h2d_bytes"), 8 * owned + 4 * p, "{strategy}: {r}");
            assert_eq!(field(r, "device_waits"), buckets + 2, "{strategy}: {r}");
        }
    }
}

/// ZeRO-2 with Burn's AdamW on lavapipe (a device with memory of its own;
/// `--no-fused-optimizer`): the owned f32 master stays on the device between steps, so only
/// the first step uploads it; `--host-path` uploads it every step and gives the same losses
/// and parameters exactly.
#[test]
fn on_a_wgpu_device_the_sharded_master_stays_there_between_steps() {
    let p = 6922u64;
    let owned = p / 2;
    let d = common::fresh_dir("transfer", "master-lavapipe");
    let run = |name: &str, extra: &[&str]| {
        let flags = [&["--no-fused-optimizer"][..], extra].concat();
        steps_2x1(&d, name, ("zero2", "wgpu:cpu"), &flags)
    };
    let (rows, params) = run("master-lavapipe", &[]);
    assert_eq!(rows.len(), 12, "a line per step");
    for (i, r) in rows.iter().enumerate() {
        let master = if i == 0 { 4 * owned } else { 0 };
        assert_eq!(
            field(r, "h2d_bytes"),
            4 * owned + master + 4 * p,
            "step {}: the master goes up at the first step only: {r}",
            i + 1
        );
        assert_eq!(field(r, "d2h_bytes"), 4 * p + 4 * owned + 4, "{r}");
    }
    let (host_rows, host_params) = run("master-lavapipe-host", &["--host-path"]);
    for r in &host_rows {
        assert_eq!(field(r, "h2d_bytes"), 8 * owned + 4 * p, "host path: {r}");
    }
    assert_same(
        "zero2 on lavapipe: master on the device vs uploaded every step",
        &(losses(&rows), params),
        &(losses(&host_rows), host_params),
        0.0,
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// ZeRO-3 and HSDP at 2 x 1, the mlp cut into its 3 layers (U = 2112, 4160 and 650
/// elements): each unit's gathered parameters go up once per use (every unit in the forward
/// pass; every unit but the last again in the backward pass, the last still held from the
/// forward), each gradient comes down once, the owned gradient goes up to the optimizer and
/// the updated owned master comes down (O = P/2 under ZeRO-3; HSDP with one rank per node
/// owns all). The master goes up at every step on the CPU backend (its device is host
/// memory) and at the first only on lavapipe, with the fused AdamW or Burn's, unless
/// `--host-path`. A wait per unit's gradients, the optimizer's and the loss's. On lavapipe
/// the run equals `--host-path` exactly.
#[test]
fn zero3_and_hsdp_move_each_units_parameters_up_once_per_use_counted_exactly() {
    let units = [32 * 64 + 64, 64 * 64 + 64, 64 * 10 + 10u64];
    let p: u64 = units.iter().sum();
    assert_eq!(p, 6922);
    let gathered = 4 * (p + p - units[2]);
    let d = common::fresh_dir("transfer", "units");
    for (strategy, owned) in [("zero3", p / 2), ("hsdp", p)] {
        let mut runs = Vec::new();
        for (device, flags) in [
            ("cpu", &[][..]),
            ("wgpu:cpu", &[][..]),
            ("wgpu:cpu", &["--no-fused-optimizer"][..]),
            ("wgpu:cpu", &["--no-fused-optimizer", "--host-path"][..]),
        ] {
            let name = format!("{strategy}-{}-{}", device.replace(':', "-"), runs.len());
            let (rows, params) = steps_2x1(&d, &name, (strategy, device), flags);
            assert_eq!(rows.len(), 12, "{name}: a line per step");
            let every_step = device == "cpu" || flags.contains(&"--host-path");
            for (i, r) in rows.iter().enumerate() {
                let master = if every_step || i == 0 { 4 * owned } else { 0 };
                let up = gathered + 4 * owned + master;
                assert_eq!(field(r, "h2d_bytes"), up, "{name}, step {}: {r}", i + 1);
                let down = 4 * p + 4 * owned + 4;
                assert_eq!(field(r, "d2h_bytes"), down, "{name}, step {}: {r}", i + 1);
                assert_eq!(field(r, "device_waits"), 3 + 2, "{name}: {r}");
            }
            runs.push((losses(&rows), params));
        }
        assert_same(
            &format!("{strategy} on lavapipe: device-resident vs --host-path"),
            &runs[2],
            &runs[3],
            0.0,
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// World 1 on lavapipe (a real wgpu device): nothing but the loss scalar crosses, the
/// device reports its memory, and the run equals the host path (the fused WGSL AdamW there,
/// Burn's AdamW on the device here: the same math in another order, hence 1e-5 as the
/// lavapipe tests use).
#[test]
fn at_world_1_only_the_loss_leaves_a_wgpu_device() {
    let (rows, summary, params) = run("resident-w1-lavapipe", 0, "wgpu:cpu", &[]);
    for r in &rows {
        assert_eq!(field(r, "d2h_bytes"), 4, "only the loss: {r}");
        assert_eq!(field(r, "h2d_bytes"), 0, "nothing goes up: {r}");
        assert_eq!(field(r, "device_waits"), 1, "one wait, the loss's: {r}");
        let (now, peak) = (field(r, "device_mem_bytes"), field(r, "device_mem_peak"));
        assert!(now > 0 && peak >= now, "device memory reported: {r}");
    }
    let peak = summary["memory_per_rank"][0]["device_mem_peak"].as_u64();
    assert!(peak.is_some_and(|b| b > 0), "{summary}");
    let (host_rows, _, host_params) = run("host-w1-lavapipe", 0, "wgpu:cpu", &["--host-path"]);
    assert!(
        host_rows.iter().all(|r| field(r, "d2h_bytes") > 4 * 6922),
        "the host path reads the gradients"
    );
    assert_same(
        "resident vs host path, world 1 lavapipe",
        &(losses(&rows), params),
        &(losses(&host_rows), host_params),
        1e-5,
    );
}

#[test]
fn at_world_1_on_the_cpu_backend_only_the_loss_crosses_and_memory_is_not_claimed() {
    let (rows, summary, params) = run("resident-w1-cpu", 0, "cpu", &[]);
    for r in &rows {
        assert_eq!(
            (field(r, "d2h_bytes"), field(r, "h2d_bytes")),
            (4, 0),
            "{r}"
        );
        assert!(
            r["device_mem_bytes"].is_null(),
            "the CPU backend reports none: {r}"
        );
    }
    assert!(summary["median"]["device_mem_peak"].is_null());
    let (host_rows, _, host_params) = run("host-w1-cpu", 0, "cpu", &["--host-path"]);
    assert_same(
        "resident vs host path, world 1 cpu",
        &(losses(&rows), params),
        &(losses(&host_rows), host_params),
        1e-6,
    );
}

/// The device's own account: ZeRO-3 at 2 x 1 peaks lower on a wgpu device (lavapipe) than
/// DDP on the same model, read from the device's allocator (`device_mem_peak`), not computed.
#[test]
fn zero3_peaks_below_ddp_in_device_memory_on_lavapipe() {
    let peak = |strategy: &str| {
        let args = common::local_train(
            "2",
            "1",
            &[
                "--example",
                "char-lm",
                "--d-model",
                "128",
                "--layers",
                "4",
                "--strategy",
                strategy,
                "--steps",
                "3",
                "--global-batch",
                "8",
                "--device",
                "wgpu:cpu",
            ],
        );
        let rows = common::train_metrics(strategy, &args, &[], Duration::from_secs(600));
        let summary = rows.last().unwrap();
        let ranks = summary["memory_per_rank"].as_array().unwrap();
        let peaks: Vec<u64> = ranks
            .iter()
            .map(|r| {
                r["device_mem_peak"]
                    .as_u64()
                    .expect("lavapipe reports memory")
            })
            .collect();
        eprintln!(
            "{strategy}: device peaks {peaks:?}, {} parameters",
            summary["params_total"]
        );
        peaks.into_iter().max().unwrap()
    };
    let (ddp, zero3) = (peak("ddp"), peak("zero3"));
    assert!(zero3 < ddp, "zero3 peaks at {zero3} bytes, ddp at {ddp}");
}
