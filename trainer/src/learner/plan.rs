//! What a Learner model trains as ([`Plan`]): a whole module ([`Plan::whole`], any
//! gradient-sync strategy) or unit by unit ([`Plan::by_units`], a model that implements
//! [`UnitsStep`]: every strategy, zero3 and hsdp included).

use super::GlobalLoss;
use crate::engine::{StepReport, TrainError, Trainer, TrainerConfig};
use crate::units::{Act, Units};
use burn::tensor::{Device, Tensor};
use burn_train::{LearnerModel, TrainStep};
use wiretrain_comm::ProcessGroup;

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

/// One step's report and the item for the metrics.
pub(super) type Stepped<M> = Result<(StepReport, <M as TrainStep>::Output), TrainError>;

/// A rank's trainer from its model, device, configuration and process group.
pub(super) type Build<M> =
    fn(M, &Device, TrainerConfig, ProcessGroup) -> Result<Trainer<M>, TrainError>;

/// How the epoch loop builds, steps and reads back a trainer for one kind of model.
pub(super) struct Plan<M: LearnerModel> {
    /// The rank's trainer (`Trainer::new` or `Trainer::with_units`).
    pub build: Build<M>,
    /// One optimizer step on this rank's batch.
    pub step: fn(&mut Trainer<M>, <M as TrainStep>::Input) -> Stepped<M>,
    /// The whole model (a collective under ZeRO-3: every rank calls it); the second
    /// argument is a model of the right shapes.
    pub full: fn(&mut Trainer<M>, M) -> Result<M, TrainError>,
}

impl<M: LearnerModel> Plan<M>
where
    <M as TrainStep>::Output: GlobalLoss,
{
    /// A whole module: the gradients of `TrainStep::step` go to the trainer.
    pub(super) fn whole() -> Self {
        Self {
            build: Trainer::new,
            step: whole_step,
            full: |trainer, _| Ok(trainer.model().clone()),
        }
    }
}

impl<M: LearnerModel + UnitsStep> Plan<M>
where
    <M as TrainStep>::Output: GlobalLoss,
{
    /// Unit by unit: the trainer runs the units' forward and backward passes.
    pub(super) fn by_units() -> Self {
        Self {
            build: Trainer::with_units,
            step: units_step,
            full: units_full,
        }
    }
}

fn whole_step<M: LearnerModel>(
    trainer: &mut Trainer<M>,
    batch: <M as TrainStep>::Input,
) -> Stepped<M>
where
    <M as TrainStep>::Output: GlobalLoss,
{
    let mut item = None;
    let rep = trainer.step_grads(|m| {
        let out = TrainStep::step(m, batch);
        let loss = out.item.local_loss().into_scalar::<f32>();
        item = Some(out.item);
        (out.grads, loss)
    })?;
    Ok((rep, item.expect("the step ran")))
}

fn units_step<M: LearnerModel + UnitsStep>(
    trainer: &mut Trainer<M>,
    batch: <M as TrainStep>::Input,
) -> Stepped<M> {
    let (x, last) = trainer.model().unit_batch(batch);
    let mut item = None;
    let rep = trainer.step_units(x, |y| {
        let (loss, it) = last(y);
        item = Some(it);
        loss
    })?;
    Ok((rep, item.expect("the step ran")))
}

fn units_full<M: LearnerModel + UnitsStep>(
    trainer: &mut Trainer<M>,
    template: M,
) -> Result<M, TrainError> {
    if !trainer.config().strategy().shards_params() {
        return Ok(trainer.model().clone());
    }
    let flat = trainer.gather_params()?;
    Ok(trainer.layout().unflatten(template, &flat))
}
