//! A GPT-2-style decoder written as a Burn user writes one (`burn::nn` only: token and
//! position embeddings, pre-norm blocks of `MultiHeadAttention` with a causal mask and a GELU
//! MLP, a final `LayerNorm`, a linear head), trained by `wiretrain::run` + `wiretrain::fit`
//! under any strategy, on the bytes of the text wiretrain ships.
//!
//! ```sh
//! cargo build --example gpt2
//! cargo run -- launch --local 2 --ranks-per-node 2 -- target/debug/examples/gpt2 --strategy zero3
//! ```
//!
//! Flags: `--preset tiny|small` (small: GPT-2 small's shapes, 12 layers of width 768, 12
//! heads, 1,024 positions, a 50,257-token vocabulary), then `--d-model`, `--layers`, `--heads`,
//! `--seq`, `--vocab` over it; `--strategy ddp|zero1|zero2|zero3|hybrid|hsdp|diloco`
//! (`--inner-steps H`), `--steps`, `--batch` (global), `--lr`, `--metrics PATH`, `--device`,
//! `--checkpoint-dir DIR` (`--resume`), `--params` (print the parameter count and exit), and
//! `--reference`: the same model and batches trained by plain Burn in this one process
//! (Burn's AdamW, no wiretrain), its losses written to `--metrics`, to compare with.
//!
//! GPT-2 ties its head to the token embedding; this model keeps them apart, so that ZeRO-3
//! can cut it into units (one parameter belongs to one unit). With the small preset that is
//! 163M parameters (124M without the head).

use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Gelu, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::sync::Arc;
use wiretrain::data::DistributedSampler;
use wiretrain::engine::Diloco;
use wiretrain::fit::{CheckpointPlan, FitOptions, fit};
use wiretrain::optim::OptimConfig;
use wiretrain::units::{Act, UnitMap, Units};
use wiretrain::{JobOptions, Strategy, Trainer, TrainerConfig};

/// Counts the heap, so that the summary carries each rank's `peak_heap_bytes`.
#[global_allocator]
static ALLOC: wiretrain::heap::CountingAlloc = wiretrain::heap::CountingAlloc;

/// The model's shapes.
#[derive(Debug, Clone, Copy)]
struct Shape {
    vocab: usize,
    seq: usize,
    d_model: usize,
    heads: usize,
    layers: usize,
}

/// One pre-norm block: `x + attn(ln1(x))`, then `x + proj(gelu(fc(ln2(x))))`.
#[derive(Module, Debug)]
struct Block {
    ln1: LayerNorm,
    attn: MultiHeadAttention,
    ln2: LayerNorm,
    fc: Linear,
    act: Gelu,
    proj: Linear,
}

#[derive(Module, Debug)]
struct Gpt {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
}

impl Block {
    fn new(s: &Shape, device: &Device) -> Self {
        let d = s.d_model;
        Self {
            ln1: LayerNormConfig::new(d).init(device),
            attn: MultiHeadAttentionConfig::new(d, s.heads)
                .with_dropout(0.0)
                .init(device),
            ln2: LayerNormConfig::new(d).init(device),
            fc: LinearConfig::new(d, 4 * d).init(device),
            act: Gelu::new(),
            proj: LinearConfig::new(4 * d, d).init(device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let mask = generate_autoregressive_mask(b, s, &x.device());
        let a = self
            .attn
            .forward(MhaInput::self_attn(self.ln1.forward(x.clone())).mask_attn(mask));
        let x = x + a.context;
        let m = self.proj.forward(
            self.act
                .forward(self.fc.forward(self.ln2.forward(x.clone()))),
        );
        x + m
    }
}

impl Gpt {
    /// Seeded parameters: every process builds the same model.
    fn new(s: &Shape, device: &Device) -> Self {
        let m = Self {
            tok: EmbeddingConfig::new(s.vocab, s.d_model).init(device),
            pos: EmbeddingConfig::new(s.seq, s.d_model).init(device),
            blocks: (0..s.layers).map(|_| Block::new(s, device)).collect(),
            ln_f: LayerNormConfig::new(s.d_model).init(device),
            head: LinearConfig::new(s.d_model, s.vocab)
                .with_bias(false)
                .init(device),
        };
        wiretrain::flat::init_deterministic(m, 11)
    }

    fn embed(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, s] = ids.dims();
        let pos = Tensor::<1, Int>::arange(0..s as i64, &ids.device())
            .reshape([1, s])
            .repeat_dim(0, b);
        self.tok.forward(ids) + self.pos.forward(pos)
    }

    /// Logits `[batch, seq, vocab]`.
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let h = self
            .blocks
            .iter()
            .fold(self.embed(ids), |h, b| b.forward(h));
        self.head.forward(self.ln_f.forward(h))
    }

    fn loss(&self, data: &Bytes, idx: &[usize], device: &Device) -> Tensor<1> {
        let (x, y) = data.batch(idx, device);
        next_token_loss(self.forward(x), y)
    }
}

/// The model as units, for ZeRO-3, HSDP and overlap: the embeddings, each block, then the
/// final norm with the head.
impl Units for Gpt {
    fn unit_map(&self) -> UnitMap {
        UnitMap::new()
            .unit(&["tok", "pos"])
            .each("blocks", self.blocks.len())
            .unit(&["ln_f", "head"])
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let n = self.blocks.len();
        match (unit, x) {
            (0, Act::I2(ids)) => Act::F3(self.embed(ids)),
            (u, Act::F3(h)) if (1..=n).contains(&u) => Act::F3(self.blocks[u - 1].forward(h)),
            (u, Act::F3(h)) if u == n + 1 => Act::F3(self.head.forward(self.ln_f.forward(h))),
            (u, x) => unreachable!("unit {u} cannot take {x:?}"),
        }
    }
}

fn next_token_loss(logits: Tensor<3>, y: Tensor<2, Int>) -> Tensor<1> {
    let [b, s, v] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([b * s, v]), y.reshape([b * s]))
}

/// The shipped text as bytes; sample `i` is the window of `seq` bytes at offset `i`, its
/// targets the window one byte on.
struct Bytes {
    text: Vec<u8>,
    seq: usize,
}

impl Bytes {
    fn len(&self) -> usize {
        self.text.len() - self.seq - 1
    }
    fn batch(&self, idx: &[usize], device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let take = |from: usize| -> Vec<i64> {
            idx.iter()
                .flat_map(|&i| {
                    self.text[i + from..i + from + self.seq]
                        .iter()
                        .map(|&b| b as i64)
                })
                .collect()
        };
        let shape = [idx.len(), self.seq];
        (
            Tensor::from_data(TensorData::new(take(0), shape), device),
            Tensor::from_data(TensorData::new(take(1), shape), device),
        )
    }
}

/// The optimizer, spelled out: the reference builds Burn's AdamW with the same values.
const BETAS: (f32, f32) = (0.9, 0.95);
const EPS: f32 = 1e-8;
const WEIGHT_DECAY: f32 = 0.1;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T, String> {
    match flag(args, name) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| format!("{name} {v}: not a number of the right kind")),
    }
}

/// The preset, then each shape flag over it.
fn shape(args: &[String]) -> Result<Shape, String> {
    let base = match flag(args, "--preset").as_deref() {
        None | Some("tiny") => (256, 32, 64, 4, 2),
        Some("small") => (50257, 1024, 768, 12, 12),
        Some(p) => return Err(format!("--preset {p}: not a preset (tiny, small)")),
    };
    let s = Shape {
        vocab: num(args, "--vocab", base.0)?,
        seq: num(args, "--seq", base.1)?,
        d_model: num(args, "--d-model", base.2)?,
        heads: num(args, "--heads", base.3)?,
        layers: num(args, "--layers", base.4)?,
    };
    if s.vocab < 256 {
        return Err(format!(
            "--vocab {}: the data are bytes, so at least 256",
            s.vocab
        ));
    }
    if s.heads == 0 || !s.d_model.is_multiple_of(s.heads) {
        return Err(format!(
            "--d-model {} is not a multiple of --heads {}",
            s.d_model, s.heads
        ));
    }
    if s.seq == 0 || s.layers == 0 {
        return Err("--seq and --layers must be at least 1".into());
    }
    Ok(s)
}

/// Exit 2: bad flags; exit 1: the run failed (a rank's error, e.g. a strategy refused under
/// the process's memory cap).
fn main() {
    ALLOC.mark_installed();
    match real_main() {
        Ok(()) => {}
        Err(e) => match e.downcast::<FailedRun>() {
            Ok(run) => {
                eprintln!("gpt2: error: {}", run.0);
                std::process::exit(1);
            }
            Err(e) => {
                eprintln!("gpt2: error: {e}");
                std::process::exit(2);
            }
        },
    }
}

/// A run that started and failed.
#[derive(Debug)]
struct FailedRun(String);

impl std::fmt::Display for FailedRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FailedRun {}

fn real_main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let s = shape(&args)?;
    let data = Arc::new(Bytes {
        text: wiretrain::models::char_lm::SHIPPED_TEXT.as_bytes().to_vec(),
        seq: s.seq,
    });
    if data.text.len() < s.seq + 2 {
        return Err(format!("--seq {}: longer than the text", s.seq).into());
    }
    let steps: usize = num(&args, "--steps", 30)?;
    let batch: usize = num(&args, "--batch", 8)?;
    let lr: f64 = num(&args, "--lr", 3e-3)?;
    if args.iter().any(|a| a == "--params") {
        let m = Gpt::new(&s, &Device::flex());
        println!("{} parameters", m.num_params());
        return Ok(());
    }
    if args.iter().any(|a| a == "--reference") {
        return reference(&s, &data, (steps, batch, lr), flag(&args, "--metrics"));
    }
    train(&args, s, data, (steps, batch, lr))
}

/// The strategy as named (`diloco`: DDP inside each node, DiLoCo between nodes).
fn trainer_config(args: &[String], lr: f64) -> Result<TrainerConfig, Box<dyn std::error::Error>> {
    let name = flag(args, "--strategy").unwrap_or_else(|| "ddp".into());
    let (strategy, diloco) = match name.as_str() {
        "diloco" => {
            let inner_steps = num(args, "--inner-steps", 10)?;
            (
                Strategy::Ddp,
                Some(Diloco {
                    inner_steps,
                    ..Diloco::default()
                }),
            )
        }
        other => (other.parse::<Strategy>()?, None),
    };
    let optim = OptimConfig::AdamW {
        beta1: BETAS.0,
        beta2: BETAS.1,
        eps: EPS,
        weight_decay: WEIGHT_DECAY,
    };
    Ok(TrainerConfig::builder(strategy)
        .lr(lr)
        .optim(optim)
        .diloco(diloco)
        .build()?)
}

/// Trains on every rank of the job (from `wiretrain launch`, torchrun or Slurm variables;
/// one rank alone when started by hand).
fn train(
    args: &[String],
    s: Shape,
    data: Arc<Bytes>,
    (steps, batch, lr): (usize, usize, f64),
) -> Result<(), Box<dyn std::error::Error>> {
    let mut job = JobOptions::from_env()?;
    if let Some(d) = flag(args, "--device") {
        job.devices = wiretrain::device::parse_specs(&d)?;
    }
    let cfg = trainer_config(args, lr)?;
    let mut opts = FitOptions::new(steps, batch);
    opts.metrics = flag(args, "--metrics").map(Into::into);
    opts.checkpoint = flag(args, "--checkpoint-dir").map(|dir| CheckpointPlan {
        dir: dir.into(),
        every: Some(10),
        keep: 2,
        resume: args.iter().any(|a| a == "--resume"),
        overwrite: false,
    });
    opts.title = "gpt2-style decoder".into();
    opts.meta = serde_json::json!({ "example": "gpt2", "d_model": s.d_model, "layers": s.layers });
    let finals = wiretrain::run(job, move |ctx| {
        let device = ctx.device();
        let mut opts = opts.clone();
        opts.stop = Some(ctx.stop.clone());
        opts.heal = ctx.heal.clone();
        let sampler = DistributedSampler::new(data.len(), batch, ctx.world(), ctx.rank(), 5)?;
        let trainer = Trainer::with_units(Gpt::new(&s, &device), &device, cfg.clone(), ctx.pg)?;
        // ZeRO-3 and HSDP step unit by unit, and so does overlap (on between nodes).
        let by_units = trainer.config().strategy().shards_params() || trainer.overlaps_units();
        let data = data.clone();
        let done = fit(trainer, sampler, &opts, |t, idx| {
            if by_units {
                let (x, y) = data.batch(idx, &device);
                t.step_units(Act::I2(x), move |out| match out {
                    Act::F3(logits) => next_token_loss(logits, y),
                    other => unreachable!("the last unit returns logits, not {other:?}"),
                })
            } else {
                t.step(|m| m.loss(&data, idx, &device))
            }
        })?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(done.final_loss)
    })
    .map_err(|e| match e {
        wiretrain::RunError::Rank { .. } => {
            Box::new(FailedRun(e.to_string())) as Box<dyn std::error::Error>
        }
        other => other.into(),
    })?;
    if let Some(Some(l)) = finals.first() {
        println!("final loss {l:.5}");
    }
    Ok(())
}

/// Plain Burn, one process, the whole global batch each step: the losses to compare with.
fn reference(
    s: &Shape,
    data: &Bytes,
    (steps, batch, lr): (usize, usize, f64),
    metrics: Option<String>,
) -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    let mut model = Gpt::new(s, &device);
    let mut optim = AdamWConfig::new()
        .with_beta_1(BETAS.0)
        .with_beta_2(BETAS.1)
        .with_epsilon(EPS)
        .with_weight_decay(WEIGHT_DECAY)
        .init();
    let mut sampler = DistributedSampler::new(data.len(), batch, 1, 0, 5)?;
    let mut lines = String::new();
    for step in 0..steps {
        let loss = model.loss(data, &sampler.indices(step), &device);
        let value = loss.clone().into_data().try_to_vec::<f32>()?[0];
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        lines.push_str(&format!(
            "{{\"step\":{step},\"loss\":{}}}\n",
            f64::from(value)
        ));
        println!("step {step:3}  loss {value:.5}");
    }
    if let Some(p) = metrics {
        std::fs::write(p, lines)?;
    }
    Ok(())
}
