//! What a step of [`super::fit`] does around the step function: this rank's share of the
//! global batch (equal, fixed or speed-proportional, with the speeds exchanged after every
//! step), and the injected delays (test hooks and the `WIRETRAIN_DEBUG_SLOWDOWN` knob).

use super::{FitError, FitOptions};
use crate::balance::{Balance, SpeedBalancer};
use crate::data::DistributedSampler;
use crate::engine::{StepReport, TrainError, Trainer};
use crate::faults::Faults;
use burn::module::Module;
use std::time::Duration;

/// The pace of one rank's steps.
pub(super) struct Pace {
    faults: Faults,
    node: usize,
    rank: usize,
    world: usize,
    /// Milliseconds per sample of the last step (what the slowdown knob scales).
    per_sample_ms: Option<f64>,
    pub balancer: SpeedBalancer,
    /// This step's samples per rank (`None`: equal shares).
    pub shares: Option<Vec<usize>>,
}

impl Pace {
    pub(super) fn new<M: Module>(trainer: &mut Trainer<M>, run: &FitOptions) -> Self {
        let faults = trainer.config().faults().clone();
        let pg = trainer.process_group();
        Self {
            faults,
            node: pg.node(),
            rank: pg.rank(),
            world: pg.world(),
            per_sample_ms: None,
            balancer: SpeedBalancer::new(run.global_batch),
            shares: None,
        }
    }

    /// Step `step`: this rank's indices, the delays, the step function, and (balancing by
    /// speed) every rank's speed for the next step's shares.
    pub(super) fn step<M: Module>(
        &mut self,
        trainer: &mut Trainer<M>,
        sampler: &mut DistributedSampler,
        step: usize,
        run: &FitOptions,
        step_fn: &mut impl FnMut(&mut Trainer<M>, &[usize]) -> Result<StepReport, TrainError>,
    ) -> Result<StepReport, FitError> {
        if self.faults.die_at == Some((self.node, step)) {
            crate::faults::die();
        }
        if self.faults.cut_at == Some((self.node, step)) && crate::faults::first_cut() {
            trainer
                .process_group()
                .abort("test fault: this node's links are cut");
        }
        if let Some(extra) = self.faults.step_delay(self.node, step) {
            std::thread::sleep(extra);
        }
        let _st = crate::trace::span(format!("step {step}"), "step");
        let sp = crate::trace::span("data", "data");
        self.shares = match &run.balance {
            Balance::Equal => None,
            Balance::Fixed(v) => Some(v.clone()),
            Balance::Speed => Some(self.balancer.shares(self.world)),
        };
        let idx = match &self.shares {
            None => sampler.indices(step),
            Some(s) => {
                trainer.set_sample_weight(s[self.rank], run.global_batch);
                sampler.indices_shared(step, s)
            }
        };
        drop(sp);
        if let Some(extra) = self.faults.rank_delay(self.rank) {
            let _s = crate::trace::span("slowed compute (test hook)", "compute");
            std::thread::sleep(extra);
        }
        // The debug knob: this rank computes `f` times slower. The extra time is spent before
        // the step's collectives, like a slower device, scaled by this step's samples.
        let mut slept_ms = 0.0;
        if let (Some(f), Some(per)) = (self.faults.slowdown_of(self.rank), self.per_sample_ms) {
            slept_ms = (f - 1.0) * per * idx.len() as f64;
            let _s = crate::trace::span("slowed compute (debug knob)", "compute");
            std::thread::sleep(Duration::from_secs_f64(slept_ms / 1e3));
        }
        let rep = step_fn(trainer, &idx)?;
        self.per_sample_ms = Some(rep.compute_ms / idx.len().max(1) as f64);
        if run.balance == Balance::Speed {
            // Everyone gets everyone's speed, so all ranks compute the same shares.
            let compute_ms = rep.compute_ms + slept_ms;
            let speed = idx.len() as f64 / (compute_ms / 1e3).max(1e-9);
            let pg = trainer.process_group();
            let n = pg.shard_range(self.world).len();
            let all = pg.all_gather(vec![speed as f32; n], self.world).wait()?;
            self.balancer.observe(&all);
        }
        Ok(rep)
    }
}
