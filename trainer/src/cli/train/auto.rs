//! `train --strategy auto`: the binary's use of [`wiretrain::auto`] on the example it trains:
//! this rank's compute step on its own batch, the wiring, the plan; rank 0 prints the table and
//! the pick, and the metrics summary records them (`auto`).

use super::resolve::AutoRun;
use anyhow::{Context, Result};
use burn::tensor::{Device, Tensor};
use std::time::Instant;
use wiretrain::auto::{Drift, Pick, Workload, choose, measure, measure_compute};
use wiretrain::data::DistributedSampler;
use wiretrain::device::DeviceSpec;
use wiretrain::engine::{Trainer, TrainerConfig};
use wiretrain::units::Units;
use wiretrain_comm::ProcessGroup;

/// Timed steps of the compute measurement (after one warm-up): the median of three.
const COMPUTE_STEPS: usize = 3;

/// `--strategy auto` (or `--show-plan`) on one rank: the configuration to train with, the
/// pick in the metrics summary (`auto`), and rank 0's watch for drift.
pub(super) fn configure<M: Units>(
    model: &M,
    tc: TrainerConfig,
    pg: &mut ProcessGroup,
    sampler: &DistributedSampler,
    loss: &impl Fn(&M, &[usize]) -> Tensor<1>,
    (auto, device, sh): (&AutoRun, &Device, &super::Shared),
    fit: &mut wiretrain::fit::FitOptions,
) -> Result<(TrainerConfig, Option<Drift>)> {
    let cx = AutoCx {
        auto,
        device,
        spec: sh.run.device.get(pg.local_rank()).or(sh.run.device.first()),
        seq: match sh.run.example {
            wiretrain::models::Example::CharLm => super::CHAR_SEQ,
            wiretrain::models::Example::Mlp => 1,
        },
        global_batch: sh.run.global_batch,
        accumulate: sh.run.accumulate,
    };
    let (tc, pick, watch) = pick(model, &tc, pg, sampler, loss, &cx)?;
    if let Some(m) = fit.meta.as_object_mut() {
        m.insert("auto".into(), serde_json::to_value(&pick)?);
    }
    Ok((tc, (pg.rank() == 0).then_some(watch)))
}

/// What `--strategy auto` needs besides the model.
pub(super) struct AutoCx<'a> {
    pub auto: &'a AutoRun,
    pub device: &'a Device,
    pub spec: Option<&'a DeviceSpec>,
    pub seq: usize,
    pub global_batch: usize,
    pub accumulate: usize,
}

/// Measures, plans and picks; returns `tc` with the picked strategy (or the one given, with
/// `--show-plan`), the pick, and the watch for drift from its prediction.
pub(super) fn pick<M: Units>(
    model: &M,
    tc: &TrainerConfig,
    pg: &mut ProcessGroup,
    sampler: &DistributedSampler,
    loss: &impl Fn(&M, &[usize]) -> Tensor<1>,
    cx: &AutoCx<'_>,
) -> Result<(TrainerConfig, Pick, Drift)> {
    let t0 = Instant::now();
    let mut sampler = sampler.clone();
    let cs = measure_compute(
        model.clone(),
        cx.device,
        tc,
        COMPUTE_STEPS,
        |t: &mut Trainer<M>, i| {
            // The step training runs: its micro-batches, accumulated.
            let idx = sampler.indices(i);
            let per = idx.len() / cx.accumulate.max(1);
            t.step_accumulate(cx.accumulate.max(1), |m, k| {
                loss(m, &idx[k * per..(k + 1) * per])
            })
        },
    )
    .context("--strategy auto: measuring this rank's compute step")?;
    let w = Workload {
        params: wiretrain::flat::FlatLayout::of(model).total(),
        seq: cx.seq,
        global_batch: cx.global_batch,
        // Micro-batches accumulate before any reduction: unit-by-unit steps are out.
        units: if cx.accumulate == 1 {
            Some(Trainer::<M>::effective_units_of(model)?)
        } else {
            None
        },
        device_mem: host_memory_share(cx.spec, pg.table().nodes()[pg.node()].devices.len()),
        allow_diloco: cx.auto.allow_diloco,
    };
    let m = measure(pg, &w, cs.step_s).context("--strategy auto: measuring the wiring")?;
    let table = pg.table().clone();
    let mut pick = choose(
        &w,
        &m,
        tc,
        table.num_nodes(),
        table.nodes()[0].devices.len(),
    )?;
    // What the measurements took on this rank, the compute's and the wiring's; the warm-up
    // step (kernel compilation on a GPU, which training's first step pays otherwise) apart.
    pick.measured.seconds = t0.elapsed().as_secs_f64() - cs.warmup_s;
    pick.measured.warmup_s = cs.warmup_s;
    let cfg = if cx.auto.keep {
        tc.clone()
    } else {
        pick.config(tc)?
    };
    let row = if cx.auto.keep {
        given_name(tc)
    } else {
        pick.name.clone()
    };
    if pg.rank() == 0 {
        print_pick(&pick, cx.seq, cx.auto.keep.then(|| row.clone()));
    }
    let (nodes, ranks) = (table.num_nodes(), table.nodes()[0].devices.len());
    let drift = Drift::new(&pick, &row, &w, &cfg, nodes, ranks);
    Ok((cfg, pick, drift))
}

/// Memory per rank where the device is host memory (Burn's CPU backend, lavapipe): the
/// machine's available memory over this node's ranks; `None` where it is not known.
fn host_memory_share(spec: Option<&DeviceSpec>, ranks: usize) -> Option<f64> {
    if !matches!(spec, Some(DeviceSpec::Cpu | DeviceSpec::WgpuCpu)) {
        return None;
    }
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024.0 / ranks.max(1) as f64)
}

/// The table on stderr: one row per strategy, the measured wiring, the pick and why.
/// The row name of a configured strategy (`diloco`, `diloco-hybrid` for DiLoCo).
fn given_name(tc: &TrainerConfig) -> String {
    match (tc.diloco(), tc.strategy()) {
        (None, s) => s.to_string(),
        (Some(_), wiretrain::strategy::Strategy::Ddp) => "diloco".into(),
        (Some(_), s) => format!("diloco-{s}"),
    }
}

/// `given`: the strategy the user named (`--show-plan`), which the run keeps.
fn print_pick(p: &Pick, seq: usize, given: Option<String>) {
    let m = &p.measured;
    let seconds = m.seconds;
    let inter = match (m.inter_gbps, m.inter_latency_us) {
        (Some(g), Some(l)) => format!("{g:.3} Gbit/s, {l:.0} µs per message"),
        _ => "none (one node)".into(),
    };
    eprintln!(
        "wiretrain: --strategy auto measured in {seconds:.1} s (after a {:.1} s warm-up step): \
         step {:.1} ms on the slowest rank ({:.4} TFLOP/s), between nodes {inter}, in the node {:.1} Gbit/s copies and {:.0} \
         µs per collective, memory {}",
        m.warmup_s,
        m.step_s * 1e3,
        m.tflops,
        m.intra_gbps,
        m.intra_latency_us,
        m.device_mem
            .map_or("unknown (every strategy taken to fit)".into(), |b| format!(
                "{:.1} GB per rank",
                b / 1e9
            )),
    );
    eprintln!(
        "wiretrain: {:>13} {:>6} {:>9} {:>10} {:>10} {:>12}",
        "strategy", "fits", "GB/rank", "inter MB", "step ms", "samples/s"
    );
    for r in &p.plans {
        eprintln!(
            "wiretrain: {:>13} {:>6} {:>9.3} {:>10.2} {:>10.1} {:>12.1}{}",
            r.name,
            if r.fits { "yes" } else { "no" },
            r.bytes_per_device / 1e9,
            r.comm_bytes_inter / 1e6,
            r.step_s * 1e3,
            r.tokens_per_s / seq as f64,
            match (r.recommended, given.as_deref() == Some(r.name.as_str())) {
                (true, true) => "  <- given, and auto's pick",
                (false, true) => "  <- given",
                (true, false) if given.is_some() => "  <- auto's pick",
                (true, false) => "  <- picked",
                (false, false) => "",
            }
        );
    }
    match given {
        None => eprintln!("wiretrain: --strategy auto picked {}", p.reason),
        Some(g) => eprintln!(
            "wiretrain: training with the strategy given, {g}; --strategy auto would pick {}",
            p.reason
        ),
    }
}

/// Logs a re-plan after drift (rank 0): what the steps measured against the prediction, and
/// what the planner would now pick (or why it picks nothing); the run keeps its strategy.
pub(super) fn log_replan(
    r: &Result<wiretrain::auto::Replan, wiretrain::auto::AutoError>,
    after_step: usize,
) {
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "wiretrain: after step {after_step}: steps stayed more than 30% off the \
                 prediction for {} steps; re-planning on what they measured failed: {e} (the \
                 run keeps its strategy)",
                wiretrain::auto::DRIFT_STEPS
            );
            return;
        }
    };
    let m = &r.pick.measured;
    eprintln!(
        "wiretrain: after step {after_step}: steps take {:.1} ms, {:.0}% off the {:.1} ms \
         predicted, for {} steps; re-planned on what they measured ({:.4} TFLOP/s{}): the \
         planner would now pick {} (the run keeps its strategy)",
        r.measured_step_s * 1e3,
        100.0 * (r.measured_step_s / r.predicted_step_s - 1.0).abs(),
        r.predicted_step_s * 1e3,
        wiretrain::auto::DRIFT_STEPS,
        m.tflops,
        m.inter_gbps
            .map_or(String::new(), |g| format!(", {g:.3} Gbit/s between nodes")),
        r.pick.reason
    );
}
