//! `--strategy auto`: the wiring picks the strategy. Before step 0 every rank measures what
//! the planner ([`crate::plan`]) needs, on this job's own hardware and model:
//! - the compute rate: a few steps of the user's own model with the trainer's own step, in a
//!   one-rank job of its own on each rank at once (so no communication is timed, while the
//!   ranks share the machine as training does), as `wiretrain bench --op compute` does; the
//!   slowest rank's median counts ([`measure_compute`]);
//! - the link between nodes: rate and per-message latency of p2p exchanges between nodes, as
//!   `wiretrain bench --op p2p` does, with the message size fitted to the rate;
//! - the in-node copy rate (shared host buffers) and a node collective's latency;
//! - each device's memory, where the caller knows it.
//!
//! Rank 0 gathers the figures and broadcasts them; every rank plans every strategy for this
//! model, world and wiring and gets the same [`Pick`]: the fastest that fits (DiLoCo only when
//! allowed: it changes the optimization; ZeRO-3 and HSDP only for a model cut into units).

use crate::engine::{Overlap, StepReport, TrainError, Trainer, TrainerConfig};
use crate::plan::{DilocoPlan, Link, PlanInput, Precision, StrategyPlan};
use crate::strategy::Strategy;
use burn::module::Module;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};
use wiretrain_comm::bench::{BenchOp, BenchSpec, run_rank};
use wiretrain_comm::tls::Token;
use wiretrain_comm::{CallOpts, Group, Node, NodeConfig, ProcessGroup, ReduceOp, WireDtype};

/// What went wrong while choosing.
#[derive(Debug, thiserror::Error)]
pub enum AutoError {
    /// The compute measurement's steps failed.
    #[error("measuring the compute rate: {0}")]
    Compute(#[from] TrainError),
    /// A collective of the measurement failed.
    #[error("measuring the wiring: {0}")]
    Comm(#[from] wiretrain_comm::Error),
    /// Rank 0's broadcast record did not parse (the JSON error).
    #[error("rank 0's measurements did not decode: {0}")]
    Record(String),
    /// The measured figures are not plannable, or no strategy fits; says why.
    #[error("--strategy auto: {0}")]
    NothingFits(String),
}

/// The job's model and batch, as the planner needs them.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Ψ, the model's parameter count.
    pub params: usize,
    /// Tokens per sample (1 for a model that is not a sequence model).
    pub seq: usize,
    /// Samples per optimizer step over all ranks.
    pub global_batch: usize,
    /// The model's effective unit count ([`crate::engine::effective_units`]), when it is cut
    /// into units (then ZeRO-3 and HSDP can run it, and the others overlap).
    pub units: Option<f64>,
    /// Bytes of memory per device, where known (`None`: every strategy is taken to fit).
    pub device_mem: Option<f64>,
    /// DiLoCo may be picked, with this many inner steps (it changes the optimization).
    pub allow_diloco: Option<u64>,
}

/// What was measured (rank 0's record, the same on every rank).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Measured {
    /// The slowest rank's median step of its own model in a one-rank job, seconds.
    pub step_s: f64,
    /// That step by the planner's model: 6·Ψ·tokens per rank / step.
    pub tflops: f64,
    /// Between nodes (absent on one node): the node's Gbit/s per direction (all its lanes).
    pub inter_gbps: Option<f64>,
    /// Between nodes (absent on one node): µs per message.
    pub inter_latency_us: Option<f64>,
    /// Inside the node: the copy rate of shared host buffers, Gbit/s.
    pub intra_gbps: f64,
    /// Inside the node: a node collective's latency, µs.
    pub intra_latency_us: f64,
    /// Bytes of memory per device, as the workload gave it (`None`: unknown).
    pub device_mem: Option<f64>,
    /// Seconds the measurements took (rank 0's wiring; the binary adds the compute
    /// measurement, on the rank that reports), not counting the warm-up step.
    pub seconds: f64,
    /// The warm-up step before the compute measurement (the binary sets it): on a GPU it
    /// compiles the kernels, which the first training step pays otherwise.
    #[serde(default)]
    pub warmup_s: f64,
}

/// The strategy `--strategy auto` trains with, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Pick {
    /// The strategy picked (under DiLoCo, its inner strategy).
    pub strategy: Strategy,
    /// DiLoCo's inner steps, when the pick is a DiLoCo row.
    pub diloco_inner_steps: Option<u64>,
    /// The pick's row name (`zero2`, `diloco`, ...).
    pub name: String,
    /// One sentence: why this row.
    pub reason: String,
    /// Every row the planner made, the pick's `recommended`.
    pub plans: Vec<StrategyPlan>,
    /// The figures the plans were made from.
    pub measured: Measured,
}

impl Pick {
    /// `base` with the picked strategy (and DiLoCo with its inner steps, on a DiLoCo row).
    pub fn config(
        &self,
        base: &TrainerConfig,
    ) -> Result<TrainerConfig, crate::engine::ConfigError> {
        let diloco = self.diloco_inner_steps.map(|h| crate::engine::Diloco {
            inner_steps: h as usize,
            ..Default::default()
        });
        base.to_builder()
            .strategy(self.strategy)
            .diloco(diloco)
            .build()
    }
}

/// The compute measurement of one rank: the median whole step of `steps` steps, and the
/// warm-up step before them (on a GPU it compiles the kernels, which the first training step
/// would otherwise do), in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ComputeStep {
    /// The median whole step, seconds.
    pub step_s: f64,
    /// The warm-up step, seconds.
    pub warmup_s: f64,
}

/// `steps` steps (after one warm-up) of `model` in a one-rank job of its own, stepped by
/// `step` (the caller's loss on its own batch), under DDP with `cfg`'s optimizer settings.
pub fn measure_compute<M: Module>(
    model: M,
    device: &Device,
    cfg: &TrainerConfig,
    steps: usize,
    mut step: impl FnMut(&mut Trainer<M>, usize) -> Result<StepReport, TrainError>,
) -> Result<ComputeStep, AutoError> {
    let mut node = Node::join(NodeConfig::single_node(1, Token::generate()))?;
    let pg = node
        .take_groups()
        .pop()
        .expect("a one-rank node has one group");
    let cfg = cfg
        .to_builder()
        .strategy(Strategy::Ddp)
        .diloco(None)
        .overlap(Overlap::Off)
        .build()
        .map_err(TrainError::from)?;
    let mut t = Trainer::new(model, device, cfg, pg)?;
    let warm = Instant::now();
    step(&mut t, 0)?;
    let warmup_s = warm.elapsed().as_secs_f64();
    let mut ms = Vec::with_capacity(steps);
    for i in 1..=steps {
        ms.push(step(&mut t, i)?.step_ms);
    }
    drop(t);
    node.shutdown()?;
    ms.sort_by(f64::total_cmp);
    Ok(ComputeStep {
        step_s: ms.get(ms.len() / 2).copied().unwrap_or(0.0) / 1e3,
        warmup_s,
    })
}

/// Measures the wiring on every rank (a collective: every rank calls it) with this rank's
/// compute step `my_step_s` (from [`measure_compute`]); returns rank 0's figures.
pub fn measure(pg: &mut ProcessGroup, w: &Workload, my_step_s: f64) -> Result<Measured, AutoError> {
    let t0 = Instant::now();
    let steps = pg.all_gather_bytes(&my_step_s.to_le_bytes())?;
    let step_s = steps
        .iter()
        .filter_map(|b| b.as_slice().try_into().ok().map(f64::from_le_bytes))
        .fold(my_step_s, f64::max);
    let tokens_per_rank = (w.global_batch * w.seq) as f64 / pg.world() as f64;
    let tflops = 6.0 * w.params as f64 * tokens_per_rank / step_s.max(1e-9) / 1e12;
    let inter = if pg.table().num_nodes() > 1 {
        Some(inter_link(pg)?)
    } else {
        None
    };
    let intra_latency_us = node_latency_us(pg)?;
    let mine = Measured {
        step_s,
        tflops,
        inter_gbps: inter.map(|l| l.0),
        inter_latency_us: inter.map(|l| l.1),
        intra_gbps: copy_gbps(),
        intra_latency_us,
        device_mem: w.device_mem,
        seconds: t0.elapsed().as_secs_f64(),
        warmup_s: 0.0,
    };
    let json = serde_json::to_vec(&mine).expect("plain numbers serialize");
    let root = pg.broadcast_bytes(&json, 0)?;
    serde_json::from_slice(&root).map_err(|e| AutoError::Record(e.to_string()))
}

/// The link between nodes from p2p exchanges: per-message latency from 4 KiB messages, the
/// rate from messages sized to take ~0.2 s at a first estimate (256 KiB to 16 MiB). Every
/// lane of the node (one per local rank) exchanges at once, so the node's rate, what the
/// planner takes, is a lane's times the lanes.
fn inter_link(pg: &mut ProcessGroup) -> Result<(f64, f64), AutoError> {
    let lanes = pg
        .table()
        .nodes()
        .iter()
        .map(|n| n.devices.len())
        .min()
        .unwrap_or(1)
        .max(1) as f64;
    let p2p = |pg: &mut ProcessGroup, bytes: usize, iters: usize| {
        let spec = BenchSpec {
            ops: vec![BenchOp::P2p],
            sizes: vec![bytes],
            iters,
            warmup: 1,
            check: false,
            reduce: ReduceOp::Sum,
            wire: WireDtype::F32,
        };
        run_rank(pg, &spec, |_| {}).map(|rows| rows[0].clone())
    };
    let small = p2p(pg, 4096, 5)?;
    let probe = p2p(pg, 256 << 10, 2)?;
    let bytes_per_s = probe.busbw_gbps * 1e9;
    let size = ((bytes_per_s * 0.2) as usize).clamp(256 << 10, 16 << 20) & !3;
    let big = p2p(pg, size, 3)?;
    Ok((big.busbw_gbps * 8.0 * lanes, small.time_us))
}

/// The median time of a one-element all-reduce inside the node, in µs.
fn node_latency_us(pg: &mut ProcessGroup) -> Result<f64, AutoError> {
    let mut us = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        pg.call(CallOpts::default().on(Group::Node))
            .all_reduce(vec![0.0f32], ReduceOp::Sum)
            .wait()?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    Ok(us[us.len() / 2])
}

/// This machine's copy rate between host buffers (what shared-buffer collectives move), Gbit/s:
/// the best of five 16 MiB copies.
fn copy_gbps() -> f64 {
    let src = vec![1.0f32; 4 << 20];
    let mut dst = vec![0.0f32; 4 << 20];
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed());
    }
    (16u64 << 20) as f64 * 8.0 / best.as_secs_f64().max(1e-9) / 1e9
}

/// Plans every strategy for `w` on `m`'s wiring and picks the fastest that fits: `cfg`'s wire
/// dtype, prefetch and overlap as the trainer runs them.
pub fn choose(
    w: &Workload,
    m: &Measured,
    cfg: &TrainerConfig,
    nodes: usize,
    ranks_per_node: usize,
) -> Result<Pick, AutoError> {
    let link = |gbps: f64, us: f64| Link {
        bytes_per_s: gbps * 1e9 / 8.0,
        latency_s: us * 1e-6,
    };
    let devices = (nodes * ranks_per_node) as u64;
    let input = PlanInput {
        params: w.params as f64,
        shape: None,
        seq: w.seq as u64,
        micro_batch: (w.global_batch as u64 / devices).max(1),
        global_batch: w.global_batch as u64,
        nodes: nodes as u64,
        gpus_per_node: ranks_per_node as u64,
        device_mem: m.device_mem.unwrap_or(f64::MAX),
        precision: Precision::F32,
        wire: cfg.wire(),
        wire_rows: Vec::new(),
        tflops: m.tflops,
        intra: link(m.intra_gbps, m.intra_latency_us),
        inter: link(
            m.inter_gbps.unwrap_or(m.intra_gbps),
            m.inter_latency_us.unwrap_or(m.intra_latency_us),
        ),
        recompute: false,
        overlap: w.units.is_some()
            && match cfg.overlap() {
                Overlap::Auto => nodes > 1,
                o => o == Overlap::On,
            },
        prefetch: cfg.prefetch() > 0,
        rank_order: Default::default(),
        units: w.units,
        diloco: w.allow_diloco.map(|inner_steps| DilocoPlan {
            inner_steps,
            allowed: true,
        }),
    };
    input.validate().map_err(|e| {
        AutoError::NothingFits(format!("the measured wiring is not plannable: {e}"))
    })?;
    let plans = input.plan();
    let Some(best) = plans.iter().find(|p| p.recommended) else {
        return Err(AutoError::NothingFits(crate::plan::reason(
            &plans,
            input.device_mem,
        )));
    };
    let mut reason = crate::plan::reason(&plans, input.device_mem);
    if nodes == 1 {
        reason = reason.replace(
            "waiting for the network",
            "waiting for communication in the node",
        );
        reason.push_str("; one node: no strategy uses the network");
    }
    Ok(Pick {
        strategy: best.strategy,
        diloco_inner_steps: best.diloco_inner_steps,
        name: best.name.clone(),
        reason,
        plans: plans.clone(),
        measured: m.clone(),
    })
}

/// Steps in a row that must drift before a re-plan is reported.
pub const DRIFT_STEPS: usize = 20;
/// How far (as a share of the prediction) a step must be from it to count as drifting.
pub const DRIFT_SHARE: f64 = 0.3;

/// Watches a run trained with a [`Pick`]: when the measured step stays more than 30 % from the
/// pick's prediction for 20 steps in a row, it re-plans with what the steps measured (their
/// compute and communication) and reports what the planner would now pick. It never switches:
/// the run goes on with its strategy, the caller logs the [`Replan`].
pub struct Drift {
    pick: Pick,
    /// The row of the strategy the run trains with.
    row: String,
    workload: Workload,
    cfg: TrainerConfig,
    nodes: usize,
    ranks_per_node: usize,
    seen: usize,
    /// The drifting steps in a row: (step, compute, communication busy), seconds.
    run: Vec<(f64, f64, f64)>,
}

/// A re-plan after drift: what was measured against what was predicted, and the new plan.
#[derive(Debug, Clone, Serialize)]
pub struct Replan {
    /// The median of the drifting steps, seconds.
    pub measured_step_s: f64,
    /// The plan's prediction of a step for the run's row, seconds.
    pub predicted_step_s: f64,
    /// The plan from the steps' measurements; its `name` is what the planner would now pick.
    pub pick: Pick,
}

impl Drift {
    /// Watches a run of `row` (the pick's name, or a strategy the user named) against `pick`.
    pub fn new(
        pick: &Pick,
        row: &str,
        workload: &Workload,
        cfg: &TrainerConfig,
        nodes: usize,
        ranks_per_node: usize,
    ) -> Self {
        Self {
            pick: pick.clone(),
            row: row.to_string(),
            workload: workload.clone(),
            cfg: cfg.clone(),
            nodes,
            ranks_per_node,
            seen: 0,
            run: Vec::new(),
        }
    }

    /// Feeds one step's report (the first, a warm-up, is skipped); returns a re-plan (or why
    /// none could be made) after [`DRIFT_STEPS`] drifting steps in a row, then counts afresh.
    /// `None` also when the run's row is not in the plan.
    pub fn observe(&mut self, r: &StepReport) -> Option<Result<Replan, AutoError>> {
        self.seen += 1;
        if self.seen == 1 {
            return None;
        }
        let row = self.pick.plans.iter().find(|p| p.name == self.row)?;
        let step = r.step_ms / 1e3;
        if (step - row.step_s).abs() <= DRIFT_SHARE * row.step_s {
            self.run.clear();
            return None;
        }
        self.run
            .push((step, r.compute_ms / 1e3, r.comm_busy_ms / 1e3));
        if self.run.len() < DRIFT_STEPS {
            return None;
        }
        let med = |k: fn(&(f64, f64, f64)) -> f64| {
            let mut v: Vec<f64> = self.run.iter().map(k).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (step_s, compute_s, busy_s) = (med(|x| x.0), med(|x| x.1), med(|x| x.2));
        self.run.clear();
        // The steps' own rates: compute scales the compute rate, the communication's busy
        // time the link (both against what the plan assumed for this row).
        let mut m = self.pick.measured.clone();
        if compute_s > 0.0 {
            m.tflops *= row.compute_s / compute_s;
        }
        if let (Some(g), true) = (m.inter_gbps, busy_s > 0.0 && row.comm_s > 0.0) {
            m.inter_gbps = Some(g * row.comm_s / busy_s);
        }
        let predicted_step_s = row.step_s;
        let replan = choose(
            &self.workload,
            &m,
            &self.cfg,
            self.nodes,
            self.ranks_per_node,
        );
        Some(replan.map(|pick| Replan {
            measured_step_s: step_s,
            predicted_step_s,
            pick,
        }))
    }
}
