//! `wiretrain launch`: starts the node processes of a job, as torchrun does, running this
//! binary's `train`/`bench` or any program (which finds its job through the `WIRETRAIN_*`
//! variables that `wiretrain::run` reads). `--local N` starts N nodes on 127.0.0.x; without it
//! launch starts this machine's one node of a job (`--nnodes/--node-rank/--master`, or the
//! torchrun/Slurm environment: `srun wiretrain launch -- ./my-train`). Signals are passed on;
//! the exit code is the failed node's.

use crate::cli::usage;
use anyhow::Result;
use clap::Args;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use wiretrain::elastic::agent::{AgentOptions, run_agent};
use wiretrain::elastic::launcher::{Elastic, LaunchError, Target, exit_code, run_local, run_node};

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Node processes to start on this machine (127.0.0.1, 127.0.0.2, ...).
    #[arg(long)]
    pub local: Option<usize>,
    /// Node processes in the whole job (with --master). `MIN:MAX` makes the launch elastic:
    /// when a node is lost, the others restart without it as long as MIN remain (see
    /// --max-restarts), and (across machines) agents that join later take the world back up
    /// to MAX. With --local N, MAX is N.
    #[arg(long, value_name = "N|MIN:MAX")]
    pub nnodes: Option<String>,
    /// Restarts an elastic launch may make: after a node process dies (or any node fails),
    /// every surviving node restarts from the newest checkpoint (`train` gets `--resume`; other
    /// programs see WIRETRAIN_EPOCH and WIRETRAIN_RESTARTS), under a new job epoch. Without
    /// --local this runs one agent per machine, meeting at --master.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Without --local: this machine's node rank (0 hosts the coordinator).
    #[arg(long, requires = "master")]
    pub node_rank: Option<usize>,
    /// Without --local: the coordinator, host:port (node 0 listens there).
    #[arg(long)]
    pub master: Option<String>,
    /// Ranks (threads, one device each) per node.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: usize,
    /// Elastic launch across machines: the address this machine's node binds, which the
    /// others dial (default: this machine's address on the route to --master).
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Elastic launch across machines: seconds the first epoch waits, once MIN agents are
    /// there, for more (up to MAX). Agents that come later join at the next restart point.
    #[arg(long, default_value_t = 3.0)]
    pub join_window: f64,
    /// Seconds a failed node's peers get to exit on their own before they are stopped.
    #[arg(long, default_value_t = 30.0)]
    pub grace: f64,
    /// What each node runs, after `--`: `train ...` or `bench ...` of this binary, or any
    /// program and its arguments (e.g. `-- ./target/release/my-train --my-flag`).
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

/// `--nnodes`'s `MIN:MAX` (or `N`): `None` when it is neither.
fn min_max(v: &str) -> Option<(usize, usize)> {
    let (lo, hi) = v.split_once(':').unwrap_or((v, v));
    match (lo.trim().parse::<usize>(), hi.trim().parse::<usize>()) {
        (Ok(lo), Ok(hi)) if 1 <= lo && lo <= hi => Some((lo, hi)),
        _ => None,
    }
}

/// Whether the node command is this binary's `train` (which resumes with `--resume`), after
/// checking that a `train` that may restart has a checkpoint directory to resume from.
fn resumes(args: &LaunchArgs, target: &Target) -> Result<bool> {
    if args.max_restarts > 100 {
        usage!("--max-restarts: {} is above 100", args.max_restarts);
    }
    let train = target.program.is_none() && target.args.first().is_some_and(|a| a == "train");
    let has = |flag: &str| {
        target
            .args
            .iter()
            .any(|a| a.to_string_lossy().split('=').next() == Some(flag))
    };
    if args.max_restarts > 0 && train && !has("--checkpoint-dir") {
        usage!(
            "--max-restarts: `train` restarts from its newest checkpoint; give it \
             --checkpoint-dir DIR and --checkpoint-every K"
        );
    }
    Ok(train)
}

/// The elastic settings of a local launch of `n` nodes: `--nnodes MIN:n` (or `n`, or unset:
/// no node may be lost) and `--max-restarts`. A `train` that restarts needs a checkpoint
/// directory to resume from.
fn elastic_of(args: &LaunchArgs, n: usize, target: &Target) -> Result<Elastic> {
    let min = match args.nnodes.as_deref() {
        None => n,
        Some(v) => match min_max(v) {
            Some((lo, hi)) if hi == n => lo,
            _ => usage!(
                "--nnodes {v}: with --local {n} give MIN:{n} (1 <= MIN <= {n}), the fewest \
                 nodes the job may go on with"
            ),
        },
    };
    let resume_flag = resumes(args, target)?;
    Ok(Elastic {
        min,
        max_restarts: args.max_restarts,
        resume_flag,
    })
}

/// The agent of an elastic launch across machines (`--nnodes MIN:MAX` or `--max-restarts`
/// without `--local`): `--master` is the rendezvous, and node numbers are the launch's.
fn agent_of(args: &LaunchArgs, target: &Target, grace: Duration) -> Result<AgentOptions> {
    if args.node_rank.is_some() {
        usage!(
            "--node-rank: an elastic launch (--nnodes MIN:MAX or --max-restarts) numbers its \
             nodes itself at every epoch; drop --node-rank"
        );
    }
    let Some(master) = args.master.clone() else {
        usage!(
            "an elastic launch across machines needs --master HOST:PORT: the rendezvous, \
             hosted by the agent whose address it is (or give --local N)"
        );
    };
    let Some((min, max)) = args.nnodes.as_deref().and_then(min_max) else {
        usage!(
            "--nnodes {}: an elastic launch needs MIN:MAX (1 <= MIN <= MAX), the fewest and \
             the most nodes",
            args.nnodes.as_deref().unwrap_or("(unset)")
        );
    };
    if max > 1024 {
        usage!("--nnodes {min}:{max}: at most 1024 nodes");
    }
    if !(0.0..=600.0).contains(&args.join_window) {
        usage!(
            "--join-window: {} is outside 0..=600 seconds",
            args.join_window
        );
    }
    Ok(AgentOptions {
        master,
        host: args.host,
        resume_flag: resumes(args, target)?,
        target: target.clone(),
        grace,
        min,
        max,
        max_restarts: args.max_restarts,
        join_window: Duration::from_secs_f64(args.join_window),
    })
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
            if args.master.is_some() || args.node_rank.is_some() || args.host.is_some() {
                usage!("--local starts every node here: it takes no --master/--node-rank/--host");
            }
            let elastic = elastic_of(args, n, &target)?;
            run_local(n, &target, grace, elastic)
        }
        None if args.max_restarts > 0
            || args.nnodes.as_deref().is_some_and(|v| v.contains(':')) =>
        {
            run_agent(&agent_of(args, &target, grace)?)
        }
        None => {
            let nnodes = match &args.nnodes {
                Some(v) => match v.parse::<usize>() {
                    Ok(n) => Some(n),
                    Err(_) => usage!("--nnodes {v}: a node count, or MIN:MAX (elastic)"),
                },
                None => None,
            };
            let job = match (&args.master, nnodes, args.node_rank) {
                (Some(m), Some(n), Some(r)) if r < n => Some((n, r, m.clone())),
                (Some(_), Some(n), Some(r)) => {
                    usage!("--node-rank {r} is not below --nnodes {n}")
                }
                (Some(_), _, _) => usage!("--master needs --nnodes and --node-rank"),
                (None, None, None) => None,
                (None, _, _) => usage!("--nnodes and --node-rank need --master (or --local N)"),
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
