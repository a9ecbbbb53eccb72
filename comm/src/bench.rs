//! An nccl-tests-style benchmark harness: one description per collective (name, bandwidth
//! factor, input, expected output), one timing loop, one table.
//!
//! Conventions (nccl-tests, GB = 1e9 bytes):
//! * size: all-reduce and broadcast the buffer; reduce-scatter its full input; all-gather its
//!   full output; p2p and sendrecv the bytes sent each way.
//! * algbw = size / time; busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n (reduce-scatter,
//!   all-gather), x 1 (broadcast, p2p, sendrecv).
//! * time: per iteration, the slowest rank; the table reports the median over iterations
//!   (ranks are lined up with a barrier before each timed call, which is not timed).
//!
//! With `check`, every iteration's output is compared element by element to a serial
//! reference (inputs are small integers, so sums are exact in any order) and the number of
//! wrong elements is reported, like nccl-tests' `#wrong`.

use crate::error::{CollectiveError, Error};
use crate::group::{CallOpts, ProcessGroup, ReduceOp};
use crate::topology::shard_range;
use crate::wire::WireDtype;
use serde::Serialize;
use std::time::Instant;

/// A collective the harness can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchOp {
    /// All-reduce of a `size`-byte buffer.
    AllReduce,
    /// Reduce-scatter of a `size`-byte input (in place).
    ReduceScatter,
    /// All-gather into a `size`-byte output (in place).
    AllGather,
    /// Broadcast of a `size`-byte buffer (the root changes every iteration).
    Broadcast,
    /// Raw exchange between neighbouring nodes, `size` bytes each way
    /// ([`ProcessGroup::p2p_exchange`]; skipped on one node).
    P2p,
    /// Point-to-point messages around the ring of ranks: each rank sends `size` bytes to the
    /// next rank and receives as many from the previous one ([`ProcessGroup::send`] and
    /// [`ProcessGroup::recv`], what pipeline stages exchange; the send's copy of the buffer
    /// is timed); skipped on one rank.
    SendRecv,
    /// Baseline: one memcpy of `size` bytes on rank 0 (no communication).
    Memcpy,
}

impl BenchOp {
    /// Every collective, in table order ([`BenchOp::Memcpy`], a baseline, is not one).
    pub const ALL: [BenchOp; 6] = [
        BenchOp::AllReduce,
        BenchOp::ReduceScatter,
        BenchOp::AllGather,
        BenchOp::Broadcast,
        BenchOp::P2p,
        BenchOp::SendRecv,
    ];

    /// The name in flags and in the table (e.g. `"all-reduce"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all-reduce",
            Self::ReduceScatter => "reduce-scatter",
            Self::AllGather => "all-gather",
            Self::Broadcast => "broadcast",
            Self::P2p => "p2p",
            Self::SendRecv => "sendrecv",
            Self::Memcpy => "memcpy",
        }
    }

    /// The op named `s` (as [`Self::name`] writes it, `"memcpy"` included), if any.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .chain([Self::Memcpy])
            .find(|o| o.name() == s)
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Self::AllReduce => 2.0 * (n - 1.0) / n,
            Self::ReduceScatter | Self::AllGather => (n - 1.0) / n,
            Self::Broadcast | Self::P2p | Self::SendRecv | Self::Memcpy => 1.0,
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// The ops to measure, in order.
    pub ops: Vec<BenchOp>,
    /// Sizes in bytes (multiples of 4).
    pub sizes: Vec<usize>,
    /// Timed iterations per op and size.
    pub iters: usize,
    /// Untimed iterations before them.
    pub warmup: usize,
    /// Compare every timed iteration's output with a serial reference.
    pub check: bool,
    /// The reduction of all-reduce and reduce-scatter.
    pub reduce: ReduceOp,
    /// The element type between nodes for all-reduce, reduce-scatter and all-gather.
    pub wire: WireDtype,
}

/// One table row.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// The op's name ([`BenchOp::name`]).
    pub op: &'static str,
    /// The size measured, in bytes (see the module docs for what it counts).
    pub bytes: usize,
    /// Nodes in the job.
    pub nodes: usize,
    /// Ranks in the job.
    pub ranks: usize,
    /// Median over the timed iterations of the slowest rank's time, in µs.
    pub time_us: f64,
    /// Algorithm bandwidth, `bytes / time`, in GB/s (1e9 bytes).
    pub algbw_gbps: f64,
    /// Bus bandwidth, `algbw` × [`BenchOp::bus_factor`], in GB/s.
    pub busbw_gbps: f64,
    /// Wrong elements, summed over ranks and timed iterations (0 without `check`).
    pub wrong: u64,
    /// Timed iterations.
    pub iters: usize,
    /// The wire dtype between nodes.
    pub wire: &'static str,
    /// Bytes the busiest rank sent to other nodes per call (frame headers included).
    pub wire_bytes: u64,
}

/// The input value of `rank` at element `i` in iteration `it`: small integers, exact sums.
fn value(rank: usize, it: usize, i: usize) -> f32 {
    ((rank * 7 + it * 13 + i * 3) % 19) as f32 - 9.0
}

/// Sum over ranks 0..world of `value(r, it, i)`, via a table over `(it*13 + i*3) % 19`.
struct SumTable([f32; 19]);

impl SumTable {
    fn new(world: usize) -> Self {
        let mut t = [0.0f32; 19];
        for (c, slot) in t.iter_mut().enumerate() {
            *slot = (0..world).map(|r| ((r * 7 + c) % 19) as f32 - 9.0).sum();
        }
        Self(t)
    }
    fn at(&self, it: usize, i: usize) -> f32 {
        self.0[(it * 13 + i * 3) % 19]
    }
}

fn finish(v: f32, reduce: ReduceOp, world: usize) -> f32 {
    match reduce {
        ReduceOp::Sum => v,
        ReduceOp::Mean => v / world as f32,
    }
}

/// Elements that differ from the reference: bit for bit when `tol` is 0, else by more than
/// `tol` (or NaN).
fn count_wrong(got: &[f32], tol: f32, want: impl Fn(usize) -> f32) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| {
            let w = want(*i);
            if tol == 0.0 {
                g.to_bits() != w.to_bits()
            } else {
                g.is_nan() || (**g - w).abs() > tol
            }
        })
        .count() as u64
}

/// A 32-bit digest of a buffer's bits, as two f32 halves that travel exactly.
fn digest(v: &[f32]) -> [f32; 2] {
    let mut h: u32 = 0x811c_9dc5;
    for x in v {
        h = (h ^ x.to_bits()).wrapping_mul(0x0100_0193);
    }
    [(h >> 16) as f32, (h & 0xffff) as f32]
}

/// How far a checked result may be from the exact one: 0 (bit-exact) for f32/f16/bf16, whose
/// inputs and sums here are small integers they represent exactly; for int8, half a
/// quantization step per quantization a value can see (one per node hop), with the largest
/// partial sum as the block maximum.
fn tolerance(op: BenchOp, spec: &BenchSpec, nodes: usize, world: usize) -> f32 {
    if spec.wire != WireDtype::Int8 || nodes < 2 {
        return 0.0;
    }
    let step = |amax: f32| crate::codec::int8_scale(amax);
    match op {
        BenchOp::AllReduce | BenchOp::ReduceScatter => {
            let t = nodes as f32 * 0.5 * step(9.0 * world as f32) * 1.01;
            finish(t, spec.reduce, world)
        }
        BenchOp::AllGather => 0.5 * step(9.0) * 1.01,
        _ => 0.0,
    }
}

/// One op at one size on this rank: what the iterations write and check.
struct Case<'a> {
    op: BenchOp,
    spec: &'a BenchSpec,
    world: usize,
    rank: usize,
    /// This rank's shard of the buffer.
    shard: std::ops::Range<usize>,
    /// How far a checked element may be from the exact result.
    tol: f32,
    sums: SumTable,
}

impl Case<'_> {
    /// Writes iteration `it`'s inputs (`root`: the broadcast's).
    fn fill(&self, buf: &mut [f32], it: usize, root: usize) {
        let rank = self.rank;
        match self.op {
            BenchOp::AllGather => {
                buf.iter_mut().for_each(|x| *x = f32::NAN);
                for i in self.shard.clone() {
                    buf[i] = value(rank, it, i);
                }
            }
            BenchOp::Broadcast if rank != root => buf.iter_mut().for_each(|x| *x = f32::NAN),
            BenchOp::Broadcast => buf
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(root, it, i)),
            _ => buf
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(rank, it, i)),
        }
    }

    /// Runs the collective on `buf` (memcpy: copies it into `copy_dst` on rank 0).
    fn call(
        &self,
        pg: &mut ProcessGroup,
        buf: Vec<f32>,
        root: usize,
        copy_dst: &mut [f32],
    ) -> Result<Vec<f32>, Error> {
        let opts = CallOpts::wire(self.spec.wire).tag("bench");
        let reduce = self.spec.reduce;
        Ok(match self.op {
            BenchOp::AllReduce => pg.call(opts).all_reduce(buf, reduce).wait()?,
            BenchOp::ReduceScatter => pg.call(opts).reduce_scatter_in_place(buf, reduce).wait()?,
            BenchOp::AllGather => pg.call(opts).all_gather_in_place(buf).wait()?,
            BenchOp::Broadcast => pg.broadcast(buf, root).wait()?,
            BenchOp::P2p => pg.p2p_exchange(buf).wait()?,
            BenchOp::SendRecv => send_recv(pg, buf)?,
            BenchOp::Memcpy => {
                if self.rank == 0 {
                    copy_dst.copy_from_slice(&buf);
                }
                buf
            }
        })
    }

    /// Wrong elements of iteration `it`'s result on this rank; results every rank holds
    /// must also be bit-identical on every rank (a rank whose digest differs from rank 0's
    /// counts its whole buffer).
    fn wrong(
        &self,
        pg: &mut ProcessGroup,
        out: &[f32],
        copy_dst: &[f32],
        it: usize,
        root: usize,
    ) -> Result<u64, Error> {
        let (rank, world, tol) = (self.rank, self.world, self.tol);
        let (sums, reduce, shard) = (&self.sums, self.spec.reduce, &self.shard);
        let mut wrong = match self.op {
            BenchOp::AllReduce => count_wrong(out, tol, |i| finish(sums.at(it, i), reduce, world)),
            BenchOp::ReduceScatter => count_wrong(&out[shard.clone()], tol, |i| {
                finish(sums.at(it, shard.start + i), reduce, world)
            }),
            BenchOp::AllGather => (0..world)
                .map(|g| {
                    let r = shard_range(out.len(), world, g);
                    count_wrong(&out[r.clone()], tol, |i| value(g, it, r.start + i))
                })
                .sum(),
            BenchOp::Broadcast => count_wrong(out, 0.0, |i| value(root, it, i)),
            BenchOp::P2p => {
                // Lane owners (local rank l < lanes) hold in the second half the first half
                // of local rank l of the previous node; everyone else's buffer is untouched.
                // The first half is never written.
                let (t, local, half) = (pg.table(), pg.local_rank(), out.len() / 2);
                let nn = t.num_nodes();
                let (from, off) = if nn >= 2 && local < t.lanes() {
                    (t.global_rank((pg.node() + nn - 1) % nn, local), 0)
                } else {
                    (rank, half)
                };
                count_wrong(&out[..half], 0.0, |i| value(rank, it, i))
                    + count_wrong(&out[half..], tol, |i| value(from, it, off + i))
            }
            BenchOp::SendRecv => {
                // The second half holds the previous rank's first half.
                let (half, prev) = (out.len() / 2, (rank + world - 1) % world);
                count_wrong(&out[..half], 0.0, |i| value(rank, it, i))
                    + count_wrong(&out[half..], 0.0, |i| value(prev, it, i))
            }
            BenchOp::Memcpy => count_wrong(copy_dst, 0.0, |i| value(rank, it, i)),
        };
        if matches!(
            self.op,
            BenchOp::AllReduce | BenchOp::AllGather | BenchOp::Broadcast
        ) {
            let d = digest(out);
            let all = pg.all_gather(d.to_vec(), 2 * world).wait()?;
            if all[2 * rank..2 * rank + 2] != all[0..2] {
                wrong += out.len() as u64;
            }
        }
        Ok(wrong)
    }
}

/// Runs one op at one size for `iters` (after `warmup`) on this rank; returns the row (the
/// same on every rank).
fn run_one(
    pg: &mut ProcessGroup,
    op: BenchOp,
    bytes: usize,
    spec: &BenchSpec,
) -> Result<BenchRow, Error> {
    if !bytes.is_multiple_of(4) {
        return Err(CollectiveError::InvalidCall(format!(
            "size {bytes} is not a multiple of 4 bytes (f32)"
        ))
        .into());
    }
    let (world, rank, len) = (pg.world(), pg.rank(), bytes / 4);
    let case = Case {
        op,
        spec,
        world,
        rank,
        shard: shard_range(len, world, rank),
        tol: tolerance(op, spec, pg.table().num_nodes(), world),
        sums: SumTable::new(world),
    };
    let mut times = Vec::with_capacity(spec.iters);
    let mut wrong = 0u64;
    let mut wire_sent = 0u64;
    // One buffer for the whole run, like nccl-tests: allocation is not part of a collective.
    let two_halves = matches!(op, BenchOp::P2p | BenchOp::SendRecv);
    let mut buf: Vec<f32> = vec![0.0; if two_halves { 2 * len } else { len }];
    let mut copy_dst: Vec<f32> = if op == BenchOp::Memcpy && rank == 0 {
        vec![1.0; len]
    } else {
        Vec::new()
    };
    for it in 0..spec.warmup + spec.iters {
        let timed = it >= spec.warmup;
        // Inputs are written before the barrier so only the collective is timed.
        let root = it % world;
        case.fill(&mut buf, it, root);
        pg.barrier()?;
        let sent0 = pg.bytes_sent();
        let t0 = Instant::now();
        buf = case.call(pg, buf, root, &mut copy_dst)?;
        let dt = t0.elapsed().as_secs_f64();
        wire_sent += pg.bytes_sent() - sent0;
        // Bookkeeping travels exactly (the group's default wire dtype, f32).
        // The slowest rank defines the iteration's time.
        let mine = pg.shard_range(world);
        let all = pg.all_gather(vec![dt as f32; mine.len()], world).wait()?;
        let slowest = all.iter().cloned().fold(0.0f32, f32::max) as f64;
        tracing::debug!(
            ?op,
            bytes,
            iteration = it,
            timed,
            secs = slowest,
            "bench iteration"
        );
        if timed {
            times.push(slowest);
        }
        if spec.check && timed {
            wrong += case.wrong(pg, &buf, &copy_dst, it, root)?;
        }
    }
    let per_call = wire_sent / (spec.warmup + spec.iters) as u64;
    case.row(pg, bytes, times, wrong, per_call)
}

impl Case<'_> {
    /// The row every rank agrees on: the median of the slowest rank's times, the wrong
    /// elements summed over ranks, the busiest rank's bytes per call.
    fn row(
        &self,
        pg: &mut ProcessGroup,
        bytes: usize,
        mut times: Vec<f64>,
        wrong: u64,
        per_call: u64,
    ) -> Result<BenchRow, Error> {
        let (op, spec, world) = (self.op, self.spec, self.world);
        let total_wrong = pg.all_reduce(vec![wrong as f32], ReduceOp::Sum).wait()?[0] as u64;
        let mine = pg.shard_range(world);
        let all = pg
            .all_gather(vec![per_call as f64 as f32; mine.len()], world)
            .wait()?;
        let wire_bytes = all.iter().cloned().fold(0.0f32, f32::max) as u64;
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let t = if times.is_empty() {
            0.0
        } else {
            times[times.len() / 2]
        };
        let algbw = if t > 0.0 { bytes as f64 / t / 1e9 } else { 0.0 };
        Ok(BenchRow {
            op: op.name(),
            bytes,
            nodes: pg.table().num_nodes(),
            ranks: world,
            time_us: t * 1e6,
            algbw_gbps: algbw,
            busbw_gbps: algbw * op.bus_factor(world),
            wrong: total_wrong,
            iters: spec.iters,
            wire: if matches!(
                op,
                BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::AllGather
            ) {
                spec.wire.name()
            } else {
                WireDtype::F32.name()
            },
            wire_bytes,
        })
    }
}

/// Sends the first half of `buf` to the next rank and receives the previous rank's into the
/// second half.
fn send_recv(pg: &mut ProcessGroup, mut buf: Vec<f32>) -> Result<Vec<f32>, Error> {
    let (rank, world, half) = (pg.rank(), pg.world(), buf.len() / 2);
    let recv = pg.recv(half, (rank + world - 1) % world, 0);
    pg.send(buf[..half].to_vec(), (rank + 1) % world, 0)
        .wait()?;
    buf[half..].copy_from_slice(&recv.wait()?);
    Ok(buf)
}

/// Runs the whole spec on this rank. Every rank of the job must call it with the same spec.
pub fn run_rank(
    pg: &mut ProcessGroup,
    spec: &BenchSpec,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, Error> {
    let mut rows = Vec::new();
    for &op in &spec.ops {
        if op == BenchOp::P2p && pg.table().num_nodes() < 2 {
            continue; // p2p measures the link between nodes; one node has none
        }
        if op == BenchOp::SendRecv && pg.world() < 2 {
            continue; // one rank has nobody to send to
        }
        for &bytes in &spec.sizes {
            let row = run_one(pg, op, bytes, spec)?;
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The table header, in nccl-tests' spirit.
pub fn table_header(nodes: usize, ranks_per_node: &str, world: usize, spec: &BenchSpec) -> String {
    format!(
        "# wiretrain bench: {nodes} node(s) x {ranks_per_node} rank(s) = world {world}; iters {} (median), warmup {}, reduce {:?}\n# transport: shared host buffers inside a node, QUIC (TLS 1.3) between nodes; wire dtype {} (all-reduce, reduce-scatter, all-gather)\n#\n# {:>14} {:>12} {:>12} {:>12} {:>12} {:>8}\n# {:>14} {:>12} {:>12} {:>12} {:>12} {:>8}",
        spec.iters,
        spec.warmup,
        spec.reduce,
        spec.wire,
        "op",
        "size(B)",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
        "",
        "",
        "",
        "",
        "",
        if spec.check { "" } else { "(n/a)" }
    )
}

/// One table line for `r` (`#wrong` reads "n/a" without `check`).
pub fn table_row(r: &BenchRow, check: bool) -> String {
    let wrong = if check {
        r.wrong.to_string()
    } else {
        "n/a".into()
    };
    format!(
        "  {:>14} {:>12} {:>12.1} {:>12.3} {:>12.3} {:>8}",
        r.op, r.bytes, r.time_us, r.algbw_gbps, r.busbw_gbps, wrong
    )
}

/// The table's last lines: the wrong values over all rows (OK or FAILED) and the average bus
/// bandwidth of the rows with a non-zero size.
pub fn table_footer(rows: &[BenchRow]) -> String {
    let n = rows.iter().filter(|r| r.bytes > 0).count().max(1);
    let avg: f64 = rows
        .iter()
        .filter(|r| r.bytes > 0)
        .map(|r| r.busbw_gbps)
        .sum::<f64>()
        / n as f64;
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    format!(
        "# Out of bounds values : {wrong} {}\n# Avg bus bandwidth    : {avg:.3} GB/s",
        if wrong == 0 { "OK" } else { "FAILED" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_match_nccl_tests() {
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::Broadcast.bus_factor(4), 1.0);
        assert_eq!(BenchOp::AllReduce.bus_factor(1), 0.0);
        assert_eq!(
            BenchOp::parse("reduce-scatter"),
            Some(BenchOp::ReduceScatter)
        );
        assert_eq!(BenchOp::parse("nope"), None);
    }

    #[test]
    fn sum_table_matches_direct_sum() {
        for world in [1, 2, 5, 8] {
            let t = SumTable::new(world);
            for it in 0..5 {
                for i in 0..50 {
                    let direct: f32 = (0..world).map(|r| value(r, it, i)).sum();
                    assert_eq!(t.at(it, i), direct);
                }
            }
        }
    }
}
