//! [`run`]: the plumbing of a distributed program, so a user's `main` holds only its training.
//!
//! `wiretrain::run(JobOptions::from_env()?, |ctx: RankContext| { ... })` maps the node's local
//! ranks to devices (one adapter each, [`crate::device::NodeDevices`]), joins the job (the
//! rank table records every rank's device), installs the Ctrl-C handler, runs the closure once
//! per local rank on its own thread with that rank's process group and device, and tears the
//! node down. A rank that returns an error or panics fails every rank of the job at once with
//! its message (its node's shared buffers are poisoned and its connections closed with the
//! reason), so no peer waits out the collective timeout; `run` then returns the root cause.

use crate::device::{NodeDevices, RankDevice};
use crate::heal::Healer;
use crate::job::{JobError, JobOptions, env};
use burn::tensor::Device;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use wiretrain_comm::{Node, ProcessGroup, RankTable};

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The job options cannot make a node configuration.
    #[error(transparent)]
    Job(#[from] JobError),
    /// The local ranks cannot get their devices.
    #[error("--device: {0}")]
    Device(#[from] crate::device::DeviceError),
    /// The node could not join the job (rendezvous, connections).
    #[error("joining the job: {0}")]
    Join(wiretrain_comm::Error),
    /// The Ctrl-C handler could not be installed, or a rank thread could not be spawned.
    #[error("cannot install the Ctrl-C handler: {0}")]
    Signal(String),
    /// A rank failed; `message` is its error or panic message.
    #[error("rank {rank} {}: {message}", verb(*panicked))]
    Rank {
        /// The rank's global rank (`usize::MAX` when only its thread's exit reported a panic).
        rank: usize,
        /// Whether it panicked rather than returned an error.
        panicked: bool,
        /// Its error or panic message.
        message: String,
    },
    /// The node's orderly shutdown failed after every rank succeeded.
    #[error("shutting down: {0}")]
    Shutdown(wiretrain_comm::Error),
}

fn verb(panicked: bool) -> &'static str {
    if panicked { "panicked" } else { "failed" }
}

/// What one rank's closure gets: its process group, its device and the job's stop flag.
pub struct RankContext {
    /// This rank's process group (the whole job).
    pub pg: ProcessGroup,
    /// This rank's device (without autodiff: see [`RankContext::device`]).
    pub rank_device: RankDevice,
    /// Raised by Ctrl-C/SIGTERM; `Trainer::set_stop_flag` makes every rank stop together.
    pub stop: Arc<AtomicBool>,
    /// In an elastic launch that heals (`WIRETRAIN_HEAL_DIR`): how this node joins the next
    /// epoch after losing a peer. Hand it to [`crate::fit::FitOptions::heal`].
    pub heal: Option<Arc<Healer>>,
}

impl RankContext {
    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }
    /// The number of ranks in the job.
    pub fn world(&self) -> usize {
        self.pg.world()
    }
    /// This rank's index among its node's ranks.
    pub fn local_rank(&self) -> usize {
        self.pg.local_rank()
    }
    /// This rank's node (node rank).
    pub fn node(&self) -> usize {
        self.pg.node()
    }
    /// The device to train on, with autodiff.
    pub fn device(&self) -> Device {
        self.rank_device.device.clone().autodiff()
    }
    /// Every rank's device, as the rank table records it (global rank order).
    pub fn devices(&self) -> Vec<String> {
        devices_of(self.pg.table())
    }
}

/// Every rank's device description from a rank table, in global rank order.
pub fn devices_of(table: &RankTable) -> Vec<String> {
    table
        .nodes()
        .iter()
        .flat_map(|n| n.devices.iter().cloned())
        .collect()
}

/// The first failure of a run: panics rank above errors (an error is often a peer's reaction
/// to the panic), then the earliest.
#[derive(Default)]
struct FirstFailure(Mutex<Option<(bool, usize, String)>>);

impl FirstFailure {
    fn record(&self, panicked: bool, rank: usize, message: String) {
        let mut f = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if f.as_ref().is_none_or(|(p, _, _)| panicked && !p) {
            *f = Some((panicked, rank, message));
        }
    }
    fn take(&self) -> Option<RunError> {
        let f = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        f.map(|(panicked, rank, message)| RunError::Rank {
            rank,
            panicked,
            message,
        })
    }
}

/// Runs `f` once per local rank of this node (each on its own thread with its own device) and
/// returns the ranks' results in local-rank order, or the root cause of a failure.
pub fn run<T, E, F>(opts: JobOptions, f: F) -> Result<Vec<T>, RunError>
where
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
    F: Fn(RankContext) -> Result<T, E> + Send + Sync + 'static,
{
    let mut cfg = opts.node_config()?;
    let plan = NodeDevices::plan(&opts.devices, opts.ranks(), opts.share_device)?;
    cfg.devices(plan.descriptions())
        .map_err(|e| JobError(e.to_string()))?;
    let stop = crate::signal::install(None).map_err(RunError::Signal)?;
    let descriptions = plan.descriptions();
    let mut node = Node::join(cfg).map_err(RunError::Join)?;
    let groups = node.take_groups();
    let heal_dir = opts.heal_dir.clone().or_else(|| {
        std::env::var_os(env::HEAL_DIR)
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    });
    let (mut node, heal) = match heal_dir {
        Some(dir) => {
            let h = Healer::new(dir, opts.clone(), descriptions, node, stop.clone());
            (None, Some(Arc::new(h)))
        }
        None => (Some(node), None),
    };
    let failure = Arc::new(FirstFailure::default());
    let f = Arc::new(f);
    let plan = Arc::new(plan);
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let (f, plan, stop, failure) = (f.clone(), plan.clone(), stop.clone(), failure.clone());
            let heal = heal.clone();
            let rank = pg.rank();
            std::thread::Builder::new()
                .name(format!("wiretrain-rank-{rank}"))
                .spawn(move || rank_thread(pg, &plan, stop, heal, &*f, failure))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| RunError::Signal(format!("spawning a rank thread: {e}")))?;
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        match h.join() {
            Ok(Some(v)) => out.push(v),
            Ok(None) => {}
            Err(p) => failure.record(true, usize::MAX, wiretrain_comm::abort::panic_message(&*p)),
        }
    }
    if let Some(h) = &heal {
        node = h.take_node();
    }
    if let Some(e) = failure.take() {
        // Dropping the node closes its connections with "node exited without shutdown".
        drop(node);
        return Err(e);
    }
    if let Some(node) = node {
        node.shutdown().map_err(RunError::Shutdown)?;
    }
    Ok(out)
}

/// One rank: its device, then the user's closure; any failure fails the job at once.
fn rank_thread<T, E: std::fmt::Display, F: Fn(RankContext) -> Result<T, E>>(
    pg: ProcessGroup,
    plan: &NodeDevices,
    stop: Arc<AtomicBool>,
    heal: Option<Arc<Healer>>,
    f: &F,
    failure: Arc<FirstFailure>,
) -> Option<T> {
    let (rank, local) = (pg.rank(), pg.local_rank());
    let first_aborter = pg.aborter();
    // After a heal the rank's process group is the new epoch's: a failure aborts that one.
    let aborter = || {
        heal.as_ref()
            .and_then(|h| h.aborter(local))
            .unwrap_or_else(|| first_aborter.clone())
    };
    let rank_device = match plan.open(pg.local_rank()) {
        Ok(d) => d,
        Err(e) => {
            let msg = format!("opening {}: {e}", plan.describe(pg.local_rank()));
            failure.record(false, rank, msg.clone());
            aborter().abort(&msg);
            return None;
        }
    };
    let ctx = RankContext {
        pg,
        rank_device,
        stop,
        heal: heal.clone(),
    };
    // A panic fails the node from comm's panic hook, before the panic is printed (a
    // backtrace can take seconds); the payload is kept here for the report.
    let (fail, heal_at_panic, aborter_at_panic) = (failure.clone(), heal.clone(), aborter());
    wiretrain_comm::abort::on_panic(Some(Box::new(move |msg: &str| {
        fail.record(true, rank, msg.to_string());
        if let Some(h) = &heal_at_panic {
            h.abandon(&format!("rank {rank} panicked: {msg}"));
        }
        let a = heal_at_panic.as_ref().and_then(|h| h.aborter(local));
        a.unwrap_or(aborter_at_panic)
            .abort(&format!("panicked: {msg}"));
    })));
    let res = std::panic::catch_unwind(AssertUnwindSafe(|| f(ctx)));
    wiretrain_comm::abort::on_panic(None);
    match res {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            let msg = e.to_string();
            // Recorded before the abort wakes the peers, whose errors only echo this one.
            failure.record(false, rank, msg.clone());
            if let Some(h) = &heal {
                h.abandon(&format!("rank {rank} failed: {msg}"));
            }
            aborter().abort(&msg);
            None
        }
        Err(p) => {
            let msg = wiretrain_comm::abort::current_panic()
                .unwrap_or_else(|| wiretrain_comm::abort::panic_message(&*p));
            failure.record(true, rank, msg.clone());
            if let Some(h) = &heal {
                h.abandon(&format!("rank {rank} panicked: {msg}"));
            }
            aborter().abort(&format!("panicked: {msg}"));
            None
        }
    }
}
