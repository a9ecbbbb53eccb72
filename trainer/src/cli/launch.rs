//! `wiretrain launch --local NODES --ranks-per-node K -- train ...`: starts NODES node
//! processes on 127.0.0.x running the given subcommand, so one command tries a real multi-node
//! job on one machine.

use anyhow::{Context, Result, bail};
use clap::Args;
use std::ffi::OsString;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Node processes to start on 127.0.0.1, 127.0.0.2, ...
    #[arg(long)]
    pub local: usize,
    /// Ranks (threads, one device each) per node.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: usize,
    /// Seconds a failed node's peers get to exit on their own before they are stopped.
    #[arg(long, default_value_t = 30.0)]
    pub grace: f64,
    /// The subcommand each node runs, after `--` (e.g. `-- train --example mlp`).
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

pub fn run(args: &LaunchArgs) -> Result<()> {
    if args.local == 0 || args.local > 64 {
        bail!("--local: {} is outside 1..=64", args.local);
    }
    if args.ranks_per_node == 0 {
        bail!("--ranks-per-node must be at least 1");
    }
    let sub = args.command[0].to_string_lossy();
    if sub != "train" && sub != "bench" {
        bail!("--: launch runs `train` or `bench`, not {sub:?}");
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
            bail!("--: {flag} is set by launch; remove it from the node command");
        }
    }
    let mut child = args.command.clone();
    child.push("--ranks-per-node".into());
    child.push(args.ranks_per_node.to_string().into());
    let grace = Duration::from_secs_f64(args.grace.clamp(1.0, 600.0));
    match wiretrain::launch::run_local(args.local, &child, grace) {
        Err(e @ wiretrain::launch::LaunchError::Interrupted) => {
            Err(super::Interrupted(e.to_string()).into())
        }
        r => r.context("local launch"),
    }
}
