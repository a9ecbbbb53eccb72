//! `wiretrain launch` of a program that is not wiretrain: the `run-loop` example (its own model,
//! `wiretrain::run` and the library loop) as real node processes over QUIC on loopback. It
//! trains 2 nodes x 2 ranks to the same per-step loss as one rank; a panicking rank or a
//! `kill -9` of a node fails every node quickly, naming the cause; the token never shows in a
//! process's arguments; bad input is one clear line and exit 2.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("launch", name)
}

fn losses(m: &Path) -> (Vec<f64>, serde_json::Value) {
    let all = common::jsonl(m);
    let (summary, steps) = all.split_last().unwrap();
    (
        steps.iter().map(|v| v["loss"].as_f64().unwrap()).collect(),
        summary.clone(),
    )
}

fn launch_loop(nodes: &str, ranks: &str, extra: &[&str], m: &Path) -> std::process::Output {
    let ex = common::example("run-loop");
    let mut args = common::local(
        nodes,
        ranks,
        &[
            ex.to_str().unwrap(),
            "--device",
            "cpu",
            "--metrics",
            m.to_str().unwrap(),
        ],
    );
    args.extend(extra);
    common::run(&args, &[], Duration::from_secs(300))
}

#[test]
fn a_user_program_trains_on_two_nodes_like_one_rank() {
    let d = dir("equal");
    let (m1, m4) = (d.join("one.jsonl"), d.join("four.jsonl"));
    let out = launch_loop("1", "1", &["--steps", "25"], &m1);
    assert!(out.status.success(), "{}", common::text(&out));
    for strategy in ["ddp", "zero2"] {
        let out = launch_loop("2", "2", &["--steps", "25", "--strategy", strategy], &m4);
        assert!(out.status.success(), "{}", common::text(&out));
        let (one, _) = losses(&m1);
        let (four, summary) = losses(&m4);
        assert_eq!(summary["world"], 4, "{summary}");
        assert_eq!(summary["example"], "run-loop", "{summary}");
        assert_eq!(summary["devices"].as_array().unwrap().len(), 4, "{summary}");
        assert_eq!(one.len(), 25);
        let worst = common::worst_rel(&four, &one, 1e-3);
        eprintln!("{strategy}: 2x2 vs 1 rank, worst relative loss difference {worst:e}");
        assert!(worst <= 1e-5, "{strategy}: {one:?} vs {four:?}");
        assert!(four[24] < 0.7 * four[0], "learns: {four:?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Runs `launch --local 2 --ranks-per-node 2 <flags...> -- <run-loop> --device cpu --steps
/// 1000000 <extra...>` with stderr read line by line as it arrives: (line, when) pairs.
fn spawn_timed(
    flags: &[&str],
    extra: &[&str],
) -> (std::process::Child, mpsc::Receiver<(String, Instant)>) {
    let ex = common::example("run-loop");
    let mut args = vec!["launch", "--local", "2", "--ranks-per-node", "2"];
    args.extend_from_slice(flags);
    args.extend([
        "--",
        ex.to_str().unwrap(),
        "--device",
        "cpu",
        "--steps",
        "1000000",
    ]);
    args.extend_from_slice(extra);
    // RUST_BACKTRACE=1, as many users run: the panicking process spends seconds printing its
    // backtrace, which must not delay its peers' failure.
    let mut child = common::spawn(
        &args,
        &[
            ("WIRETRAIN_TOKEN", "0123456789abcdef-a-secret-test-token"),
            ("RUST_BACKTRACE", "1"),
        ],
    );
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send((l, Instant::now()));
        }
    });
    (child, rx)
}

#[test]
fn a_panicking_rank_fails_every_node_within_5_s_with_its_message() {
    let (mut child, rx) = spawn_timed(&[], &["--panic-at", "3:20"]);
    let st = common::wait_exit(&mut child, Duration::from_secs(120));
    let exited = Instant::now();
    let lines: Vec<(String, Instant)> = rx.iter().collect();
    let text: String = lines.iter().map(|(l, _)| format!("{l}\n")).collect();
    assert!(!st.success(), "{text}");
    let panicked = lines
        .iter()
        .find(|(l, _)| l.contains("panicked at"))
        .unwrap_or_else(|| panic!("no panic printed:\n{text}"))
        .1;
    // Node 0 (ranks 0-1) fails with rank 3's message: its error line, timed from the panic.
    let peer = lines
        .iter()
        .find(|(l, _)| {
            l.starts_with("run-loop: error: rank 1") || l.starts_with("run-loop: error: rank 0")
        })
        .unwrap_or_else(|| panic!("node 0 printed no error:\n{text}"))
        .1;
    let took = peer.duration_since(panicked);
    eprintln!(
        "node 0 failed {took:?} after the panic; the launch ended {:?} after it",
        exited.duration_since(panicked)
    );
    assert!(
        took < Duration::from_secs(5),
        "{took:?} after the panic:\n{text}"
    );
    // Node 0's ranks name the panicking rank and its message.
    assert!(
        text.contains("rank 3") && text.contains("was told to panic at step 20"),
        "{text}"
    );
    assert!(!text.contains("secret-test-token"), "{text}");
}

#[test]
fn kill_9_of_a_node_fails_the_others_within_30_s_naming_it() {
    let d = dir("kill");
    let m = d.join("m.jsonl");
    let (mut child, rx) = spawn_timed(&["--grace", "60"], &["--metrics", m.to_str().unwrap()]);
    common::wait_until(&mut child, Duration::from_secs(120), "5 steps", || {
        common::line_count(&m) >= 5
    });
    let victim = common::node_pid(child.id(), 1).expect("node 1 among the launcher's children");
    // The token travels in the environment only: no process shows it in its arguments.
    for p in [child.id(), victim] {
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap();
        assert!(
            !String::from_utf8_lossy(&cmd).contains("secret-test-token"),
            "token in the arguments of {p}"
        );
    }
    let killed = Instant::now();
    common::signal(victim, "-9");
    let st = common::wait_exit(&mut child, Duration::from_secs(90));
    let took = killed.elapsed();
    eprintln!("the launcher exited {took:?} after kill -9 of node 1");
    let text: String = rx.iter().map(|(l, _)| format!("{l}\n")).collect();
    assert!(!st.success(), "{text}");
    // Within 30 s node 0 failed on its own (the launcher's 60 s grace was not needed).
    assert!(took < Duration::from_secs(30), "{took:?}:\n{text}");
    assert!(text.contains("node 1"), "{text}");
    assert!(!text.contains("secret-test-token"), "{text}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_launches_and_device_specs_are_one_clear_line_and_exit_2() {
    let e = common::refused(&["launch", "--local", "2", "--", "./no-such-program", "--x"]);
    assert!(e.contains("program \"./no-such-program\" not found"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    // A node that refuses its flags: its own usage error reaches the user, with its exit code 2.
    let e = common::refused(&["launch", "--local", "2", "--", "train", "--no-such-flag"]);
    assert!(e.contains("unexpected argument '--no-such-flag'"), "{e}");
    assert!(e.contains("node 0 exited"), "{e}");
    // No Vulkan driver at all (the loader finds no ICD): what to install, not Burn's Debug dump.
    let e = common::refused_env(
        &["train", "--device", "wgpu:cpu", "--steps", "1"],
        &[
            ("VK_ICD_FILENAMES", "/nonexistent/icd.json"),
            ("VK_DRIVER_FILES", "/nonexistent/icd.json"),
        ],
    );
    assert!(e.contains("mesa-vulkan-drivers"), "{e}");
    assert!(
        !e.contains("AdapterUnavailable") && !e.contains("WgpuDevice"),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    let e = common::refused(&["train", "--device", "gpu0", "--steps", "1"]);
    assert!(e.contains("\"gpu0\" is not a device"), "{e}");
    let e = common::refused(&["train", "--device", "wgpu:99", "--steps", "1"]);
    assert!(e.contains("there is no adapter 99"), "{e}");
    // This machine has no GPU adapter (CI: lavapipe only): `wgpu` cannot give each rank one.
    let out = common::run(
        &["devices", "--ranks-per-node", "2", "--device", "wgpu"],
        &[],
        Duration::from_secs(60),
    );
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    if !listing.contains("DiscreteGpu") && !listing.contains("IntegratedGpu") {
        let e = common::refused(&[
            "train",
            "--device",
            "wgpu",
            "--ranks-per-node",
            "2",
            "--steps",
            "1",
        ]);
        assert!(e.contains("no GPU adapter found"), "{e}");
        assert_eq!(e.trim().lines().count(), 1, "{e}");
    }
}

#[test]
fn devices_lists_adapters_and_the_mapping_of_local_ranks() {
    let out = common::run(
        &[
            "devices",
            "--ranks-per-node",
            "2",
            "--device",
            "wgpu:cpu,cpu",
        ],
        &[],
        Duration::from_secs(60),
    );
    let text = common::text(&out);
    if !out.status.success() {
        return common::skip_unless_ci(&format!("no software Vulkan adapter here: {text}"));
    }
    assert!(out.status.success(), "{text}");
    assert!(text.contains("spec") && text.contains("vendor"), "{text}");
    assert!(text.contains("Cpu") && text.contains("Vulkan"), "{text}");
    assert!(text.contains("local rank 0: wgpu:"), "{text}");
    assert!(
        text.contains("local rank 1: cpu (burn flex backend)"),
        "{text}"
    );
}

/// The multi-machine form, each node started by its own `wiretrain launch --nnodes 2
/// --node-rank R --master HOST:PORT`, here both on loopback: the program trains as one job.
#[test]
fn launch_per_machine_with_master_and_node_rank() {
    let d = dir("per-machine");
    let m = d.join("m.jsonl");
    // A free UDP port for the coordinator.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = format!("127.0.0.1:{port}");
    let ex = common::example("run-loop");
    let node = |r: usize, bind: &str| {
        let mut c = Command::new(common::bin());
        c.args([
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            &r.to_string(),
            "--master",
            &master,
            "--ranks-per-node",
            "2",
            "--",
            ex.to_str().unwrap(),
            "--device",
            "cpu",
            "--steps",
            "10",
        ])
        .env("WIRETRAIN_TOKEN", "per-machine-test-token-0123456789abcdef")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        if r == 0 {
            c.arg("--metrics").arg(&m);
        } else {
            c.env("WIRETRAIN_BIND", bind);
        }
        c.spawn().unwrap()
    };
    let mut n0 = node(0, "");
    let mut n1 = node(1, "127.0.0.2:0");
    let (s0, s1) = (
        common::wait_exit(&mut n0, Duration::from_secs(120)),
        common::wait_exit(&mut n1, Duration::from_secs(120)),
    );
    let (e0, e1) = (common::stderr_of(&mut n0), common::stderr_of(&mut n1));
    assert!(s0.success() && s1.success(), "node 0:\n{e0}\nnode 1:\n{e1}");
    let (steps, summary) = losses(&m);
    assert_eq!(steps.len(), 10);
    assert_eq!(summary["world"], 4, "{summary}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `launch` pins the coordinator for every node it starts: node 0 writes its certificate's
/// fingerprint, the others are handed it (WIRETRAIN_MASTER_SHA256) and accept only that
/// certificate at the handshake. (Programs of your own read the same variable through
/// `JobOptions::from_env`; job.rs tests that.)
#[test]
fn launch_pins_the_coordinator_for_every_node_it_starts() {
    let args = [
        "launch",
        "--local",
        "3",
        "--",
        "train",
        "--example",
        "mlp",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--global-batch",
        "24",
        "--no-progress",
    ];
    let out = common::run(
        &args,
        &[("RUST_LOG", "wiretrain_comm::rendezvous=debug")],
        Duration::from_secs(120),
    );
    let text = common::text(&out);
    assert!(out.status.success(), "{text}");
    let dials: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("dialing the coordinator"))
        .collect();
    assert_eq!(dials.len(), 2, "{text}");
    for l in dials {
        assert!(l.contains("pinned") && l.contains("true"), "{l}");
    }
}
