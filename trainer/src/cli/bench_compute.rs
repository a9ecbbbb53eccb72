//! `wiretrain bench --op compute`: this machine's training compute rate, the figure
//! `wiretrain plan --tflops` takes.
//!
//! Every rank of the job runs the trainer's own step (forward, backward, flatten, AdamW,
//! unflatten) on a built-in example in a one-rank job of its own, so no communication enters
//! the timing; all ranks run at once, so `--local N` processes share the cores as N training
//! processes do. The row reports the slowest rank's medians and the rate by the planner's
//! model: 6·Ψ FLOPs per token (6·Ψ·tokens / forward-backward time).

use crate::cli::traces::median;
use crate::cli::usage;
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use std::sync::Arc;
use wiretrain::device::{DeviceSpec, select};
use wiretrain::engine::{StepReport, TrainError, Trainer, TrainerConfig};
use wiretrain::models::Example;
use wiretrain::models::char_lm::Corpus;
use wiretrain::models::mlp::{Dataset, Mlp};
use wiretrain::strategy::Strategy;
use wiretrain_comm::tls::Token;
use wiretrain_comm::{Node, NodeConfig, ProcessGroup, ReduceOp};

/// The model `--op compute` measures (ignored by the collectives).
#[derive(Debug, Clone, Args)]
pub struct ComputeArgs {
    /// --op compute: built-in example, mlp or char-lm.
    #[arg(long, default_value = "char-lm")]
    pub example: String,
    /// --op compute: char-lm width (a multiple of 4).
    #[arg(long, default_value_t = 64)]
    pub d_model: usize,
    /// --op compute: char-lm transformer blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// --op compute: samples per rank per step (the micro-batch).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// --op compute: device per rank: auto, wgpu, wgpu:cpu (lavapipe), cpu.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

// Same data as `wiretrain train` (mlp: synthetic samples; char-lm: 64-character windows).
use super::train::{CHAR_SEQ, DATASET, char_lm};

/// One `--op compute` result (one JSON line with `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct ComputeRow {
    pub op: &'static str,
    pub example: String,
    pub device: String,
    pub params: usize,
    /// Samples per rank per step, and tokens per sample (1 for mlp).
    pub batch: usize,
    pub seq: usize,
    pub nodes: usize,
    pub ranks: usize,
    /// Medians over the timed steps of the slowest rank.
    pub time_us: f64,
    pub compute_ms: f64,
    pub optim_ms: f64,
    /// 6·Ψ·tokens / forward-backward time, and the same over the whole step.
    pub tflops: f64,
    pub step_tflops: f64,
}

impl ComputeArgs {
    fn validate(&self) -> Result<Example> {
        let ex: Example = self
            .example
            .parse()
            .map_err(|e| crate::cli::usage_error(format!("--example: {e}")))?;
        if self.batch == 0 || self.batch > 4096 {
            usage!("--batch: {} is outside 1..=4096", self.batch);
        }
        if self.d_model == 0 || !self.d_model.is_multiple_of(4) || self.d_model > 8192 {
            usage!(
                "--d-model: {} must be a positive multiple of 4, at most 8192",
                self.d_model
            );
        }
        if self.layers == 0 || self.layers > 64 {
            usage!("--layers: {} is outside 1..=64", self.layers);
        }
        self.device
            .parse::<DeviceSpec>()
            .map_err(|e| crate::cli::usage_error(format!("--device: {e}")))?;
        Ok(ex)
    }
}

/// Checks the flags before any process starts.
pub fn check(args: &ComputeArgs) -> Result<()> {
    args.validate().map(|_| ())
}

/// Runs the measurement on one rank of the job; rank 0 returns the row.
pub fn run_rank(
    job: &mut ProcessGroup,
    args: &ComputeArgs,
    iters: usize,
    warmup: usize,
    nodes: usize,
) -> Result<Option<ComputeRow>> {
    let example = args.validate()?;
    let spec: DeviceSpec = args.device.parse().map_err(anyhow::Error::msg)?;
    let rd = select(spec).map_err(|e| crate::cli::usage_error(format!("--device: {e}")))?;
    let device = rd.device.clone().autodiff();
    let m = measure(job, args, example, &device, iters, warmup)?;
    let Some(t) = slowest_medians(job, &m.reports)? else {
        return Ok(None);
    };
    let b = args.batch;
    let flops = 6.0 * m.params as f64 * (b * m.seq) as f64;
    Ok(Some(ComputeRow {
        op: "compute",
        example: example.to_string(),
        device: rd.description,
        params: m.params,
        batch: b,
        seq: m.seq,
        nodes,
        ranks: job.world(),
        time_us: t.step_ms * 1e3,
        compute_ms: t.compute_ms,
        optim_ms: t.optim_ms,
        tflops: flops / (t.compute_ms * 1e-3) / 1e12,
        step_tflops: flops / (t.step_ms * 1e-3) / 1e12,
    }))
}

/// What one rank measured: the model's parameter count, tokens per sample and the timed
/// steps' reports.
struct Measured {
    params: usize,
    seq: usize,
    reports: Vec<StepReport>,
}

/// Trains `example` on `device` in a one-rank job of this rank's own and times its steps.
fn measure(
    job: &mut ProcessGroup,
    args: &ComputeArgs,
    example: Example,
    device: &burn::tensor::Device,
    iters: usize,
    warmup: usize,
) -> Result<Measured> {
    // A one-rank job of this rank's own: the trainer's all-reduces stay in this thread.
    let token = Token::generate();
    let mut solo = Node::join(NodeConfig::single_node(1, token)).context("a one-rank job")?;
    let pg = solo
        .take_groups()
        .pop()
        .context("a one-rank job has one group")?;
    let tc = TrainerConfig::builder(Strategy::Ddp)
        .lr(example.default_lr())
        .build()?;
    let seed = 1;
    let b = args.batch;
    let (params, seq, reports) = match example {
        Example::Mlp => {
            let data = Arc::new(Dataset::synthetic(DATASET, seed));
            let t = Trainer::new(Mlp::new(device, seed), device, tc, pg)?;
            let n = t.layout().total();
            let r = timed(job, t, iters, warmup, |t, i| {
                let idx = window(i, b, data.len());
                t.step(|m| m.loss(&data, &idx, device))
            })?;
            (n, 1, r)
        }
        Example::CharLm => {
            let corpus = Arc::new(Corpus::shipped(CHAR_SEQ));
            let model = char_lm(&corpus, args.d_model, args.layers, device, seed);
            let t = Trainer::new(model, device, tc, pg)?;
            let n = t.layout().total();
            let r = timed(job, t, iters, warmup, |t, i| {
                let idx = window(i, b, corpus.len());
                t.step(|m| m.loss(&corpus, &idx, device))
            })?;
            (n, corpus.seq(), r)
        }
    };
    solo.shutdown().context("closing the one-rank job")?;
    Ok(Measured {
        params,
        seq,
        reports,
    })
}

/// Median milliseconds per step: the whole step, forward-backward, and the optimizer.
struct Medians {
    step_ms: f64,
    compute_ms: f64,
    optim_ms: f64,
}

/// Every rank's medians to every rank; rank 0 gets the slowest rank's (by whole step), the
/// others `None`.
fn slowest_medians(job: &mut ProcessGroup, reports: &[StepReport]) -> Result<Option<Medians>> {
    let world = job.world();
    let mut mine = vec![0.0f32; 3 * world];
    let med = |f: fn(&StepReport) -> f64| median(reports.iter().map(f).collect());
    let r = job.rank();
    mine[3 * r] = med(|s| s.step_ms) as f32;
    mine[3 * r + 1] = med(|s| s.compute_ms) as f32;
    mine[3 * r + 2] = med(|s| s.optim_ms) as f32;
    let all = job
        .all_reduce(mine, ReduceOp::Sum)
        .wait()
        .context("gathering the ranks' timings")?;
    if r != 0 {
        return Ok(None);
    }
    let slowest = (0..world)
        .max_by(|&a, &b| all[3 * a].total_cmp(&all[3 * b]))
        .unwrap_or(0);
    Ok(Some(Medians {
        step_ms: f64::from(all[3 * slowest]),
        compute_ms: f64::from(all[3 * slowest + 1]),
        optim_ms: f64::from(all[3 * slowest + 2]),
    }))
}

/// Warm-up steps, a barrier so every rank times the same interval, then the timed steps.
fn timed<M: burn::module::Module>(
    job: &mut ProcessGroup,
    mut t: Trainer<M>,
    iters: usize,
    warmup: usize,
    mut step: impl FnMut(&mut Trainer<M>, usize) -> Result<StepReport, TrainError>,
) -> Result<Vec<StepReport>> {
    for i in 0..warmup {
        step(&mut t, i)?;
    }
    job.barrier().context("barrier before timing")?;
    (0..iters).map(|i| Ok(step(&mut t, warmup + i)?)).collect()
}

/// Samples `i·b .. (i+1)·b`, wrapping around the dataset.
fn window(i: usize, b: usize, len: usize) -> Vec<usize> {
    (0..b).map(|k| (i * b + k) % len.max(1)).collect()
}

/// The table form of a row.
pub fn table(row: &ComputeRow) -> String {
    format!(
        "# compute: {} ({} parameters) on {}, {} samples x {} tokens per rank, {} ranks on {} nodes at once\n\
         # {:>10} {:>12} {:>10} {:>12} {:>12}\n  {:>10.1} {:>12.1} {:>10.1} {:>12.4} {:>12.4}",
        row.example,
        row.params,
        row.device,
        row.batch,
        row.seq,
        row.ranks,
        row.nodes,
        "step ms",
        "fwd+bwd ms",
        "optim ms",
        "TFLOP/s",
        "step TFLOP/s",
        row.time_us / 1e3,
        row.compute_ms,
        row.optim_ms,
        row.tflops,
        row.step_tflops,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_wrap_around_the_dataset() {
        assert_eq!(window(0, 3, 10), vec![0, 1, 2]);
        assert_eq!(window(3, 3, 10), vec![9, 0, 1]);
    }
}
