//! What a collective call is: its kind (with the code its frames carry between nodes) and its
//! identity, the kind and the group's sequence number. Below `group` and the transports, which
//! both name calls this way.

use std::fmt;

/// The kinds of collective, with their wire codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
    P2p,
    /// All-reduce whose result is kept only where this rank owns it: its node pieces
    /// ([`ProcessGroup::node_pieces`]); no gather inside the node.
    HybridReduce,
    /// Gather inside the node only: every rank contributes its node pieces.
    NodeGather,
    /// All-reduce among the ranks of each node only (shared memory, nothing between nodes).
    NodeReduce,
    /// Reduction among the ranks of each node only, kept where this rank owns it (its node
    /// pieces, as [`OpKind::HybridReduce`]); nothing between nodes.
    NodeReduceScatter,
}

impl OpKind {
    pub const MAX_CODE: u8 = 10;

    pub fn code(self) -> u8 {
        match self {
            Self::AllReduce => 1,
            Self::ReduceScatter => 2,
            Self::AllGather => 3,
            Self::Broadcast => 4,
            Self::Barrier => 5,
            Self::P2p => 6,
            Self::HybridReduce => 7,
            Self::NodeGather => 8,
            Self::NodeReduce => 9,
            Self::NodeReduceScatter => 10,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all_reduce",
            Self::ReduceScatter => "reduce_scatter",
            Self::AllGather => "all_gather",
            Self::Broadcast => "broadcast",
            Self::Barrier => "barrier",
            Self::P2p => "p2p",
            Self::HybridReduce => "hybrid_reduce",
            Self::NodeGather => "node_gather",
            Self::NodeReduce => "node_reduce",
            Self::NodeReduceScatter => "node_reduce_scatter",
        }
    }
}

/// The identity of one collective call: its kind and the group's sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpId {
    pub kind: OpKind,
    pub seq: u64,
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.kind.name(), self.seq)
    }
}
