//! A CNN with BatchNorm (`examples/resnet.rs`: a small ResNet from `burn::nn`) through Burn's
//! `Learner` with wiretrain's strategy, as real node processes over QUIC on loopback: 2 nodes x
//! 2 ranks under ddp, zero2 and zero3 (the model's units) log, step by step, the losses of
//! Burn's own single-device training on the same global batches (each rank's share normalized
//! apart, as each rank normalizes its own batch), and every rank ends with the same BatchNorm
//! running statistics, moved from their start.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("learner-cnn", name)
}

/// Burn's per-iteration training losses of epoch 1 (`train/epoch-1/Loss.log`).
fn losses(out: &Path) -> Vec<f64> {
    let p = out.join("train/epoch-1/Loss.log");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|err| panic!("{}: {err}", p.display()));
    text.lines()
        .filter(|l| !l.ends_with(",final"))
        .map(|l| l.split(',').next().unwrap().parse::<f64>().unwrap())
        .collect()
}

/// Each rank's printed running mean of the stem's BatchNorm: (rank, values).
fn running_means(stderr: &str) -> Vec<(usize, String)> {
    let mut v: Vec<(usize, String)> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("resnet: rank "))
        .filter_map(|l| {
            let (rank, rest) = l.split_once(" running mean ")?;
            Some((rank.parse().ok()?, rest.to_string()))
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_cnn_with_batchnorm_trains_through_the_learner_at_2x2_as_burn_does_on_one_device() {
    let d = dir("equal");
    let ex = common::example("resnet");
    let reference = d.join("reference");
    let out = std::process::Command::new(&ex)
        .args(["--reference", "4", "--epochs", "1", "--batch", "8", "--out"])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
    let want = losses(&reference);
    // 768 images, 4 ranks of 192, batch 8: 24 steps.
    assert_eq!(want.len(), 24);
    for strategy in ["ddp", "zero2", "zero3"] {
        let o = d.join(strategy);
        let mut args = common::local(
            "2",
            "2",
            &[
                ex.to_str().unwrap(),
                "--strategy",
                strategy,
                "--epochs",
                "1",
            ],
        );
        args.extend([
            "--batch",
            "8",
            "--device",
            "cpu",
            "--out",
            o.to_str().unwrap(),
        ]);
        let run = common::run(&args, &[], Duration::from_secs(600));
        let text = common::text(&run);
        assert!(run.status.success(), "{strategy}: {text}");
        let got = losses(&o);
        assert_eq!(got.len(), want.len(), "{strategy}");
        let worst = common::worst_rel(&got, &want, 1e-3);
        eprintln!("{strategy}: 2x2 Learner CNN vs one device, worst relative difference {worst:e}");
        assert!(worst <= 1e-5, "{strategy}: {want:?}\nvs\n{got:?}");
        assert!(got[23] < 0.7 * got[0], "learns: {got:?}");
        let means = running_means(&String::from_utf8_lossy(&run.stderr));
        let ranks: Vec<usize> = means.iter().map(|m| m.0).collect();
        assert_eq!(ranks, [0, 1, 2, 3], "{strategy}: {text}");
        assert!(
            means.iter().all(|m| m.1 == means[0].1),
            "{strategy}: every rank holds rank 0's statistics: {means:?}"
        );
        let first: Vec<f32> = means[0]
            .1
            .trim_matches(|c| c == '[' || c == ']')
            .split(", ")
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(first.len(), 8);
        assert!(
            first.iter().any(|&x| x.abs() > 1e-3),
            "{strategy}: the statistics moved from their start (0): {first:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}
