//! Why a launch failed ([`LaunchError`]): what the launcher reports, and the exit code it
//! gives the job.

use std::process::ExitStatus;
use std::time::Duration;

/// Why a local launch failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A node process could not be started.
    #[error("cannot start node {node}: {source}")]
    Spawn {
        /// The node's number.
        node: usize,
        /// The spawn's error.
        #[source]
        source: std::io::Error,
    },
    /// Node 0 did not write its address within the time given.
    #[error("node 0 did not report its address within {0:?}")]
    NoAddress(Duration),
    /// Node 0 exited, with this status, before it wrote its address.
    #[error("node 0 exited before listening ({0})")]
    EarlyExit(ExitStatus),
    /// Nodes failed; `code` is the first failed node's exit code (128 + signal when killed).
    #[error("{}", .failures.join("; "))]
    Failed {
        /// Each failed node's failure, in words.
        failures: Vec<String>,
        /// The first failed node's exit code.
        code: i32,
    },
    /// An I/O error of the launcher itself (its temporary files, its runtime).
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// A signal stopped the job: the nodes finished their step and exited.
    #[error("stopped by a signal; the nodes finished their step and exited")]
    Interrupted,
    /// The signal handler could not be installed.
    #[error("{0}")]
    Signal(String),
    /// The elastic rendezvous across machines failed (unreachable, refused, lost).
    #[error("{0}")]
    Rendezvous(String),
}
