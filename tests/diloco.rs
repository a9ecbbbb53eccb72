//! DiLoCo (`--strategy diloco`) through the real binary:
//! - inner steps stay inside the node: on one node the run equals DDP (the outer step of a
//!   single node with outer lr 1 and no momentum gives back the inner parameters);
//! - across nodes, bytes flow only at outer steps (every --inner-steps steps), and the run
//!   learns;
//! - bad settings are refused. The 20 Mbit/s lab comparison with DDP is a benchmark
//!   (scripts/bench-diloco.sh, docs/WIRING.md).

mod common;

use std::time::Duration;

fn run(args: &[&str], name: &str) -> Vec<serde_json::Value> {
    let mut all = args.to_vec();
    all.extend(["--no-progress", "--device", "cpu"]);
    common::train_metrics(
        &format!("diloco-{name}"),
        &all,
        &[],
        Duration::from_secs(600),
    )
}

fn steps(v: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    v.iter().filter(|l| l.get("summary").is_none()).collect()
}

#[test]
fn one_node_diloco_is_ddp() {
    let base = [
        "launch",
        "--local",
        "1",
        "--ranks-per-node",
        "2",
        "--",
        "train",
        "--example",
        "mlp",
        "--steps",
        "12",
        "--global-batch",
        "32",
    ];
    let mut d = base.to_vec();
    d.extend(["--strategy", "ddp"]);
    let ddp = run(&d, "ddp");
    let mut l = base.to_vec();
    l.extend([
        "--strategy",
        "diloco",
        "--inner-steps",
        "3",
        "--outer-lr",
        "1",
        "--outer-momentum",
        "0",
    ]);
    let dl = run(&l, "diloco1");
    assert_eq!(dl.last().unwrap()["strategy"], "diloco");
    for (a, b) in steps(&ddp).iter().zip(steps(&dl)) {
        let (x, y) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(
            ((x - y) / x).abs() <= 1e-5,
            "step {}: {x} vs {y}",
            a["step"]
        );
    }
}

#[test]
fn across_nodes_bytes_flow_only_at_outer_steps() {
    let v = run(
        &[
            "launch",
            "--local",
            "2",
            "--ranks-per-node",
            "2",
            "--",
            "train",
            "--example",
            "char-lm",
            "--steps",
            "24",
            "--strategy",
            "diloco",
            "--inner-steps",
            "4",
            "--wire-dtype",
            "bf16",
        ],
        "2x2",
    );
    let s = steps(&v);
    assert_eq!(s.len(), 24);
    let params = v.last().unwrap()["params_total"].as_u64().unwrap() as f64;
    for (i, st) in s.iter().enumerate() {
        let sent = st["sent_bytes"].as_f64().unwrap();
        if (i + 1) % 4 == 0 {
            // Outer step: the parameter deltas in bf16; a ring all-reduce over 2 nodes sends
            // the whole buffer once per node, split over its 2 lanes (ranks): Ψ/2 x 2 bytes.
            assert!(
                sent > 0.4 * params,
                "step {i}: {sent} bytes at an outer step"
            );
        } else {
            // Inner step: only the 8-byte loss all-reduce crosses nodes.
            assert!(
                sent < 1000.0,
                "step {i}: {sent} bytes crossed nodes in an inner step"
            );
        }
    }
    let (first, last) = (
        s[0]["loss"].as_f64().unwrap(),
        s[23]["loss"].as_f64().unwrap(),
    );
    assert!(last < 0.9 * first, "diloco learns: {first} -> {last}");
}

#[test]
fn bad_diloco_settings_are_refused() {
    for (args, needle) in [
        (
            vec!["train", "--strategy", "ddp", "--inner-steps", "5"],
            "--inner-steps",
        ),
        (
            vec!["train", "--strategy", "diloco", "--inner-steps", "0"],
            "--inner-steps",
        ),
        (
            vec!["train", "--strategy", "diloco", "--outer-momentum", "1.5"],
            "--outer-momentum",
        ),
        (
            vec![
                "train",
                "--strategy",
                "diloco",
                "--checkpoint-dir",
                "/tmp/x",
            ],
            "diloco",
        ),
    ] {
        let out = common::run(&args, &[], Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            common::text(&out)
        );
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
