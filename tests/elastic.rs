//! Elastic local launches through the real binary (Burn's CPU backend, real QUIC between node
//! processes): `launch --local 3 --nnodes 2:3 --max-restarts 1` goes on without a node killed
//! with -9, on the two survivors, from the newest checkpoint, and its loss curve after the
//! restart equals a manual `--resume` on two nodes from the same checkpoint; a launch that may
//! not lose the node fails naming it; the elastic flags are checked before anything starts.

mod common;

use common::ckpt::{BATCH, dir, losses, s};
use std::path::Path;
use std::time::{Duration, Instant};

/// `launch --local 3 <launch flags> -- train` of the mlp example (ZeRO-2, 300 steps, a
/// checkpoint every 10, all kept, a 3 s idle timeout) with `extra` train flags.
fn elastic_args(launch: &[&str], extra: &[&str]) -> Vec<String> {
    elastic_steps("300", launch, extra)
}

/// [`elastic_args`] with `steps` steps.
fn elastic_steps(steps: &str, launch: &[&str], extra: &[&str]) -> Vec<String> {
    let mut a = vec!["launch", "--local", "3"];
    a.extend_from_slice(launch);
    a.extend(["--", "train"]);
    a.extend(common::mlp("zero2", steps, BATCH, "5", "cpu"));
    a.extend(["--checkpoint-every", "10", "--checkpoint-keep", "100"]);
    a.extend(["--idle-timeout", "3"]);
    a.extend_from_slice(extra);
    a.into_iter().map(String::from).collect()
}

/// Starts `args`, waits for 20 metrics lines in `m`, kills node 2 with -9 and returns the
/// exit status, the stderr and when the kill was sent; `None` where /proc shows no children
/// (never under CI=true).
fn kill_node_2(args: &[String], m: &Path) -> Option<(std::process::ExitStatus, String, Instant)> {
    let mut child = common::spawn(args, &[]);
    common::wait_until(&mut child, Duration::from_secs(120), "20 steps", || {
        common::line_count(m) >= 20
    });
    let victim = common::ckpt::node_or_skip(&mut child, 2)?;
    let killed = Instant::now();
    common::signal(victim, "-9");
    let status = common::wait_exit_or(&mut child, Duration::from_secs(240), "the job hangs");
    Some((status, common::stderr_of(&mut child), killed))
}

#[test]
fn a_killed_node_restarts_the_job_on_the_survivors_from_the_last_checkpoint() {
    let d = dir("elastic");
    let (ck, m, tr) = (d.join("ck"), d.join("m.jsonl"), d.join("trace"));
    let args = elastic_args(
        &["--nnodes", "2:3", "--max-restarts", "1"],
        &[
            "--checkpoint-dir",
            s(&ck),
            "--metrics",
            s(&m),
            "--trace",
            s(&tr),
        ],
    );
    let Some((status, err, killed)) = kill_node_2(&args, &m) else {
        return;
    };
    assert!(status.success(), "the job goes on and finishes: {err}");
    assert!(
        err.contains("elastic restart 1 of 1") && err.contains("on 2 node(s) without [2]"),
        "{err}"
    );

    // The metrics go on in the same file: epoch 0's steps, then epoch 1's from the checkpoint.
    let summary = common::jsonl(&m).into_iter().last().unwrap();
    let start = summary["resumed_from"].as_u64().unwrap() as usize;
    assert!(
        start.is_multiple_of(10) && start >= 10,
        "resumed at a checkpoint: {start}"
    );
    let all = losses(&m);
    let (before, after) = all.split_at(all.len() - (300 - start));
    assert!(before.last().unwrap().0 + 1 >= start, "{before:?}");
    assert_eq!(
        after.iter().map(|x| x.0).collect::<Vec<_>>(),
        (start..300).collect::<Vec<_>>()
    );
    assert_eq!(summary["world"], 2, "{summary}");
    let el = &summary["elastic"];
    assert_eq!(el["epoch"], 1, "{summary}");
    let r = &el["restarts"][0];
    assert_eq!(r["left"], serde_json::json!([2]), "{summary}");
    assert_eq!(r["world"], 2, "{summary}");
    // The steps the failure cost: done in epoch 0 after the checkpoint, then again.
    assert_eq!(el["recovery"], "checkpoint", "{summary}");
    let lost = before.last().unwrap().0 + 1 - start;
    assert_eq!(el["steps_lost"], lost, "{summary}");
    // Failure detected (the idle timeout of 3 s) and the first step of the new epoch.
    let detected = r["detected_unix_ms"].as_u64().unwrap();
    let first = summary["first_step_unix_ms"].as_u64().unwrap();
    let restart_s = (first - detected) as f64 / 1e3;
    eprintln!("restart: {restart_s:.2} s from detection to the first step of epoch 1");
    assert!(restart_s <= 30.0, "{restart_s} s");
    assert!(
        killed.elapsed().as_secs_f64() <= 120.0,
        "the restarted job finishes in time"
    );

    // The new epoch's traces mark the restart.
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tr.join("trace-rank0.json")).unwrap()).unwrap();
    assert_eq!(t["otherData"]["elastic"]["epoch"], 1);
    assert!(
        t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["cat"] == "elastic" && e["name"] == "elastic restart: epoch 1"),
        "no restart marker in the trace"
    );

    // A manual resume on 2 nodes from that checkpoint follows the same curve.
    let m2 = d.join("m2.jsonl");
    common::ckpt::resume_copy(&d, &ck, start, ("2", "1"), "zero2", &["--metrics", s(&m2)]);
    common::ckpt::assert_same_losses(after, &losses(&m2));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_launch_that_may_not_lose_the_node_fails_naming_it() {
    let d = dir("elastic-min");
    let (ck, m) = (d.join("ck"), d.join("m.jsonl"));
    let args = elastic_args(
        &["--nnodes", "3:3", "--max-restarts", "2"],
        &["--checkpoint-dir", s(&ck), "--metrics", s(&m)],
    );
    let Some((status, err, _)) = kill_node_2(&args, &m) else {
        return;
    };
    assert!(!status.success(), "{err}");
    assert!(err.contains("node 2 exited with signal: 9"), "{err}");
    assert!(!err.contains("elastic restart"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Node 2 lost in epoch 0, then node 1 in epoch 1, with one restart allowed: the launch fails,
/// naming the last failure and the restart before it.
#[test]
fn exhausted_restarts_fail_with_their_history() {
    let d = dir("elastic-twice");
    let (ck, m) = (d.join("ck"), d.join("m.jsonl"));
    let args = elastic_steps(
        "5000",
        &["--nnodes", "1:3", "--max-restarts", "1"],
        &["--checkpoint-dir", s(&ck), "--metrics", s(&m)],
    );
    let mut child = common::spawn(&args, &[]);
    common::wait_until(&mut child, Duration::from_secs(120), "20 steps", || {
        common::line_count(&m) >= 20
    });
    let Some(victim) = common::ckpt::node_or_skip(&mut child, 2) else {
        return;
    };
    common::signal(victim, "-9");
    // Epoch 1 runs (its node 1 carries the new epoch) and has added steps to the metrics.
    let (launcher, mut second) = (child.id(), None);
    common::wait_until(&mut child, Duration::from_secs(60), "epoch 1", || {
        second = common::node_pid(launcher, 1).filter(|&p| common::of_epoch(p, 1));
        second.is_some()
    });
    let lines = common::line_count(&m);
    common::wait_until(
        &mut child,
        Duration::from_secs(60),
        "epoch 1's steps",
        || common::line_count(&m) >= lines + 20,
    );
    common::signal(second.unwrap(), "-9");
    let status = common::wait_exit_or(&mut child, Duration::from_secs(120), "the job hangs");
    let err = common::stderr_of(&mut child);
    assert!(!status.success(), "{err}");
    assert!(err.contains("elastic restart 1 of 1"), "{err}");
    assert!(
        err.contains("node 1 exited with signal: 9")
            && err.contains("after 1 restart(s): epoch 1 on 2 node(s) without [2]"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn elastic_flags_are_checked_before_anything_starts() {
    let train = ["--", "train", "--example", "mlp", "--steps", "3"];
    let with = |pre: &[&'static str]| -> Vec<&'static str> {
        let mut v = vec!["launch"];
        v.extend_from_slice(pre);
        v.extend(train);
        v
    };
    let (a, b, c, e) = (
        with(&["--local", "3", "--nnodes", "2:4"]),
        with(&["--local", "3", "--nnodes", "0:3"]),
        with(&["--local", "2", "--max-restarts", "1"]),
        with(&[
            "--nnodes",
            "2:3",
            "--node-rank",
            "0",
            "--master",
            "127.0.0.1:1",
        ]),
    );
    let f = with(&[
        "--max-restarts",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master",
        "127.0.0.1:1",
    ]);
    let m = "127.0.0.1:1";
    let (g, h, k) = (
        with(&["--nnodes", "2:3"]),
        with(&["--nnodes", "3:2", "--master", m]),
        with(&["--max-restarts", "1", "--master", m]),
    );
    let (l, n, o) = (
        with(&["--nnodes", "2:3", "--master", m, "--join-window", "1000"]),
        with(&["--nnodes", "2:3", "--master", m, "--max-restarts", "1"]),
        with(&["--local", "2", "--host", "127.0.0.1"]),
    );
    common::refused_each(&[
        (&a, "MIN:3"),
        (&b, "MIN:3"),
        (&c, "--checkpoint-dir"),
        (&e, "--node-rank: an elastic launch"),
        (&f, "--node-rank: an elastic launch"),
        (&g, "needs --master HOST:PORT"),
        (&h, "--nnodes 3:2: an elastic launch needs MIN:MAX"),
        (&k, "--nnodes (unset): an elastic launch needs MIN:MAX"),
        (&l, "--join-window: 1000 is outside"),
        (&n, "--checkpoint-dir"),
        (&o, "--host"),
    ]);
}

#[test]
fn the_documented_elastic_command_works_verbatim() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ELASTIC.md")).unwrap();
    let block = readme
        .split("## Elastic restarts")
        .nth(1)
        .and_then(|s| s.split("```sh").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("docs/ELASTIC.md has the elastic section with a command");
    let line = block.replace("\\\n", " ");
    let words: Vec<&str> = line.split('#').next().unwrap().split_whitespace().collect();
    assert_eq!(words[0], "wiretrain", "{block}");
    let d = dir("elastic-readme");
    let out = std::process::Command::new(common::bin())
        .args(&words[1..])
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
    assert!(d.join("ckpt-elastic").join("step-00000300").exists());
    let _ = std::fs::remove_dir_all(&d);
}
