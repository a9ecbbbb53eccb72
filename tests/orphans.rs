//! No orphans (issue 42, item 3): after `kill -9` of a launcher — `launch --local 2` or a
//! per-machine `launch` (one node, with and without --master) — every node process it
//! started exits within 10 s (Linux: the parent-death signal), instead of training on beside
//! a relaunch.

mod common;

use std::time::{Duration, Instant};

/// The processes `pid` started (Linux /proc), `None` where /proc does not show them.
fn children(pid: u32) -> Option<Vec<u32>> {
    let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    Some(
        kids.split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect(),
    )
}

/// Whether `pid` still runs: a zombie (exited, not yet reaped by its new parent) does not.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        let state = s.rsplit(") ").next().and_then(|r| r.chars().next());
        !matches!(state, Some('Z' | 'X') | None)
    })
}

/// Starts `wiretrain args...`, waits for its `nodes` node processes, kills it with SIGKILL,
/// and asserts that every node exits within 10 s.
fn no_node_outlives(what: &str, args: &[&str], nodes: usize) {
    let mut launcher = common::spawn(args, &[]);
    let t0 = Instant::now();
    let mut kids = Vec::new();
    while kids.len() < nodes {
        let Some(k) = children(launcher.id()) else {
            let _ = launcher.kill();
            let _ = launcher.wait();
            return common::skip_unless_ci("/proc does not show a process's children here");
        };
        kids = k;
        assert!(
            launcher.try_wait().unwrap().is_none(),
            "{what}: the launch ended early: {}",
            common::stderr_of(&mut launcher)
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what}: {nodes} node(s) not started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The nodes train (past their start-up) before the launcher is killed.
    std::thread::sleep(Duration::from_secs(2));
    common::signal(launcher.id(), "-9");
    let _ = launcher.wait();
    let killed = Instant::now();
    while kids.iter().any(|&k| running(k)) {
        if killed.elapsed() > Duration::from_secs(10) {
            for &k in &kids {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &k.to_string()])
                    .status();
            }
            panic!("{what}: node(s) {kids:?} still ran 10 s after kill -9 of their launcher");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "{what}: every node exited {:?} after kill -9 of the launcher",
        killed.elapsed()
    );
}

#[test]
fn killing_a_launcher_kills_its_nodes() {
    if !cfg!(target_os = "linux") {
        return common::skip_unless_ci("the parent-death signal is Linux's");
    }
    let mut local = common::local_nodes("2", &["train"]);
    local.extend(common::MLP_FOREVER);
    no_node_outlives("launch --local 2", &local, 2);
    let mut alone = vec!["launch", "--"];
    alone.extend(["train"].iter().chain(common::MLP_FOREVER.iter()));
    no_node_outlives("launch (one machine)", &alone, 1);
    let mut given = vec!["launch", "--nnodes", "1", "--node-rank", "0"];
    given.extend(["--master", "127.0.0.1:0", "--", "train"]);
    given.extend(common::MLP_FOREVER);
    no_node_outlives("launch --master (per machine)", &given, 1);
}
