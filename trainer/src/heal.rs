//! Replica healing: a node whose peer is lost keeps its process, its model and its optimizer
//! state, asks its elastic launcher for its place in the next job epoch, joins that epoch
//! in-process and goes on from the live state, with no checkpoint read ([`crate::fit`] does
//! the rest: rebinding the trainer, agreeing on the state, redoing the step cut off).
//!
//! The launcher and its node processes talk through files in the heal directory
//! (`WIRETRAIN_HEAL_DIR`, which `wiretrain launch --max-restarts` sets): a node that lost its
//! job writes `ready-<pid>.json` ([`Ready`]); the launcher answers with `assign-<pid>.json`
//! ([`Answer`]): the node's rank, the world and the coordinator of the new epoch, or a stop
//! (the launcher restarts from a checkpoint instead). Every file is written whole (a
//! temporary file, then a rename). A node waits for its answer at most [`Healer::wait`].
//!
//! One [`Healer`] serves all local ranks of a node: each rank's thread calls
//! [`Healer::rejoin`]; the last to arrive drops the old [`Node`], asks, joins the new epoch
//! and hands every rank its new [`ProcessGroup`].

use crate::job::{Elastic, JobOptions};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use wiretrain_comm::abort::Aborter;
use wiretrain_comm::{Node, ProcessGroup};

/// Why a node could not heal (it then fails as it would without healing).
#[derive(Debug, thiserror::Error)]
pub enum HealError {
    /// The launcher's answer did not come within the heal wait.
    #[error("no answer from the elastic launcher in {dir} within {secs:.0} s")]
    NoAnswer {
        /// The heal directory.
        dir: PathBuf,
        /// The wait, in seconds.
        secs: f64,
    },
    /// The launcher answered with a stop (its reason): it restarts from a checkpoint instead.
    #[error("the elastic launcher does not heal this failure: {0}")]
    Refused(String),
    /// Writing the ready file or reading the answer failed.
    #[error("the heal directory {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The answer is too large, not JSON of an [`Answer`], or an assignment that does not fit
    /// (node rank out of range, epoch not later, options the node cannot join with).
    #[error("the launcher's answer {path} is not valid: {reason}")]
    BadAnswer {
        /// The answer file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Joining the new epoch's job failed.
    #[error("joining epoch {epoch}: {source}")]
    Join {
        /// The epoch being joined.
        epoch: u64,
        /// The communication layer's error.
        #[source]
        source: wiretrain_comm::Error,
    },
    /// The stop flag was raised while waiting for the answer.
    #[error("stopped by a signal while waiting for the next epoch")]
    Stopped,
    /// Another local rank abandoned the heal or its heal failed (that error, in words), or
    /// the node's ranks did not all arrive in time.
    #[error("another local rank could not heal: {0}")]
    Other(String),
}

/// What a node that lost its job tells the launcher.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Ready {
    /// The node process's id (the answer file is named by it).
    pub pid: u32,
    /// The epoch it lost.
    pub epoch: u64,
    /// Steps its state holds (the smallest over its local ranks).
    pub step: usize,
    /// The error that ended the epoch for it.
    pub reason: String,
    /// When it wrote this, in ms since the Unix epoch.
    pub unix_ms: u64,
}

/// A node's place in the next epoch.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Assignment {
    /// The new epoch (later than the one lost).
    pub epoch: u64,
    /// Node processes in the new epoch.
    pub nnodes: usize,
    /// This node's rank in it (0 hosts the coordinator).
    pub node_rank: usize,
    /// The coordinator (node 0 binds it, port 0 for any).
    pub master: String,
    /// The local address to bind, if set.
    pub bind: Option<SocketAddr>,
    /// Node 0 writes its bound address here.
    pub addr_file: Option<PathBuf>,
    /// Node 0 writes its certificate's SHA-256 here.
    pub fingerprint_file: Option<PathBuf>,
    /// Node 0's certificate, pinned by the others.
    pub master_sha256: Option<String>,
    /// The launch's restarts and heals so far (as `WIRETRAIN_RESTARTS`).
    pub restarts: serde_json::Value,
    /// The nodes of the new epoch that start fresh and receive the state (a growth in place).
    #[serde(default)]
    pub joined: Vec<usize>,
}

/// The launcher's answer to [`Ready`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// Join the next epoch in this place.
    Assign(Assignment),
    /// No heal: the node fails (its launcher restarts the job from a checkpoint).
    Stop(String),
}

/// The file a node writes when it has lost its job.
pub fn ready_file(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("ready-{pid}.json"))
}

/// The file a launcher writes to ask a node to leave its epoch after its step, alive, to be
/// moved into the next one (the world grows in place).
pub fn regroup_file(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("regroup-{pid}"))
}

/// The file in which a node says whether it can go on in place into a next epoch.
pub fn capable_file(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("capable-{pid}.json"))
}

/// The file the launcher answers in.
pub fn answer_file(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("assign-{pid}.json"))
}

/// How long a node waits for its launcher's answer when the launcher gives its nodes `grace`
/// to stop: the launcher answers once every node reported (or `grace` has passed) and the next
/// epoch is agreed, so the wait is the grace period and a minute, never under the default 60 s
/// (before, a fixed 60 s: a `--grace` above it made every heal fail with no answer).
pub fn answer_wait(grace: Duration) -> Duration {
    (grace + Duration::from_secs(60)).max(Duration::from_secs(60))
}

/// Removes the files of node process `pid` (ready, answer, capable, regroup) once it has
/// ended, so that a process given the same pid later finds none of them.
pub fn forget(dir: &Path, pid: u32) {
    for f in [
        ready_file(dir, pid),
        answer_file(dir, pid),
        capable_file(dir, pid),
        regroup_file(dir, pid),
    ] {
        let _ = std::fs::remove_file(f);
    }
}

/// Writes `value` as JSON to `path` whole: a temporary file, then a rename.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// A rank's new place after a heal.
pub struct Rejoined {
    /// The rank's process group in the new epoch.
    pub pg: ProcessGroup,
    /// The new epoch and the launch's restarts and heals so far.
    pub elastic: Elastic,
    /// Nodes of the new epoch start fresh and receive the state (they build their trainer
    /// and then agree, so the others meet them in the same collectives).
    pub joined: bool,
}

struct Round {
    node: Option<Node>,
    /// Ranks that arrived in this round, and the smallest step among them.
    arrived: usize,
    step: usize,
    reason: String,
    round: u64,
    /// The new groups by local rank, and the epoch's record, once the round is done.
    groups: Vec<Option<ProcessGroup>>,
    aborters: Vec<Option<Aborter>>,
    outcome: Option<Result<(Elastic, bool), String>>,
    epoch: u64,
    /// A local rank that ended without healing (its error): the others stop waiting.
    abandoned: Option<String>,
}

/// A node's healing: holds its [`Node`] and brings its local ranks into the next epoch.
pub struct Healer {
    dir: PathBuf,
    opts: JobOptions,
    devices: Vec<String>,
    ranks: usize,
    stop: Arc<AtomicBool>,
    /// How long a node waits for the launcher's answer.
    pub wait: Duration,
    state: Mutex<Round>,
    cv: Condvar,
    /// Raised when the launcher asks this node to regroup (see [`regroup_file`]).
    regroup: Arc<AtomicBool>,
}

impl std::fmt::Debug for Healer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Healer")
            .field("dir", &self.dir)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

impl Healer {
    /// The healer of `node`, joined with `opts` (whose heal directory is `dir`), its ranks on
    /// `devices`.
    pub fn new(
        dir: PathBuf,
        opts: JobOptions,
        devices: Vec<String>,
        node: Node,
        stop: Arc<AtomicBool>,
    ) -> Self {
        let ranks = opts.ranks();
        let epoch = opts.epoch.unwrap_or(0);
        let wait = opts.heal_wait.unwrap_or(Duration::from_secs(60));
        Self {
            dir,
            opts,
            devices,
            ranks,
            stop,
            wait,
            state: Mutex::new(Round {
                node: Some(node),
                arrived: 0,
                step: usize::MAX,
                reason: String::new(),
                round: 0,
                groups: Vec::new(),
                aborters: Vec::new(),
                outcome: None,
                epoch,
                abandoned: None,
            }),
            cv: Condvar::new(),
            regroup: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The flag raised when the launcher asks this node to leave its epoch after its step,
    /// alive (a growth in place); [`crate::engine::Trainer::set_regroup_flag`] makes every
    /// rank leave after the same step. A thread watches for the request (until the process
    /// ends).
    pub fn regroup_flag(&self) -> Arc<AtomicBool> {
        static WATCHING: std::sync::Once = std::sync::Once::new();
        let (flag, file) = (
            self.regroup.clone(),
            regroup_file(&self.dir, std::process::id()),
        );
        WATCHING.call_once(|| {
            let _ = std::thread::Builder::new()
                .name("wiretrain-regroup".into())
                .spawn(move || {
                    loop {
                        if file.exists() {
                            let _ = std::fs::remove_file(&file);
                            flag.store(true, Ordering::SeqCst);
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                });
        });
        self.regroup.clone()
    }

    /// Says (once per node) whether this node can go on in place into a next epoch.
    pub fn capable(&self, live: bool) {
        let f = capable_file(&self.dir, std::process::id());
        if !f.exists() {
            let _ = write_json(&f, &serde_json::json!({ "live": live }));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Round> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node of the current epoch (at the end of the run).
    pub fn take_node(&self) -> Option<Node> {
        self.lock().node.take()
    }

    /// The aborter of local rank `local`'s current process group (after a heal, the new
    /// epoch's), `None` before any heal.
    pub fn aborter(&self, local: usize) -> Option<Aborter> {
        self.lock().aborters.get(local).cloned().flatten()
    }

    /// A local rank ended without healing (`why`): ranks waiting for it in
    /// [`Healer::rejoin`] fail at once.
    pub fn abandon(&self, why: &str) {
        let mut st = self.lock();
        st.abandoned.get_or_insert_with(|| why.to_string());
        self.cv.notify_all();
    }

    /// Local rank `local` lost its job with `reason`, its state holding `step` steps: waits
    /// for every local rank, then (the last to arrive) drops the old node, asks the launcher
    /// and joins the next epoch. Returns this rank's new process group.
    pub fn rejoin(&self, local: usize, step: usize, reason: &str) -> Result<Rejoined, HealError> {
        let mut st = self.lock();
        if let Some(why) = &st.abandoned {
            return Err(HealError::Other(why.clone()));
        }
        let round = st.round;
        st.arrived += 1;
        st.step = st.step.min(step);
        if st.reason.is_empty() {
            st.reason = reason.to_string();
        }
        if st.arrived == self.ranks {
            let outcome = match st.abandoned.clone() {
                Some(why) => Err(HealError::Other(why)),
                None => self.heal_node(&mut st),
            };
            st.outcome = Some(outcome.as_ref().map_err(|e| e.to_string()).cloned());
            self.regroup.store(false, Ordering::SeqCst);
            st.arrived = 0;
            st.step = usize::MAX;
            st.reason.clear();
            st.round += 1;
            self.cv.notify_all();
            outcome?;
        } else {
            let limit = self.wait + Duration::from_secs(60);
            let t0 = Instant::now();
            while st.round == round {
                if let Some(why) = st.abandoned.clone() {
                    st.arrived -= 1;
                    return Err(HealError::Other(why));
                }
                let left = limit.saturating_sub(t0.elapsed());
                if left.is_zero() {
                    st.arrived -= 1;
                    return Err(HealError::Other(
                        "the node's other ranks did not reach the heal".into(),
                    ));
                }
                st = self
                    .cv
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        let (elastic, joined) = match st.outcome.clone() {
            Some(Ok(e)) => e,
            Some(Err(e)) => return Err(HealError::Other(e)),
            None => return Err(HealError::Other("no outcome".into())),
        };
        let pg = st
            .groups
            .get_mut(local)
            .and_then(Option::take)
            .ok_or_else(|| HealError::Other(format!("no process group for local rank {local}")))?;
        Ok(Rejoined {
            pg,
            elastic,
            joined,
        })
    }

    /// Waits (up to the heal wait) for the launcher's answer at `answer_path`, then takes it
    /// away: the assignment into a later epoch than `epoch`, or why the launcher refused.
    fn await_answer(&self, answer_path: &Path, epoch: u64) -> Result<Assignment, HealError> {
        let io = |source| HealError::Io {
            path: answer_path.to_path_buf(),
            source,
        };
        let t0 = Instant::now();
        let bytes = loop {
            if self.stop.load(Ordering::SeqCst) {
                return Err(HealError::Stopped);
            }
            match std::fs::metadata(answer_path).and_then(|m| {
                if m.len() > 1 << 20 {
                    Err(std::io::Error::other(format!(
                        "{} bytes (at most 1 MiB)",
                        m.len()
                    )))
                } else {
                    std::fs::read(answer_path)
                }
            }) {
                Ok(b) => break b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(e)),
            }
            if t0.elapsed() > self.wait {
                return Err(HealError::NoAnswer {
                    dir: self.dir.clone(),
                    secs: self.wait.as_secs_f64(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = std::fs::remove_file(answer_path);
        let bad = |reason: String| HealError::BadAnswer {
            path: answer_path.to_path_buf(),
            reason,
        };
        if bytes.len() > 1 << 20 {
            return Err(bad(format!("{} bytes (at most 1 MiB)", bytes.len())));
        }
        let a = match serde_json::from_slice::<Answer>(&bytes).map_err(|e| bad(e.to_string()))? {
            Answer::Stop(why) => return Err(HealError::Refused(why)),
            Answer::Assign(a) => a,
        };
        if a.node_rank >= a.nnodes || a.epoch <= epoch {
            return Err(bad(format!(
                "node {} of {} in epoch {} (this node was in epoch {epoch})",
                a.node_rank, a.nnodes, a.epoch
            )));
        }
        Ok(a)
    }

    /// The node's part of a heal (under the lock): the old node goes, the launcher's answer,
    /// the new node.
    fn heal_node(&self, st: &mut Round) -> Result<(Elastic, bool), HealError> {
        // The old node's connections close; its peers (if any are alive) see it leave.
        drop(st.node.take());
        let pid = std::process::id();
        let ready = Ready {
            pid,
            epoch: st.epoch,
            step: st.step,
            reason: st.reason.clone(),
            unix_ms: unix_ms(),
        };
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HealError::Io { path, source }
        };
        let answer_path = answer_file(&self.dir, pid);
        let _ = std::fs::remove_file(&answer_path);
        let ready_path = ready_file(&self.dir, pid);
        write_json(&ready_path, &ready).map_err(io(&ready_path))?;
        let a = self.await_answer(&answer_path, st.epoch)?;
        let bad = |reason: String| HealError::BadAnswer {
            path: answer_path.clone(),
            reason,
        };
        let mut opts = self.opts.clone();
        opts.nnodes = Some(a.nnodes);
        opts.node_rank = Some(a.node_rank);
        opts.master = Some(a.master.clone());
        opts.bind = a.bind;
        opts.addr_file = a.addr_file.clone();
        opts.fingerprint_file = a.fingerprint_file.clone();
        opts.master_sha256 = a.master_sha256.clone();
        opts.epoch = Some(a.epoch);
        let mut cfg = opts.node_config().map_err(|e| bad(e.to_string()))?;
        cfg.devices(self.devices.clone())
            .map_err(|e| bad(e.to_string()))?;
        let mut node = Node::join(cfg).map_err(|source| HealError::Join {
            epoch: a.epoch,
            source,
        })?;
        let groups = node.take_groups();
        st.aborters = groups.iter().map(|g| Some(g.aborter())).collect();
        st.groups = groups.into_iter().map(Some).collect();
        st.node = Some(node);
        st.epoch = a.epoch;
        tracing::info!(
            epoch = a.epoch,
            nnodes = a.nnodes,
            node = a.node_rank,
            "healed: joined the next epoch"
        );
        Ok((
            Elastic {
                epoch: a.epoch,
                restarts: a.restarts,
            },
            !a.joined.is_empty(),
        ))
    }
}

/// Now, in milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
