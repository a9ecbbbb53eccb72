//! Checkpoints under failures of the disk and the process, through the real binary:
//! - kill -9 while pruning (an old checkpoint renamed aside, not yet deleted): the newest
//!   checkpoint is intact, resume loads it, and the next prune finishes the removal;
//! - a full disk (ENOSPC on a small tmpfs) during a shard write: a clear error naming the file,
//!   the older checkpoint intact, no temporary files left, and resume works once there is room;
//! - one rank failing to load under ZeRO-2 (a corrupt shard): every rank reports that error,
//!   and none reports a protocol violation.

mod common;

use common::ckpt::{dir, flip_a_bit, launch_args, s};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use wiretrain::checkpoint::Checkpoint;

/// One node process of the mlp example on the CPU backend.
fn train_args(steps: usize, ck: &Path, extra: &[&str]) -> Vec<String> {
    let steps = steps.to_string();
    let mut a = vec![
        "train",
        "--example",
        "mlp",
        "--steps",
        &steps,
        "--seed",
        "3",
    ];
    a.extend(["--device", "cpu", "--no-progress"]);
    a.extend(["--checkpoint-every", "5", "--checkpoint-dir", s(ck)]);
    a.extend_from_slice(extra);
    a.into_iter().map(String::from).collect()
}

fn run<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> (bool, String) {
    let out = common::run(args, &[], Duration::from_secs(120));
    (out.status.success(), common::text(&out))
}

/// Resumes the run of [`train_args`] from `ck` to `steps` keeping `keep` checkpoints, which must
/// succeed and say `at`.
fn resume(steps: usize, ck: &Path, keep: &str, at: &str) {
    let (ok, text) = run(&train_args(
        steps,
        ck,
        &["--checkpoint-keep", keep, "--resume"],
    ));
    assert!(ok, "{text}");
    assert!(text.contains(at), "{text}");
}

/// What `d` holds, but for the run lock (`wiretrain.lock`, kept between runs).
fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "wiretrain.lock")
        .collect();
    v.sort();
    v
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the test hooks: --features wiretrain/test-hooks (scripts/test.sh)"
)]
fn kill_during_prune_keeps_the_newest_checkpoint_and_the_next_prune_finishes() {
    let d = dir("kill-prune");
    let ck = d.join("ck");
    // Keep one: the save of step 10 prunes step 5, and stalls with it renamed aside.
    let mut child = Command::new(common::bin())
        .args(train_args(30, &ck, &["--checkpoint-keep", "1"]))
        .env("WIRETRAIN_TEST_STALL_PRUNE", "30000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let doomed = ck.join(".removing-step-00000005");
    common::wait_until(&mut child, Duration::from_secs(60), "prune", || {
        doomed.exists()
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert_eq!(
        entries(&ck),
        [".removing-step-00000005", "step-00000010"],
        "the kill hit between the rename and the delete"
    );
    let c = Checkpoint::open(&ck).expect("the newest checkpoint is intact");
    assert_eq!(c.manifest.step, 10);
    assert_eq!(c.read_params().unwrap().len(), c.manifest.total);

    // Resume (no stall now): it loads step 10, and its first prune removes the debris.
    resume(20, &ck, "1", "at step 10 ");
    assert_eq!(entries(&ck), ["step-00000020"]);
    let _ = std::fs::remove_dir_all(&d);
}

#[cfg(unix)]
/// Mounts a tmpfs of `bytes` at `at`; false (with the reason printed) where this process may
/// not mount, which fails the test under CI=true.
fn mount_tmpfs(at: &Path, bytes: u64) -> bool {
    std::fs::create_dir_all(at).unwrap();
    let out = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={bytes}"),
            "tmpfs",
            s(at),
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            let why = String::from_utf8_lossy(&o.stderr).trim().to_string();
            common::skip_unless_ci(&format!("cannot mount a tmpfs (needs root): {why}"));
            false
        }
        Err(e) => {
            common::skip_unless_ci(&format!("no mount command: {e}"));
            false
        }
    }
}

#[cfg(unix)]
struct Unmount<'a>(&'a Path);

#[cfg(unix)]
impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

#[cfg(unix)]
#[test]
fn a_full_disk_during_a_shard_write_keeps_the_older_checkpoint_and_says_so() {
    let d = dir("enospc");
    let mnt = d.join("small");
    // The mlp checkpoint is ~85 KB: one fits in 140 KiB, the second does not.
    if !mount_tmpfs(&mnt, 140 << 10) {
        return;
    }
    let _unmount = Unmount(&mnt);
    let ck = mnt.join("ck");
    let (ok, text) = run(&train_args(15, &ck, &["--checkpoint-keep", "3"]));
    assert!(!ok, "a full disk must fail the run: {text}");
    assert!(
        text.contains("step-00000010/shard-00000.safetensors")
            && text.contains("No space left on device"),
        "the error names the file and the cause: {text}"
    );
    assert!(text.contains("checkpoint of step 5 written"), "{text}");
    let c = Checkpoint::open(&ck).expect("the older checkpoint is intact");
    assert_eq!(c.manifest.step, 5);
    assert_eq!(c.read_params().unwrap().len(), c.manifest.total);
    // The failed write left no temporary file and no manifest behind.
    assert_eq!(entries(&ck.join("step-00000010")), Vec::<String>::new());

    // With room again (the same mount, grown), resume loads step 5 and finishes.
    assert!(
        Command::new("mount")
            .args(["-o", "remount,size=4m", s(&mnt)])
            .status()
            .unwrap()
            .success()
    );
    resume(15, &ck, "3", "at step 5 ");
    assert_eq!(Checkpoint::open(&ck).unwrap().manifest.step, 15);
    drop(_unmount);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn one_rank_failing_to_load_under_zero2_fails_every_rank_with_its_error() {
    let d = dir("zero2-load");
    let ck = d.join("ck");
    let (ok, text) = run(&launch_args(2, "zero2", 4, &["--checkpoint-dir", s(&ck)]));
    assert!(ok, "{text}");
    // Rank 1's own shard of the only checkpoint is corrupt.
    flip_a_bit(&ck.join("step-00000004").join("shard-00001.safetensors"));
    let (ok, text) = run(&launch_args(
        2,
        "zero2",
        8,
        &["--checkpoint-dir", s(&ck), "--resume"],
    ));
    assert!(!ok, "{text}");
    assert!(!text.contains("protocol violation"), "{text}");
    // Both ranks (one per node process) name the shard and the cause.
    for rank in ["rank 0: ", "rank 1: "] {
        let said = text.lines().any(|l| {
            l.contains(rank)
                && l.contains("shard-00001.safetensors")
                && l.contains("checksum mismatch")
        });
        assert!(said, "{rank}names the bad shard:\n{text}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A checkpoint of another model (here char-lm 64 wide, resumed 32 wide) is refused at resume,
/// naming what does not fit; nothing is loaded and the checkpoint stays.
#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_parameter() {
    let d = dir("other-model");
    let ck = d.join("ck");
    let args = |width: &'static str, extra: &[&'static str]| {
        let mut a = vec![
            "train",
            "--example",
            "char-lm",
            "--steps",
            "2",
            "--device",
            "cpu",
        ];
        a.extend([
            "--no-progress",
            "--d-model",
            width,
            "--checkpoint-dir",
            s(&ck),
        ]);
        a.extend_from_slice(extra);
        a
    };
    let (ok, text) = run(&args("64", &[]));
    assert!(ok, "{text}");
    let (ok, text) = run(&args("32", &["--resume"]));
    assert!(!ok, "{text}");
    assert!(
        text.contains("does not fit this run: parameter #0 is \"tok.weight\" [63, 64] in the checkpoint but \"tok.weight\" [63, 32] in this model"),
        "names the parameter that does not fit: {text}"
    );
    assert_eq!(Checkpoint::open(&ck).unwrap().manifest.step, 2);
    let _ = std::fs::remove_dir_all(&d);
}
