//! One run per checkpoint directory (issue 42, item 1): while a 2-node `launch --local` job
//! trains with `--resume` in a directory (its nodes, on one machine, do not refuse each
//! other), a second `--resume` run there — alone or launched — is refused with exit 2 and
//! one line naming the holder (host, pid, job); the first's checkpoints stay intact: after
//! it stops, a resume continues from its newest one. A resume of a run that is finished
//! trains nothing and succeeds.

mod common;

use common::ckpt::{self, s};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The step directories of `ck` that hold a manifest, newest last.
fn valid_steps(ck: &std::path::Path) -> Vec<usize> {
    let mut v: Vec<usize> = std::fs::read_dir(ck)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().join("manifest.json").is_file())
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_prefix("step-")?.parse().ok()
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// Kills the launch `pid` (and so its nodes) if the test fails while it runs.
struct KillOnPanic(u32);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = Command::new("kill")
                .args(["-9", &self.0.to_string()])
                .status();
        }
    }
}

#[test]
fn a_second_run_on_a_live_runs_checkpoint_directory_is_refused_naming_the_holder() {
    let d = ckpt::dir("lock");
    let ck = d.join("ck");
    let log = d.join("first.log");
    let resume = ["--checkpoint-dir", s(&ck), "--resume"];
    let mut first_args = ckpt::launch_args(2, "zero2", 100_000_000, &resume);
    first_args.extend(["--checkpoint-every", "10"].map(String::from));
    let mut first = Command::new(common::bin())
        .args(&first_args)
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn wiretrain");
    let _guard = KillOnPanic(first.id());
    common::wait_until(
        &mut first,
        Duration::from_secs(180),
        "checkpoint of the first run",
        || !valid_steps(&ck).is_empty(),
    );
    let Some(node0) = ckpt::node_or_skip(&mut first, 0) else {
        return;
    };
    let lease = std::fs::read_to_string(ck.join("wiretrain.lock")).unwrap();
    assert!(
        lease.contains(&format!("\"pid\":{node0}")),
        "node 0 holds the lease: {lease}"
    );

    // A second run, alone and launched, with --resume on the same directory.
    let mut alone = vec!["train"];
    alone.extend(common::mlp("zero2", "40", ckpt::BATCH, "5", "cpu"));
    alone.extend(resume);
    let launched = ckpt::launch_args(2, "zero2", 40, &resume);
    for (what, err) in [
        ("alone", common::refused(&alone)),
        ("launched", common::refused(&launched)),
    ] {
        let line = err
            .lines()
            .find(|l| l.contains("in use by another run"))
            .unwrap_or_else(|| panic!("{what}: no refusal naming the holder:\n{err}"));
        assert!(
            line.contains(&format!("pid {node0}")) && line.contains("job local-"),
            "{what}: {line}"
        );
        if what == "alone" {
            assert_eq!(err.trim().lines().count(), 1, "{what}: one line: {err}");
        }
    }
    let before = valid_steps(&ck);

    // The first run goes on, stops cleanly, and its checkpoints resume.
    common::wait_until(
        &mut first,
        Duration::from_secs(120),
        "a checkpoint after the refusals",
        || valid_steps(&ck).last() > before.last(),
    );
    common::signal(first.id(), "-TERM");
    let st = common::wait_exit(&mut first, Duration::from_secs(60));
    let first_log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(st.code(), Some(130), "{first_log}");
    assert!(!first_log.contains("in use"), "{first_log}");
    // Every checkpoint left is the first run's: one run id, and each one opens.
    let ids: std::collections::BTreeSet<String> = valid_steps(&ck)
        .iter()
        .map(|step| {
            let m = ck.join(format!("step-{step:08}")).join("manifest.json");
            let m: serde_json::Value = serde_json::from_slice(&std::fs::read(m).unwrap()).unwrap();
            m["run_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let newest = *valid_steps(&ck).last().unwrap();
    let steps = (newest + 2).to_string();
    let mut again = vec!["train"];
    again.extend(common::mlp("zero2", &steps, ckpt::BATCH, "5", "cpu"));
    again.extend(resume);
    let err = ckpt::run_ok(&again.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    assert!(
        err.contains(&format!("at step {newest} ")) && !err.contains("stale lease"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A resume at the run's last step (an elastic restart after the job's work was done, or a
/// second `--resume` of a finished run) trains nothing and succeeds, saying so: it used to
/// fail drawing a plot with no point, which turned an elastic restart at the end of a job
/// into a failed job (found by tests/elastic_agents.rs, a stalled agent).
#[test]
fn resuming_a_finished_run_trains_nothing_and_succeeds() {
    let d = ckpt::dir("finished");
    let (ck, m) = (d.join("ck"), d.join("m.jsonl"));
    let mut args = vec!["train"];
    args.extend(common::mlp("zero2", "20", "32", "1", "cpu"));
    args.extend(["--checkpoint-dir", s(&ck), "--checkpoint-every", "10"]);
    args.extend(["--metrics", s(&m)]);
    let out = common::run(&args, &[], Duration::from_secs(120));
    assert!(out.status.success(), "{}", common::text(&out));
    let plot = std::fs::metadata(d.join("m.png"))
        .unwrap()
        .modified()
        .unwrap();
    args.push("--resume");
    let out = common::run(&args, &[], Duration::from_secs(120));
    let text = common::text(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("nothing left to train: the run is at step 20 of 20"),
        "{text}"
    );
    let again = std::fs::metadata(d.join("m.png"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(plot, again, "the finished run's plot is kept");
    let _ = std::fs::remove_dir_all(&d);
}
