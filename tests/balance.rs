//! Speed-proportional batches through the real binary: one node, two CPU-backend ranks, rank
//! 1 made 3x slower with the documented debug knob (`WIRETRAIN_DEBUG_SLOWDOWN=1:3`). With
//! `--balance speed` the shares move toward the fast rank after calibration (the metrics show
//! them every step), and the updates are the same as with an equal split (the gradient is
//! weighted by share), so the loss curves match. The speed-up itself is a benchmark
//! (scripts/bench-balance.sh, docs/BENCHMARKS.md), not asserted here.

mod common;

use std::time::Duration;

fn run(balance: &str) -> Vec<serde_json::Value> {
    common::train_metrics(
        &format!("balance-{balance}"),
        &common::local_train(
            "1",
            "2",
            &[
                "--example",
                "char-lm",
                "--steps",
                "16",
                "--device",
                "cpu",
                "--balance",
                balance,
            ],
        ),
        &[("WIRETRAIN_DEBUG_SLOWDOWN", "1:3")],
        Duration::from_secs(600),
    )
}

#[test]
fn speed_balance_moves_work_to_the_fast_rank_with_the_same_updates() {
    let equal = run("equal");
    let speed = run("speed");
    let steps = |v: &[serde_json::Value]| -> Vec<serde_json::Value> {
        v.iter()
            .filter(|l| l.get("summary").is_none())
            .cloned()
            .collect()
    };
    let (e, s) = (steps(&equal), steps(&speed));
    assert_eq!(e.len(), 16);
    assert_eq!(s.len(), 16);
    // Calibration: equal shares first.
    assert_eq!(s[0]["shares"], serde_json::json!([32, 32]));
    let last: Vec<u64> = s[15]["shares"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    eprintln!("shares after calibration: {last:?}");
    assert_eq!(last.iter().sum::<u64>(), 64);
    assert!(
        last[1] * 100 < 64 * 40,
        "the 3x slower rank should get well under half: {last:?}"
    );
    let summary = speed.last().unwrap();
    assert_eq!(summary["balance"], "speed");
    assert!(summary["speeds"][0].as_f64().unwrap() > summary["speeds"][1].as_f64().unwrap());
    // Same global batch, weighted gradients: the same training.
    for (a, b) in e.iter().zip(&s) {
        let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(((la - lb) / la).abs() <= 1e-5, "loss {la} vs {lb}");
    }
}
