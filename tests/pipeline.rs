//! Pipeline parallelism (`examples/pipeline.rs`, `wiretrain::pipeline`) through real node
//! processes under `wiretrain launch`: 2 stages across 2 nodes (activations over QUIC), 4
//! stages on 2 nodes x 2 ranks (inside the node and across), 2 stages x 2 replicas (a stage
//! per node) and 2 stages x 3 replicas (a replica per node), with 1F1B and GPipe, give the
//! per-step losses and final parameters of plain Burn training the whole global batch in one
//! process, within 1e-5; configurations that cannot run are refused naming what to change.

mod common;

use std::path::Path;
use std::time::Duration;

const STEPS: &str = "6";

fn dir(name: &str) -> std::path::PathBuf {
    common::fresh_dir("pipeline", name)
}

/// The final parameters by path.
fn params(p: &Path) -> serde_json::Map<String, serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The largest difference between two runs' parameters, and the paths compared: every
/// parameter but the attention key biases. Their gradient is zero in exact arithmetic
/// (softmax ignores a shift shared by all keys), so what reaches them is rounding noise, which
/// AdamW normalizes into full-size steps of either sign: they differ between any two orders of
/// summation, plain Burn against itself included. They are checked to stay within the steps
/// AdamW can take (lr per step).
fn param_diff(
    a: &serde_json::Map<String, serde_json::Value>,
    b: &serde_json::Map<String, serde_json::Value>,
) -> (f64, usize) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    let mut compared = 0;
    for (path, va) in a {
        let (x, y) = (va.as_array().unwrap(), b[path].as_array().unwrap());
        assert_eq!(x.len(), y.len(), "{path}");
        let d = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p.as_f64().unwrap() - q.as_f64().unwrap()).abs())
            .fold(0.0, f64::max);
        if path.ends_with("mha.key.bias") {
            assert!(d <= 2.0 * 3e-3 * 6.0, "{path}: {d}");
            continue;
        }
        worst = worst.max(d);
        compared += 1;
    }
    (worst, compared)
}

/// Runs the example under `launch --local nodes --ranks-per-node ranks` with `extra` flags;
/// returns its output.
fn launch(nodes: &str, ranks: &str, extra: &[&str], d: &Path) -> std::process::Output {
    let ex = common::example("pipeline");
    let (m, p) = (d.join("m.jsonl"), d.join("p.json"));
    let mut cmd = vec![ex.to_str().unwrap(), "--steps", STEPS, "--layers", "2"];
    cmd.extend([
        "--metrics",
        m.to_str().unwrap(),
        "--params-out",
        p.to_str().unwrap(),
    ]);
    cmd.extend(extra);
    let args = common::local(nodes, ranks, &cmd);
    common::run(&args, &[], Duration::from_secs(300))
}

fn reference(d: &Path, batch: &str) -> (Vec<f64>, serde_json::Map<String, serde_json::Value>) {
    let ex = common::example("pipeline");
    let (m, p) = (d.join("m.jsonl"), d.join("p.json"));
    let out = std::process::Command::new(ex)
        .args([
            "--reference",
            "--steps",
            STEPS,
            "--layers",
            "2",
            "--batch",
            batch,
        ])
        .args([
            "--metrics",
            m.to_str().unwrap(),
            "--params-out",
            p.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
    (common::step_losses(&m), params(&p))
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn pipelines_of_2_and_4_stages_and_with_replicas_equal_plain_burn_with_1f1b_and_gpipe() {
    let refs = [
        ("16", reference(&dir("reference16"), "16")),
        ("24", reference(&dir("reference24"), "24")),
    ];
    let runs: [(&str, &str, &str, &[&str]); 5] = [
        ("2", "1", "16", &["--stages", "2", "--schedule", "1f1b"]),
        ("2", "2", "16", &["--stages", "4", "--schedule", "1f1b"]),
        (
            "2",
            "2",
            "16",
            &[
                "--stages",
                "4",
                "--schedule",
                "gpipe",
                "--microbatches",
                "2",
            ],
        ),
        // 2 stages x 2 replicas: a stage per node, its replicas averaging inside the node.
        (
            "2",
            "2",
            "16",
            &["--stages", "2", "--schedule", "1f1b", "--microbatches", "2"],
        ),
        // 2 stages x 3 replicas: the stages inside each node, a replica per node.
        (
            "3",
            "2",
            "24",
            &[
                "--stages",
                "2",
                "--schedule",
                "gpipe",
                "--microbatches",
                "2",
            ],
        ),
    ];
    for (i, (nodes, ranks, batch, extra)) in runs.into_iter().enumerate() {
        let (want_l, want_p) = &refs.iter().find(|r| r.0 == batch).unwrap().1;
        let d = dir(&format!("run{i}"));
        let extra = [extra, &["--batch", batch]].concat();
        let out = launch(nodes, ranks, &extra, &d);
        assert!(out.status.success(), "{extra:?}: {}", common::text(&out));
        let l = common::step_losses(&d.join("m.jsonl"));
        let p = params(&d.join("p.json"));
        assert!(
            max_diff(&l, want_l) < 1e-5,
            "{extra:?}: losses {l:?} vs {want_l:?}"
        );
        let (dp, compared) = param_diff(&p, want_p);
        assert!(compared > 10, "{compared} parameters compared");
        assert!(dp < 1e-5, "{extra:?}: parameters differ by up to {dp}");
        assert!(l[5] < l[0], "{extra:?} learns: {l:?}");
    }
}

#[test]
fn configurations_a_pipeline_cannot_run_are_refused_naming_what_to_change() {
    let cases: [(&str, &[&str], &str); 5] = [
        ("2", &["--stages", "3"], "3 stages on a world of 2 ranks"),
        ("3", &["--stages", "2"], "launch a multiple of 2 ranks"),
        (
            "4",
            &["--stages", "4", "--microbatches", "2"],
            "1F1B needs at least one per stage",
        ),
        (
            "2",
            &["--stages", "2", "--split", "0..0,0..4"],
            "non-empty, contiguous unit ranges",
        ),
        (
            "4",
            &["--stages", "4", "--layers", "1"],
            "each stage needs at least one unit",
        ),
    ];
    for (i, (ranks, extra, want)) in cases.into_iter().enumerate() {
        let out = launch("1", ranks, extra, &dir(&format!("bad{i}")));
        let text = common::text(&out);
        assert!(!out.status.success(), "{extra:?} ran: {text}");
        assert!(text.contains(want), "{extra:?} should say {want:?}: {text}");
    }
}

/// Stage 0's peak of live heap bytes in steps after the first (the process holds stage 0
/// alone under `--local 2`), and the micro-batches it held at once, from the metrics.
fn stage0_peak(m: &Path) -> (u64, u64) {
    let steps: Vec<serde_json::Value> = common::jsonl(m)
        .into_iter()
        .filter(|v| v.get("step").is_some_and(|s| s.as_u64() > Some(0)))
        .collect();
    let heap = steps
        .iter()
        .map(|v| v["peak_heap_bytes"].as_u64().unwrap())
        .max();
    (heap.unwrap(), steps[0]["peak_in_flight"].as_u64().unwrap())
}

#[test]
fn one_f_one_b_holds_at_most_s_micro_batches_of_activations_measured_on_the_heap() {
    // 2 stages, 8 micro-batches of 8 samples: GPipe holds all 8 on stage 0, 1F1B at most 2.
    let mut peaks = Vec::new();
    for schedule in ["gpipe", "1f1b"] {
        let d = dir(&format!("heap-{schedule}"));
        let extra = [
            "--stages",
            "2",
            "--schedule",
            schedule,
            "--microbatches",
            "8",
        ];
        let extra = [&extra[..], &["--batch", "64", "--steps", "3"]].concat();
        let out = launch("2", "1", &extra, &d);
        assert!(out.status.success(), "{schedule}: {}", common::text(&out));
        peaks.push(stage0_peak(&d.join("m.jsonl")));
    }
    let ((gpipe, g_held), (one, o_held)) = (peaks[0], peaks[1]);
    assert_eq!((g_held, o_held), (8, 2));
    // What 2 of the 8 micro-batches' activations take of GPipe's peak, with half again for
    // what does not scale with them (the step's gradient sum, messages in flight).
    let bound = 1.5 * 2.0 / 8.0 * gpipe as f64;
    assert!(
        (one as f64) <= bound,
        "1F1B's peak {one} B is above {bound:.0} B (GPipe's: {gpipe} B)"
    );
}

/// A stage's node process on its own (no launcher), as a machine of a real job runs it.
fn stage_node(rank: &str, master: &str, extra: &[(&str, &str)]) -> std::process::Child {
    let mut c = std::process::Command::new(common::example("pipeline"));
    c.args(["--stages", "2", "--microbatches", "2", "--steps", "100000"])
        .env("WIRETRAIN_NNODES", "2")
        .env("WIRETRAIN_NODE_RANK", rank)
        .env("WIRETRAIN_MASTER", master)
        .env("WIRETRAIN_RANKS_PER_NODE", "1")
        .env("WIRETRAIN_DEVICE", "cpu")
        .env(
            "WIRETRAIN_TOKEN",
            "pipeline-0123456789abcdef0123456789abcdef",
        )
        .envs(extra.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    c.spawn().unwrap()
}

#[test]
fn a_stage_that_dies_fails_the_other_stage_within_the_idle_timeout_naming_it() {
    use std::time::Instant;
    let d = dir("dies");
    let addr = d.join("addr");
    let mut n0 = stage_node(
        "0",
        "127.0.0.1:0",
        &[("WIRETRAIN_ADDR_FILE", addr.to_str().unwrap())],
    );
    let t0 = Instant::now();
    let master = loop {
        if let Ok(s) = std::fs::read_to_string(&addr) {
            break s.trim().to_string();
        }
        assert!(n0.try_wait().unwrap().is_none(), "stage 0 exited early");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "stage 0 never listened"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut n1 = stage_node("1", &master, &[("WIRETRAIN_BIND", "127.0.0.2:0")]);
    // A few steps, then stage 1's process dies without a word (SIGKILL).
    std::thread::sleep(Duration::from_secs(4));
    assert!(n1.try_wait().unwrap().is_none(), "stage 1 ended early");
    assert!(n0.try_wait().unwrap().is_none(), "stage 0 ended early");
    n1.kill().unwrap();
    let _ = n1.wait();
    let killed = Instant::now();
    loop {
        if n0.try_wait().unwrap().is_some() {
            break;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = n0.kill();
            panic!("stage 0 still runs 60 s after stage 1 died");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = killed.elapsed();
    let out = n0.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "stage 0 must fail: {err}");
    assert!(
        err.contains("rank 1") && err.contains("node 1"),
        "names the dead stage: {err}"
    );
    // The idle timeout (10 s) notices a silent peer; the collective timeout is 120 s.
    assert!(took < Duration::from_secs(30), "took {took:?}: {err}");
}
