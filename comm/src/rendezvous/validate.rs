//! The checks rendezvous applies to what other nodes send: a joiner's `Hello` (on the
//! coordinator) and the coordinator's `Welcome` (on a joiner). Pure functions over decoded
//! messages, so the property tests and the fuzz target (`untrusted::decode_untrusted`) run
//! exactly the checks the network path runs.

use super::Control;
use crate::tls::same_fingerprint;
use crate::topology::RankTable;
use std::net::IpAddr;

/// Most ranks one node may host.
pub const MAX_RANKS_PER_NODE: usize = 1024;

/// A joiner's hello that passed [`check_hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedHello {
    /// The node rank the joiner asked for (free, not 0), or `None` to be assigned one.
    pub node_rank: Option<usize>,
    /// The IP the joiner says it listens on, if any.
    pub listen_ip: Option<IpAddr>,
    /// The UDP port the joiner listens on.
    pub listen_port: u16,
    /// One device description per rank (1..=[`MAX_RANKS_PER_NODE`] of them).
    pub devices: Vec<String>,
}

/// The coordinator's check of a joiner's first message: the same protocol version and node
/// count, a free node rank other than 0 (or none, to be assigned), 1..=1024 ranks. `taken`
/// says whether a node rank has already joined. The error is the refusal sent back.
pub fn check_hello(
    hello: &Control,
    version: u32,
    nnodes: usize,
    taken: impl Fn(usize) -> bool,
) -> Result<AcceptedHello, String> {
    let Control::Hello {
        version: v,
        node_rank,
        nnodes: n,
        listen_ip,
        listen_port,
        devices,
        ..
    } = hello
    else {
        return Err("expected a Hello message".into());
    };
    if *v != version {
        return Err(format!(
            "protocol version mismatch: this coordinator speaks version {version}, the joining \
             node version {v}; run the same wiretrain release on every node"
        ));
    }
    if *n != nnodes {
        return Err(format!(
            "node count mismatch: the coordinator expects {nnodes} nodes, the joining node was \
             told {n}"
        ));
    }
    match *node_rank {
        Some(r) if r >= nnodes => {
            return Err(format!(
                "node rank {r} is not below the node count {nnodes}"
            ));
        }
        Some(0) => return Err("node rank 0 is the coordinator itself".into()),
        Some(r) if taken(r) => return Err(format!("node rank {r} has already joined")),
        _ => {}
    }
    if devices.is_empty() || devices.len() > MAX_RANKS_PER_NODE {
        return Err(format!(
            "a node must host 1..={MAX_RANKS_PER_NODE} ranks, not {}",
            devices.len()
        ));
    }
    Ok(AcceptedHello {
        node_rank: *node_rank,
        listen_ip: *listen_ip,
        listen_port: *listen_port,
        devices: devices.clone(),
    })
}

/// What a joiner expects of the coordinator's welcome.
#[derive(Debug, Clone)]
pub struct Expect<'a> {
    /// The node count this node was told.
    pub nnodes: usize,
    /// The ranks this node asked to host.
    pub ranks: usize,
    /// The fingerprint of the certificate the coordinator presented in the handshake.
    pub coordinator_sha256: &'a str,
    /// This node's own certificate fingerprint.
    pub own_sha256: &'a str,
}

/// Why a welcome is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadWelcome {
    /// The table does not fit this node (count, index, ranks).
    Inconsistent(String),
    /// The coordinator is not the table's node 0.
    CoordinatorCert {
        /// The fingerprint the table gives node 0.
        expected: String,
    },
    /// The table names another certificate for this node.
    OwnCert,
}

/// A joiner's check of the coordinator's answer: the node count it was told, a node index in
/// 1..n that hosts the ranks it asked for, the coordinator as the table's node 0 (by the
/// certificate it presented), and this node's own certificate in its row. (The table's own
/// shape is already validated when it is decoded.)
pub fn check_welcome(node: usize, table: &RankTable, want: &Expect) -> Result<(), BadWelcome> {
    if table.num_nodes() != want.nnodes
        || node == 0
        || node >= table.num_nodes()
        || table.ranks_on(node) != want.ranks
    {
        return Err(BadWelcome::Inconsistent(format!(
            "inconsistent rank table for node {node}"
        )));
    }
    let coordinator = &table.nodes()[0].cert_sha256;
    if !same_fingerprint(want.coordinator_sha256, coordinator) {
        return Err(BadWelcome::CoordinatorCert {
            expected: coordinator.clone(),
        });
    }
    if !same_fingerprint(&table.nodes()[node].cert_sha256, want.own_sha256) {
        return Err(BadWelcome::OwnCert);
    }
    Ok(())
}
