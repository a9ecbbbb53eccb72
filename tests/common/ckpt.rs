//! Helpers of the checkpoint tests: a fresh directory, `launch --local` of the mlp example with
//! checkpoint flags, and a run that must succeed.

use std::path::{Path, PathBuf};
use std::time::Duration;

pub const BATCH: &str = "24";

pub fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wiretrain-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `launch --local nodes -- train ...` for the mlp example with the given extra flags.
pub fn launch_args(nodes: usize, strategy: &str, steps: usize, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "launch",
        "--local",
        &nodes.to_string(),
        "--",
        "train",
        "--example",
        "mlp",
        "--strategy",
        strategy,
        "--steps",
        &steps.to_string(),
        "--global-batch",
        BATCH,
        "--lr",
        "0.01",
        "--seed",
        "5",
        "--device",
        "cpu",
        "--bucket-bytes",
        "4096",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

pub fn run_ok(args: &[String]) -> String {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = super::run(&a, &[], Duration::from_secs(300));
    assert!(out.status.success(), "{}", super::text(&out));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}
