//! Bad input and failures between real node processes: a wrong token, a protocol version
//! mismatch, a node that never arrives, and a peer killed mid-collective. Each must end in a
//! clear error naming the cause, never a hang (every run here is bounded).

mod common;

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A job token that passes the strength check.
const TOK: &str = "faults-0123456789abcdef0123456789abcdef";

fn tmp(name: &str) -> PathBuf {
    common::fresh_dir("faults", name)
}

fn spawn(args: &[&str], token: &str) -> Child {
    spawn_env(args, &[("WIRETRAIN_TOKEN", token)])
}

fn spawn_env(args: &[&str], envs: &[(&str, &str)]) -> Child {
    common::spawn_with(args, envs, Stdio::piped())
}

/// Starts node 0 of a 2-node bench and returns it with its address.
fn node0(dir: &std::path::Path, token: &str, extra: &[&str]) -> (Child, String) {
    node0_env(dir, &[("WIRETRAIN_TOKEN", token)], extra)
}

/// `bench --nnodes 2 --node-rank <rank> --master <master>`: one node of a 2-node bench.
fn bench_node<'a>(rank: &'a str, master: &'a str) -> Vec<&'a str> {
    vec![
        "bench",
        "--nnodes",
        "2",
        "--node-rank",
        rank,
        "--master",
        master,
    ]
}

fn node0_env(dir: &std::path::Path, envs: &[(&str, &str)], extra: &[&str]) -> (Child, String) {
    let addr_file = dir.join("addr");
    let mut args = bench_node("0", "127.0.0.1:0");
    args.extend(["--addr-file", addr_file.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let mut child = spawn_env(&args, envs);
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(&addr_file) {
            return (child, s.trim().to_string());
        }
        assert!(child.try_wait().unwrap().is_none(), "node 0 exited early");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "node 0 never listened"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Starts node 1 of a 2-node bench against node 0 at `addr`.
fn node1(addr: &str, token: &str, extra: &[&str]) -> Child {
    node1_env(addr, &[("WIRETRAIN_TOKEN", token)], extra)
}

fn node1_env(addr: &str, envs: &[(&str, &str)], extra: &[&str]) -> Child {
    let mut args = bench_node("1", addr);
    args.extend_from_slice(extra);
    spawn_env(&args, envs)
}

/// Waits for a child with a limit; returns (success, stderr, elapsed).
fn finish(mut c: Child, limit: Duration) -> (bool, String, Duration) {
    let t0 = Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            let out = c.wait_with_output().unwrap();
            return (
                out.status.success(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
                t0.elapsed(),
            );
        }
        if t0.elapsed() > limit {
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            panic!(
                "process hung past {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One all-reduce of 4 bytes.
const TINY: [&str; 6] = ["--op", "all-reduce", "--bytes", "4", "--iters", "1"];

/// [`TINY`], with a rendezvous that gives up after 4 s.
const QUICK: [&str; 8] = [
    TINY[0],
    TINY[1],
    TINY[2],
    TINY[3],
    TINY[4],
    TINY[5],
    "--rendezvous-timeout",
    "4",
];

#[test]
fn wrong_token_is_refused_and_the_missing_node_is_named() {
    let d = tmp("token");
    let (n0, addr) = node0(&d, "token-A-0123456789abcdef0123456789abcdef", &QUICK);
    let n1 = node1(&addr, "token-B-0123456789abcdef0123456789abcdef", &QUICK);
    let (ok1, err1, _) = finish(n1, Duration::from_secs(30));
    assert!(!ok1);
    assert!(
        err1.contains("different job token"),
        "node 1 stderr: {err1}"
    );
    let (ok0, err0, _) = finish(n0, Duration::from_secs(30));
    assert!(!ok0);
    assert!(
        err0.contains("rendezvous timed out"),
        "node 0 stderr: {err0}"
    );
    assert!(err0.contains("never seen: [1]"), "node 0 stderr: {err0}");
}

/// Two bench nodes with one token and these extra variables each: (ok, stderr) of node 0 and
/// of node 1.
fn pair(name: &str, env0: (&str, &str), env1: (&str, &str)) -> ((bool, String), (bool, String)) {
    let d = tmp(name);
    let (n0, addr) = node0_env(&d, &[("WIRETRAIN_TOKEN", TOK), env0], &QUICK);
    let n1 = node1_env(&addr, &[("WIRETRAIN_TOKEN", TOK), env1], &QUICK);
    let (ok1, err1, _) = finish(n1, Duration::from_secs(30));
    let (ok0, err0, _) = finish(n0, Duration::from_secs(30));
    ((ok0, err0), (ok1, err1))
}

/// The same token but another job id (`WIRETRAIN_JOB_ID`, else Slurm's job id): a process of
/// an earlier job that used the token is refused like a stranger.
#[test]
fn another_job_with_the_same_token_is_refused() {
    let job = "WIRETRAIN_JOB_ID";
    let ((ok0, err0), (ok1, err1)) = pair("job-id", (job, "job-7"), (job, "job-6"));
    assert!(!ok0 && !ok1, "{err0}\n{err1}");
    assert!(
        err1.contains("different job token or job id"),
        "node 1 stderr: {err1}"
    );
    // The same job id on both: they form the job.
    let slurm = "SLURM_JOB_ID";
    let ((ok0, err0), (ok1, err1)) = pair("job-id-same", (slurm, "4242"), (slurm, "4242"));
    assert!(ok0 && ok1, "{err0}\n{err1}");
}

/// A process of an earlier epoch of an elastic job (the same token and job id, an older
/// `WIRETRAIN_EPOCH`, as a survivor of the epoch before a restart would have) is refused at
/// rendezvous, with a message that says so.
#[test]
fn a_stale_process_of_an_earlier_epoch_is_refused() {
    let e = "WIRETRAIN_EPOCH";
    let ((ok0, err0), (ok1, err1)) = pair("epoch", (e, "2"), (e, "1"));
    assert!(!ok0 && !ok1, "{err0}\n{err1}");
    assert!(
        err1.contains("job epoch mismatch: this node is of epoch 1, the job is at epoch 2")
            && err1.contains("stale process of an earlier epoch"),
        "node 1 stderr: {err1}"
    );
}

#[test]
fn protocol_version_mismatch_is_refused() {
    let d = tmp("version");
    let (n0, addr) = node0(&d, TOK, &QUICK);
    let mut extra = vec!["--protocol-version-override", "99"];
    extra.extend_from_slice(&QUICK);
    let (ok1, err1, _) = finish(node1(&addr, TOK, &extra), Duration::from_secs(30));
    assert!(!ok1);
    assert!(
        err1.contains("protocol version mismatch"),
        "node 1 stderr: {err1}"
    );
    assert!(err1.contains("version 99"), "node 1 stderr: {err1}");
    // The coordinator's side says it too, with the address it refused.
    let (ok0, err0, _) = finish(n0, Duration::from_secs(30));
    assert!(!ok0);
    assert!(
        err0.contains("refused a node: protocol version mismatch") && err0.contains("version 99"),
        "node 0 stderr: {err0}"
    );
    assert!(
        err0.contains("127.0.0.1:"),
        "node 0 names the address: {err0}"
    );
}

#[test]
fn unreachable_coordinator_is_a_clear_error() {
    // Nothing listens on this loopback port (we bind it for UDP and keep it, so no one can).
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = sock.local_addr().unwrap().to_string();
    let mut args = bench_node("1", &addr);
    args.extend(["--rendezvous-timeout", "2"]);
    let (ok, err, took) = finish(spawn(&args, TOK), Duration::from_secs(30));
    assert!(!ok);
    assert!(err.contains("could not reach the coordinator"), "{err}");
    assert!(took < Duration::from_secs(15));
}

#[test]
fn killed_peer_is_named_within_the_timeout() {
    let d = tmp("kill");
    let long = [
        "--op",
        "all-reduce",
        "--bytes",
        "16M",
        "--iters",
        "100000",
        "--warmup",
        "0",
        "--idle-timeout",
        "3",
        "--collective-timeout",
        "60",
    ];
    let (n0, addr) = node0(&d, TOK, &long);
    let mut n1 = node1(&addr, TOK, &long);
    // Let a few collectives run, then kill node 1 without warning.
    std::thread::sleep(Duration::from_secs(3));
    assert!(n1.try_wait().unwrap().is_none(), "node 1 ended early");
    n1.kill().unwrap();
    let _ = n1.wait();
    let pid0 = n0.id();
    let (ok0, err0, took) = finish(n0, Duration::from_secs(60));
    assert!(!ok0, "node 0 must fail");
    // The flight recorder of rank 0 shows its last collectives, the failed one last.
    // Its file is named in the log, in a private directory of the process.
    let flight = err0
        .split("written to ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("the log names the flight recorder file: {err0}"));
    assert!(
        flight.ends_with(format!("wiretrain-flight-{pid0}-rank0.json")),
        "{flight:?}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::fs::metadata(flight.parent().unwrap()).unwrap();
        assert_eq!(dir.permissions().mode() & 0o777, 0o700, "{flight:?}");
    }
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&flight).expect("flight recorder dump")).unwrap();
    let last = rec["collectives"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    // The bench loop runs all_reduce, all_gather and barrier: the kill lands in one of them.
    let op = last["op"].as_str().unwrap();
    assert!(
        ["all_reduce", "all_gather", "barrier"].contains(&op),
        "{rec}"
    );
    assert!(last["state"].as_str().unwrap().contains("node 1"), "{rec}");
    assert!(
        err0.contains(&format!("{op} seq {}", last["seq"])),
        "the error names the collective the recorder shows: {err0}"
    );
    let all = rec["collectives"].as_array().unwrap();
    assert!(
        all[..all.len() - 1].iter().all(|e| e["state"] == "ok"),
        "{rec}"
    );
    assert!(
        err0.contains(flight.to_str().unwrap()),
        "the log names the dump: {err0}"
    );
    let _ = std::fs::remove_file(&flight);
    let _ = std::fs::remove_dir(flight.parent().unwrap());
    assert!(took < Duration::from_secs(20), "took {took:?}: {err0}");
    assert!(
        err0.contains("node 1"),
        "error must name the dead node: {err0}"
    );
    assert!(
        err0.contains(" seq "),
        "error must name the collective: {err0}"
    );
}

#[test]
fn bad_flags_exit_with_code_2() {
    for args in [
        &["bench", "--bytes", "7"][..],
        &["bench", "--op", "all-shuffle"],
        &["bench", "--nnodes", "2"],
        &["bench", "--reduce", "max"],
    ] {
        let err = common::refused(args);
        assert_eq!(err.trim().lines().count(), 1, "one clear line: {err}");
    }
}

#[test]
fn a_weak_token_is_refused_before_anything_listens() {
    for weak in ["hunter2", "0123456789abcdef", &"7".repeat(64)] {
        let args = [&["bench"][..], &TINY, &bench_node("0", "127.0.0.1:0")[1..]].concat();
        let err =
            common::refused_within(&args, &[("WIRETRAIN_TOKEN", weak)], Duration::from_secs(30));
        assert!(err.contains("at least 128 bits"), "{err}");
        assert!(err.contains("openssl rand -hex 32"), "{err}");
        assert!(!err.contains(weak), "the token is never printed: {err}");
    }
}

/// (Unix: the warning is about permission bits.)
#[cfg(unix)]
#[test]
fn token_file_and_environment_never_silently_disagree() {
    use std::os::unix::fs::PermissionsExt;
    let d = tmp("token-file");
    let f = d.join("token");
    std::fs::write(&f, format!("{TOK}\n")).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let fs = f.to_str().unwrap();
    let args = [&["bench"][..], &TINY, &["--token-file", fs][..]].concat();
    // Two different secrets: refused, naming both sources.
    let other = "another-0123456789abcdef0123456789abcdef";
    let err = common::refused_env(&args, &[("WIRETRAIN_TOKEN", other)]);
    assert!(
        err.contains("WIRETRAIN_TOKEN") && err.contains("--token-file"),
        "{err}"
    );
    assert!(
        !err.contains(other) && !err.contains(TOK),
        "no token is printed: {err}"
    );
    // The same secret both ways runs; a file others can read is warned about.
    let out = common::run(&args, &[("WIRETRAIN_TOKEN", TOK)], Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", common::text(&out));
    assert!(err.contains("readable by other users"), "{err}");
    // Mode 600: no warning.
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = common::run(&args, &[], Duration::from_secs(60));
    assert!(out.status.success(), "{}", common::text(&out));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("readable by other users"));
    let _ = std::fs::remove_dir_all(&d);
}
