//! Burn's `Learner` distributed by wiretrain, through the `learner` example (its own model and
//! data) as real node processes over QUIC on loopback: 2 nodes x 2 ranks with ddp, zero2 and
//! zero3 (the model's units) log, step by step, the same global loss (Burn's own `Loss.log` of rank 0) as Burn's
//! single-device training on the same global batches, within 1e-5; Burn's checkpointer writes
//! on rank 0; a strategy the model cannot use is one clear line and exit 2. In an elastic
//! launch, a lost node's survivors heal in place (DDP) or restart from the sharded
//! checkpoint (zero2, or when rank 0's node is lost).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("learner", name)
}

/// Burn's per-iteration training losses of `epochs` epochs under `out`.
fn burn_losses(out: &Path, epochs: usize) -> Vec<f64> {
    (1..=epochs).flat_map(|e| epoch_losses(out, e)).collect()
}

/// Burn's per-iteration training losses of epoch `e` (`train/epoch-E/Loss.log`: one
/// "loss,count" line per step, then "mean,final").
fn epoch_losses(out: &Path, e: usize) -> Vec<f64> {
    let p = out.join(format!("train/epoch-{e}/Loss.log"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|err| panic!("{}: {err}", p.display()));
    text.lines()
        .filter(|l| !l.ends_with(",final"))
        .map(|l| l.split(',').next().unwrap().parse::<f64>().unwrap())
        .collect()
}

const EPOCHS: &str = "2";

/// `launch --local 2 --ranks-per-node 2 -- <learner example> --strategy S --epochs E --batch 16
/// --device cpu <rest...>`, which must succeed.
fn learner_2x2(ex: &Path, strategy: &str, epochs: &str, rest: &[&str]) {
    let mut args = common::local(
        "2",
        "2",
        &[
            ex.to_str().unwrap(),
            "--strategy",
            strategy,
            "--epochs",
            epochs,
        ],
    );
    args.extend(["--batch", "16", "--device", "cpu"]);
    args.extend_from_slice(rest);
    let run = common::run(&args, &[], Duration::from_secs(600));
    assert!(run.status.success(), "{strategy}: {}", common::text(&run));
}

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
        let mut rest = vec!["--out", o.to_str().unwrap()];
        if strategy == "zero2" {
            rest.push("--checkpoints");
        }
        learner_2x2(&ex, strategy, EPOCHS, &rest);
        let got = burn_losses(&o, 2);
        assert_eq!(got.len(), want.len(), "{strategy}");
        let worst = common::worst_rel(&got, &want, 1e-3);
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
    // wiretrain's sharded checkpoint after epoch 1 of a zero2 run, resumed under zero3 (other
    // shards: buckets become units): epoch 2 continues the uninterrupted curve, optimizer
    // state included.
    let ck = d.join("ck");
    let sharded = |strategy: &str, epochs: &str, o: &Path, extra: &[&str]| {
        let mut rest = vec![
            "--sharded",
            ck.to_str().unwrap(),
            "--out",
            o.to_str().unwrap(),
        ];
        rest.extend(extra);
        learner_2x2(&ex, strategy, epochs, &rest);
    };
    sharded("zero2", "1", &d.join("first"), &[]);
    let o = d.join("resumed");
    sharded("zero3", EPOCHS, &o, &["--resume"]);
    let got = epoch_losses(&o, 2);
    assert!(
        !o.join("train/epoch-1").exists(),
        "epoch 1 came from the checkpoint"
    );
    let worst = common::worst_rel(&got, &want[24..], 1e-3);
    eprintln!("resumed 2x2 zero3 from a 2x2 zero2 checkpoint: worst relative difference {worst:e}");
    assert_eq!(got.len(), 24);
    assert!(worst <= 1e-5, "{:?}\nvs\n{got:?}", &want[24..]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_strategy_the_model_cannot_use_is_refused() {
    let ex = common::example("learner");
    let text = common::refused(&common::local_nodes(
        "1",
        &[ex.to_str().unwrap(), "--strategy", "zero3", "--whole"],
    ));
    assert!(text.contains("needs a model cut into units"), "{text}");
}

/// Ctrl-C at the launcher reaches every rank's strategy: all ranks leave the Learner after the
/// same step (the stop travels with the step's loss reduction) and the job exits 130.
#[test]
fn ctrl_c_stops_every_learner_rank_after_the_same_step() {
    let d = dir("stop");
    let (ex, o) = (common::example("learner"), d.join("out"));
    let (exs, os) = (ex.to_str().unwrap(), o.to_str().unwrap());
    let args = [exs, "--epochs", "100000", "--device", "cpu", "--out", os];
    let mut child = common::spawn(&common::local("2", "2", &args), &[]);
    let log = o.join("train/epoch-1/Loss.log");
    common::wait_until(&mut child, Duration::from_secs(120), "3 steps", || {
        common::line_count(&log) >= 3
    });
    common::signal(child.id(), "-INT");
    let st = common::wait_exit(&mut child, Duration::from_secs(60));
    let err = common::stderr_of(&mut child);
    assert_eq!(st.code(), Some(130), "{err}");
    // Every rank's own step count at the stop (2 nodes x 2 ranks): the same on all four.
    let steps: Vec<(usize, usize)> = err
        .lines()
        .filter_map(|l| l.strip_prefix("learner: rank "))
        .filter_map(|l| {
            let (r, n) = l.split_once(" stopped after step ")?;
            Some((r.parse().ok()?, n.trim().parse().ok()?))
        })
        .collect();
    let mut ranks: Vec<usize> = steps.iter().map(|s| s.0).collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2, 3], "every rank reports its count: {err}");
    assert!(
        steps.iter().all(|s| s.1 == steps[0].1 && s.1 >= 3),
        "every rank stopped after the same step: {steps:?}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// An elastic launch of the Learner example (3 nodes of 1 rank, DDP, `--nnodes 2:3`): node 2
/// dies as by `kill -9` at the start of step 140 (the 13th of epoch 5: WIRETRAIN_TEST_DIE_AT)
/// and the two others heal in place, through `WiretrainStrategy::with_heal`: no restart, the
/// rest of epoch 5 on their own shares (the step cut off lost), every later epoch shared over
/// 2 ranks; epochs 6 to 30 equal a 2-node run resumed from the healed run's checkpoint of
/// epoch 5, step by step (what the heal's state does from there on; the next test checks that
/// state against a run whose state was not disturbed).
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn a_lost_node_under_the_learner_heals_from_live_replicas() {
    let d = learner_heal("heal", &[], "state identical on every replica");
    resumed_from_epoch_5_matches(&d);
    let _ = std::fs::remove_dir_all(&d);
}

/// The same with node 1's state made to differ at the heal (and claiming a step fewer): node
/// 0's is sent to it, checked by digest, and the run goes on as one: every epoch's losses
/// equal those of the same launch without the disturbance (an independent reference: the
/// state node 1 received must be exactly the one it would have held).
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn under_the_learner_a_survivor_whose_state_differs_receives_a_replicas() {
    let diverge = [("WIRETRAIN_TEST_HEAL_DIVERGE", "1")];
    let d = learner_heal("diverged", &diverge, "state sent from a replica");
    let plain = learner_heal("undisturbed", &[], "state identical on every replica");
    for e in 1..=30 {
        let (got, want) = (
            epoch_losses(&d.join("out"), e),
            epoch_losses(&plain.join("out"), e),
        );
        assert_eq!(got.len(), want.len(), "epoch {e}");
        let worst = common::worst_rel(&got, &want, 1e-3);
        assert!(
            worst <= 1e-6,
            "epoch {e}: after the transfer {got:?}\nundisturbed {want:?}"
        );
    }
    for p in [d, plain] {
        let _ = std::fs::remove_dir_all(&p);
    }
}

/// The elastic Learner launch of the tests above, its heal checked (one heal, step 140
/// lost, the epochs' step counts); returns its directory (`out`, `ck`).
fn learner_heal(name: &str, envs: &[(&str, &str)], state: &str) -> PathBuf {
    let d = dir(name);
    let o = d.join("out");
    let (st, err) = elastic_learner(&d, ("ddp", "30", "1"), "2", envs);
    assert!(st.success(), "{err}");
    assert!(
        err.contains("elastic heal 1 of 1")
            && err.contains("going on from step 140 with no checkpoint read (1 step(s) lost")
            && err.contains(state),
        "{err}"
    );
    assert!(!err.contains("elastic restart"), "no restart: {err}");
    // 1536 items: 32 steps an epoch on 3 ranks of batch 16, 48 on 2; epoch 5 ends on the
    // survivors' shares without the step cut off.
    let counts: Vec<usize> = (1..=30).map(|e| epoch_losses(&o, e).len()).collect();
    let mut want = vec![32; 4];
    want.push(31);
    want.extend([48; 25]);
    assert_eq!(counts, want);
    d
}

/// 2 nodes resume from the healed run's checkpoint of epoch 5 and train epochs 6 to 30: the
/// same losses, step by step.
fn resumed_from_epoch_5_matches(d: &Path) {
    let (o, ck) = (d.join("out"), d.join("ck"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let exs = s(&common::example("learner"));
    // The reference: 2 nodes resume from epoch 5's checkpoint and train epochs 6 to 30.
    let (ck2, o2) = (d.join("ck-reference"), d.join("out-reference"));
    std::fs::create_dir_all(&ck2).unwrap();
    let name = "step-00000005";
    let cp = std::process::Command::new("cp")
        .args(["-r", &s(&ck.join(name)), &s(&ck2.join(name))])
        .status()
        .unwrap();
    assert!(cp.success());
    let (ck2s, o2s) = (s(&ck2), s(&o2));
    let mut a = common::local("2", "1", &[&exs, "--strategy", "ddp", "--epochs", "30"]);
    a.extend([
        "--batch",
        "16",
        "--device",
        "cpu",
        "--sharded",
        &ck2s,
        "--resume",
    ]);
    a.extend(["--out", &o2s]);
    let mut child = common::spawn(&a, &[]);
    let st = common::wait_exit_or(&mut child, Duration::from_secs(240), "the reference hangs");
    assert!(st.success(), "{}", common::stderr_of(&mut child));
    for e in 6..=30 {
        let (got, want) = (epoch_losses(&o, e), epoch_losses(&o2, e));
        assert_eq!(got.len(), want.len());
        let worst = common::worst_rel(&got, &want, 1e-3);
        assert!(
            worst <= 1e-5,
            "epoch {e}: healed {got:?}\nvs resumed {want:?}"
        );
    }
}

/// The same death under zero2 (a lost node's shards exist nowhere else): the launch restarts
/// the survivors, which resume from the sharded checkpoint of epoch 4 and run every later
/// epoch on 2 ranks.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn a_lost_node_under_the_learner_with_zero2_restarts_from_the_sharded_checkpoint() {
    let d = dir("restart");
    let (st, err) = elastic_learner(&d, ("zero2", "8", "1"), "2", &[]);
    assert!(st.success(), "{err}");
    assert!(
        err.contains("elastic restart 1 of 1: epoch 1 on 2 node(s) without [2]"),
        "{err}"
    );
    assert!(!err.contains("healed from live replicas"), "{err}");
    let counts: Vec<usize> = (5..=8)
        .map(|e| epoch_losses(&d.join("out"), e).len())
        .collect();
    assert_eq!(counts, [48; 4], "epochs 5-8 on 2 ranks");
    let _ = std::fs::remove_dir_all(&d);
}

/// When the node of rank 0 dies (Burn's validation, checkpointer and logs run there), the
/// survivors' heal fails alike on every rank, naming why, and the launch restarts them from
/// the sharded checkpoint (the failed heal is one of the restarts).
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn losing_rank_0s_node_under_the_learner_restarts_from_the_sharded_checkpoint() {
    let d = dir("rank0");
    let (st, err) = elastic_learner(&d, ("ddp", "8", "2"), "0", &[]);
    assert!(st.success(), "{err}");
    assert!(err.contains("elastic heal 1 of 2"), "{err}");
    assert!(err.contains("the node of rank 0 was lost"), "{err}");
    assert!(err.contains("elastic restart 2 of 2"), "{err}");
    assert!(!err.contains("healed from live replicas"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `launch --local 3 --nnodes 2:3 --max-restarts R -- <learner example> --strategy S --epochs E
/// --batch 16 --sharded <d>/ck --keep 40 --resume --out <d>/out` with node `die` dying at
/// the start of step 140 (plus `envs`): the launch's exit status and stderr.
fn elastic_learner(
    d: &Path,
    (strategy, epochs, restarts): (&str, &str, &str),
    die: &str,
    envs: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (exs, os, cks) = (
        s(&common::example("learner")),
        s(&d.join("out")),
        s(&d.join("ck")),
    );
    let mut args = vec!["launch", "--local", "3", "--nnodes", "2:3"];
    args.extend([
        "--max-restarts",
        restarts,
        "--",
        &exs,
        "--strategy",
        strategy,
    ]);
    args.extend(["--epochs", epochs, "--batch", "16", "--device", "cpu"]);
    args.extend(["--sharded", &cks, "--keep", "40", "--resume", "--out", &os]);
    let at = format!("{die}:140");
    let mut envs = envs.to_vec();
    envs.push(("WIRETRAIN_TEST_DIE_AT", &at));
    // Burn's renderer writes much to stdout: it goes nowhere, stderr is read at the end.
    let mut child = common::spawn(&args, &envs);
    let st = common::wait_exit_or(&mut child, Duration::from_secs(240), "the job hangs");
    (st, common::stderr_of(&mut child))
}
