//! Stages 1-3 at world or node scope (ZeRO-1/2/3, hybrid, HSDP): each rank owns its pieces of
//! every bucket (its shard, or its node shard) and keeps optimizer state for those only.
//!
//! * Stage 1 issues every bucket's reduction and waits for them together.
//! * Stage 2 waits for each bucket's reduction before flattening the next, so a rank holds
//!   its gradient shard plus one bucket.
//! * Stages 1-2 then step the f32 master of the owned pieces and gather every rank's pieces
//!   (in the wire dtype) into the parameters the model computes with.
//! * Stage 3 keeps only its shard at rest; the unit-by-unit step (`engine::units`) reduces
//!   through the same [`Reach`], and this sync only steps the shard.

use super::holds::{Holding, Replicas};
use super::sync::{Grad, GradSync, Held, Reduced, SyncCx};
use super::{Reach, Stage, Strategy};
use crate::clock::Phase;
use crate::error::{ConfigError, TrainError};
use crate::optim::StepOpts;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use std::ops::Range;
use wiretrain_comm::{CallOpts, Group, ProcessGroup, RankTable, ReduceOp, Work};

/// The sharded sync of `stage` (1, 2 or 3) over `reach`.
pub(crate) struct Sharded {
    pub stage: Stage,
    pub reach: Reach,
}

impl Sharded {
    /// Gathers every rank's pieces of every bucket (its master, in the wire dtype) into the
    /// parameters the model computes with, all buckets in flight at once. With `upload`
    /// (after an optimizer step), each gathered bucket also goes up to the device as soon as
    /// it is back, while later ones travel, and `held.dev` is the model's new flat parameters
    /// there: no whole-vector copy and upload after the last gather.
    fn gather(&self, cx: &mut SyncCx<'_>, upload: bool) -> Result<(), TrainError> {
        let held = &mut *cx.held;
        let issue = cx.clock.enter(Phase::Comm, "issue gathers");
        let mut works = Vec::with_capacity(held.buckets.len());
        let mut at = 0;
        for b in &held.buckets {
            let n = self.reach.share(cx.pg, b.len());
            let w = self
                .reach
                .gather(cx.pg, cx.wire, &held.master[at..at + n], b.len());
            at += n;
            works.push((b.clone(), w));
        }
        drop(issue);
        let mut parts = Vec::with_capacity(if upload { works.len() } else { 0 });
        for (b, w) in works {
            let _wait = cx.clock.enter(Phase::Comm, format!("wait {}", w.id()));
            let full = w.wait()?;
            held.params[b].copy_from_slice(&full);
            if upload {
                parts.push(crate::transfer::upload(full, cx.opt.device()));
            }
        }
        held.dev = (!parts.is_empty()).then(|| Tensor::cat(parts, 0));
        Ok(())
    }
}

impl Sharded {
    /// Waits for each reduction and keeps this rank's share of it in `gshard`.
    fn wait_place(
        &self,
        cx: &mut SyncCx<'_>,
        works: impl Iterator<Item = (usize, Work<Vec<f32>>)>,
        gshard: &mut [f32],
    ) -> Result<(), TrainError> {
        for (b, w) in works {
            let _wait = cx.clock.enter(Phase::Comm, format!("wait {}", w.id()));
            let buf = w.wait()?;
            self.place(cx, b, &buf, gshard);
        }
        Ok(())
    }
}

impl GradSync for Sharded {
    fn reach(&self) -> Reach {
        self.reach
    }

    fn owned(&self, pg: &ProcessGroup, buckets: &[Range<usize>], _: usize) -> Vec<Range<usize>> {
        self.reach.owned(pg, buckets)
    }

    fn reduce(&mut self, cx: &mut SyncCx<'_>, grads: &mut GradientsParams) -> Reduced {
        if self.stage == Stage::Parameters {
            let strategy = if self.reach == Reach::World {
                Strategy::Zero3
            } else {
                Strategy::Hsdp
            };
            return Err(ConfigError::NeedsUnits {
                strategy,
                use_instead: "Trainer::step_units",
            }
            .into());
        }
        let mut gshard = vec![0.0f32; cx.held.owned_len()];
        let mut pending: Vec<(usize, Work<Vec<f32>>)> = Vec::new();
        for (i, b) in cx.held.buckets.clone().into_iter().enumerate() {
            let flatten = cx.clock.enter(Phase::Compute, "flatten bucket");
            let flat = cx.read_bucket(self.reach, grads, b);
            drop(flatten);
            let issue = cx.clock.enter(Phase::Comm, "issue reduce");
            let w = self.issue(cx, flat);
            drop(issue);
            pending.push((i, w));
            // ZeRO-2: the full bucket is reduced and dropped before the next exists.
            if self.stage == Stage::Gradients {
                self.wait_place(cx, pending.drain(..), &mut gshard)?;
            }
        }
        self.wait_place(cx, pending.drain(..), &mut gshard)?;
        Ok(Grad::Host(gshard))
    }

    fn issue(&self, cx: &mut SyncCx<'_>, flat: Vec<f32>) -> Work<Vec<f32>> {
        self.reach.reduce(cx.pg, cx.wire, flat)
    }

    fn place(&self, cx: &SyncCx<'_>, b: usize, buf: &[f32], grad: &mut [f32]) {
        self.reach
            .take_share(cx.pg, buf, &mut grad[cx.held.owned_at(b)]);
    }

    fn update(&mut self, cx: &mut SyncCx<'_>, grad: Grad, scale: f32) -> Result<(), TrainError> {
        let grad = grad.into_host()?;
        // Only the gathered (wire-rounded) values leave the optimizer: when fused, the f32
        // master stays on the device and the cast kernel narrows the read-back.
        let opts = StepOpts {
            grad_scale: scale,
            readback: cx.wire,
        };
        if matches!(self.reach, Reach::Hybrid) {
            // Every rank of the node got its reduced shard before any steps its optimizer
            // (a node barrier in shared memory): a node losing a peer mid-step has stepped
            // all its shards or none, so its state is one step of the replicas' (healing).
            let _b = cx.clock.enter(Phase::Comm, "node barrier");
            cx.pg
                .call(CallOpts::default().on(Group::Node).tag("node barrier"))
                .all_reduce(vec![0.0], ReduceOp::Sum)
                .wait()?;
        }
        let target = if self.stage == Stage::Parameters {
            &mut cx.held.params
        } else {
            &mut cx.held.master
        };
        let optim = cx.clock.enter(Phase::Optim, "optimizer");
        cx.opt.step_with(cx.lr, target, &grad, opts)?;
        cx.held.optimizer_steps += 1;
        drop(optim);
        if self.stage == Stage::Parameters {
            return Ok(());
        }
        self.gather(cx, true)
    }

    fn refresh(&mut self, cx: &mut SyncCx<'_>) -> Result<(), TrainError> {
        if self.stage == Stage::Parameters {
            return Ok(());
        }
        self.gather(cx, false)
    }

    fn checkpoint_piece(&self, pg: &ProcessGroup, held: &Held) -> Option<Range<usize>> {
        let len = held.owned_len();
        match self.reach {
            Reach::World => Some(0..len),
            Reach::NodeOnly => (len > 0).then_some(0..len),
            // Every node holds the same shards: node k writes the k-th of equal pieces of
            // this rank's shard, so each element is written once and no node writes it all.
            Reach::Hybrid => {
                let (k, nodes) = (pg.node(), pg.table().num_nodes());
                let piece = len * k / nodes..len * (k + 1) / nodes;
                (!piece.is_empty()).then_some(piece)
            }
        }
    }

    fn keeps_master(&self) -> bool {
        self.stage != Stage::Parameters
    }

    fn owned_values(&self, held: &Held) -> Vec<f32> {
        match self.stage {
            // Stage 3 holds only its shards, in f32.
            Stage::Parameters => held.params.clone(),
            // The f32 master, not the compute copy a narrow wire dtype rounds.
            _ => held.master.clone(),
        }
    }

    fn replicas(&self, table: &RankTable) -> Replicas {
        match self.reach {
            Reach::World => Replicas::None(
                "shards its state over every rank: a lost node's shards exist nowhere else",
            ),
            // Each local rank's shard is replicated on the other nodes.
            Reach::Hybrid => Replicas::Groups(
                table
                    .nodes()
                    .iter()
                    .flat_map(|n| 0..n.devices.len())
                    .collect(),
            ),
            Reach::NodeOnly => Replicas::NodesApart,
        }
    }

    fn holding(&self, held: &Held, total: usize, prefetch: usize, unit_overlap: bool) -> Holding {
        let max_bucket = held.buckets.iter().map(|b| b.len()).max().unwrap_or(0);
        Holding {
            params: match self.stage {
                Stage::Parameters => held.owned_len() + (1 + prefetch) * max_bucket,
                _ => total,
            },
            grads: match self.stage {
                Stage::OptimizerState => total,
                _ => held.owned_len() + max_bucket * if unit_overlap { 2 } else { 1 },
            },
        }
    }
}
