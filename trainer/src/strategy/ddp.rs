//! Stage 0, DDP: every rank owns the whole flat vector; each gradient bucket's mean
//! all-reduce is in flight while the next bucket is flattened, then every rank runs the same
//! optimizer step on everything.

use super::Reach;
use super::sync::{GradSync, Reduced, SyncCx, weigh};
use crate::clock::Phase;
use crate::error::TrainError;
use crate::optim::StepOpts;
use burn::optim::GradientsParams;
use std::ops::Range;
use wiretrain_comm::{ProcessGroup, WireDtype, Work};

/// The replicated sync; `reach` is the world, or the node alone under DiLoCo.
pub(crate) struct Replicated {
    pub reach: Reach,
}

impl GradSync for Replicated {
    fn owned(&self, _: &ProcessGroup, _: &[Range<usize>], total: usize) -> Vec<Range<usize>> {
        std::iter::once(0..total).collect()
    }

    fn reduce(&mut self, cx: &mut SyncCx<'_>, grads: &mut GradientsParams) -> Reduced {
        let held = &*cx.held;
        let mut works: Vec<(Range<usize>, Work<Vec<f32>>)> = Vec::new();
        let issue = cx.clock.enter(Phase::Compute, "flatten+issue");
        for b in &held.buckets {
            let mut flat = Vec::new();
            cx.layout.flatten_grads(grads, b.clone(), &mut flat);
            weigh(&mut flat, cx.sample_weight);
            works.push((b.clone(), self.reach.all_reduce(cx.pg, cx.wire, flat)));
        }
        drop(issue);
        let mut full = vec![0.0f32; cx.layout.total()];
        for (b, w) in works {
            let _wait = cx.clock.enter(Phase::Comm, format!("wait {}", w.id()));
            full[b].copy_from_slice(&w.wait()?);
        }
        Ok(full)
    }

    fn issue(&self, cx: &mut SyncCx<'_>, flat: Vec<f32>) -> Work<Vec<f32>> {
        self.reach.all_reduce(cx.pg, cx.wire, flat)
    }

    fn place(&self, cx: &SyncCx<'_>, b: usize, buf: &[f32], grad: &mut [f32]) {
        grad[cx.held.buckets[b].clone()].copy_from_slice(buf);
    }

    fn update(&mut self, cx: &mut SyncCx<'_>, grad: &[f32], scale: f32) -> Result<(), TrainError> {
        let _s = cx.clock.enter(Phase::Optim, "optimizer");
        // The micro-batch mean is taken in the step (on the device when fused).
        let opts = StepOpts {
            grad_scale: scale,
            readback: WireDtype::F32,
        };
        cx.opt.step_with(cx.lr, &mut cx.held.params, grad, opts)?;
        cx.held.optimizer_steps += 1;
        Ok(())
    }

    fn refresh(&mut self, _: &mut SyncCx<'_>) -> Result<(), TrainError> {
        Ok(())
    }
}
