//! Pipeline parallelism as a user runs it: the char-lm model (embeddings, transformer blocks,
//! norm and head as units) cut into stages, one per rank, through `wiretrain::run` and
//! [`wiretrain::pipeline::PipelineTrainer`]; each step splits the global batch into
//! micro-batches run by the GPipe or 1F1B schedule.
//!
//! `wiretrain launch --local 2 -- target/debug/examples/pipeline --stages 2 --microbatches 4`
//! (flags: `--schedule 1f1b|gpipe`, `--split 0..1,1..4`, `--layers N`, `--steps N`,
//! `--batch N`, `--lr X`, `--metrics FILE` (one JSON line per step, then the summary),
//! `--params-out FILE` (the final parameters, JSON)).
//!
//! `--reference`: the same model and global batches trained by plain Burn (its AdamW on the
//! whole batch) in this one process, writing the same files: the losses and parameters a
//! pipeline must reproduce.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use std::ops::Range;
use wiretrain::JobOptions;
use wiretrain::data::DistributedSampler;
use wiretrain::flat::FlatLayout;
use wiretrain::models::char_lm::{CharLm, CharLmConfig, Corpus};
use wiretrain::optim::OptimConfig;
use wiretrain::pipeline::{PipelineConfig, PipelineTrainer};

#[global_allocator]
static ALLOC: wiretrain::heap::CountingAlloc = wiretrain::heap::CountingAlloc;

const SEQ: usize = 32;
const SEED: u64 = 7;

/// The value of the last `name` flag (a later flag overrides an earlier one).
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .rposition(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T, String> {
    match flag(args, name) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| format!("{name} {v:?} is not a valid number")),
    }
}

/// `0..1,1..4` as unit ranges.
fn split(s: &str) -> Result<Vec<Range<usize>>, String> {
    s.split(',')
        .map(|r| {
            let (a, b) = r
                .split_once("..")
                .ok_or_else(|| format!("--split {r:?} is not START..END"))?;
            let n = |x: &str| {
                x.parse::<usize>()
                    .map_err(|_| format!("--split {r:?}: {x:?}"))
            };
            Ok(n(a)?..n(b)?)
        })
        .collect()
}

/// One step's record: the loss; in a pipeline run, stage 0's process's peak of live heap
/// bytes above the step's start and the micro-batches it held at once.
struct Step {
    loss: f32,
    heap: Option<usize>,
    in_flight: usize,
}

struct Run {
    steps: usize,
    batch: usize,
    micro: usize,
    lr: f64,
    layers: usize,
    metrics: Option<String>,
    params_out: Option<String>,
}

fn model(corpus: &Corpus, layers: usize, device: &Device) -> CharLm {
    CharLmConfig::new(corpus.vocab_size())
        .with_seq(SEQ)
        .with_n_layers(layers)
        .init(device, SEED)
}

/// The indices of micro-batch `i` of `m` in the global batch `idx`.
fn micro(idx: &[usize], i: usize, m: usize) -> &[usize] {
    let n = idx.len();
    &idx[i * n / m..(i + 1) * n / m]
}

/// Writes the per-step losses (`--metrics`) and the final parameters by path
/// (`--params-out`: `{"path": [values...], ...}`).
fn write_outputs(
    run: &Run,
    steps: &[Step],
    layout: &FlatLayout,
    params: &[f32],
) -> Result<(), String> {
    if let Some(p) = &run.metrics {
        let mut lines: String = steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut v = serde_json::json!({ "step": i, "loss": f64::from(s.loss) });
                if let Some(h) = s.heap {
                    v["peak_heap_bytes"] = h.into();
                    v["peak_in_flight"] = s.in_flight.into();
                }
                format!("{v}\n")
            })
            .collect();
        lines.push_str(&format!("{{\"summary\":true,\"steps\":{}}}\n", steps.len()));
        std::fs::write(p, lines).map_err(|e| format!("--metrics {p}: {e}"))?;
    }
    if let Some(p) = &run.params_out {
        let by_path: serde_json::Map<String, serde_json::Value> = layout
            .entries()
            .iter()
            .map(|e| (e.path.clone(), params[e.offset..e.offset + e.len].into()))
            .collect();
        let text = serde_json::to_string(&by_path).map_err(|e| e.to_string())?;
        std::fs::write(p, text).map_err(|e| format!("--params-out {p}: {e}"))?;
    }
    Ok(())
}

/// Plain Burn, one process, the whole global batch each step.
fn reference(run: &Run, corpus: &Corpus) -> Result<(), String> {
    let device = Device::flex().autodiff();
    let mut m = model(corpus, run.layers, &device);
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init();
    let mut sampler =
        DistributedSampler::new(corpus.len(), run.batch, 1, 0, 5).map_err(|e| e.to_string())?;
    let mut losses = Vec::new();
    for step in 0..run.steps {
        let idx = sampler.indices(step);
        // The mean over the micro-batches' means, as the pipeline's loss is.
        let loss = (0..run.micro)
            .map(|i| m.loss(corpus, micro(&idx, i, run.micro), &device))
            .reduce(|a, b| a + b)
            .expect("a micro-batch")
            / run.micro as f32;
        let value = loss
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .map_err(|e| format!("{e:?}"))?[0];
        println!("step {step:3}  loss {value:.5}");
        losses.push(Step {
            loss: value,
            heap: None,
            in_flight: run.micro,
        });
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        m = optim.step(run.lr, m, grads);
    }
    let layout = FlatLayout::of(&m);
    write_outputs(run, &losses, &layout, &layout.flatten_params(&m))
}

/// One stage per rank of the job (from `wiretrain launch`, torchrun or Slurm variables).
fn train(run: Run, cfg: PipelineConfig, corpus: Corpus) -> Result<(), String> {
    let job = JobOptions::from_env().map_err(|e| e.to_string())?;
    let outs = wiretrain::run(job, move |ctx| {
        let device = ctx.device();
        let m = model(&corpus, run.layers, &device);
        let mut t = PipelineTrainer::new(m, &device, cfg.clone(), ctx.pg)?;
        let (replica, replicas) = (t.replica(), t.replicas());
        if !run.batch.is_multiple_of(replicas * run.micro) {
            return Err(format!(
                "--batch {} must be a multiple of {replicas} replicas x {} micro-batches",
                run.batch, run.micro
            )
            .into());
        }
        if t.stage() == 0 && replica == 0 {
            let p = t.placement().describe();
            eprintln!("pipeline: {} stages x {replicas} replicas: {p}", cfg.stages);
        }
        let mut sampler = DistributedSampler::new(corpus.len(), run.batch, 1, 0, 5)?;
        let mut losses = Vec::new();
        for step in 0..run.steps {
            let all = sampler.indices(step);
            // This replica's share of the global batch, cut into the micro-batches.
            let n = all.len();
            let idx = &all[replica * n / replicas..(replica + 1) * n / replicas];
            let (c, d) = (&corpus, &device);
            wiretrain::heap::reset_peak();
            let live = wiretrain::heap::live_bytes();
            let rep = t.step(
                |i| CharLm::unit_io(c, micro(idx, i, run.micro), d).0,
                |i, out| (CharLm::unit_io(c, micro(idx, i, run.micro), d).1)(out),
            )?;
            if t.stage() == 0 && replica == 0 {
                println!(
                    "step {step:3}  loss {:.5}  step {:.1} ms  stage 0 busy {:.1} ms",
                    rep.loss, rep.step_ms, rep.busy_ms
                );
            }
            let heap = wiretrain::heap::peak_bytes()
                .zip(live)
                .map(|(p, l)| p.saturating_sub(l));
            losses.push(Step {
                loss: rep.loss,
                heap,
                in_flight: rep.peak_in_flight,
            });
        }
        let params = t.gather_params()?;
        if t.stage() == 0 && replica == 0 {
            write_outputs(&run, &losses, &FlatLayout::of(t.model()), &params)?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    outs.map(|_| ()).map_err(|e| e.to_string())
}

fn main() {
    ALLOC.mark_installed();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = main_with(&args) {
        eprintln!("pipeline: error: {e}");
        std::process::exit(2);
    }
}

fn main_with(args: &[String]) -> Result<(), String> {
    let corpus = Corpus::shipped(SEQ);
    let run = Run {
        steps: num(args, "--steps", 8)?,
        batch: num(args, "--batch", 16)?,
        micro: num(args, "--microbatches", 4)?,
        lr: num(args, "--lr", 3e-3)?,
        layers: num(args, "--layers", 2)?,
        metrics: flag(args, "--metrics"),
        params_out: flag(args, "--params-out"),
    };
    if run.micro == 0 || !run.batch.is_multiple_of(run.micro) {
        return Err(format!(
            "--batch {} must be a multiple of --microbatches {} (equal micro-batches)",
            run.batch, run.micro
        ));
    }
    if args.iter().any(|a| a == "--reference") {
        return reference(&run, &corpus);
    }
    let cfg = PipelineConfig {
        stages: num(args, "--stages", 2)?,
        micro_batches: run.micro,
        schedule: flag(args, "--schedule")
            .unwrap_or_else(|| "1f1b".into())
            .parse()?,
        split: flag(args, "--split").map(|s| split(&s)).transpose()?,
        optim: OptimConfig::default(),
        lr: run.lr,
    };
    train(run, cfg, corpus)
}
