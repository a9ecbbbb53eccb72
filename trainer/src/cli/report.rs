//! `wiretrain report DIR`: the summary of a traced run (`train --trace DIR`) and a PNG of the
//! step split per rank (`DIR/report-split.png`) and of busbw over time
//! (`DIR/report-busbw.png`); `--json` prints the analysis as one object.

use crate::cli::traces::{RankTrace, Report, analyse, load};
use anyhow::{Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// The directory `train --trace` wrote.
    pub dir: PathBuf,
    /// Print the analysis as one JSON object instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// No PNG.
    #[arg(long)]
    pub no_plot: bool,
    /// `wiretrain bench --json` output on the same machines: its busbw is shown beside the
    /// achieved figures.
    #[arg(long)]
    pub bench: Option<PathBuf>,
}

pub fn run(args: &ReportArgs) -> Result<()> {
    let traces = load(&args.dir)?;
    let mut r = analyse(&traces);
    if let Some(b) = &args.bench {
        crate::cli::traces::add_bench(&mut r, &read_bench(b)?);
    }
    if !args.no_plot {
        write_plots(args, &r, &traces)?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    print_splits(&r);
    print_bandwidth(&r);
    print_waits(&r);
    Ok(())
}

/// The rows of `wiretrain bench --json` output at `b`.
fn read_bench(b: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(b)
        .map_err(|e| crate::cli::usage_error(format!("--bench {}: {e}", b.display())))?;
    text.lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            crate::cli::usage_error(format!(
                "--bench {}: not `wiretrain bench --json` output: {e}",
                b.display()
            ))
        })
}

/// The step split per rank and, when any collective ran, bus bandwidth over time, as PNGs
/// in the trace directory.
fn write_plots(args: &ReportArgs, r: &Report, traces: &[RankTrace]) -> Result<()> {
    let png = args.dir.join("report-split.png");
    let bars: Vec<(usize, [f64; 5])> = r
        .splits
        .iter()
        .map(|s| {
            (
                s.rank,
                [s.compute_ms, s.comm_ms, s.optim_ms, s.data_ms, s.other_ms],
            )
        })
        .collect();
    wiretrain::plot::plot_split(&png, "step time per rank", &bars)
        .with_context(|| format!("writing {}", png.display()))?;
    let bw = args.dir.join("report-busbw.png");
    let series = crate::cli::traces::busbw_series(traces);
    if series.iter().any(|s| !s.1.is_empty()) {
        wiretrain::plot::plot_busbw(&bw, "bus bandwidth per collective (rank 0)", &series)
            .with_context(|| format!("writing {}", bw.display()))?;
    }
    if !args.json {
        println!("plots: {} {}", png.display(), bw.display());
    }
    Ok(())
}

/// Where each rank's step time went, and the slowest rank.
fn print_splits(r: &Report) {
    println!(
        "# {} ranks; node clocks aligned within ±{:.0} µs",
        r.world, r.clock_accuracy_us
    );
    println!(
        "{:>5} {:>5} {:>6} {:>10} {:>11} {:>11} {:>10} {:>9} {:>9} {:>13} {:>8}",
        "rank",
        "node",
        "steps",
        "step ms",
        "compute ms",
        "exposed ms",
        "optim ms",
        "data ms",
        "other ms",
        "comm busy ms",
        "hidden"
    );
    for s in &r.splits {
        println!(
            "{:>5} {:>5} {:>6} {:>10.2} {:>11.2} {:>11.2} {:>10.2} {:>9.2} {:>9.2} {:>13.2} {:>7.0}%",
            s.rank,
            s.node,
            s.steps,
            s.step_ms,
            s.compute_ms,
            s.comm_ms,
            s.optim_ms,
            s.data_ms,
            s.other_ms,
            s.comm_busy_ms,
            100.0 * s.hidden_share
        );
    }
    println!(
        "  (comm busy: time a collective was in flight on the rank's communication thread; \
         hidden: the share of it the rank computed through instead of waiting)"
    );
    println!(
        "slowest rank: {} (busy {:.2} ms per step more than the median rank, {:.2}x)",
        r.slowest_rank, r.slowest_extra_ms, r.slowest_ratio
    );
}

/// Each collective's medians and bandwidths.
fn print_bandwidth(r: &Report) {
    println!("collectives (medians; time from start to completion on the communication thread):");
    println!(
        "{:>16} {:>7} {:>12} {:>10} {:>11} {:>11} {:>11} {:>15} {:>11} {:>11}",
        "op",
        "calls",
        "bytes",
        "ms",
        "algbw GB/s",
        "busbw GB/s",
        "intra GB/s",
        "inter-node GB/s",
        "inter share",
        "bench busbw"
    );
    for b in &r.bandwidth {
        println!(
            "{:>16} {:>7} {:>12.0} {:>10.3} {:>11.3} {:>11.3} {:>11.3} {:>15} {:>10.0}% {:>11}",
            b.op,
            b.calls,
            b.bytes,
            b.median_ms,
            b.algbw_gbs,
            b.busbw_gbs,
            b.intra_busbw_gbs,
            b.inter_gbs.map_or("-".to_string(), |g| format!("{g:.3}")),
            100.0 * b.inter_share,
            b.bench_busbw_gbs
                .map_or("-".to_string(), |g| format!("{g:.3}"))
        );
    }
    println!(
        "  (inter-node GB/s: what a lane sent per second while on the link between nodes; \
         compare with `wiretrain bench --op p2p` on the same link)"
    );
}

/// The longest waits, and whom they waited for.
fn print_waits(r: &Report) {
    println!("longest waits:");
    for w in &r.waits {
        match w.waited_for {
            Some(o) if o != w.rank => println!(
                "  rank {} {} {:.2} ms: waited for rank {} (submitted {:.2} ms later)",
                w.rank, w.what, w.ms, o, w.late_by_ms
            ),
            _ => println!(
                "  rank {} {} {:.2} ms: every rank had submitted (transfer time)",
                w.rank, w.what, w.ms
            ),
        }
    }
}
