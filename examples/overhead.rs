//! Step-time overhead of wiretrain at world size 1 against plain Burn training of the same
//! model on the same device, measured in one process with the two loops interleaved step by
//! step (so machine noise hits both alike). Reports medians and their ratio.
//!
//! Plain Burn: forward, backward, `ModuleOptimizer::step` (AdamW), read the loss, sync.
//! wiretrain: `Trainer::step` with DDP at world size 1 (one rank, one node).
//!
//! `cargo run --release --example overhead -- [EXAMPLE] [DEVICE] [STEPS] [BATCH] [FLAGS]`
//! (defaults: char-lm cpu 40 32; EXAMPLE: mlp, char-lm; DEVICE: auto, wgpu, wgpu:cpu, cpu).
//! Flags: `--d-model N --layers N` size char-lm (feed-forward 4x wider; `--d-model 256
//! --layers 4` is 3.2M parameters, `--d-model 512 --layers 8` 25M); `--host-path` runs
//! wiretrain's DDP on the host path instead of device-resident (for old-against-new figures).

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use std::time::Instant;
use wiretrain::comm::{Node, NodeConfig};
use wiretrain::data::DistributedSampler;
use wiretrain::models::Example;
use wiretrain::models::char_lm::{CharLm, CharLmConfig, Corpus};
use wiretrain::models::mlp::{Dataset, Mlp};
use wiretrain::{Strategy, Trainer, TrainerConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Removes `--name VALUE` from `args`, parsing the value.
fn take_flag(args: &mut Vec<String>, name: &str) -> Res<Option<usize>> {
    let Some(i) = args.iter().position(|a| a == name) else {
        return Ok(None);
    };
    let v = args
        .get(i + 1)
        .ok_or(format!("{name} needs a value"))?
        .parse()?;
    args.drain(i..i + 2);
    Ok(Some(v))
}

fn main() -> Res<()> {
    let mut all: Vec<String> = std::env::args().skip(1).collect();
    let d_model = take_flag(&mut all, "--d-model")?;
    let layers = take_flag(&mut all, "--layers")?;
    let host_path = all.iter().any(|a| a == "--host-path");
    all.retain(|a| a != "--host-path");
    let mut args = all.into_iter();
    let example: Example = args.next().unwrap_or_else(|| "char-lm".into()).parse()?;
    let spec = args.next().unwrap_or_else(|| "cpu".into()).parse()?;
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(40);
    let batch: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let rd = wiretrain::device::select(spec)?;
    let device = rd.device.clone().autodiff();
    let mut node = Node::join(NodeConfig::single_node(
        1,
        wiretrain::comm::tls::Token::generate(),
    ))?;
    let pg = node.take_groups().pop().ok_or("no process group")?;
    let lr = example.default_lr();
    let cfg = TrainerConfig::builder(Strategy::Ddp)
        .lr(lr)
        .device_resident(!host_path)
        .build()?;
    let (plain, ours, params) = match example {
        Example::Mlp => {
            let data = Dataset::synthetic(4096, 1);
            let sampler = DistributedSampler::new(data.len(), batch, 1, 0, 1)?;
            let trainer = Trainer::new(Mlp::new(&device, 1), &device, cfg, pg)?;
            let loss = |m: &Mlp, idx: &[usize]| m.loss(&data, idx, &device);
            measure(
                Mlp::new(&device, 1),
                trainer,
                sampler,
                (steps, lr, &device),
                loss,
            )?
        }
        Example::CharLm => {
            let corpus = Corpus::shipped(64);
            let sampler = DistributedSampler::new(corpus.len(), batch, 1, 0, 1)?;
            let mut mc = CharLmConfig::new(corpus.vocab_size());
            if let Some(d) = d_model {
                mc = mc.with_d_model(d).with_d_ff(4 * d);
            }
            if let Some(l) = layers {
                mc = mc.with_n_layers(l);
            }
            let trainer = Trainer::new(mc.init(&device, 1), &device, cfg, pg)?;
            let loss = |m: &CharLm, idx: &[usize]| m.loss(&corpus, idx, &device);
            measure(
                mc.init(&device, 1),
                trainer,
                sampler,
                (steps, lr, &device),
                loss,
            )?
        }
    };
    node.shutdown()?;
    let (p, o) = (median(plain), median(ours));
    let path = if host_path {
        "host path"
    } else {
        "device-resident"
    };
    println!(
        "# {example} ({params} parameters) on {}; batch {batch}; {steps} steps each, \
         interleaved; wiretrain {path}",
        rd.description
    );
    println!("{:>12} {:>12} {:>8}", "burn_ms", "wiretrain_ms", "ratio");
    println!("{p:>12.3} {o:>12.3} {:>8.3}", o / p);
    println!(
        "{}",
        serde_json::json!({"example": example.to_string(), "device": rd.description,
            "params": params, "path": path, "batch": batch, "steps": steps, "burn_ms": p,
            "wiretrain_ms": o, "ratio": o / p})
    );
    Ok(())
}

/// Runs `steps` steps of plain Burn training of `model` and of `trainer`, alternating, after
/// 3 warm-up steps of each; returns the step times in ms (plain, wiretrain) and the
/// parameter count. Both loops see
/// the same batches and must agree on the loss to 1e-4 relative, so they do the same work.
fn measure<M: Module>(
    mut model: M,
    mut trainer: Trainer<M>,
    mut sampler: DistributedSampler,
    (steps, lr, device): (usize, f64, &Device),
    loss_fn: impl Fn(&M, &[usize]) -> Tensor<1>,
) -> Res<(Vec<f64>, Vec<f64>, usize)> {
    let params = trainer.layout().total();
    // The same AdamW settings as wiretrain's default OptimConfig.
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init();
    let (mut plain, mut ours) = (Vec::new(), Vec::new());
    for s in 0..steps + 3 {
        let idx = sampler.indices(s);
        let t = Instant::now();
        let loss = loss_fn(&model, &idx);
        let lp = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        device.sync()?;
        let tp = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let lo = trainer.step(|m| loss_fn(m, &idx))?.loss;
        let to = t.elapsed().as_secs_f64() * 1e3;
        if ((lp - lo) / lp).abs() > 1e-4 {
            return Err(format!("step {s}: plain Burn loss {lp} vs wiretrain {lo}").into());
        }
        if s >= 3 {
            plain.push(tp);
            ours.push(to);
        }
    }
    Ok((plain, ours, params))
}
