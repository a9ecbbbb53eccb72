//! Your own model through `wiretrain::run` and the library loop (`wiretrain::fit`): a small
//! regression MLP and its data, both defined in this file, trained data-parallel on every
//! rank of the job with metrics, checkpoints and Ctrl-C handled by the library.
//!
//! One machine, 2 nodes x 2 ranks over QUIC on loopback:
//!
//! ```sh
//! cargo build --example run-loop
//! cargo run -- launch --local 2 --ranks-per-node 2 -- target/debug/examples/run-loop --strategy zero2
//! ```
//!
//! Flags: `--steps N` (default 60), `--strategy ddp|zero1|zero2|hybrid`, `--metrics PATH`,
//! `--checkpoint-dir DIR` (with `--resume`), `--device SPEC` (as `wiretrain train`), and
//! `--panic-at RANK:STEP` to watch a rank fail the whole job at once.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor, TensorData};
use std::sync::Arc;
use wiretrain::data::DistributedSampler;
use wiretrain::fit::{CheckpointPlan, FitOptions, fit};
use wiretrain::{JobOptions, Strategy, Trainer, TrainerConfig};

/// The model: 8 inputs, 32 hidden, 1 output.
#[derive(Module, Debug)]
struct Regressor {
    l1: Linear,
    act: Relu,
    l2: Linear,
}

impl Regressor {
    fn new(device: &Device) -> Self {
        let m = Self {
            l1: LinearConfig::new(8, 32).init(device),
            act: Relu::new(),
            l2: LinearConfig::new(32, 1).init(device),
        };
        // Seeded values: the same start whatever the world size (wiretrain also starts every
        // rank from rank 0's parameters).
        wiretrain::flat::init_deterministic(m, 3)
    }

    /// Mean squared error on the samples `idx`.
    fn loss(&self, data: &Data, idx: &[usize], device: &Device) -> Tensor<1> {
        let (x, y) = data.batch(idx, device);
        let out = self.l2.forward(self.act.forward(self.l1.forward(x)));
        (out - y).powi_scalar(2).mean()
    }
}

/// y = sin(sum of x) + 0.5 x0, on deterministic inputs (the same on every rank).
struct Data {
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Data {
    fn new(n: usize) -> Self {
        let mut s = 0x2545_f491_u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let x: Vec<f32> = (0..n * 8).map(|_| next()).collect();
        let y = x
            .chunks(8)
            .map(|r| r.iter().sum::<f32>().sin() + 0.5 * r[0])
            .collect();
        Self { x, y }
    }
    fn len(&self) -> usize {
        self.y.len()
    }
    fn batch(&self, idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<2>) {
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| self.x[i * 8..i * 8 + 8].iter().copied())
            .collect();
        let y: Vec<f32> = idx.iter().map(|&i| self.y[i]).collect();
        (
            Tensor::from_data(TensorData::new(x, [idx.len(), 8]), device),
            Tensor::from_data(TensorData::new(y, [idx.len(), 1]), device),
        )
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("run-loop: error: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: usize = flag(&args, "--steps").map_or(Ok(60), |s| s.parse())?;
    let strategy: Strategy = flag(&args, "--strategy")
        .unwrap_or_else(|| "ddp".into())
        .parse()?;
    let panic_at: Option<(usize, usize)> = flag(&args, "--panic-at").and_then(|s| {
        let (r, st) = s.split_once(':')?;
        Some((r.parse().ok()?, st.parse().ok()?))
    });
    // The job comes from `wiretrain launch` (or torchrun/Slurm variables); one rank alone
    // when started by hand.
    let mut job = JobOptions::from_env()?;
    if let Some(d) = flag(&args, "--device") {
        job.devices = wiretrain::device::parse_specs(&d)?;
    }
    let mut opts = FitOptions::new(steps, 64);
    opts.metrics = flag(&args, "--metrics").map(Into::into);
    opts.checkpoint = flag(&args, "--checkpoint-dir").map(|dir| CheckpointPlan {
        dir: dir.into(),
        every: Some(20),
        keep: 2,
        resume: args.iter().any(|a| a == "--resume"),
        overwrite: args.iter().any(|a| a == "--overwrite-checkpoints"),
    });
    opts.title = "run-loop regressor".into();
    opts.meta = serde_json::json!({ "example": "run-loop" });
    let data = Arc::new(Data::new(2048));
    let finals = wiretrain::run(job, move |ctx| {
        let device = ctx.device();
        let mut opts = opts.clone();
        opts.stop = Some(ctx.stop.clone());
        opts.heal = ctx.heal.clone();
        let (rank, world) = (ctx.rank(), ctx.world());
        let sampler = DistributedSampler::new(data.len(), opts.global_batch, world, rank, 7)?;
        let cfg = TrainerConfig::builder(strategy).lr(1e-2).build()?;
        let trainer = Trainer::new(Regressor::new(&device), &device, cfg, ctx.pg)?;
        let data = data.clone();
        let mut step = 0;
        let done = fit(trainer, sampler, &opts, |t, idx| {
            if panic_at == Some((rank, step)) {
                panic!("rank {rank} was told to panic at step {step}");
            }
            step += 1;
            t.step(|m| m.loss(&data, idx, &device))
        })?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(done.final_loss)
    })?;
    if let Some(Some(l)) = finals.first() {
        println!("final loss {l:.5}");
    }
    Ok(())
}
