//! Typed errors, one enum per layer. Every variant carries the context a user needs to act:
//! which node or rank, which collective, what was expected.

use std::net::SocketAddr;
use std::time::Duration;

/// Any error of the communication layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("i/o error while {context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Formats an error with its whole source chain on one line ("a: b: c").
pub fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A configuration value that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("{field} is required ({hint})")]
    Missing {
        field: &'static str,
        hint: &'static str,
    },
}

/// A frame or message from the network that breaks the protocol.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    #[error("bad magic {found:#010x} (not a wiretrain peer, or a corrupted stream)")]
    BadMagic { found: u32 },
    #[error("unknown {field} value {value}")]
    UnknownValue { field: &'static str, value: u32 },
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    Oversized { len: u64, max: u64 },
    #[error("unexpected frame: expected {expected}, got {got}")]
    Unexpected { expected: String, got: String },
    #[error("malformed control message: {0}")]
    Malformed(String),
    #[error("announced a payload of {len} bytes, above the call's limit of {max} bytes")]
    TooLong { len: u64, max: u64 },
}

/// A failure of a link between nodes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("cannot bind a QUIC endpoint on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("connection to {peer} failed: {reason}")]
    Connect { peer: String, reason: String },
    #[error("connection to {peer} lost: {reason}")]
    Lost { peer: String, reason: String },
    #[error("protocol violation by {peer}: {source}; connection closed")]
    Protocol {
        peer: String,
        #[source]
        source: WireError,
    },
}

/// A failure during rendezvous.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    #[error(
        "refused by the coordinator at {addr}: it presented a certificate of a different job token or job id (check WIRETRAIN_TOKEN / --token-file and WIRETRAIN_JOB_ID / SLURM_JOB_ID on every node)"
    )]
    WrongToken { addr: SocketAddr },
    #[error("refused by the coordinator: {reason}")]
    Refused { reason: String },
    #[error(
        "the node at {addr} is of this job but presented a certificate other than the one pinned for it (expected sha256 {expected}, as the rank table or the launcher named it); refusing it"
    )]
    UnknownCertificate { addr: SocketAddr, expected: String },
    #[error("could not reach the coordinator at {addr} within {timeout:?}: {last_error}")]
    Unreachable {
        addr: SocketAddr,
        timeout: Duration,
        last_error: String,
    },
    #[error(
        "rendezvous timed out after {timeout:?}: {joined} of {expected} nodes joined; node ranks never seen: {missing:?}"
    )]
    Timeout {
        timeout: Duration,
        joined: usize,
        expected: usize,
        missing: Vec<usize>,
    },
    #[error("mesh set-up with node {node} failed: {reason}")]
    Mesh { node: usize, reason: String },
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// A collective that could not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    #[error("{op} seq {seq} ({bytes} bytes) on rank {rank} failed while {waiting_for}")]
    Failed {
        op: &'static str,
        seq: u64,
        bytes: usize,
        rank: usize,
        waiting_for: String,
        #[source]
        source: Box<TransportError>,
    },
    #[error(
        "{op} seq {seq} ({bytes} bytes) on rank {rank} timed out after {timeout:?} while {waiting_for}"
    )]
    Timeout {
        op: &'static str,
        seq: u64,
        bytes: usize,
        rank: usize,
        timeout: Duration,
        waiting_for: String,
    },
    #[error("{op} seq {seq} on rank {rank}: local rank {peer} of this node failed: {reason}")]
    PeerFailed {
        op: &'static str,
        seq: u64,
        rank: usize,
        peer: usize,
        reason: String,
    },
    /// A peer sent what no correct rank sends (e.g. a length past the call's limit); every
    /// rank that received it fails alike, before allocating anything for it.
    #[error("{op}: rank {rank} broke the protocol: {source}")]
    Protocol {
        op: &'static str,
        rank: usize,
        #[source]
        source: WireError,
    },
    #[error("mismatched collectives at seq {seq}: {detail}")]
    Mismatch { seq: u64, detail: String },
    #[error("invalid collective call: {0}")]
    InvalidCall(String),
    #[error("the communication worker of rank {rank} is gone ({why})")]
    WorkerGone { rank: usize, why: String },
}
