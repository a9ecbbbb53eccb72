//! One collective call with its own options ([`CallOpts`]): the wire dtype between nodes and a
//! tag for the flight recorder and traces apply to that call only, so no caller sets and
//! restores state on the group. `pg.call(opts).all_reduce(buf, op)`; the plain
//! [`ProcessGroup`] methods are the same calls with default options.

use super::{ProcessGroup, ReduceOp, Work, keep_or_leak};
use crate::op::OpKind;
use crate::wire::WireDtype;
use std::mem::ManuallyDrop;

/// Options of one collective call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOpts {
    /// Element type of the ring frames between nodes (reductions and gathers); `None` is the
    /// group's default ([`ProcessGroup::set_wire_dtype`], f32 unless set). Every rank must pass
    /// the same dtype for the same collective (a mismatch is a protocol error naming both).
    pub wire: Option<WireDtype>,
    /// A label kept with the call in the flight recorder (and so in traces and dumps), e.g.
    /// "grad bucket" or "unit gather".
    pub tag: Option<&'static str>,
}

impl CallOpts {
    /// Options with this wire dtype.
    pub fn wire(wire: WireDtype) -> Self {
        Self {
            wire: Some(wire),
            tag: None,
        }
    }

    /// The same options with this tag.
    pub fn tag(self, tag: &'static str) -> Self {
        Self {
            tag: Some(tag),
            ..self
        }
    }
}

/// A collective about to be submitted with its options; see [`ProcessGroup::call`].
#[must_use = "a Call does nothing until one of its collectives is called"]
pub struct Call<'a> {
    pg: &'a mut ProcessGroup,
    opts: CallOpts,
}

impl ProcessGroup {
    /// The next collective with `opts`: `pg.call(CallOpts::wire(WireDtype::Bf16)).all_reduce(..)`.
    pub fn call(&mut self, opts: CallOpts) -> Call<'_> {
        Call { pg: self, opts }
    }
}

impl Call<'_> {
    /// Sums (or averages) `buf` across all ranks, in place.
    pub fn all_reduce(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::AllReduce, buf, 0, op)
    }

    /// Reduces `buf` (the full buffer, used as scratch) across ranks and returns this rank's
    /// shard, `shard_range(buf.len())`.
    pub fn reduce_scatter(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        let range = self.pg.shard_range(buf.len());
        self.pg.submit(
            OpKind::ReduceScatter,
            4 * buf.len(),
            self.opts,
            move |ex, id| {
                let mut buf = ManuallyDrop::new(buf);
                let len = buf.len();
                let r = ex.collective(id, &mut buf, len, 0, op);
                keep_or_leak(r, buf).map(|b| b[range].to_vec())
            },
        )
    }

    /// In-place reduce-scatter: `buf` comes back with the reduced shard at
    /// `shard_range(buf.len())` (the rest is scratch). No allocation.
    pub fn reduce_scatter_in_place(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::ReduceScatter, buf, 0, op)
    }

    /// In-place all-gather: `buf` is the full buffer with this rank's shard already at
    /// `shard_range(buf.len())`; it comes back complete. No allocation.
    pub fn all_gather_in_place(self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.whole(OpKind::AllGather, buf, 0, ReduceOp::Sum)
    }

    /// Gathers every rank's shard of a `total`-element buffer; `shard` must have
    /// `shard_range(total).len()` elements.
    pub fn all_gather(self, shard: Vec<f32>, total: usize) -> Work<Vec<f32>> {
        let range = self.pg.shard_range(total);
        if shard.len() != range.len() {
            let why = format!(
                "all_gather on rank {}: shard has {} elements, but rank {}'s shard of {total} is {}",
                self.pg.rank,
                shard.len(),
                self.pg.rank,
                range.len()
            );
            return self.pg.invalid(OpKind::AllGather, why);
        }
        self.pg
            .submit(OpKind::AllGather, 4 * total, self.opts, move |ex, id| {
                let mut buf = ManuallyDrop::new(vec![0.0f32; total]);
                buf[range].copy_from_slice(&shard);
                let r = ex.collective(id, &mut buf, total, 0, ReduceOp::Sum);
                keep_or_leak(r, buf)
            })
    }

    /// Hybrid sharding's gradient reduction, in place: `buf` comes back reduced over all ranks
    /// on [`ProcessGroup::node_pieces`] (the rest is scratch). Inside a node it is a
    /// reduce-scatter over shared memory; across nodes only the pieces travel, each lane
    /// all-reducing its own (HSDP: shard inside the node, replicate across nodes).
    pub fn hybrid_reduce_in_place(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::HybridReduce, buf, 0, op)
    }

    /// Gather inside the node: `buf` holds this rank's values on its node pieces and comes
    /// back complete from the node's other ranks, with no traffic between nodes.
    pub fn node_gather_in_place(self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.whole(OpKind::NodeGather, buf, 0, ReduceOp::Sum)
    }

    /// All-reduce among the ranks of this rank's node only, in place, over shared memory: no
    /// byte crosses nodes (DiLoCo's inner steps). Mean divides by the node's rank count.
    pub fn node_all_reduce(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::NodeReduce, buf, 0, op)
    }

    /// Reduction among the ranks of this rank's node only, in place, over shared memory:
    /// `buf` comes back reduced over the node on [`ProcessGroup::node_pieces`] (the rest is
    /// scratch) and no byte crosses nodes (DiLoCo's inner steps with sharding inside the
    /// node). Mean divides by the node's rank count.
    pub fn node_reduce_scatter_in_place(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::NodeReduceScatter, buf, 0, op)
    }

    /// A collective of `kind` on the whole of `buf`, in place (`arg`: broadcast's root).
    pub(super) fn whole(
        self,
        kind: OpKind,
        buf: Vec<f32>,
        arg: usize,
        op: ReduceOp,
    ) -> Work<Vec<f32>> {
        self.pg
            .submit(kind, 4 * buf.len(), self.opts, move |ex, id| {
                let mut buf = ManuallyDrop::new(buf);
                let len = buf.len();
                let r = ex.collective(id, &mut buf, len, arg, op);
                keep_or_leak(r, buf)
            })
    }
}
