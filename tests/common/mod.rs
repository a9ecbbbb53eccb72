//! Helpers for the multi-process tests: run the real `wiretrain` binary with a time limit.

#![allow(dead_code)]

pub mod ckpt;

use std::ffi::OsStr;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_wiretrain")
}

/// A fresh, empty directory `wiretrain-<prefix>-<pid>-<name>` under the system's temp dir.
pub fn fresh_dir(prefix: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wiretrain-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `wiretrain args...` and kills it after `limit` (a hang fails the test, never blocks).
pub fn run<S: AsRef<OsStr> + Debug>(args: &[S], envs: &[(&str, &str)], limit: Duration) -> Output {
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

/// Runs `wiretrain args...` (bounded by `limit`), which must succeed and print `n` JSON rows
/// (`bench --json`, `plan --json`): the rows.
pub fn json_rows(args: &[&str], limit: Duration, n: usize) -> Vec<serde_json::Value> {
    let out = run(args, &[], limit);
    assert!(out.status.success(), "{}", text(&out));
    let rows = rows(&out);
    assert_eq!(rows.len(), n, "{}", text(&out));
    rows
}

/// The words of `s`: a command line of fixed flags, written as one string.
pub fn words(s: &str) -> Vec<&str> {
    s.split_whitespace().collect()
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
pub fn train_metrics<S: AsRef<OsStr>>(
    name: &str,
    args: &[S],
    envs: &[(&str, &str)],
    limit: Duration,
) -> Vec<serde_json::Value> {
    let d = fresh_dir("m", name);
    let m = d.join("m.jsonl");
    let mut all: Vec<&OsStr> = args.iter().map(AsRef::as_ref).collect();
    all.extend([OsStr::new("--metrics"), m.as_os_str()]);
    let out = run(&all, envs, limit);
    assert!(out.status.success(), "{name}: {}", text(&out));
    let v = jsonl(&m);
    let _ = std::fs::remove_dir_all(&d);
    v
}

/// The JSON lines of a metrics file, every one of which must parse.
pub fn jsonl(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line is JSON"))
        .collect()
}

/// The per-step losses of a metrics file (the summary line has no `step`).
pub fn step_losses(m: &Path) -> Vec<f64> {
    jsonl(m)
        .iter()
        .filter(|v| v.get("step").is_some())
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

/// The little-endian f32 values of a `--save-params` file.
pub fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The worst relative difference of `got` from `want`, element by element (over the shorter of
/// the two), relative to `|want|` but at least `floor`.
pub fn worst_rel(got: &[f64], want: &[f64], floor: f64) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (w - g).abs() / w.abs().max(floor))
        .fold(0.0, f64::max)
}

/// Runs `wiretrain args...`, asserts it was refused as bad input (exit status 2), and returns
/// its stderr.
pub fn refused<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    refused_env(args, &[])
}

/// Each `(args, needle)` is refused ([`refused`]: exit 2) with one line that contains `needle`.
pub fn refused_each(cases: &[(&[&str], &str)]) {
    for (args, needle) in cases {
        let err = refused(args);
        assert!(
            err.contains(needle) && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
    }
}

/// [`refused`] with extra environment variables.
pub fn refused_env<S: AsRef<OsStr> + Debug>(args: &[S], envs: &[(&str, &str)]) -> String {
    refused_within(args, envs, Duration::from_secs(60))
}

/// [`refused_env`] that must be refused within `limit`.
pub fn refused_within<S: AsRef<OsStr> + Debug>(
    args: &[S],
    envs: &[(&str, &str)],
    limit: Duration,
) -> String {
    let out = run(args, envs, limit);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub mod skip;
pub(crate) use skip::skip_unless_ci;

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

/// Whether process `pid` runs with `WIRETRAIN_EPOCH=<epoch>` (a node of that elastic epoch).
pub fn of_epoch(pid: u32, epoch: usize) -> bool {
    let want = format!("WIRETRAIN_EPOCH={epoch}\0");
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|e| e.windows(want.len()).any(|w| w == want.as_bytes()))
}

/// Waits (bounded) for a child to exit; a hang kills it and fails the test.
pub fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    wait_exit_or(
        child,
        limit,
        &format!("the process did not exit within {limit:?}"),
    )
}

/// [`wait_exit`] that fails with `why` on a hang.
pub fn wait_exit_or(child: &mut Child, limit: Duration, why: &str) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("{why}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `wiretrain args...` with `envs`, stdout discarded and stderr piped, for a test that
/// watches, signals or kills it while it runs.
pub fn spawn<S: AsRef<OsStr>>(args: &[S], envs: &[(&str, &str)]) -> Child {
    spawn_with(args, envs, Stdio::null())
}

/// [`spawn`] with `stdout` given.
pub fn spawn_with<S: AsRef<OsStr>>(args: &[S], envs: &[(&str, &str)], stdout: Stdio) -> Child {
    Command::new(bin())
        .args(args)
        .envs(envs.iter().copied())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn wiretrain")
}

/// Polls (bounded) until `done` holds while `child` runs: the child exiting first, or `limit`
/// passing, kills it and fails the test, naming `what` was awaited.
pub fn wait_until(child: &mut Child, limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended early, before {what}"
        );
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("no {what} within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The number of lines in the file at `p` (0 while it does not exist).
pub fn line_count(p: &Path) -> usize {
    std::fs::read_to_string(p).map_or(0, |s| s.lines().count())
}

/// Sends `sig` (`-INT`, `-9`, ...) to process `pid` with kill(1), which must succeed.
pub fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill(1)");
    assert!(st.success(), "kill {sig} {pid}");
}

/// All of a child's piped stderr (read to its end: call it once the child has exited).
pub fn stderr_of(child: &mut Child) -> String {
    use std::io::Read;
    let mut s = String::new();
    child
        .stderr
        .take()
        .expect("stderr is piped")
        .read_to_string(&mut s)
        .unwrap();
    s
}

/// `launch --local <nodes> --ranks-per-node <ranks> -- <command...>`: a job of local node
/// processes on 127.0.0.x, each running `command`.
pub fn local<'a>(nodes: &'a str, ranks: &'a str, command: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["launch", "--local", nodes, "--ranks-per-node", ranks, "--"];
    v.extend_from_slice(command);
    v
}

/// `launch --local <nodes> -- <command...>`: [`local`] with the default ranks per node.
pub fn local_nodes<'a>(nodes: &'a str, command: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["launch", "--local", nodes, "--"];
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

/// `--example mlp --strategy S --steps N --global-batch B --lr 0.01 --seed SEED --device D
/// --bucket-bytes 4096`: the mlp example as the trainer and checkpoint tests train it.
pub fn mlp<'a>(
    strategy: &'a str,
    steps: &'a str,
    batch: &'a str,
    seed: &'a str,
    device: &'a str,
) -> Vec<&'a str> {
    let mut v = vec!["--example", "mlp", "--strategy", strategy, "--steps", steps];
    v.extend(["--global-batch", batch, "--lr", "0.01", "--seed", seed]);
    v.extend(["--device", device, "--bucket-bytes", "4096"]);
    v
}

/// The mlp example for ever (until a signal or a fault), with the CPU backend.
pub const MLP_FOREVER: [&str; 6] = [
    "--example",
    "mlp",
    "--steps",
    "100000000",
    "--device",
    "cpu",
];

/// `local_train` on 2 nodes x 2 ranks of `--example E --strategy S --steps N <rest...>`.
pub fn train_2x2<'a>(
    example: &'a str,
    strategy: &'a str,
    steps: &'a str,
    rest: &[&'a str],
) -> Vec<&'a str> {
    let mut v = local_train(
        "2",
        "2",
        &[
            "--example",
            example,
            "--strategy",
            strategy,
            "--steps",
            steps,
        ],
    );
    v.extend_from_slice(rest);
    v
}
