//! Burn's `Learner`, distributed by wiretrain: a small classifier of three interleaved spirals
//! (model, data and batcher defined here; nothing is downloaded), trained with
//! `SupervisedTraining` on every rank, whose only change from single-device training is the
//! training strategy.
//!
//! ```sh
//! cargo build --example learner
//! cargo run -- launch --local 2 --ranks-per-node 2 -- target/debug/examples/learner --strategy zero2 --out run-learner
//! ```
//!
//! Flags: `--strategy ddp|zero1|zero2|hybrid|zero3|hsdp` (zero3/hsdp run the model's units;
//! `--whole` trains it as a whole module, which they refuse), `--epochs N` (3), `--batch B` per
//! rank (16), `--out DIR` (Burn's logs of rank 0: `DIR/train/epoch-N/Loss.log`),
//! `--checkpoints` (Burn's checkpointer on rank 0), `--sharded DIR` (wiretrain's sharded
//! checkpoint every epoch, the newest `--keep K` (2) kept; `--resume` continues from it, on any
//! world size), `--device SPEC`, and `--reference W`: one process, Burn's own single-device training on the global batches of
//! a W-rank run (batch W·B), for comparing losses step by step. In an elastic launch
//! (`launch --local N --nnodes MIN:N --max-restarts R`) a lost node's survivors heal in place
//! (tests/learner.rs: under ddp); zero1/2/3 restart from `--sharded DIR --resume`.

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::metric::LossMetric;
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use std::path::PathBuf;
use std::sync::Arc;
use wiretrain::learner::{UnitLoss, UnitsStep, WiretrainStrategy, renderer_for};
use wiretrain::optim::OptimConfig;
use wiretrain::units::{Act, Units};
use wiretrain::{JobOptions, RankContext, TrainerConfig};

#[derive(Module, Debug)]
struct Net {
    l1: Linear,
    act: Relu,
    l2: Linear,
    out: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        let linear = |inputs, outputs| LinearConfig::new(inputs, outputs).init(device);
        let net = Self {
            l1: linear(2, 64),
            act: Relu::new(),
            l2: linear(64, 64),
            out: linear(64, 3),
        };
        // The same start on every rank and in the reference run.
        wiretrain::flat::init_deterministic(net, 7)
    }

    /// Layer `unit` (ReLU after the hidden ones): the forward pass runs them in order, and
    /// ZeRO-3 and HSDP one unit at a time.
    fn layer(&self, unit: usize, x: Tensor<2>) -> Tensor<2> {
        match unit {
            0 => self.act.forward(self.l1.forward(x)),
            1 => self.act.forward(self.l2.forward(x)),
            _ => self.out.forward(x),
        }
    }

    fn classify(&self, b: Batch) -> ClassificationOutput {
        let logits = (0..LAYERS.len()).fold(b.x, |h, unit| self.layer(unit, h));
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), b.y.clone());
        ClassificationOutput::new(loss, logits, b.y)
    }
}

impl TrainStep for Net {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

/// ZeRO-3 and HSDP run the model unit by unit: the three layers, by field name.
const LAYERS: [&str; 3] = ["l1", "l2", "out"];

impl Units for Net {
    fn num_units(&self) -> usize {
        LAYERS.len()
    }
    fn unit_of(&self, path: &str) -> usize {
        let field = path.split('.').next();
        LAYERS
            .iter()
            .position(|&l| field == Some(l))
            .unwrap_or(LAYERS.len() - 1)
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let Act::F2(x) = x else {
            unreachable!("every unit of Net takes a [batch, features] tensor")
        };
        Act::F2(self.layer(unit, x))
    }
}

impl UnitsStep for Net {
    fn unit_batch(&self, b: Batch) -> (Act, UnitLoss<Self>) {
        let y = b.y;
        let last: UnitLoss<Self> = Box::new(move |logits| {
            let Act::F2(logits) = logits else {
                unreachable!("the last unit returns logits")
            };
            let loss = CrossEntropyLossConfig::new()
                .init(&logits.device())
                .forward(logits.clone(), y.clone());
            (loss.clone(), ClassificationOutput::new(loss, logits, y))
        });
        (Act::F2(b.x), last)
    }
}

impl InferenceStep for Net {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> ClassificationOutput {
        self.classify(b)
    }
}

/// A point of spiral arm `label`.
#[derive(Clone, Debug)]
struct Sample {
    x: [f32; 2],
    label: i64,
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

#[derive(Clone)]
struct Spirals;

impl Batcher<Sample, Batch> for Spirals {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|s| s.x).collect();
        let y: Vec<i64> = items.iter().map(|s| s.label).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, 2]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

/// `n` points on three spiral arms, shuffled by a fixed permutation, with a little noise.
fn spirals(n: usize, salt: u64) -> Vec<Sample> {
    let mut s = 0x9e37_79b9_7f4a_7c15_u64 ^ salt;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|i| {
            let label = (i % 3) as i64;
            let r = next();
            let t = r * 4.0 + label as f32 * 2.094 + 0.2 * (next() - 0.5);
            Sample {
                x: [r * t.cos(), r * t.sin()],
                label,
            }
        })
        .collect()
}

/// The reference order: global batch i of a `world`-rank run (rank r holds items
/// [r·n/world, (r+1)·n/world), batch `b`) as one batch of `world·b`.
fn as_global_batches(items: Vec<Sample>, world: usize, b: usize) -> Vec<Sample> {
    let per = items.len() / world;
    let batches = per.div_ceil(b);
    let mut out = Vec::with_capacity(per * world);
    for i in 0..batches {
        for r in 0..world {
            let lo = r * per + i * b;
            out.extend_from_slice(&items[lo..(lo + b).min(r * per + per)]);
        }
    }
    out
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

const LR: f64 = 5e-3;
const TRAIN: usize = 1536;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match real_main(&args) {
        Ok(()) => {}
        Err((code, e)) => {
            eprintln!("learner: error: {e}");
            std::process::exit(code);
        }
    }
}

type Failure = (i32, String);

fn bad(e: impl std::fmt::Display) -> Failure {
    (2, e.to_string())
}

fn real_main(args: &[String]) -> Result<(), Failure> {
    let epochs: usize = flag(args, "--epochs")
        .map_or(Ok(3), |s| s.parse())
        .map_err(bad)?;
    let batch: usize = flag(args, "--batch")
        .map_or(Ok(16), |s| s.parse())
        .map_err(bad)?;
    let out = PathBuf::from(flag(args, "--out").unwrap_or_else(|| "run-learner".into()));
    if let Some(w) = flag(args, "--reference") {
        let world: usize = w.parse().map_err(bad)?;
        return reference(&out, world, batch, epochs);
    }
    let mut job = JobOptions::from_env().map_err(bad)?;
    if let Some(d) = flag(args, "--device") {
        job.devices = wiretrain::device::parse_specs(&d).map_err(bad)?;
    }
    let (cfg, whole) = trainer_config(args)?;
    let setup = Setup {
        epochs,
        batch,
        out,
        cfg,
        whole,
        checkpoints: args.iter().any(|a| a == "--checkpoints"),
        keep: flag(args, "--keep")
            .map_or(Ok(2), |s| s.parse())
            .map_err(bad)?,
        sharded: flag(args, "--sharded")
            .map(|d| (PathBuf::from(d), args.iter().any(|a| a == "--resume"))),
    };
    let results = wiretrain::run(job, move |ctx| train_rank(ctx, &setup)).map_err(|e| match e {
        wiretrain::RunError::Device(_) | wiretrain::RunError::Job(_) => bad(e),
        other => (1, other.to_string()),
    })?;
    if results.iter().any(|i| *i) {
        eprintln!("learner: interrupted");
        std::process::exit(130);
    }
    Ok(())
}

/// What every rank of a distributed run trains with.
struct Setup {
    epochs: usize,
    batch: usize,
    out: PathBuf,
    cfg: TrainerConfig,
    /// As a whole module (any Burn module), or unit by unit (zero3, hsdp).
    whole: bool,
    /// Burn's checkpointer on rank 0.
    checkpoints: bool,
    /// Sharded checkpoints: (directory, resume from its newest).
    sharded: Option<(PathBuf, bool)>,
    /// Sharded checkpoints kept (`--keep`, 2).
    keep: usize,
}

/// The strategy and optimizer of `--strategy`, and whether the model trains as a whole.
fn trainer_config(args: &[String]) -> Result<(TrainerConfig, bool), Failure> {
    let strategy: wiretrain::Strategy = flag(args, "--strategy")
        .unwrap_or_else(|| "ddp".into())
        .parse()
        .map_err(bad)?;
    let cfg = TrainerConfig::builder(strategy)
        .optim(OptimConfig::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        })
        // The test suite's injected faults (read only when wiretrain is built with its
        // `test-hooks` feature; nothing otherwise).
        .faults(wiretrain::faults::Faults::from_env())
        .build()
        .map_err(|e| bad(format!("--strategy {strategy}: {e}")))?;
    // As a whole module (any Burn module), or unit by unit (zero3, hsdp). A strategy the
    // model cannot use is refused before the job starts.
    let whole = args.iter().any(|a| a == "--whole") || !cfg.strategy().shards_params();
    if whole {
        WiretrainStrategy::check(&cfg).map_err(|e| bad(format!("--strategy {strategy}: {e}")))?;
    }
    Ok((cfg, whole))
}

/// One rank's training with Burn's `SupervisedTraining`; whether it was interrupted.
fn train_rank(ctx: RankContext, setup: &Setup) -> Result<bool, String> {
    let rank = ctx.rank();
    let device = ctx.device();
    let train = DataLoaderBuilder::new(Spirals)
        .batch_size(setup.batch)
        .build(InMemDataset::new(spirals(TRAIN, 0)));
    let heal = ctx.heal.clone();
    let steps = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let strategy = strategy_for(
        ctx.pg,
        &device,
        setup,
        (ctx.stop.clone(), heal, steps.clone()),
    )?;
    // Rank 0 renders and logs; the others stay silent and write nothing.
    let dir = if rank == 0 {
        setup.out.clone()
    } else {
        std::env::temp_dir().join(format!("learner-rank{rank}-{}", std::process::id()))
    };
    let mut training = SupervisedTraining::new(&dir, train, valid())
        .num_epochs(setup.epochs)
        .metric_train_numeric(LossMetric::new())
        .with_application_logger(None)
        .renderer(renderer_for(rank))
        .with_training_strategy(strategy);
    if rank != 0 {
        training = training.with_metric_logger(burn_train::logger::InMemoryMetricLogger::new());
    } else if setup.checkpoints {
        training = training.with_default_checkpointers();
    }
    let res = training.launch(Learner::new(Net::new(&device), adamw(), LR));
    if rank != 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    match res.error {
        Some(e) => Err(e.to_string()),
        None if res.interrupted.is_some() => {
            // Each rank's own count, so that "every rank stopped after the same step" is
            // checked, not assumed.
            // One write of the whole line: the node processes share the launcher's stderr, and
            // a line written piecewise interleaves with another process's.
            let n = steps.load(std::sync::atomic::Ordering::Relaxed);
            let line = format!("learner: rank {rank} stopped after step {n}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Validation batches (the same on every rank).
fn valid() -> Arc<dyn burn::data::dataloader::DataLoader<Batch>> {
    DataLoaderBuilder::new(Spirals)
        .batch_size(64)
        .build(InMemDataset::new(spirals(384, 1)))
}

/// Burn's AdamW with the hyper-parameters wiretrain's optimizer is given.
fn adamw() -> burn::optim::ModuleOptimizer {
    AdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init()
}

/// The single-process reference: Burn's own loop on `world` ranks' batches, taken as one.
fn reference(
    out: &std::path::Path,
    world: usize,
    batch: usize,
    epochs: usize,
) -> Result<(), Failure> {
    let device = Device::flex().autodiff();
    let train = DataLoaderBuilder::new(Spirals)
        .batch_size(world * batch)
        .build(InMemDataset::new(as_global_batches(
            spirals(TRAIN, 0),
            world,
            batch,
        )));
    let res = SupervisedTraining::new(out, train, valid())
        .num_epochs(epochs)
        .metric_train_numeric(LossMetric::new())
        .with_application_logger(None)
        .launch(Learner::new(Net::new(&device), adamw(), LR));
    match res.error {
        Some(e) => Err((1, e.to_string())),
        None => Ok(()),
    }
}

/// Burn-train's strategy for this rank: wiretrain's, on the whole module or unit by unit,
/// with the job's stop flag, healing in an elastic launch that heals and, when asked, sharded
/// checkpoints.
fn strategy_for(
    pg: wiretrain::comm::ProcessGroup,
    device: &Device,
    setup: &Setup,
    (stop, heal, steps): (
        Arc<std::sync::atomic::AtomicBool>,
        Option<Arc<wiretrain::heal::Healer>>,
        Arc<std::sync::atomic::AtomicUsize>,
    ),
) -> Result<TrainingStrategy<Net>, String> {
    let (device, cfg) = (device.clone(), setup.cfg.clone());
    // The two kinds of strategy take the same settings.
    macro_rules! configured {
        ($strategy:expr) => {{
            let mut s = $strategy
                .map_err(|e| e.to_string())?
                .with_stop_flag(stop)
                .with_heal(heal)
                .with_step_counter(steps.clone());
            if let Some((d, resume)) = &setup.sharded {
                s = s.sharded_checkpoints(d, setup.keep, *resume);
            }
            Arc::new(s)
        }};
    }
    Ok(TrainingStrategy::Custom(if setup.whole {
        configured!(WiretrainStrategy::new(pg, device, cfg))
    } else {
        configured!(WiretrainStrategy::units(pg, device, cfg))
    }))
}
