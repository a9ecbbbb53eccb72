//! A small ResNet-style CNN with `BatchNorm` (a convolution stem, residual blocks of two
//! convolutions each, global average pooling, a linear head), trained through Burn's
//! `Learner` with wiretrain's training strategy, on 8x8 images this example draws (three
//! classes: horizontal stripes, vertical stripes, a bright square; nothing is downloaded).
//!
//! ```sh
//! cargo build --example resnet
//! cargo run -- launch --local 2 --ranks-per-node 2 -- target/debug/examples/resnet --strategy zero3 --out run-resnet
//! ```
//!
//! Flags: `--strategy ddp|zero1|zero2|hybrid|zero3|hsdp` (zero3/hsdp run the model's units),
//! `--epochs N` (2), `--batch B` per rank (8), `--out DIR` (Burn's logs of rank 0),
//! `--device SPEC`, and `--reference W`: one process, Burn's own single-device training on the
//! global batches of a W-rank run. Each rank normalizes its own batch, so the reference's
//! step normalizes each rank's share of the global batch apart (its loss is their mean).
//! Every rank prints its stem's BatchNorm running mean at the end (`resnet: rank R running
//! mean [..]`): under the default policy the ranks hold rank 0's.

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::metric::LossMetric;
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use wiretrain::learner::{UnitLoss, UnitsStep, WiretrainStrategy, renderer_for};
use wiretrain::optim::OptimConfig;
use wiretrain::units::{Act, UnitMap, Units};
use wiretrain::{JobOptions, RankContext, TrainerConfig};

const SIDE: usize = 8;
const CHANNELS: usize = 8;
const TRAIN: usize = 768;
const LR: f64 = 3e-3;

/// The ranks' shares a training step normalizes apart: 1 on a rank, W in the reference.
static SHARES: AtomicUsize = AtomicUsize::new(1);

/// A 3x3 convolution (same padding) and its BatchNorm.
#[derive(Module, Debug)]
struct ConvBn {
    conv: Conv2d,
    bn: BatchNorm,
}

impl ConvBn {
    fn new(cin: usize, device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([cin, CHANNELS], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            bn: BatchNormConfig::new(CHANNELS).init(device),
        }
    }
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.bn.forward(self.conv.forward(x))
    }
}

/// `relu(x + b(relu(a(x))))`.
#[derive(Module, Debug)]
struct Residual {
    a: ConvBn,
    b: ConvBn,
    act: Relu,
}

impl Residual {
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let h = self.b.forward(self.act.forward(self.a.forward(x.clone())));
        self.act.forward(x + h)
    }
}

#[derive(Module, Debug)]
struct ResNet {
    stem: ConvBn,
    act: Relu,
    blocks: Vec<Residual>,
    pool: AdaptiveAvgPool2d,
    head: Linear,
}

impl ResNet {
    fn new(device: &Device) -> Self {
        let block = || Residual {
            a: ConvBn::new(CHANNELS, device),
            b: ConvBn::new(CHANNELS, device),
            act: Relu::new(),
        };
        let net = Self {
            stem: ConvBn::new(1, device),
            act: Relu::new(),
            blocks: vec![block(), block()],
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(CHANNELS, 3).init(device),
        };
        // The same start on every rank and in the reference run.
        wiretrain::flat::init_deterministic(net, 5)
    }

    /// Unit `u`: the stem, each residual block, then pooling and the head.
    fn unit(&self, u: usize, x: Tensor<4>) -> Act {
        if u == 0 {
            Act::F4(self.act.forward(self.stem.forward(x)))
        } else if u <= self.blocks.len() {
            Act::F4(self.blocks[u - 1].forward(x))
        } else {
            let [b, c, _, _] = x.dims();
            Act::F2(self.head.forward(self.pool.forward(x).reshape([b, c])))
        }
    }

    fn logits(&self, x: Tensor<4>) -> Tensor<2> {
        let out = (0..self.num_units()).fold(Act::F4(x), |h, u| match h {
            Act::F4(h) => self.unit(u, h),
            other => other,
        });
        let Act::F2(logits) = out else {
            unreachable!("the last unit returns logits")
        };
        logits
    }

    /// The loss over `b`, each of [`SHARES`] shares normalized apart (their mean).
    fn classify(&self, b: Batch) -> ClassificationOutput {
        let shares = SHARES.load(Ordering::Relaxed).max(1);
        let n = b.x.dims()[0] / shares;
        let parts: Vec<Tensor<2>> = (0..shares)
            .map(|i| self.logits(b.x.clone().narrow(0, i * n, n)))
            .collect();
        let loss_fn = CrossEntropyLossConfig::new().init(&b.x.device());
        let losses: Vec<Tensor<1>> = parts
            .iter()
            .enumerate()
            .map(|(i, l)| loss_fn.forward(l.clone(), b.y.clone().narrow(0, i * n, n)))
            .collect();
        let loss = Tensor::cat(losses, 0).mean();
        ClassificationOutput::new(loss, Tensor::cat(parts, 0), b.y)
    }
}

impl TrainStep for ResNet {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for ResNet {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> ClassificationOutput {
        self.classify(b)
    }
}

/// ZeRO-3 and HSDP run the stem, each block and the head one at a time.
impl Units for ResNet {
    fn unit_map(&self) -> UnitMap {
        UnitMap::new()
            .unit(&["stem"])
            .each("blocks", self.blocks.len())
            .unit(&["head"])
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let Act::F4(x) = x else {
            unreachable!("every unit of the ResNet takes images [batch, channels, h, w]")
        };
        self.unit(unit, x)
    }
}

impl UnitsStep for ResNet {
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
        (Act::F4(b.x), last)
    }
}

#[derive(Clone, Debug)]
struct Image {
    pixels: Vec<f32>,
    label: i64,
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<4>,
    y: Tensor<1, Int>,
}

#[derive(Clone)]
struct Images;

impl Batcher<Image, Batch> for Images {
    fn batch(&self, items: Vec<Image>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|s| s.pixels.iter().copied())
            .collect();
        let y: Vec<i64> = items.iter().map(|s| s.label).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, 1, SIDE, SIDE]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

/// `n` images of the three classes in turn, with a random phase and noise.
fn images(n: usize, salt: u64) -> Vec<Image> {
    let mut s = 0x2545_f491_4f6c_dd1d_u64 ^ salt;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|i| {
            let label = (i % 3) as i64;
            let phase = (next() * 2.0) as usize;
            let pixels = (0..SIDE * SIDE)
                .map(|p| {
                    let (r, c) = (p / SIDE, p % SIDE);
                    let on = match label {
                        0 => (r + phase).is_multiple_of(2),
                        1 => (c + phase).is_multiple_of(2),
                        _ => (2..6).contains(&r) && (2..6).contains(&c),
                    };
                    f32::from(u8::from(on)) + 0.3 * (next() - 0.5)
                })
                .collect();
            Image { pixels, label }
        })
        .collect()
}

/// The reference order: global batch i of a `world`-rank run (rank r holds items
/// [r·n/world, (r+1)·n/world), batch `b`) as one batch of `world·b`, rank 0's share first.
fn as_global_batches(items: Vec<Image>, world: usize, b: usize) -> Vec<Image> {
    let per = items.len() / world;
    let mut out = Vec::with_capacity(per * world);
    for i in 0..per.div_ceil(b) {
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

fn num(args: &[String], name: &str, default: usize) -> Result<usize, String> {
    flag(args, name).map_or(Ok(default), |v| {
        v.parse().map_err(|_| format!("{name} {v}: not a count"))
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err((code, e)) = real_main(&args) {
        eprintln!("resnet: error: {e}");
        std::process::exit(code);
    }
}

type Failure = (i32, String);

fn bad(e: impl std::fmt::Display) -> Failure {
    (2, e.to_string())
}

fn real_main(args: &[String]) -> Result<(), Failure> {
    let epochs = num(args, "--epochs", 2).map_err(bad)?;
    let batch = num(args, "--batch", 8).map_err(bad)?;
    if batch == 0 || epochs == 0 {
        return Err(bad("--batch and --epochs must be at least 1"));
    }
    let out = PathBuf::from(flag(args, "--out").unwrap_or_else(|| "run-resnet".into()));
    if flag(args, "--reference").is_some() {
        let world = num(args, "--reference", 1).map_err(bad)?;
        return reference(&out, world, batch, epochs);
    }
    let mut job = JobOptions::from_env().map_err(bad)?;
    if let Some(d) = flag(args, "--device") {
        job.devices = wiretrain::device::parse_specs(&d).map_err(bad)?;
    }
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
        .build()
        .map_err(|e| bad(format!("--strategy {strategy}: {e}")))?;
    let setup = (epochs, batch, out, cfg);
    wiretrain::run(job, move |ctx| train_rank(ctx, &setup)).map_err(|e| match e {
        wiretrain::RunError::Device(_) | wiretrain::RunError::Job(_) => bad(e),
        other => (1, other.to_string()),
    })?;
    Ok(())
}

/// One rank's training with Burn's `SupervisedTraining` and wiretrain's strategy.
fn train_rank(
    ctx: RankContext,
    (epochs, batch, out, cfg): &(usize, usize, PathBuf, TrainerConfig),
) -> Result<(), String> {
    let rank = ctx.rank();
    let device = ctx.device();
    let train = DataLoaderBuilder::new(Images)
        .batch_size(*batch)
        .build(InMemDataset::new(images(TRAIN, 0)));
    let strategy: TrainingStrategy<ResNet> = if cfg.strategy().shards_params() {
        let s = WiretrainStrategy::units(ctx.pg, device.clone(), cfg.clone());
        TrainingStrategy::Custom(Arc::new(
            s.map_err(|e| e.to_string())?.with_stop_flag(ctx.stop),
        ))
    } else {
        let s = WiretrainStrategy::new(ctx.pg, device.clone(), cfg.clone());
        TrainingStrategy::Custom(Arc::new(
            s.map_err(|e| e.to_string())?.with_stop_flag(ctx.stop),
        ))
    };
    // Rank 0 renders and logs; the others stay silent and write nothing.
    let dir = if rank == 0 {
        out.clone()
    } else {
        std::env::temp_dir().join(format!("resnet-rank{rank}-{}", std::process::id()))
    };
    let mut training = SupervisedTraining::new(&dir, train, valid())
        .num_epochs(*epochs)
        .metric_train_numeric(LossMetric::new())
        .with_application_logger(None)
        .renderer(renderer_for(rank))
        .with_training_strategy(strategy);
    if rank != 0 {
        training = training.with_metric_logger(burn_train::logger::InMemoryMetricLogger::new());
    }
    let res = training.launch(Learner::new(ResNet::new(&device), adamw(), LR));
    if rank != 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    if let Some(e) = res.error {
        return Err(e.to_string());
    }
    let mean: Vec<f32> = res
        .model
        .stem
        .bn
        .running_mean
        .value()
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| format!("reading the running mean: {e:?}"))?;
    // One write of the whole line: the node processes share the launcher's stderr.
    let line = format!("resnet: rank {rank} running mean {mean:?}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    Ok(())
}

/// Validation batches (the same on every rank).
fn valid() -> Arc<dyn burn::data::dataloader::DataLoader<Batch>> {
    DataLoaderBuilder::new(Images)
        .batch_size(64)
        .build(InMemDataset::new(images(192, 1)))
}

/// Burn's AdamW with the hyper-parameters wiretrain's optimizer is given.
fn adamw() -> burn::optim::ModuleOptimizer {
    AdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init()
}

/// The single-process reference: Burn's own loop on `world` ranks' batches, taken as one,
/// each rank's share normalized apart.
fn reference(
    out: &std::path::Path,
    world: usize,
    batch: usize,
    epochs: usize,
) -> Result<(), Failure> {
    if world == 0 || batch == 0 || !TRAIN.is_multiple_of(world * batch) {
        return Err(bad(format!(
            "--reference {world} with --batch {batch}: the {TRAIN} images must split into whole \
             global batches"
        )));
    }
    SHARES.store(world, Ordering::Relaxed);
    let device = Device::flex().autodiff();
    let train = DataLoaderBuilder::new(Images)
        .batch_size(world * batch)
        .build(InMemDataset::new(as_global_batches(
            images(TRAIN, 0),
            world,
            batch,
        )));
    let res = SupervisedTraining::new(out, train, valid())
        .num_epochs(epochs)
        .metric_train_numeric(LossMetric::new())
        .with_application_logger(None)
        .launch(Learner::new(ResNet::new(&device), adamw(), LR));
    match res.error {
        Some(e) => Err((1, e.to_string())),
        None => Ok(()),
    }
}
