//! Helpers for the multi-process tests: run the real `wiretrain` binary with a time limit.

#![allow(dead_code)]

pub mod ckpt;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_wiretrain")
}

/// Runs `wiretrain args...` and kills it after `limit` (a hang fails the test, never blocks).
pub fn run(args: &[&str], envs: &[(&str, &str)], limit: Duration) -> Output {
    let mut c = Command::new(bin());
    c.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("XDG_RUNTIME_DIR", std::env::temp_dir());
    for (k, v) in envs {
        c.env(k, v);
    }
    let mut child = c.spawn().expect("spawn wiretrain");
    let t0 = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "wiretrain {args:?} exceeded {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Parses the JSON rows a `bench --json` run printed.
pub fn rows(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("valid JSON row"))
        .collect()
}

pub fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `wiretrain args... --metrics FILE` (a `train`, directly or under `launch`) in a fresh
/// temporary directory, asserts it succeeded, and returns the metrics lines (steps, then the
/// summary).
pub fn train_metrics(
    name: &str,
    args: &[&str],
    envs: &[(&str, &str)],
    limit: Duration,
) -> Vec<serde_json::Value> {
    let d = std::env::temp_dir().join(format!("wiretrain-m-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let m = d.join("m.jsonl");
    let ms = m.to_str().unwrap().to_string();
    let mut all = args.to_vec();
    all.extend(["--metrics", &ms]);
    let out = run(&all, envs, limit);
    assert!(out.status.success(), "{name}: {}", text(&out));
    let v = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line is JSON"))
        .collect();
    let _ = std::fs::remove_dir_all(&d);
    v
}

/// Runs `wiretrain args...`, asserts it was refused as bad input (exit status 2), and returns
/// its stderr.
pub fn refused(args: &[&str]) -> String {
    refused_env(args, &[])
}

/// [`refused`] with extra environment variables.
pub fn refused_env(args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = run(args, envs, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// An example binary `cargo test` builds next to the test binaries.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap()
        .join("examples")
        .join(name);
    assert!(p.exists(), "{} is built by `cargo test`", p.display());
    p
}

/// The node process of `launcher` that is node `n` of its job: by its `--node-rank` flag
/// (this binary's subcommands) or its `WIRETRAIN_NODE_RANK` variable (any program).
pub fn node_pid(launcher: u32, n: usize) -> Option<u32> {
    let kids =
        std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children")).ok()?;
    let flag = format!("--node-rank\0{n}\0");
    let var = format!("WIRETRAIN_NODE_RANK={n}\0");
    let has = |file: String, pat: &str| {
        std::fs::read(file).is_ok_and(|c| c.windows(pat.len()).any(|w| w == pat.as_bytes()))
    };
    kids.split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| {
            has(format!("/proc/{p}/cmdline"), &flag) || has(format!("/proc/{p}/environ"), &var)
        })
}

/// Waits (bounded) for a child to exit; a hang kills it and fails the test.
pub fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("the process did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `launch --local <nodes> --ranks-per-node <ranks> -- <command...>`: a job of local node
/// processes on 127.0.0.x, each running `command`.
pub fn local<'a>(nodes: &'a str, ranks: &'a str, command: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["launch", "--local", nodes, "--ranks-per-node", ranks, "--"];
    v.extend_from_slice(command);
    v
}

/// `launch --local <nodes> --ranks-per-node <ranks> -- train <rest...>`: a training job of
/// local node processes.
pub fn local_train<'a>(nodes: &'a str, ranks: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    let mut v = local(nodes, ranks, &["train"]);
    v.extend_from_slice(rest);
    v
}
