//! Burn's `Learner`, distributed by wiretrain: [`WiretrainStrategy`] is a burn-train
//! `SupervisedLearningStrategy`, so a Learner user trains across ranks and nodes by adding
//! `.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))` on every rank.
//!
//! Each rank's strategy owns that rank's [`ProcessGroup`] and device. It slices the training
//! `DataLoader` into equal, disjoint per-rank shares (rank r gets items `[r·n/W, (r+1)·n/W)`,
//! so global batch i is the union of every rank's batch i), runs `TrainStep::step` on the
//! rank's batch, and hands the gradients to a wiretrain [`Trainer`] (ddp, zero1, zero2, hybrid:
//! buckets, wire dtype, sharded optimizer state). A model cut into units ([`UnitsStep`]) also
//! trains under zero3 and hsdp through [`WiretrainStrategy::units`]. The optimizer is wiretrain's (the
//! [`TrainerConfig`]'s AdamW or SGD, Burn's own math on the rank's flat shard), stepped with
//! the Learner's learning-rate scheduler. Every training item reaches the event processor with
//! the loss averaged over all ranks ([`GlobalLoss`]), so rank 0's renderer and metric loggers
//! show global figures (other metrics are rank 0's own batch). Validation, Burn's
//! checkpointer and early stopping run on rank 0 (its decision to stop is shared); a stop on
//! any rank's `Interrupter` (or Ctrl-C) stops every rank after the same step; wiretrain's
//! sharded checkpoints ([`WiretrainStrategy::sharded_checkpoints`]) are written by all ranks.

mod silent;

pub use silent::renderer_for;

use crate::engine::{StepReport, TrainError, Trainer, TrainerConfig};
use crate::strategy::Strategy;
use crate::units::{Act, Units};
use burn::tensor::{Device, Tensor};
use burn_train::{
    ClassificationOutput, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, RegressionOutput, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingError,
    TrainingItem, ValidLoader,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use wiretrain_comm::ProcessGroup;

/// A training item whose loss can be replaced by the mean over all ranks.
pub trait GlobalLoss {
    /// This rank's mean loss of the batch (a 1-element tensor).
    fn local_loss(&self) -> Tensor<1>;
    /// The item with its loss replaced by `loss`.
    fn with_loss(self, loss: Tensor<1>) -> Self;
}

impl GlobalLoss for RegressionOutput {
    fn local_loss(&self) -> Tensor<1> {
        self.loss.clone()
    }
    fn with_loss(mut self, loss: Tensor<1>) -> Self {
        self.loss = loss;
        self
    }
}

impl GlobalLoss for ClassificationOutput {
    fn local_loss(&self) -> Tensor<1> {
        self.loss.clone()
    }
    fn with_loss(mut self, loss: Tensor<1>) -> Self {
        self.loss = loss;
        self
    }
}

/// Why a strategy cannot be built.
#[derive(Debug, thiserror::Error)]
#[error("wiretrain Learner strategy: {0}")]
pub struct StrategyError(pub String);

/// The per-rank strategy (build one on every rank, with that rank's process group).
pub struct WiretrainStrategy {
    pg: Mutex<Option<ProcessGroup>>,
    device: Device,
    cfg: TrainerConfig,
    stop: Option<Arc<AtomicBool>>,
    sharded: Option<(PathBuf, usize, bool)>,
}

impl WiretrainStrategy {
    /// `device` is this rank's (autodiff is added), `cfg` the strategy and optimizer. ZeRO-3
    /// and HSDP need a model cut into units and are refused here.
    pub fn new(
        pg: ProcessGroup,
        device: Device,
        cfg: TrainerConfig,
    ) -> Result<Self, StrategyError> {
        Self::check(&cfg)?;
        Ok(Self {
            pg: Mutex::new(Some(pg)),
            device: device.autodiff(),
            cfg,
            stop: None,
            sharded: None,
        })
    }

    /// Whether [`Self::new`] accepts `cfg` (any module: ddp, zero1, zero2, hybrid), without a
    /// process group: a program can refuse bad settings before its job starts.
    pub fn check(cfg: &TrainerConfig) -> Result<(), StrategyError> {
        if cfg.strategy().shards_params() {
            return Err(StrategyError(format!(
                "{} shards parameters unit by unit: it needs a model cut into units \
                 (implement wiretrain::learner::UnitsStep and use WiretrainStrategy::units); \
                 any module trains with ddp, zero1, zero2 or hybrid",
                cfg.strategy()
            )));
        }
        if cfg.diloco().is_some() {
            return Err(StrategyError(
                "diloco is not available through the Learner strategy".into(),
            ));
        }
        Ok(())
    }

    /// The strategy for a model cut into units ([`UnitsStep`]): every strategy, zero3 and
    /// hsdp included.
    pub fn units(
        pg: ProcessGroup,
        device: Device,
        cfg: TrainerConfig,
    ) -> Result<WiretrainUnitsStrategy, StrategyError> {
        // Checked as the same settings under ddp (any strategy is fine with units).
        let plain = cfg
            .to_builder()
            .strategy(Strategy::Ddp)
            .build()
            .map_err(|e| StrategyError(e.to_string()))?;
        let mut s = Self::new(pg, device, plain)?;
        s.cfg = cfg;
        Ok(WiretrainUnitsStrategy(s))
    }

    /// Also stop every rank when this flag rises (e.g. [`crate::RankContext::stop`]).
    pub fn with_stop_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.stop = Some(flag);
        self
    }

    /// Writes wiretrain's sharded checkpoint (one shard per rank) into `dir` after every
    /// epoch, keeping `keep`; with `resume`, training starts after the newest one's epoch, on
    /// any world size and strategy.
    pub fn sharded_checkpoints(
        mut self,
        dir: impl Into<PathBuf>,
        keep: usize,
        resume: bool,
    ) -> Self {
        self.sharded = Some((dir.into(), keep.max(1), resume));
        self
    }

    /// The strategy this runs.
    pub fn strategy(&self) -> Strategy {
        self.cfg.strategy()
    }
}

/// A failure of this rank, as the Learner reports errors.
fn failure(rank: usize, message: String) -> TrainingError {
    TrainingError::Workers(vec![burn_train::train::WorkerFailure {
        device_id: rank,
        message,
    }])
}

/// What a Learner model trains as: a whole module, or unit by unit.
trait Plan<M: LearnerModel> {
    fn build(
        &self,
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Trainer<M>, TrainError>;
    /// One optimizer step on this rank's batch; the item for the metrics.
    fn step(
        &self,
        trainer: &mut Trainer<M>,
        batch: <M as TrainStep>::Input,
    ) -> Result<(StepReport, <M as TrainStep>::Output), TrainError>;
    /// The whole model (a collective under ZeRO-3: every rank calls it); `template` is a
    /// model of the right shapes.
    fn full(&self, trainer: &mut Trainer<M>, template: M) -> Result<M, TrainError>;
}

struct Whole;

impl<M: LearnerModel> Plan<M> for Whole
where
    <M as TrainStep>::Output: GlobalLoss,
{
    fn build(
        &self,
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Trainer<M>, TrainError> {
        Trainer::new(model, device, cfg, pg)
    }
    fn step(
        &self,
        trainer: &mut Trainer<M>,
        batch: <M as TrainStep>::Input,
    ) -> Result<(StepReport, <M as TrainStep>::Output), TrainError> {
        let mut item = None;
        let rep = trainer.step_grads(|m| {
            let out = TrainStep::step(m, batch);
            let loss = out.item.local_loss().into_scalar::<f32>();
            item = Some(out.item);
            (out.grads, loss)
        })?;
        Ok((rep, item.expect("the step ran")))
    }
    fn full(&self, trainer: &mut Trainer<M>, _template: M) -> Result<M, TrainError> {
        Ok(trainer.model().clone())
    }
}

/// A Learner model cut into units (see [`Units`]): what ZeRO-3 and HSDP need besides
/// `TrainStep`.
pub trait UnitsStep: Units + TrainStep {
    /// Unit 0's input for `batch`, and what turns the last unit's output into the batch's
    /// mean loss and the training item. Called on the model at rest (under ZeRO-3 its
    /// parameters are placeholders: read only the batch here).
    fn unit_batch(&self, batch: <Self as TrainStep>::Input) -> (Act, UnitLoss<Self>);
}

/// The last unit's output to (loss, training item).
pub type UnitLoss<M> = Box<dyn FnOnce(Act) -> (Tensor<1>, <M as TrainStep>::Output)>;

struct ByUnits;

impl<M: LearnerModel + UnitsStep> Plan<M> for ByUnits
where
    <M as TrainStep>::Output: GlobalLoss,
{
    fn build(
        &self,
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Trainer<M>, TrainError> {
        Trainer::with_units(model, device, cfg, pg)
    }
    fn step(
        &self,
        trainer: &mut Trainer<M>,
        batch: <M as TrainStep>::Input,
    ) -> Result<(StepReport, <M as TrainStep>::Output), TrainError> {
        let (x, last) = trainer.model().unit_batch(batch);
        let mut item = None;
        let rep = trainer.step_units(x, |y| {
            let (loss, it) = last(y);
            item = Some(it);
            loss
        })?;
        Ok((rep, item.expect("the step ran")))
    }
    fn full(&self, trainer: &mut Trainer<M>, template: M) -> Result<M, TrainError> {
        if !trainer.config().strategy().shards_params() {
            return Ok(trainer.model().clone());
        }
        let flat = trainer.gather_params()?;
        Ok(trainer.layout().unflatten(template, &flat))
    }
}

impl<M> SupervisedLearningStrategy<M> for WiretrainStrategy
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalLoss,
{
    fn fit(
        &self,
        tc: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        fit_plan(
            self,
            &Whole,
            tc,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        )
    }
}

/// [`WiretrainStrategy`] for a model cut into units: every strategy, zero3 and hsdp included.
pub struct WiretrainUnitsStrategy(WiretrainStrategy);

impl WiretrainUnitsStrategy {
    /// See [`WiretrainStrategy::with_stop_flag`].
    pub fn with_stop_flag(self, flag: Arc<AtomicBool>) -> Self {
        Self(self.0.with_stop_flag(flag))
    }
    /// See [`WiretrainStrategy::sharded_checkpoints`].
    pub fn sharded_checkpoints(self, dir: impl Into<PathBuf>, keep: usize, resume: bool) -> Self {
        Self(self.0.sharded_checkpoints(dir, keep, resume))
    }
}

impl<M> SupervisedLearningStrategy<M> for WiretrainUnitsStrategy
where
    M: LearnerModel + UnitsStep,
    <M as TrainStep>::Output: GlobalLoss,
{
    fn fit(
        &self,
        tc: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        fit_plan(
            &self.0,
            &ByUnits,
            tc,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        )
    }
}

/// The epoch loop of both strategies (burn-train's single-device loop, distributed).
fn fit_plan<M: LearnerModel>(
    s: &WiretrainStrategy,
    plan: &impl Plan<M>,
    tc: TrainingComponents<M>,
    mut learner: Learner<M>,
    dataloader_train: TrainLoader<M>,
    dataloader_valid: ValidLoader<M>,
    starting_epoch: usize,
) -> (M, SupervisedTrainingEventProcessor<M>)
where
    <M as TrainStep>::Output: GlobalLoss,
{
    let mut events = tc.event_processor;
    let interrupter = tc.interrupter.clone();
    let pg = match take_group(s, tc.grad_accumulation) {
        Ok(pg) => pg,
        Err((rank, msg)) => {
            interrupter.fail(failure(rank, msg));
            return (learner.model(), events);
        }
    };
    let (rank, world) = (pg.rank(), pg.world());
    learner.fork(&s.device);
    let per = dataloader_train.num_items() / world;
    let train = dataloader_train
        .slice(rank * per, rank * per + per)
        .to_device(&s.device);
    let valid = (rank == 0).then(|| dataloader_valid.to_device(&s.device.clone().inner()));
    let aborter = pg.aborter();
    let fail = |msg: String| {
        aborter.abort(&msg);
        interrupter.fail(failure(rank, msg));
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (mut trainer, epoch0) = match start(plan, learner.model(), s, pg, &stop, starting_epoch) {
        Ok(t) => t,
        Err(msg) => {
            fail(msg);
            return (learner.model(), events);
        }
    };
    let mut checkpointer = if rank == 0 { tc.checkpointer } else { None };
    let mut early = if rank == 0 { tc.early_stopping } else { None };
    let total = tc.num_epochs;
    for epoch in epoch0..=total {
        let r = run_epoch(
            plan,
            &mut trainer,
            &mut learner,
            &*train,
            epoch,
            &mut events,
            &interrupter,
            (&stop, s.stop.as_deref()),
        );
        if let Err(msg) = r {
            fail(msg);
            break;
        }
        if interrupter.should_stop() {
            break;
        }
        let flush = checkpointer.is_some() || early.is_some();
        let r = end_epoch(
            plan,
            &mut trainer,
            &mut learner,
            valid.as_deref(),
            (epoch, flush),
            &mut events,
            &interrupter,
            &s.sharded,
            checkpointer.as_mut().map(|c| (c, &*tc.event_store)),
        );
        if let Err(msg) = r {
            fail(msg);
            break;
        }
        // Rank 0 decides on early stopping; every rank follows.
        let leave = early
            .as_mut()
            .is_some_and(|e| e.should_stop(epoch, &tc.event_store));
        match all_follow(&mut trainer, leave) {
            Ok(true) => break,
            Ok(false) => {}
            Err(msg) => {
                fail(msg);
                break;
            }
        }
    }
    let template = learner.model();
    match plan.full(&mut trainer, template) {
        Ok(m) => (m, events),
        Err(e) => {
            fail(e.to_string());
            (learner.model(), events)
        }
    }
}

/// After an epoch's steps: the whole model, validated on rank 0, the epoch's end event
/// (flushed when a checkpointer or early stopping reads the store), the sharded checkpoint,
/// and burn-train's own checkpoint (rank 0).
#[allow(clippy::too_many_arguments)]
fn end_epoch<M: LearnerModel>(
    plan: &impl Plan<M>,
    trainer: &mut Trainer<M>,
    learner: &mut Learner<M>,
    valid: Option<&dyn burn::data::dataloader::DataLoader<<M as InferenceStep>::Input>>,
    (epoch, flush): (usize, bool),
    events: &mut SupervisedTrainingEventProcessor<M>,
    interrupter: &Interrupter,
    sharded: &Option<(PathBuf, usize, bool)>,
    checkpointer: Option<(
        &mut burn_train::LearningCheckpointer<M>,
        &burn_train::metric::store::EventStoreClient,
    )>,
) -> Result<(), String> {
    let model = plan
        .full(trainer, learner.model())
        .map_err(|e| e.to_string())?;
    if let Some(valid) = valid {
        valid_epoch(&model, valid, epoch, events, interrupter);
    }
    interrupter.fail_on_error(events.process_train(LearnerEvent::EndEpoch(epoch)));
    if flush {
        interrupter.fail_on_error(events.flush());
    }
    if let Some((dir, keep, _)) = sharded {
        let meta = serde_json::json!({ "epoch": epoch, "learner": true });
        trainer
            .save_checkpoint(dir, epoch, meta, *keep)
            .map_err(|e| format!("checkpoint of epoch {epoch}: {e}"))?;
    }
    if let Some((c, store)) = checkpointer {
        learner.load_model(model.into_record());
        c.checkpoint(learner, epoch, store);
    }
    Ok(())
}

/// The rank's trainer, stopping on `stop`, with its sharded checkpoints opened: the trainer
/// and the first epoch to run.
fn start<M: LearnerModel>(
    plan: &impl Plan<M>,
    model: M,
    s: &WiretrainStrategy,
    pg: ProcessGroup,
    stop: &Arc<AtomicBool>,
    starting_epoch: usize,
) -> Result<(Trainer<M>, usize), String> {
    let mut trainer = plan
        .build(model, &s.device, s.cfg.clone(), pg)
        .map_err(|e| e.to_string())?;
    trainer.set_stop_flag(stop.clone());
    let epoch0 = open_sharded(&mut trainer, s, starting_epoch)?;
    Ok((trainer, epoch0))
}

/// Rank 0's decision (`leave` there) on every rank.
fn all_follow<M: burn::module::Module>(
    trainer: &mut Trainer<M>,
    leave: bool,
) -> Result<bool, String> {
    let v = trainer
        .process_group()
        .broadcast(vec![f32::from(u8::from(leave))], 0)
        .wait()
        .map_err(|e| e.to_string())?;
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
/// checkpoint: the first epoch to run.
fn open_sharded<M: burn::module::Module>(
    trainer: &mut Trainer<M>,
    s: &WiretrainStrategy,
    starting_epoch: usize,
) -> Result<usize, String> {
    match &s.sharded {
        None => Ok(starting_epoch),
        Some((dir, _, false)) => trainer
            .claim_checkpoint_dir(dir, false)
            .map(|()| starting_epoch)
            .map_err(|e| format!("sharded checkpoints: {e}")),
        Some((dir, _, true)) => match trainer.resume_latest(dir) {
            Ok(Some(m)) => Ok(starting_epoch.max(m.step + 1)),
            Ok(None) => Ok(starting_epoch),
            Err(e) => Err(format!("resuming from {}: {e}", dir.display())),
        },
    }
}

/// One training epoch over this rank's share: every step is a wiretrain step; the item goes
/// to the event processor with the global mean loss. All ranks run the same number of steps
/// and leave together on a stop.
#[allow(clippy::too_many_arguments)]
fn run_epoch<M>(
    plan: &impl Plan<M>,
    trainer: &mut Trainer<M>,
    learner: &mut Learner<M>,
    train: &dyn burn::data::dataloader::DataLoader<<M as TrainStep>::Input>,
    epoch: usize,
    events: &mut SupervisedTrainingEventProcessor<M>,
    interrupter: &Interrupter,
    (stop, outer): (&AtomicBool, Option<&AtomicBool>),
) -> Result<(), String>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalLoss,
{
    interrupter.fail_on_error(events.process_train(LearnerEvent::StartSplit {
        epoch_number: epoch,
        total_items: train.num_items(),
    }));
    let mut it = train.iter();
    let mut iteration = 0;
    while let Some(batch) = it.next() {
        let batch = batch.map_err(|e| format!("reading a training batch: {e}"))?;
        iteration += 1;
        let progress = it.progress();
        learner.lr_step();
        let lr = learner.lr_current();
        trainer.set_lr(lr.base());
        if interrupter.should_stop() || outer.is_some_and(|o| o.load(Ordering::Relaxed)) {
            stop.store(true, Ordering::Relaxed);
        }
        let (rep, item) = plan.step(trainer, batch).map_err(|e| e.to_string())?;
        let device = item.local_loss().device();
        let item = item.with_loss(Tensor::from_floats([rep.loss], &device));
        let item = TrainingItem::new(item, progress, Some(iteration), Some(lr));
        interrupter.fail_on_error(events.process_train(LearnerEvent::ProcessedItem(item)));
        if rep.stop {
            if !interrupter.should_stop() {
                interrupter.stop(Some("stopped on another rank"));
            }
            break;
        }
    }
    interrupter.fail_on_error(events.process_train(LearnerEvent::EndSplit(epoch)));
    Ok(())
}

/// Validation on rank 0 (no collectives), as Burn's single-device strategy runs it.
fn valid_epoch<M: LearnerModel>(
    model: &M,
    valid: &dyn burn::data::dataloader::DataLoader<<M as InferenceStep>::Input>,
    epoch: usize,
    events: &mut SupervisedTrainingEventProcessor<M>,
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
