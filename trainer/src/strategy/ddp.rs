//! Stage 0, DDP: every rank owns the whole flat vector; each gradient bucket's mean
//! all-reduce is in flight while the next bucket is flattened, then every rank runs the same
//! optimizer step on everything.
//!
//! Device-resident (`resident`, the default, DiLoCo's inner steps too): each bucket is put together on
//! the device and read once; each reduced bucket goes up once, as soon as its all-reduce is
//! back (while later buckets still travel); the optimizer steps the
//! parameters on the device and the model's parameters become views of its result, so no
//! parameter crosses to the host. At world 1 (or inside a node of one rank, DiLoCo's inner
//! steps) not even the gradient does.

use super::Reach;
use super::holds::{Holding, Replicas};
use super::sync::{Grad, GradSync, Held, Reduced, SyncCx};
use crate::clock::Phase;
use crate::error::TrainError;
use crate::optim::StepOpts;
use crate::transfer;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use std::collections::VecDeque;
use std::ops::Range;
use wiretrain_comm::{ProcessGroup, RankTable, WireDtype, Work};

/// The replicated sync; `reach` is the world, or the node alone under DiLoCo.
pub(crate) struct Replicated {
    pub reach: Reach,
    /// The parameters live on the device (see the module doc).
    pub resident: bool,
}

impl Replicated {
    /// Alone in its reach, device-resident: the gradient stays on the device (one concatenation of the
    /// parameters' gradients), weighed there.
    fn reduce_on_device(&self, cx: &mut SyncCx<'_>, grads: &mut GradientsParams) -> Reduced {
        let _f = cx.clock.enter(Phase::Compute, "flatten");
        let all = 0..cx.layout.total();
        let g = cx.layout.grads_device(grads, all, cx.opt.device());
        let w = cx.sample_weight;
        Ok(Grad::Device(Box::new(if w == 1.0 { g } else { g * w })))
    }
}

/// Uploads the reductions at the front of `works` that are already back, in order, without
/// waiting for any.
fn upload_ready(
    works: &mut VecDeque<(Range<usize>, Work<Vec<f32>>)>,
    parts: &mut Vec<Tensor<1>>,
    device: &burn::tensor::Device,
) -> Result<(), TrainError> {
    while let Some((b, w)) = works.pop_front() {
        match w.try_wait() {
            Ok(done) => parts.push(transfer::upload(done?, device)),
            Err(w) => {
                works.push_front((b, w));
                break;
            }
        }
    }
    Ok(())
}

impl GradSync for Replicated {
    fn reach(&self) -> Reach {
        self.reach
    }

    fn owned(&self, _: &ProcessGroup, _: &[Range<usize>], total: usize) -> Vec<Range<usize>> {
        std::iter::once(0..total).collect()
    }

    fn reduce(&mut self, cx: &mut SyncCx<'_>, grads: &mut GradientsParams) -> Reduced {
        // Alone in its reach (world 1, or DiLoCo's inner steps on a node of one rank): the
        // mean is the rank's own gradient.
        let alone = match self.reach {
            Reach::NodeOnly => cx.pg.table().ranks_on(cx.pg.node()) == 1,
            _ => cx.pg.world() == 1,
        };
        if self.resident && alone && cx.layout.total() > 0 {
            return self.reduce_on_device(cx, grads);
        }
        let mut works: VecDeque<(Range<usize>, Work<Vec<f32>>)> = VecDeque::new();
        // Device-resident: the reduced buckets that went up, in bucket order.
        let mut parts = Vec::new();
        let issue = cx.clock.enter(Phase::Compute, "flatten+issue");
        for b in cx.held.buckets.clone() {
            let flat = cx.read_bucket(self.reach, grads, b.clone());
            works.push_back((b.clone(), self.reach.all_reduce(cx.pg, cx.wire, flat)));
            if self.resident {
                // A pipeline of buckets: while bucket i+1 is read and bucket i reduced, the
                // buckets already back go up.
                upload_ready(&mut works, &mut parts, cx.opt.device())?;
            }
        }
        drop(issue);
        if self.resident {
            // The rest go up as each is back, while later ones travel.
            for (_, w) in works {
                let _wait = cx.clock.enter(Phase::Comm, format!("wait {}", w.id()));
                parts.push(transfer::upload(w.wait()?, cx.opt.device()));
            }
            return Ok(Grad::Device(Box::new(Tensor::cat(parts, 0))));
        }
        let mut full = vec![0.0f32; cx.layout.total()];
        for (b, w) in works {
            let _wait = cx.clock.enter(Phase::Comm, format!("wait {}", w.id()));
            full[b].copy_from_slice(&w.wait()?);
        }
        Ok(Grad::Host(full))
    }

    fn issue(&self, cx: &mut SyncCx<'_>, flat: Vec<f32>) -> Work<Vec<f32>> {
        self.reach.all_reduce(cx.pg, cx.wire, flat)
    }

    fn place(&self, cx: &SyncCx<'_>, b: usize, buf: &[f32], grad: &mut [f32]) {
        grad[cx.held.buckets[b].clone()].copy_from_slice(buf);
    }

    fn update(&mut self, cx: &mut SyncCx<'_>, grad: Grad, scale: f32) -> Result<(), TrainError> {
        let _s = cx.clock.enter(Phase::Optim, "optimizer");
        if self.resident {
            // An empty model has no parameters on the device: nothing to step.
            if let Some(params) = cx.held.dev.take() {
                let g = grad.into_device(cx.opt.device());
                cx.held.dev = Some(cx.opt.step_device(cx.lr, params, g, scale)?);
            }
            cx.held.optimizer_steps += 1;
            return Ok(());
        }
        // The micro-batch mean is taken in the step (on the device when fused).
        let opts = StepOpts {
            grad_scale: scale,
            readback: WireDtype::F32,
        };
        let grad = grad.into_host()?;
        cx.opt.step_with(cx.lr, &mut cx.held.params, &grad, opts)?;
        cx.held.optimizer_steps += 1;
        Ok(())
    }

    fn refresh(&mut self, _: &mut SyncCx<'_>) -> Result<(), TrainError> {
        Ok(())
    }

    fn resident(&self) -> bool {
        self.resident
    }

    fn checkpoint_piece(&self, pg: &ProcessGroup, held: &Held) -> Option<Range<usize>> {
        let piece = match self.reach {
            // Every rank of the node holds it all (DiLoCo's inner DDP): its first writes it.
            Reach::NodeOnly => (pg.local_rank() == 0).then(|| 0..held.owned_len())?,
            // Every rank holds it all: each writes its share, so no rank writes it all.
            Reach::World | Reach::Hybrid => pg.shard_range(held.owned_len()),
        };
        (!piece.is_empty()).then_some(piece)
    }

    fn owned_values(&self, held: &Held) -> Vec<f32> {
        held.owned_of(&held.params)
    }

    fn replicas(&self, table: &RankTable) -> Replicas {
        match self.reach {
            Reach::NodeOnly => Replicas::NodesApart,
            Reach::World | Reach::Hybrid => Replicas::Groups(vec![0; table.world()]),
        }
    }

    fn holding(&self, _: &Held, total: usize, _: usize, _: bool) -> Holding {
        Holding {
            params: total,
            grads: total,
        }
    }
}
