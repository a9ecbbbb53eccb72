//! The training loop every wiretrain program shares: [`fit`] runs a [`Trainer`] for
//! [`FitOptions::steps`] steps and owns what makes a run usable: metrics JSONL (one line per
//! step, then a summary with every rank's device and memory), the progress bar, the PNG plot,
//! checkpoint-every/keep/resume, `--trace` files, speed-proportional batches (`--balance`),
//! the stop flag (every rank leaves after the same step) and `--save-params`. DiLoCo,
//! accumulation and the wire dtype live in the [`Trainer`] and its step function.
//! `wiretrain train` is a user of it like any other program.

use crate::balance::{Balance, SpeedBalancer};
use crate::data::DistributedSampler;
use crate::engine::{ConfigError, StepReport, TrainError, Trainer, TrainerConfig};
use crate::strategy::Strategy;
use burn::module::Module;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// Why the loop stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Comm(#[from] wiretrain_comm::Error),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("plot: {0}")]
    Plot(String),
}

impl From<crate::checkpoint::CheckpointError> for FitError {
    fn from(e: crate::checkpoint::CheckpointError) -> Self {
        Self::Train(TrainError::Checkpoint(e))
    }
}

fn io(context: String, source: std::io::Error) -> FitError {
    FitError::Io { context, source }
}

/// One step's point: what the run's plot draws.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlotPoint {
    pub step: usize,
    pub loss: f64,
    pub samples_per_s: f64,
}

/// Where and how often checkpoints are written.
#[derive(Debug, Clone)]
pub struct CheckpointPlan {
    pub dir: PathBuf,
    /// Every this many steps (one is also written after the last step and on a stop).
    pub every: Option<usize>,
    /// Valid checkpoints kept (older ones are removed).
    pub keep: usize,
    /// Start from the newest valid checkpoint in `dir` (resharded to this world size and
    /// strategy); step 0 when there is none.
    pub resume: bool,
    /// A fresh run (not `resume`) in a directory holding checkpoints of an earlier run moves
    /// them aside into `dir/previous-<time>/`; without it that is refused
    /// ([`crate::checkpoint::CheckpointError::InUse`]).
    pub overwrite: bool,
}

/// What the loop does besides stepping.
#[derive(Debug, Clone)]
pub struct FitOptions {
    pub steps: usize,
    /// Samples per step over all ranks (what samples/s counts).
    pub global_batch: usize,
    /// Micro-batches per step (recorded; the step function runs them).
    pub accumulate: usize,
    pub balance: Balance,
    /// One JSON line per step and a summary (rank 0 writes it).
    pub metrics: Option<PathBuf>,
    /// PNG of loss and throughput by step (rank 0).
    pub plot: Option<PathBuf>,
    /// Progress bar on rank 0's stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    pub checkpoint: Option<CheckpointPlan>,
    /// One Chrome trace file per rank into this directory.
    pub trace: Option<PathBuf>,
    /// Rank 0 writes the final flat parameters (little-endian f32) here.
    pub save_params: Option<PathBuf>,
    /// The run's description (a JSON object: example, seed, lr, ...): stored in checkpoints
    /// and added to the summary line.
    pub meta: serde_json::Value,
    /// What the plot's title calls the model.
    pub title: String,
    /// Raised to stop after the current step on every rank (e.g. [`crate::RankContext::stop`]).
    pub stop: Option<Arc<AtomicBool>>,
}

impl FitOptions {
    /// `steps` steps of `global_batch` samples, nothing written.
    pub fn new(steps: usize, global_batch: usize) -> Self {
        Self {
            steps,
            global_batch,
            accumulate: 1,
            balance: Balance::Equal,
            metrics: None,
            plot: None,
            progress: true,
            checkpoint: None,
            trace: None,
            save_params: None,
            meta: serde_json::json!({}),
            title: "model".into(),
            stop: None,
        }
    }
}

/// What [`fit`] hands back.
pub struct Fitted<M: Module> {
    pub trainer: Trainer<M>,
    /// The last step done, when the stop flag ended the run early.
    pub stopped_after: Option<usize>,
    pub steps_done: usize,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
}

/// Whether `micro` micro-batches per step work under `strategy` (a program can refuse the
/// setting before its job starts; [`fit`] checks it too).
pub fn check_accumulate(micro: usize, strategy: Strategy) -> Result<(), ConfigError> {
    if micro > 1 && strategy.shards_params() {
        return Err(ConfigError::AccumulateSharded { micro, strategy });
    }
    Ok(())
}

/// The strategy as a user names it (diloco runs on top of ddp or hybrid).
pub fn strategy_name(cfg: &TrainerConfig) -> String {
    if cfg.diloco().is_some() {
        "diloco".into()
    } else {
        cfg.strategy().to_string()
    }
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

/// Runs the training loop (see the module docs): `step_fn(trainer, indices)` runs one
/// optimizer step on this rank's sample indices of the global batch (e.g. `trainer.step(..)`,
/// `step_accumulate` or `step_units`). Every rank of the job calls it with the same options.
pub fn fit<M: Module>(
    mut trainer: Trainer<M>,
    mut sampler: DistributedSampler,
    run: &FitOptions,
    mut step_fn: impl FnMut(&mut Trainer<M>, &[usize]) -> Result<StepReport, TrainError>,
) -> Result<Fitted<M>, FitError> {
    let leader = trainer.process_group().rank() == 0;
    let strategy = trainer.config().strategy();
    check_accumulate(run.accumulate, strategy).map_err(|e| FitError::Train(e.into()))?;
    // Refused before step 0, so no run ends without the plot it asked for.
    #[cfg(not(feature = "plot"))]
    if run.plot.is_some() {
        return Err(FitError::Plot(
            "this wiretrain was built without its `plot` feature (on by default); enable it or \
             leave FitOptions::plot unset"
                .into(),
        ));
    }
    if let Some(s) = &run.stop {
        trainer.set_stop_flag(s.clone());
    }
    let mut out = match (&run.metrics, leader) {
        (Some(p), true) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| io(format!("--metrics {}", p.display()), e))?,
        )),
        _ => None,
    };
    // The peak memory reported is that of the training steps, not of start-up (where every
    // rank briefly holds the whole model, whatever the strategy).
    crate::rss::reset_peak_rss();
    crate::heap::reset_peak();
    let bar = progress_bar(run.steps, leader && run.progress);
    let t_start = Instant::now();
    let mut points: Vec<PlotPoint> = Vec::with_capacity(run.steps);
    let mut split: Vec<[f64; 6]> = Vec::with_capacity(run.steps);
    let mut comm_total = 0.0;
    let mut stopped = None;
    let micro = run.accumulate;
    let mut run_meta = run.meta.clone();
    if let Some(m) = run_meta.as_object_mut() {
        m.insert("global_batch".into(), run.global_batch.into());
        m.insert("accumulate".into(), micro.into());
    }
    let mut start = 0;
    if let Some(c) = run.checkpoint.as_ref().filter(|c| !c.resume) {
        trainer.claim_checkpoint_dir(&c.dir, c.overwrite)?;
    }
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
    if run.trace.is_some() {
        let off = crate::trace::estimate_offset(trainer.process_group())?;
        crate::trace::enable(rank, node, off);
        if let Some(d) = crate::run::devices_of(trainer.process_group().table()).get(rank) {
            crate::trace::set_device(d);
        }
        trainer.process_group().keep_history(true);
    }
    let faults = trainer.config().faults().clone();
    let slow_rank = faults.rank_delay(rank);
    let slowdown = faults.slowdown_of(rank);
    let mut per_sample_ms: Option<f64> = None;
    let world = trainer.process_group().world();
    let mut balancer = SpeedBalancer::new(run.global_batch);
    let mut shares: Option<Vec<usize>> = None;
    let mut t_iter = Instant::now();
    for step in start..run.steps {
        if let Some(extra) = faults.step_delay(node, step) {
            std::thread::sleep(extra);
        }
        let st = crate::trace::span(format!("step {step}"), "step");
        let sp = crate::trace::span("data", "data");
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
        if let Some(extra) = slow_rank {
            let _s = crate::trace::span("slowed compute (test hook)", "compute");
            std::thread::sleep(extra);
        }
        // The debug knob: this rank computes `f` times slower. The extra time is spent before
        // the step's collectives, like a slower device, scaled by this step's samples.
        let mut slept_ms = 0.0;
        if let (Some(f), Some(per)) = (slowdown, per_sample_ms) {
            slept_ms = (f - 1.0) * per * idx.len() as f64;
            let _s = crate::trace::span("slowed compute (debug knob)", "compute");
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
        if run.trace.is_some() {
            crate::trace::add_comm_track(trainer.process_group());
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
            writeln!(o, "{line}")
                .and_then(|()| o.flush())
                .map_err(|e| io("writing --metrics".into(), e))?;
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
            let d = trainer.save_checkpoint(&c.dir, done, run_meta.clone(), c.keep)?;
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
    if let Some(dir) = &run.trace {
        let world = trainer.process_group().world();
        if let Some(p) = crate::trace::finish(dir, world)
            .map_err(|e| io(format!("--trace {}", dir.display()), e))?
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
        crate::rss::peak_rss_bytes().unwrap_or(0),
        crate::heap::peak_bytes().unwrap_or(0) as u64,
    ];
    let per_rank = gather_memory(trainer.process_group(), mine)?;
    let full_params = match &run.save_params {
        Some(_) => Some(trainer.gather_params()?),
        None => None,
    };
    let first_loss = points.first().map(|p| p.loss);
    let final_loss = points.last().map(|p| p.loss);
    if let Some(mut o) = out.take() {
        let mut summary = serde_json::json!({
            "summary": true,
            "strategy": strategy_name(trainer.config()),
            "diloco": trainer.config().diloco(),
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
            "prefetch": trainer.config().prefetch(),
            "wire_dtype": trainer.config().wire().name(),
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
            "devices": crate::run::devices_of(trainer.process_group().table()),
        });
        // The caller's description of the run (example, seed, ...) completes the summary.
        if let (Some(s), Some(m)) = (summary.as_object_mut(), run.meta.as_object()) {
            for (k, v) in m {
                s.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        writeln!(o, "{summary}")
            .and_then(|()| o.flush())
            .map_err(|e| io("writing --metrics".into(), e))?;
    }
    if leader {
        eprintln!(
            "wiretrain: {steps_done} steps, loss {:.4} -> {:.4}, {samples_per_s:.1} samples/s",
            first_loss.unwrap_or(0.0),
            final_loss.unwrap_or(0.0),
        );
        if let (Some(p), Some(full)) = (&run.save_params, &full_params) {
            let bytes: Vec<u8> = full.iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(p, bytes)
                .map_err(|e| io(format!("--save-params {}", p.display()), e))?;
        }
        #[cfg(feature = "plot")]
        if let Some(p) = &run.plot {
            let title = format!(
                "{} {} world {world}, global batch {}",
                run.title,
                strategy_name(trainer.config()),
                run.global_batch
            );
            crate::plot::plot_run(p, &title, &points).map_err(|e| FitError::Plot(e.to_string()))?;
            eprintln!("wiretrain: plot written to {}", p.display());
        }
    }
    Ok(Fitted {
        trainer,
        stopped_after: stopped,
        steps_done,
        first_loss,
        final_loss,
    })
}

/// Every rank's [params, grads, optim, peak RSS of its process during the steps, peak live heap
/// bytes of its process during the steps (0: not counted)] bytes, in rank order.
fn gather_memory(
    pg: &mut wiretrain_comm::ProcessGroup,
    mine: [u64; 5],
) -> Result<Vec<serde_json::Value>, wiretrain_comm::Error> {
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = pg.all_gather_bytes(&bytes)?;
    Ok(all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let v: Vec<u64> = b
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            let at = |i: usize| v.get(i).copied().unwrap_or(0);
            serde_json::json!({
                "rank": r,
                "params_bytes": at(0),
                "grads_bytes": at(1),
                "optim_bytes": at(2),
                "model_state_bytes": at(0) + at(1) + at(2),
                "peak_rss_bytes": at(3),
                "peak_heap_bytes": Some(at(4)).filter(|&h| h > 0),
            })
        })
        .collect())
}
