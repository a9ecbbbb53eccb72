//! DiLoCo (`--strategy diloco`) through the real binary:
//! - inner steps stay inside the node: on one node the run equals DDP (the outer step of a
//!   single node with outer lr 1 and no momentum gives back the inner parameters);
//! - across nodes, bytes flow only at outer steps (every --inner-steps steps), and the run
//!   learns;
//! - a checkpoint in the middle of a round resumes bit for bit (each node its own inner
//!   state, plus the outer state); on more nodes it resumes too, and on fewer each node
//!   keeps its own inner state (checked exactly); DDP resumes node 0's model from it;
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
    let base = common::local_train(
        "1",
        "2",
        &["--example", "mlp", "--steps", "12", "--global-batch", "32"],
    );
    let mut d = base.clone();
    d.extend(["--strategy", "ddp"]);
    let ddp = run(&d, "ddp");
    let mut l = base;
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
    // Both ran every step (a zip over a short run would compare nothing).
    assert_eq!(steps(&ddp).len(), 12, "ddp steps");
    assert_eq!(steps(&dl).len(), 12, "diloco steps");
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
        &common::local_train(
            "2",
            "2",
            &[
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
        ),
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
    common::refused_each(&[
        (
            &["train", "--strategy", "ddp", "--inner-steps", "5"],
            "--inner-steps",
        ),
        (
            &["train", "--strategy", "diloco", "--inner-steps", "0"],
            "--inner-steps",
        ),
        (
            &["train", "--strategy", "diloco", "--outer-momentum", "1.5"],
            "--outer-momentum",
        ),
        (
            &["train", "--strategy", "diloco", "--inner-strategy", "zero3"],
            "--inner-strategy",
        ),
        (&["train", "--inner-strategy", "hybrid"], "--inner-strategy"),
    ]);
}

/// `launch --local nodes --ranks-per-node 2 -- train` of the mlp example under DiLoCo
/// (H = 3) for `steps`; `strategy` is ddp, or diloco with its inner strategy after a colon.
fn diloco_args<'a>(
    nodes: &'a str,
    strategy: &'a str,
    steps: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let (strategy, inner) = strategy.split_once(':').unwrap_or((strategy, "ddp"));
    let mut a = common::local_train(
        nodes,
        "2",
        &["--example", "mlp", "--steps", steps, "--global-batch", "48"],
    );
    a.extend([
        "--lr",
        "0.01",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--no-progress",
    ]);
    a.extend(["--strategy", strategy]);
    if strategy == "diloco" {
        a.extend(["--inner-steps", "3", "--outer-momentum", "0.5"]);
        a.extend(["--inner-strategy", inner]);
    }
    a.extend_from_slice(extra);
    a
}

fn run_args(a: &[&str]) -> std::process::Output {
    common::run(a, &[], Duration::from_secs(300))
}

/// Runs `a` (which must succeed) with metrics; returns (step, loss) of every step.
fn step_losses(name: &str, a: &[&str]) -> Vec<(u64, f64)> {
    let name = name.replace(':', "-");
    let v = common::train_metrics(&name, a, &[], Duration::from_secs(300));
    steps(&v)
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn checkpoints_resume_each_nodes_inner_state_and_the_outer_state() {
    resume_case("diloco:ddp");
}

#[test]
fn sharded_inside_the_node_checkpoints_resume_too() {
    resume_case("diloco:hybrid");
}

fn resume_case(strategy: &str) {
    let d = common::fresh_dir("diloco-ck", &strategy.replace(':', "-"));
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let (ck, base, b) = (p("ck"), p("base.f32"), p("b.f32"));

    // 10 steps straight through: outer steps after steps 3, 6 and 9.
    let lb = step_losses(
        &format!("resume-base-{strategy}"),
        &diloco_args("2", strategy, "10", &["--save-params", &base]),
    );

    // 8 steps with checkpoints at 4 and 8 (8 is one inner step into the third round), then
    // resume to 10.
    let a = run_args(&diloco_args(
        "2",
        strategy,
        "8",
        &["--checkpoint-every", "4", "--checkpoint-dir", &ck],
    ));
    assert!(a.status.success(), "{}", common::text(&a));
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.join("ck/step-00000008/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["diloco"]["inner_done"], 8);
    assert_eq!(manifest["diloco"]["nodes"].as_array().unwrap().len(), 1);
    // Node 1's inner state: one file under DDP inside the node, one per rank when sharded.
    let files = if strategy.ends_with("hybrid") { 2 } else { 1 };
    assert_eq!(
        manifest["diloco"]["nodes"][0].as_array().unwrap().len(),
        files,
        "{manifest}"
    );
    let lr = step_losses(
        &format!("resume-b-{strategy}"),
        &diloco_args(
            "2",
            strategy,
            "10",
            &["--checkpoint-dir", &ck, "--resume", "--save-params", &b],
        ),
    );
    assert_eq!(lr.len(), 2, "resumed at step 8: {lr:?}");
    for (s, l) in &lr {
        let want = lb.iter().find(|(t, _)| t == s).unwrap().1;
        assert_eq!(*l, want, "step {s}: resumed loss {l}, straight run {want}");
    }
    assert_eq!(
        std::fs::read(d.join("b.f32")).unwrap(),
        std::fs::read(d.join("base.f32")).unwrap(),
        "parameters after 10 steps differ between the straight and the resumed run"
    );

    // Another node count resumes too, saying what it does with the per-node inner states:
    // a new node starts the round at the anchor with node 0's inner optimizer state.
    let three = run_args(&diloco_args(
        "3",
        strategy,
        "10",
        &["--checkpoint-dir", &ck, "--resume"],
    ));
    let t = common::text(&three);
    assert!(three.status.success(), "{t}");
    assert!(
        t.contains("DiLoCo state of 2 node(s) resumed on 3: node(s) 2..3 start the round at"),
        "{t}"
    );

    // Any other strategy resumes node 0's model from the ordinary file set.
    let ddp = run_args(&diloco_args(
        "3",
        "ddp",
        "10",
        &["--checkpoint-dir", &ck, "--resume"],
    ));
    assert!(ddp.status.success(), "{}", common::text(&ddp));
    let _ = std::fs::remove_dir_all(&d);
}

/// ZeRO-2 sharding inside the node (`--inner-strategy hybrid`) is the same math as DDP inside
/// it, and still sends nothing between nodes in inner steps.
#[test]
fn sharding_inside_the_node_matches_ddp_inside_it() {
    let runs: Vec<Vec<serde_json::Value>> = ["ddp", "hybrid"]
        .iter()
        .map(|inner| {
            let strategy = format!("diloco:{inner}");
            let a = diloco_args("2", &strategy, "9", &[]);
            common::train_metrics(&format!("inner-{inner}"), &a, &[], Duration::from_secs(300))
        })
        .collect();
    let (ddp, hyb) = (steps(&runs[0]), steps(&runs[1]));
    assert_eq!(hyb.len(), 9);
    for (i, (a, b)) in ddp.iter().zip(&hyb).enumerate() {
        let (x, y) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(
            ((x - y) / x).abs() <= 1e-5,
            "step {i}: ddp {x} vs hybrid {y}"
        );
        let sent = b["sent_bytes"].as_f64().unwrap();
        if (i + 1) % 3 != 0 {
            assert!(
                sent < 1000.0,
                "step {i}: {sent} bytes crossed nodes in an inner step"
            );
        }
    }
    // The inner optimizer state is sharded: half of DDP's per rank on 2 ranks per node.
    let mem = |v: &[serde_json::Value]| {
        v.last().unwrap()["memory_per_rank"][0]["optim_bytes"]
            .as_f64()
            .expect("summary has memory_per_rank")
    };
    let (a, b) = (mem(&runs[0]), mem(&runs[1]));
    assert!(b < 0.6 * a, "optimizer bytes per rank: ddp {a}, hybrid {b}");
}

/// A 3-node checkpoint in the middle of a round resumed on 2 nodes: each keeps its own inner
/// state and node 2's is dropped. Checked exactly: the resumed step runs with lr 1e-12 (the
/// inner parameters do not move in f32) and ends the round with outer lr 1 and no momentum,
/// so the new anchor is the mean of nodes 0 and 1's parameters in the checkpoint, and both
/// start there.
#[test]
fn a_checkpoint_resumes_on_fewer_nodes_each_with_its_own_inner_state() {
    use wiretrain::checkpoint::Checkpoint;
    let d = common::fresh_dir("diloco-ck", "fewer");
    let ck = d.join("ck");
    let cks = ck.to_str().unwrap().to_string();
    let args = |nodes: &'static str, lr: &'static str, steps: &'static str| {
        let mut a = common::local_train(nodes, "1", &["--example", "mlp"]);
        a.extend(["--steps", steps, "--global-batch", "24", "--lr", lr]);
        a.extend(["--seed", "3", "--device", "cpu", "--no-progress"]);
        a.extend(["--strategy", "diloco", "--inner-steps", "3"]);
        a.extend([
            "--outer-lr",
            "1",
            "--outer-momentum",
            "0",
            "--wire-dtype",
            "f32",
        ]);
        a.extend(["--checkpoint-dir", &cks, "--checkpoint-every", "1"]);
        a.into_iter().map(String::from).collect::<Vec<String>>()
    };
    // 8 steps on 3 nodes: step 8's checkpoint is 2 inner steps into the third round.
    let a = run_args(
        &args("3", "0.01", "8")
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>(),
    );
    assert!(a.status.success(), "{}", common::text(&a));
    let mut r = args("2", "1e-12", "9");
    r.push("--resume".into());
    let b = run_args(&r.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let t = common::text(&b);
    assert!(b.status.success(), "{t}");
    assert!(
        t.contains("DiLoCo state of 3 node(s) resumed on 2: the inner steps of node(s) 2..3"),
        "{t}"
    );
    let open = |s: usize| Checkpoint::open(&ck.join(format!("step-{s:08}"))).unwrap();
    let (c8, c9) = (open(8), open(9));
    let whole = 0..c8.manifest.total;
    let all = std::slice::from_ref(&whole);
    let (n0, n1, n2) = (
        c8.read_params().unwrap(),
        c8.read_node(1, all).unwrap().params,
        c8.read_node(2, all).unwrap().params,
    );
    let anchor = c9.read_outer().unwrap().unwrap().anchor;
    let (mut worst, mut off) = (0.0f32, 0.0f32);
    for i in 0..anchor.len() {
        let want = 0.5 * (n0[i] + n1[i]);
        worst = worst.max((anchor[i] - want).abs() / want.abs().max(1.0));
        off = off.max((anchor[i] - 0.5 * (n0[i] + n2[i])).abs());
    }
    assert!(
        worst <= 1e-6,
        "the anchor is the mean of nodes 0 and 1: {worst}"
    );
    assert!(off > 1e-4, "node 2's inner state differs and is not used");
    assert_eq!(c9.read_params().unwrap(), anchor);
    assert_eq!(c9.read_node(1, all).unwrap().params, anchor);
    let _ = std::fs::remove_dir_all(&d);
}
