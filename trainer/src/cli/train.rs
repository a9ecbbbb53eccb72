//! `wiretrain train`: one node of a training run (every local rank is a thread), and
//! `wiretrain launch --local N -- train ...`: N such nodes on 127.0.0.x.

use super::node::NodeArgs;
use anyhow::{Context, Result, bail};
use burn::module::Module;
use burn::tensor::Tensor;
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Deserialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use wiretrain::balance::{Balance, SpeedBalancer};
use wiretrain::data::DistributedSampler;
use wiretrain::device::{DeviceSpec, select};
use wiretrain::models::Example;
use wiretrain::models::char_lm::{CharLm, CharLmConfig, Corpus};
use wiretrain::models::mlp::{Dataset, Mlp};
use wiretrain::plot::{PlotPoint, plot_run};
use wiretrain::strategy::Strategy;
use wiretrain::trainer::{Diloco, StepReport, TrainError, Trainer, TrainerConfig};
use wiretrain::units::{Act, Units};
use wiretrain_comm::{Node, WireDtype};

#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Built-in example to train: mlp, char-lm.
    #[arg(long)]
    pub example: Option<String>,
    /// Parallel strategy: ddp, zero1, zero2, zero3 (alias fsdp), hybrid, hsdp, diloco (DDP
    /// inside each node, nodes averaging parameter deltas every --inner-steps steps).
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
    /// Device per rank: auto, wgpu, wgpu:cpu (lavapipe), cpu; or a comma-separated list with
    /// one per local rank, to mix device kinds on a node (e.g. "wgpu:cpu,cpu").
    #[arg(long)]
    pub device: Option<String>,
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
    accumulate: Option<usize>,
    prefetch: Option<usize>,
    wire_dtype: Option<String>,
    fused_optimizer: Option<bool>,
    balance: Option<String>,
    shares: Option<String>,
    inner_steps: Option<usize>,
    inner_strategy: Option<String>,
    outer_lr: Option<f32>,
    outer_momentum: Option<f32>,
    plot: Option<PathBuf>,
    d_model: Option<usize>,
    layers: Option<usize>,
    checkpoint_every: Option<usize>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_keep: Option<usize>,
    resume: Option<bool>,
}

/// Where and how often checkpoints are written.
#[derive(Debug, Clone)]
struct CkptPlan {
    dir: PathBuf,
    every: Option<usize>,
    keep: usize,
    resume: bool,
}

/// The resolved run settings.
#[derive(Debug, Clone)]
struct Run {
    example: Example,
    strategy: Strategy,
    steps: usize,
    global_batch: usize,
    lr: f64,
    seed: u64,
    /// One per local rank, or a single one for all.
    device: Vec<DeviceSpec>,
    bucket_bytes: usize,
    accumulate: usize,
    prefetch: usize,
    wire: WireDtype,
    fused_optimizer: bool,
    balance: Balance,
    diloco: Option<Diloco>,
    plot: Option<PathBuf>,
    d_model: usize,
    layers: usize,
    checkpoint: Option<CkptPlan>,
}

impl Run {
    /// The strategy as the user named it (diloco runs on top of ddp).
    fn strategy_name(&self) -> String {
        if self.diloco.is_some() {
            "diloco".into()
        } else {
            self.strategy.to_string()
        }
    }
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
        let example: Example = self
            .example
            .clone()
            .or(file.example)
            .unwrap_or_else(|| "mlp".into())
            .parse()
            .map_err(|e| anyhow::anyhow!("--example: {e}"))?;
        let strategy = self
            .strategy
            .clone()
            .or(file.strategy)
            .unwrap_or_else(|| "ddp".into());
        let diloco = (strategy == "diloco").then(|| {
            let d = Diloco::default();
            Diloco {
                inner_steps: self
                    .inner_steps
                    .or(file.inner_steps)
                    .unwrap_or(d.inner_steps),
                outer_lr: self.outer_lr.or(file.outer_lr).unwrap_or(d.outer_lr),
                outer_momentum: self
                    .outer_momentum
                    .or(file.outer_momentum)
                    .unwrap_or(d.outer_momentum),
            }
        });
        if let Some(d) = &diloco {
            if d.inner_steps == 0 {
                bail!("--inner-steps must be at least 1");
            }
            if !(d.outer_lr.is_finite() && d.outer_lr > 0.0) {
                bail!("--outer-lr: {} must be a positive number", d.outer_lr);
            }
            if !(0.0..1.0).contains(&d.outer_momentum) {
                bail!("--outer-momentum: {} is outside [0, 1)", d.outer_momentum);
            }
        } else if self.inner_steps.is_some()
            || self.outer_lr.is_some()
            || self.outer_momentum.is_some()
            || self.inner_strategy.is_some()
        {
            bail!(
                "--inner-steps, --inner-strategy, --outer-lr and --outer-momentum belong to \
                 --strategy diloco"
            );
        }
        let strategy: Strategy = if diloco.is_some() {
            match self
                .inner_strategy
                .clone()
                .or(file.inner_strategy)
                .as_deref()
                .unwrap_or("ddp")
            {
                "ddp" => Strategy::Ddp,
                "hybrid" => Strategy::Hybrid,
                other => bail!(
                    "--inner-strategy: {other:?} is not ddp or hybrid (sharding inside the node)"
                ),
            }
        } else {
            strategy
                .parse()
                .map_err(|e| anyhow::anyhow!("--strategy: {e} (or diloco)"))?
        };
        let device = self
            .device
            .clone()
            .or(file.device)
            .unwrap_or_else(|| "auto".into());
        // One spec for every rank of the node, or one per local rank ("wgpu:cpu,cpu").
        let device: Vec<DeviceSpec> = device
            .split(',')
            .map(|d| d.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--device: {e}"))?;
        let lr = self.lr.or(file.lr).unwrap_or(example.default_lr());
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
        let accumulate = self.accumulate.or(file.accumulate).unwrap_or(1);
        if accumulate == 0 {
            bail!("--accumulate must be at least 1");
        }
        if accumulate > 1 && strategy == Strategy::Zero3 {
            bail!(
                "--accumulate: zero3 runs one micro-batch per step (accumulation is not built yet)"
            );
        }
        let d_model = self.d_model.or(file.d_model).unwrap_or(64);
        if d_model == 0 || !d_model.is_multiple_of(4) || d_model > 8192 {
            bail!(
                "--d-model: {d_model} must be a positive multiple of 4 (the heads), at most 8192"
            );
        }
        let layers = self.layers.or(file.layers).unwrap_or(2);
        if !(1..=64).contains(&layers) {
            bail!("--layers: {layers} is outside 1..=64");
        }
        let prefetch = self.prefetch.or(file.prefetch).unwrap_or(1);
        if prefetch > 16 {
            bail!("--prefetch: {prefetch} units ahead is more than 16");
        }
        let wire: WireDtype = self
            .wire_dtype
            .clone()
            .or(file.wire_dtype)
            .unwrap_or_else(|| "f32".into())
            .parse()
            .map_err(|e| anyhow::anyhow!("--wire-dtype: {e}"))?;
        let balance = match (
            self.shares.clone().or(file.shares),
            self.balance.clone().or(file.balance).as_deref(),
        ) {
            (Some(list), None | Some("fixed")) => Balance::Fixed(
                list.split(',')
                    .map(|x| x.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| anyhow::anyhow!("--shares {list:?}: {e}"))?,
            ),
            (Some(_), Some(b)) => {
                bail!("--shares sets fixed shares; it cannot go with --balance {b}")
            }
            (None, None | Some("equal")) => Balance::Equal,
            (None, Some("speed")) => Balance::Speed,
            (None, Some(other)) => bail!("--balance: {other:?} is not equal or speed"),
        };
        if balance != Balance::Equal && accumulate > 1 {
            bail!("--balance/--shares: uneven shares need --accumulate 1");
        }
        let plot = self
            .plot
            .clone()
            .or(file.plot)
            .or_else(|| self.metrics.as_ref().map(|m| m.with_extension("png")));
        let every = self.checkpoint_every.or(file.checkpoint_every);
        let keep = self.checkpoint_keep.or(file.checkpoint_keep).unwrap_or(2);
        let resume = self.resume || file.resume.unwrap_or(false);
        if every == Some(0) {
            bail!("--checkpoint-every must be at least 1");
        }
        if keep == 0 {
            bail!("--checkpoint-keep must be at least 1");
        }
        let checkpoint = match self.checkpoint_dir.clone().or(file.checkpoint_dir) {
            Some(dir) => Some(CkptPlan {
                dir,
                every,
                keep,
                resume,
            }),
            None if every.is_some() || resume => {
                bail!("--checkpoint-every and --resume need --checkpoint-dir")
            }
            None => None,
        };
        Ok(Run {
            checkpoint,
            example,
            strategy,
            steps,
            global_batch: self.global_batch.or(file.global_batch).unwrap_or(64),
            lr,
            seed: self.seed.or(file.seed).unwrap_or(1),
            device,
            bucket_bytes,
            accumulate,
            prefetch,
            wire,
            fused_optimizer: !self.no_fused_optimizer && file.fused_optimizer.unwrap_or(true),
            balance,
            diloco,
            plot,
            d_model,
            layers,
        })
    }
}

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
    metrics: Option<PathBuf>,
    save: Option<PathBuf>,
    trace: Option<PathBuf>,
    progress: bool,
    stop: Arc<AtomicBool>,
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let run = args.resolve()?;
    let cfg = args.node.config()?;
    let nnodes = cfg.nnodes();
    let world_guess = nnodes * cfg.ranks();
    if run.device.len() > 1 && run.device.len() != cfg.ranks() {
        bail!(
            "--device: {} devices listed for {} ranks per node (give one, or one per local rank)",
            run.device.len(),
            cfg.ranks()
        );
    }
    let per_step = world_guess * run.accumulate;
    if let Balance::Fixed(sh) = &run.balance
        && (sh.len() != world_guess
            || sh.contains(&0)
            || sh.iter().sum::<usize>() != run.global_batch)
    {
        bail!(
            "--shares {sh:?}: need {world_guess} shares (one per rank), each at least 1, \
             summing to --global-batch {}",
            run.global_batch
        );
    }
    if run.balance != Balance::Equal {
        if run.global_batch < world_guess {
            bail!(
                "--global-batch {} is smaller than the world size {world_guess}",
                run.global_batch
            );
        }
    } else if run.global_batch == 0 || !run.global_batch.is_multiple_of(per_step) {
        bail!(
            "--global-batch {} must be a positive multiple of the world size {world_guess} \
             times --accumulate {}",
            run.global_batch,
            run.accumulate
        );
    }
    let stop = wiretrain::signal::install(None).map_err(anyhow::Error::msg)?;
    let data = match run.example {
        Example::Mlp => Data::Mlp(Arc::new(Dataset::synthetic(DATASET, run.seed))),
        Example::CharLm => Data::CharLm(Arc::new(Corpus::shipped(CHAR_SEQ))),
    };
    let mut node = Node::join(cfg).context("joining the job")?;
    let groups = node.take_groups();
    let shared = Shared {
        run,
        data,
        metrics: args.metrics.clone(),
        save: args.save_params.clone(),
        trace: args.trace.clone(),
        progress: !args.no_progress,
        stop,
    };
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let shared = shared.clone();
            std::thread::spawn(move || train_rank(pg, shared))
        })
        .collect();
    let outcomes = super::join_ranks(handles)?;
    node.shutdown().context("shutting down")?;
    if let Some(step) = outcomes.iter().flatten().next() {
        return Err(super::Interrupted(format!(
            "stopped by a signal after step {step} on every rank; metrics and outputs are written"
        ))
        .into());
    }
    Ok(())
}

/// Trains one rank; returns the last step done when a signal stopped the run early.
fn train_rank(pg: wiretrain_comm::ProcessGroup, sh: Shared) -> Result<Option<usize>> {
    let spec = sh.run.device[pg.local_rank().min(sh.run.device.len() - 1)];
    let rd = select(spec).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
    let device = rd.device.clone().autodiff();
    if sh.run.device.len() > 1 {
        eprintln!(
            "wiretrain: rank {} (node {}, local {}) trains on {}",
            pg.rank(),
            pg.node(),
            pg.local_rank(),
            rd.description
        );
    }
    if pg.rank() == 0 {
        eprintln!(
            "wiretrain: rank 0 trains {} on {}; world {}; strategy {}",
            sh.run.example,
            rd.description,
            pg.world(),
            sh.run.strategy_name()
        );
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
    let mut tc = TrainerConfig::new(sh.run.strategy);
    tc.lr = sh.run.lr;
    tc.bucket_bytes = sh.run.bucket_bytes;
    tc.prefetch = sh.run.prefetch;
    tc.wire = sh.run.wire;
    tc.fused_optimizer = sh.run.fused_optimizer;
    tc.diloco = sh.run.diloco;
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

/// Trains a unit model: unit by unit under ZeRO-3 (`unit_io` gives unit 0's input and the
/// loss of the last unit's output), else whole-model steps of `--accumulate` micro-batches.
fn train_model<M: Units, L: FnOnce(Act) -> Tensor<1>>(
    model: M,
    (device, tc, pg, sampler, sh): RankSetup<'_>,
    loss: impl Fn(&M, &[usize]) -> Tensor<1>,
    unit_io: impl Fn(&[usize]) -> (Act, L),
) -> Result<Option<usize>> {
    if tc.strategy.shards_params() {
        let trainer = Trainer::with_units(model, device, tc, pg)?;
        return train_loop(trainer, sampler, sh, |t, idx| {
            let (x, l) = unit_io(idx);
            t.step_units(x, l)
        });
    }
    let micro = sh.run.accumulate;
    let trainer = Trainer::new(model, device, tc, pg)?;
    train_loop(trainer, sampler, sh, |t, idx| {
        let per = idx.len() / micro;
        t.step_accumulate(micro, |m, i| loss(m, &idx[i * per..(i + 1) * per]))
    })
}

fn progress_bar(steps: usize, show: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(steps as u64),
        if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg} (eta {eta})")
            .expect("a valid progress template")
            .progress_chars("=> "),
    );
    bar
}

/// Medians of the per-step time split (the first step, which compiles kernels, is left out
/// when there are more).
fn medians(reports: &[[f64; 6]]) -> serde_json::Value {
    let skip = usize::from(reports.len() > 1);
    let med = |k: usize| {
        let mut v: Vec<f64> = reports[skip..].iter().map(|r| r[k]).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    serde_json::json!({
        "step_ms": med(0), "compute_ms": med(1), "comm_ms": med(2), "optim_ms": med(3),
        "sent_bytes": med(4), "gather_ms": med(5),
    })
}

fn train_loop<M: Module>(
    mut trainer: Trainer<M>,
    mut sampler: DistributedSampler,
    sh: &Shared,
    mut step_fn: impl FnMut(&mut Trainer<M>, &[usize]) -> Result<StepReport, TrainError>,
) -> Result<Option<usize>> {
    let run = &sh.run;
    let leader = trainer.process_group().rank() == 0;
    trainer.set_stop_flag(sh.stop.clone());
    let mut out = match (&sh.metrics, leader) {
        (Some(p), true) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("--metrics {}", p.display()))?,
        )),
        _ => None,
    };
    // The peak memory reported is that of the training steps, not of start-up (where every
    // rank briefly holds the whole model, whatever the strategy).
    wiretrain::rss::reset_peak_rss();
    let bar = progress_bar(run.steps, leader && sh.progress);
    let t_start = Instant::now();
    let mut points: Vec<PlotPoint> = Vec::with_capacity(run.steps);
    let mut split: Vec<[f64; 6]> = Vec::with_capacity(run.steps);
    let mut comm_total = 0.0;
    let mut stopped = None;
    let micro = run.accumulate;
    let run_meta = serde_json::json!({
        "example": run.example.to_string(),
        "seed": run.seed,
        "global_batch": run.global_batch,
        "lr": run.lr,
        "accumulate": micro,
        "d_model": run.d_model,
        "layers": run.layers,
    });
    let mut start = 0;
    if let Some(c) = run.checkpoint.as_ref().filter(|c| c.resume) {
        match trainer.resume_latest(&c.dir)? {
            Some(m) => {
                start = m.step;
                if leader {
                    eprintln!(
                        "wiretrain: resumed from {} at step {start} (written by {} ranks, {})",
                        c.dir.display(),
                        m.world,
                        m.strategy
                    );
                    if m.run.get("global_batch") != run_meta.get("global_batch") {
                        eprintln!(
                            "wiretrain: warning: the checkpoint was trained with global batch {}, \
                             this run uses {}; the data order differs from an uninterrupted run",
                            m.run
                                .get("global_batch")
                                .unwrap_or(&serde_json::Value::Null),
                            run.global_batch
                        );
                    }
                }
            }
            None if leader => eprintln!(
                "wiretrain: no checkpoint in {}; starting at step 0",
                c.dir.display()
            ),
            None => {}
        }
    }
    bar.set_position(start as u64);
    let node = trainer.process_group().node();
    let rank = trainer.process_group().rank();
    if sh.trace.is_some() {
        let off = wiretrain::trace::estimate_offset(trainer.process_group())?;
        wiretrain::trace::enable(rank, node, off);
        trainer.process_group().keep_history(true);
    }
    let slow_rank = slow_rank_hook(rank);
    let slowdown = slowdown_hook(rank);
    let mut per_sample_ms: Option<f64> = None;
    let world = trainer.process_group().world();
    let mut balancer = SpeedBalancer::new(run.global_batch);
    let mut shares: Option<Vec<usize>> = None;
    let mut t_iter = Instant::now();
    for step in start..run.steps {
        if let Some(ms) = slow_step_hook(node, step) {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let st = wiretrain::trace::span(format!("step {step}"), "step");
        let sp = wiretrain::trace::span("data", "data");
        shares = match &run.balance {
            Balance::Equal => None,
            Balance::Fixed(v) => Some(v.clone()),
            Balance::Speed => Some(balancer.shares(world)),
        };
        let idx = match &shares {
            None => sampler.indices(step),
            Some(s) => {
                trainer.set_sample_weight(s[rank], run.global_batch);
                sampler.indices_shared(step, s)
            }
        };
        drop(sp);
        if let Some(ms) = slow_rank {
            let _s = wiretrain::trace::span("slowed compute (test hook)", "compute");
            std::thread::sleep(Duration::from_millis(ms));
        }
        // The debug knob: this rank computes `f` times slower. The extra time is spent before
        // the step's collectives, like a slower device, scaled by this step's samples.
        let mut slept_ms = 0.0;
        if let (Some(f), Some(per)) = (slowdown, per_sample_ms) {
            slept_ms = (f - 1.0) * per * idx.len() as f64;
            let _s = wiretrain::trace::span("slowed compute (debug knob)", "compute");
            std::thread::sleep(Duration::from_secs_f64(slept_ms / 1e3));
        }
        let rep = step_fn(&mut trainer, &idx)?;
        per_sample_ms = Some(rep.compute_ms / idx.len().max(1) as f64);
        let compute_ms = rep.compute_ms + slept_ms;
        if run.balance == Balance::Speed {
            // Everyone gets everyone's speed, so all ranks compute the same shares.
            let speed = idx.len() as f64 / (compute_ms / 1e3).max(1e-9);
            let pg = trainer.process_group();
            let n = pg.shard_range(world).len();
            let all = pg.all_gather(vec![speed as f32; n], world).wait()?;
            balancer.observe(&all);
        }
        drop(st);
        if sh.trace.is_some() {
            wiretrain::trace::add_comm_track(trainer.process_group());
        }
        let samples_per_s = run.global_batch as f64 / (rep.step_ms / 1e3);
        comm_total += rep.comm_ms;
        points.push(PlotPoint {
            step,
            loss: rep.loss as f64,
            samples_per_s,
        });
        split.push([
            rep.step_ms,
            rep.compute_ms,
            rep.comm_ms,
            rep.optim_ms,
            rep.sent_bytes as f64,
            rep.gather_ms,
        ]);
        if let Some(o) = out.as_mut() {
            let line = serde_json::json!({
                "step": step,
                "loss": rep.loss,
                "samples_per_s": samples_per_s,
                "step_ms": rep.step_ms,
                "comm_ms": rep.comm_ms,
                "compute_ms": rep.compute_ms,
                "optim_ms": rep.optim_ms,
                "gather_ms": rep.gather_ms,
                "sent_bytes": rep.sent_bytes,
                "shares": shares,
                // The whole loop iteration on the leader: the step plus anything between steps.
                "wall_ms": t_iter.elapsed().as_secs_f64() * 1e3,
            });
            writeln!(o, "{line}")?;
            o.flush()?;
        }
        t_iter = Instant::now();
        bar.set_position(step as u64 + 1);
        bar.set_message(format!(
            "loss {:.4} | {:.0} samples/s | comm {:.0}%{}",
            rep.loss,
            samples_per_s,
            100.0 * rep.comm_ms / rep.step_ms.max(1e-9),
            shares
                .as_ref()
                .map(|s| format!(" | shares {s:?}"))
                .unwrap_or_default()
        ));
        let done = step + 1;
        if let Some(c) = &run.checkpoint
            && (c.every.is_some_and(|k| done.is_multiple_of(k)) || done == run.steps || rep.stop)
        {
            let t = Instant::now();
            let d = trainer
                .save_checkpoint(&c.dir, done, run_meta.clone(), c.keep)
                .with_context(|| format!("writing a checkpoint into {}", c.dir.display()))?;
            if leader {
                bar.suspend(|| {
                    eprintln!(
                        "wiretrain: checkpoint of step {done} written to {} ({:.0} ms)",
                        d.display(),
                        t.elapsed().as_secs_f64() * 1e3
                    )
                });
            }
        }
        if rep.stop {
            stopped = Some(step);
            break;
        }
    }
    bar.finish_and_clear();
    let steps_done = points.len();
    if let Some(dir) = &sh.trace {
        let world = trainer.process_group().world();
        if let Some(p) = wiretrain::trace::finish(dir, world)
            .with_context(|| format!("--trace {}", dir.display()))?
            && leader
        {
            eprintln!(
                "wiretrain: traces written to {} ({} and one per rank)",
                dir.display(),
                p.display()
            );
        }
    }
    let elapsed = t_start.elapsed().max(Duration::from_micros(1));
    let samples_per_s = (steps_done * run.global_batch) as f64 / elapsed.as_secs_f64();
    let mem = trainer.memory();
    // Memory of every rank, gathered to rank 0 for the summary.
    let world = trainer.process_group().world();
    let mine = [
        mem.params_bytes as u64,
        mem.grads_bytes as u64,
        mem.optim_bytes as u64,
        wiretrain::rss::peak_rss_bytes().unwrap_or(0),
    ];
    let per_rank = gather_memory(trainer.process_group(), mine)?;
    let full_params = match &sh.save {
        Some(_) => Some(trainer.gather_params()?),
        None => None,
    };
    let first_loss = points.first().map(|p| p.loss);
    let final_loss = points.last().map(|p| p.loss);
    if let Some(mut o) = out.take() {
        let summary = serde_json::json!({
            "summary": true,
            "example": run.example.to_string(),
            "strategy": run.strategy_name(),
            "diloco": run.diloco,
            "world": world,
            "steps": run.steps,
            "steps_done": steps_done,
            "resumed_from": start,
            "stopped_early": stopped.is_some(),
            "global_batch": run.global_batch,
            "accumulate": micro,
            "first_loss": first_loss,
            "final_loss": final_loss,
            "samples_per_s": samples_per_s,
            "comm_share": comm_total / (elapsed.as_secs_f64() * 1e3),
            "median": medians(&split),
            "params_total": trainer.layout().total(),
            "largest_bucket_elems": trainer.largest_bucket(),
            "prefetch": run.prefetch,
            "wire_dtype": run.wire.name(),
            "optimizer": trainer.optimizer_path(),
            "kernels": trainer.kernel_counters(),
            "memory_per_rank": per_rank,
            "balance": match &run.balance {
                Balance::Equal => "equal",
                Balance::Speed => "speed",
                Balance::Fixed(_) => "fixed",
            },
            "shares": shares,
            "speeds": balancer.speeds(),
        });
        writeln!(o, "{summary}")?;
        o.flush()?;
    }
    if leader {
        eprintln!(
            "wiretrain: {steps_done} steps, loss {:.4} -> {:.4}, {samples_per_s:.1} samples/s",
            first_loss.unwrap_or(0.0),
            final_loss.unwrap_or(0.0),
        );
        if let (Some(p), Some(full)) = (&sh.save, &full_params) {
            let bytes: Vec<u8> = full.iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(p, bytes).with_context(|| format!("--save-params {}", p.display()))?;
        }
        if let Some(p) = &run.plot {
            let title = format!(
                "{} {} world {world}, global batch {}",
                run.example,
                run.strategy_name(),
                run.global_batch
            );
            plot_run(p, &title, &points)?;
            eprintln!("wiretrain: plot written to {}", p.display());
        }
    }
    Ok(stopped)
}

/// `WIRETRAIN_TEST_SLOW_STEP=node:step:ms` makes every rank of node `node` spend `ms` more on
/// step `step`: the fault test of a slow (not dead) node. Unset in normal runs.
fn slow_step_hook(node: usize, step: usize) -> Option<u64> {
    let v = std::env::var("WIRETRAIN_TEST_SLOW_STEP").ok()?;
    let mut it = v.split(':').map(|x| x.parse::<u64>().ok());
    let (n, s, ms) = (it.next()??, it.next()??, it.next()??);
    (n == node as u64 && s == step as u64).then_some(ms)
}

/// `WIRETRAIN_DEBUG_SLOWDOWN=rank:factor` makes rank `rank` compute `factor` times slower
/// (before each step's collectives it sleeps `factor - 1` times its last per-sample compute
/// time per sample of the step, and counts it as compute): a stand-in for a slower card when
/// trying `--balance speed`. Unset in normal runs.
fn slowdown_hook(rank: usize) -> Option<f64> {
    let v = std::env::var("WIRETRAIN_DEBUG_SLOWDOWN").ok()?;
    let (r, f) = v.split_once(':')?;
    let f: f64 = f.parse().ok()?;
    (r.parse::<usize>().ok()? == rank && f.is_finite() && f >= 1.0).then_some(f)
}

/// `WIRETRAIN_TEST_SLOW_RANK=rank:ms` makes rank `rank` spend `ms` more in every step: the
/// straggler of the trace report's test. Unset in normal runs.
fn slow_rank_hook(rank: usize) -> Option<u64> {
    let v = std::env::var("WIRETRAIN_TEST_SLOW_RANK").ok()?;
    let (r, ms) = v.split_once(':')?;
    (r.parse::<usize>().ok()? == rank).then(|| ms.parse().ok())?
}

/// Every rank's [params, grads, optim, peak RSS of its process during the steps] bytes, in rank
/// order (each sent as three exact 16-bit pieces in f32).
fn gather_memory(
    pg: &mut wiretrain_comm::ProcessGroup,
    mine: [u64; 4],
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
            "model_state_bytes": dec(&v[0..3]) + dec(&v[3..6]) + dec(&v[6..9]),
            "peak_rss_bytes": dec(&v[9..12]),
        }));
    }
    Ok(out)
}
