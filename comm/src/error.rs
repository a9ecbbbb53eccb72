//! Typed errors, one enum per layer. Every variant carries the context a user needs to act:
//! which node or rank, which collective, what was expected.

use std::net::SocketAddr;
use std::time::Duration;

/// Any error of the communication layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Joining the job (rendezvous, mesh, lanes) or the goodbye at shutdown failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// A transport failure outside any collective (TLS identity, QUIC endpoint, a link).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A collective (or a call to one) failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A local I/O operation failed (starting the runtime, reading the bound address, writing
    /// the fingerprint or address file).
    #[error("i/o error while {context}: {source}")]
    Io {
        /// What the node was doing, e.g. "writing the fingerprint file".
        context: &'static str,
        /// The underlying I/O error.
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
    /// A value was given but is out of range or does not parse.
    #[error("{field}: {reason}")]
    Invalid {
        /// The setting, as the user names it (field or environment variable).
        field: &'static str,
        /// Why the value cannot be used.
        reason: String,
    },
    /// A setting that has no default was not given.
    #[error("{field} is required ({hint})")]
    Missing {
        /// The setting, as the user names it (field or environment variable).
        field: &'static str,
        /// How to provide it.
        hint: &'static str,
    },
}

/// A frame or message from the network that breaks the protocol.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// A frame or stream header does not start with [`crate::wire::MAGIC`].
    #[error("bad magic {found:#010x} (not a wiretrain peer, or a corrupted stream)")]
    BadMagic {
        /// The first four bytes received, as a little-endian u32.
        found: u32,
    },
    /// A header field holds a code this build does not know (frame kind, op, dtype, group,
    /// or a stream protocol version other than [`crate::wire::PROTOCOL_VERSION`]).
    #[error("unknown {field} value {value}")]
    UnknownValue {
        /// Which header field.
        field: &'static str,
        /// The value received.
        value: u32,
    },
    /// A frame payload or control message is longer than the fixed protocol limit
    /// ([`crate::wire::MAX_FRAME_PAYLOAD`] or [`crate::wire::MAX_CONTROL_LEN`]).
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    Oversized {
        /// The announced length, in bytes.
        len: u64,
        /// The limit, in bytes.
        max: u64,
    },
    /// A valid frame arrived, but not the one the schedule expects next.
    #[error("unexpected frame: expected {expected}, got {got}")]
    Unexpected {
        /// The expected header, described.
        expected: String,
        /// The received header, described.
        got: String,
    },
    /// A control message body is not valid JSON for the expected message; holds the parser's
    /// error.
    #[error("malformed control message: {0}")]
    Malformed(String),
    /// A peer announced a variable-length payload longer than the collective call allows.
    #[error("announced a payload of {len} bytes, above the call's limit of {max} bytes")]
    TooLong {
        /// The announced length, in bytes.
        len: u64,
        /// The call's limit, in bytes.
        max: u64,
    },
}

/// A failure of a link between nodes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The UDP socket or QUIC endpoint could not be created on the bind address.
    #[error("cannot bind a QUIC endpoint on {addr}: {source}")]
    Bind {
        /// The address that was to be bound.
        addr: SocketAddr,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Building the TLS or QUIC configuration (keys, certificates) failed; holds the reason.
    #[error("TLS setup failed: {0}")]
    Tls(String),
    /// A connection could not be established.
    #[error("connection to {peer} failed: {reason}")]
    Connect {
        /// Who was being connected to, described.
        peer: String,
        /// Why it failed.
        reason: String,
    },
    /// An established connection or stream went down.
    #[error("connection to {peer} lost: {reason}")]
    Lost {
        /// The peer of the connection, described.
        peer: String,
        /// Why it went down.
        reason: String,
    },
    /// A peer sent bytes that break the wire protocol; the connection is closed.
    #[error("protocol violation by {peer}: {source}; connection closed")]
    Protocol {
        /// The offending peer, described.
        peer: String,
        /// What was wrong with what it sent.
        #[source]
        source: WireError,
    },
}

/// A failure during rendezvous.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The coordinator's certificate was made from another job token or job id.
    #[error(
        "refused by the coordinator at {addr}: it presented a certificate of a different job token or job id (check WIRETRAIN_TOKEN / --token-file and WIRETRAIN_JOB_ID / SLURM_JOB_ID on every node)"
    )]
    WrongToken {
        /// The coordinator's address.
        addr: SocketAddr,
    },
    /// The coordinator refused this node, or the hello/welcome exchange failed.
    #[error("refused by the coordinator: {reason}")]
    Refused {
        /// Why, as the coordinator or this node stated it.
        reason: String,
    },
    /// A node of this job presented a certificate other than the one pinned for it.
    #[error(
        "the node at {addr} is of this job but presented a certificate other than the one pinned for it (expected sha256 {expected}, as the rank table or the launcher named it); refusing it"
    )]
    UnknownCertificate {
        /// The address of the node that presented it.
        addr: SocketAddr,
        /// The pinned certificate's sha256 fingerprint.
        expected: String,
    },
    /// No connection to the coordinator succeeded before the rendezvous timeout.
    #[error("could not reach the coordinator at {addr} within {timeout:?}: {last_error}")]
    Unreachable {
        /// The coordinator's address.
        addr: SocketAddr,
        /// The rendezvous timeout that passed.
        timeout: Duration,
        /// The error of the last connection attempt.
        last_error: String,
    },
    /// The coordinator did not see every node join before the rendezvous timeout.
    #[error(
        "rendezvous timed out after {timeout:?}: {joined} of {expected} nodes joined; node ranks never seen: {missing:?}"
    )]
    Timeout {
        /// The rendezvous timeout that passed.
        timeout: Duration,
        /// Nodes that joined, the coordinator included.
        joined: usize,
        /// Nodes the job expects.
        expected: usize,
        /// Node ranks no node joined as.
        missing: Vec<usize>,
    },
    /// Connecting to another node, or opening the lane streams with it, failed after the
    /// rank table was agreed.
    #[error("mesh set-up with node {node} failed: {reason}")]
    Mesh {
        /// The other node's node rank.
        node: usize,
        /// Why it failed.
        reason: String,
    },
    /// A transport failure during rendezvous.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// A collective that could not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// The link to another node failed during the collective.
    #[error("{op} seq {seq} ({bytes} bytes) on rank {rank} failed while {waiting_for}")]
    Failed {
        /// The collective's name.
        op: &'static str,
        /// The collective's sequence number in its group.
        seq: u64,
        /// The size of the collective's buffer, in bytes.
        bytes: usize,
        /// The global rank that reports the failure.
        rank: usize,
        /// What the rank was waiting for when it failed (step, frame, peer).
        waiting_for: String,
        /// The transport failure.
        #[source]
        source: Box<TransportError>,
    },
    /// The collective did not finish within the collective timeout.
    #[error(
        "{op} seq {seq} ({bytes} bytes) on rank {rank} timed out after {timeout:?} while {waiting_for}"
    )]
    Timeout {
        /// The collective's name.
        op: &'static str,
        /// The collective's sequence number in its group.
        seq: u64,
        /// The size of the collective's buffer, in bytes.
        bytes: usize,
        /// The global rank that timed out.
        rank: usize,
        /// The timeout that passed.
        timeout: Duration,
        /// What the rank was waiting for (ranks of this node, or a step and frame from a peer).
        waiting_for: String,
    },
    /// Another rank of this node failed (or left), or an earlier collective of this rank
    /// failed, so this collective cannot run.
    #[error("{op} seq {seq} on rank {rank}: local rank {peer} of this node failed: {reason}")]
    PeerFailed {
        /// The collective's name.
        op: &'static str,
        /// The collective's sequence number in its group.
        seq: u64,
        /// The global rank that reports the failure.
        rank: usize,
        /// The global rank of the rank that failed.
        peer: usize,
        /// Why it failed.
        reason: String,
    },
    /// A peer sent what no correct rank sends (e.g. a length past the call's limit); every
    /// rank that received it fails alike, before allocating anything for it.
    #[error("{op}: rank {rank} broke the protocol: {source}")]
    Protocol {
        /// The collective's name.
        op: &'static str,
        /// The rank that sent it.
        rank: usize,
        /// What was wrong with what it sent.
        #[source]
        source: WireError,
    },
    /// The ranks of this node entered different collectives (or different arguments) at the
    /// same point.
    #[error("mismatched collectives at seq {seq}: {detail}")]
    Mismatch {
        /// The sequence number at which they differ.
        seq: u64,
        /// Which local ranks called what.
        detail: String,
    },
    /// The call's arguments cannot be run (e.g. a payload that cannot fit in memory); holds
    /// why.
    #[error("invalid collective call: {0}")]
    InvalidCall(String),
    /// A send or receive between two ranks did not complete within the collective timeout;
    /// the node fails with it.
    #[error(
        "{op} (tag {tag}) between rank {rank} and rank {peer} timed out after {timeout:?}: \
         {waiting_for}"
    )]
    P2pTimeout {
        /// `send` or `recv`.
        op: &'static str,
        /// The global rank that timed out.
        rank: usize,
        /// The rank it sends to or receives from.
        peer: usize,
        /// The message's tag.
        tag: u64,
        /// The timeout that passed.
        timeout: Duration,
        /// What it waited for.
        waiting_for: String,
    },
    /// A send or receive between two ranks failed: its node, or the link to the peer's node,
    /// failed first.
    #[error("{op} (tag {tag}) between rank {rank} and rank {peer} failed: {reason}")]
    P2pFailed {
        /// `send` or `recv`.
        op: &'static str,
        /// The global rank that reports the failure.
        rank: usize,
        /// The rank it sends to or receives from.
        peer: usize,
        /// The message's tag.
        tag: u64,
        /// Why it failed.
        reason: String,
    },
    /// A receive got a message of another length than it was posted for.
    #[error(
        "recv (tag {tag}) on rank {rank}: rank {peer} sent {got} elements, this receive \
         expects {want}"
    )]
    P2pLength {
        /// The receiving rank.
        rank: usize,
        /// The sending rank.
        peer: usize,
        /// The message's tag.
        tag: u64,
        /// Elements the message holds.
        got: usize,
        /// Elements the receive was posted for.
        want: usize,
    },
    /// The rank's communication thread has stopped (it panicked, or the group shut down).
    #[error("the communication worker of rank {rank} is gone ({why})")]
    WorkerGone {
        /// The rank whose thread is gone.
        rank: usize,
        /// Why it stopped.
        why: String,
    },
}
