//! Elastic launches across machines, one `wiretrain launch` agent per machine, through the
//! real binary (Burn's CPU backend, real QUIC between agents and between node processes, each
//! agent on its own 127.0.0.x): three agents train ZeRO-2; one is killed with -9 (its node
//! dies with it, as with its machine), the two left restart under epoch 1 from the newest
//! checkpoint; an agent started again joins at the next restart point, the world grows back
//! to 3 without a step lost, and the job finishes on every agent.

mod common;

use common::ckpt::{BATCH, dir, losses, s};
use std::path::Path;
use std::process::Child;
use std::time::Duration;

/// The job's secret, the same on every agent (as a user sets it on every machine).
const TOKEN: (&str, &str) = (
    "WIRETRAIN_TOKEN",
    "3f6c1a9e8b7d2c4f5a6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b8a",
);

/// A free UDP port on 127.0.0.1 for the rendezvous.
fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One agent, binding `host`, of `launch --nnodes 2:3 --max-restarts 2 --master master --
/// train` (mlp, ZeRO-2, `steps` steps, a checkpoint every 10, a 3 s idle timeout).
fn agent(master: &str, host: &str, steps: &str, extra: &[&str]) -> Child {
    agent_of("zero2", master, host, steps, extra)
}

/// [`agent`] training `strategy`.
fn agent_of(strategy: &str, master: &str, host: &str, steps: &str, extra: &[&str]) -> Child {
    let mut a = vec!["launch", "--nnodes", "2:3", "--max-restarts", "2"];
    a.extend(["--master", master, "--host", host, "--join-window", "10"]);
    a.extend(["--grace", "10", "--", "train"]);
    a.extend(common::mlp(strategy, steps, BATCH, "5", "cpu"));
    a.extend(["--checkpoint-every", "10", "--checkpoint-keep", "100"]);
    a.extend(["--idle-timeout", "3"]);
    a.extend_from_slice(extra);
    common::spawn(&a, &[TOKEN])
}

/// Agents on 127.0.0.1, .2 and .3, started in that order: the first binds the rendezvous
/// address and hosts it, and nodes are numbered in the order the agents join.
fn three(master: &str, steps: &str, extra: &[&str]) -> [Child; 3] {
    three_of("zero2", master, steps, extra)
}

/// [`three`] agents training `strategy`.
fn three_of(strategy: &str, master: &str, steps: &str, extra: &[&str]) -> [Child; 3] {
    let a = agent_of(strategy, master, "127.0.0.1", steps, extra);
    std::thread::sleep(Duration::from_millis(500));
    let b = agent_of(strategy, master, "127.0.0.2", steps, extra);
    std::thread::sleep(Duration::from_millis(500));
    [a, b, agent_of(strategy, master, "127.0.0.3", steps, extra)]
}

/// Waits for the agent `a` to run a node of `epoch`, then for `more` metrics lines in `m`.
fn wait_epoch(a: &mut Child, epoch: usize, m: &Path, more: usize) {
    let pid = a.id();
    common::wait_until(
        a,
        Duration::from_secs(90),
        &format!("epoch {epoch}"),
        || (0..3).any(|n| common::node_pid(pid, n).is_some_and(|p| common::of_epoch(p, epoch))),
    );
    let lines = common::line_count(m);
    common::wait_until(a, Duration::from_secs(90), "steps of the epoch", || {
        common::line_count(m) >= lines + more
    });
}

#[test]
fn agents_restart_without_a_killed_machine_and_grow_back_when_it_returns() {
    if std::fs::metadata("/proc/self/task").is_err() {
        common::skip_unless_ci("needs /proc to find the node processes");
        return;
    }
    let d = dir("agents");
    let (ck, m, tr) = (d.join("ck"), d.join("m.jsonl"), d.join("trace"));
    let master = format!("127.0.0.1:{}", free_port());
    let steps = "400";
    let extra = [
        "--checkpoint-dir",
        s(&ck),
        "--metrics",
        s(&m),
        "--trace",
        s(&tr),
    ];
    let [mut a, mut b, c] = three(&master, steps, &extra);
    common::wait_until(&mut a, Duration::from_secs(120), "20 steps", || {
        common::line_count(&m) >= 20
    });

    // Machine C dies: its agent is killed, its node with it.
    let c_node = common::node_pid(c.id(), 2).expect("agent C runs node 2");
    common::signal(c.id(), "-9");
    let mut c = c;
    let _ = c.wait();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !Path::new(&format!("/proc/{c_node}")).exists()
            || std::fs::read_to_string(format!("/proc/{c_node}/stat"))
                .is_ok_and(|st| st.contains(") Z ")),
        "the node of a killed agent dies with it"
    );
    wait_epoch(&mut a, 1, &m, 10);

    // C comes back: it joins at the next restart point and the world grows back to 3.
    let mut c2 = agent(&master, "127.0.0.3", steps, &extra);
    for (x, name) in [(&mut a, "A"), (&mut b, "B"), (&mut c2, "C again")] {
        let st = common::wait_exit_or(x, Duration::from_secs(300), "the job hangs");
        let err = common::stderr_of(x);
        assert!(st.success(), "agent {name}: {st}: {err}");
        if name == "A" {
            eprintln!("agent A: {err}");
            assert!(
                err.contains("this agent hosts the elastic rendezvous"),
                "{err}"
            );
            assert!(
                err.contains("epoch 1 on 2 node(s) without [2]")
                    && err.contains("epoch 2 on 3 node(s) joined by [2]"),
                "{err}"
            );
        }
    }

    let summary = common::jsonl(&m).into_iter().last().unwrap();
    assert_eq!(summary["world"], 3, "{summary}");
    let el = &summary["elastic"];
    eprintln!("restarts: {}", el["restarts"]);
    assert_eq!(el["epoch"], 2, "{summary}");
    let (r1, r2) = (&el["restarts"][0], &el["restarts"][1]);
    assert_eq!(r1["left"], serde_json::json!([2]), "{summary}");
    assert_eq!(r1["world"], 2, "{summary}");
    assert_eq!(r2["left"], serde_json::json!([]), "{summary}");
    assert_eq!(r2["joined"], serde_json::json!([2]), "{summary}");
    assert_eq!(r2["world"], 3, "{summary}");
    // The failure restart took at most 30 s from its detection to epoch 1's start.
    let took = r1["restarted_unix_ms"].as_u64().unwrap() - r1["detected_unix_ms"].as_u64().unwrap();
    assert!(took <= 30_000, "{took} ms");

    // Every step ran; the growth lost none: epoch 1 stopped after a step and checkpointed it,
    // and epoch 2 began at the step after it.
    let all = losses(&m);
    let start = summary["resumed_from"].as_u64().unwrap() as usize;
    let total: usize = steps.parse().unwrap();
    let (before, after) = all.split_at(all.len() - (total - start));
    assert_eq!(
        before.last().unwrap().0 + 1,
        start,
        "steps lost at the growth"
    );
    assert_eq!(el["steps_lost"], 0, "{summary}");
    assert_eq!(
        after.iter().map(|x| x.0).collect::<Vec<_>>(),
        (start..total).collect::<Vec<_>>()
    );
    assert!(after.iter().all(|x| x.1.is_finite()));
    // Epoch 2's traces show the restarts (a marker, and the history in otherData).
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tr.join("trace-rank0.json")).unwrap()).unwrap();
    assert_eq!(t["otherData"]["elastic"]["epoch"], 2);
    assert_eq!(
        t["otherData"]["elastic"]["restarts"][1]["joined"],
        serde_json::json!([2])
    );
    assert!(
        t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["cat"] == "elastic" && e["name"] == "elastic restart: epoch 2"),
        "no restart marker in the trace"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Under DDP, a machine lost (its agent killed with -9) leaves two nodes that heal in place:
/// the same node processes go on in epoch 1 from their live state (no checkpoint read, at
/// most one step lost); the machine started again joins in place too: the two regroup after
/// a step and its fresh node receives their state, and the world grows back to 3 with no
/// step lost and nothing read from a checkpoint.
#[test]
fn agents_heal_in_place_under_ddp_and_grow_back_in_place() {
    heal_in_place_and_grow_back("ddp", &[]);
}

/// Under DiLoCo the survivors keep their inner states and the newcomer takes node 0's (and
/// the outer state), each checked by digest.
#[test]
fn agents_heal_in_place_under_diloco_and_grow_back_in_place() {
    heal_in_place_and_grow_back("diloco", &["--inner-steps", "4"]);
}

/// Kills agent C of 3 training `strategy` with `flags`: A and B heal in place; C started
/// again joins in place, receiving the state from them.
fn heal_in_place_and_grow_back(strategy: &str, flags: &[&str]) {
    if std::fs::metadata("/proc/self/task").is_err() {
        common::skip_unless_ci("needs /proc to find the node processes");
        return;
    }
    let d = dir(&format!("agents-heal-{strategy}"));
    let (ck, m) = (d.join("ck"), d.join("m.jsonl"));
    let master = format!("127.0.0.1:{}", free_port());
    // Enough steps that the job still runs when the machine comes back.
    let steps = "1500";
    let mut extra = vec!["--checkpoint-dir", s(&ck), "--metrics", s(&m)];
    extra.extend_from_slice(flags);
    let [mut a, mut b, mut c] = three_of(strategy, &master, steps, &extra);
    common::wait_until(&mut a, Duration::from_secs(120), "20 steps", || {
        common::line_count(&m) >= 20
    });
    let nodes = [common::node_pid(a.id(), 0), common::node_pid(b.id(), 1)];
    assert!(
        nodes.iter().all(Option::is_some),
        "agents A and B run nodes 0 and 1"
    );
    common::signal(c.id(), "-9");
    let _ = c.wait();
    // The survivors heal and go on writing steps, in the same processes.
    let lines = common::line_count(&m);
    common::wait_until(&mut a, Duration::from_secs(60), "healed steps", || {
        common::line_count(&m) >= lines + 20
    });
    for (x, n) in [(&a, nodes[0]), (&b, nodes[1])] {
        let now = (0..3).find_map(|i| common::node_pid(x.id(), i));
        assert_eq!(now, n, "the node process goes on in place");
    }
    let mut c2 = agent_of(strategy, &master, "127.0.0.3", steps, &extra);
    for (x, name) in [(&mut a, "A"), (&mut b, "B"), (&mut c2, "C again")] {
        let st = common::wait_exit_or(x, Duration::from_secs(300), "the job hangs");
        let err = common::stderr_of(x);
        assert!(st.success(), "agent {name}: {st}: {err}");
        if name == "A" {
            assert!(
                err.contains("elastic heal from live replicas (epoch 1")
                    && err.contains("epoch 1 on 2 node(s) without [2]")
                    && err.contains("epoch 2 on 3 node(s) joined by [2]"),
                "{err}"
            );
            assert!(err.contains("goes on in place"), "{err}");
        }
        // Nothing is read from a checkpoint: the heal and the growth go on in place.
        assert!(!err.contains("resumed from"), "agent {name}: {err}");
    }
    let summary = common::jsonl(&m).into_iter().last().unwrap();
    assert_eq!(summary["world"], 3, "{summary}");
    let el = &summary["elastic"];
    let (r1, r2) = (&el["restarts"][0], &el["restarts"][1]);
    assert_eq!(r1["recovery"], "live", "{summary}");
    assert_eq!(r1["left"], serde_json::json!([2]), "{summary}");
    assert_eq!(r2["joined"], serde_json::json!([2]), "{summary}");
    // The growth was in place too: the newcomer received the state from the others.
    assert_eq!(r2["recovery"], "live", "{summary}");
    let heals = el["heals"]
        .as_array()
        .expect("the heals of node 0's process");
    assert_eq!(heals.len(), 2, "{summary}");
    assert_eq!(heals[1]["state_transferred"], true, "{summary}");
    assert_eq!(heals[1]["steps_lost"], 0, "{summary}");
    // Every step ran once after the heal: the growth lost none.
    let all = losses(&m);
    let from = heals[0]["went_on_from"].as_u64().unwrap() as usize;
    let tail: Vec<usize> = all.iter().map(|x| x.0).filter(|&x| x >= from).collect();
    assert_eq!(tail, (from..1500).collect::<Vec<_>>());
    // The process's own summary line: no checkpoint read, at most one step lost.
    let healed = common::jsonl(&m)
        .into_iter()
        .find(|l| l.get("summary").is_some() && l["elastic"]["recovery"] == "live")
        .expect("epoch 1's summary says it healed");
    assert!(
        healed["elastic"]["steps_lost"].as_u64().unwrap() <= 1,
        "{healed}"
    );
    assert_eq!(healed["resumed_from"], 0, "{healed}");
    let _ = std::fs::remove_dir_all(&d);
}

/// docs/ELASTIC.md's elastic launch across machines (three agents on 127.0.0.x), verbatim, with
/// bash and this build's `wiretrain` first on PATH: the job finishes on every agent.
#[test]
fn the_documented_agent_commands_work_verbatim() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ELASTIC.md")).unwrap();
    let block = readme
        .split("## Elastic restarts")
        .nth(1)
        .and_then(|s| s.split("```sh").nth(2))
        .and_then(|s| s.split("```").next())
        .expect("docs/ELASTIC.md has the agents' commands");
    let d = dir("agents-readme");
    let bin_dir = Path::new(common::bin()).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // Every agent must succeed: the script's `wait` is followed by a check of each exit.
    let script = block.replace(
        "\nwait\n",
        "\nfor p in $(jobs -p); do wait $p || exit 1; done\n",
    );
    let mut child = std::process::Command::new("bash")
        .args(["-c", &script])
        .current_dir(&d)
        .env("PATH", path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let st = common::wait_exit_or(&mut child, Duration::from_secs(300), "the agents hang");
    let err = common::stderr_of(&mut child);
    assert!(st.success(), "{err}");
    assert!(
        err.contains("this agent hosts the elastic rendezvous"),
        "{err}"
    );
    assert!(
        d.join("ckpt-agents").join("step-00000300").exists(),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// [`three`] agents of a job that runs until stopped, in a fresh directory `name`, once it has
/// run 20 steps.
fn three_training(name: &str) -> (std::path::PathBuf, [Child; 3]) {
    three_training_steps(name, "100000000")
}

/// [`three_training`] for `steps` steps.
fn three_training_steps(name: &str, steps: &str) -> (std::path::PathBuf, [Child; 3]) {
    let d = dir(name);
    let (ck, m) = (d.join("ck"), d.join("m.jsonl"));
    let master = format!("127.0.0.1:{}", free_port());
    let extra = ["--checkpoint-dir", s(&ck), "--metrics", s(&m)];
    let mut agents = three(&master, steps, &extra);
    common::wait_until(&mut agents[0], Duration::from_secs(120), "20 steps", || {
        common::line_count(&m) >= 20
    });
    (d, agents)
}

/// A stalled agent (SIGSTOP: alive, silent, its node still running) is handled as a lost
/// machine (issue 42, item 7): the host's link to it goes idle, the others restart without
/// it from the newest checkpoint, within the idle timeout and the restart bound, and finish
/// the job; the stalled agent, resumed after the job moved on, finds its link gone and exits
/// non-zero naming it.
#[test]
fn a_stalled_agent_is_left_behind_and_the_others_finish() {
    let (d, [mut a, mut b, mut c]) = three_training_steps("agents-stall", "3000");
    common::signal(c.id(), "-STOP");
    for (x, name) in [(&mut a, "A"), (&mut b, "B")] {
        let st = common::wait_exit_or(x, Duration::from_secs(240), "the job hangs on a stall");
        let err = common::stderr_of(x);
        assert!(st.success(), "agent {name}: {st}: {err}");
        if name == "A" {
            assert!(
                err.contains("epoch 1 on 2 node(s) without [2]") && err.contains("is gone"),
                "{err}"
            );
        }
    }
    let summary = common::jsonl(&d.join("m.jsonl"))
        .into_iter()
        .last()
        .unwrap();
    let r1 = &summary["elastic"]["restarts"][0];
    assert_eq!(r1["left"], serde_json::json!([2]), "{summary}");
    let took = r1["restarted_unix_ms"].as_u64().unwrap() - r1["detected_unix_ms"].as_u64().unwrap();
    assert!(took <= 30_000, "{took} ms from detection to the restart");
    common::signal(c.id(), "-CONT");
    let st = common::wait_exit_or(&mut c, Duration::from_secs(60), "the stalled agent lingers");
    let err = common::stderr_of(&mut c);
    assert!(!st.success(), "the stalled agent: {err}");
    assert!(
        err.contains("elastic rendezvous"),
        "the stalled agent: {err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Ctrl-C (SIGINT) to one agent stops the job on every agent: its node stops after its step,
/// the host ends the job (no restart), and every agent exits 130.
#[test]
fn a_signal_to_one_agent_stops_the_job_everywhere() {
    let (d, [mut a, mut b, mut c]) = three_training("agents-int");
    common::signal(b.id(), "-INT");
    for (x, name) in [(&mut a, "A"), (&mut b, "B"), (&mut c, "C")] {
        let st = common::wait_exit_or(x, Duration::from_secs(60), "an agent goes on");
        let err = common::stderr_of(x);
        assert_eq!(st.code(), Some(130), "agent {name}: {err}");
        assert!(!err.contains("elastic restart"), "agent {name}: {err}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The agent hosting the rendezvous is lost: every other agent fails within 30 s, naming the
/// lost rendezvous, and takes its node along.
#[test]
fn losing_the_rendezvous_host_fails_every_agent() {
    let (d, [mut a, mut b, mut c]) = three_training("agents-host");
    let nodes = [common::node_pid(b.id(), 1), common::node_pid(c.id(), 2)];
    common::signal(a.id(), "-9");
    let _ = a.wait();
    for (x, name) in [(&mut b, "B"), (&mut c, "C")] {
        let st = common::wait_exit_or(x, Duration::from_secs(30), "an agent outlives its host");
        let err = common::stderr_of(x);
        assert!(!st.success(), "agent {name}: {err}");
        assert!(
            err.contains("lost the elastic rendezvous"),
            "agent {name}: {err}"
        );
    }
    for p in nodes.into_iter().flatten() {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        assert!(
            stat.is_empty() || stat.contains(") Z "),
            "node {p} outlives its agent"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Agents that do not belong are kept out (issue 42, item 6): an agent started with other
/// settings (here `--steps`) is refused by the host naming the first differing argument with
/// both values; one of another job id (WIRETRAIN_JOB_ID, as a leftover agent of an earlier
/// launch has) cannot connect; one with a weak token stops before it dials. The host goes on
/// waiting for agents that belong.
#[test]
fn agents_with_other_settings_another_job_or_a_weak_token_are_refused() {
    let d = dir("agents-refused");
    let ck = d.join("ck");
    let master = format!("127.0.0.1:{}", free_port());
    let extra = ["--checkpoint-dir", s(&ck)];
    let mut host = agent(&master, "127.0.0.1", "400", &extra);
    std::thread::sleep(Duration::from_millis(500));
    let mut other_steps = agent(&master, "127.0.0.2", "500", &extra);
    let st = common::wait_exit_or(&mut other_steps, Duration::from_secs(60), "not refused");
    let err = common::stderr_of(&mut other_steps);
    assert!(!st.success(), "{err}");
    assert!(
        err.contains("refused")
            && err.contains(
                "argument 7 of the node command differs: `500` on this agent, `400` in the job"
            ),
        "{err}"
    );

    let mut a = vec!["launch", "--nnodes", "2:3", "--max-restarts", "2"];
    a.extend([
        "--master",
        &master,
        "--host",
        "127.0.0.3",
        "--join-window",
        "10",
    ]);
    a.extend(["--grace", "10", "--", "train"]);
    a.extend(common::mlp("zero2", "400", BATCH, "5", "cpu"));
    a.extend(["--checkpoint-every", "10", "--checkpoint-keep", "100"]);
    a.extend(["--idle-timeout", "3"]);
    a.extend_from_slice(&extra);
    let mut other_job = common::spawn(&a, &[TOKEN, ("WIRETRAIN_JOB_ID", "an-earlier-launch")]);
    let st = common::wait_exit_or(&mut other_job, Duration::from_secs(60), "joined");
    let err = common::stderr_of(&mut other_job);
    assert!(!st.success() && err.contains("is of another job"), "{err}");

    let weak = ("WIRETRAIN_TOKEN", "hunter2");
    let mut weak_agent = common::spawn(&a, &[weak]);
    let st = common::wait_exit_or(&mut weak_agent, Duration::from_secs(30), "dialed");
    let err = common::stderr_of(&mut weak_agent);
    assert!(!st.success() && err.contains("at least 128 bits"), "{err}");
    assert!(!err.contains("hunter2"), "the token is not printed: {err}");

    // The host still waits for agents of its job (none of the three was let in).
    assert!(host.try_wait().unwrap().is_none(), "the host ended");
    common::signal(host.id(), "-9");
    let _ = host.wait();
    let _ = std::fs::remove_dir_all(&d);
}
