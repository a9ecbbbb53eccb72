//! The executor: runs one rank's collectives, in order, on its communication thread. Inside
//! the node it works on the shared buffers (the fused reduce and copy loops); across nodes it
//! hands each lane's ring to the node's network runtime.

use super::phases::{CallCx, mean_phase, post_phase, pre_phase, single_node};
use super::{OpId, ReduceOp};
use crate::abort::FailHook;
use crate::algo::frames::FrameCall;
use crate::algo::program::{Lanes, Pre};
use crate::algo::{Program, Scope, Scopes, ring};
use crate::error::{CollectiveError, Error, TransportError};
use crate::topology::RankTable;
use crate::transport::lane::{Lane, LaneError, LaneTask, OwnedLaneTask, RawBuf, RingJob};
use crate::transport::local::{BarrierError, Call, NodeShared, Peers};
use crate::wire::WireDtype;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs the collectives of one rank on its communication thread.
pub(super) struct Executor {
    pub(super) rank: usize,
    pub(super) local: usize,
    pub(super) node: usize,
    pub(super) table: Arc<RankTable>,
    /// This rank's view of each group.
    pub(super) scopes: Arc<Scopes>,
    pub(super) shared: Arc<NodeShared>,
    /// This rank's link to the other nodes (none when the job has one node).
    pub(super) lane: Option<Box<dyn Lane>>,
    pub(super) rt: tokio::runtime::Handle,
    pub(super) timeout: Duration,
    pub(super) failed: Option<String>,
    pub(super) on_fail: FailHook,
    /// Time (ms) and bytes this rank spent on its inter-node lane in the current collective.
    pub(super) inter: Option<(f64, u64)>,
    /// The wire dtype of the collective being run.
    pub(super) wire: WireDtype,
    /// Unit tests: (rank, seq) of the collective that panics after its first barrier.
    #[cfg(test)]
    pub(super) panic_at: Option<(usize, u64)>,
}

impl Executor {
    pub(super) fn fail(&mut self, id: OpId, e: CollectiveError) -> Error {
        // When another local rank already failed this node, that is the cause: report it, not
        // its echo (e.g. the connections the node closed because of it).
        if let Some((r, why)) = self.shared.aborted()
            && r != self.local
        {
            let e = CollectiveError::PeerFailed {
                op: id.kind.name(),
                seq: id.seq,
                rank: self.rank,
                peer: self.table.global_rank(self.node, r),
                reason: why,
            };
            self.failed = Some(crate::error::report(&e));
            return e.into();
        }
        let msg = crate::error::report(&e);
        tracing::error!(rank = self.rank, op = %id, "{msg}");
        self.failed = Some(msg.clone());
        self.shared
            .abort(self.local, format!("rank {}: {msg}", self.rank));
        (self.on_fail)(format!("rank {} failed: {msg}", self.rank));
        e.into()
    }

    pub(super) fn barrier(
        &mut self,
        id: OpId,
        bytes: usize,
        deadline: Instant,
    ) -> Result<(), Error> {
        let left = deadline.saturating_duration_since(Instant::now());
        let peer_failed = |ex: &Self, local: usize, reason: String| CollectiveError::PeerFailed {
            op: id.kind.name(),
            seq: id.seq,
            rank: ex.rank,
            peer: ex.table.global_rank(ex.node, local),
            reason,
        };
        match self.shared.barrier(self.local, left) {
            Ok(()) => Ok(()),
            Err(BarrierError::Aborted { rank, reason }) => {
                let e = peer_failed(self, rank, reason);
                self.failed = Some(crate::error::report(&e));
                Err(e.into())
            }
            Err(BarrierError::Departed { rank, reason }) => {
                // Nobody failed yet: fail the node (and through it the other nodes) now.
                let e = peer_failed(self, rank, reason);
                Err(self.fail(id, e))
            }
            Err(BarrierError::Timeout { missing }) => {
                let missing: Vec<usize> = missing
                    .iter()
                    .map(|&l| self.table.global_rank(self.node, l))
                    .collect();
                let e = CollectiveError::Timeout {
                    op: id.kind.name(),
                    seq: id.seq,
                    bytes,
                    rank: self.rank,
                    timeout: self.timeout,
                    waiting_for: format!(
                        "ranks {missing:?} of this node to reach the same collective"
                    ),
                };
                Err(self.fail(id, e))
            }
        }
    }

    /// This rank's communication thread panicked in a collective: fail the node with the
    /// message (other local ranks' barriers, other nodes through the connections' close) and
    /// refuse every later collective of this rank.
    pub(super) fn panicked(&mut self, message: &str) -> Error {
        let why = format!(
            "local rank {} panicked in its communication thread: {message}",
            self.local
        );
        tracing::error!(rank = self.rank, "{why}");
        self.shared
            .abort(self.local, format!("rank {}: {why}", self.rank));
        (self.on_fail)(format!("rank {} failed: {why}", self.rank));
        self.failed = Some(why.clone());
        CollectiveError::WorkerGone {
            rank: self.rank,
            why,
        }
        .into()
    }

    pub(super) fn check_healthy(&self, id: OpId) -> Result<(), Error> {
        match &self.failed {
            Some(why) => Err(CollectiveError::PeerFailed {
                op: id.kind.name(),
                seq: id.seq,
                rank: self.rank,
                peer: self.rank,
                reason: format!("an earlier collective failed: {why}"),
            }
            .into()),
            None => Ok(()),
        }
    }

    /// Runs a future on the lane with the collective's deadline, mapping failures.
    ///
    /// The lane's work runs as a task on the node's network runtime, beside quinn's connection
    /// drivers, rather than on this thread: a packet that completes a frame then wakes the lane
    /// task on the runtime's own worker (no futex wake of another thread and no context switch
    /// per stream read or write). This thread waits for the task and takes the lane back.
    pub(super) fn on_lane(
        &mut self,
        id: OpId,
        bytes: usize,
        deadline: Instant,
        task: LaneTask<'_>,
    ) -> Result<(), Error> {
        let lane = self.lane.take().expect("lane owner");
        let t_lane = Instant::now();
        let sent_before = lane.sent();
        let until = tokio::time::Instant::from_std(deadline);
        let owned = OwnedLaneTask::from(task);
        // SAFETY (the buffer behind `RawBuf`): this thread blocks until the task has finished,
        // so the caller's buffer outlives every access the task makes.
        let handle = self
            .rt
            .spawn(lane.run(owned, (id.kind.code(), id.seq), until));
        let res = match self.rt.block_on(handle) {
            Ok((lane, res)) => {
                self.lane = Some(lane);
                res
            }
            Err(e) => {
                // The lane (its streams) went down with the task: this group cannot talk to
                // other nodes any more, and `fail` keeps every later call from trying.
                let err = CollectiveError::Failed {
                    op: id.kind.name(),
                    seq: id.seq,
                    bytes,
                    rank: self.rank,
                    waiting_for: "the lane task".into(),
                    source: Box::new(TransportError::Lost {
                        peer: "every other node".into(),
                        reason: format!("the lane task ended abnormally: {e}"),
                    }),
                };
                return Err(self.fail(id, err));
            }
        };
        let lane = self.lane.as_ref().expect("lane owner");
        let (step, chunk, from) = lane.waiting();
        // Time and bytes on the inter-node link, for the trace's per-link bandwidth.
        let sent = lane.sent() - sent_before;
        let (ms, b) = self.inter.unwrap_or((0.0, 0));
        self.inter = Some((ms + t_lane.elapsed().as_secs_f64() * 1e3, b + sent));
        let waiting_for = format!(
            "waiting for step {step} frame {chunk} from {}",
            lane.describe(from)
        );
        let err = match res {
            Ok(()) => return Ok(()),
            Err(LaneError::Failed(e)) => CollectiveError::Failed {
                op: id.kind.name(),
                seq: id.seq,
                bytes,
                rank: self.rank,
                waiting_for,
                source: Box::new(e),
            },
            Err(LaneError::TimedOut) => CollectiveError::Timeout {
                op: id.kind.name(),
                seq: id.seq,
                bytes,
                rank: self.rank,
                timeout: self.timeout,
                waiting_for,
            },
        };
        Err(self.fail(id, err))
    }

    /// The hierarchical collective on `buf`, over the ranks of the call's group (see the
    /// module docs; a sub-group's call runs the same program on its scope's table).
    pub(super) fn collective(
        &mut self,
        id: OpId,
        buf: &mut [f32],
        arg: usize,
        reduce: ReduceOp,
    ) -> Result<(), Error> {
        self.check_healthy(id)?;
        let len = buf.len();
        let span = tracing::debug_span!("collective", op = %id, rank = self.rank, len);
        let _g = span.enter();
        let Some(scope) = self.scopes.get(id.group).cloned() else {
            // Refused at submission unless empty: nothing to do.
            return Ok(());
        };
        let Some(prog) = Program::of(id.kind) else {
            let e = CollectiveError::InvalidCall("p2p is not a collective".into());
            return Err(self.fail(id, e));
        };
        let deadline = Instant::now() + self.timeout;
        // One pointer for everything that touches the buffer from here on (the slot other
        // ranks use and our own lane), derived once.
        let ptr = buf.as_mut_ptr();
        let peers = self.enter(id, &scope, ptr, len, arg, deadline)?;
        // Test hook: a panic between barriers, with the other local ranks using the buffer.
        #[cfg(test)]
        if self.panic_at == Some((self.rank, id.seq)) {
            panic!(
                "injected panic in collective seq {} of rank {}",
                id.seq, self.rank
            );
        }
        let cx = CallCx {
            id,
            prog,
            lay: scope.layout(len),
            scope: &scope,
            peers: &peers,
            // SAFETY: `buf` outlives the collective; on failure the caller parks it in the
            // node's shared state.
            raw: unsafe { RawBuf::from_raw(ptr, len) },
            arg,
            deadline,
        };
        let meet = scope.meets_in_node();
        let (j, k) = (scope.local, scope.table.ranks_on(scope.node));
        if scope.table.num_nodes() == 1 {
            single_node(prog.single, &peers, &cx.lay, (j, k), arg, reduce);
            return self.meet(meet, id, len * 4, deadline);
        }
        if j < cx.lay.lanes() {
            pre_phase(&cx);
            self.lane_phase(&cx)?;
            if reduce == ReduceOp::Mean && prog.pre == Pre::Reduce {
                mean_phase(&cx);
            }
        }
        self.meet(meet, id, len * 4, deadline)?;
        post_phase(&cx);
        self.meet(meet, id, len * 4, deadline)
    }

    /// The start of a call: publishes the buffer and meets the node's other ranks (checking
    /// they make the same call), or, for a group with one rank per node, takes the buffer
    /// alone.
    fn enter(
        &mut self,
        id: OpId,
        scope: &Scope,
        ptr: *mut f32,
        len: usize,
        arg: usize,
        deadline: Instant,
    ) -> Result<Peers, Error> {
        if !scope.meets_in_node() {
            return Ok(Peers::solo(ptr, len));
        }
        let call = Call {
            seq: id.seq,
            op: id.kind.code(),
            group: id.group.code(),
            len,
            arg,
        };
        self.shared.publish_raw(self.local, ptr, len, call);
        self.barrier(id, len * 4, deadline)?;
        let peers = self
            .shared
            .peers(self.local)
            .map_err(|detail| CollectiveError::Mismatch {
                seq: id.seq,
                detail,
            });
        peers.map_err(|e| self.fail(id, e))
    }

    /// Across nodes: this lane's ring (or chain) over its pieces, one per node.
    fn lane_phase(&mut self, cx: &CallCx<'_>) -> Result<(), Error> {
        let (n, nn) = (cx.scope.node, cx.scope.table.num_nodes());
        let (next, prev) = ((n + 1) % nn, (n + nn - 1) % nn);
        let pieces = cx.lay.lane_pieces(cx.scope.local);
        let bytes = cx.lay.len() * 4;
        // The ring's steps, and the step from which it forwards finished pieces (an
        // all-gather half starts with this node's own finished piece).
        let (steps, round_step) = match cx.prog.lanes {
            Lanes::AllReduce => (ring::all_reduce(n, nn), Some(nn - 1)),
            Lanes::ReduceScatter => (ring::reduce_scatter(n, nn), None),
            Lanes::AllGather => (ring::all_gather(n, nn), Some(0)),
            Lanes::Chain => {
                let (recv, send) = ring::chain_role(n, cx.scope.table.locate(cx.arg).0, nn);
                let task = LaneTask::Chain {
                    buf: cx.raw,
                    pieces: &pieces,
                    from: recv.then_some(prev),
                    to: send.then_some(next),
                };
                return self.on_lane(cx.id, bytes, cx.deadline, task);
            }
        };
        let job = RingJob {
            buf: cx.raw,
            pieces: &pieces,
            steps: &steps,
            next,
            prev,
            call: FrameCall {
                op: cx.id.kind.code(),
                group: cx.id.group.code(),
                seq: cx.id.seq,
                dtype: self.wire,
            },
            step_base: 0,
            round_step,
        };
        self.on_lane(cx.id, bytes, cx.deadline, LaneTask::Ring(job))
    }

    /// The node's barrier, for a call whose group meets in the node (else nothing).
    fn meet(&mut self, meet: bool, id: OpId, bytes: usize, deadline: Instant) -> Result<(), Error> {
        if meet {
            self.barrier(id, bytes, deadline)
        } else {
            Ok(())
        }
    }

    pub(super) fn p2p(&mut self, id: OpId, buf: &mut [f32]) -> Result<(), Error> {
        self.check_healthy(id)?;
        let nn = self.table.num_nodes();
        if self.lane.is_none() || nn < 2 {
            return Ok(());
        }
        let half = buf.len() / 2;
        let pieces = [0..half, half..2 * half];
        let steps = [ring::RingStep {
            send: 0,
            recv: 1,
            mode: ring::RecvMode::Copy,
        }];
        let raw = RawBuf::new(buf);
        let n = self.node;
        let job = RingJob {
            buf: raw,
            pieces: &pieces,
            steps: &steps,
            next: (n + 1) % nn,
            prev: (n + nn - 1) % nn,
            call: FrameCall {
                op: id.kind.code(),
                group: id.group.code(),
                seq: id.seq,
                dtype: WireDtype::F32,
            },
            step_base: 0,
            round_step: None,
        };
        let deadline = Instant::now() + self.timeout;
        self.on_lane(id, half * 4, deadline, LaneTask::Ring(job))
    }
}
