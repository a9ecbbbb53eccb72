//! Whole runs through the binary, as a user starts them: the char-lm example learns on
//! 2 nodes x 2 ranks and leaves metrics and a PNG plot; a signal to the launcher, or to one
//! node only, stops every rank cleanly after the same step (exit 130, summary written).

mod common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::{signal, spawn, stderr_of};

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("run", name)
}

fn lines(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The acceptance run: 200 steps, 2 nodes x 2 ranks, ZeRO-2, final loss below
/// 0.8 x the initial loss. On the CPU backend (the lavapipe path of the same trainer is
/// covered by tests/train.rs; here the figure of merit is learning, not the device).
#[test]
fn char_lm_learns_on_two_nodes_and_plots() {
    let d = dir("char-lm");
    let m = d.join("m.jsonl");
    let out = common::run(
        &common::train_2x2(
            "char-lm",
            "zero2",
            "200",
            &["--device", "cpu", "--metrics", m.to_str().unwrap()],
        ),
        &[],
        Duration::from_secs(900),
    );
    assert!(out.status.success(), "{}", common::text(&out));
    let all = lines(&m);
    let steps: Vec<f64> = all
        .iter()
        .filter(|v| v.get("summary").is_none())
        .map(|v| v["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(steps.len(), 200);
    let first = steps[0];
    let last10 = steps[190..].iter().sum::<f64>() / 10.0;
    eprintln!(
        "char-lm loss {first:.4} -> {:.4} (last 10 mean {last10:.4})",
        steps[199]
    );
    assert!(
        steps[199] < 0.8 * first && last10 < 0.8 * first,
        "loss {first} -> {} (last 10 mean {last10})",
        steps[199]
    );
    let summary = all.last().unwrap();
    assert_eq!(summary["example"], "char-lm");
    assert_eq!(summary["world"], 4);
    assert_eq!(summary["stopped_early"], false);
    let png = std::fs::read(d.join("m.png")).expect("the plot next to the metrics");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let _ = std::fs::remove_dir_all(&d);
}

/// Starts the mlp example for ever (until a signal) on 2 nodes x 2 ranks, with metrics in a
/// fresh directory `name`, and waits for its first 5 steps: (directory, metrics, launcher).
fn launch_5_steps(name: &str) -> (PathBuf, PathBuf, Child) {
    let d = dir(name);
    let m = d.join("m.jsonl");
    let mut args = common::local_train("2", "2", &common::MLP_FOREVER);
    args.extend(["--metrics", m.to_str().unwrap()]);
    let mut child = spawn(&args, &[]);
    wait_for_steps(&mut child, &m, 5);
    (d, m, child)
}

fn wait_for_steps(child: &mut Child, m: &Path, n: usize) {
    common::wait_until(
        child,
        Duration::from_secs(120),
        &format!("{n} steps"),
        || lines(m).len() >= n,
    );
}

/// Waits (bounded) for the launcher and checks the clean stop: exit 130, a summary that says
/// so, a plot.
fn check_clean_stop(mut child: Child, m: &Path) {
    let status = common::wait_exit_or(
        &mut child,
        Duration::from_secs(60),
        "no clean stop within 60 s of the signal",
    );
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("stopped by a signal"), "{err}");
    let all = lines(m);
    let summary = all.last().unwrap();
    assert_eq!(summary["stopped_early"], true, "{summary}");
    let done = summary["steps_done"].as_u64().unwrap();
    assert_eq!(done as usize, all.len() - 1);
    // Every rank's own count: all stopped after the same step.
    let ranks = summary["memory_per_rank"].as_array().unwrap();
    assert_eq!(ranks.len(), 4, "{summary}");
    for r in ranks {
        assert_eq!(r["steps_done"].as_u64(), Some(done), "{r}");
    }
    assert!(m.with_extension("png").exists());
}

#[test]
fn ctrl_c_at_the_launcher_stops_every_rank_cleanly() {
    let (d, m, child) = launch_5_steps("sigint-launcher");
    signal(child.id(), "-INT");
    check_clean_stop(child, &m);
    let _ = std::fs::remove_dir_all(&d);
}

/// Like Ctrl-C on one machine of a multi-machine job: only node 1's process gets SIGINT; its
/// request travels with the step's loss reduction and every rank stops after the same step.
#[test]
fn a_signal_at_one_node_stops_the_whole_job() {
    let (d, m, mut child) = launch_5_steps("sigint-node");
    let children = format!("/proc/{0}/task/{0}/children", child.id());
    let Ok(pids) = std::fs::read_to_string(&children) else {
        let _ = child.kill();
        return common::skip_unless_ci(&format!("{children} is not readable on this system"));
    };
    let pids: Vec<u32> = pids
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "two node processes: {pids:?}");
    let node1 = pids
        .iter()
        .copied()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(14).any(|w| w == b"--node-rank\x001\x00"))
        })
        .expect("node 1 among the launcher's children");
    signal(node1, "-INT");
    check_clean_stop(child, &m);
    let _ = std::fs::remove_dir_all(&d);
}

/// A second signal more than 2 s after the first aborts at once (exit 130), even while the
/// clean stop is still busy: here its final checkpoint write stalls for 60 s.
#[cfg(unix)]
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the test hooks: --features wiretrain/test-hooks (scripts/test.sh)"
)]
fn a_second_signal_aborts_at_once() {
    let d = dir("second-sigint");
    let m = d.join("m.jsonl");
    let ck = d.join("ck");
    let (ms, cks) = (m.to_str().unwrap(), ck.to_str().unwrap());
    let mut args = vec!["train", "--example", "mlp", "--steps", "1000000"];
    args.extend(["--device", "cpu", "--no-progress", "--metrics", ms]);
    args.extend(["--checkpoint-every", "1000000", "--checkpoint-dir", cks]);
    let mut child = spawn(&args, &[("WIRETRAIN_TEST_STALL_CHECKPOINT", "0:60000")]);
    wait_for_steps(&mut child, &m, 5);
    signal(child.id(), "-INT");
    // The clean stop begins: its checkpoint stalls. A second signal within 2 s counts as the
    // same keypress; one after 2.5 s aborts.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "still stopping cleanly"
    );
    let second = Instant::now();
    signal(child.id(), "-INT");
    let status = common::wait_exit_or(
        &mut child,
        Duration::from_secs(20),
        "the second signal did not abort the run",
    );
    let took = second.elapsed();
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(
        took < Duration::from_secs(2),
        "aborted {took:?} after the second signal"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A shell without `XDG_RUNTIME_DIR` (ssh, cron, Slurm) gets no message from the graphics
/// stack, and logs written to a pipe carry no colour codes.
#[test]
fn a_plain_shell_gets_no_graphics_noise_and_piped_logs_no_colour() {
    let out = std::process::Command::new(common::bin())
        .args([
            "train",
            "--example",
            "mlp",
            "--steps",
            "2",
            "--device",
            "wgpu:cpu",
        ])
        .env_remove("XDG_RUNTIME_DIR")
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("XDG_RUNTIME_DIR"), "graphics noise: {err}");
    assert!(err.contains("INFO"), "the log reaches the pipe: {err}");
    assert!(
        !err.contains('\u{1b}'),
        "colour codes in a piped log: {err:?}"
    );
}
