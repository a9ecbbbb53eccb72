//! The trainer: runs one optimizer step of a Burn module under a
//! [`Strategy`](crate::strategy::Strategy) across the ranks of a [`ProcessGroup`].
//!
//! A complete, tested example is in the crate documentation ([`crate`]); in short:
//! `Trainer::new(model, &device, TrainerConfig::new(Strategy::Zero2), pg)?`, then per step
//! `trainer.step(|m| m.loss(&batch))?` (forward, backward, communication, update), or
//! `trainer.step_accumulate(k, |m, i| ...)` for k micro-batches per step, or, for ZeRO-3,
//! `Trainer::with_units` and `trainer.step_units(input, loss_fn)`.

use crate::clock::{Phase, StepClock};
use crate::flat::FlatLayout;
use crate::optim::ShardOptimizer;
use crate::strategy::{GradSync, Held, SyncCx, sync_for};
use crate::transfer::{self, DeviceMemory, TransferCounts};
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use wiretrain_comm::{CallOpts, ProcessGroup, ReduceOp, WireDtype};

pub use crate::error::{ConfigError, ModelMismatch, OtherRank, TrainError};
pub use crate::strategy::diloco::Diloco;

mod agreement;
mod buffers;
pub(crate) use agreement::check_agreement;
mod ckpt;
mod config;
mod heal;
mod recover;
mod report;
mod start;
mod units;
pub(crate) use units::unit_ranges;

pub use config::{Overlap, TrainerConfig, TrainerConfigBuilder};
pub(crate) use heal::Agreed;
pub use recover::RecoverError;
pub(crate) use recover::{Recovered, Recovery};
pub use report::{MemoryReport, StepReport, hidden_share};
pub use units::effective_units;

/// One rank's trainer: its model, its part of the flat parameters and of the optimizer state,
/// and the strategy's gradient sync with the other ranks of its process group.
pub struct Trainer<M: Module> {
    model: Option<M>,
    layout: FlatLayout,
    pg: ProcessGroup,
    cfg: TrainerConfig,
    /// Parameters, masters, owned ranges and buckets (see [`Held`]).
    held: Held,
    /// The strategy's gradient sync, chosen once from `cfg`.
    sync: Box<dyn GradSync>,
    /// Stages 0-2 on a unit model with overlap on: the buckets are the units and
    /// `step_units` reduces each unit's gradient while earlier units' backward runs.
    unit_overlap: bool,
    /// A unit model's effective unit count (see `units::effective_units`).
    units_effective: Option<f64>,
    opt: ShardOptimizer,
    memory: MemoryReport,
    stop: Option<Arc<AtomicBool>>,
    /// Raised when this node is asked to regroup (a growth in place).
    regroup: Option<Arc<AtomicBool>>,
    /// `pg.bytes_sent()` and `pg.comm_busy()` when the current step began.
    sent_at_start: u64,
    busy_at_start: Duration,
    /// This thread's transfer counts when the current step began.
    xfer_at_start: TransferCounts,
    /// Device memory readings of the current step.
    step_mem: DeviceMemory,
    /// This rank's device (without autodiff).
    device: Device,
    /// This rank's gradient and loss weight: share · world / global batch (1 with equal
    /// shares), so the mean over ranks is the global-batch mean (see `set_sample_weight`).
    sample_weight: f32,
    /// The run id written into checkpoint manifests (fresh per run, kept across resume).
    run_id: String,
    /// The model holds state that is not trained (flat::buffers).
    has_buffers: bool,
}

impl<M: Module> Trainer<M> {
    /// Checks that every rank has the same model, starts every rank from rank 0's parameters
    /// and allocates this rank's optimizer state. For
    /// [`Strategy::Zero3`](crate::strategy::Strategy::Zero3) use [`Trainer::with_units`].
    pub fn new(
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Self, TrainError> {
        if cfg.strategy.shards_params() {
            return Err(ConfigError::NeedsUnits {
                strategy: cfg.strategy,
                use_instead: "Trainer::with_units",
            }
            .into());
        }
        Self::build(model, device, cfg, pg, None)
    }

    /// `units`: the unit ranges of `layout`, which become the buckets (stage 3, or stages
    /// 0-2 with overlap).
    fn build(
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        mut pg: ProcessGroup,
        units: Option<(Vec<Range<usize>>, FlatLayout)>,
    ) -> Result<Self, TrainError> {
        let (unit_ranges, layout) = match units {
            Some((u, l)) => (Some(u), l),
            None => (None, FlatLayout::of(&model)),
        };
        let unit_overlap = unit_ranges.is_some() && !cfg.strategy.shards_params();
        let has_buffers = crate::flat::buffers::count(&model) > 0;
        check_agreement(&mut pg, &layout)?;
        crate::memcap::check_group(cfg.strategy, layout.total(), &pg)?;
        // ZeRO-3 and HSDP take rank 0's parameters unit by unit (`start`); the others whole.
        let by_unit = cfg.strategy.shards_params() && unit_ranges.is_some();
        let params = if by_unit {
            Vec::new()
        } else {
            pg.broadcast(layout.flatten_params(&model), 0).wait()?
        };
        let buckets = unit_ranges
            .clone()
            .unwrap_or_else(|| layout.buckets(cfg.bucket_bytes / 4));
        // Device-resident DDP (DiLoCo's inner DDP too: its outer step reads the parameters
        // once a round).
        let sync = sync_for(cfg.strategy, cfg.diloco, &params, cfg.device_resident);
        let resident = sync.resident();
        let owned = sync.owned(&pg, &buckets, layout.total());
        let mut held = Held {
            owned,
            buckets,
            ..Held::default()
        };
        let (model, params) = match &unit_ranges {
            // At rest a ZeRO-3 rank holds its shard of every unit and a module of placeholders.
            Some(u) if by_unit => start::shard_units(model, &layout, u, &held.owned, &mut pg)?,
            _ => (layout.unflatten(model, &params), params),
        };
        held.params = params;
        let opt = optimizer_for(&cfg, device, held.owned_len(), resident);
        let h = sync.holding(&held, layout.total(), cfg.prefetch, unit_overlap);
        let memory = MemoryReport {
            params_bytes: 4 * h.params,
            grads_bytes: 4 * h.grads,
            optim_bytes: opt.state_bytes(),
        };
        let mut trainer = Self {
            model: Some(model),
            layout,
            pg,
            cfg,
            held,
            sync,
            unit_overlap,
            units_effective: None,
            opt,
            memory,
            stop: None,
            regroup: None,
            sent_at_start: 0,
            busy_at_start: Duration::ZERO,
            xfer_at_start: TransferCounts::default(),
            step_mem: DeviceMemory::default(),
            device: device.clone().inner(),
            sample_weight: 1.0,
            run_id: format!("{:016x}", rand::random::<u64>()),
            has_buffers,
        };
        trainer.reset_master();
        Ok(trainer)
    }

    /// Stages 1-2 keep an f32 master of their owned elements: it is taken from the
    /// parameters (at the start, and after a load).
    fn reset_master(&mut self) {
        self.opt.forget_master();
        if self.sync.keeps_master() {
            self.held.master = self.held.owned_of(&self.held.params);
        }
    }

    /// The model as this rank holds it between steps (under ZeRO-3 and HSDP with placeholder
    /// parameters; [`Trainer::into_full_model`] gathers them).
    pub fn model(&self) -> &M {
        self.model.as_ref().expect("model present between steps")
    }

    /// The model, its non-trained state (BatchNorm's running statistics) current; under ZeRO-3
    /// and HSDP with the placeholders held at rest ([`Trainer::into_full_model`] gathers).
    pub fn into_model(mut self) -> M {
        let model = self.model.take().expect("model present between steps");
        // Folds a RunningState's pending update into its value (shared with `model`).
        drop(model.valid());
        model
    }

    /// Where each parameter lies in the flat vector.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The configuration this trainer runs with.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// "adamw (fused wgsl)", "adamw" (Burn's) or "sgd".
    pub fn optimizer_path(&self) -> &'static str {
        if self.opt.is_fused() {
            "adamw (fused wgsl)"
        } else {
            self.opt.kind()
        }
    }

    /// Calls of wiretrain's WGSL kernels on this rank's device (fused optimizer only).
    pub fn kernel_counters(&self) -> Option<wiretrain_shaders::Counters> {
        self.opt.kernel_counters()
    }

    /// The parameters this rank holds between steps: the full flat vector (identical on every
    /// rank) for DDP, ZeRO-1 and ZeRO-2; this rank's shard of every unit for ZeRO-3. Under
    /// device-resident DDP a read of the device when a step changed them.
    pub fn params(&mut self) -> Result<&[f32], TrainError> {
        self.sync_host()?;
        Ok(&self.held.params)
    }

    /// Whether the parameters live on the device between steps (device-resident DDP: the
    /// default for DDP, DiLoCo's inner DDP too; see [`TrainerConfigBuilder::device_resident`]).
    pub fn device_resident(&self) -> bool {
        self.sync.resident()
    }

    /// Device-resident DDP: makes the host vector the model's parameters again (one read of
    /// the device) when a step changed them. Everything that reads `held.params` between
    /// steps (checkpoints, heals, gathers) calls it first.
    pub(crate) fn sync_host(&mut self) -> Result<(), TrainError> {
        if !self.held.host_stale {
            return Ok(());
        }
        let model = self.model.as_ref().expect("model present between steps");
        self.held.params = self.layout.flatten_params(model);
        self.held.host_stale = false;
        Ok(())
    }

    /// Device-resident DDP: hands the update the model's parameters on the device.
    fn params_to_update(&mut self, model: &M) {
        if self.sync.resident() {
            self.held.dev = self.layout.params_device(model);
        }
    }

    /// The model with the parameters the update left: views of the device result
    /// (device-resident DDP; the host vector is then stale), or the host vector uploaded.
    fn model_after_update(&mut self, model: M) -> M {
        if !self.sync.resident() {
            // ZeRO-1/2 and hybrid uploaded each gathered bucket as it came back.
            return match self.held.dev.take() {
                Some(p) => self.layout.unflatten_device(model, p),
                None => self.layout.unflatten(model, &self.held.params),
            };
        }
        self.held.host_stale = true;
        match self.held.dev.take() {
            Some(p) => self.layout.unflatten_device(model, p),
            None => model,
        }
    }

    /// The full flat parameter vector on every rank. A collective under ZeRO-3 (every rank
    /// must call it; it gathers the f32 masters exactly); a copy otherwise (what the model
    /// computes with: with a narrow wire dtype, ZeRO-1/2 and hybrid hold the decoded values).
    pub fn gather_params(&mut self) -> Result<Vec<f32>, TrainError> {
        if !self.cfg.strategy.shards_params() {
            self.sync_host()?;
            return Ok(self.held.params.clone());
        }
        let device_master = self.opt.device_master()?;
        let shard: &[f32] = device_master.as_deref().unwrap_or(&self.held.params);
        let reach = self.sync.reach();
        let mut full = vec![0.0f32; self.layout.total()];
        let mut at = 0;
        let mut works = Vec::with_capacity(self.held.buckets.len());
        for b in &self.held.buckets {
            let n = reach.share(&self.pg, b.len());
            let w = reach.gather(&mut self.pg, WireDtype::F32, &shard[at..at + n], b.len());
            at += n;
            works.push((b.clone(), w));
        }
        for (b, w) in works {
            full[b].copy_from_slice(&w.wait()?);
        }
        Ok(full)
    }

    /// Bytes this rank holds of parameters, gradients and optimizer state.
    pub fn memory(&self) -> MemoryReport {
        self.memory
    }

    /// Whether [`Trainer::step_units`] overlaps each unit's gradient reduction with the
    /// backward of the units before it (stages 0-2 with [`Overlap`] on; see
    /// [`Trainer::with_units`]). ZeRO-3 and HSDP always step unit by unit.
    pub fn overlaps_units(&self) -> bool {
        self.unit_overlap
    }

    /// The model's units as the planner counts them ([`effective_units`]): `None` for a
    /// trainer built without units ([`Trainer::new`]).
    pub fn units_effective(&self) -> Option<f64> {
        self.units_effective
    }

    /// Elements of the largest communication unit: a bucket, or under ZeRO-3 a unit.
    pub fn largest_bucket(&self) -> usize {
        self.held.buckets.iter().map(|b| b.len()).max().unwrap_or(0)
    }

    /// This rank's process group (collectives take it mutably).
    pub fn process_group(&mut self) -> &mut ProcessGroup {
        &mut self.pg
    }

    /// Uneven batches: this rank trains on `share` of the `global` samples of each step (the
    /// shares of all ranks sum to `global`). Its gradient and loss are weighted by
    /// `share · world / global` before the mean over ranks, so the update equals the
    /// single-process update on the whole global batch. Every strategy supports it.
    pub fn set_sample_weight(&mut self, share: usize, global: usize) {
        self.sample_weight = (share * self.pg.world()) as f32 / global.max(1) as f32;
    }

    /// A flag this rank raises to ask for a stop (e.g. on Ctrl-C). It travels with the step's
    /// loss reduction, so every rank sees [`StepReport::stop`] after the same step.
    pub fn set_stop_flag(&mut self, flag: Arc<AtomicBool>) {
        self.stop = Some(flag);
    }

    /// A flag this rank raises when its node is asked to regroup (an elastic growth in place,
    /// [`crate::heal::Healer::regroup_flag`]); it travels with the step's loss reduction like
    /// the stop flag, so every rank sees [`StepReport::regroup`] after the same step.
    pub fn set_regroup_flag(&mut self, flag: Arc<AtomicBool>) {
        self.regroup = Some(flag);
    }

    /// One training step: `loss_fn` runs the forward pass on this rank's batch and returns the
    /// mean loss; backward, gradient communication and the update follow.
    pub fn step(
        &mut self,
        loss_fn: impl FnOnce(&M) -> Tensor<1>,
    ) -> Result<StepReport, TrainError> {
        let mut f = Some(loss_fn);
        self.step_accumulate(1, |m, _| (f.take().expect("one micro-batch"))(m))
    }

    /// One optimizer step over `micro` micro-batches: `loss_fn(model, i)` returns the mean loss
    /// of micro-batch `i`. Gradients accumulate on this rank's device with no communication
    /// (like DDP's `no_sync`), then are averaged and communicated once. The micro-batches should
    /// be of equal size, so the result equals one step on their union.
    pub fn step_accumulate(
        &mut self,
        micro: usize,
        mut loss_fn: impl FnMut(&M, usize) -> Tensor<1>,
    ) -> Result<StepReport, TrainError> {
        if micro == 0 {
            return Err(ConfigError::NoMicroBatch.into());
        }
        let (clock, model) = self.begin_whole_step()?;
        let mut local_loss = 0.0f32;
        let mut acc = GradientsAccumulator::<M>::new();
        let mut single = None;
        for i in 0..micro {
            // Reading the loss back makes the (lazy) forward pass run inside its phase.
            let micro_arg = || serde_json::json!({ "micro": i });
            let fwd = clock.enter(Phase::Compute, "forward").args(micro_arg());
            let loss = loss_fn(&model, i);
            local_loss += read_loss(loss.clone())?;
            drop(fwd);
            let _bwd = clock.enter(Phase::Compute, "backward").args(micro_arg());
            let g = GradientsParams::from_grads(loss.backward(), &model);
            if micro == 1 {
                single = Some(g);
            } else {
                acc.accumulate(&model, g);
            }
        }
        let local_loss = local_loss / micro as f32;
        let grads = single.unwrap_or_else(|| acc.grads());
        self.step_mem.sample(&self.device);
        let grad_scale = 1.0 / micro as f32;
        self.apply_grads(model, grads, grad_scale, local_loss, clock)
    }

    /// One optimizer step from gradients computed elsewhere: `grads_fn(model)` runs the
    /// forward and backward passes on this rank's batch (e.g. Burn's `TrainStep::step`) and
    /// returns the gradients and the batch's mean loss; communication and the update follow
    /// as in [`Trainer::step`]. DDP, ZeRO-1/2 and hybrid.
    pub fn step_grads(
        &mut self,
        grads_fn: impl FnOnce(&M) -> (GradientsParams, f32),
    ) -> Result<StepReport, TrainError> {
        let (clock, model) = self.begin_whole_step()?;
        let fb = clock.enter(Phase::Compute, "forward+backward");
        let (grads, local_loss) = grads_fn(&model);
        drop(fb);
        self.apply_grads(model, grads, 1.0, local_loss, clock)
    }

    /// The start of a whole-model step: refuses ZeRO-3/HSDP, resets the step's counters and
    /// takes the model out for the forward and backward passes.
    fn begin_whole_step(&mut self) -> Result<(StepClock, M), TrainError> {
        if self.cfg.strategy.shards_params() {
            return Err(ConfigError::NeedsUnits {
                strategy: self.cfg.strategy,
                use_instead: "Trainer::step_units",
            }
            .into());
        }
        self.begin_counters();
        let model = self.model.take().expect("model present between steps");
        Ok((StepClock::since(Instant::now()), model))
    }

    /// Resets the step's communication, transfer and device-memory counters.
    fn begin_counters(&mut self) {
        self.sent_at_start = self.pg.bytes_sent();
        self.busy_at_start = self.pg.comm_busy();
        self.xfer_at_start = transfer::counts();
        self.step_mem = DeviceMemory::default();
    }

    /// Sets the learning rate of the following steps (e.g. from a scheduler).
    pub fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    /// The context a sync works in during a step timed by `clock`.
    fn sync_cx<'a>(&'a mut self, clock: &'a StepClock) -> (SyncCx<'a>, &'a mut dyn GradSync) {
        let cx = SyncCx {
            pg: &mut self.pg,
            layout: &self.layout,
            opt: &mut self.opt,
            clock,
            wire: self.cfg.wire,
            lr: self.cfg.lr,
            sample_weight: self.sample_weight,
            narrow: self.cfg.device_resident,
            held: &mut self.held,
        };
        (cx, self.sync.as_mut())
    }

    /// Communicates `grads` (scaled by `grad_scale`) under the strategy, updates the owned
    /// elements and puts the model back with the new parameters.
    fn apply_grads(
        &mut self,
        model: M,
        mut grads: GradientsParams,
        grad_scale: f32,
        local_loss: f32,
        clock: StepClock,
    ) -> Result<StepReport, TrainError> {
        self.params_to_update(&model);
        let (mut cx, sync) = self.sync_cx(&clock);
        let res = sync
            .reduce(&mut cx, &mut grads)
            .and_then(|grad| sync.update(&mut cx, grad, grad_scale));
        drop(grads);
        if let Err(e) = res {
            // The parameters are those of the last step: the model is kept (a heal goes on).
            self.held.dev = None;
            self.model = Some(model);
            return Err(e);
        }
        self.step_mem.sample(&self.device);
        let unflatten = clock.enter(Phase::Compute, "unflatten");
        let model = self.model_after_update(model);
        drop(unflatten);
        self.finish_step(model, local_loss, &clock)
    }

    /// Puts the model back and agrees on the loss and the stop flag.
    fn finish_step(
        &mut self,
        model: M,
        local_loss: f32,
        clock: &StepClock,
    ) -> Result<StepReport, TrainError> {
        self.model = Some(model);
        {
            let _b = clock.enter(Phase::Comm, "buffers");
            self.sync_buffers()?;
        }
        let agree = clock.enter(Phase::Comm, "loss all_reduce");
        let stop = self
            .stop
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed));
        let regroup = self
            .regroup
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed));
        let world = self.pg.world() as f32;
        let flags = [stop, regroup].map(|f| f32::from(u8::from(f)));
        let agreed = self
            .pg
            .call(CallOpts::default().tag("loss"))
            .all_reduce(
                vec![local_loss * self.sample_weight, flags[0], flags[1]],
                ReduceOp::Sum,
            )
            .wait()?;
        drop(agree);
        let (loss, stop, regroup) = (agreed[0] / world, agreed[1] > 0.0, agreed[2] > 0.0);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.step_mem.sample(&self.device);
        let moved = transfer::counts() - self.xfer_at_start;
        Ok(StepReport {
            loss,
            compute_ms: ms(clock.total(Phase::Compute)),
            comm_ms: ms(clock.total(Phase::Comm) + clock.total(Phase::Gather)),
            optim_ms: ms(clock.total(Phase::Optim)),
            step_ms: ms(clock.elapsed()),
            gather_ms: ms(clock.total(Phase::Gather)),
            sent_bytes: self.pg.bytes_sent() - self.sent_at_start,
            comm_busy_ms: ms(self.pg.comm_busy().saturating_sub(self.busy_at_start)),
            stop,
            regroup,
            d2h_bytes: moved.d2h_bytes,
            h2d_bytes: moved.h2d_bytes,
            device_waits: moved.device_waits,
            device_mem_bytes: self.step_mem.in_use,
            device_mem_peak: self.step_mem.peak,
        })
    }
}

/// Reads a micro-batch's loss (one blocking wait, counted).
fn read_loss(loss: Tensor<1>) -> Result<f32, TrainError> {
    transfer::read_scalar(loss).map_err(|reason| {
        crate::optim::OptimError::ReadBack {
            what: "the loss".into(),
            reason,
        }
        .into()
    })
}

/// The optimizer of `owned` elements: fused kernels where the device has them and the sync
/// does not keep the parameters on the device (`resident`), with its f32 master on the
/// device when the configuration keeps state there and the device's memory is its own.
fn optimizer_for(
    cfg: &TrainerConfig,
    device: &Device,
    owned: usize,
    resident: bool,
) -> ShardOptimizer {
    let kernels = (cfg.fused_optimizer && !resident)
        .then(|| crate::device::kernels_for(device))
        .flatten();
    // Burn's CPU backend computes in host memory: a master "on the device" there would be
    // a second host copy for nothing.
    let separate = crate::transfer::device_memory(device).is_some();
    ShardOptimizer::new(&cfg.optim, device.clone(), owned, kernels)
        .keep_master(cfg.device_resident && separate)
}
