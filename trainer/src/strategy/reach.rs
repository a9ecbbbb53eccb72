//! Where a strategy's shards live and how its collectives travel ([`Reach`]): across the
//! world, inside the node with replicas across nodes (hybrid, HSDP), or inside the node with
//! nothing across (DiLoCo's inner steps). Every sharded strategy cuts, reduces and gathers
//! through these helpers, so a scope is one value rather than a flag per call site.

use std::ops::Range;
use wiretrain_comm::{CallOpts, ProcessGroup, ReduceOp, WireDtype, Work};

/// The ranks a shard spans and the ranks a reduction spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Shards span every rank; reductions and gathers span every rank.
    World,
    /// Shards span the node's ranks (the node pieces, the same positions on every node);
    /// reductions span every rank; gathers stay inside the node.
    Hybrid,
    /// Shards span the node's ranks; reductions and gathers stay inside the node.
    NodeOnly,
}

impl Reach {
    /// The reach of a strategy's shards at `scope` (without DiLoCo).
    pub fn of(scope: super::Scope) -> Self {
        match scope {
            super::Scope::World => Self::World,
            super::Scope::Node => Self::Hybrid,
        }
    }

    /// The ranges of a bucket (or unit) of `len` elements this rank owns.
    pub fn pieces(self, pg: &ProcessGroup, len: usize) -> Vec<Range<usize>> {
        match self {
            Self::World => vec![pg.shard_range(len)],
            Self::Hybrid | Self::NodeOnly => pg.node_pieces(len),
        }
    }

    /// How many elements of a bucket of `len` this rank owns.
    pub fn share(self, pg: &ProcessGroup, len: usize) -> usize {
        self.pieces(pg, len).iter().map(|r| r.len()).sum()
    }

    /// This rank's pieces of every bucket, as flat ranges, in bucket order.
    pub fn owned(self, pg: &ProcessGroup, buckets: &[Range<usize>]) -> Vec<Range<usize>> {
        buckets
            .iter()
            .flat_map(|b| {
                self.pieces(pg, b.len())
                    .into_iter()
                    .map(|r| b.start + r.start..b.start + r.end)
            })
            .collect()
    }

    /// Starts the mean all-reduce of a whole bucket (the replicated strategy).
    pub fn all_reduce(
        self,
        pg: &mut ProcessGroup,
        wire: WireDtype,
        flat: Vec<f32>,
    ) -> Work<Vec<f32>> {
        match self {
            Self::NodeOnly => pg
                .call(CallOpts::default().tag("grads"))
                .node_all_reduce(flat, ReduceOp::Mean),
            Self::World | Self::Hybrid => pg
                .call(CallOpts::wire(wire).tag("grads"))
                .all_reduce(flat, ReduceOp::Mean),
        }
    }

    /// Starts the mean reduction of a bucket's full gradient so that this rank ends with its
    /// pieces of it (the rest of the buffer is scratch).
    pub fn reduce(self, pg: &mut ProcessGroup, wire: WireDtype, flat: Vec<f32>) -> Work<Vec<f32>> {
        let call = pg.call(CallOpts::wire(wire).tag("grads"));
        match self {
            Self::World => call.reduce_scatter_in_place(flat, ReduceOp::Mean),
            Self::Hybrid => call.hybrid_reduce_in_place(flat, ReduceOp::Mean),
            Self::NodeOnly => call.node_reduce_scatter_in_place(flat, ReduceOp::Mean),
        }
    }

    /// Starts gathering a bucket of `len` elements from every rank's share (`share`: this
    /// rank's pieces, concatenated).
    pub fn gather(
        self,
        pg: &mut ProcessGroup,
        wire: WireDtype,
        share: &[f32],
        len: usize,
    ) -> Work<Vec<f32>> {
        let mut buf = vec![0.0f32; len];
        let mut at = 0;
        for r in self.pieces(pg, len) {
            let n = r.len();
            buf[r].copy_from_slice(&share[at..at + n]);
            at += n;
        }
        let call = pg.call(CallOpts::wire(wire).tag("params"));
        match self {
            Self::World => call.all_gather_in_place(buf),
            Self::Hybrid | Self::NodeOnly => call.node_gather_in_place(buf),
        }
    }

    /// Copies this rank's pieces of a reduced bucket buffer into `out`.
    pub fn take_share(self, pg: &ProcessGroup, buf: &[f32], out: &mut [f32]) {
        let mut at = 0;
        for r in self.pieces(pg, buf.len()) {
            let n = r.len();
            out[at..at + n].copy_from_slice(&buf[r]);
            at += n;
        }
    }
}
