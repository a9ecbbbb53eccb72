//! `wiretrain train`: one node of a training run (every local rank is a thread), and
//! `wiretrain launch --local N -- train ...`: N such nodes on 127.0.0.x.

use super::node::NodeArgs;
use crate::cli::usage;
use anyhow::Result;
use burn::tensor::Tensor;
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use wiretrain::RankContext;
use wiretrain::balance::Balance;
use wiretrain::data::DistributedSampler;
use wiretrain::engine::{Trainer, TrainerConfig};
use wiretrain::fit::{FitOptions, fit};
use wiretrain::models::Example;
use wiretrain::models::char_lm::{CharLm, CharLmConfig, Corpus};
use wiretrain::models::mlp::{Dataset, Mlp};
use wiretrain::units::{Act, Units};

#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Built-in example to train: mlp, char-lm.
    #[arg(long)]
    pub example: Option<String>,
    /// Parallel strategy: ddp, zero1, zero2, zero3 (alias fsdp), hybrid, hsdp, diloco (DDP
    /// inside each node, nodes averaging parameter deltas every --inner-steps steps), or auto
    /// (measure the wiring at start and train with the fastest the planner finds).
    #[arg(long)]
    pub strategy: Option<String>,
    /// --strategy auto: strategies that change the optimization it may pick (diloco).
    #[arg(long)]
    pub allow: Option<String>,
    /// With a named --strategy: measure the wiring at start and print auto's table, then
    /// train with the strategy given (the table shows what it is predicted to cost).
    #[arg(long)]
    pub show_plan: bool,
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
    /// Device per rank: auto, wgpu (local rank i on the i-th GPU adapter), wgpu:N (adapter N
    /// of `wiretrain devices`), wgpu:cpu (lavapipe), cpu; or a comma-separated list with one
    /// per local rank, to mix device kinds on a node (e.g. "wgpu:cpu,cpu").
    #[arg(long, env = "WIRETRAIN_DEVICE")]
    pub device: Option<String>,
    /// Let several local ranks share one GPU adapter (refused otherwise).
    #[arg(long)]
    pub share_device: bool,
    /// Gradient bucket size in bytes.
    #[arg(long)]
    pub bucket_bytes: Option<usize>,
    /// Micro-batches accumulated locally per optimizer step (communication once per step).
    #[arg(long)]
    pub accumulate: Option<usize>,
    /// char-lm: model width (a multiple of its 4 heads; feed-forward 4x wider). Default 64.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// char-lm: transformer blocks. Default 2.
    #[arg(long)]
    pub layers: Option<usize>,
    /// ZeRO-3: unit all-gathers in flight ahead of the computing unit (0 turns prefetch off).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// DDP, ZeRO-1/2, hybrid: reduce each unit's gradient while the backward of the units
    /// before it runs (auto: on when gradients cross nodes and --accumulate is 1; on; off).
    #[arg(long)]
    pub overlap: Option<String>,
    /// Element type of gradients and parameters between nodes: f32, f16, bf16, int8 (one f32
    /// scale per 128 values). Sums accumulate in f32; masters and optimizer state stay f32.
    #[arg(long)]
    pub wire_dtype: Option<String>,
    /// diloco: inner steps per outer step (default 50).
    #[arg(long)]
    pub inner_steps: Option<usize>,
    /// diloco: outer learning rate (default 0.7).
    #[arg(long)]
    pub outer_lr: Option<f32>,
    /// diloco: outer Nesterov momentum (default 0.9).
    #[arg(long)]
    pub outer_momentum: Option<f32>,
    /// diloco: the strategy inside each node, ddp (default) or hybrid (ZeRO-2 sharding of
    /// gradients and optimizer state among the node's ranks).
    #[arg(long)]
    pub inner_strategy: Option<String>,
    /// How the global batch is split over ranks: equal, or speed (shares follow each rank's
    /// measured samples/s after a short calibration, gradients weighted by share).
    #[arg(long)]
    pub balance: Option<String>,
    /// Fixed per-rank shares of the global batch, comma-separated (sum = --global-batch);
    /// gradients are weighted by share, as with --balance speed.
    #[arg(long)]
    pub shares: Option<String>,
    /// Run AdamW with Burn's tensor ops instead of wiretrain's fused WGSL kernel on wgpu
    /// devices (for comparisons; the math is the same).
    #[arg(long)]
    pub no_fused_optimizer: bool,
    /// The host path: DDP's gradients, parameters and optimizer go through host memory every
    /// step, and the other strategies upload their f32 master every step (the path before the
    /// device-resident step; for comparisons).
    #[arg(long)]
    pub host_path: bool,
    /// --resume takes the checkpoints rank 0 lists even where another node's directory holds
    /// others (by default every node lists its own and a difference is refused).
    #[arg(long)]
    pub trust_rank0_checkpoints: bool,
    /// Write a PNG plot of loss and throughput here (default: the metrics path with .png).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Write one JSON line per step (and a summary line) here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write the final flat parameters (little-endian f32) here.
    #[arg(long)]
    pub save_params: Option<PathBuf>,
    /// Write a sharded checkpoint every K steps into --checkpoint-dir (one is also written
    /// after the last step and when a signal stops the run).
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Directory of the checkpoints (`step-NNNNNNNN/` with one shard per rank and a manifest).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Valid checkpoints kept in --checkpoint-dir (older ones are removed). Default 2.
    #[arg(long)]
    pub checkpoint_keep: Option<usize>,
    /// Resume from the newest valid checkpoint in --checkpoint-dir, on any world size and
    /// strategy (the flat buffers are resharded); starts at step 0 when there is none.
    #[arg(long)]
    pub resume: bool,
    /// Start afresh in a --checkpoint-dir that holds checkpoints of an earlier run, moving
    /// them aside into DIR/previous-<time>/ (without it, that is refused: a later --resume
    /// would load whichever run's checkpoint is newest).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite_checkpoints: bool,
    /// Seconds the ranks of a checkpoint save wait for the slowest writer (the longer of this
    /// and --collective-timeout applies). Default 600.
    #[arg(long, value_name = "SECS")]
    pub checkpoint_timeout: Option<f64>,
    /// Write a timeline trace per rank (Chrome trace JSON: Perfetto, chrome://tracing) into
    /// this directory; `wiretrain report DIR` summarises it.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// TOML file with any of the fields above (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
}

mod auto;
mod resolve;

use resolve::Run;

/// Size of the synthetic mlp dataset.
pub(super) const DATASET: usize = 4096;
/// Context length of the char-lm example.
pub(super) const CHAR_SEQ: usize = 64;

/// The data of the chosen example, shared by this node's ranks.
#[derive(Clone)]
enum Data {
    Mlp(Arc<Dataset>),
    CharLm(Arc<Corpus>),
}

impl Data {
    fn len(&self) -> usize {
        match self {
            Self::Mlp(d) => d.len(),
            Self::CharLm(c) => c.len(),
        }
    }
}

/// What every rank of this node shares.
#[derive(Clone)]
struct Shared {
    run: Run,
    data: Data,
    fit: FitOptions,
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let run = args.resolve()?;
    let mut job = args.node.options()?;
    job.devices = run.device.clone();
    job.share_device = run.share_device;
    let nnodes = job.node_config()?.nnodes();
    let world_guess = nnodes * job.ranks();
    if run.device.len() > 1 && run.device.len() != job.ranks() {
        usage!(
            "--device: {} devices listed for {} ranks per node (give one, or one per local rank)",
            run.device.len(),
            job.ranks()
        );
    }
    let per_step = world_guess * run.accumulate;
    if let Balance::Fixed(sh) = &run.balance
        && (sh.len() != world_guess
            || sh.contains(&0)
            || sh.iter().sum::<usize>() != run.global_batch)
    {
        usage!(
            "--shares {sh:?}: need {world_guess} shares (one per rank), each at least 1, \
             summing to --global-batch {}",
            run.global_batch
        );
    }
    if run.balance != Balance::Equal {
        if run.global_batch < world_guess {
            usage!(
                "--global-batch {} is smaller than the world size {world_guess}",
                run.global_batch
            );
        }
    } else if run.global_batch == 0 || !run.global_batch.is_multiple_of(per_step) {
        usage!(
            "--global-batch {} must be a positive multiple of the world size {world_guess} \
             times --accumulate {}",
            run.global_batch,
            run.accumulate
        );
    }
    let data = match run.example {
        Example::Mlp => Data::Mlp(Arc::new(Dataset::synthetic(DATASET, run.seed))),
        Example::CharLm => Data::CharLm(Arc::new(Corpus::shipped(CHAR_SEQ))),
    };
    let mut fit = FitOptions::new(run.steps, run.global_batch);
    fit.accumulate = run.accumulate;
    fit.balance = run.balance.clone();
    fit.metrics = args.metrics.clone();
    fit.plot = run.plot.clone();
    fit.progress = !args.no_progress;
    fit.checkpoint = run.checkpoint.clone();
    fit.trace = args.trace.clone();
    fit.save_params = args.save_params.clone();
    fit.title = run.example.to_string();
    fit.meta = serde_json::json!({
        "example": run.example.to_string(),
        "seed": run.seed,
        "lr": run.trainer.lr(),
        "d_model": run.d_model,
        "layers": run.layers,
    });
    // An epoch after an elastic restart: `fit` continues the metrics and reports it.
    wiretrain::job::Elastic::from_env()?;
    let shared = Shared { run, data, fit };
    let outcomes =
        wiretrain::run(job, move |ctx| train_rank(ctx, shared.clone())).map_err(|e| match e {
            wiretrain::RunError::Device(d) => crate::cli::usage_error(format!("--device: {d}")),
            other => anyhow::Error::new(other),
        })?;
    if let Some(step) = outcomes.iter().flatten().next() {
        return Err(super::Interrupted(format!(
            "stopped by a signal after step {step} on every rank; metrics and outputs are written"
        ))
        .into());
    }
    Ok(())
}

/// Trains one rank; returns the last step done when a signal stopped the run early.
fn train_rank(ctx: RankContext, sh: Shared) -> Result<Option<usize>> {
    let device = ctx.device();
    let mut sh = sh;
    sh.fit.stop = Some(ctx.stop.clone());
    // `--strategy auto` measures with collectives before training, which nodes healed or
    // regrouped in place would not meet: such a run restarts from its checkpoint instead.
    sh.fit.heal = ctx.heal.clone().filter(|_| sh.run.auto.is_none());
    let pg = ctx.pg;
    if pg.rank() == 0 {
        eprintln!(
            "wiretrain: training {} on world {}; strategy {}",
            sh.run.example,
            pg.world(),
            sh.run.strategy_name()
        );
        // The rank table: every rank's node and device.
        let table = pg.table();
        for n in table.nodes() {
            for (l, d) in n.devices.iter().enumerate() {
                eprintln!(
                    "wiretrain: rank {} (node {}, local {l}) trains on {d}",
                    table.global_rank(n.node, l),
                    n.node
                );
            }
        }
    }
    let make = if sh.run.balance == Balance::Equal {
        DistributedSampler::new
    } else {
        DistributedSampler::uneven
    };
    let sampler = make(
        sh.data.len(),
        sh.run.global_batch,
        pg.world(),
        pg.rank(),
        sh.run.seed,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let tc = sh.run.trainer.clone();
    match sh.data.clone() {
        Data::Mlp(data) => train_model(
            Mlp::new(&device, sh.run.seed),
            (&device, tc, pg, sampler, &sh),
            |m, idx| m.loss(&data, idx, &device),
            |idx| Mlp::unit_io(&data, idx, &device),
        ),
        Data::CharLm(corpus) => train_model(
            char_lm(&corpus, sh.run.d_model, sh.run.layers, &device, sh.run.seed),
            (&device, tc, pg, sampler, &sh),
            |m, idx| m.loss(&corpus, idx, &device),
            |idx| CharLm::unit_io(&corpus, idx, &device),
        ),
    }
}

/// The char-lm example at width `d_model` (feed-forward 4x wider) with `layers` blocks.
pub(super) fn char_lm(
    corpus: &Corpus,
    d_model: usize,
    layers: usize,
    device: &burn::tensor::Device,
    seed: u64,
) -> CharLm {
    CharLmConfig::new(corpus.vocab_size())
        .with_seq(corpus.seq())
        .with_d_model(d_model)
        .with_d_ff(4 * d_model)
        .with_n_layers(layers)
        .init(device, seed)
}

/// What a rank trains with, besides the model.
type RankSetup<'a> = (
    &'a burn::tensor::Device,
    TrainerConfig,
    wiretrain_comm::ProcessGroup,
    DistributedSampler,
    &'a Shared,
);

/// Trains a unit model: unit by unit under ZeRO-3, HSDP and with overlap (`unit_io` gives unit
/// 0's input and the loss of the last unit's output), else whole-model steps of
/// `--accumulate` micro-batches.
fn train_model<M: Units, L: FnOnce(Act) -> Tensor<1>>(
    model: M,
    (device, tc, mut pg, sampler, sh): RankSetup<'_>,
    loss: impl Fn(&M, &[usize]) -> Tensor<1>,
    unit_io: impl Fn(&[usize]) -> (Act, L),
) -> Result<Option<usize>> {
    let micro = sh.run.accumulate;
    let mut fit_opts = sh.fit.clone();
    let (tc, mut drift) = match &sh.run.auto {
        None => (tc, None),
        Some(a) => auto::configure(
            &model,
            tc,
            &mut pg,
            &sampler,
            &loss,
            (a, device, sh),
            &mut fit_opts,
        )?,
    };
    let trainer = Trainer::with_units(model, device, tc, pg)?;
    // Unit by unit: ZeRO-3 and HSDP always, the others when they overlap (one micro-batch:
    // resolve turns overlap off otherwise).
    let by_units = trainer.config().strategy().shards_params() || trainer.overlaps_units();
    let mut steps = 0;
    let done = fit(trainer, sampler, &fit_opts, |t, idx| {
        let r = if by_units {
            let (x, l) = unit_io(idx);
            t.step_units(x, l)?
        } else {
            let per = idx.len() / micro;
            t.step_accumulate(micro, |m, i| loss(m, &idx[i * per..(i + 1) * per]))?
        };
        steps += 1;
        if let Some(re) = drift.as_mut().and_then(|d| d.observe(&r)) {
            auto::log_replan(&re, steps);
        }
        Ok(r)
    })?;
    Ok(done.stopped_after)
}
