//! The epoch loop of both Learner strategies (burn-train's single-device loop, distributed):
//! the rank's share of the data, wiretrain steps, validation and checkpoints on rank 0,
//! sharded checkpoints on every rank, and stops that every rank follows.

use super::heal::{Phase, Spot, healed};
use super::plan::Plan;
use super::{GlobalLoss, WiretrainStrategy, failure};
use crate::engine::{TrainError, Trainer};
use crate::heal::Healer;
use burn::data::dataloader::DataLoader;
use burn::tensor::Tensor;
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, LearningCheckpointer, SupervisedTrainingEventProcessor,
    TrainLoader, TrainStep, TrainingComponents, TrainingItem, ValidLoader,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use wiretrain_comm::ProcessGroup;

type Events<M> = SupervisedTrainingEventProcessor<M>;

/// The rank's whole fit (from `starting_epoch`, or the sharded checkpoint's next epoch): the trained model (whole, on every rank) and the event processor.
pub(super) fn fit_plan<M: LearnerModel>(
    s: &WiretrainStrategy,
    plan: &Plan<M>,
    tc: TrainingComponents<M>,
    mut learner: Learner<M>,
    (train, valid): (TrainLoader<M>, ValidLoader<M>),
    starting_epoch: usize,
) -> (M, Events<M>)
where
    <M as TrainStep>::Output: GlobalLoss,
{
    let events = tc.event_processor;
    let interrupter = tc.interrupter.clone();
    let pg = match take_group(s, tc.grad_accumulation) {
        Ok(pg) => pg,
        Err((rank, msg)) => {
            interrupter.fail(failure(rank, msg));
            return (learner.model(), events);
        }
    };
    let rank = pg.rank();
    learner.fork(&s.device);
    let valid = (rank == 0).then(|| valid.to_device(&s.device.clone().inner()));
    if let Some(h) = &s.heal {
        // A node cannot join a Learner run in place (it would not know the epoch's data):
        // the launcher grows the world at a restart from the checkpoint.
        h.capable(false);
    }
    let fail = |pg: &ProcessGroup, msg: String| {
        pg.aborter().abort(&msg);
        interrupter.fail(failure(pg.rank(), msg));
    };
    let stop = Arc::new(AtomicBool::new(false));
    let model = learner.model();
    let aborter = pg.aborter();
    let (trainer, (epoch0, steps0)) = match start(plan, model, s, pg, &stop, starting_epoch) {
        Ok(t) => t,
        Err(msg) => {
            aborter.abort(&msg);
            interrupter.fail(failure(rank, msg));
            return (learner.model(), events);
        }
    };
    let mut run = Run {
        plan,
        trainer,
        learner,
        events,
        interrupter: &interrupter,
        stop: (&stop, s.stop.as_deref()),
        heal: s.heal.as_deref(),
        steps: steps0,
        counter: s.steps.as_deref(),
    };
    let end = EpochEnd {
        valid: valid.as_deref(),
        sharded: &s.sharded,
        checkpointer: if rank == 0 { tc.checkpointer } else { None },
        early: if rank == 0 { tc.early_stopping } else { None },
        store: &tc.event_store,
    };
    if let Err(msg) = run.epochs(epoch0..=tc.num_epochs, (&train, &s.device), end) {
        fail(run.trainer.process_group(), msg);
    }
    let template = run.learner.model();
    match (plan.full)(&mut run.trainer, template) {
        Ok(m) => (m, run.events),
        Err(e) => {
            fail(run.trainer.process_group(), e.to_string());
            (run.learner.model(), run.events)
        }
    }
}

/// What runs after an epoch's steps besides burn-train's events.
struct EpochEnd<'a, M: LearnerModel> {
    /// Rank 0's validation data.
    valid: Option<&'a dyn DataLoader<<M as InferenceStep>::Input>>,
    /// Wiretrain's sharded checkpoints: (directory, how many to keep, resume).
    sharded: &'a Option<(std::path::PathBuf, usize, bool)>,
    /// Burn's own checkpointer and early stopping (rank 0).
    checkpointer: Option<LearningCheckpointer<M>>,
    early: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    store: &'a Arc<EventStoreClient>,
}

/// One rank's trainer, Learner and event processor through the epochs.
struct Run<'a, M: LearnerModel> {
    plan: &'a Plan<M>,
    trainer: Trainer<M>,
    learner: Learner<M>,
    events: Events<M>,
    interrupter: &'a Interrupter,
    /// The trainer's stop flag, and the user's (see `WiretrainStrategy::with_stop_flag`).
    stop: (&'a AtomicBool, Option<&'a AtomicBool>),
    /// How this node heals after losing a peer (see `WiretrainStrategy::with_heal`).
    heal: Option<&'a Healer>,
    /// Optimizer steps the trainer's state holds since this fit began (what a heal agrees).
    steps: usize,
    /// The user's copy of `steps` (see `WiretrainStrategy::with_step_counter`).
    counter: Option<&'a std::sync::atomic::AtomicUsize>,
}

impl<M: LearnerModel> Run<'_, M>
where
    <M as TrainStep>::Output: GlobalLoss,
{
    /// Every epoch of `epochs` over this rank's share of `train` (on `device`), until the
    /// last, a stop, or an error (returned). Each epoch is shared over the world it starts
    /// in: equal, disjoint, contiguous shares (rank r of W gets items [r·n/W, (r+1)·n/W)).
    fn epochs(
        &mut self,
        epochs: std::ops::RangeInclusive<usize>,
        (train, device): (&TrainLoader<M>, &burn::tensor::Device),
        mut end: EpochEnd<'_, M>,
    ) -> Result<(), String> {
        for epoch in epochs {
            let pg = self.trainer.process_group();
            let per = train.num_items() / pg.world();
            let share = train
                .slice(pg.rank() * per, pg.rank() * per + per)
                .to_device(device);
            self.train_epoch(&*share, epoch)?;
            if self.interrupter.should_stop() {
                return Ok(());
            }
            self.end_epoch(epoch, &mut end)?;
            // Rank 0 decides on early stopping; every rank follows.
            let leave = end
                .early
                .as_mut()
                .is_some_and(|e| e.should_stop(epoch, end.store));
            let at = (self.heal, Spot::at(epoch, Phase::Follow));
            if healed(&mut self.trainer, at, &mut self.steps, |t| {
                all_follow(t, leave)
            })? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// One training epoch over this rank's share: every step is a wiretrain step; the item
    /// goes to the event processor with the global mean loss. All ranks run the same number
    /// of steps and leave together on a stop.
    fn train_epoch(
        &mut self,
        train: &dyn DataLoader<<M as TrainStep>::Input>,
        epoch: usize,
    ) -> Result<(), String> {
        let (stop, outer) = self.stop;
        self.train_event(LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: train.num_items(),
        });
        let mut it = train.iter();
        let mut iteration = 0;
        while let Some(batch) = it.next() {
            let batch = batch.map_err(|e| format!("reading a training batch: {e}"))?;
            iteration += 1;
            let progress = it.progress();
            self.learner.lr_step();
            let lr = self.learner.lr_current();
            self.trainer.set_lr(lr.base());
            if self.interrupter.should_stop() || outer.is_some_and(|o| o.load(Ordering::Relaxed)) {
                stop.store(true, Ordering::Relaxed);
            }
            let node = self.trainer.process_group().node();
            if self.trainer.config().faults().die_at == Some((node, self.steps)) {
                crate::faults::die();
            }
            let before = self.trainer.updates();
            let (rep, item) = match (self.plan.step)(&mut self.trainer, batch) {
                Ok(stepped) => stepped,
                Err(e) => match self.heal {
                    Some(h) if super::heal::healable(&self.trainer, &e) => {
                        let done = self.steps + usize::from(self.trainer.updates() > before);
                        let cut = (done, self.steps + 1);
                        let spot = Spot {
                            epoch,
                            phase: Phase::Step,
                            taken: iteration,
                        };
                        let reason = e.to_string();
                        let (steps, taken) =
                            super::heal::heal(&mut self.trainer, h, &reason, cut, spot)?;
                        self.steps = steps;
                        self.count();
                        // Every rank goes on after the furthest batch any had taken, with the
                        // next batches of its own share (the learning rate schedule steps
                        // past them too, so that every rank's stays in step).
                        while iteration < taken && it.next().is_some() {
                            iteration += 1;
                            self.learner.lr_step();
                        }
                        continue;
                    }
                    _ => return Err(e.to_string()),
                },
            };
            self.steps += 1;
            self.count();
            let device = item.local_loss().device();
            let item = item.with_loss(Tensor::from_floats([rep.loss], &device));
            let item = TrainingItem::new(item, progress, Some(iteration), Some(lr));
            self.train_event(LearnerEvent::ProcessedItem(item));
            if rep.stop {
                if !self.interrupter.should_stop() {
                    self.interrupter.stop(Some("stopped on another rank"));
                }
                break;
            }
        }
        self.train_event(LearnerEvent::EndSplit(epoch));
        Ok(())
    }

    /// Publishes the step count to the user's counter.
    fn count(&self) {
        if let Some(c) = self.counter {
            c.store(self.steps, Ordering::Relaxed);
        }
    }

    fn train_event(&mut self, e: LearnerEvent<<M as TrainStep>::Output>) {
        self.interrupter.fail_on_error(self.events.process_train(e));
    }

    /// After an epoch's steps: the whole model, validated on rank 0, the epoch's end event
    /// (flushed when a checkpointer or early stopping reads the store), the sharded
    /// checkpoint, and burn-train's own checkpoint (rank 0).
    fn end_epoch(&mut self, epoch: usize, end: &mut EpochEnd<'_, M>) -> Result<(), String> {
        let (plan, learner) = (self.plan, &self.learner);
        let heal = self.heal;
        let at = |phase| (heal, Spot::at(epoch, phase));
        let model = healed(&mut self.trainer, at(Phase::Model), &mut self.steps, |t| {
            (plan.full)(t, learner.model())
        })?;
        if let Some(valid) = end.valid {
            valid_epoch(&model, valid, epoch, &mut self.events, self.interrupter);
        }
        self.train_event(LearnerEvent::EndEpoch(epoch));
        if end.checkpointer.is_some() || end.early.is_some() {
            self.interrupter.fail_on_error(self.events.flush());
        }
        if let Some((dir, keep, _)) = end.sharded {
            let meta = serde_json::json!({ "epoch": epoch, "learner": true, "steps": self.steps });
            let mut again = false;
            healed(
                &mut self.trainer,
                at(Phase::Checkpoint),
                &mut self.steps,
                |t| {
                    // After a heal: written unless the failure came after it was complete.
                    if std::mem::replace(&mut again, true) && written(t, dir, epoch)? {
                        return Ok(());
                    }
                    t.save_checkpoint(dir, epoch, meta.clone(), *keep).map(drop)
                },
            )
            .map_err(|e| format!("checkpoint of epoch {epoch}: {e}"))?;
        }
        if let Some(c) = end.checkpointer.as_mut() {
            self.learner.load_model(model.into_record());
            c.checkpoint(&self.learner, epoch, end.store);
        }
        Ok(())
    }
}

/// The rank's trainer, stopping on `stop`, with its sharded checkpoints opened: the trainer,
/// the first epoch to run and the steps its state holds.
fn start<M: LearnerModel>(
    plan: &Plan<M>,
    model: M,
    s: &WiretrainStrategy,
    pg: ProcessGroup,
    stop: &Arc<AtomicBool>,
    starting_epoch: usize,
) -> Result<(Trainer<M>, (usize, usize)), String> {
    let mut trainer =
        (plan.build)(model, &s.device, s.cfg.clone(), pg).map_err(|e| e.to_string())?;
    trainer.set_stop_flag(stop.clone());
    let start = open_sharded(&mut trainer, s, starting_epoch)?;
    Ok((trainer, start))
}

/// Rank 0's decision (`leave` there) on every rank.
fn all_follow<M: burn::module::Module>(
    trainer: &mut Trainer<M>,
    leave: bool,
) -> Result<bool, TrainError> {
    let v = trainer
        .process_group()
        .broadcast(vec![f32::from(u8::from(leave))], 0)
        .wait()?;
    Ok(v[0] > 0.0)
}

/// Whether the checkpoint of `step` under `dir` is complete (rank 0 looks; every rank gets
/// its answer).
fn written<M: burn::module::Module>(
    trainer: &mut Trainer<M>,
    dir: &std::path::Path,
    step: usize,
) -> Result<bool, TrainError> {
    let pg = trainer.process_group();
    let path = dir.join(crate::checkpoint::step_dir_name(step));
    let here = pg.rank() == 0 && crate::checkpoint::Checkpoint::open(&path).is_ok();
    let v = pg.broadcast(vec![f32::from(u8::from(here))], 0).wait()?;
    Ok(v[0] > 0.0)
}

/// The strategy's process group (once: a strategy trains once), refused with the rank and a
/// message when the learner asks for what the strategy cannot do yet.
fn take_group(
    s: &WiretrainStrategy,
    grad_accumulation: Option<usize>,
) -> Result<ProcessGroup, (usize, String)> {
    let Some(pg) = s.pg.lock().unwrap_or_else(|p| p.into_inner()).take() else {
        let msg = "a WiretrainStrategy trains once (build a new one per Learner launch)";
        return Err((usize::MAX, msg.into()));
    };
    if grad_accumulation.is_some_and(|n| n > 1) {
        let msg = "grads_accumulation is not available through the wiretrain strategy yet \
                   (raise the batch size or the world size instead)";
        pg.abort(msg);
        return Err((pg.rank(), msg.into()));
    }
    Ok(pg)
}

/// Claims the sharded-checkpoint directory of a fresh run, or resumes from its newest
/// checkpoint: the first epoch to run, and the optimizer steps the state holds (as the
/// checkpoint recorded them; 0 from one written before they were).
fn open_sharded<M: burn::module::Module>(
    trainer: &mut Trainer<M>,
    s: &WiretrainStrategy,
    starting_epoch: usize,
) -> Result<(usize, usize), String> {
    if let Some((dir, _, _)) = &s.sharded {
        // One run per directory: a second one there is refused, naming the holder.
        let lock = trainer
            .lock_checkpoint_dir(dir)
            .map_err(|e| format!("sharded checkpoints: {e}"))?;
        *s.dir_lock.lock().unwrap_or_else(|p| p.into_inner()) = lock;
    }
    match &s.sharded {
        None => Ok((starting_epoch, 0)),
        Some((dir, _, false)) => trainer
            .claim_checkpoint_dir(dir, false)
            .map(|()| (starting_epoch, 0))
            .map_err(|e| format!("sharded checkpoints: {e}")),
        Some((dir, _, true)) => match trainer.resume_latest(dir) {
            Ok(Some(m)) => {
                let steps = m.run["steps"].as_u64().unwrap_or(0) as usize;
                Ok((starting_epoch.max(m.step + 1), steps))
            }
            Ok(None) => Ok((starting_epoch, 0)),
            Err(e) => Err(format!("resuming from {}: {e}", dir.display())),
        },
    }
}

/// Validation on rank 0 (no collectives), as Burn's single-device strategy runs it.
fn valid_epoch<M: LearnerModel>(
    model: &M,
    valid: &dyn DataLoader<<M as InferenceStep>::Input>,
    epoch: usize,
    events: &mut Events<M>,
    interrupter: &Interrupter,
) {
    interrupter.fail_on_error(events.process_valid(LearnerEvent::StartSplit {
        epoch_number: epoch,
        total_items: valid.num_items(),
    }));
    let model = model.valid();
    let mut it = valid.iter();
    let mut iteration = 0;
    while let Some(item) = it.next() {
        let item = match item {
            Ok(i) => i,
            Err(e) => {
                interrupter.fail(e);
                break;
            }
        };
        iteration += 1;
        let progress = it.progress();
        let out = InferenceStep::step(&model, item);
        let out = TrainingItem::new(out, progress, Some(iteration), None);
        interrupter.fail_on_error(events.process_valid(LearnerEvent::ProcessedItem(out)));
        if interrupter.should_stop() {
            break;
        }
    }
    interrupter.fail_on_error(events.process_valid(LearnerEvent::EndSplit(epoch)));
}
