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
//! In an elastic launch, [`WiretrainStrategy::with_heal`] heals a step cut off by a lost node
//! from live replicas (`heal`).

mod epoch;
mod heal;
mod plan;
mod silent;

pub use plan::{UnitLoss, UnitsStep};
pub use silent::renderer_for;

use crate::engine::TrainerConfig;
use crate::heal::Healer;
use crate::strategy::Strategy;
use burn::tensor::{Device, Tensor};
use burn_train::{
    ClassificationOutput, Learner, LearnerModel, RegressionOutput, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingError,
    ValidLoader,
};
use epoch::fit_plan;
use plan::Plan;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
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
    /// Where the fit keeps its optimizer step count (see `with_step_counter`).
    steps: Option<Arc<std::sync::atomic::AtomicUsize>>,
    sharded: Option<(PathBuf, usize, bool)>,
    heal: Option<Arc<Healer>>,
    /// The sharded-checkpoint directory's lock, held by rank 0's process while the fit runs.
    dir_lock: Mutex<Option<crate::checkpoint::DirLock>>,
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
            steps: None,
            sharded: None,
            heal: None,
            dir_lock: Mutex::new(None),
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

    /// In an elastic launch that heals ([`crate::RankContext::heal`]): a step cut off by a
    /// lost node heals from live replicas (ddp, hybrid, hsdp) instead of failing, and the
    /// survivors go on in the same process from the step in memory. `None` leaves it off.
    pub fn with_heal(mut self, heal: Option<Arc<Healer>>) -> Self {
        self.heal = heal;
        self
    }

    /// Keeps the optimizer steps this rank's fit has taken in `counter` (updated after every
    /// step and heal): after a stop, every rank's count is the same.
    pub fn with_step_counter(mut self, counter: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        self.steps = Some(counter);
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

impl<M> SupervisedLearningStrategy<M> for WiretrainStrategy
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalLoss,
{
    fn fit(
        &self,
        tc: TrainingComponents<M>,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        fit_plan(self, &Plan::whole(), tc, learner, (train, valid), epoch)
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
    /// See [`WiretrainStrategy::with_heal`].
    pub fn with_heal(self, heal: Option<Arc<Healer>>) -> Self {
        Self(self.0.with_heal(heal))
    }

    /// [`WiretrainStrategy::with_step_counter`].
    pub fn with_step_counter(self, counter: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        Self(self.0.with_step_counter(counter))
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
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        fit_plan(
            &self.0,
            &Plan::by_units(),
            tc,
            learner,
            (train, valid),
            epoch,
        )
    }
}
