//! Collectives between two network namespaces joined by a tbf-shaped veth pair (the wiring
//! lab's smallest form): correctness across a real shaped link. Throughput figures are in
//! docs/BENCHMARKS.md (a benchmark, not this test). Skipped, with the reason printed, where
//! namespaces cannot be created (not root, no iproute2); under `CI=true` that fails instead.

mod common;

use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The lab tests run one at a time: each measures time on a 2-core machine.
static LAB: Mutex<()> = Mutex::new(());

fn lab_lock() -> std::sync::MutexGuard<'static, ()> {
    LAB.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `scripts/<script>` with the binary under test: `None` (the reason printed) where the
/// script exits 77 because namespaces cannot be created, else its output and text after
/// asserting that it succeeded.
fn lab(script: &str, args: &[&str], env: &[(&str, &str)]) -> Option<(Output, String)> {
    let path = format!("{}/scripts/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(path)
        .args(args)
        .env("BIN", common::bin())
        .envs(env.iter().copied())
        .output()
        .expect("run lab script");
    let text = common::text(&out);
    if out.status.code() == Some(77) {
        common::skip_unless_ci(String::from_utf8_lossy(&out.stdout).trim());
        return None;
    }
    assert!(out.status.success(), "{text}");
    Some((out, text))
}

#[test]
fn collectives_across_a_shaped_link() {
    let _one = lab_lock();
    let t0 = Instant::now();
    let Some((out, text)) = lab(
        "lab-tbf.sh",
        &[
            "--op",
            "all-reduce,reduce-scatter,all-gather,broadcast,p2p",
            "--bytes",
            "0,28,4000012",
            "--iters",
            "3",
            "--warmup",
            "0",
            "--check",
            "--json",
            "--reduce",
            "mean",
        ],
        &[("RATE", "1gbit"), ("LIMIT", "120")],
    ) else {
        return;
    };
    assert!(t0.elapsed() < Duration::from_secs(240), "{text}");
    let rows = common::rows(&out);
    assert_eq!(rows.len(), 15, "{text}");
    for r in rows {
        assert_eq!(r["wrong"], 0, "{r}");
        assert_eq!(r["nodes"], 2);
    }
}

/// Fault test: the link between two training nodes is cut (`ip link set down` on the veth)
/// mid-training. Both nodes must exit non-zero within 30 s of the cut, naming the other node
/// (QUIC keep-alive declares the peer dead after the idle timeout; nothing hangs).
#[test]
fn a_cut_link_stops_both_training_nodes_within_30_s() {
    let _one = lab_lock();
    let Some((out, text)) = lab(
        "lab-tbf.sh",
        &[&common::MLP_FOREVER[..], &["--no-progress"]].concat(),
        &[
            ("SUB", "train"),
            ("RATE", "1gbit"),
            ("LIMIT", "120"),
            ("CUT_AFTER", "8"),
        ],
    ) else {
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let exits: Vec<(i32, u64)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("# cut: node "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (
                w[3].trim_end_matches(',').parse().unwrap(),
                w[4].parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(exits.len(), 2, "{text}");
    for (i, (code, ms)) in exits.iter().enumerate() {
        eprintln!("node {i}: exit {code} after {ms} ms");
        assert_ne!(*code, 0, "node {i} must fail: {text}");
        assert!(*ms < 30_000, "node {i} took {ms} ms: {text}");
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node 1") && err.contains("node 0"), "{text}");
}

/// Elastic launch across three namespaces (one agent each, `--nnodes 2:3`): the link of the
/// third is cut mid-training (`ip link set down`). That is handled like its death: the two
/// agents still connected restart without it under epoch 1, from the newest checkpoint, and
/// finish; the cut agent fails within 30 s, having lost the rendezvous.
#[test]
fn a_cut_link_in_an_elastic_launch_is_handled_like_a_death() {
    let _one = lab_lock();
    let Some((out, text)) = lab("lab-elastic.sh", &[], &[("STEPS", "300"), ("CUT_AT", "20")])
    else {
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let exits: Vec<(i32, u64)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("# agent "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[2].parse().unwrap(), w[4].parse().unwrap())
        })
        .collect();
    assert_eq!(exits.len(), 3, "{text}");
    assert_eq!(
        (exits[0].0, exits[1].0),
        (0, 0),
        "the two left finish: {text}"
    );
    assert_ne!(exits[2].0, 0, "the cut agent fails: {text}");
    assert!(
        exits[2].1 < 30_000,
        "the cut agent took {} ms: {text}",
        exits[2].1
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lost the elastic rendezvous"), "{text}");
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("the summary line");
    assert_eq!(summary["world"], 2, "{summary}");
    let r = &summary["elastic"]["restarts"][0];
    assert_eq!(r["left"], serde_json::json!([2]), "{summary}");
    assert_eq!(r["world"], 2, "{summary}");
    let took = r["restarted_unix_ms"].as_u64().unwrap() - r["detected_unix_ms"].as_u64().unwrap();
    assert!(took <= 30_000, "{took} ms");
}

/// The wiring lab end to end, smallest form: 2 namespaced nodes on a bridge, char-lm (1.6M
/// parameters) with DDP unshaped and over a 50 Mbit/s tbf link; the planner, calibrated by
/// `wiretrain bench` alone (`--op compute` for the compute rate, `--op p2p` for each link),
/// predicts both steps within 20 % (compute dominates the one, the link the other). The full
/// sweep (4 rates x 5 strategies) is `scripts/lab.sh`; its figures are in docs/WIRING.md.
///
/// The lab measures time on a shared 2-core VM, where the same compute has been seen to take
/// 553 ms in one row and 736 ms in the next (host steal), so a prediction may miss in one lab
/// run through no fault of the planner. A miss is retried only while the host is seen to be
/// noisy: the first miss runs the lab again; a later miss is retried only when some row's
/// measured step differs by more than 20 % between the last two runs (the same work, timed
/// twice). Two runs that agree and both miss fail the test: that is the planner. Every run is
/// reported; every structural check holds on every run.
#[test]
fn the_lab_measures_and_the_planner_predicts_a_shaped_run() {
    const LAB_ATTEMPTS: usize = 3;
    let _one = lab_lock();
    let csv = std::env::temp_dir().join(format!("wiretrain-lab-{}.csv", std::process::id()));
    let mut misses = Vec::new();
    let mut last_steps: Option<Vec<f64>> = None;
    for attempt in 1..=LAB_ATTEMPTS {
        let Some(_) = lab(
            "lab.sh",
            &[],
            &[
                ("RATES", "none 50"),
                ("STRATEGIES", "ddp"),
                ("STEPS", "6"),
                ("LIMIT", "200"),
                ("OUT", csv.to_str().unwrap()),
            ],
        ) else {
            return;
        };
        let body = std::fs::read_to_string(&csv).unwrap();
        let rows: Vec<Vec<&str>> = body
            .lines()
            .skip(1)
            .map(|l| l.split(',').collect())
            .collect();
        assert_eq!(rows.len(), 2, "{body}");
        let (unshaped, shaped) = (&rows[0], &rows[1]);
        let step = |r: &Vec<&str>| r[4].parse::<f64>().unwrap();
        assert!(
            step(shaped) > 1.5 * step(unshaped),
            "the 50 Mbit/s link must cost: {body}"
        );
        // The calibration came from wiretrain bench: one compute rate for the whole lab
        // (measured once, before any run) and a link rate per rate, slower on the shaped link.
        let tflops = |r: &Vec<&str>| r[14].parse::<f64>().unwrap();
        assert!(tflops(shaped).is_finite() && tflops(shaped) > 0.0, "{body}");
        assert_eq!(tflops(shaped), tflops(unshaped), "{body}");
        assert!(
            shaped[12].parse::<f64>().unwrap() < unshaped[12].parse::<f64>().unwrap(),
            "{body}"
        );
        let mut within = true;
        for r in [unshaped, shaped] {
            let ratio: f64 = r[11].parse().unwrap();
            eprintln!(
                "lab run {attempt}: {} ddp: measured {} ms, predicted/measured {ratio}",
                r[0],
                step(r)
            );
            within &= (0.8..=1.2).contains(&ratio);
        }
        if within {
            break;
        }
        misses.push(body.clone());
        let steps = vec![step(unshaped), step(shaped)];
        if let Some(prev) = &last_steps {
            let spread = prev
                .iter()
                .zip(&steps)
                .map(|(a, b)| (a - b).abs() / a.min(*b))
                .fold(0.0, f64::max);
            eprintln!(
                "lab run {attempt}: largest change of a row's step since the last run {spread:.3}"
            );
            assert!(
                spread > 0.2,
                "the prediction missed by more than 20 % in two runs whose measurements agree \
                 within 20 % (no host noise to blame):\n{}",
                misses.join("\n")
            );
        }
        last_steps = Some(steps);
        assert!(
            attempt < LAB_ATTEMPTS,
            "prediction off by more than 20 % in all {LAB_ATTEMPTS} lab runs:\n{}",
            misses.join("\n")
        );
    }
    let png = csv.with_extension("png");
    let out = common::run(
        &[
            "plan",
            "--lab-csv",
            csv.to_str().unwrap(),
            "--lab-plot",
            png.to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{}", common::text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("| 50 Mbit/s | ddp |"));
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
    let _ = std::fs::remove_file(&csv);
    let _ = std::fs::remove_file(&png);
}

/// `train --strategy auto` in the lab (`scripts/lab-auto.sh`): two namespaced nodes of 2 ranks,
/// char-lm at d_model 128, at 1000 Mbit/s and at 20 Mbit/s with DiLoCo allowed. At each rate
/// the auto run measures the wiring (within 10 s), plans and trains with its pick; then every
/// strategy it could pick is run at the same rate. Asserted: one pick per rate; at 1000 Mbit/s
/// a strategy whose update equals single-process training; at 20 Mbit/s DiLoCo, whose measured
/// step beats every exact strategy's by at least 1.3x (measured: 1.8x to 2.3x). How close the pick comes
/// to the fastest run at 1000 Mbit/s, where the exact strategies are within a few percent of
/// each other, is a benchmark figure (docs/WIRING.md), not asserted: the 2-core VM's noise is
/// larger than the gaps.
#[test]
fn strategy_auto_picks_an_exact_strategy_on_a_fast_link_and_diloco_on_a_slow_one() {
    let _one = lab_lock();
    let mut picks = Vec::new();
    for (rate, allow, runs) in [("1000", "", 5), ("20", "diloco", 7)] {
        let csv = std::env::temp_dir().join(format!(
            "wiretrain-lab-auto-{}-{rate}.csv",
            std::process::id()
        ));
        let Some((_, text)) = lab(
            "lab-auto.sh",
            &[],
            &[
                ("RATES", rate),
                ("ALLOW", allow),
                ("STRATEGIES", "ddp zero2 zero3 hybrid hsdp"),
                ("STEPS", "8"),
                (
                    "EXTRA",
                    "--example char-lm --device cpu --global-batch 32 --d-model 128",
                ),
                ("LIMIT", "200"),
                ("OUT", csv.to_str().unwrap()),
            ],
        ) else {
            return;
        };
        eprintln!("lab-auto, {rate} Mbit/s:\n{text}");
        let body = std::fs::read_to_string(&csv).unwrap();
        let _ = std::fs::remove_file(&csv);
        let rs: Vec<Vec<&str>> = body
            .lines()
            .skip(1)
            .map(|l| l.split(',').collect())
            .collect();
        assert_eq!(rs.len(), runs, "{body}");
        let picked: Vec<_> = rs.iter().filter(|r| r[2] == "1").collect();
        assert_eq!(
            picked.len(),
            1,
            "{rate} Mbit/s: one pick among the runs: {body}"
        );
        let p = picked[0];
        let measure: f64 = p[5].parse().unwrap();
        assert!(measure <= 10.0, "measuring took {measure} s: {body}");
        if rate == "20" {
            let step = |r: &Vec<&str>| r[3].parse::<f64>().unwrap();
            let exact = rs.iter().filter(|r| !r[1].starts_with("diloco"));
            let gain = exact.map(step).fold(f64::MAX, f64::min) / step(p);
            assert!(
                gain >= 1.3,
                "20 Mbit/s: the pick gains only {gain:.2}x over the exact strategies: {body}"
            );
        }
        picks.push((p[1].to_string(), body));
    }
    assert!(
        !picks[0].0.starts_with("diloco"),
        "1000 Mbit/s: an exact strategy: {picks:?}"
    );
    assert!(
        picks[1].0.starts_with("diloco"),
        "20 Mbit/s with --allow diloco: {picks:?}"
    );
}
