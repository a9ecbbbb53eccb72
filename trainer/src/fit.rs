//! The training loop every wiretrain program shares: [`fit`] runs a [`Trainer`] for
//! [`FitOptions::steps`] steps and owns what makes a run usable: metrics JSONL (one line per
//! step, then a summary with every rank's device and memory), the progress bar, the PNG plot,
//! checkpoint-every/keep/resume, `--trace` files, speed-proportional batches (`--balance`),
//! the stop flag (every rank leaves after the same step) and `--save-params`. DiLoCo,
//! accumulation and the wire dtype live in the [`Trainer`] and its step function.
//! `wiretrain train` is a user of it like any other program.

use crate::balance::Balance;
use crate::checkpoint::DirLock;
use crate::data::DistributedSampler;
use crate::engine::{ConfigError, StepReport, TrainError, Trainer, TrainerConfig};
use crate::strategy::Strategy;
use burn::module::Module;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// Why the loop stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// The trainer failed: a step, a checkpoint, the configuration.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// A collective of the loop's own failed (the speed exchange, the trace's clock offset,
    /// the summary's memory gather).
    #[error(transparent)]
    Comm(#[from] wiretrain_comm::Error),
    /// Writing the metrics, the final parameters or the traces failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being written (the option and its path).
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Drawing the plot failed, or a plot was asked of a build without the `plot` feature.
    #[error("plot: {0}")]
    Plot(String),
    /// The job's environment is wrong (e.g. WIRETRAIN_RESTARTS is not JSON).
    #[error(transparent)]
    Job(#[from] crate::job::JobError),
    /// The job failed and this node could not heal from live replicas.
    #[error("{failure}; healing from live replicas failed: {source}")]
    Heal {
        /// The error that cut the step off, in words.
        failure: String,
        /// Why the heal failed.
        #[source]
        source: Box<crate::engine::RecoverError>,
    },
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
    /// The step index.
    pub step: usize,
    /// The step's loss.
    pub loss: f64,
    /// Samples per second over all ranks: the global batch over the step's time.
    pub samples_per_s: f64,
}

/// Where and how often checkpoints are written.
#[derive(Debug, Clone)]
pub struct CheckpointPlan {
    /// The checkpoint directory (step directories go inside it).
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
    /// The run's total steps: the loop ends after step `steps - 1`.
    pub steps: usize,
    /// Samples per step over all ranks (what samples/s counts).
    pub global_batch: usize,
    /// Micro-batches per step (recorded; the step function runs them).
    pub accumulate: usize,
    /// How the global batch is split between ranks (equal, by measured speed, or fixed).
    pub balance: Balance,
    /// One JSON line per step and a summary (rank 0 writes it).
    pub metrics: Option<PathBuf>,
    /// Add to --metrics instead of starting it afresh (an epoch after an elastic restart,
    /// `WIRETRAIN_EPOCH` > 0, always does: it continues the epochs before it, and its summary
    /// gets an `elastic` entry).
    pub append_metrics: bool,
    /// PNG of loss and throughput by step (rank 0).
    pub plot: Option<PathBuf>,
    /// Progress bar on rank 0's stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Checkpoints to write and resume from; none when `None`.
    pub checkpoint: Option<CheckpointPlan>,
    /// One Chrome trace file per rank into this directory.
    pub trace: Option<PathBuf>,
    /// Rank 0 writes the final flat parameters (little-endian f32) here.
    pub save_params: Option<PathBuf>,
    /// The run's description (a JSON object: example, seed, lr, ...): stored in checkpoints
    /// and added to the summary line.
    pub meta: serde_json::Value,
    /// More for the summary line only (a JSON object; not stored in checkpoints).
    pub report: serde_json::Value,
    /// What the plot's title calls the model.
    pub title: String,
    /// Raised to stop after the current step on every rank (e.g. [`crate::RankContext::stop`]).
    pub stop: Option<Arc<AtomicBool>>,
    /// In an elastic launch that heals ([`crate::RankContext::heal`]): when a step fails
    /// because a node was lost, DDP and hybrid go on from this rank's live state in the next
    /// epoch (no checkpoint read; the step cut off is redone); other strategies fail as
    /// without it (the launcher restarts from a checkpoint).
    pub heal: Option<Arc<crate::heal::Healer>>,
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
            append_metrics: false,
            plot: None,
            progress: true,
            checkpoint: None,
            trace: None,
            save_params: None,
            meta: serde_json::json!({}),
            report: serde_json::json!({}),
            title: "model".into(),
            stop: None,
            heal: None,
        }
    }
}

/// What [`fit`] hands back.
pub struct Fitted<M: Module> {
    /// The trainer after the last step.
    pub trainer: Trainer<M>,
    /// The last step done, when the stop flag ended the run early.
    pub stopped_after: Option<usize>,
    /// Steps this process ran (not those a resumed checkpoint held).
    pub steps_done: usize,
    /// The loss of the first step this process ran, if it ran one.
    pub first_loss: Option<f64>,
    /// The loss of the last step this process ran, if it ran one.
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

/// Runs the training loop (see the module docs): `step_fn(trainer, indices)` runs one
/// optimizer step on this rank's sample indices of the global batch (e.g. `trainer.step(..)`,
/// `step_accumulate` or `step_units`). Every rank of the job calls it with the same options.
pub fn fit<M: Module>(
    mut trainer: Trainer<M>,
    mut sampler: DistributedSampler,
    run: &FitOptions,
    mut step_fn: impl FnMut(&mut Trainer<M>, &[usize]) -> Result<StepReport, TrainError>,
) -> Result<Fitted<M>, FitError> {
    let mut leader = trainer.process_group().rank() == 0;
    check_options(run, trainer.config().strategy())?;
    if let Some(s) = &run.stop {
        trainer.set_stop_flag(s.clone());
    }
    let mut rec = Record::open(run, leader)?;
    let run_meta = run_meta(run);
    // The checkpoint directory's lock, held by rank 0's process while the run lasts (a node
    // joining in place joins a run that holds it).
    let (start, mut lock) = match heal::setup(&mut trainer, run, &run_meta)? {
        // A node joining in place: its state comes from the nodes already there.
        Some(steps) => (steps, None),
        None => resume_or_claim(&mut trainer, run, &run_meta, leader)?,
    };
    rec.bar.set_position(start as u64);
    if run.trace.is_some() {
        start_trace(&mut trainer)?;
    }
    let mut pace = Pace::new(&mut trainer, run);
    let mut stopped = None;
    let mut step = start;
    while step < run.steps {
        let before = trainer.updates();
        // The step, its record and its checkpoint; a lost node may cut any of them off.
        let res = pace
            .step(&mut trainer, &mut sampler, step, run, &mut step_fn)
            .and_then(|rep| {
                if run.trace.is_some() {
                    crate::trace::add_comm_track(trainer.process_group());
                }
                rec.step(step, &rep, run.global_batch, &pace.shares)?;
                let bar = (leader).then_some(&rec.bar);
                save_due(&mut trainer, run, &run_meta, step + 1, rep.stop, bar)?;
                Ok(rep)
            });
        let (h, cut) = match res {
            Err(e) => {
                let Some(h) = heal::healable(run, &trainer, &e) else {
                    return Err(e);
                };
                let applied = trainer.updates() > before;
                let reason = e.to_string();
                (h, heal::Cut::failed(step, applied, reason))
            }
            Ok(rep) if rep.stop => {
                stopped = Some(step);
                break;
            }
            Ok(rep) => match run.heal.clone().filter(|_| rep.regroup) {
                // Agents joined: this epoch ends after this step, and the next one, with
                // them, goes on from it in place.
                Some(h) => (h, heal::Cut::regroup(step)),
                None => {
                    step += 1;
                    continue;
                }
            },
        };
        let (sampler, pace, rec) = (&mut sampler, &mut pace, &mut rec);
        step = heal::heal(&mut trainer, sampler, pace, rec, run, &h, cut, &run_meta)?;
        leader = trainer.process_group().rank() == 0;
        relock(&mut lock, run, leader);
    }
    rec.bar.finish_and_clear();
    finish_trace(run, trainer.process_group().world(), leader)?;
    rec.finish(trainer, run, start, stopped, &pace)
}

/// With `--trace`, merges the ranks' traces of this process (`world` ranks in the job); the
/// leader says where they are.
fn finish_trace(run: &FitOptions, world: usize, leader: bool) -> Result<(), FitError> {
    let Some(dir) = &run.trace else {
        return Ok(());
    };
    if let Some(p) =
        crate::trace::finish(dir, world).map_err(|e| io(format!("--trace {}", dir.display()), e))?
        && leader
    {
        eprintln!(
            "wiretrain: traces written to {} ({} and one per rank)",
            dir.display(),
            p.display()
        );
    }
    Ok(())
}

/// What a checkpoint's manifest records of the run: the caller's metadata, the global batch
/// and the accumulation.
fn run_meta(run: &FitOptions) -> serde_json::Value {
    let mut meta = run.meta.clone();
    if let Some(m) = meta.as_object_mut() {
        m.insert("global_batch".into(), run.global_batch.into());
        m.insert("accumulate".into(), run.accumulate.into());
    }
    meta
}

/// Writes the checkpoint of `done` steps when it is due (every k steps, the last step, a
/// stop); `bar` (the leader's) says so.
fn save_due<M: Module>(
    trainer: &mut Trainer<M>,
    run: &FitOptions,
    run_meta: &serde_json::Value,
    done: usize,
    stop: bool,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<(), FitError> {
    let Some(c) = &run.checkpoint else {
        return Ok(());
    };
    if !(c.every.is_some_and(|k| done.is_multiple_of(k)) || done == run.steps || stop) {
        return Ok(());
    }
    let t = Instant::now();
    let d = trainer.save_checkpoint(&c.dir, done, run_meta.clone(), c.keep)?;
    if let Some(bar) = bar {
        bar.suspend(|| {
            eprintln!(
                "wiretrain: checkpoint of step {done} written to {} ({:.0} ms)",
                d.display(),
                t.elapsed().as_secs_f64() * 1e3
            )
        });
    }
    Ok(())
}

/// The options [`fit`] refuses before step 0, so no run ends without what it asked for.
fn check_options(run: &FitOptions, strategy: Strategy) -> Result<(), FitError> {
    check_accumulate(run.accumulate, strategy).map_err(|e| FitError::Train(e.into()))?;
    #[cfg(not(feature = "plot"))]
    if run.plot.is_some() {
        return Err(FitError::Plot(
            "this wiretrain was built without its `plot` feature (on by default); enable it or \
             leave FitOptions::plot unset"
                .into(),
        ));
    }
    Ok(())
}

/// The first step: the newest valid checkpoint's when resuming (0 without one), else 0 after
/// claiming the checkpoint directory for this run.
fn resume_or_claim<M: Module>(
    trainer: &mut Trainer<M>,
    run: &FitOptions,
    run_meta: &serde_json::Value,
    leader: bool,
) -> Result<(usize, Option<DirLock>), FitError> {
    let Some(c) = run.checkpoint.as_ref() else {
        return Ok((0, None));
    };
    let lock = trainer.lock_checkpoint_dir(&c.dir)?;
    Ok((resume_or_claim_locked(trainer, c, run_meta, leader)?, lock))
}

/// After a heal that made this process rank 0's: it takes the checkpoint directory's lock
/// where the old holder was lost with its node (a warning when it cannot: the run goes on).
fn relock(lock: &mut Option<DirLock>, run: &FitOptions, leader: bool) {
    let Some(c) = run.checkpoint.as_ref().filter(|_| leader && lock.is_none()) else {
        return;
    };
    match DirLock::acquire(&c.dir) {
        Ok(l) => *lock = Some(l),
        Err(e) => tracing::warn!("after the heal, rank 0 does not hold the lock: {e}"),
    }
}

/// [`resume_or_claim`] once the directory is this run's.
fn resume_or_claim_locked<M: Module>(
    trainer: &mut Trainer<M>,
    c: &CheckpointPlan,
    run_meta: &serde_json::Value,
    leader: bool,
) -> Result<usize, FitError> {
    if !c.resume {
        trainer.claim_checkpoint_dir(&c.dir, c.overwrite)?;
        return Ok(0);
    }
    let Some(m) = trainer.resume_latest(&c.dir)? else {
        if leader {
            eprintln!(
                "wiretrain: no checkpoint in {}; starting at step 0",
                c.dir.display()
            );
        }
        return Ok(0);
    };
    if leader {
        eprintln!(
            "wiretrain: resumed from {} at step {} (written by {} ranks, {})",
            c.dir.display(),
            m.step,
            m.world,
            m.strategy
        );
        if m.run.get("global_batch") != run_meta.get("global_batch") {
            eprintln!(
                "wiretrain: warning: the checkpoint was trained with global batch {}, this run \
                 uses {}; the data order differs from an uninterrupted run",
                m.run
                    .get("global_batch")
                    .unwrap_or(&serde_json::Value::Null),
                run_meta
                    .get("global_batch")
                    .unwrap_or(&serde_json::Value::Null)
            );
        }
    }
    Ok(m.step)
}

/// Starts this rank's trace: clock offset to rank 0, device name, the collectives' history.
fn start_trace<M: Module>(trainer: &mut Trainer<M>) -> Result<(), FitError> {
    let pg = trainer.process_group();
    let (rank, node) = (pg.rank(), pg.node());
    let off = crate::trace::estimate_offset(pg)?;
    crate::trace::enable(rank, node, off);
    if let Some(d) = crate::run::devices_of(trainer.process_group().table()).get(rank) {
        crate::trace::set_device(d);
    }
    trainer.process_group().keep_history(true);
    Ok(())
}

mod heal;
mod pace;
mod record;

use pace::Pace;
use record::Record;
