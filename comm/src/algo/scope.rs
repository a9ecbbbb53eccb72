//! The ranks a call spans, as a rank table of its own ([`Scope`]): the world, the node
//! sub-group (this node's ranks, as a one-node job) or the replica sub-group (this rank's lane:
//! one rank on every node). A sub-group's call is an ordinary collective on its scope's table,
//! so the executor and the phase programs know nothing of groups, and hybrid sharding (HSDP) is
//! a reduce-scatter on the node group followed by an all-reduce on the replica group, as FSDP2
//! composes it.
//!
//! The node group cuts a buffer into as many shards as there are lanes (the smallest node's
//! rank count), not into its own rank count: shard `l` is then the same positions on every
//! node, so replicas hold the same elements. On nodes with more ranks, the ranks past the
//! lanes own an empty shard and have no replica group.

use super::Layout;
use crate::op::Group;
use crate::topology::{NodeInfo, RankTable};
use std::ops::Range;
use std::sync::Arc;

/// One rank's view of a group: the group as a rank table, and where the rank sits in it.
#[derive(Debug, Clone)]
pub struct Scope {
    /// The group viewed.
    pub group: Group,
    /// The group as a rank table (its nodes, its ranks on each).
    pub table: RankTable,
    /// This rank's node in `table`.
    pub node: usize,
    /// This rank's local rank on its node in `table`.
    pub local: usize,
    /// For a one-node scope (the node group): the shards a reduce-scatter cuts into.
    shards: Option<usize>,
}

impl Scope {
    /// The view of `group` from local rank `local` of node `node` in `world`; `None` for the
    /// replica group of a rank past the lanes (no rank of that index on some node).
    pub fn of(group: Group, world: &RankTable, node: usize, local: usize) -> Option<Self> {
        // Node `at` of the group's table is node `src` of the world.
        let info = |at: usize, src: usize, devices: Vec<String>| NodeInfo {
            node: at,
            addr: world.nodes()[src].addr,
            devices,
            cert_sha256: world.nodes()[src].cert_sha256.clone(),
        };
        let (table, node_in, local_in, shards) = match group {
            Group::World => (world.clone(), node, local, None),
            Group::Node => {
                let devices = world.nodes()[node].devices.clone();
                let t =
                    RankTable::new(vec![info(0, node, devices)]).expect("one node with its ranks");
                (t, 0, local, Some(world.lanes()))
            }
            Group::Replica => {
                if local >= world.lanes() {
                    return None;
                }
                let nodes = (0..world.num_nodes())
                    .map(|n| info(n, n, vec![world.nodes()[n].devices[local].clone()]))
                    .collect();
                let t = RankTable::new(nodes).expect("one rank on every node");
                (t, node, 0, None)
            }
        };
        Some(Self {
            group,
            table,
            node: node_in,
            local: local_in,
            shards,
        })
    }

    /// This rank's rank within the group.
    pub fn rank(&self) -> usize {
        self.table.global_rank(self.node, self.local)
    }

    /// The group's size.
    pub fn size(&self) -> usize {
        self.table.world()
    }

    /// Whether the group's calls meet the node's other ranks at its barriers and work on
    /// their buffers (the world and node groups); a replica group has one rank per node.
    pub fn meets_in_node(&self) -> bool {
        self.group != Group::Replica
    }

    /// The element layout of a call on `len` elements.
    pub fn layout(&self, len: usize) -> Layout {
        match self.shards {
            Some(shards) => Layout::one_node(len, self.table.ranks_on(0), shards),
            None => Layout::new(&self.table, len),
        }
    }

    /// This rank's shard of `len` elements: what a reduce-scatter leaves it and an
    /// all-gather takes from it.
    pub fn shard(&self, len: usize) -> Range<usize> {
        self.layout(len).chunk(self.rank())
    }
}

/// One rank's view of each group (`None`: no replica group past the lanes).
#[derive(Debug, Clone)]
pub struct Scopes([Option<Arc<Scope>>; 3]);

impl Scopes {
    /// The views of every group from local rank `local` of node `node` in `world`.
    pub fn of(world: &RankTable, node: usize, local: usize) -> Self {
        Self(Group::ALL.map(|g| Scope::of(g, world, node, local).map(Arc::new)))
    }

    /// This rank's view of `group` (shared: a call takes it without copying the table).
    pub fn get(&self, group: Group) -> Option<&Arc<Scope>> {
        self.0[group.index()].as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::table_of as table;

    #[test]
    fn scopes_are_the_mesh_axes() {
        let t = table(&[3, 2]);
        let s = Scope::of(Group::Node, &t, 0, 2).unwrap();
        assert_eq!((s.size(), s.rank()), (3, 2));
        // Two lanes: the node group cuts into two shards, the third rank holds none.
        assert_eq!(s.shard(10), 10..10);
        assert_eq!(Scope::of(Group::Node, &t, 1, 1).unwrap().shard(10), 5..10);
        let r = Scope::of(Group::Replica, &t, 1, 1).unwrap();
        assert_eq!((r.size(), r.rank(), r.meets_in_node()), (2, 1, false));
        assert!(Scope::of(Group::Replica, &t, 0, 2).is_none());
        let w = Scope::of(Group::World, &t, 1, 0).unwrap();
        assert_eq!((w.size(), w.rank()), (5, 3));
        assert_eq!(w.shard(10), 6..8);
    }
}
