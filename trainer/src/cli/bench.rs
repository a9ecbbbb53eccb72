//! `wiretrain bench`: nccl-tests-style collective benchmark over the real transports.
//!
//! `wiretrain bench --op all-reduce --bytes 1M,16M,64M --local 2 --ranks-per-node 2`
//! starts 2 node processes on 127.0.0.x with 2 ranks each and prints one table (or JSON lines
//! with `--json`) from global rank 0.

use super::bench_compute::{self, ComputeArgs};
use super::node::NodeArgs;
use crate::cli::usage;
use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;
use std::time::Duration;
use wiretrain_comm::bench::{self, BenchOp, BenchRow, BenchSpec};
use wiretrain_comm::{Node, ReduceOp};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Collectives to measure: all-reduce, reduce-scatter, all-gather, broadcast, p2p, sendrecv
    /// (comma-separated, or "all"); "memcpy" adds a one-rank memcpy baseline row; "compute"
    /// (alone) measures the training compute rate of a built-in example instead.
    #[arg(long, default_value = "all-reduce")]
    pub op: String,
    /// Sizes in bytes, comma-separated, with optional K/M/G suffix (powers of 1024).
    #[arg(long, default_value = "1M,16M,64M")]
    pub bytes: String,
    /// Start this many node processes on 127.0.0.x and run the benchmark across them.
    #[arg(long)]
    pub local: Option<usize>,
    /// Timed iterations per size (the table shows the median).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations before timing.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Check every result against a serial reference and count wrong elements.
    #[arg(long)]
    pub check: bool,
    /// Reduction for all-reduce and reduce-scatter: sum or mean.
    #[arg(long, default_value = "sum")]
    pub reduce: String,
    /// Element type between nodes for all-reduce, reduce-scatter and all-gather: f32, f16,
    /// bf16 or int8 (block-quantized, one f32 scale per 128 values). Sums accumulate in f32.
    #[arg(long, default_value = "f32")]
    pub wire_dtype: wiretrain_comm::WireDtype,
    /// Transport: quic (wiretrain's: shared memory in a node, QUIC between nodes) or nccl
    /// (global rank r on CUDA device r mod the device count; needs a binary built with
    /// `--features nccl`).
    #[arg(long, default_value = "quic")]
    pub backend: String,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub node: NodeArgs,
}

/// Parses "1M,16M,64M" (K/M/G = 1024-based, like nccl-tests).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|t| {
            let t = t.trim();
            let (num, mul) = match t.chars().last() {
                Some('K' | 'k') => (&t[..t.len() - 1], 1usize << 10),
                Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
                Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
                _ => (t, 1),
            };
            let n: usize = num.parse().map_err(|e| {
                crate::cli::usage_error(format!(
                    "--bytes: {t:?} is not a size like 4096, 1M or 64M: {e}"
                ))
            })?;
            let b = n
                .checked_mul(mul)
                .filter(|&b| b <= 8 << 30)
                .ok_or_else(|| {
                    crate::cli::usage_error(format!("--bytes: {t} is above the 8 GiB limit"))
                })?;
            if !b.is_multiple_of(4) {
                usage!("--bytes: {t} is not a multiple of 4 bytes (elements are f32)");
            }
            Ok(b)
        })
        .collect()
}

pub fn parse_ops(s: &str) -> Result<Vec<BenchOp>> {
    if s == "all" {
        return Ok(BenchOp::ALL.to_vec());
    }
    s.split(',')
        .map(|o| {
            BenchOp::parse(o.trim()).ok_or_else(|| {
                crate::cli::usage_error(format!("--op: unknown collective {o:?} (all-reduce, reduce-scatter, all-gather, broadcast, p2p, sendrecv, memcpy, all)"))
            })
        })
        .collect()
}

impl BenchArgs {
    pub fn spec(&self) -> Result<BenchSpec> {
        let reduce = match self.reduce.as_str() {
            "sum" => ReduceOp::Sum,
            "mean" => ReduceOp::Mean,
            other => usage!("--reduce: {other:?} is not sum or mean"),
        };
        if self.iters == 0 {
            usage!("--iters must be at least 1");
        }
        Ok(BenchSpec {
            ops: parse_ops(&self.op)?,
            sizes: parse_sizes(&self.bytes)?,
            iters: self.iters,
            warmup: self.warmup,
            check: self.check,
            reduce,
            wire: self.wire_dtype,
        })
    }
}

/// Runs the benchmark on this node (every node of the job runs this).
pub fn run(args: &BenchArgs) -> Result<()> {
    let spec = args.checked_spec()?;
    if let Some(nodes) = args.local {
        if nodes == 0 || nodes > 64 {
            usage!("--local: {nodes} is outside 1..=64");
        }
        // Bad transport flags are refused here, once, before any node process starts.
        if let Err(e) = args.node.options()?.check_tuning() {
            usage!("{e}");
        }
        let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        let child = wiretrain::elastic::launcher::strip_flag(&argv, "--local");
        let target = wiretrain::elastic::launcher::Target {
            program: None,
            // launch adds the rendezvous flags, this node count among them.
            args: wiretrain::elastic::launcher::strip_flag(&child, "--ranks-per-node"),
            ranks_per_node: args.node.ranks_per_node,
        };
        let grace = Duration::from_secs_f64(args.node.collective_timeout.clamp(1.0, 300.0) + 5.0);
        return wiretrain::elastic::launcher::run_local(
            nodes,
            &target,
            grace,
            wiretrain::elastic::launcher::Elastic::none(nodes),
        )
        .context("local launch");
    }
    let cfg = args.node.config()?;
    let mut node = Node::join(cfg).context("joining the job")?;
    let table = node.table().clone();
    let groups = node.take_groups();
    let Some(spec) = spec else {
        return run_compute(args, node, groups, table.num_nodes());
    };
    let rpn: Vec<usize> = (0..table.num_nodes()).map(|n| table.ranks_on(n)).collect();
    let rpn = if rpn.iter().all(|&k| k == rpn[0]) {
        rpn[0].to_string()
    } else {
        format!("{rpn:?}")
    };
    let json = args.json;
    let handles: Vec<_> = groups
        .into_iter()
        .map(|mut pg| {
            let spec = spec.clone();
            let header = bench::table_header(table.num_nodes(), &rpn, table.world(), &spec);
            let nccl = args.backend == "nccl";
            std::thread::spawn(move || bench_one_rank(&mut pg, &spec, &header, json, nccl))
        })
        .collect();
    let wrong: u64 = super::join_ranks(handles)?
        .iter()
        .flat_map(|rows| rows.iter().map(|r| r.wrong))
        .sum();
    node.shutdown().context("shutting down")?;
    if wrong > 0 {
        anyhow::bail!("{wrong} wrong elements");
    }
    Ok(())
}

/// One rank's benchmark (rank 0 prints the table or the JSON rows): over QUIC and shared
/// memory, or NCCL.
fn bench_one_rank(
    pg: &mut wiretrain_comm::ProcessGroup,
    spec: &bench::BenchSpec,
    header: &str,
    json: bool,
    nccl: bool,
) -> Result<Vec<BenchRow>> {
    let check = spec.check;
    let leader = pg.rank() == 0;
    if leader && !json {
        println!("{header}");
    }
    let print = |row: &BenchRow| {
        if leader {
            let line = if json {
                serde_json::to_string(row).expect("rows serialize")
            } else {
                bench::table_row(row, check)
            };
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
    };
    if nccl {
        #[cfg(feature = "nccl")]
        {
            // Global rank modulo the devices: the local rank on a node of one rank
            // per GPU, and distinct GPUs for `--local` nodes sharing one machine.
            let count = wiretrain_comm::nccl::probe()
                .map_err(|e| crate::cli::usage_error(format!("--backend nccl: {e}")))?;
            if leader && pg.table().num_nodes() > 1 {
                eprintln!(
                    "wiretrain: warning: NCCL moves tensors between nodes over its own \
                     transports, unencrypted and unauthenticated (outside wiretrain's \
                     TLS): use --backend nccl only on a network you trust"
                );
            }
            let device = pg.rank() % count;
            let rows = wiretrain_comm::nccl::bench_rank(pg, device, spec, print)
                .map_err(|e| anyhow::anyhow!("NCCL on cuda:{device}: {e}"))?;
            if leader && !json {
                println!("{}", bench::table_footer(&rows));
            }
            return Ok(rows);
        }
    }
    let rows = bench::run_rank(pg, spec, print)?;
    if leader && !json {
        println!("{}", bench::table_footer(&rows));
    }
    Ok(rows)
}

impl BenchArgs {
    /// The benchmark's spec after the checks of its flags (`None`: `--op compute`).
    fn checked_spec(&self) -> Result<Option<bench::BenchSpec>> {
        let compute = self.op.split(',').any(|o| o.trim() == "compute");
        if compute {
            if self.op.trim() != "compute" {
                usage!("--op compute runs alone (measure the collectives in a separate run)");
            }
            if self.iters == 0 {
                usage!("--iters must be at least 1");
            }
            if self.backend != "quic" {
                usage!("--op compute needs no --backend (it runs no collective)");
            }
            bench_compute::check(&self.compute)?;
        }
        let spec = if compute { None } else { Some(self.spec()?) };
        match self.backend.as_str() {
            "quic" => {}
            "nccl" if cfg!(feature = "nccl") => {}
            "nccl" => usage!(
                "--backend nccl: this binary was built without NCCL (cargo build --features nccl)"
            ),
            other => usage!("--backend: {other:?} is not quic or nccl"),
        }
        Ok(spec)
    }
}

/// `--op compute` on this node: every local rank measures at once; rank 0 prints the row.
fn run_compute(
    args: &BenchArgs,
    node: Node,
    groups: Vec<wiretrain_comm::ProcessGroup>,
    nodes: usize,
) -> Result<()> {
    let handles: Vec<_> = groups
        .into_iter()
        .map(|mut pg| {
            let a = args.compute.clone();
            let (iters, warmup) = (args.iters, args.warmup);
            std::thread::spawn(move || bench_compute::run_rank(&mut pg, &a, iters, warmup, nodes))
        })
        .collect();
    let rows = super::join_ranks(handles)?;
    node.shutdown().context("shutting down")?;
    for row in rows.into_iter().flatten() {
        let line = if args.json {
            serde_json::to_string(&row).context("serializing the row")?
        } else {
            bench_compute::table(&row)
        };
        println!("{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_sizes("0,4,1K,1M").unwrap(), vec![0, 4, 1024, 1 << 20]);
        assert!(parse_sizes("7").is_err());
        assert!(parse_sizes("abc").is_err());
        assert!(parse_sizes("100G").is_err());
        assert_eq!(parse_ops("all").unwrap().len(), 6);
        assert!(parse_ops("all-reduce,nope").is_err());
    }
}
