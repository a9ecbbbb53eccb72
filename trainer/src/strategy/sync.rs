//! The gradient-sync trait every strategy implements ([`GradSync`]), what it works on during a
//! step ([`Held`], [`SyncCx`]), and the choice of one from the configuration ([`sync_for`]).

use super::diloco::{Diloco, DilocoSync};
use super::holds::{Holding, Replicas};
use super::{Reach, Stage, Strategy, ddp::Replicated, sharded::Sharded};
use crate::clock::StepClock;
use crate::error::TrainError;
use crate::flat::FlatLayout;
use crate::optim::ShardOptimizer;
use crate::transfer;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use std::ops::Range;
use wiretrain_comm::{ProcessGroup, RankTable, WireDtype, Work};

/// What a rank holds between steps.
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// What the model computes with: the full flat vector (stages 0-2, identical on every
    /// rank), or this rank's shard of every unit (stage 3).
    pub params: Vec<f32>,
    /// Stages 1-2: the f32 master of the owned elements (concatenated); `params` holds the
    /// values the gather decoded, which a narrow wire dtype rounds. Empty otherwise.
    pub master: Vec<f32>,
    /// The element ranges this rank owns (and keeps optimizer state for), in bucket order.
    pub owned: Vec<Range<usize>>,
    /// The communication buckets (the units under stage 3).
    pub buckets: Vec<Range<usize>>,
    /// Optimizer steps applied to the owned elements (counted when the optimizer has
    /// stepped, before any gather after it: what a heal compares).
    pub optimizer_steps: usize,
    /// Device-resident DDP, during a step's update: the flat parameters on the device (the
    /// model's, taken before the update; the optimizer's result after it). `None` otherwise.
    pub dev: Option<Tensor<1>>,
    /// Device-resident DDP: `params` lags the model's parameters, which live on the device
    /// (read back on demand: `Trainer::sync_host`).
    pub host_stale: bool,
}

impl Held {
    pub(crate) fn owned_len(&self) -> usize {
        self.owned.iter().map(|r| r.len()).sum()
    }

    /// Where bucket `b`'s owned elements sit in the concatenation of the owned ranges (the
    /// layout of the owned gradient, the stage 1-2 master and the stage 3 shard), for
    /// strategies that own a range of every bucket.
    pub(crate) fn owned_at(&self, b: usize) -> Range<usize> {
        let start: usize = self.owned[..b].iter().map(|r| r.len()).sum();
        start..start + self.owned[b].len()
    }

    /// The owned elements of `params`, concatenated: the f32 master stages 1-2 keep.
    pub(crate) fn owned_of(&self, params: &[f32]) -> Vec<f32> {
        self.owned
            .iter()
            .flat_map(|r| params[r.clone()].iter().copied())
            .collect()
    }
}

/// What a sync works with during one step.
pub(crate) struct SyncCx<'a> {
    pub pg: &'a mut ProcessGroup,
    pub layout: &'a FlatLayout,
    pub opt: &'a mut ShardOptimizer,
    pub clock: &'a StepClock,
    /// Element type between nodes for gradient reductions and parameter gathers.
    pub wire: WireDtype,
    pub lr: f64,
    /// This rank's gradient weight (see `Trainer::set_sample_weight`).
    pub sample_weight: f32,
    /// Gradient buckets for a 16-bit wire are narrowed on the device before they are read
    /// (the device-resident step; the host path reads them whole).
    pub narrow: bool,
    /// What this rank holds.
    pub held: &'a mut Held,
}

/// A reduced gradient: the mean over this rank's owned elements, concatenated; on the host
/// (what a collective returns) or on the device (device-resident DDP at world 1).
pub(crate) enum Grad {
    Host(Vec<f32>),
    Device(Box<Tensor<1>>),
}

impl Grad {
    /// The gradient on the host (one blocking read when it is on the device).
    pub(crate) fn into_host(self) -> Result<Vec<f32>, TrainError> {
        match self {
            Self::Host(v) => Ok(v),
            Self::Device(t) => transfer::read_f32(*t).map_err(|reason| {
                crate::optim::OptimError::ReadBack {
                    what: "the reduced gradient".into(),
                    reason,
                }
                .into()
            }),
        }
    }

    /// The gradient on `device` (one upload when it is on the host).
    pub(crate) fn into_device(self, device: &Device) -> Tensor<1> {
        match self {
            Self::Host(v) => transfer::upload(v, device),
            Self::Device(t) => *t,
        }
    }
}

/// A sync's reduction (see [`Grad`]).
pub(crate) type Reduced = Result<Grad, TrainError>;

/// How a strategy communicates gradients and updates the parameters it owns.
pub(crate) trait GradSync: Send {
    /// The element ranges this rank owns of the job's `buckets` (of `total` elements).
    fn owned(&self, pg: &ProcessGroup, buckets: &[Range<usize>], total: usize)
    -> Vec<Range<usize>>;

    /// Reduces this step's gradients (bucket by bucket, as they are flattened) and returns
    /// the mean gradient over this rank's owned elements, concatenated.
    fn reduce(&mut self, cx: &mut SyncCx<'_>, grads: &mut GradientsParams) -> Reduced;

    /// Starts the reduction of one bucket's flattened, weighed gradient (a unit's, in the
    /// unit-by-unit step, which issues each as soon as the unit's backward is done).
    fn issue(&self, cx: &mut SyncCx<'_>, flat: Vec<f32>) -> Work<Vec<f32>>;

    /// Copies what this rank keeps of bucket `b`'s reduced buffer (what [`GradSync::issue`]
    /// returned) into its place in `grad`, the owned gradient ([`Held::owned_len`] long).
    fn place(&self, cx: &SyncCx<'_>, b: usize, buf: &[f32], grad: &mut [f32]);

    /// Steps the optimizer on the owned elements with `grad` (scaled by `scale`) and
    /// brings `cx.held.params` up to date (device-resident DDP: `cx.held.dev`).
    fn update(&mut self, cx: &mut SyncCx<'_>, grad: Grad, scale: f32) -> Result<(), TrainError>;

    /// Where this sync's reductions travel (DiLoCo's inner steps: inside the node).
    fn reach(&self) -> Reach;

    /// Whether this sync keeps the parameters on the device (device-resident DDP): the
    /// trainer then hands the update the model's parameters in `held.dev` and takes the
    /// result from there.
    fn resident(&self) -> bool {
        false
    }

    /// The positions of the owned concatenation ([`Held::owned`]) this rank writes to a
    /// checkpoint, so that every element is written once and, where other ranks hold it too,
    /// no rank writes it all; `None`: this rank writes no file.
    fn checkpoint_piece(&self, pg: &ProcessGroup, held: &Held) -> Option<Range<usize>>;

    /// The f32 values of the owned elements, concatenated, that a checkpoint records (when
    /// the optimizer keeps no master on the device): the master, not a compute copy that a
    /// narrow wire dtype rounded.
    fn owned_values(&self, held: &Held) -> Vec<f32>;

    /// Which ranks of `table` hold the same state (what a heal takes a lost node's from).
    fn replicas(&self, table: &RankTable) -> Replicas;

    /// The elements this rank holds between steps, of a model of `total` (`prefetch`: units
    /// gathered ahead; `unit_overlap`: a unit's full gradient in flight beside the next's).
    fn holding(&self, held: &Held, total: usize, prefetch: usize, unit_overlap: bool) -> Holding;

    /// Whether this sync keeps an f32 master of the owned elements beside the parameters the
    /// model computes with (stages 1-2), taken from them at the start and after a load.
    fn keeps_master(&self) -> bool {
        false
    }

    /// After a checkpoint load: makes `cx.held.params` what a step's gather would give from
    /// the owned masters (a collective for the sharded strategies).
    fn refresh(&mut self, cx: &mut SyncCx<'_>) -> Result<(), TrainError>;

    /// DiLoCo's outer state, when this sync is DiLoCo.
    fn outer(&self) -> Option<&super::diloco::OuterState> {
        None
    }

    fn outer_mut(&mut self) -> Option<&mut super::diloco::OuterState> {
        None
    }

    /// DiLoCo, after a heal agreed on the outer state: with `to_anchor` (this rank's outer
    /// step was cut off and another rank's completed, or it joined) the parameters become
    /// the anchor; then, when no rank completed the round's outer step, it runs now (a
    /// collective of the healed world, each delta weighed by `weight` so that the mean is
    /// over the ranks that hold one). Returns whether it ran.
    fn heal_round(
        &mut self,
        _cx: &mut SyncCx<'_>,
        _to_anchor: bool,
        _weight: f32,
    ) -> Result<bool, TrainError> {
        Ok(false)
    }
}

/// The sync of `strategy`, wrapped in DiLoCo when `diloco` is set (then `params` is where its
/// first round starts). The configuration's builder has checked the pair.
/// `resident`: the parameters stay on the device where a sync can keep them there (DDP,
/// DiLoCo's inner DDP too).
pub(crate) fn sync_for(
    strategy: Strategy,
    diloco: Option<Diloco>,
    params: &[f32],
    resident: bool,
) -> Box<dyn GradSync> {
    let Some(d) = diloco else {
        let reach = Reach::of(strategy.scope());
        return match strategy.stage() {
            Stage::Replicated => Box::new(Replicated { reach, resident }),
            stage => Box::new(Sharded { stage, reach }),
        };
    };
    // DiLoCo's inner steps stay inside the node: replicated there (DDP), or sharded there
    // (hybrid, the only other strategy `diloco::check` lets through).
    let inner: Box<dyn GradSync> = match strategy.stage() {
        Stage::Replicated => Box::new(Replicated {
            reach: Reach::NodeOnly,
            resident,
        }),
        _ => Box::new(Sharded {
            stage: Stage::Gradients,
            reach: Reach::NodeOnly,
        }),
    };
    Box::new(DilocoSync::new(inner, d, params))
}

impl SyncCx<'_> {
    /// Bucket `range` of `grads` on the host, weighed, for a reduction over `reach` (see
    /// [`FlatLayout::read_grads`]: narrowed on the device when the reduction crosses nodes on
    /// a 16-bit wire).
    pub(crate) fn read_bucket(
        &mut self,
        reach: Reach,
        grads: &mut GradientsParams,
        range: Range<usize>,
    ) -> Vec<f32> {
        let narrow = (self.narrow && reach.crosses_nodes(self.pg)).then_some(self.wire);
        self.layout
            .read_grads(grads, range, self.opt.device(), self.sample_weight, narrow)
    }
}
