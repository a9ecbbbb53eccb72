//! Healing from live replicas through the real binary (Burn's CPU backend, real QUIC between
//! node processes): in `launch --local 3 --nnodes 2:3 --max-restarts 1`, node 2 killed with
//! -9 under DDP (under HSDP, under DiLoCo, and under hybrid, 2 ranks per node, with one
//! survivor's state made to differ) leaves two processes that go on in epoch 1 from their
//! in-memory state, with no checkpoint read and at most one step lost; their parameters and
//! losses equal those of the same job run without a failure on 3 nodes up to that step and
//! resumed on 2 nodes from that run's own checkpoint.

mod common;

use common::ckpt::{BATCH, dir, losses, s};
use std::path::Path;
use std::time::{Duration, Instant};

/// `launch --local 3 --ranks-per-node R --nnodes 2:3 --max-restarts 1 -- train` of the mlp
/// example (300 steps, a checkpoint after every step, all kept, a 3 s idle timeout).
fn heal_args(strategy: &str, flags: &[&str], ranks: &str, d: &Path) -> Vec<String> {
    let mut a = vec!["launch", "--local", "3", "--ranks-per-node", ranks];
    a.extend(["--nnodes", "2:3", "--max-restarts", "1", "--", "train"]);
    a.extend(common::mlp(strategy, "300", BATCH, "5", "cpu"));
    a.extend_from_slice(flags);
    a.extend(["--checkpoint-every", "1", "--checkpoint-keep", "400"]);
    a.extend(["--idle-timeout", "3"]);
    let mut a: Vec<String> = a.into_iter().map(String::from).collect();
    for (flag, name) in [
        ("--checkpoint-dir", "ck"),
        ("--metrics", "m.jsonl"),
        ("--save-params", "p.bin"),
        ("--trace", "trace"),
    ] {
        a.push(flag.into());
        a.push(s(&d.join(name)).into());
    }
    a
}

fn floats(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Runs the launch (`strategy` with its `flags`), kills node 2 after 20 steps (unless `envs`
/// has it kill itself with WIRETRAIN_TEST_DIE_AT) and checks the heal; returns its event in
/// the summary, or nothing where /proc shows no children (never under CI=true).
fn kill_and_heal(
    (strategy, flags): (&str, &[&str]),
    ranks: &str,
    envs: &[(&str, &str)],
    transferred: Option<bool>,
) -> Option<serde_json::Value> {
    kill_heal_inspect((strategy, flags), ranks, envs, transferred, &|_| {})
}

/// [`kill_and_heal`], then `inspect` on the run's directory before it is removed (its
/// checkpoints in `ck`, the failure-free run's in `ck-3`).
fn kill_heal_inspect(
    (strategy, flags): (&str, &[&str]),
    ranks: &str,
    envs: &[(&str, &str)],
    transferred: Option<bool>,
    inspect: &dyn Fn(&Path),
) -> Option<serde_json::Value> {
    let d = dir(&format!("heal-{strategy}-{}", envs.len()));
    let m = d.join("m.jsonl");
    let mut child = common::spawn(&heal_args(strategy, flags, ranks, &d), envs);
    let killed = Instant::now();
    if !envs.iter().any(|(k, _)| *k == "WIRETRAIN_TEST_DIE_AT") {
        common::wait_until(&mut child, Duration::from_secs(120), "20 steps", || {
            common::line_count(&m) >= 20
        });
        let victim = common::ckpt::node_or_skip(&mut child, 2)?;
        common::signal(victim, "-9");
    }
    let status = common::wait_exit_or(&mut child, Duration::from_secs(240), "the job hangs");
    let err = common::stderr_of(&mut child);
    assert!(status.success(), "the job heals and finishes: {err}");
    assert!(
        err.contains("elastic heal 1 of 1") && err.contains("on 2 node(s) without [2]"),
        "{err}"
    );
    assert!(err.contains("healed from live replicas"), "{err}");
    assert!(
        !err.contains("resumed from"),
        "no checkpoint is read: {err}"
    );
    assert!(
        killed.elapsed() <= Duration::from_secs(120),
        "healed in time"
    );

    // One metrics file: epoch 0's steps up to the failure, then the healed steps.
    let summary = common::jsonl(&m).into_iter().last().unwrap();
    assert_eq!(
        summary["world"],
        2 * ranks.parse::<u64>().unwrap(),
        "{summary}"
    );
    assert_eq!(summary["resumed_from"], 0, "{summary}");
    let el = &summary["elastic"];
    assert_eq!(el["epoch"], 1, "{summary}");
    assert_eq!(el["recovery"], "live", "{summary}");
    assert_eq!(el["restarts"][0]["recovery"], "live", "{summary}");
    let heal = &el["heals"][0];
    let (failed, from) = (
        heal["failed_step"].as_u64().unwrap() as usize,
        heal["went_on_from"].as_u64().unwrap() as usize,
    );
    assert!(from == failed || from == failed + 1, "{heal}");
    assert_eq!(el["steps_lost"], failed + 1 - from, "{summary}");
    assert!(el["steps_lost"].as_u64().unwrap() <= 1, "{summary}");
    if let Some(t) = transferred {
        assert_eq!(heal["state_transferred"], t, "{heal}");
    }
    let all = losses(&m);
    let steps: Vec<usize> = all.iter().map(|x| x.0).collect();
    // Every step before the failure, then every step from the heal on; the step cut off has
    // its line when the failure hit its checkpoint (applied and recorded), not when it hit
    // its update or loss.
    let expected: Vec<usize> = (0..failed).chain(from..300).collect();
    let recorded: Vec<usize> = (0..300).collect();
    assert!(
        steps == expected || (from == failed + 1 && steps == recorded),
        "steps up to the failure, then from the heal on: {steps:?} (failed {failed}, from {from})"
    );
    // From the failure this node saw to the first healed step (the target is 10 s).
    let took =
        heal["first_step_unix_ms"].as_u64().unwrap() - heal["detected_unix_ms"].as_u64().unwrap();
    let launcher = heal["first_step_unix_ms"].as_u64().unwrap()
        - el["restarts"][0]["detected_unix_ms"].as_u64().unwrap();
    eprintln!(
        "heal: {:.2} s from the node's failure to its first healed step ({:.2} s from the kill \
         seen by the launcher)",
        took as f64 / 1e3,
        launcher as f64 / 1e3
    );
    assert!(took <= 10_000, "{took} ms");

    // The traces of the healed ranks mark the heal.
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("trace/trace-rank0.json")).unwrap()).unwrap();
    assert_eq!(t["otherData"]["elastic"]["epoch"], 1);
    assert!(
        t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["cat"] == "elastic" && e["name"] == "elastic heal: epoch 1"),
        "no heal marker in the trace"
    );

    // The reference, independent of the healed run: the same job run through the same world
    // sizes without a failure, 3 nodes up to the step where the healed world took over, then
    // 2 nodes resumed from that run's own checkpoint. Not the healed run's checkpoints: when
    // the kill lands in a checkpoint write, the healed world writes the checkpoint of the step
    // it goes on from itself. When the healed world ran a DiLoCo outer step that no node
    // completed, no failure-free run holds its state (nodes 0 and 1 stepped on a 3-node share
    // of the data, then averaged alone): `inspect` checks the healed run's checkpoint of that
    // step against the survivors' states taken from the failure-free run, and the reference
    // resumes from it. Same losses, same parameters.
    let outer = heal["outer_step_ran"] == true;
    let switch = if outer { failed } else { from };
    let ck3 = uninterrupted(
        &d,
        (strategy, flags),
        ranks,
        switch,
        &all[..failed.min(switch)],
    );
    let ck_from = if outer {
        inspect(&d);
        d.join("ck")
    } else {
        ck3
    };
    let (m2, p2) = (d.join("m2.jsonl"), d.join("p2.bin"));
    let mut extra = vec!["--metrics", s(&m2), "--save-params", s(&p2)];
    extra.extend_from_slice(flags);
    common::ckpt::resume_copy(&d, &ck_from, from, ("2", ranks), strategy, &extra);
    let reference: Vec<(usize, f64)> = losses(&m2).into_iter().filter(|x| x.0 >= from).collect();
    let after = &all[all.len() - reference.len()..];
    assert_eq!(after.first().map(|x| x.0), Some(from));
    assert_eq!(reference.len(), 300 - from);
    common::ckpt::assert_same_losses(after, &reference);
    let (healed, resumed) = (floats(&d.join("p.bin")), floats(&p2));
    assert_eq!(healed.len(), resumed.len());
    let worst = healed
        .iter()
        .zip(&resumed)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "parameters differ by {worst}");
    if !outer {
        inspect(&d);
    }
    let _ = std::fs::remove_dir_all(&d);
    Some(heal.clone())
}

/// The same job as [`heal_args`] without a failure, on 3 nodes, for `steps` steps (a
/// checkpoint after each, in `d/ck-3`): its losses must equal the healed run's `before` (its
/// steps before the failure). Returns its checkpoint directory.
fn uninterrupted(
    d: &Path,
    (strategy, flags): (&str, &[&str]),
    ranks: &str,
    steps: usize,
    before: &[(usize, f64)],
) -> std::path::PathBuf {
    let (ck, m) = (d.join("ck-3"), d.join("m3.jsonl"));
    let n = steps.to_string();
    let mut a = vec![
        "launch",
        "--local",
        "3",
        "--ranks-per-node",
        ranks,
        "--",
        "train",
    ];
    a.extend(common::mlp(strategy, &n, BATCH, "5", "cpu"));
    a.extend_from_slice(flags);
    a.extend(["--checkpoint-every", "1", "--checkpoint-keep", "400"]);
    a.extend(["--checkpoint-dir", s(&ck), "--metrics", s(&m)]);
    let a: Vec<String> = a.into_iter().map(String::from).collect();
    common::ckpt::run_ok(&a);
    let three = losses(&m);
    assert_eq!(three.len(), steps);
    common::ckpt::assert_same_losses(before, &three[..before.len()]);
    ck
}

#[test]
fn a_killed_node_under_ddp_heals_from_live_replicas_with_no_checkpoint_read() {
    kill_and_heal(("ddp", &[]), "1", &[], None);
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn under_hybrid_a_survivor_whose_state_differs_receives_a_replicas_state_checked_by_digest() {
    kill_and_heal(
        ("hybrid", &[]),
        "2",
        &[("WIRETRAIN_TEST_HEAL_DIVERGE", "1")],
        Some(true),
    );
}

#[test]
fn under_hsdp_the_survivors_heal_their_shards_from_live_replicas() {
    kill_and_heal(("hsdp", &[]), "2", &[], None);
}

/// DiLoCo (4 inner steps a round, 2 ranks per node sharding inside it): the survivors keep
/// their own inner states and agree on the outer state; the 2-node resume takes nodes 0 and
/// 1's inner states from the checkpoint.
#[test]
fn under_diloco_the_survivors_go_on_with_their_inner_states_and_the_outer_state() {
    let f = [&DILOCO[..], &["--inner-strategy", "hybrid"]].concat();
    kill_and_heal(("diloco", &f), "2", &[], None);
}

const DILOCO: [&str; 4] = ["--inner-steps", "4", "--outer-momentum", "0.5"];

/// Node 2 dies at the start of step 23, the last inner step of round 6: the survivors'
/// outer step fails (nobody completed it), and the healed world runs it before going on: the
/// checkpoint of step 24 (written after the heal) holds one Nesterov step from step 23's
/// outer state, and both survivors' parameters are its anchor.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn under_diloco_the_outer_step_a_death_cut_off_runs_on_the_healed_world() {
    let envs = [("WIRETRAIN_TEST_DIE_AT", "2:23")];
    let heal = kill_heal_inspect(
        ("diloco", &DILOCO),
        "1",
        &envs,
        Some(false),
        &one_outer_step,
    )
    .unwrap();
    assert_eq!(heal["failed_step"], 23, "{heal}");
    assert_eq!(heal["went_on_from"], 24, "{heal}");
    assert_eq!(heal["outer_step_ran"], true, "{heal}");
}

/// The healed run's checkpoint of step 24 (written after the heal) against the survivors' own
/// states: nodes 0 and 1's parameters after step 23 come from the failure-free 3-node run
/// (its checkpoint of step 23, resumed on 3 nodes for one step with 5 inner steps a round, so
/// that step 23 ends no round and the checkpoint of step 24 holds each node's inner state).
/// With d the mean over nodes 0 and 1 of anchor - parameters: one outer step,
/// m' = mu m + d and a' = a - lr (d + mu m') (lr 0.7, mu 0.5), and both nodes at a'.
fn one_outer_step(d: &Path) {
    use wiretrain::checkpoint::Checkpoint;
    let probe = d.join("ck-probe");
    let name = "step-00000023";
    std::fs::create_dir_all(&probe).unwrap();
    let cp = std::process::Command::new("cp")
        .args(["-r", s(&d.join("ck-3").join(name)), s(&probe.join(name))])
        .status()
        .unwrap();
    assert!(cp.success());
    let mut a = vec!["launch", "--local", "3", "--", "train"];
    a.extend(common::mlp("diloco", "24", BATCH, "5", "cpu"));
    a.extend(["--inner-steps", "5", "--outer-momentum", "0.5"]);
    a.extend([
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        s(&probe),
        "--resume",
    ]);
    let a: Vec<String> = a.into_iter().map(String::from).collect();
    common::ckpt::run_ok(&a);
    let open = |dir: &Path| Checkpoint::open(&dir.join("step-00000024")).unwrap();
    let (states, after) = (open(&probe), open(&d.join("ck")));
    let o = states.read_outer().unwrap().unwrap();
    assert_eq!(o.inner_done, 24, "the probe ran step 23 and no outer step");
    let whole = 0..states.manifest.total;
    let all = std::slice::from_ref(&whole);
    let p0 = states.read_params().unwrap();
    let p1 = states.read_node(1, all).unwrap().params;
    let o2 = after.read_outer().unwrap().unwrap();
    assert_eq!(o2.inner_done, 24);
    assert_eq!(after.manifest.ranks_per_node.len(), 2, "written on 2 nodes");
    let (lr, mu) = (0.7f32, 0.5f32);
    let mut moved = 0.0f32;
    for i in 0..o.anchor.len() {
        let delta = ((o.anchor[i] - p0[i]) + (o.anchor[i] - p1[i])) / 2.0;
        let m = mu * o.momentum[i] + delta;
        let want = o.anchor[i] - lr * (delta + mu * m);
        for (what, got, want) in [
            ("anchor", o2.anchor[i], want),
            ("momentum", o2.momentum[i], m),
        ] {
            let err = (got - want).abs();
            assert!(
                err <= 1e-5 * want.abs().max(1.0),
                "{what} element {i}: {err}"
            );
        }
        moved = moved.max((o2.anchor[i] - o.anchor[i]).abs());
    }
    assert!(moved > 0.0, "the outer step moved the anchor");
    assert_eq!(
        after.read_params().unwrap(),
        o2.anchor,
        "node 0 at the anchor"
    );
    assert_eq!(
        after.read_node(1, all).unwrap().params,
        o2.anchor,
        "node 1 at the anchor"
    );
}

/// A cut link with every node alive (node 1 fails the job's connections at the start of step
/// 20: WIRETRAIN_TEST_CUT_AT): every node loses its job and none is lost, so all three heal in
/// place together in epoch 1, with no checkpoint read and at most one step lost.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs --features wiretrain/test-hooks"
)]
fn a_cut_link_with_every_node_alive_heals_all_of_them_in_place() {
    let d = dir("heal-cut");
    let m = d.join("m.jsonl");
    let args = heal_args("ddp", &[], "1", &d);
    let out = common::run(
        &args,
        &[("WIRETRAIN_TEST_CUT_AT", "1:20")],
        Duration::from_secs(240),
    );
    let err = common::text(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("elastic heal 1 of 1")
            && err.contains("on 3 node(s) without [] (every node lost its job and none was lost"),
        "{err}"
    );
    assert!(err.contains("healed from live replicas"), "{err}");
    assert!(
        !err.contains("resumed from"),
        "no checkpoint is read: {err}"
    );
    let summary = common::jsonl(&m).into_iter().last().unwrap();
    assert_eq!(summary["world"], 3, "{summary}");
    let el = &summary["elastic"];
    assert_eq!(el["recovery"], "live", "{summary}");
    assert!(el["steps_lost"].as_u64().unwrap() <= 1, "{summary}");
    let steps: Vec<usize> = losses(&m).iter().map(|x| x.0).collect();
    let from = el["heals"][0]["went_on_from"].as_u64().unwrap() as usize;
    assert!(from == 20 || from == 21, "{summary}");
    let tail: Vec<usize> = steps.iter().copied().filter(|&s| s >= from).collect();
    assert_eq!(tail, (from..300).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&d);
}
