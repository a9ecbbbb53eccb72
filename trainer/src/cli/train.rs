//! `wiretrain train`: one node of a training run (every local rank is a thread), and
//! `wiretrain launch --local N -- train ...`: N such nodes on 127.0.0.x.

use super::node::NodeArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Deserialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use wiretrain::data::DistributedSampler;
use wiretrain::device::{DeviceSpec, select};
use wiretrain::models::mlp::{Dataset, Mlp};
use wiretrain::strategy::Strategy;
use wiretrain::trainer::{Trainer, TrainerConfig};
use wiretrain_comm::Node;

#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Built-in example to train: mlp.
    #[arg(long)]
    pub example: Option<String>,
    /// Parallel strategy: ddp, zero1, zero2.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Optimizer steps.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Samples per step over all ranks (must divide by the world size).
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Seed for parameters and data order.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Device per rank: auto, wgpu, wgpu:cpu (lavapipe), cpu.
    #[arg(long)]
    pub device: Option<String>,
    /// Gradient bucket size in bytes.
    #[arg(long)]
    pub bucket_bytes: Option<usize>,
    /// Write one JSON line per step (and a summary line) here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write the final flat parameters (little-endian f32) here.
    #[arg(long)]
    pub save_params: Option<PathBuf>,
    /// TOML file with any of the fields above (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
}

/// `run.toml`: the same names as the flags, with underscores.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    example: Option<String>,
    strategy: Option<String>,
    steps: Option<usize>,
    global_batch: Option<usize>,
    lr: Option<f64>,
    seed: Option<u64>,
    device: Option<String>,
    bucket_bytes: Option<usize>,
}

/// The resolved run settings.
#[derive(Debug, Clone)]
struct Run {
    strategy: Strategy,
    steps: usize,
    global_batch: usize,
    lr: f64,
    seed: u64,
    device: DeviceSpec,
    bucket_bytes: usize,
}

impl TrainArgs {
    fn resolve(&self) -> Result<Run> {
        let file: FileConfig = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("--config {}", p.display()))?;
                toml::from_str(&text)
                    .map_err(|e| anyhow::anyhow!("--config {}: {}", p.display(), e.message()))?
            }
            None => FileConfig::default(),
        };
        let example = self
            .example
            .clone()
            .or(file.example)
            .unwrap_or_else(|| "mlp".into());
        if example != "mlp" {
            bail!("--example: {example:?} is not a built-in example (mlp)");
        }
        let strategy = self
            .strategy
            .clone()
            .or(file.strategy)
            .unwrap_or_else(|| "ddp".into());
        let strategy: Strategy = strategy
            .parse()
            .map_err(|e| anyhow::anyhow!("--strategy: {e}"))?;
        let device = self
            .device
            .clone()
            .or(file.device)
            .unwrap_or_else(|| "auto".into());
        let device: DeviceSpec = device
            .parse()
            .map_err(|e| anyhow::anyhow!("--device: {e}"))?;
        let lr = self.lr.or(file.lr).unwrap_or(1e-2);
        if !(lr.is_finite() && lr > 0.0) {
            bail!("--lr: {lr} must be a positive number");
        }
        let steps = self.steps.or(file.steps).unwrap_or(100);
        if steps == 0 {
            bail!("--steps must be at least 1");
        }
        let bucket_bytes = self.bucket_bytes.or(file.bucket_bytes).unwrap_or(25 << 20);
        if bucket_bytes < 4 {
            bail!("--bucket-bytes: {bucket_bytes} holds no f32 element");
        }
        Ok(Run {
            strategy,
            steps,
            global_batch: self.global_batch.or(file.global_batch).unwrap_or(64),
            lr,
            seed: self.seed.or(file.seed).unwrap_or(1),
            device,
            bucket_bytes,
        })
    }
}

/// Size of the synthetic mlp dataset.
const DATASET: usize = 4096;

pub fn run(args: &TrainArgs) -> Result<()> {
    let run = args.resolve()?;
    let cfg = args.node.config()?;
    let nnodes = cfg.nnodes();
    let world_guess = nnodes * cfg.ranks();
    if !run.global_batch.is_multiple_of(world_guess) || run.global_batch == 0 {
        bail!(
            "--global-batch {} must be a positive multiple of the world size {world_guess}",
            run.global_batch
        );
    }
    let mut node = Node::join(cfg).context("joining the job")?;
    let groups = node.take_groups();
    let data = std::sync::Arc::new(Dataset::synthetic(DATASET, run.seed));
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let run = run.clone();
            let data = data.clone();
            let metrics = args.metrics.clone();
            let save = args.save_params.clone();
            std::thread::spawn(move || train_rank(pg, run, data, metrics, save))
        })
        .collect();
    super::join_ranks(handles)?;
    node.shutdown().context("shutting down")?;
    Ok(())
}

fn train_rank(
    pg: wiretrain_comm::ProcessGroup,
    run: Run,
    data: std::sync::Arc<Dataset>,
    metrics: Option<PathBuf>,
    save: Option<PathBuf>,
) -> Result<()> {
    let rank = pg.rank();
    let world = pg.world();
    let leader = rank == 0;
    let rd = select(run.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
    let device = rd.device.clone().autodiff();
    if leader {
        eprintln!(
            "wiretrain: rank 0 trains on {}; world {world}; strategy {}",
            rd.description, run.strategy
        );
    }
    let sampler = DistributedSampler::new(data.len(), run.global_batch, world, rank, run.seed)
        .map_err(|e| anyhow::anyhow!(e))?;
    let model = Mlp::new(&device, run.seed);
    let mut tc = TrainerConfig::new(run.strategy);
    tc.lr = run.lr;
    tc.bucket_bytes = run.bucket_bytes;
    let mut trainer = Trainer::new(model, &device, tc, pg)?;
    let mut out = match (&metrics, leader) {
        (Some(p), true) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("--metrics {}", p.display()))?,
        )),
        _ => None,
    };
    let t_start = Instant::now();
    let mut first_loss = None;
    let mut last_loss = 0.0;
    let mut comm_total = 0.0;
    for step in 0..run.steps {
        let idx = sampler.indices(step);
        let rep = trainer.step(|m| m.loss(&data, &idx, &device))?;
        first_loss.get_or_insert(rep.loss);
        last_loss = rep.loss;
        comm_total += rep.comm_ms;
        if let Some(o) = out.as_mut() {
            let line = serde_json::json!({
                "step": step,
                "loss": rep.loss,
                "samples_per_s": run.global_batch as f64 / (rep.step_ms / 1e3),
                "step_ms": rep.step_ms,
                "comm_ms": rep.comm_ms,
                "compute_ms": rep.compute_ms,
                "optim_ms": rep.optim_ms,
            });
            writeln!(o, "{line}")?;
        }
    }
    let elapsed = t_start.elapsed().max(Duration::from_micros(1));
    let mem = trainer.memory();
    // Memory of every rank, gathered to rank 0 for the summary.
    let pg = trainer.process_group();
    let mine = [
        mem.params_bytes as u64,
        mem.grads_bytes as u64,
        mem.optim_bytes as u64,
    ];
    let per_rank = gather_memory(pg, mine)?;
    if let Some(mut o) = out.take() {
        let summary = serde_json::json!({
            "summary": true,
            "strategy": run.strategy.to_string(),
            "world": world,
            "steps": run.steps,
            "global_batch": run.global_batch,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "samples_per_s": (run.steps * run.global_batch) as f64 / elapsed.as_secs_f64(),
            "comm_share": comm_total / (elapsed.as_secs_f64() * 1e3),
            "params_total": trainer.layout().total(),
            "memory_per_rank": per_rank,
        });
        writeln!(o, "{summary}")?;
        o.flush()?;
    }
    if leader {
        eprintln!(
            "wiretrain: {} steps, loss {:.4} -> {:.4}, {:.1} samples/s",
            run.steps,
            first_loss.unwrap_or(0.0),
            last_loss,
            (run.steps * run.global_batch) as f64 / elapsed.as_secs_f64()
        );
        if let Some(p) = &save {
            let bytes: Vec<u8> = trainer
                .params()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            std::fs::write(p, bytes).with_context(|| format!("--save-params {}", p.display()))?;
        }
    }
    Ok(())
}

/// Every rank's [params, grads, optim] bytes, in rank order (each sent as three exact 16-bit
/// pieces in f32).
fn gather_memory(
    pg: &mut wiretrain_comm::ProcessGroup,
    mine: [u64; 3],
) -> Result<Vec<serde_json::Value>> {
    let world = pg.world();
    let enc: Vec<f32> = mine
        .iter()
        .flat_map(|v| {
            [
                (v >> 32 & 0xffff) as f32,
                (v >> 16 & 0xffff) as f32,
                (v & 0xffff) as f32,
            ]
        })
        .collect();
    let dec = |c: &[f32]| ((c[0] as u64) << 32) | ((c[1] as u64) << 16) | c[2] as u64;
    let mut out = Vec::with_capacity(world);
    for r in 0..world {
        let v = pg.broadcast(enc.clone(), r).wait()?;
        out.push(serde_json::json!({
            "rank": r,
            "params_bytes": dec(&v[0..3]),
            "grads_bytes": dec(&v[3..6]),
            "optim_bytes": dec(&v[6..9]),
        }));
    }
    Ok(out)
}
