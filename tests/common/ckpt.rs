//! Helpers of the checkpoint tests: a fresh directory, `launch --local` of the mlp example with
//! checkpoint flags, and a run that must succeed.

use std::path::{Path, PathBuf};
use std::time::Duration;

pub const BATCH: &str = "24";

pub fn dir(name: &str) -> PathBuf {
    super::fresh_dir("ckpt", name)
}

/// `launch --local nodes -- train ...` for the mlp example with the given extra flags.
pub fn launch_args(nodes: usize, strategy: &str, steps: usize, extra: &[&str]) -> Vec<String> {
    let (nodes, steps) = (nodes.to_string(), steps.to_string());
    let mut a = super::local_nodes(&nodes, &["train"]);
    a.extend(super::mlp(strategy, &steps, BATCH, "5", "cpu"));
    a.extend_from_slice(extra);
    a.into_iter().map(String::from).collect()
}

pub fn run_ok(args: &[String]) -> String {
    let out = super::run(args, &[], Duration::from_secs(300));
    assert!(out.status.success(), "{}", super::text(&out));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Flips one bit near the end of `file` (in its data, past the header) and returns the bytes as
/// they are now on disk.
pub fn flip_a_bit(file: &Path) -> Vec<u8> {
    let mut bytes = std::fs::read(file).unwrap();
    let mid = bytes.len() - 8;
    bytes[mid] ^= 0x40;
    std::fs::write(file, &bytes).unwrap();
    bytes
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// (step, loss) of every step line of a metrics file, in file order.
pub fn losses(p: &Path) -> Vec<(usize, f64)> {
    super::jsonl(p)
        .into_iter()
        .filter(|v| v.get("summary").is_none())
        .map(|v| {
            (
                v["step"].as_u64().unwrap() as usize,
                v["loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The pid of node `n` of the launch `child`; `None` (the launch killed, a skip noted) where
/// /proc does not show the launcher's children, which fails the test under CI=true.
pub fn node_or_skip(child: &mut std::process::Child, n: usize) -> Option<u32> {
    let pid = super::node_pid(child.id(), n);
    if pid.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        super::skip_unless_ci("the launcher's children are not visible in /proc here");
    }
    pid
}

/// Copies the checkpoint of `step` from `ck` into a directory of its own under `d` and resumes
/// from it on `nodes` nodes of `ranks` ranks (`strategy`, 300 steps, the mlp example) with
/// `extra` flags: the reference an elastic run's continuation is compared with. Returns the
/// run's stderr.
pub fn resume_copy(
    d: &Path,
    ck: &Path,
    step: usize,
    (nodes, ranks): (&str, &str),
    strategy: &str,
    extra: &[&str],
) -> String {
    let ck2 = d.join("ck-reference");
    let name = format!("step-{step:08}");
    std::fs::create_dir_all(&ck2).unwrap();
    let cp = std::process::Command::new("cp")
        .args(["-r", s(&ck.join(&name)), s(&ck2.join(&name))])
        .status()
        .unwrap();
    assert!(cp.success(), "copying {name}");
    let mut a = vec![
        "launch",
        "--local",
        nodes,
        "--ranks-per-node",
        ranks,
        "--",
        "train",
    ];
    a.extend(super::mlp(strategy, "300", BATCH, "5", "cpu"));
    a.extend(["--checkpoint-dir", s(&ck2), "--resume"]);
    a.extend_from_slice(extra);
    let a: Vec<String> = a.into_iter().map(String::from).collect();
    let out = run_ok(&a);
    assert!(
        out.contains(&format!("resumed from {} at step {step}", s(&ck2))),
        "{out}"
    );
    out
}

/// Each (step, loss) of `reference` equals the same step of `after` within 1e-5, and they
/// hold the same steps.
pub fn assert_same_losses(after: &[(usize, f64)], reference: &[(usize, f64)]) {
    assert_eq!(reference.len(), after.len());
    for (a, b) in after.iter().zip(reference) {
        assert_eq!(a.0, b.0);
        assert!(
            (a.1 - b.1).abs() <= 1e-5,
            "step {}: {} vs {}",
            a.0,
            a.1,
            b.1
        );
    }
}
