//! The per-rank handle ([`ProcessGroup`]) and the node that owns the links ([`Node`]).
//!
//! Each rank's collectives run in order on the rank's own communication thread, so calls are
//! non-blocking: they return a [`Work`] handle at once and the caller overlaps compute until it
//! calls [`Work::wait`]. Every call gets the next sequence number of its group ([`OpId`]); the
//! number is checked between the ranks of a node and carried in every frame between nodes, so
//! repeated collectives can never mix.
//!
//! Algorithm of every collective (see `algo::layout` for the pieces):
//! 1. inside the node, local rank l sums its lane's pieces across the node's buffers;
//! 2. across nodes, lane l runs a ring over its pieces (local rank l of every node, all lanes
//!    in parallel over their own QUIC streams), as a task on the node's network runtime;
//! 3. inside the node, every rank copies the other lanes' results.
//!
//! With one node this is a pure shared-buffer reduce-scatter/all-gather; with one rank per
//! node it is a plain ring.
//!
//! Between nodes the ring frames carry the group's wire dtype ([`ProcessGroup::set_wire_dtype`]:
//! f32, f16, bf16 or int8, see [`crate::codec`]); inside a node everything stays f32. A
//! reduction decodes each received frame and adds it in f32. Before an all-gather sends a
//! node's own finished piece, the node replaces it by its decoded form, so every rank ends with
//! bit-identical values. Broadcast and p2p always carry f32.

use crate::abort::{Aborter, FailHook};
use crate::algo::layout::intersect;
use crate::algo::{Layout, ring};
use crate::config::NodeConfig;
use crate::error::{CollectiveError, Error, RendezvousError, TransportError};
use crate::rendezvous::{self, Peer};
use crate::tls::JobIdentity;
use crate::topology::RankTable;
use crate::transport::local::{BarrierError, Call, NodeShared, Peers};
use crate::transport::quic::{self, LaneLinks, RawBuf, RingJob, close_code};
use crate::wire::WireDtype;
use quinn::{Endpoint, VarInt};
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Reduction applied by all-reduce and reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the world size.
    Mean,
}

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

/// A collective in flight. `wait` blocks until it completes and hands back the buffer.
#[must_use = "a collective's result must be waited for"]
pub struct Work<T> {
    id: OpId,
    rank: usize,
    rx: mpsc::Receiver<Result<T, Error>>,
    /// Why the communication thread ended, when it did (a panic's message).
    gone: Gone,
}

/// Why a rank's communication thread ended early (set by the thread as it stops).
type Gone = Arc<std::sync::Mutex<Option<String>>>;

fn worker_gone(rank: usize, gone: &Gone) -> Error {
    let why = gone
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| "process group shut down".into());
    Error::Collective(CollectiveError::WorkerGone { rank, why })
}

impl<T> Work<T> {
    pub fn id(&self) -> OpId {
        self.id
    }

    /// Blocks until the collective completes.
    pub fn wait(self) -> Result<T, Error> {
        self.rx
            .recv()
            .unwrap_or_else(|_| Err(worker_gone(self.rank, &self.gone)))
    }

    /// Returns the result if the collective has completed, or the handle back.
    pub fn try_wait(self) -> Result<Result<T, Error>, Self> {
        match self.rx.try_recv() {
            Ok(r) => Ok(r),
            Err(mpsc::TryRecvError::Empty) => Err(self),
            Err(mpsc::TryRecvError::Disconnected) => Ok(Err(worker_gone(self.rank, &self.gone))),
        }
    }
}

type Job = Box<dyn FnOnce(&mut Executor) + Send>;

/// Hands the buffer back after a successful collective. After a failure other local ranks may
/// still be reading or writing it (they learn of the failure at their next barrier), so it is
/// leaked rather than freed: the group is dead anyway, and a leak is safe where a free is not.
/// Every collective holds its buffer in a `ManuallyDrop` until here, so a panic in between
/// (which unwinds past this call) leaks it too.
fn keep_or_leak(r: Result<(), Error>, buf: ManuallyDrop<Vec<f32>>) -> Result<Vec<f32>, Error> {
    match r {
        Ok(()) => Ok(ManuallyDrop::into_inner(buf)),
        Err(e) => Err(e),
    }
}

/// The handle of one rank: submit collectives here. Owned by the rank's thread.
pub struct ProcessGroup {
    rank: usize,
    local_rank: usize,
    node: usize,
    table: Arc<RankTable>,
    next_seq: u64,
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<std::thread::JoinHandle<()>>,
    sent: Option<Arc<std::sync::atomic::AtomicU64>>,
    flight: Arc<std::sync::Mutex<crate::flight::FlightRecorder>>,
    wire: WireDtype,
    gone: Gone,
    /// The deadline of each collective submitted from now on (the node's collective timeout
    /// unless [`ProcessGroup::set_timeout`] says otherwise).
    timeout: Duration,
    aborter: Aborter,
}

/// Locks the flight recorder, also after a panic elsewhere (it only holds plain data).
fn lock(
    f: &std::sync::Mutex<crate::flight::FlightRecorder>,
) -> std::sync::MutexGuard<'_, crate::flight::FlightRecorder> {
    f.lock().unwrap_or_else(|p| p.into_inner())
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world", &self.table.world())
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl ProcessGroup {
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    pub fn node(&self) -> usize {
        self.node
    }
    pub fn world(&self) -> usize {
        self.table.world()
    }
    pub fn table(&self) -> &RankTable {
        &self.table
    }

    /// Fails the whole job at once with `reason`: this node's other ranks and every other
    /// node end their collectives with it (instead of waiting out the collective timeout).
    pub fn abort(&self, reason: &str) {
        self.aborter.abort(reason);
    }

    /// A handle that fails the job in this rank's name from any thread (e.g. the thread that
    /// joins a rank which returned an error).
    pub fn aborter(&self) -> Aborter {
        self.aborter.clone()
    }

    /// Bytes this rank has sent to other nodes so far (QUIC frame payloads and headers, as
    /// written to the streams; 0 for a rank that carries no lane or a single-node job).
    pub fn bytes_sent(&self) -> u64 {
        self.sent
            .as_ref()
            .map_or(0, |s| s.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// This rank's shard of a buffer of `len` elements (reduce-scatter output, all-gather input).
    pub fn shard_range(&self, len: usize) -> std::ops::Range<usize> {
        crate::topology::shard_range(len, self.world(), self.rank)
    }

    /// The flight recorder of this rank: its last collectives and how they ended.
    /// The element type the ring frames between nodes carry from now on (all-reduce,
    /// reduce-scatter, all-gather); returns the previous one. Every rank of the job must use
    /// the same dtype for the same collective (a mismatch is a protocol error naming both).
    pub fn set_wire_dtype(&mut self, dtype: WireDtype) -> WireDtype {
        std::mem::replace(&mut self.wire, dtype)
    }

    pub fn wire_dtype(&self) -> WireDtype {
        self.wire
    }

    /// The deadline of every collective submitted from now on (e.g. a longer one around a
    /// checkpoint write, which some ranks wait out while others write); returns the previous
    /// one. Starts as the node's collective timeout.
    pub fn set_timeout(&mut self, timeout: Duration) -> Duration {
        std::mem::replace(&mut self.timeout, timeout)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn flight_recorder(&self) -> Vec<crate::flight::Entry> {
        lock(&self.flight).entries()
    }

    /// The instant the flight recorder's times count from.
    pub fn flight_epoch(&self) -> std::time::Instant {
        lock(&self.flight).epoch()
    }

    /// Keeps every finished collective (not just the last 64) for [`Self::take_history`]:
    /// the communication track of a trace.
    pub fn keep_history(&mut self, on: bool) {
        lock(&self.flight).keep_history(on);
    }

    /// The collectives finished since the last call, with their times.
    pub fn take_history(&mut self) -> Vec<crate::flight::Entry> {
        lock(&self.flight).take_history()
    }

    fn submit<T: Send + 'static>(
        &mut self,
        kind: OpKind,
        bytes: usize,
        run: impl FnOnce(&mut Executor, OpId) -> Result<T, Error> + Send + 'static,
    ) -> Work<T> {
        self.next_seq += 1;
        let id = OpId {
            kind,
            seq: self.next_seq,
        };
        let (rtx, rx) = mpsc::sync_channel(1);
        let wire = match kind {
            OpKind::AllReduce
            | OpKind::ReduceScatter
            | OpKind::AllGather
            | OpKind::HybridReduce
            | OpKind::Barrier => self.wire,
            _ => WireDtype::F32,
        };
        lock(&self.flight).submitted(id.seq, kind.name(), bytes, wire.name());
        let flight = self.flight.clone();
        let rank = self.rank;
        let timeout = self.timeout;
        let job: Job = Box::new(move |ex: &mut Executor| {
            lock(&flight).started(id.seq);
            ex.inter = None;
            ex.wire = wire;
            ex.timeout = timeout;
            // A panic fails the node here, so this collective's caller gets its message (the
            // buffer it held is leaked: see `keep_or_leak`).
            let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(ex, id))) {
                Ok(r) => r,
                Err(p) => Err(ex.panicked(&crate::abort::panic_message(&*p))),
            };
            let mut f = lock(&flight);
            f.inter_link(id.seq, ex.inter.take());
            f.finished(id.seq, r.as_ref().err().map(|e| crate::error::report(e)));
            if r.is_err()
                && let Some(p) = f.dump_once()
            {
                tracing::error!(
                    "rank {rank}: flight recorder (last {} collectives) written to {}",
                    crate::flight::CAPACITY,
                    p.display()
                );
            }
            drop(f);
            let _ = rtx.send(r);
        });
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
        }
        Work {
            id,
            rank: self.rank,
            rx,
            gone: self.gone.clone(),
        }
    }

    /// A call rejected before submission: it gets no sequence number, so the group's
    /// numbering stays aligned with the other ranks.
    fn invalid<T: Send + 'static>(&mut self, kind: OpKind, why: String) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let _ = tx.send(Err(CollectiveError::InvalidCall(why).into()));
        Work {
            id: OpId {
                kind,
                seq: self.next_seq,
            },
            rank: self.rank,
            rx,
            gone: self.gone.clone(),
        }
    }

    /// Sums (or averages) `buf` across all ranks, in place.
    pub fn all_reduce(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.submit(OpKind::AllReduce, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, op);
            keep_or_leak(r, buf)
        })
    }

    /// Reduces `buf` (the full buffer, used as scratch) across ranks and returns this rank's
    /// shard, `shard_range(buf.len())`.
    pub fn reduce_scatter(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        let range = self.shard_range(buf.len());
        self.submit(OpKind::ReduceScatter, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, op);
            keep_or_leak(r, buf).map(|b| b[range].to_vec())
        })
    }

    /// In-place reduce-scatter: `buf` comes back with the reduced shard at
    /// `shard_range(buf.len())` (the rest is scratch). No allocation.
    pub fn reduce_scatter_in_place(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.submit(OpKind::ReduceScatter, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, op);
            keep_or_leak(r, buf)
        })
    }

    /// In-place all-gather: `buf` is the full buffer with this rank's shard already at
    /// `shard_range(buf.len())`; it comes back complete. No allocation.
    pub fn all_gather_in_place(&mut self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.submit(OpKind::AllGather, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, ReduceOp::Sum);
            keep_or_leak(r, buf)
        })
    }

    /// Gathers every rank's shard of a `total`-element buffer; `shard` must have
    /// `shard_range(total).len()` elements.
    pub fn all_gather(&mut self, shard: Vec<f32>, total: usize) -> Work<Vec<f32>> {
        let range = self.shard_range(total);
        if shard.len() != range.len() {
            let why = format!(
                "all_gather on rank {}: shard has {} elements, but rank {}'s shard of {total} is {}",
                self.rank,
                shard.len(),
                self.rank,
                range.len()
            );
            return self.invalid(OpKind::AllGather, why);
        }
        self.submit(OpKind::AllGather, 4 * total, move |ex, id| {
            let mut buf = ManuallyDrop::new(vec![0.0f32; total]);
            buf[range].copy_from_slice(&shard);
            let r = ex.collective(id, &mut buf, total, 0, ReduceOp::Sum);
            keep_or_leak(r, buf)
        })
    }

    /// Copies `root`'s buffer to every rank; all ranks pass buffers of the same length.
    pub fn broadcast(&mut self, buf: Vec<f32>, root: usize) -> Work<Vec<f32>> {
        if root >= self.world() {
            let why = format!(
                "broadcast root {root} is not below world size {}",
                self.world()
            );
            return self.invalid(OpKind::Broadcast, why);
        }
        self.submit(OpKind::Broadcast, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, root, ReduceOp::Sum);
            keep_or_leak(r, buf)
        })
    }

    /// Blocks until every rank has reached the barrier.
    pub fn barrier(&mut self) -> Result<(), Error> {
        self.submit(OpKind::Barrier, 0, |ex, id| {
            let mut one = ManuallyDrop::new(vec![0.0f32]);
            let r = ex.collective(id, &mut one, 1, 0, ReduceOp::Sum);
            keep_or_leak(r, one).map(|_| ())
        })
        .wait()
    }

    /// The ranges of a buffer of `len` elements this rank owns in hybrid sharding: its node's
    /// share, cut among the node's ranks, identical (by position) on every node. Empty for a
    /// rank beyond the smallest node's rank count.
    pub fn node_pieces(&self, len: usize) -> Vec<std::ops::Range<usize>> {
        let lay = Layout::new(&self.table, len);
        if self.local_rank < lay.lanes() {
            lay.lane_pieces(self.local_rank)
        } else {
            Vec::new()
        }
    }

    /// Hybrid sharding's gradient reduction, in place: `buf` comes back reduced over all ranks
    /// on [`ProcessGroup::node_pieces`] (the rest is scratch). Inside a node it is a
    /// reduce-scatter over shared memory; across nodes only the pieces travel, each lane
    /// all-reducing its own (HSDP: shard inside the node, replicate across nodes).
    pub fn hybrid_reduce_in_place(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.submit(OpKind::HybridReduce, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, op);
            keep_or_leak(r, buf)
        })
    }

    /// Gather inside the node: `buf` holds this rank's values on its node pieces and comes
    /// back complete from the node's other ranks, with no traffic between nodes.
    pub fn node_gather_in_place(&mut self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.submit(OpKind::NodeGather, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, ReduceOp::Sum);
            keep_or_leak(r, buf)
        })
    }

    /// All-reduce among the ranks of this rank's node only, in place, over shared memory: no
    /// byte crosses nodes (DiLoCo's inner steps). Mean divides by the node's rank count.
    pub fn node_all_reduce(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.submit(OpKind::NodeReduce, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, op);
            keep_or_leak(r, buf)
        })
    }

    /// Reduction among the ranks of this rank's node only, in place, over shared memory:
    /// `buf` comes back reduced over the node on [`ProcessGroup::node_pieces`] (the rest is
    /// scratch) and no byte crosses nodes (DiLoCo's inner steps with sharding inside the
    /// node). Mean divides by the node's rank count.
    pub fn node_reduce_scatter_in_place(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.submit(OpKind::NodeReduceScatter, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let len = buf.len();
            let r = ex.collective(id, &mut buf, len, 0, op);
            keep_or_leak(r, buf)
        })
    }

    /// Raw transport measurement: lane owners send the first half of `buf` to the next node
    /// and receive the second half from the previous node, both directions at once.
    /// Ranks without a lane return at once. For `wiretrain bench --op p2p`.
    pub fn p2p_exchange(&mut self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.submit(OpKind::P2p, 4 * buf.len(), move |ex, id| {
            let mut buf = ManuallyDrop::new(buf);
            let r = ex.p2p(id, &mut buf);
            keep_or_leak(r, buf)
        })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // A rank thread unwinding from a panic fails its node before it waits for its
        // communication thread, so no peer waits on buffers it will never publish.
        if std::thread::panicking() {
            let why = crate::abort::current_panic().unwrap_or_else(|| "see its stderr".into());
            self.aborter.abort(&format!("panicked: {why}"));
        } else {
            self.aborter.leave(&format!(
                "left the job after its collective #{} (its process group was dropped)",
                self.next_seq
            ));
        }
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// What a lane owner runs across nodes.
enum LaneTask<'a> {
    Ring(RingJob<'a>),
    Chain {
        buf: RawBuf,
        pieces: &'a [std::ops::Range<usize>],
        from: Option<usize>,
        to: Option<usize>,
    },
}

/// A `LaneTask` that owns its piece and step lists, so it can run as a task on the runtime.
enum OwnedLaneTask {
    /// `job`'s own `pieces` and `steps` are empty; the task points them at these.
    Ring {
        job: RingJob<'static>,
        pieces: Vec<std::ops::Range<usize>>,
        steps: Vec<ring::RingStep>,
    },
    Chain {
        buf: RawBuf,
        pieces: Vec<std::ops::Range<usize>>,
        from: Option<usize>,
        to: Option<usize>,
    },
}

impl From<LaneTask<'_>> for OwnedLaneTask {
    fn from(t: LaneTask<'_>) -> Self {
        match t {
            LaneTask::Ring(j) => OwnedLaneTask::Ring {
                pieces: j.pieces.to_vec(),
                steps: j.steps.to_vec(),
                job: RingJob {
                    pieces: &[],
                    steps: &[],
                    ..j
                },
            },
            LaneTask::Chain {
                buf,
                pieces,
                from,
                to,
            } => OwnedLaneTask::Chain {
                buf,
                pieces: pieces.to_vec(),
                from,
                to,
            },
        }
    }
}

/// Runs the collectives of one rank on its communication thread.
struct Executor {
    rank: usize,
    local: usize,
    node: usize,
    table: Arc<RankTable>,
    shared: Arc<NodeShared>,
    lane: Option<LaneLinks>,
    rt: tokio::runtime::Handle,
    timeout: Duration,
    failed: Option<String>,
    on_fail: FailHook,
    /// Time (ms) and bytes this rank spent on its inter-node lane in the current collective.
    inter: Option<(f64, u64)>,
    /// The wire dtype of the collective being run.
    wire: WireDtype,
    /// Unit tests: (rank, seq) of the collective that panics after its first barrier.
    #[cfg(test)]
    panic_at: Option<(usize, u64)>,
}

impl Executor {
    fn fail(&mut self, id: OpId, e: CollectiveError) -> Error {
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

    fn barrier(&mut self, id: OpId, bytes: usize, deadline: Instant) -> Result<(), Error> {
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
    fn panicked(&mut self, message: &str) -> Error {
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

    fn check_healthy(&self, id: OpId) -> Result<(), Error> {
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
    fn on_lane(
        &mut self,
        id: OpId,
        bytes: usize,
        deadline: Instant,
        task: LaneTask<'_>,
    ) -> Result<(), Error> {
        let mut lane = self.lane.take().expect("lane owner");
        let progress = lane.progress.clone();
        let t_lane = Instant::now();
        let sent_before = lane.sent.load(std::sync::atomic::Ordering::Relaxed);
        let left = deadline.saturating_duration_since(Instant::now());
        let owned = OwnedLaneTask::from(task);
        let (code, seq) = (id.kind.code(), id.seq);
        // SAFETY (the buffer behind `RawBuf`): this thread blocks until the task has finished,
        // so the caller's buffer outlives every access the task makes.
        let handle = self.rt.spawn(async move {
            let res = match owned {
                OwnedLaneTask::Ring { job, pieces, steps } => {
                    let job = RingJob {
                        pieces: &pieces,
                        steps: &steps,
                        ..job
                    };
                    tokio::time::timeout(left, lane.ring(job)).await
                }
                OwnedLaneTask::Chain {
                    buf,
                    pieces,
                    from,
                    to,
                } => {
                    tokio::time::timeout(left, lane.chain(buf, &pieces, from, to, code, seq)).await
                }
            };
            (lane, res)
        });
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
        let (step, chunk, from) = progress.waiting();
        let lane = self.lane.as_ref().expect("lane owner");
        // Time and bytes on the inter-node link, for the trace's per-link bandwidth.
        let sent = lane.sent.load(std::sync::atomic::Ordering::Relaxed) - sent_before;
        let (ms, b) = self.inter.unwrap_or((0.0, 0));
        self.inter = Some((ms + t_lane.elapsed().as_secs_f64() * 1e3, b + sent));
        let waiting_for = format!(
            "waiting for step {step} frame {chunk} from {}",
            lane.describe(from)
        );
        match res {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                let err = CollectiveError::Failed {
                    op: id.kind.name(),
                    seq: id.seq,
                    bytes,
                    rank: self.rank,
                    waiting_for,
                    source: Box::new(e.error),
                };
                Err(self.fail(id, err))
            }
            Err(_) => {
                let err = CollectiveError::Timeout {
                    op: id.kind.name(),
                    seq: id.seq,
                    bytes,
                    rank: self.rank,
                    timeout: self.timeout,
                    waiting_for,
                };
                Err(self.fail(id, err))
            }
        }
    }

    /// The hierarchical collective on a full-length buffer (see the module docs).
    fn collective(
        &mut self,
        id: OpId,
        buf: &mut [f32],
        len: usize,
        arg: usize,
        reduce: ReduceOp,
    ) -> Result<(), Error> {
        self.check_healthy(id)?;
        let span = tracing::debug_span!("collective", op = %id, rank = self.rank, len);
        let _g = span.enter();
        let deadline = Instant::now() + self.timeout;
        let bytes = len * 4;
        let table = self.table.clone();
        let (n, j) = (self.node, self.local);
        let nn = table.num_nodes();
        let lay = Layout::new(&table, len);
        let lanes = lay.lanes();
        let my_lane = (j < lanes).then_some(j);
        let k = table.ranks_on(n);
        let call = Call {
            seq: id.seq,
            op: id.kind.code(),
            len,
            arg,
        };
        // One pointer for everything that touches the buffer from here on (the slot other
        // ranks use and our own lane), derived once.
        let ptr = buf.as_mut_ptr();
        self.shared.publish_raw(j, ptr, buf.len(), call);
        // SAFETY: `buf` outlives the collective; on failure the caller leaks it.
        let raw = unsafe { RawBuf::from_raw(ptr, buf.len()) };
        self.barrier(id, bytes, deadline)?;
        // Test hook: a panic between barriers, with the other local ranks using the buffer.
        #[cfg(test)]
        if self.panic_at == Some((self.rank, id.seq)) {
            panic!(
                "injected panic in collective seq {} of rank {}",
                id.seq, self.rank
            );
        }
        let peers = self
            .shared
            .peers(j)
            .map_err(|detail| CollectiveError::Mismatch {
                seq: id.seq,
                detail,
            });
        let peers = match peers {
            Ok(p) => p,
            Err(e) => return Err(self.fail(id, e)),
        };
        let next = (n + 1) % nn;
        let prev = (n + nn - 1) % nn;
        let world = table.world() as f32;
        if nn == 1 {
            self.single_node(id, &peers, &lay, arg, reduce);
            return self.barrier(id, bytes, deadline);
        }
        match id.kind {
            OpKind::AllReduce
            | OpKind::ReduceScatter
            | OpKind::Barrier
            | OpKind::HybridReduce
            | OpKind::NodeReduce
            | OpKind::NodeReduceScatter => {
                let node_only = matches!(id.kind, OpKind::NodeReduce | OpKind::NodeReduceScatter);
                if let Some(l) = my_lane {
                    let pieces = lay.lane_pieces(l);
                    if k > 1 {
                        for r in &pieces {
                            // SAFETY: lane l's pieces are written only by local rank l (me)
                            // in this phase, and read only by me.
                            unsafe { sum_into(&peers, j, k, r.clone(), 1.0, false) };
                        }
                    }
                    if nn > 1 && !node_only {
                        let steps = if id.kind == OpKind::ReduceScatter {
                            ring::reduce_scatter(n, nn)
                        } else {
                            ring::all_reduce(n, nn)
                        };
                        let job = RingJob {
                            buf: raw,
                            pieces: &pieces,
                            steps: &steps,
                            next,
                            prev,
                            op: id.kind.code(),
                            seq: id.seq,
                            step_base: 0,
                            dtype: self.wire,
                            // The all-gather half starts with this node's finished piece.
                            round_step: (id.kind != OpKind::ReduceScatter).then_some(nn - 1),
                        };
                        self.on_lane(id, bytes, deadline, LaneTask::Ring(job))?;
                    }
                    if reduce == ReduceOp::Mean {
                        let owned = if id.kind == OpKind::ReduceScatter {
                            vec![lay.piece(n, l)]
                        } else {
                            pieces.clone()
                        };
                        let by = if node_only { k as f32 } else { world };
                        for r in owned {
                            let dst = unsafe { peers.write(j, r) };
                            dst.iter_mut().for_each(|x| *x /= by);
                        }
                    }
                }
                self.barrier(id, bytes, deadline)?;
                if matches!(id.kind, OpKind::HybridReduce | OpKind::NodeReduceScatter) {
                    // Each rank keeps its lane's pieces; nothing to gather.
                } else if id.kind == OpKind::ReduceScatter {
                    let mine = lay.chunk(self.rank);
                    for l in (0..lanes).filter(|&l| l != j) {
                        let r = intersect(&mine, &lay.piece(n, l));
                        copy_from(&peers, l, j, r);
                    }
                } else {
                    for l in (0..lanes).filter(|&l| l != j) {
                        for r in lay.lane_pieces(l) {
                            copy_from(&peers, l, j, r);
                        }
                    }
                }
            }
            OpKind::AllGather => {
                if let Some(l) = my_lane {
                    let first = table.first_rank(n);
                    let piece = lay.piece(n, l);
                    for i in (0..k).filter(|&i| i != j) {
                        let r = intersect(&lay.chunk(first + i), &piece);
                        copy_from(&peers, i, j, r);
                    }
                    if nn > 1 {
                        let pieces = lay.lane_pieces(l);
                        let steps = ring::all_gather(n, nn);
                        let job = RingJob {
                            buf: raw,
                            pieces: &pieces,
                            steps: &steps,
                            next,
                            prev,
                            op: id.kind.code(),
                            seq: id.seq,
                            step_base: 0,
                            dtype: self.wire,
                            round_step: Some(0),
                        };
                        self.on_lane(id, bytes, deadline, LaneTask::Ring(job))?;
                    }
                }
                self.barrier(id, bytes, deadline)?;
                for l in (0..lanes).filter(|&l| l != j) {
                    for r in lay.lane_pieces(l) {
                        copy_from(&peers, l, j, r);
                    }
                }
            }
            OpKind::Broadcast => {
                let (rn, rl) = table.locate(arg);
                if let Some(l) = my_lane {
                    let pieces = lay.lane_pieces(l);
                    if n == rn && j != rl {
                        for r in &pieces {
                            copy_from(&peers, rl, j, r.clone());
                        }
                    }
                    if nn > 1 {
                        let (recv, send) = ring::chain_role(n, rn, nn);
                        let from = recv.then_some(prev);
                        let to = send.then_some(next);
                        let task = LaneTask::Chain {
                            buf: raw,
                            pieces: &pieces,
                            from,
                            to,
                        };
                        self.on_lane(id, bytes, deadline, task)?;
                    }
                }
                self.barrier(id, bytes, deadline)?;
                for l in (0..lanes).filter(|&l| l != j) {
                    for r in lay.lane_pieces(l) {
                        copy_from(&peers, l, j, r);
                    }
                }
            }
            OpKind::NodeGather => {
                for l in (0..lanes).filter(|&l| l != j) {
                    for r in lay.lane_pieces(l) {
                        copy_from(&peers, l, j, r);
                    }
                }
            }
            OpKind::P2p => unreachable!("p2p has its own path"),
        }
        self.barrier(id, bytes, deadline)
    }

    /// One node: everything happens in shared memory between the entry and exit barriers.
    /// Rank j owns chunk j of every buffer; reductions read all k inputs once per block and
    /// (for all-reduce) write the result straight into every buffer.
    fn single_node(&self, id: OpId, peers: &Peers, lay: &Layout, arg: usize, reduce: ReduceOp) {
        let (j, k) = (self.local, self.table.ranks_on(0));
        let mine = lay.chunk(j);
        let divisor = match reduce {
            ReduceOp::Sum => 1.0,
            ReduceOp::Mean => k as f32,
        };
        match id.kind {
            // SAFETY: chunk j of every buffer belongs to rank j in this phase.
            OpKind::AllReduce | OpKind::Barrier | OpKind::NodeReduce => unsafe {
                sum_into(peers, j, k, mine, divisor, true)
            },
            // With one node, node pieces are the ranks' chunks.
            OpKind::ReduceScatter | OpKind::HybridReduce | OpKind::NodeReduceScatter => unsafe {
                sum_into(peers, j, k, mine, divisor, false)
            },
            OpKind::AllGather | OpKind::NodeGather => {
                for i in (0..k).filter(|&i| i != j) {
                    copy_from(peers, i, j, lay.chunk(i));
                }
            }
            OpKind::Broadcast => copy_from(peers, arg, j, 0..lay.len()),
            OpKind::P2p => {}
        }
    }

    fn p2p(&mut self, id: OpId, buf: &mut [f32]) -> Result<(), Error> {
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
            op: id.kind.code(),
            seq: id.seq,
            step_base: 0,
            dtype: WireDtype::F32,
            round_step: None,
        };
        let deadline = Instant::now() + self.timeout;
        self.on_lane(id, half * 4, deadline, LaneTask::Ring(job))
    }
}

/// Elements per block of the fused intra-node loops: small enough to stay in L1/L2 between
/// the reads of the k inputs and the writes.
const BLOCK: usize = 8 << 10;

/// `me[r] = sum_i buf_i[r] / divisor`, block by block in one pass over each input; with
/// `spread`, the result is also written to every other local buffer (a fused all-gather).
///
/// # Safety
/// `r` must be owned by `me` in this phase: no other rank reads or writes `r` of any buffer.
unsafe fn sum_into(
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
fn copy_from(peers: &Peers, from: usize, to: usize, r: std::ops::Range<usize>) {
    if r.is_empty() || from == to {
        return;
    }
    // SAFETY: per the phase rules, `from` only reads/writes its own lane ranges, which
    // `r` belongs to and which are final; `to` (me) is the only writer of my copy of `r`.
    let src = unsafe { peers.read(from, r.clone()) };
    let dst = unsafe { peers.write(to, r) };
    dst.copy_from_slice(src);
}

/// This process's membership in a job: the links to the other nodes and one
/// [`ProcessGroup`] per local rank.
pub struct Node {
    table: Arc<RankTable>,
    node: usize,
    endpoint: Endpoint,
    peers: Vec<Peer>,
    groups: Vec<ProcessGroup>,
    runtime: Option<tokio::runtime::Runtime>,
    shutdown_timeout: Duration,
    fingerprint: String,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("node", &self.node)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Joins the job (or hosts the coordinator on node 0), connects to every other node and
    /// starts one communication thread per local rank.
    pub fn join(cfg: NodeConfig) -> Result<Node, Error> {
        crate::abort::note_panics();
        // Each local rank's inter-node lane (its frame copies, decoding and reductions) runs as
        // a task on this runtime: at least one worker per rank keeps the lanes as parallel as
        // the ranks.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.quic.net_threads.max(cfg.ranks()))
            .thread_name("wiretrain-net")
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                context: "starting the network runtime",
                source,
            })?;
        let identity = JobIdentity::for_job(&cfg.token, cfg.job_id.as_deref())?;
        let fingerprint = identity.fingerprint();
        let (endpoint, node, table, peers, lanes) = runtime.block_on(async {
            let ep = quic::endpoint(cfg.bind, &identity, &cfg.quic)?;
            let local = ep.local_addr().map_err(|source| Error::Io {
                context: "reading the bound address",
                source,
            })?;
            if let Some(p) = cfg
                .fingerprint_file
                .as_ref()
                .filter(|_| cfg.node_rank == Some(0))
            {
                write_atomically(p, &identity.node_fingerprint()).map_err(|source| Error::Io {
                    context: "writing the fingerprint file",
                    source,
                })?;
            }
            if let Some(p) = &cfg.addr_file {
                write_atomically(p, &local.to_string()).map_err(|source| Error::Io {
                    context: "writing the address file",
                    source,
                })?;
            }
            tracing::info!(%local, nnodes = cfg.nnodes, "node endpoint up");
            // The CA fingerprint identifies the job token's CA: debug only.
            tracing::debug!(ca_fingerprint = %fingerprint, "job CA");
            let (table, me, peers) = if cfg.node_rank == Some(0) {
                let (t, p) =
                    rendezvous::coordinate(&ep, &cfg, local, &identity.node_fingerprint()).await?;
                (t, 0, p)
            } else {
                let (t, me, p0) = rendezvous::join(&ep, &identity, &cfg).await?;
                (t, me, vec![p0])
            };
            let peers = rendezvous::mesh(&ep, &identity, &cfg, &table, me, peers).await?;
            let lanes = rendezvous::open_lanes(&cfg, &table, me, &peers).await?;
            Ok::<_, Error>((ep, me, table, peers, lanes))
        })?;
        let table = Arc::new(table);
        let k = table.ranks_on(node);
        let shared = Arc::new(NodeShared::new(k));
        let ep2 = endpoint.clone();
        let on_fail: FailHook = Arc::new(move |why: String| {
            let mut why = why.into_bytes();
            why.truncate(900); // a CONNECTION_CLOSE reason must fit in a packet
            ep2.close(VarInt::from_u32(close_code::FAILED), &why);
        });
        let mut lanes: Vec<Option<LaneLinks>> = lanes.into_iter().map(Some).collect();
        let mut groups = Vec::with_capacity(k);
        for local in 0..k {
            let rank = table.global_rank(node, local);
            let lane = lanes.get_mut(local).and_then(Option::take);
            let sent = lane.as_ref().map(|l| l.sent.clone());
            let mut ex = Executor {
                rank,
                local,
                node,
                table: table.clone(),
                shared: shared.clone(),
                lane,
                rt: runtime.handle().clone(),
                timeout: cfg.collective_timeout,
                failed: None,
                on_fail: on_fail.clone(),
                inter: None,
                wire: WireDtype::F32,
                #[cfg(test)]
                panic_at: cfg.test_panic_at,
            };
            let aborter = Aborter {
                shared: shared.clone(),
                on_fail: on_fail.clone(),
                local,
                rank,
            };
            let on_panic = aborter.clone();
            let gone: Gone = Arc::default();
            let gone_w = gone.clone();
            let (tx, rx) = mpsc::channel::<Job>();
            let worker = std::thread::Builder::new()
                .name(format!("wiretrain-comm-{rank}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        // A panic here may come between barriers, with other local ranks
                        // using this rank's buffer: the collective leaked it (it was held in
                        // a ManuallyDrop), and the node fails at once with the message.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            job(&mut ex);
                        }));
                        if let Err(p) = r {
                            let why = format!(
                                "local rank {local} panicked in its communication thread: {}",
                                crate::abort::panic_message(&*p)
                            );
                            *gone_w.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
                            on_panic.abort(&why);
                            break;
                        }
                    }
                })
                .map_err(|source| Error::Io {
                    context: "spawning a communication thread",
                    source,
                })?;
            groups.push(ProcessGroup {
                rank,
                local_rank: local,
                node,
                table: table.clone(),
                next_seq: 0,
                tx: Some(tx),
                worker: Some(worker),
                sent,
                flight: Arc::new(std::sync::Mutex::new(crate::flight::FlightRecorder::new(
                    rank,
                ))),
                wire: WireDtype::F32,
                timeout: cfg.collective_timeout,
                gone,
                aborter,
            });
        }
        Ok(Node {
            table,
            node,
            endpoint,
            peers,
            groups,
            runtime: Some(runtime),
            shutdown_timeout: cfg.collective_timeout,
            fingerprint,
        })
    }

    pub fn node(&self) -> usize {
        self.node
    }
    pub fn table(&self) -> &RankTable {
        &self.table
    }
    /// Fingerprint of the job certificate (derived from the token; safe to print).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The counters of this node's connection to every other node (path MTU, RTT, losses,
    /// datagrams per system call), in node order.
    pub fn link_stats(&self) -> Vec<crate::rendezvous::LinkStats> {
        self.peers.iter().map(rendezvous::Peer::stats).collect()
    }

    /// The process groups of this node's ranks, in local-rank order (once).
    pub fn take_groups(&mut self) -> Vec<ProcessGroup> {
        std::mem::take(&mut self.groups)
    }

    /// Clean shutdown: exchanges goodbyes with every node (so nothing in flight is cut off),
    /// closes the connections and waits for the endpoint to drain. Drop the process groups
    /// first.
    pub fn shutdown(mut self) -> Result<(), Error> {
        self.groups.clear();
        let rt = self.runtime.take().expect("runtime present until shutdown");
        let within = self.shutdown_timeout;
        let res = rt.block_on(async {
            let r = rendezvous::goodbye(self.node, &mut self.peers, within).await;
            let _ = tokio::time::timeout(Duration::from_secs(3), self.endpoint.wait_idle()).await;
            r
        });
        rt.shutdown_timeout(Duration::from_secs(1));
        res.map_err(|reason| {
            Error::Rendezvous(RendezvousError::Transport(TransportError::Lost {
                peer: "peers at shutdown".into(),
                reason,
            }))
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.groups.clear();
        if let Some(rt) = self.runtime.take() {
            // Dropped without shutdown (an error path): tell peers at once.
            self.endpoint.close(
                VarInt::from_u32(close_code::FAILED),
                b"node exited without shutdown",
            );
            // Let the close packets leave before the runtime stops (connections closed
            // earlier with a reason keep that reason).
            let ep = self.endpoint.clone();
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_millis(500), ep.wait_idle()).await;
            });
            rt.shutdown_timeout(Duration::from_millis(200));
        }
    }
}

fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}

#[cfg(test)]
mod panic_tests;
