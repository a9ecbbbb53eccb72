//! DiLoCo (Douillard et al. 2023) as a wrapper around an inner sync: the inner steps reduce
//! inside the node only (DDP or hybrid there); every `inner_steps` steps the nodes average
//! their parameter deltas, in the wire dtype (the only bytes between nodes), and apply an
//! outer Nesterov-momentum SGD step: m = μ m + Δ, θ = θ₀ − lr (Δ + μ m).

use super::Strategy;
use super::holds::{Holding, Replicas};
use super::sync::{Grad, GradSync, Held, Reduced, SyncCx};
use crate::clock::Phase;
use crate::error::{ConfigError, TrainError};
use burn::optim::GradientsParams;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::ops::Range;
use wiretrain_comm::{CallOpts, ProcessGroup, RankTable, ReduceOp, Work};

/// DiLoCo's outer loop: defaults outer lr 0.7, momentum 0.9.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Diloco {
    /// Inner (local) optimizer steps per outer step (H).
    pub inner_steps: usize,
    /// The outer SGD step's learning rate.
    pub outer_lr: f32,
    /// The outer Nesterov momentum μ, in [0, 1).
    pub outer_momentum: f32,
}

impl Default for Diloco {
    fn default() -> Self {
        Self {
            inner_steps: 50,
            outer_lr: 0.7,
            outer_momentum: 0.9,
        }
    }
}

/// Checks DiLoCo's settings over `strategy` (the builder of the trainer's configuration calls
/// it, once).
pub(crate) fn check(strategy: Strategy, d: Diloco) -> Result<(), ConfigError> {
    if !matches!(strategy, Strategy::Ddp | Strategy::Hybrid) {
        return Err(ConfigError::DilocoStrategy(strategy));
    }
    if d.inner_steps == 0 {
        return Err(ConfigError::DilocoInnerSteps);
    }
    if !(d.outer_lr.is_finite() && d.outer_lr > 0.0) {
        return Err(ConfigError::OuterLr(d.outer_lr));
    }
    if !(0.0..1.0).contains(&d.outer_momentum) {
        return Err(ConfigError::OuterMomentum(d.outer_momentum));
    }
    Ok(())
}

/// DiLoCo's state: the parameters at the start of the round and the outer momentum.
#[derive(Debug, Clone, Default)]
pub(crate) struct OuterState {
    pub anchor: Vec<f32>,
    pub momentum: Vec<f32>,
    pub inner_done: usize,
    /// Outer steps applied: `inner_done / inner_steps`, or one fewer while the round's outer
    /// step is pending (a failure cut it off; a heal runs it).
    pub rounds: usize,
}

impl OuterState {
    /// SHA-256 over the anchor, the momentum and both counters (what a heal compares).
    pub(crate) fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for v in [&self.anchor, &self.momentum] {
            h.update((v.len() as u64).to_le_bytes());
            h.update(bytemuck::cast_slice::<f32, u8>(v));
        }
        h.update((self.inner_done as u64).to_le_bytes());
        h.update((self.rounds as u64).to_le_bytes());
        h.finalize().into()
    }
}

/// The wrapper: `inner` runs every step, the outer step every `cfg.inner_steps`.
pub(crate) struct DilocoSync {
    inner: Box<dyn GradSync>,
    cfg: Diloco,
    outer: OuterState,
}

impl DilocoSync {
    /// A first round that starts at `params`.
    pub(crate) fn new(inner: Box<dyn GradSync>, cfg: Diloco, params: &[f32]) -> Self {
        Self {
            inner,
            cfg,
            outer: OuterState {
                anchor: params.to_vec(),
                momentum: vec![0.0; params.len()],
                inner_done: 0,
                rounds: 0,
            },
        }
    }

    /// The outer step that ends the round `inner_done` closes: the mean of the nodes'
    /// deltas from the anchor (each weighed by `weight`: 1, or in a heal the world over the
    /// ranks that hold a delta), the Nesterov update, and every node restarting at the anchor.
    fn apply_outer(&mut self, cx: &mut SyncCx<'_>, weight: f32) -> Result<(), TrainError> {
        let _s = cx.clock.enter(Phase::Comm, "outer step");
        let outer = &mut self.outer;
        let delta: Vec<f32> = outer
            .anchor
            .iter()
            .zip(&cx.held.params)
            .map(|(a, p)| (a - p) * weight)
            .collect();
        let delta = cx
            .pg
            .call(CallOpts::wire(cx.wire).tag("diloco delta"))
            .all_reduce(delta, ReduceOp::Mean)
            .wait()?;
        let (lr, mu) = (self.cfg.outer_lr, self.cfg.outer_momentum);
        for (((a, m), p), g) in outer
            .anchor
            .iter_mut()
            .zip(outer.momentum.iter_mut())
            .zip(cx.held.params.iter_mut())
            .zip(&delta)
        {
            *m = mu * *m + g;
            *a -= lr * (g + mu * *m);
            *p = *a;
        }
        outer.rounds = outer.inner_done / self.cfg.inner_steps;
        follow_params(cx)
    }
}

/// The optimizer's master (the whole vector when replicated, the owned pieces when sharded
/// inside the node) follows `held.params`; the fused optimizer keeps its own copy on the
/// device.
fn follow_params(cx: &mut SyncCx<'_>) -> Result<(), TrainError> {
    let held = &mut *cx.held;
    let master = if held.master.is_empty() {
        &held.params
    } else {
        held.master = held.owned_of(&held.params);
        &held.master
    };
    Ok(cx.opt.set_master(master)?)
}

impl GradSync for DilocoSync {
    fn reach(&self) -> super::Reach {
        self.inner.reach()
    }

    fn owned(
        &self,
        pg: &ProcessGroup,
        buckets: &[Range<usize>],
        total: usize,
    ) -> Vec<Range<usize>> {
        self.inner.owned(pg, buckets, total)
    }

    fn reduce(&mut self, cx: &mut SyncCx<'_>, grads: &mut GradientsParams) -> Reduced {
        self.inner.reduce(cx, grads)
    }

    fn issue(&self, cx: &mut SyncCx<'_>, flat: Vec<f32>) -> Work<Vec<f32>> {
        self.inner.issue(cx, flat)
    }

    fn place(&self, cx: &SyncCx<'_>, b: usize, buf: &[f32], grad: &mut [f32]) {
        self.inner.place(cx, b, buf, grad)
    }

    fn update(&mut self, cx: &mut SyncCx<'_>, grad: Grad, scale: f32) -> Result<(), TrainError> {
        // An inner step counts when the optimizer stepped, as `optimizer_steps` does (a
        // gather after it may still fail).
        let before = cx.held.optimizer_steps;
        let res = self.inner.update(cx, grad, scale);
        if cx.held.optimizer_steps > before {
            self.outer.inner_done += 1;
        }
        res?;
        if !self.outer.inner_done.is_multiple_of(self.cfg.inner_steps) {
            return Ok(());
        }
        // A device-resident inner DDP holds the round's result on the device: the outer step
        // reads it once and puts the new parameters back once. An inner hybrid's gathered
        // parameters went up too, but its host vector is current: the outer step's result
        // replaces them (one upload, by the trainer).
        let on_device = cx.held.dev.take().filter(|_| self.inner.resident());
        if let Some(dev) = on_device.clone() {
            cx.held.params = crate::transfer::read_f32(dev).map_err(|reason| {
                crate::optim::OptimError::ReadBack {
                    what: "the parameters for the outer step".into(),
                    reason,
                }
            })?;
        }
        let res = self.apply_outer(cx, 1.0);
        cx.held.dev = match (on_device, &res) {
            (Some(_), Ok(())) => Some(crate::transfer::upload(
                cx.held.params.clone(),
                cx.opt.device(),
            )),
            (dev, _) => dev,
        };
        res
    }

    fn resident(&self) -> bool {
        self.inner.resident()
    }

    fn refresh(&mut self, cx: &mut SyncCx<'_>) -> Result<(), TrainError> {
        self.inner.refresh(cx)
    }

    fn checkpoint_piece(&self, pg: &ProcessGroup, held: &Held) -> Option<Range<usize>> {
        self.inner.checkpoint_piece(pg, held)
    }

    fn keeps_master(&self) -> bool {
        self.inner.keeps_master()
    }

    fn owned_values(&self, held: &Held) -> Vec<f32> {
        self.inner.owned_values(held)
    }

    fn replicas(&self, _: &RankTable) -> Replicas {
        Replicas::NodesApart
    }

    fn holding(&self, held: &Held, total: usize, prefetch: usize, unit_overlap: bool) -> Holding {
        self.inner.holding(held, total, prefetch, unit_overlap)
    }

    fn outer(&self) -> Option<&OuterState> {
        Some(&self.outer)
    }

    fn outer_mut(&mut self) -> Option<&mut OuterState> {
        Some(&mut self.outer)
    }

    fn heal_round(
        &mut self,
        cx: &mut SyncCx<'_>,
        to_anchor: bool,
        weight: f32,
    ) -> Result<bool, TrainError> {
        if to_anchor {
            cx.held.params.clone_from(&self.outer.anchor);
            follow_params(cx)?;
        }
        let (done, h) = (self.outer.inner_done, self.cfg.inner_steps);
        if done.is_multiple_of(h) && self.outer.rounds < done / h {
            self.apply_outer(cx, weight)?;
            return Ok(true);
        }
        Ok(false)
    }
}
