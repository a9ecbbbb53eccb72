//! Sharded checkpoints through the real binary (Burn's CPU backend, real QUIC between node
//! processes):
//! - resume on another world size and strategy — 4 nodes ZeRO-2, then 2 nodes ZeRO-3, then
//!   3 nodes DDP — follows an uninterrupted 4-node run's loss curve within 1e-4;
//! - `wiretrain export` writes a safetensors file that Burn's `SafetensorsStore` loads into the
//!   same module;
//! - kill -9 of a node while a checkpoint is being written: the survivors exit non-zero, the
//!   previous checkpoint stays valid, and the job resumes from it with one node fewer;
//! - a corrupted shard: resume and export fail naming the file; nothing is loaded.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::ckpt::{dir, flip_a_bit, launch_args, losses, run_ok, s};
use common::read_f32;

/// `wiretrain export --checkpoint <ck> --out <out>`.
fn export(ck: &Path, out: &Path) -> Output {
    common::run(
        &["export", "--checkpoint", s(ck), "--out", s(out)],
        &[],
        Duration::from_secs(60),
    )
}

#[test]
fn resume_reshards_across_world_sizes_and_strategies() {
    let d = dir("reshard");
    let ck = d.join("ck");
    let (base_m, base_p) = (d.join("base.jsonl"), d.join("base.f32"));
    run_ok(&launch_args(
        4,
        "zero2",
        30,
        &["--metrics", s(&base_m), "--save-params", s(&base_p)],
    ));
    let base = losses(&base_m);
    assert_eq!(base.len(), 30);

    let m1 = d.join("a.jsonl");
    let err = run_ok(&launch_args(
        4,
        "zero2",
        10,
        &[
            "--metrics",
            s(&m1),
            "--checkpoint-every",
            "5",
            "--checkpoint-dir",
            s(&ck),
        ],
    ));
    assert!(err.contains("checkpoint of step 10 written"), "{err}");
    let m2 = d.join("b.jsonl");
    let err = run_ok(&launch_args(
        2,
        "zero3",
        20,
        &[
            "--metrics",
            s(&m2),
            "--checkpoint-every",
            "5",
            "--checkpoint-dir",
            s(&ck),
            "--resume",
        ],
    ));
    assert!(
        err.contains("resumed from") && err.contains("at step 10 (written by 4 ranks, zero2)"),
        "{err}"
    );
    let (m3, p3) = (d.join("c.jsonl"), d.join("c.f32"));
    let err = run_ok(&launch_args(
        3,
        "ddp",
        30,
        &[
            "--metrics",
            s(&m3),
            "--checkpoint-dir",
            s(&ck),
            "--resume",
            "--save-params",
            s(&p3),
        ],
    ));
    assert!(
        err.contains("at step 20 (written by 2 ranks, zero3)"),
        "{err}"
    );

    let mut chained = losses(&m1);
    chained.extend(losses(&m2));
    chained.extend(losses(&m3));
    let steps: Vec<usize> = chained.iter().map(|x| x.0).collect();
    assert_eq!(
        steps,
        (0..30).collect::<Vec<_>>(),
        "every step once, in order"
    );
    let mut worst = 0.0f64;
    for ((_, a), (_, b)) in chained.iter().zip(&base) {
        worst = worst.max((a - b).abs() / b.abs().max(1.0));
    }
    eprintln!("resumed loss curve vs uninterrupted: worst relative difference {worst:e}");
    assert!(worst <= 1e-4, "loss curves differ by {worst:e}");
    let (pa, pb) = (read_f32(&p3), read_f32(&base_p));
    assert_eq!(pa.len(), pb.len());
    let pworst = pa
        .iter()
        .zip(&pb)
        .map(|(a, b)| f64::from((a - b).abs()) / f64::from(b.abs()).max(1.0))
        .fold(0.0, f64::max);
    eprintln!("final parameters vs uninterrupted: worst {pworst:e}");
    assert!(pworst <= 1e-4, "final parameters differ by {pworst:e}");

    // Only the newest two valid checkpoints are kept (default --checkpoint-keep 2), beside the
    // run lock.
    let mut kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "wiretrain.lock")
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-00000020", "step-00000030"]);

    // Export the final checkpoint and load it into the module with Burn's own store.
    let model = d.join("model.safetensors");
    let out = export(&ck, &model);
    assert!(out.status.success(), "{}", common::text(&out));
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    let device = burn::tensor::Device::flex();
    let mut mlp = wiretrain::models::mlp::Mlp::new(&device, 99);
    let res = mlp
        .load_from(&mut SafetensorsStore::from_file(&model))
        .expect("Burn loads the exported file");
    assert!(res.missing.is_empty() && res.errors.is_empty(), "{res:?}");
    let flat = wiretrain::flat::FlatLayout::of(&mlp).flatten_params(&mlp);
    assert_eq!(flat, pa, "the exported model holds the trained parameters");
    let _ = std::fs::remove_dir_all(&d);
}

/// Hybrid and HSDP checkpoints, whose replicas split the writing (node k's ranks write the k-th
/// piece of their shard): a chain 2x2 hybrid -> 2x2 HSDP -> 1x3 ZeRO-1 (3 ranks in one node)
/// follows a single-process run.
#[test]
fn hybrid_and_hsdp_checkpoints_resume_on_other_shapes() {
    let d = dir("hybrid");
    let ck = d.join("ck");
    let base_m = d.join("base.jsonl");
    run_ok(&launch_args(1, "ddp", 30, &["--metrics", s(&base_m)]));
    let base = losses(&base_m);
    let mut chained = Vec::new();
    for (i, (nodes, rpn, strategy, steps)) in [
        (2, "2", "hybrid", 10),
        (2, "2", "hsdp", 20),
        (1, "3", "zero1", 30),
    ]
    .into_iter()
    .enumerate()
    {
        let m = d.join(format!("{i}.jsonl"));
        let mut a = launch_args(
            nodes,
            strategy,
            steps,
            &["--metrics", s(&m), "--checkpoint-dir", s(&ck), "--resume"],
        );
        a.splice(3..3, ["--ranks-per-node".to_string(), rpn.to_string()]);
        run_ok(&a);
        if i < 2 {
            // The replicas split the writing: all four ranks wrote, each element once, and
            // no file holds more than half a node's shard (plus rounding).
            let man = wiretrain::checkpoint::Checkpoint::open(&ck)
                .unwrap()
                .manifest;
            let writers: Vec<usize> = man.files.iter().map(|f| f.rank).collect();
            assert_eq!(writers, [0, 1, 2, 3], "{man:?}");
            let mut covered: Vec<[usize; 2]> =
                man.files.iter().flat_map(|f| f.ranges.clone()).collect();
            covered.sort();
            let mut at = 0;
            for r in &covered {
                assert_eq!(r[0], at, "each element written once: {covered:?}");
                at = r[1];
            }
            assert_eq!(at, man.total);
            let most = man
                .files
                .iter()
                .map(|f| f.ranges.iter().map(|r| r[1] - r[0]).sum::<usize>())
                .max()
                .unwrap();
            assert!(most <= man.total / 4 + 1, "{most} of {}", man.total);
        }
        chained.extend(losses(&m));
    }
    let steps: Vec<usize> = chained.iter().map(|x| x.0).collect();
    assert_eq!(steps, (0..30).collect::<Vec<_>>());
    let worst = chained
        .iter()
        .zip(&base)
        .map(|((_, a), (_, b))| (a - b).abs() / b.abs().max(1.0))
        .fold(0.0, f64::max);
    eprintln!("hybrid -> hsdp -> zero1 vs single process: worst {worst:e}");
    assert!(worst <= 1e-4, "loss curves differ by {worst:e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the test hooks: --features wiretrain/test-hooks (scripts/test.sh)"
)]
fn kill_during_a_checkpoint_write_keeps_the_previous_one_and_resumes_with_a_node_fewer() {
    let d = dir("kill");
    let ck = d.join("ck");
    let args = launch_args(
        3,
        "zero2",
        40,
        &["--checkpoint-every", "5", "--checkpoint-dir", s(&ck)],
    );
    // The checkpoint of step 10 stalls for 20 s between the shard files and the manifest.
    let mut child = common::spawn(&args, &[("WIRETRAIN_TEST_STALL_CHECKPOINT", "10:20000")]);
    let step10 = ck.join("step-00000010");
    let shard = step10.join("shard-00002.safetensors");
    common::wait_until(
        &mut child,
        Duration::from_secs(120),
        "checkpoint write",
        || shard.exists(),
    );
    let Some(victim) = common::ckpt::node_or_skip(&mut child, 2) else {
        return;
    };
    let killed_at = Instant::now();
    common::signal(victim, "-9");
    // The survivors notice the dead node once their stall ends and exit non-zero.
    let status = common::wait_exit_or(
        &mut child,
        Duration::from_secs(80),
        "the job hangs after kill -9",
    );
    let detected = killed_at.elapsed();
    let err = common::stderr_of(&mut child);
    eprintln!("job exited {detected:?} after kill -9 of node 2 ({status}):\n{err}");
    assert!(!status.success(), "{err}");
    assert!(err.contains("node 2"), "the dead node is named: {err}");
    assert!(
        !step10.join("manifest.json").exists(),
        "no manifest for the interrupted write"
    );
    let ckpt = wiretrain::checkpoint::Checkpoint::open(&ck).expect("the previous checkpoint");
    assert_eq!(ckpt.manifest.step, 5);
    assert_eq!(ckpt.read_params().unwrap().len(), ckpt.manifest.total);

    // Restart with one node fewer: training completes from step 5.
    let m = d.join("m.jsonl");
    let mut args = launch_args(2, "zero2", 12, &["--metrics", s(&m)]);
    args.extend(["--checkpoint-dir", s(&ck), "--resume"].map(String::from));
    let err = run_ok(&args);
    assert!(
        err.contains("at step 5 (written by 3 ranks, zero2)"),
        "{err}"
    );
    let steps: Vec<usize> = losses(&m).iter().map(|x| x.0).collect();
    assert_eq!(steps, (5..12).collect::<Vec<_>>());
    // The interrupted step-10 directory was older than the new valid step 12 and is gone.
    assert!(!step10.exists());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_corrupted_shard_is_named_and_never_loaded() {
    let d = dir("corrupt");
    let ck = d.join("ck");
    run_ok(&launch_args(2, "zero1", 4, &["--checkpoint-dir", s(&ck)]));
    let shard = ck.join("step-00000004").join("shard-00001.safetensors");
    let bytes = flip_a_bit(&shard);
    let args = launch_args(2, "zero1", 8, &["--checkpoint-dir", s(&ck), "--resume"]);
    let out = common::run(&args, &[], Duration::from_secs(120));
    let text = common::text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("shard-00001.safetensors") && text.contains("checksum mismatch"),
        "{text}"
    );
    let out = export(&ck, &d.join("x.safetensors"));
    let text = common::text(&out);
    assert!(
        !out.status.success() && text.contains("shard-00001.safetensors"),
        "{text}"
    );
    assert!(!d.join("x.safetensors").exists());
    // The corrupted checkpoint is still there, untouched, for a human to look at.
    assert_eq!(std::fs::read(&shard).unwrap(), bytes);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn checkpoint_flags_are_checked() {
    for (args, want) in [
        ("train --checkpoint-every 5", "need --checkpoint-dir"),
        ("train --resume", "need --checkpoint-dir"),
        (
            "train --checkpoint-dir /tmp/x --checkpoint-every 0",
            "at least 1",
        ),
    ] {
        let err = common::refused(&common::words(args));
        assert!(err.contains(want), "{err}");
    }
}

/// A slow node is not a dead one: node 1 spends 15 s (longer than the 10 s QUIC idle timeout)
/// in one step; keep-alive keeps the connections up, and the run completes.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the test hooks: --features wiretrain/test-hooks (scripts/test.sh)"
)]
fn a_slow_node_within_the_collective_timeout_is_not_declared_dead() {
    let d = dir("slow");
    let m = d.join("m.jsonl");
    let args = launch_args(2, "zero2", 6, &["--metrics", s(&m)]);
    let t0 = Instant::now();
    let out = common::run(
        &args,
        &[("WIRETRAIN_TEST_SLOW_STEP", "1:2:15000")],
        Duration::from_secs(180),
    );
    assert!(out.status.success(), "{}", common::text(&out));
    assert!(t0.elapsed() >= Duration::from_secs(15));
    assert_eq!(losses(&m).len(), 6);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_fresh_run_never_mixes_with_an_earlier_runs_checkpoints() {
    let d = dir("reuse");
    let ck = d.join("ck");
    let ckpt = |steps: usize, extra: &[&str]| {
        let mut e = vec!["--checkpoint-dir", s(&ck)];
        e.extend_from_slice(extra);
        launch_args(1, "ddp", steps, &e)
    };
    run_ok(&ckpt(10, &["--checkpoint-every", "5"]));
    let manifest = |p: &Path| std::fs::read(p.join("step-00000010").join("manifest.json"));
    let before = manifest(&ck).unwrap();
    // A fresh run in the used directory: refused, exit 2, nothing touched.
    let a = ckpt(6, &["--checkpoint-every", "3"]);
    let out = common::run(&a, &[], Duration::from_secs(120));
    let text = common::text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("already holds checkpoints of an earlier run"),
        "{text}"
    );
    assert!(
        text.contains("--resume") && text.contains("--overwrite-checkpoints"),
        "{text}"
    );
    assert_eq!(manifest(&ck).unwrap(), before);
    // With --overwrite-checkpoints the old run moves aside, whole; the new run keeps its own
    // two checkpoints (it used to prune them: the old run's step 10 was "newer").
    let err = run_ok(&ckpt(
        6,
        &["--checkpoint-every", "3", "--overwrite-checkpoints"],
    ));
    assert!(err.contains("earlier checkpoints moved to"), "{err}");
    let steps = |p: &Path| -> Vec<usize> {
        wiretrain::checkpoint::list_valid(p)
            .unwrap()
            .iter()
            .map(|x| x.0)
            .collect()
    };
    assert_eq!(steps(&ck), [3, 6]);
    let aside: Vec<PathBuf> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("previous-")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(steps(&aside[0]), [5, 10]);
    assert_eq!(manifest(&aside[0]).unwrap(), before);
    // Resume takes the new run's newest, and its prune leaves the old run alone.
    let err = run_ok(&ckpt(
        8,
        &[
            "--resume",
            "--checkpoint-every",
            "1",
            "--checkpoint-keep",
            "1",
        ],
    ));
    assert!(err.contains("at step 6 "), "{err}");
    assert_eq!(steps(&ck), [8]);
    assert_eq!(steps(&aside[0]), [5, 10]);
    let _ = std::fs::remove_dir_all(&d);
}

/// docs/GUIDE.md's checkpoint commands, verbatim (relative paths included), in a fresh directory.
#[test]
fn the_documented_checkpoint_commands_work_verbatim() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/GUIDE.md")).unwrap();
    let section = readme
        .split("## Checkpoints, resume and export")
        .nth(1)
        .expect("docs/GUIDE.md has the checkpoint section");
    let block = section
        .split("```sh")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let commands: Vec<Vec<String>> = block
        .replace("\\\n", " ")
        .lines()
        .map(|l| l.split('#').next().unwrap().trim().to_string())
        .filter(|l| !l.is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect();
    assert_eq!(commands.len(), 3, "{block}");
    let d = dir("readme");
    for c in &commands {
        assert_eq!(c[0], "wiretrain", "{c:?}");
        let log = d.join("stderr.txt");
        let mut child = Command::new(common::bin())
            .args(&c[1..])
            .current_dir(&d)
            .env("XDG_RUNTIME_DIR", std::env::temp_dir())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let st = common::wait_exit(&mut child, Duration::from_secs(600));
        let err = std::fs::read_to_string(&log).unwrap();
        assert!(st.success(), "{c:?}: {st}\n{err}");
        assert!(!err.contains("error"), "{c:?}: {err}");
    }
    let model = std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(model.len() > 8);
    let _ = std::fs::remove_dir_all(&d);
}

/// A corrupt newest checkpoint (a flipped byte in one shard, then a garbage manifest) falls
/// back to the older one kept beside it, with a warning naming the file; the run continues.
#[test]
fn a_corrupt_newest_checkpoint_falls_back_to_the_one_before() {
    let d = dir("fallback");
    let ck = d.join("ck");
    run_ok(&launch_args(
        2,
        "zero1",
        10,
        &["--checkpoint-every", "5", "--checkpoint-dir", s(&ck)],
    ));
    let shard = ck.join("step-00000010").join("shard-00001.safetensors");
    let bytes = flip_a_bit(&shard);
    let m = d.join("m.jsonl");
    let err = run_ok(&launch_args(
        2,
        "zero1",
        12,
        &[
            "--checkpoint-dir",
            s(&ck),
            "--resume",
            "--checkpoint-keep",
            "3",
            "--metrics",
            s(&m),
        ],
    ));
    assert!(
        err.contains("shard-00001.safetensors") && err.contains("checksum mismatch"),
        "{err}"
    );
    assert!(err.contains("trying the one before it"), "{err}");
    assert!(err.contains("at step 5 "), "{err}");
    let steps: Vec<usize> = losses(&m).iter().map(|x| x.0).collect();
    assert_eq!(steps, (5..12).collect::<Vec<_>>());
    // The corrupted checkpoint is never deleted by the resumed run (a human may want it)...
    assert_eq!(std::fs::read(&shard).unwrap(), bytes);
    // ...and a manifest that is not JSON at all falls back the same way, here twice (12 is
    // garbage, 10 still has its bad shard, 5 loads).
    std::fs::write(
        ck.join("step-00000012").join("manifest.json"),
        b"{ not json",
    )
    .unwrap();
    let err = run_ok(&launch_args(
        1,
        "zero1",
        6,
        &["--checkpoint-dir", s(&ck), "--resume"],
    ));
    assert!(
        err.contains("not a manifest") && err.contains("checksum mismatch"),
        "{err}"
    );
    assert!(err.contains("at step 5 "), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A checkpoint write slower than --collective-timeout completes: the save's collectives wait
/// under --checkpoint-timeout. Under DDP every rank writes a share (rank 1 is the slow writer
/// here, 6 s against a 2 s collective timeout); with too short a checkpoint timeout the same
/// run fails, naming the timeout.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the test hooks: --features wiretrain/test-hooks (scripts/test.sh)"
)]
fn a_checkpoint_write_slower_than_the_collective_timeout_completes() {
    let d = dir("slow-write");
    let ck = d.join("ck");
    let args = |timeout: &str| {
        launch_args(
            2,
            "ddp",
            6,
            &[
                "--checkpoint-every",
                "5",
                "--checkpoint-dir",
                s(&ck),
                "--collective-timeout",
                "2",
                "--checkpoint-timeout",
                timeout,
            ],
        )
    };
    let stall = [("WIRETRAIN_TEST_STALL_CHECKPOINT", "5:6000:1")];
    let out = common::run(&args("30"), &stall, Duration::from_secs(120));
    assert!(out.status.success(), "{}", common::text(&out));
    let m = wiretrain::checkpoint::Checkpoint::open(&ck.join("step-00000005")).unwrap();
    let writers: Vec<usize> = m.manifest.files.iter().map(|f| f.rank).collect();
    assert_eq!(writers, [0, 1], "every DDP rank writes its share");
    // The control: a checkpoint timeout shorter than the stall fails at the collective timeout.
    let _ = std::fs::remove_dir_all(&ck);
    let out = common::run(&args("1"), &stall, Duration::from_secs(120));
    let text = common::text(&out);
    assert!(!out.status.success(), "{text}");
    // Rank 0 waits for the slow writer under the 2 s collective timeout, and says so.
    assert!(
        text.contains("on rank 0 timed out after 2s while waiting for step 0 frame 0 from node 1"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
