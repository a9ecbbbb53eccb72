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
//! Between nodes the ring frames carry the call's wire dtype ([`CallOpts::wire`], else the
//! group's default, [`ProcessGroup::set_wire_dtype`]: f32, f16, bf16 or int8, see
//! [`crate::codec`]); inside a node everything stays f32. A
//! reduction decodes each received frame and adds it in f32. Before an all-gather sends a
//! node's own finished piece, the node replaces it by its decoded form, so every rank ends with
//! bit-identical values. Broadcast and p2p always carry f32.

use crate::abort::Aborter;
use crate::algo::Scopes;
use crate::error::{CollectiveError, Error};
pub use crate::op::{Group, OpId, OpKind};
use crate::topology::RankTable;
use crate::wire::WireDtype;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

/// Reduction applied by all-reduce and reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Sum divided by the world size.
    Mean,
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
    /// The identity (kind, group, sequence number) of the call this handle waits for.
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
/// parked in the node's shared state ([`NodeShared::park`]) rather than freed, and freed when
/// the last rank of the node lets go of that state (the node's teardown, e.g. a heal's). Every
/// collective holds its buffer in a `ManuallyDrop` until here, so a panic in between (which
/// unwinds past this call) leaks it: a leak is safe where a free is not.
fn keep_or_park(
    ex: &Executor,
    r: Result<(), Error>,
    buf: ManuallyDrop<Vec<f32>>,
) -> Result<Vec<f32>, Error> {
    let buf = ManuallyDrop::into_inner(buf);
    match r {
        Ok(()) => Ok(buf),
        Err(e) => {
            ex.shared.park(buf);
            Err(e)
        }
    }
}

/// Records the calls of one job in the flight recorder as the executor runs them.
struct Steps {
    flight: Arc<std::sync::Mutex<crate::flight::FlightRecorder>>,
}

impl Steps {
    /// Runs call `id` with `f`, recording when it started and finished and how it ended.
    fn step<T>(
        &self,
        ex: &mut Executor,
        id: OpId,
        f: impl FnOnce(&mut Executor) -> Result<T, Error>,
    ) -> Result<T, Error> {
        lock(&self.flight).started(id);
        ex.inter = None;
        let r = f(ex);
        let mut fl = lock(&self.flight);
        fl.inter_link(id, ex.inter.take());
        fl.finished(id, r.as_ref().err().map(|e| crate::error::report(e)));
        r
    }
}

/// The handle of one rank: submit collectives here. Owned by the rank's thread.
pub struct ProcessGroup {
    rank: usize,
    local_rank: usize,
    node: usize,
    table: Arc<RankTable>,
    /// This rank's view of each group (world, node, replica).
    scopes: Arc<Scopes>,
    /// The last sequence number of each group, indexed by `Group::index`.
    seqs: [u64; 3],
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
    /// The node's point-to-point messaging (`send`, `recv`).
    p2p: Arc<crate::p2p::P2p>,
    /// The last number given to a message call (apart from the collectives').
    messages: u64,
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
    /// This rank's global rank in the job (0 to [`Self::world`] - 1).
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// This rank's index among the ranks of its node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    /// The node rank of the node this rank runs on.
    pub fn node(&self) -> usize {
        self.node
    }
    /// The number of ranks in the job.
    pub fn world(&self) -> usize {
        self.table.world()
    }
    /// The job's rank table: every node and its ranks.
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

    /// Bytes this rank's collectives have sent to other nodes so far (QUIC frame payloads and
    /// headers, as written to its lane's streams; 0 for a rank that carries no lane or a
    /// single-node job). Point-to-point messages ([`Self::send`]) are not counted.
    pub fn bytes_sent(&self) -> u64 {
        self.sent
            .as_ref()
            .map_or(0, |s| s.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// This rank's shard of a buffer of `len` elements (reduce-scatter output, all-gather input).
    pub fn shard_range(&self, len: usize) -> std::ops::Range<usize> {
        crate::topology::shard_range(len, self.world(), self.rank)
    }

    /// The element type the ring frames between nodes carry from now on (all-reduce,
    /// reduce-scatter, all-gather); returns the previous one. Every rank of the job must use
    /// the same dtype for the same collective (a mismatch is a protocol error naming both).
    pub fn set_wire_dtype(&mut self, dtype: WireDtype) -> WireDtype {
        std::mem::replace(&mut self.wire, dtype)
    }

    /// The element type the ring frames between nodes carry by default (see
    /// [`Self::set_wire_dtype`]).
    pub fn wire_dtype(&self) -> WireDtype {
        self.wire
    }

    /// The deadline of every collective submitted from now on (e.g. a longer one around a
    /// checkpoint write, which some ranks wait out while others write); returns the previous
    /// one. Starts as the node's collective timeout.
    pub fn set_timeout(&mut self, timeout: Duration) -> Duration {
        std::mem::replace(&mut self.timeout, timeout)
    }

    /// The deadline of each collective submitted from now on (see [`Self::set_timeout`]).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The flight recorder of this rank: its last collectives and how they ended.
    pub fn flight_recorder(&self) -> Vec<crate::flight::Entry> {
        lock(&self.flight).entries()
    }

    /// Time so far during which this rank's communication thread was running a collective
    /// (from each call's start to its end): with the waits a step exposed, how much of its
    /// communication was hidden behind compute.
    pub fn comm_busy(&self) -> Duration {
        Duration::from_secs_f64(lock(&self.flight).busy_ms().max(0.0) / 1e3)
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
        opts: CallOpts,
        run: impl FnOnce(&mut Executor, OpId) -> Result<T, Error> + Send + 'static,
    ) -> Work<T> {
        self.submit_steps(&[(kind, opts.group)], bytes, opts, move |ex, ids, rec| {
            rec.step(ex, ids[0], |ex| run(ex, ids[0]))
        })
    }

    /// Submits one job of consecutive calls, each `(kind, group)` numbered in its own group;
    /// `run` executes them, each through [`Steps::step`] (which records it in the flight
    /// recorder). The job's wire dtype is that of its first call.
    fn submit_steps<T: Send + 'static>(
        &mut self,
        calls: &[(OpKind, Group)],
        bytes: usize,
        opts: CallOpts,
        run: impl FnOnce(&mut Executor, &[OpId], &Steps) -> Result<T, Error> + Send + 'static,
    ) -> Work<T> {
        let ids: Vec<OpId> = calls
            .iter()
            .map(|&(kind, group)| {
                let seq = &mut self.seqs[group.index()];
                *seq += 1;
                OpId {
                    kind,
                    group,
                    seq: *seq,
                }
            })
            .collect();
        let (rtx, rx) = mpsc::sync_channel(1);
        let wire = match calls[0].0 {
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather | OpKind::Barrier => {
                opts.wire.unwrap_or(self.wire)
            }
            _ => WireDtype::F32,
        };
        {
            let mut f = lock(&self.flight);
            for id in &ids {
                let ranks = self.group_rank(id.group).map_or(1, |(_, n)| n);
                f.submitted(*id, ranks, bytes, wire.name(), opts.tag);
            }
        }
        let rec = Steps {
            flight: self.flight.clone(),
        };
        let rank = self.rank;
        let timeout = self.timeout;
        let last = *ids.last().expect("at least one call");
        let job: Job = Box::new(move |ex: &mut Executor| {
            ex.wire = wire;
            ex.timeout = timeout;
            // A panic fails the node here, so this collective's caller gets its message (the
            // buffer it held is leaked: see `keep_or_park`).
            let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(ex, &ids, &rec)
            })) {
                Ok(r) => r,
                Err(p) => Err(ex.panicked(&crate::abort::panic_message(&*p))),
            };
            let mut f = lock(&rec.flight);
            if let Err(e) = &r {
                // Calls the error cut short (or never started) end with it.
                let why = crate::error::report(e);
                for id in &ids {
                    f.finish_open(*id, &why);
                }
                if let Some(p) = f.dump_once() {
                    tracing::error!(
                        "rank {rank}: flight recorder (last {} collectives) written to {}",
                        crate::flight::CAPACITY,
                        p.display()
                    );
                }
            }
            drop(f);
            let _ = rtx.send(r);
        });
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
        }
        Work {
            id: last,
            rank: self.rank,
            rx,
            gone: self.gone.clone(),
        }
    }

    /// A call rejected before submission: it gets no sequence number, so the group's
    /// numbering stays aligned with the other ranks.
    fn invalid<T: Send + 'static>(&mut self, kind: OpKind, group: Group, why: String) -> Work<T> {
        self.ready(kind, group, Err(CollectiveError::InvalidCall(why).into()))
    }

    /// A call from a rank outside its group (the replica group of a rank past the smallest
    /// node's rank count), answered at once: an empty buffer is nothing to do, anything else
    /// is refused.
    fn outside(&mut self, kind: OpKind, group: Group, len: usize) -> Work<Vec<f32>> {
        if len == 0 {
            return self.ready(kind, group, Ok(Vec::new()));
        }
        let why = format!(
            "rank {} (local rank {}) has no {} group: a node hosts fewer ranks, so only the \
             first {} local ranks have replicas on every node; call it with an empty buffer",
            self.rank,
            self.local_rank,
            group.name(),
            self.table.lanes()
        );
        self.invalid(kind, group, why)
    }

    /// A call answered at once, without a sequence number (refused, or nothing to do).
    fn ready<T: Send + 'static>(
        &mut self,
        kind: OpKind,
        group: Group,
        r: Result<T, Error>,
    ) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let _ = tx.send(r);
        Work {
            id: OpId {
                kind,
                group,
                seq: self.seqs[group.index()],
            },
            rank: self.rank,
            rx,
            gone: self.gone.clone(),
        }
    }

    /// Sums (or averages) `buf` across all ranks, in place.
    pub fn all_reduce(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.call(CallOpts::default()).all_reduce(buf, op)
    }

    /// Reduces `buf` (the full buffer, used as scratch) across ranks and returns this rank's
    /// shard, `shard_range(buf.len())`.
    pub fn reduce_scatter(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.call(CallOpts::default()).reduce_scatter(buf, op)
    }

    /// In-place reduce-scatter: `buf` comes back with the reduced shard at
    /// `shard_range(buf.len())` (the rest is scratch). No allocation.
    pub fn reduce_scatter_in_place(&mut self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.call(CallOpts::default())
            .reduce_scatter_in_place(buf, op)
    }

    /// In-place all-gather: `buf` is the full buffer with this rank's shard already at
    /// `shard_range(buf.len())`; it comes back complete. No allocation.
    pub fn all_gather_in_place(&mut self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.call(CallOpts::default()).all_gather_in_place(buf)
    }

    /// Gathers every rank's shard of a `total`-element buffer; `shard` must have
    /// `shard_range(total).len()` elements.
    pub fn all_gather(&mut self, shard: Vec<f32>, total: usize) -> Work<Vec<f32>> {
        self.call(CallOpts::default()).all_gather(shard, total)
    }

    /// Copies `root`'s buffer to every rank; all ranks pass buffers of the same length.
    pub fn broadcast(&mut self, buf: Vec<f32>, root: usize) -> Work<Vec<f32>> {
        if root >= self.world() {
            let why = format!(
                "broadcast root {root} is not below world size {}",
                self.world()
            );
            return self.invalid(OpKind::Broadcast, Group::World, why);
        }
        self.submit(
            OpKind::Broadcast,
            4 * buf.len(),
            CallOpts::default(),
            move |ex, id| {
                let mut buf = ManuallyDrop::new(buf);
                let r = ex.collective(id, &mut buf, root, ReduceOp::Sum);
                keep_or_park(ex, r, buf)
            },
        )
    }

    /// Blocks until every rank has reached the barrier.
    pub fn barrier(&mut self) -> Result<(), Error> {
        self.submit(OpKind::Barrier, 0, CallOpts::default(), |ex, id| {
            let mut one = ManuallyDrop::new(vec![0.0f32]);
            let r = ex.collective(id, &mut one, 0, ReduceOp::Sum);
            keep_or_park(ex, r, one).map(|_| ())
        })
        .wait()
    }

    /// This rank's place in `group`: its rank there and the group's size; `None` for the
    /// replica group of a rank past the smallest node's rank count (it has no replica on
    /// that node).
    pub fn group_rank(&self, group: Group) -> Option<(usize, usize)> {
        self.scopes.get(group).map(|s| (s.rank(), s.size()))
    }

    /// This rank's shard of `len` elements in `group`: what a reduce-scatter on that group
    /// leaves it and an all-gather takes from it. In the node group the shards are the same
    /// positions on every node (the node cuts into as many shards as the smallest node has
    /// ranks; ranks past them own an empty shard), so the replica group of a rank holds the
    /// same elements: hybrid sharding's shard.
    pub fn group_shard(&self, group: Group, len: usize) -> std::ops::Range<usize> {
        self.scopes.get(group).map_or(len..len, |s| s.shard(len))
    }

    /// Raw transport measurement: lane owners send the first half of `buf` to the next node
    /// and receive the second half from the previous node, both directions at once.
    /// Ranks without a lane return at once. For `wiretrain bench --op p2p`.
    pub fn p2p_exchange(&mut self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.submit(
            OpKind::P2p,
            4 * buf.len(),
            CallOpts::default(),
            move |ex, id| {
                let mut buf = ManuallyDrop::new(buf);
                let r = ex.p2p(id, &mut buf);
                keep_or_park(ex, r, buf)
            },
        )
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
                self.seqs[Group::World.index()]
            ));
        }
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

mod bytes;
pub use bytes::MAX_BYTES;
mod call;
mod executor;
mod messages;
mod node;
mod phases;

pub use call::{Call, CallOpts};
use executor::Executor;
pub use node::Node;

#[cfg(test)]
mod lane_tests;
#[cfg(test)]
mod panic_tests;
