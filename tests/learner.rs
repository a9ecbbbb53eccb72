//! Burn's `Learner` distributed by wiretrain, through the `learner` example (its own model and
//! data) as real node processes over QUIC on loopback: 2 nodes x 2 ranks with ddp, zero2 and
//! zero3 (the model's units) log, step by step, the same global loss (Burn's own `Loss.log` of rank 0) as Burn's
//! single-device training on the same global batches, within 1e-5; Burn's checkpointer writes
//! on rank 0; a strategy the model cannot use is one clear line and exit 2.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wiretrain-learner-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Burn's per-iteration training losses of `epochs` epochs under `out`.
fn burn_losses(out: &Path, epochs: usize) -> Vec<f64> {
    (1..=epochs)
        .flat_map(|e| {
            let p = out.join(format!("train/epoch-{e}/Loss.log"));
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|err| panic!("{}: {err}", p.display()));
            text.lines()
                .filter(|l| !l.ends_with(",final"))
                .map(|l| l.split(',').next().unwrap().parse::<f64>().unwrap())
                .collect::<Vec<_>>()
        })
        .collect()
}

const EPOCHS: &str = "2";

#[test]
fn learner_on_two_nodes_matches_single_device_training_step_by_step() {
    let d = dir("equal");
    let ex = common::example("learner");
    let reference = d.join("reference");
    let out = std::process::Command::new(&ex)
        .args([
            "--reference",
            "4",
            "--epochs",
            EPOCHS,
            "--batch",
            "16",
            "--out",
        ])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
    let want = burn_losses(&reference, 2);
    // 1536 items, 4 ranks of 384, batch 16: 24 steps an epoch.
    assert_eq!(want.len(), 48);
    for strategy in ["ddp", "zero2", "zero3"] {
        let o = d.join(strategy);
        let mut args = vec![
            "launch",
            "--local",
            "2",
            "--ranks-per-node",
            "2",
            "--",
            ex.to_str().unwrap(),
            "--strategy",
            strategy,
            "--epochs",
            EPOCHS,
            "--batch",
            "16",
            "--device",
            "cpu",
            "--out",
            o.to_str().unwrap(),
        ];
        if strategy == "zero2" {
            args.push("--checkpoints");
        }
        let run = common::run(&args, &[], Duration::from_secs(600));
        assert!(run.status.success(), "{strategy}: {}", common::text(&run));
        let got = burn_losses(&o, 2);
        assert_eq!(got.len(), want.len(), "{strategy}");
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1e-3))
            .fold(0.0, f64::max);
        eprintln!("{strategy}: 2x2 Learner vs single device, worst relative difference {worst:e}");
        assert!(worst <= 1e-5, "{strategy}: {want:?}\nvs\n{got:?}");
        assert!(got[47] < 0.8 * got[0], "learns: {got:?}");
        if strategy == "zero2" {
            assert!(
                o.join("checkpoint/model-2.bpk").exists(),
                "Burn's checkpointer on rank 0"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_strategy_the_model_cannot_use_is_refused() {
    let out = common::run(
        &[
            "launch",
            "--local",
            "1",
            "--",
            common::example("learner").to_str().unwrap(),
            "--strategy",
            "zero3",
            "--whole",
        ],
        &[],
        Duration::from_secs(60),
    );
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{}", common::text(&out));
    assert!(text.contains("needs a model cut into units"), "{text}");
}
