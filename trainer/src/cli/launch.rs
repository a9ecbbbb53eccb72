//! `wiretrain launch`: starts the node processes of a job, as torchrun does, running this
//! binary's `train`/`bench` or any program (which finds its job through the `WIRETRAIN_*`
//! variables that `wiretrain::run` reads). `--local N` starts N nodes on 127.0.0.x; without it
//! launch starts this machine's one node of a job (`--nnodes/--node-rank/--master`, or the
//! torchrun/Slurm environment: `srun wiretrain launch -- ./my-train`). Signals are passed on;
//! the exit code is the failed node's.

use crate::cli::launcher::{LaunchError, Target, exit_code, run_local, run_node};
use crate::cli::usage;
use anyhow::Result;
use clap::Args;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Node processes to start on this machine (127.0.0.1, 127.0.0.2, ...).
    #[arg(long)]
    pub local: Option<usize>,
    /// Without --local: node processes in the whole job.
    #[arg(long, requires = "master")]
    pub nnodes: Option<usize>,
    /// Without --local: this machine's node rank (0 hosts the coordinator).
    #[arg(long, requires = "master")]
    pub node_rank: Option<usize>,
    /// Without --local: the coordinator, host:port (node 0 listens there).
    #[arg(long)]
    pub master: Option<String>,
    /// Ranks (threads, one device each) per node.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: usize,
    /// Seconds a failed node's peers get to exit on their own before they are stopped.
    #[arg(long, default_value_t = 30.0)]
    pub grace: f64,
    /// What each node runs, after `--`: `train ...` or `bench ...` of this binary, or any
    /// program and its arguments (e.g. `-- ./target/release/my-train --my-flag`).
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

/// A node failed: the launcher exits with its code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct NodeFailed {
    pub message: String,
    pub code: i32,
}

/// The program to run, checked before anything starts: a path (with a `/`) that is a file,
/// or a name found on PATH.
fn find_program(p: &Path) -> Result<PathBuf> {
    let found = if p.components().count() > 1 || p.is_absolute() {
        p.is_file().then(|| p.to_path_buf())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(p))
                .find(|c| c.is_file())
        })
    };
    found.ok_or_else(|| {
        crate::cli::usage_error(format!(
            "--: program {:?} not found (not a file, nor a name on PATH; launch runs `train`, `bench` or a program)",
            p.display()
        ))
    })
}

/// What every node runs: `train` or `bench` of this binary (whose rendezvous flags launch
/// sets), or another program.
fn target_of(args: &LaunchArgs) -> Result<Target> {
    let first = args.command[0].clone();
    if first != "train" && first != "bench" {
        return Ok(Target {
            program: Some(find_program(Path::new(&first))?),
            args: args.command[1..].to_vec(),
            ranks_per_node: args.ranks_per_node,
        });
    }
    for flag in [
        "--nnodes",
        "--node-rank",
        "--master",
        "--ranks-per-node",
        "--local",
    ] {
        if args
            .command
            .iter()
            .any(|a| a.to_string_lossy().split('=').next() == Some(flag))
        {
            usage!("--: {flag} is set by launch; remove it from the node command");
        }
    }
    Ok(Target {
        program: None,
        args: args.command.clone(),
        ranks_per_node: args.ranks_per_node,
    })
}

pub fn run(args: &LaunchArgs) -> Result<()> {
    if args.ranks_per_node == 0 || args.ranks_per_node > 1024 {
        usage!(
            "--ranks-per-node: {} is outside 1..=1024",
            args.ranks_per_node
        );
    }
    let target = target_of(args)?;
    let grace = Duration::from_secs_f64(args.grace.clamp(1.0, 600.0));
    let res = match args.local {
        Some(n) => {
            if n == 0 || n > 64 {
                usage!("--local: {n} is outside 1..=64");
            }
            if args.master.is_some() {
                usage!("--local starts every node here: it takes no --master/--nnodes/--node-rank");
            }
            run_local(n, &target, grace)
        }
        None => {
            let job = match (&args.master, args.nnodes, args.node_rank) {
                (Some(m), Some(n), Some(r)) if r < n => Some((n, r, m.clone())),
                (Some(_), Some(n), Some(r)) => {
                    usage!("--node-rank {r} is not below --nnodes {n}")
                }
                (Some(_), _, _) => usage!("--master needs --nnodes and --node-rank"),
                (None, _, _) => None,
            };
            run_node(&target, job).and_then(|st| {
                if st.success() {
                    Ok(())
                } else {
                    Err(LaunchError::Failed {
                        failures: vec![format!("the node process exited with {st}")],
                        code: exit_code(st),
                    })
                }
            })
        }
    };
    match res {
        Ok(()) => Ok(()),
        Err(e @ LaunchError::Interrupted) => Err(super::Interrupted(e.to_string()).into()),
        Err(LaunchError::Failed { failures, code }) => Err(NodeFailed {
            message: failures.join("; "),
            code,
        }
        .into()),
        Err(LaunchError::EarlyExit(st)) => Err(NodeFailed {
            message: format!("node 0 exited before listening ({st})"),
            code: exit_code(st),
        }
        .into()),
        Err(e) => Err(anyhow::Error::new(e).context("launch")),
    }
}
