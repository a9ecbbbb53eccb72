//! Where a strategy's shards live and how its collectives travel ([`Reach`]): across the
//! world, inside the node with replicas across nodes (hybrid, HSDP), or inside the node with
//! nothing across (DiLoCo's inner steps). Every sharded strategy cuts, reduces and gathers
//! through these helpers, so a scope is one value rather than a flag per call site. The node
//! scopes are ordinary collectives on the process group's sub-groups ([`Group::Node`],
//! [`Group::Replica`]), as FSDP2 composes HSDP from a shard group and a replicate group.

use std::ops::Range;
use wiretrain_comm::{CallOpts, Group, ProcessGroup, ReduceOp, WireDtype, Work};

/// The ranks a shard spans and the ranks a reduction spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Shards span every rank; reductions and gathers span every rank.
    World,
    /// Shards span the node's ranks (the node group's shards, the same positions on every
    /// node); reductions span every rank; gathers stay inside the node.
    Hybrid,
    /// Shards span the node's ranks; reductions and gathers stay inside the node.
    NodeOnly,
}

impl Reach {
    /// The reach of a strategy's shards at `scope` (without DiLoCo).
    pub(crate) fn of(scope: super::Scope) -> Self {
        match scope {
            super::Scope::World => Self::World,
            super::Scope::Node => Self::Hybrid,
        }
    }

    /// Whether a reduction over this reach travels between nodes (in the wire dtype).
    pub(crate) fn crosses_nodes(self, pg: &ProcessGroup) -> bool {
        self != Self::NodeOnly && pg.table().num_nodes() > 1
    }

    /// The range of a bucket (or unit) of `len` elements this rank owns: its shard in the
    /// group its shards span.
    pub(crate) fn shard(self, pg: &ProcessGroup, len: usize) -> Range<usize> {
        match self {
            Self::World => pg.shard_range(len),
            Self::Hybrid | Self::NodeOnly => pg.group_shard(Group::Node, len),
        }
    }

    /// How many elements of a bucket of `len` this rank owns.
    pub(crate) fn share(self, pg: &ProcessGroup, len: usize) -> usize {
        self.shard(pg, len).len()
    }

    /// This rank's shard of every bucket, as flat ranges, in bucket order.
    pub(crate) fn owned(self, pg: &ProcessGroup, buckets: &[Range<usize>]) -> Vec<Range<usize>> {
        buckets
            .iter()
            .map(|b| {
                let r = self.shard(pg, b.len());
                b.start + r.start..b.start + r.end
            })
            .collect()
    }

    /// Starts the mean all-reduce of a whole bucket (the replicated strategy).
    pub(crate) fn all_reduce(
        self,
        pg: &mut ProcessGroup,
        wire: WireDtype,
        flat: Vec<f32>,
    ) -> Work<Vec<f32>> {
        match self {
            Self::NodeOnly => pg
                .call(CallOpts::default().on(Group::Node).tag("grads"))
                .all_reduce(flat, ReduceOp::Mean),
            Self::World | Self::Hybrid => pg
                .call(CallOpts::wire(wire).tag("grads"))
                .all_reduce(flat, ReduceOp::Mean),
        }
    }

    /// Starts the mean reduction of a bucket's full gradient so that this rank ends with its
    /// shard of it (the rest of the buffer is scratch).
    pub(crate) fn reduce(
        self,
        pg: &mut ProcessGroup,
        wire: WireDtype,
        flat: Vec<f32>,
    ) -> Work<Vec<f32>> {
        let opts = CallOpts::wire(wire).tag("grads");
        match self {
            Self::World => pg.call(opts).reduce_scatter_in_place(flat, ReduceOp::Mean),
            Self::Hybrid => pg.call(opts).hybrid_reduce_in_place(flat, ReduceOp::Mean),
            Self::NodeOnly => pg
                .call(opts.on(Group::Node))
                .reduce_scatter_in_place(flat, ReduceOp::Mean),
        }
    }

    /// Starts gathering a bucket of `len` elements from every rank's share (`share`: this
    /// rank's shard of it).
    pub(crate) fn gather(
        self,
        pg: &mut ProcessGroup,
        wire: WireDtype,
        share: &[f32],
        len: usize,
    ) -> Work<Vec<f32>> {
        let mut buf = vec![0.0f32; len];
        buf[self.shard(pg, len)].copy_from_slice(share);
        let opts = CallOpts::wire(wire).tag("params");
        match self {
            Self::World => pg.call(opts).all_gather_in_place(buf),
            Self::Hybrid | Self::NodeOnly => pg.call(opts.on(Group::Node)).all_gather_in_place(buf),
        }
    }

    /// Copies this rank's shard of a reduced bucket buffer into `out`.
    pub(crate) fn take_share(self, pg: &ProcessGroup, buf: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&buf[self.shard(pg, buf.len())]);
    }
}
