//! A real two-node Slurm cluster (scripts/slurm-lab.sh: slurmctld and two slurmd in network
//! and UTS namespaces of their own, munge): `sbatch -N2` of a script that runs
//! `srun wiretrain launch -- train ...`, and `srun -N2` of a user program (the run-loop
//! example), each training across the two Slurm nodes over QUIC with the node list, node ids
//! and master taken from Slurm's own environment. Each run's losses equal the same job's on
//! loopback (`launch --local 2`). `srun --ntasks-per-node=2` is refused with the flags that
//! give one task per node. Skipped, with the reason, where the cluster cannot start (not root,
//! no Slurm packages); under `CI=true` that fails instead.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const TRAIN: &str = "train --example mlp --steps 12 --global-batch 16 --device cpu --seed 3 \
                     --no-progress";
const USER_ARGS: &str = "--steps 10 --strategy zero2 --device cpu";

/// What the job scripts run on the cluster, as host wtctl (`$BIN`, `$EXAMPLE` and `$OUT` set).
const DRIVER: &str = r#"set -u
cat >"$OUT/job.sh" <<EOF
#!/bin/bash
#SBATCH --ntasks-per-node=1
srun --label "$BIN" launch --ranks-per-node 2 -- $TRAIN --metrics "$OUT/batch.jsonl"
EOF
RUST_LOG=wiretrain=info sbatch -N2 --wait -o "$OUT/batch.out" -e "$OUT/batch.err" "$OUT/job.sh" >"$OUT/sbatch.out" \
  || { echo "sbatch failed: $(cat "$OUT/sbatch.out" "$OUT/batch.err")"; exit 1; }
WIRETRAIN_RANKS_PER_NODE=2 srun -N2 --ntasks-per-node=1 "$EXAMPLE" $USER_ARGS \
  --metrics "$OUT/user.jsonl" >"$OUT/user.out" 2>"$OUT/user.err" \
  || { echo "srun of the user program failed: $(cat "$OUT/user.err")"; exit 1; }
if srun -N2 --ntasks-per-node=2 "$BIN" $TRAIN >"$OUT/refused.out" 2>"$OUT/refused.err"; then
  echo "two tasks per node were not refused"; exit 1
fi
echo driver done
"#;

/// The per-step losses in a metrics file.
fn losses(p: &Path) -> Vec<f64> {
    let rows = common::jsonl(p);
    let l: Vec<f64> = rows
        .iter()
        .filter(|r| r.get("summary").is_none())
        .filter_map(|r| r["loss"].as_f64())
        .collect();
    assert!(!l.is_empty(), "no losses in {}", p.display());
    l
}

/// The same job on loopback (2 nodes x 2 ranks): its losses.
fn loopback(program: &str, args: &str, dir: &Path, name: &str) -> Vec<f64> {
    let metrics = dir.join(format!("{name}.jsonl"));
    let mut cmd: Vec<String> = ["launch", "--local", "2", "--ranks-per-node", "2", "--"]
        .map(String::from)
        .to_vec();
    cmd.push(program.into());
    cmd.extend(args.split_whitespace().map(String::from));
    cmd.extend(["--metrics".into(), metrics.display().to_string()]);
    let out = common::run(&cmd, &[], Duration::from_secs(180));
    assert!(out.status.success(), "{}", common::text(&out));
    losses(&metrics)
}

fn assert_same(slurm: &[f64], local: &[f64], what: &str) {
    assert_eq!(slurm.len(), local.len(), "{what}: {slurm:?} vs {local:?}");
    for (i, (a, b)) in slurm.iter().zip(local).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what} step {i}: {a} vs {b}"
        );
    }
}

#[test]
fn sbatch_and_srun_train_across_two_slurm_nodes() {
    let dir = common::fresh_dir("slurm", "cluster");
    let t0 = Instant::now();
    let example = common::example("run-loop");
    // The job token; Slurm passes the submitter's environment to every task.
    let token = "slurm-0123456789abcdef0123456789abcdef";
    let out = Command::new("bash")
        .arg(format!(
            "{}/scripts/slurm-lab.sh",
            env!("CARGO_MANIFEST_DIR")
        ))
        .args(["bash", "-c", DRIVER])
        .env("BIN", common::bin())
        .env("EXAMPLE", &example)
        .env("OUT", &dir)
        .env("TRAIN", TRAIN)
        .env("USER_ARGS", USER_ARGS)
        .env("WIRETRAIN_TOKEN", token)
        .env("LIMIT", "400")
        .env("SLURM_LAB_LOGS", dir.join("logs"))
        .output()
        .expect("run scripts/slurm-lab.sh");
    let text = common::text(&out);
    if out.status.code() == Some(77) {
        common::skip_unless_ci(String::from_utf8_lossy(&out.stdout).trim());
        return;
    }
    assert!(out.status.success(), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(480), "{text}");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    // The rendezvous came from Slurm's variables on both nodes (srun --label prefixes each
    // line with its task: one per node).
    let batch_log = read("batch.err");
    for task in ["0: ", "1: "] {
        assert!(
            batch_log.lines().any(|l| l.starts_with(task)
                && l.contains("rendezvous from environment")
                && l.contains("\"slurm\"")),
            "task {task}did not take the job from Slurm's environment:\n{batch_log}"
        );
    }
    let local = loopback(common::bin(), TRAIN, &dir, "batch-local");
    assert_same(&losses(&dir.join("batch.jsonl")), &local, "sbatch train");
    let local = loopback(
        &example.display().to_string(),
        USER_ARGS,
        &dir,
        "user-local",
    );
    assert_same(
        &losses(&dir.join("user.jsonl")),
        &local,
        "srun user program",
    );
    let refused = read("refused.err");
    assert!(
        refused.contains("--ntasks-per-node=1") && refused.contains("--ranks-per-node 2"),
        "two tasks per node: {refused}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
