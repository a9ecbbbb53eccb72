//! What a collective call is: its kind (with the code its frames carry between nodes), the
//! group it spans (the whole world, or one of the two sub-groups of the node × lane mesh), and
//! its identity, the kind, the group and the group's sequence number. Below `group` and the
//! transports, which both name calls this way.

use std::fmt;

/// The kinds of collective, with their wire codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Every rank ends with the reduction of all ranks' buffers (wire code 1).
    AllReduce,
    /// Every rank ends with the reduction of its own shard (wire code 2).
    ReduceScatter,
    /// Every rank ends with all ranks' shards (wire code 3).
    AllGather,
    /// Every rank ends with the root's buffer (wire code 4).
    Broadcast,
    /// Returns once every rank has reached it (wire code 5).
    Barrier,
    /// Raw transport measurement between neighbouring nodes, not a collective
    /// ([`crate::ProcessGroup::p2p_exchange`]; wire code 6).
    P2p,
    /// A message to one rank ([`crate::ProcessGroup::send`]); not a collective, numbered
    /// apart from the collectives.
    Send,
    /// A message from one rank ([`crate::ProcessGroup::recv`]); as [`Self::Send`].
    Recv,
}

impl OpKind {
    /// The largest wire code of any kind (frames with a larger op code are rejected).
    pub const MAX_CODE: u8 = 8;

    /// The code frames between nodes carry for this kind (1 to [`Self::MAX_CODE`]).
    pub fn code(self) -> u8 {
        match self {
            Self::AllReduce => 1,
            Self::ReduceScatter => 2,
            Self::AllGather => 3,
            Self::Broadcast => 4,
            Self::Barrier => 5,
            Self::P2p => 6,
            Self::Send => 7,
            Self::Recv => 8,
        }
    }

    /// The snake-case name used in errors, logs and traces (e.g. `"all_reduce"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all_reduce",
            Self::ReduceScatter => "reduce_scatter",
            Self::AllGather => "all_gather",
            Self::Broadcast => "broadcast",
            Self::Barrier => "barrier",
            Self::P2p => "p2p",
            Self::Send => "send",
            Self::Recv => "recv",
        }
    }
}

/// The ranks a call spans. A job's ranks form a two-dimensional mesh, nodes × local ranks (as
/// torch's `DeviceMesh` with a replicate and a shard dimension), and each axis is a sub-group:
///
/// * [`Group::Node`]: the ranks of this rank's node (shared memory only, nothing crosses
///   nodes);
/// * [`Group::Replica`]: the same local rank on every node (its lane: one rank per node, only
///   QUIC between them).
///
/// Every group numbers its own calls, so a sub-group's calls never shift another group's
/// numbering, and frames between nodes carry the group with the number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Group {
    /// Every rank of the job.
    #[default]
    World,
    /// The ranks of this rank's node.
    Node,
    /// Local rank `l` of every node (only ranks below the smallest node's rank count have
    /// replicas on every node; see [`crate::ProcessGroup::group_shard`]).
    Replica,
}

impl Group {
    /// Every group, in code order.
    pub const ALL: [Group; 3] = [Group::World, Group::Node, Group::Replica];
    /// The largest wire code of any group (frames with a larger group code are rejected).
    pub const MAX_CODE: u8 = 2;

    /// The code frames between nodes carry for this group (0 to [`Self::MAX_CODE`]).
    pub fn code(self) -> u8 {
        match self {
            Self::World => 0,
            Self::Node => 1,
            Self::Replica => 2,
        }
    }

    /// The lower-case name used in errors, logs and traces (e.g. `"replica"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::World => "world",
            Self::Node => "node",
            Self::Replica => "replica",
        }
    }

    pub(crate) fn index(self) -> usize {
        self.code() as usize
    }
}

/// The identity of one collective call: its kind, its group and the group's sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpId {
    /// The collective's kind.
    pub kind: OpKind,
    /// The group the call spans.
    pub group: Group,
    /// The call's sequence number in its group (the first call is 1).
    pub seq: u64,
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.group {
            Group::World => write!(f, "{}#{}", self.kind.name(), self.seq),
            g => write!(f, "{}.{}#{}", g.name(), self.kind.name(), self.seq),
        }
    }
}
