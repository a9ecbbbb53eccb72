//! The shared-memory phases of a collective inside a node: what a lane owner does before the
//! lanes run (reduce, collect, copy from the root), the mean, the copies after them, and the
//! one-node case, with the fused block loops they use. Each phase works between two barriers
//! under the rules of `transport::local`: every element is written by at most one rank, and an
//! element written is read by no other.

use super::OpId;
use super::ReduceOp;
use crate::algo::layout::intersect;
use crate::algo::program::{Post, Pre, Single};
use crate::algo::{Layout, Program, Scope};
use crate::transport::lane::RawBuf;
use crate::transport::local::Peers;
use std::time::Instant;

/// One call as its phases see it.
pub(super) struct CallCx<'a> {
    pub id: OpId,
    pub prog: Program,
    pub lay: Layout,
    pub scope: &'a Scope,
    pub peers: &'a Peers,
    pub raw: RawBuf,
    /// Broadcast's root.
    pub arg: usize,
    pub deadline: Instant,
}

/// Inside the node, before the lanes: what this lane's owner does to the lane's pieces.
pub(super) fn pre_phase(cx: &CallCx<'_>) {
    let (n, j) = (cx.scope.node, cx.scope.local);
    let table = &cx.scope.table;
    let k = table.ranks_on(n);
    let pieces = cx.lay.lane_pieces(j);
    match cx.prog.pre {
        // SAFETY: lane j's pieces are written only by local rank j (me) in this phase, and
        // read only by me.
        Pre::Reduce if k > 1 => {
            for r in &pieces {
                unsafe { sum_into(cx.peers, j, k, r.clone(), 1.0, false) };
            }
        }
        Pre::CollectChunks => {
            let (first, piece) = (table.first_rank(n), cx.lay.piece(n, j));
            for i in (0..k).filter(|&i| i != j) {
                copy_from(cx.peers, i, j, intersect(&cx.lay.chunk(first + i), &piece));
            }
        }
        Pre::FromRoot => {
            let (rn, rl) = table.locate(cx.arg);
            if n == rn && j != rl {
                for r in &pieces {
                    copy_from(cx.peers, rl, j, r.clone());
                }
            }
        }
        Pre::Reduce => {}
    }
}

/// After a reduction's lanes: the lane owner divides what it holds reduced by the group's size.
pub(super) fn mean_phase(cx: &CallCx<'_>) {
    let (n, j) = (cx.scope.node, cx.scope.local);
    let owned = if cx.prog.only_own_piece_reduced() {
        vec![cx.lay.piece(n, j)]
    } else {
        cx.lay.lane_pieces(j)
    };
    let world = cx.scope.size() as f32;
    for r in owned {
        // SAFETY: the lane's pieces are this rank's alone until the next barrier.
        let dst = unsafe { cx.peers.write(j, r) };
        dst.iter_mut().for_each(|x| *x /= world);
    }
}

/// Inside the node, after the lanes: every rank copies from the other lanes' owners.
pub(super) fn post_phase(cx: &CallCx<'_>) {
    let (n, j) = (cx.scope.node, cx.scope.local);
    let me = cx.scope.rank();
    for l in (0..cx.lay.lanes()).filter(|&l| l != j) {
        match cx.prog.post {
            Post::OtherLanes => {
                for r in cx.lay.lane_pieces(l) {
                    copy_from(cx.peers, l, j, r);
                }
            }
            Post::OwnChunk => copy_from(
                cx.peers,
                l,
                j,
                intersect(&cx.lay.chunk(me), &cx.lay.piece(n, l)),
            ),
        }
    }
}

/// Elements per block of the fused intra-node loops: small enough to stay in L1/L2 between
/// the reads of the k inputs and the writes.
pub(super) const BLOCK: usize = 8 << 10;

/// `me[r] = sum_i buf_i[r] / divisor`, block by block in one pass over each input; with
/// `spread`, the result is also written to every other local buffer (a fused all-gather).
///
/// # Safety
/// `r` must be owned by `me` in this phase: no other rank reads or writes `r` of any buffer.
pub(super) unsafe fn sum_into(
    peers: &Peers,
    me: usize,
    k: usize,
    r: std::ops::Range<usize>,
    divisor: f32,
    spread: bool,
) {
    let mut at = r.start;
    while at < r.end {
        let b = at..(at + BLOCK).min(r.end);
        // SAFETY: per the function contract.
        let dst = unsafe { peers.write(me, b.clone()) };
        for i in (0..k).filter(|&i| i != me) {
            let src = unsafe { peers.read(i, b.clone()) };
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += *s);
        }
        if divisor != 1.0 {
            dst.iter_mut().for_each(|x| *x /= divisor);
        }
        if spread {
            for i in (0..k).filter(|&i| i != me) {
                unsafe { peers.write(i, b.clone()) }.copy_from_slice(dst);
            }
        }
        at = b.end;
    }
}

/// Copies elements `r` of local rank `from`'s buffer into local rank `to`'s (`to` is the
/// calling rank; `from` does not write `r` in this phase).
pub(super) fn copy_from(peers: &Peers, from: usize, to: usize, r: std::ops::Range<usize>) {
    if r.is_empty() || from == to {
        return;
    }
    // SAFETY: per the phase rules, `from` only reads/writes its own lane ranges, which
    // `r` belongs to and which are final; `to` (me) is the only writer of my copy of `r`.
    let src = unsafe { peers.read(from, r.clone()) };
    let dst = unsafe { peers.write(to, r) };
    dst.copy_from_slice(src);
}

/// One node: everything happens in shared memory between the entry and exit barriers.
/// Rank j owns chunk j of every buffer; reductions read all k inputs once per block and
/// (for all-reduce) write the result straight into every buffer.
/// `(j, k)`: this rank's index among the node's `k` ranks of the call's group.
pub(super) fn single_node(
    single: Single,
    peers: &Peers,
    lay: &Layout,
    (j, k): (usize, usize),
    arg: usize,
    reduce: ReduceOp,
) {
    let mine = lay.chunk(j);
    let divisor = match reduce {
        ReduceOp::Sum => 1.0,
        ReduceOp::Mean => k as f32,
    };
    match single {
        // SAFETY: chunk j of every buffer belongs to rank j in this phase.
        Single::AllReduce => unsafe { sum_into(peers, j, k, mine, divisor, true) },
        Single::ReduceScatter => unsafe { sum_into(peers, j, k, mine, divisor, false) },
        Single::Gather => {
            for i in (0..k).filter(|&i| i != j) {
                copy_from(peers, i, j, lay.chunk(i));
            }
        }
        Single::Broadcast => copy_from(peers, arg, j, 0..lay.len()),
    }
}
