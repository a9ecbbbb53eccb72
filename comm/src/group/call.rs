//! One collective call with its own options ([`CallOpts`]): the group it spans (the world, or
//! a sub-group of the node × lane mesh), the wire dtype between nodes and a tag for the flight
//! recorder and traces apply to that call only, so no caller sets and restores state on the
//! group. `pg.call(opts).all_reduce(buf, op)`; the plain [`ProcessGroup`] methods are the same
//! calls with default options (the world, the group's wire dtype, no tag).

use super::{ProcessGroup, ReduceOp, Work, keep_or_park};
use crate::op::{Group, OpKind};
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
    /// The ranks the call spans: every rank (the default), this rank's node, or its replicas
    /// (the same local rank on every node). Each group numbers its own calls.
    pub group: Group,
}

impl CallOpts {
    /// Options with this wire dtype.
    pub fn wire(wire: WireDtype) -> Self {
        Self {
            wire: Some(wire),
            ..Self::default()
        }
    }

    /// The same options for a call on `group`.
    pub fn on(self, group: Group) -> Self {
        Self { group, ..self }
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
    /// Sums (or averages) `buf` across the group's ranks, in place.
    pub fn all_reduce(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::AllReduce, buf, 0, op)
    }

    /// Reduces `buf` (the full buffer, used as scratch) across the group's ranks and returns
    /// this rank's shard, [`ProcessGroup::group_shard`].
    pub fn reduce_scatter(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        let range = self.pg.group_shard(self.opts.group, buf.len());
        if self.pg.group_rank(self.opts.group).is_none() {
            return self
                .pg
                .outside(OpKind::ReduceScatter, self.opts.group, buf.len());
        }
        self.pg.submit(
            OpKind::ReduceScatter,
            4 * buf.len(),
            self.opts,
            move |ex, id| {
                let mut buf = ManuallyDrop::new(buf);
                let r = ex.collective(id, &mut buf, 0, op);
                keep_or_park(ex, r, buf).map(|b| b[range].to_vec())
            },
        )
    }

    /// In-place reduce-scatter: `buf` comes back with the reduced shard at
    /// [`ProcessGroup::group_shard`] (the rest is scratch). No allocation.
    pub fn reduce_scatter_in_place(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.whole(OpKind::ReduceScatter, buf, 0, op)
    }

    /// In-place all-gather: `buf` is the full buffer with this rank's shard already at
    /// [`ProcessGroup::group_shard`]; it comes back complete. No allocation.
    pub fn all_gather_in_place(self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.whole(OpKind::AllGather, buf, 0, ReduceOp::Sum)
    }

    /// Gathers every rank's shard of a `total`-element buffer; `shard` must have
    /// `group_shard(group, total).len()` elements.
    pub fn all_gather(self, shard: Vec<f32>, total: usize) -> Work<Vec<f32>> {
        let group = self.opts.group;
        let range = self.pg.group_shard(group, total);
        if shard.len() != range.len() {
            let why = format!(
                "all_gather on rank {}: shard has {} elements, but its shard of {total} in the \
                 {} group is {}",
                self.pg.rank,
                shard.len(),
                group.name(),
                range.len()
            );
            return self.pg.invalid(OpKind::AllGather, group, why);
        }
        if self.pg.group_rank(group).is_none() {
            return self.pg.outside(OpKind::AllGather, group, total);
        }
        self.pg
            .submit(OpKind::AllGather, 4 * total, self.opts, move |ex, id| {
                let mut buf = ManuallyDrop::new(vec![0.0f32; total]);
                buf[range].copy_from_slice(&shard);
                let r = ex.collective(id, &mut buf, 0, ReduceOp::Sum);
                keep_or_park(ex, r, buf)
            })
    }

    /// Hybrid sharding's gradient reduction (HSDP), in place: a reduce-scatter on the node
    /// group, then an all-reduce of this rank's node shard on its replica group, as FSDP2
    /// composes it; submitted together, so the caller overlaps them with compute. `buf` comes
    /// back reduced over every rank on [`ProcessGroup::group_shard`]`(Group::Node, ..)` (the
    /// rest is scratch); a mean divides by the world size. Each of the two calls is numbered
    /// in its own group; `opts.group` is not used. Nothing but the shards crosses nodes.
    pub fn hybrid_reduce_in_place(self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        let pg = self.pg;
        let shard = pg.group_shard(Group::Node, buf.len());
        let world = pg.world() as f32;
        let mut calls = vec![(OpKind::ReduceScatter, Group::Node)];
        if pg.group_rank(Group::Replica).is_some() {
            calls.push((OpKind::AllReduce, Group::Replica));
        }
        pg.submit_steps(&calls, 4 * buf.len(), self.opts, move |ex, ids, steps| {
            let mut buf = ManuallyDrop::new(buf);
            let sum = ReduceOp::Sum;
            let mut r = steps.step(ex, ids[0], |ex| ex.collective(ids[0], &mut buf, 0, sum));
            if let (Ok(()), Some(&id)) = (&r, ids.get(1)) {
                let part = &mut buf[shard.clone()];
                r = steps.step(ex, id, |ex| ex.collective(id, part, 0, sum));
            }
            if r.is_ok() && op == ReduceOp::Mean {
                buf[shard].iter_mut().for_each(|x| *x /= world);
            }
            keep_or_park(ex, r, buf)
        })
    }

    /// A collective of `kind` on the whole of `buf`, in place (`arg`: broadcast's root).
    pub(super) fn whole(
        self,
        kind: OpKind,
        buf: Vec<f32>,
        arg: usize,
        op: ReduceOp,
    ) -> Work<Vec<f32>> {
        if self.pg.group_rank(self.opts.group).is_none() {
            return self.pg.outside(kind, self.opts.group, buf.len());
        }
        self.pg
            .submit(kind, 4 * buf.len(), self.opts, move |ex, id| {
                let mut buf = ManuallyDrop::new(buf);
                let r = ex.collective(id, &mut buf, arg, op);
                keep_or_park(ex, r, buf)
            })
    }
}
