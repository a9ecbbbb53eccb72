//! NCCL collectives on CUDA devices (cargo feature `nccl`), for NVLink/InfiniBand clusters.
//!
//! Built on cudarc with dynamic loading: nothing links at build time, so the feature compiles
//! (and its tests run, skipping) on machines without CUDA. At run time [`probe`] says whether
//! `libcuda` and `libnccl` are present and how many devices there are; where libnccl is
//! missing, the `nvidia-nccl-cu13` Python wheel ships `libnccl.so.2`, which cudarc does not
//! look for: link it as `libnccl.so` in a directory on `LD_LIBRARY_PATH`.
//!
//! The NCCL unique id travels through wiretrain's own rendezvous: rank 0 creates it and
//! broadcasts its 128 bytes over the job's process group (QUIC between nodes, shared memory
//! inside one) with the bytes collective. Every rank then joins the NCCL
//! communicator with its global rank, on its own CUDA device.

use crate::bench::{BenchOp, BenchRow, BenchSpec};
use crate::group::{ProcessGroup, ReduceOp};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What can go wrong on the NCCL path.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// The NCCL path cannot run here (no CUDA driver, no libnccl, no device) or its init
    /// thread could not start or panicked; holds why, in words a user can act on.
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA: {0:?}")]
    Cuda(cudarc::driver::DriverError),
    /// An NCCL call failed.
    #[error("NCCL: {0:?}")]
    Nccl(cudarc::nccl::result::NcclError),
    /// A collective of wiretrain's process group failed (the NCCL id's broadcast, a barrier).
    #[error("exchanging the NCCL id through the process group: {0}")]
    Exchange(#[from] crate::Error),
    /// An output buffer has the wrong length for the collective.
    #[error("{what}: {got} elements, {want} expected")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Its length, in elements.
        got: usize,
        /// The length the collective needs, in elements.
        want: usize,
    },
    /// NCCL did not finish within the job's collective timeout; the communicator was aborted
    /// (`ncclCommAbort`), as PyTorch's NCCL watchdog does.
    #[error(
        "{what} on rank {rank} of {world} did not finish within {secs:.0} s (a rank died, hangs, \
         or never joined); the NCCL communicator was aborted"
    )]
    Timeout {
        /// What did not finish (the init, or a collective).
        what: &'static str,
        /// This rank.
        rank: usize,
        /// Ranks in the communicator.
        world: usize,
        /// The timeout that passed, in seconds.
        secs: f64,
    },
    /// The communicator was aborted by an earlier timeout; holds that failure's message.
    #[error("the NCCL communicator was aborted earlier: {0}")]
    Aborted(String),
}

impl From<cudarc::driver::DriverError> for NcclError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Self::Cuda(e)
    }
}

impl From<cudarc::nccl::result::NcclError> for NcclError {
    fn from(e: cudarc::nccl::result::NcclError) -> Self {
        Self::Nccl(e)
    }
}

/// The CUDA devices of this machine, or why the NCCL path cannot run here (no driver, no
/// libnccl), in words a user can act on.
pub fn probe() -> Result<usize, NcclError> {
    // SAFETY: only tries to open the shared libraries by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NcclError::Unavailable(
            "no CUDA driver (libcuda.so) on this machine".into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(NcclError::Unavailable(
            "libnccl.so not found: install NCCL, or `pip install nvidia-nccl-cu13` and link its \
             nvidia/nccl/lib/libnccl.so.2 as libnccl.so in a directory on LD_LIBRARY_PATH \
             (cudarc does not look for the .so.2 name)"
                .into(),
        ));
    }
    let n = CudaContext::device_count()?;
    if n < 1 {
        return Err(NcclError::Unavailable(
            "the CUDA driver sees no device".into(),
        ));
    }
    Ok(n as usize)
}

/// One rank's NCCL communicator over the whole job. Init and every wait on the stream are
/// bounded by the job's collective timeout; past it the communicator is aborted and every
/// later call fails with [`NcclError::Aborted`].
pub struct NcclGroup {
    /// `None` once aborted.
    comm: Option<Comm>,
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    timeout: Duration,
    aborted: Option<String>,
}

/// A communicator handed from the init thread to the rank's thread. NCCL communicators may be
/// used from any one thread at a time; cudarc's `Comm` does not say so itself.
struct SentComm(Comm);
// SAFETY: the communicator moves once, from the init thread to its owner; never shared.
unsafe impl Send for SentComm {}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Mean => cudarc::nccl::ReduceOp::Avg,
    }
}

impl NcclGroup {
    /// Joins the job's NCCL communicator on CUDA device `device` (a collective: every rank of
    /// `pg` calls it). The id is exchanged over `pg`, then every rank meets at a barrier, so
    /// NCCL's own bootstrap only starts once all are there; the init itself is bounded by
    /// `pg`'s collective timeout.
    pub fn new(pg: &mut ProcessGroup, device: usize) -> Result<Self, NcclError> {
        probe()?;
        let id = share_id(pg)?;
        pg.barrier()?;
        Self::init(device, pg.rank(), pg.world(), id, pg.timeout())
    }

    /// NCCL's init for `rank` of `world` on CUDA device `device` with an id every rank shares,
    /// bounded by `timeout`: past it this returns [`NcclError::Timeout`] and the init, left
    /// blocked in NCCL, aborts the communicator if it ever completes.
    pub fn init(
        device: usize,
        rank: usize,
        world: usize,
        id: [std::ffi::c_char; 128],
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let made = (|| -> Result<_, NcclError> {
                    let ctx = CudaContext::new(device)?;
                    let stream = ctx.default_stream();
                    let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(id))?;
                    Ok((ctx, stream, SentComm(comm)))
                })();
                // A receiver gone (timed out) drops the communicator: cudarc aborts it.
                let _ = tx.send(made);
            })
            .map_err(|e| NcclError::Unavailable(format!("starting NCCL's init thread: {e}")))?;
        match rx.recv_timeout(timeout) {
            Ok(made) => {
                let (ctx, stream, SentComm(comm)) = made?;
                Ok(Self {
                    comm: Some(comm),
                    rank,
                    world,
                    ctx,
                    stream,
                    timeout,
                    aborted: None,
                })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(NcclError::Timeout {
                what: "NCCL init",
                rank,
                world,
                secs: timeout.as_secs_f64(),
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(NcclError::Unavailable("NCCL's init thread panicked".into()))
            }
        }
    }

    fn comm(&self) -> Result<&Comm, NcclError> {
        match (&self.comm, &self.aborted) {
            (Some(c), _) => Ok(c),
            (None, why) => Err(NcclError::Aborted(why.clone().unwrap_or_default())),
        }
    }

    /// Aborts the communicator (`ncclCommAbort`, through cudarc's drop), once.
    fn abort(&mut self, why: String) {
        if let Some(c) = self.comm.take() {
            tracing::error!(rank = self.rank, "aborting the NCCL communicator: {why}");
            // cudarc panics when the abort itself fails; the communicator is gone either way.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(c)));
        }
        self.aborted = Some(why);
    }

    /// The bound on init and on each [`Self::sync`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the bound on each later [`Self::sync`].
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// This rank in the communicator (its global rank in the job).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator (the job's world size).
    pub fn world(&self) -> usize {
        self.world
    }

    /// The CUDA stream the collectives are queued on (the device's default stream).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A device buffer holding `host`.
    pub fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, NcclError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download(&self, dev: &CudaSlice<f32>) -> Result<Vec<f32>, NcclError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// Sum or mean over all ranks, in place.
    pub fn all_reduce(&self, buf: &mut CudaSlice<f32>, op: ReduceOp) -> Result<(), NcclError> {
        self.comm()?.all_reduce_in_place(buf, &nccl_op(op))?;
        Ok(())
    }

    /// `dst` (len / world elements) gets this rank's slice of the reduction of `src`.
    pub fn reduce_scatter(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        let want = src.len() / self.world();
        if dst.len() != want || !src.len().is_multiple_of(self.world()) {
            return Err(NcclError::Length {
                what: "reduce-scatter output",
                got: dst.len(),
                want,
            });
        }
        self.comm()?.reduce_scatter(src, dst, &nccl_op(op))?;
        Ok(())
    }

    /// `dst` (world x src.len() elements) gets every rank's `src`, in rank order.
    pub fn all_gather(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), NcclError> {
        let want = src.len() * self.world();
        if dst.len() != want {
            return Err(NcclError::Length {
                what: "all-gather output",
                got: dst.len(),
                want,
            });
        }
        self.comm()?.all_gather(src, dst)?;
        Ok(())
    }

    /// Everyone gets `root`'s buffer, in place.
    pub fn broadcast(&self, buf: &mut CudaSlice<f32>, root: usize) -> Result<(), NcclError> {
        self.comm()?.broadcast_in_place(buf, root as i32)?;
        Ok(())
    }

    /// Waits until the collectives queued on this rank's stream have finished, at most the
    /// timeout: past it the communicator is aborted (NCCL kernels waiting for a dead or hung
    /// peer never finish on their own) and this returns [`NcclError::Timeout`].
    pub fn sync(&mut self) -> Result<(), NcclError> {
        self.comm()?;
        self.ctx.bind_to_thread()?;
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            // SAFETY: the stream belongs to this group's context, bound to this thread above.
            let status = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match status {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(cudarc::driver::DriverError(other).into()),
            }
            if start.elapsed() >= self.timeout {
                let e = NcclError::Timeout {
                    what: "an NCCL collective",
                    rank: self.rank,
                    world: self.world,
                    secs: self.timeout.as_secs_f64(),
                };
                self.abort(e.to_string());
                return Err(e);
            }
            // Spin briefly (collectives of small buffers finish in microseconds), then nap.
            polls += 1;
            if polls < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

/// Rank 0 makes the NCCL unique id and broadcasts its 128 bytes over `pg` (a collective: every
/// rank calls it), through [`ProcessGroup::broadcast_bytes`].
pub fn share_id(pg: &mut ProcessGroup) -> Result<[std::ffi::c_char; 128], NcclError> {
    let id = if pg.rank() == 0 {
        Id::new()?.internal().map(|c| c as u8)
    } else {
        [0u8; 128]
    };
    let got = pg.broadcast_bytes(&id, 0)?;
    let mut raw = [0 as std::ffi::c_char; 128];
    for (r, b) in raw.iter_mut().zip(&got) {
        *r = *b as std::ffi::c_char;
    }
    Ok(raw)
}

/// `wiretrain bench --backend nccl` on this rank: the same table as the QUIC benchmark
/// (nccl-tests definitions), with the buffers on this rank's CUDA device and the collectives
/// run by NCCL; `spec.check` compares all-reduce results with the serial reference. Every
/// rank of the job calls it with the same spec.
pub fn bench_rank(
    pg: &mut ProcessGroup,
    device: usize,
    spec: &BenchSpec,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, NcclError> {
    let mut g = NcclGroup::new(pg, device)?;
    let mut rows = Vec::new();
    for &op in &spec.ops {
        if !matches!(
            op,
            BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::AllGather | BenchOp::Broadcast
        ) {
            continue;
        }
        for &bytes in &spec.sizes {
            let row = bench_row(&mut g, pg, spec, op, bytes)?;
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Element `i` of rank `rank`'s benchmark input (the check recomputes it for every rank).
fn bench_value(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 3) % 19) as f32 - 9.0
}

/// One row of the NCCL benchmark: `op` on a buffer of `bytes` (rounded down to whole f32s
/// per rank).
fn bench_row(
    g: &mut NcclGroup,
    pg: &mut ProcessGroup,
    spec: &BenchSpec,
    op: BenchOp,
    bytes: usize,
) -> Result<BenchRow, NcclError> {
    let world = g.world();
    // nccl-tests' sizes: the full buffer, a multiple of the world size.
    let len = (bytes / 4) / world * world;
    let host: Vec<f32> = (0..len).map(|i| bench_value(g.rank(), i)).collect();
    let t = median_time(g, pg, spec, op, &host)?;
    let wrong = if spec.check && op == BenchOp::AllReduce {
        all_reduce_errors(g, spec.reduce, &host)?
    } else {
        0
    };
    let algbw = if t > 0.0 {
        4.0 * len as f64 / t / 1e9
    } else {
        0.0
    };
    Ok(BenchRow {
        op: op.name(),
        bytes: 4 * len,
        nodes: pg.table().num_nodes(),
        ranks: world,
        time_us: t * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * op.bus_factor(world),
        wrong,
        iters: spec.iters,
        wire: "f32",
        wire_bytes: 0,
    })
}

/// The median time of `spec.iters` runs of `op` on `host`'s data, after `spec.warmup`
/// untimed ones; every run starts on a barrier of all ranks.
fn median_time(
    g: &mut NcclGroup,
    pg: &mut ProcessGroup,
    spec: &BenchSpec,
    op: BenchOp,
    host: &[f32],
) -> Result<f64, NcclError> {
    let world = g.world();
    let mut full = g.upload(host)?;
    let mut part = g.upload(&host[..host.len() / world])?;
    let mut times = Vec::with_capacity(spec.iters);
    for it in 0..spec.warmup + spec.iters {
        g.sync()?;
        pg.barrier()?;
        let t = std::time::Instant::now();
        match op {
            BenchOp::AllReduce => g.all_reduce(&mut full, spec.reduce)?,
            BenchOp::ReduceScatter => g.reduce_scatter(&full, &mut part, spec.reduce)?,
            BenchOp::AllGather => g.all_gather(&part, &mut full)?,
            _ => g.broadcast(&mut full, it % world)?,
        }
        g.sync()?;
        if it >= spec.warmup {
            times.push(t.elapsed().as_secs_f64());
        }
        if op == BenchOp::AllReduce {
            // Fresh input for the next iteration (and the check).
            full = g.upload(host)?;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times.get(times.len() / 2).copied().unwrap_or(0.0))
}

/// How many elements of an all-reduce of `host` differ from the serial reduction of every
/// rank's input.
fn all_reduce_errors(g: &NcclGroup, reduce: ReduceOp, host: &[f32]) -> Result<u64, NcclError> {
    let world = g.world();
    let mut probe = g.upload(host)?;
    g.all_reduce(&mut probe, reduce)?;
    let got = g.download(&probe)?;
    let mut wrong = 0u64;
    for (i, v) in got.iter().enumerate() {
        let s: f32 = (0..world).map(|r| bench_value(r, i)).sum();
        let want = match reduce {
            ReduceOp::Sum => s,
            ReduceOp::Mean => s / world as f32,
        };
        if (v - want).abs() > 1e-6 * want.abs().max(1.0) {
            wrong += 1;
        }
    }
    Ok(wrong)
}
