//! The rank table: which nodes exist, where they listen, and which ranks (devices) each hosts.
//! Global ranks are node-major: all ranks of node 0, then node 1, and so on, so ring
//! neighbours stay inside a node wherever possible. Nodes may host different rank counts.

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::ops::Range;

/// One node of the job as everyone agreed at rendezvous.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node rank, 0 is the coordinator.
    pub node: usize,
    /// The address its QUIC endpoint is reachable at.
    pub addr: SocketAddr,
    /// One description per local rank (the rank's device), in local-rank order.
    pub devices: Vec<String>,
    /// SHA-256 (hex) of the node's TLS certificate, as presented at rendezvous; every
    /// node-to-node connection pins it.
    #[serde(default)]
    pub cert_sha256: String,
}

/// The table every rank receives from the rendezvous: identical on all nodes. Deserializing
/// validates it like [`RankTable::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawTable")]
pub struct RankTable {
    nodes: Vec<NodeInfo>,
}

#[derive(Deserialize)]
struct RawTable {
    nodes: Vec<NodeInfo>,
}

impl TryFrom<RawTable> for RankTable {
    type Error = String;
    fn try_from(r: RawTable) -> Result<Self, String> {
        if r.nodes.len() > 4096 || r.nodes.iter().any(|n| n.devices.len() > 1024) {
            return Err("rank table too large".into());
        }
        RankTable::new(r.nodes)
    }
}

impl RankTable {
    /// Builds a table; nodes must be sorted by node rank 0..n and each host at least one rank.
    pub fn new(nodes: Vec<NodeInfo>) -> Result<Self, String> {
        if nodes.is_empty() {
            return Err("a job needs at least one node".into());
        }
        for (i, n) in nodes.iter().enumerate() {
            if n.node != i {
                return Err(format!("node at position {i} claims node rank {}", n.node));
            }
            if n.devices.is_empty() {
                return Err(format!("node {i} hosts no rank"));
            }
        }
        Ok(Self { nodes })
    }

    /// Every node, in node-rank order.
    pub fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }

    /// Number of nodes in the job.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Total number of ranks.
    pub fn world(&self) -> usize {
        self.nodes.iter().map(|n| n.devices.len()).sum()
    }

    /// Number of ranks hosted by `node`.
    pub fn ranks_on(&self, node: usize) -> usize {
        self.nodes[node].devices.len()
    }

    /// Global rank of the first rank on `node`.
    pub fn first_rank(&self, node: usize) -> usize {
        self.nodes[..node].iter().map(|n| n.devices.len()).sum()
    }

    /// Global rank of (node, local rank).
    pub fn global_rank(&self, node: usize, local: usize) -> usize {
        self.first_rank(node) + local
    }

    /// (node, local rank) of a global rank.
    pub fn locate(&self, rank: usize) -> (usize, usize) {
        let mut first = 0;
        for n in &self.nodes {
            if rank < first + n.devices.len() {
                return (n.node, rank - first);
            }
            first += n.devices.len();
        }
        panic!("rank {rank} outside world {}", self.world());
    }

    /// Global ranks hosted by `node`.
    pub fn ranks_of(&self, node: usize) -> Range<usize> {
        let f = self.first_rank(node);
        f..f + self.ranks_on(node)
    }

    /// Number of parallel cross-node rings ("lanes"): the smallest rank count of any node.
    /// Local rank `l < lanes()` of every node runs ring `l`.
    pub fn lanes(&self) -> usize {
        self.nodes
            .iter()
            .map(|n| n.devices.len())
            .min()
            .unwrap_or(1)
    }

    /// A human description of a node for error messages: "node 1 (ranks 2-3 at 127.0.0.2:4000)".
    pub fn describe_node(&self, node: usize) -> String {
        match self.nodes.get(node) {
            Some(n) => {
                let r = self.ranks_of(node);
                let ranks = if r.len() == 1 {
                    format!("rank {}", r.start)
                } else {
                    format!("ranks {}-{}", r.start, r.end - 1)
                };
                format!("node {node} ({ranks} at {})", n.addr)
            }
            None => format!("node {node}"),
        }
    }
}

/// Splits `range` into `parts` contiguous pieces whose lengths differ by at most one; the
/// first `len % parts` pieces are one element longer.
pub fn split(range: Range<usize>, parts: usize) -> Vec<Range<usize>> {
    assert!(parts > 0, "split into zero parts");
    let len = range.len();
    let (base, extra) = (len / parts, len % parts);
    let mut out = Vec::with_capacity(parts);
    let mut at = range.start;
    for i in 0..parts {
        let l = base + usize::from(i < extra);
        out.push(at..at + l);
        at += l;
    }
    out
}

/// A rank table of `shape[n]` ranks on node n at 127.0.0.(n+1):1000 (no certificates): the
/// topology the pure tests run on.
#[cfg(test)]
pub(crate) fn table_of(shape: &[usize]) -> RankTable {
    RankTable::new(
        shape
            .iter()
            .enumerate()
            .map(|(i, &k)| NodeInfo {
                node: i,
                addr: format!("127.0.0.{}:1000", i + 1)
                    .parse()
                    .expect("an address"),
                devices: vec!["cpu".into(); k],
                cert_sha256: String::new(),
            })
            .collect(),
    )
    .expect("a valid shape")
}

/// The element range of rank `rank`'s shard of a buffer of `len` elements over `world` ranks.
pub fn shard_range(len: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (len / world, len % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::table_of as table;
    use super::*;

    #[test]
    fn node_major_ranks() {
        let t = table(&[2, 3, 1]);
        assert_eq!(t.world(), 6);
        assert_eq!(t.global_rank(1, 2), 4);
        assert_eq!(t.locate(4), (1, 2));
        assert_eq!(t.locate(5), (2, 0));
        assert_eq!(t.lanes(), 1);
        assert_eq!(t.ranks_of(1), 2..5);
        assert_eq!(t.describe_node(1), "node 1 (ranks 2-4 at 127.0.0.2:1000)");
    }

    #[test]
    fn split_matches_shard_range() {
        for len in [0, 1, 7, 10, 11, 1000] {
            for world in 1..9 {
                let s = split(0..len, world);
                assert_eq!(s.iter().map(|r| r.len()).sum::<usize>(), len);
                for (r, piece) in s.iter().enumerate() {
                    assert_eq!(*piece, shard_range(len, world, r));
                    assert!(piece.len() + 1 >= len / world && piece.len() <= len / world + 1);
                }
            }
        }
    }

    #[test]
    fn deserializing_validates() {
        let good = serde_json::to_string(&table(&[1, 2])).unwrap();
        assert_eq!(
            serde_json::from_str::<RankTable>(&good).unwrap(),
            table(&[1, 2])
        );
        let bad = good.replace("\"node\":1", "\"node\":7");
        assert!(serde_json::from_str::<RankTable>(&bad).is_err());
        let empty = r#"{"nodes":[{"node":0,"addr":"127.0.0.1:1","devices":[]}]}"#;
        assert!(serde_json::from_str::<RankTable>(empty).is_err());
    }

    #[test]
    fn rejects_bad_tables() {
        assert!(RankTable::new(vec![]).is_err());
        let mut t = table(&[1, 1]).nodes;
        t[1].devices.clear();
        assert!(RankTable::new(t).is_err());
    }
}
