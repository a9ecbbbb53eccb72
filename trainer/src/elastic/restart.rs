//! An elastic local launch's bookkeeping: how far it may go on after losing nodes
//! ([`Elastic`]), each restart as the nodes of later epochs and the launcher's errors describe
//! it, and which exits count as a lost node. The restart loop is `launcher::run_local`.

use std::ffi::OsString;
use std::process::ExitStatus;
use std::time::Instant;

/// How a local launch may go on after losing nodes (`launch --nnodes MIN:N --max-restarts R`).
#[derive(Debug, Clone, Copy)]
pub struct Elastic {
    /// The fewest nodes the job may go on with.
    pub min: usize,
    /// Restarts allowed (0: the first failure ends the launch).
    pub max_restarts: usize,
    /// Add `--resume` to the node command of every restart (this binary's `train`).
    pub resume_flag: bool,
}

impl Elastic {
    /// No restarts: the first failure ends the launch.
    pub fn none(nodes: usize) -> Self {
        Self {
            min: nodes,
            max_restarts: 0,
            resume_flag: false,
        }
    }
}

/// One restart of an elastic launch, as the nodes of later epochs see it
/// (`WIRETRAIN_RESTARTS`) and the launcher reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct Restart {
    /// The epoch the restart began.
    pub epoch: usize,
    /// The nodes lost (numbered as in the epoch before).
    pub left: Vec<usize>,
    /// The nodes that joined (numbered as in the new epoch).
    pub joined: Vec<usize>,
    /// Nodes in the new epoch.
    pub world: usize,
    /// Why the epoch before ended.
    pub reason: String,
    /// "checkpoint" (the nodes restarted from the newest checkpoint) or "live" (they healed
    /// from live replicas, without restarting).
    pub recovery: &'static str,
    /// When the first node failure was seen and when the new epoch's nodes were started (ms
    /// since the Unix epoch).
    pub detected_unix_ms: u64,
    pub restarted_unix_ms: u64,
}

/// A restart in words.
pub(super) fn describe_restart(r: &Restart) -> String {
    let mut change = Vec::new();
    if !r.left.is_empty() || r.joined.is_empty() {
        change.push(format!("without {:?}", r.left));
    }
    if !r.joined.is_empty() {
        change.push(format!("joined by {:?}", r.joined));
    }
    format!(
        "epoch {} on {} node(s) {} ({})",
        r.epoch,
        r.world,
        change.join(", "),
        r.reason
    )
}

/// Whether a node process was ended by a signal (lost, not failed on its own).
pub(super) fn killed(st: ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        st.signal().is_some()
    }
    #[cfg(not(unix))]
    {
        let _ = st;
        false
    }
}

/// `at` in ms since the Unix epoch.
pub(super) fn unix_ms_at(at: Instant) -> u64 {
    let now = std::time::SystemTime::now() - at.elapsed();
    now.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Removes a flag without a value.
pub(super) fn strip_switch(args: &[OsString], flag: &str) -> Vec<OsString> {
    args.iter().filter(|a| *a != flag).cloned().collect()
}
