//! The trainer: runs one optimizer step of a Burn module under a [`Strategy`] across the
//! ranks of a [`ProcessGroup`].
//!
//! A complete, tested example is in the crate documentation ([`crate`]); in short:
//! `Trainer::new(model, &device, TrainerConfig::new(Strategy::Zero2), pg)?`, then per step
//! `trainer.step(|m| m.loss(&batch))?` (forward, backward, communication, update), or
//! `trainer.step_accumulate(k, |m, i| ...)` for k micro-batches per step, or, for ZeRO-3,
//! `Trainer::with_units` and `trainer.step_units(input, loss_fn)`.

use crate::flat::FlatLayout;
use crate::optim::{OptimConfig, ShardOptimizer, StepOpts};
use crate::strategy::Strategy;
use crate::trace::span;
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use serde::Serialize;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use wiretrain_comm::{ProcessGroup, ReduceOp, WireDtype, Work};

mod ckpt;
mod zero3;

/// What can go wrong while training.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error(transparent)]
    Comm(#[from] wiretrain_comm::Error),
    #[error("ranks disagree on the model: {0}")]
    ModelMismatch(String),
    #[error("invalid trainer configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error("optimizer step: {0}")]
    Optimizer(String),
    /// Another rank failed (it reported its own error); this rank stops with it.
    #[error("{0}")]
    OtherRank(String),
}

/// How to train.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub strategy: Strategy,
    pub optim: OptimConfig,
    pub lr: f64,
    /// Bucket size in bytes (f32 elements × 4); 25 MiB like PyTorch DDP.
    pub bucket_bytes: usize,
    /// ZeRO-3: unit all-gathers in flight ahead of the unit computing (0 = no prefetch).
    pub prefetch: usize,
    /// Element type between nodes for gradient reductions and parameter gathers (f32, f16,
    /// bf16, int8). Sums accumulate in f32; master weights and optimizer state stay f32 on
    /// their owner; every rank computes with the same (decoded) parameters.
    pub wire: WireDtype,
    /// On a wgpu device, run AdamW as wiretrain's fused WGSL kernel (master, m and v on the
    /// device) instead of Burn's tensor ops. Same math; off for comparisons.
    pub fused_optimizer: bool,
    /// DiLoCo on top of DDP or hybrid (sharded inside the node): inner steps reduce inside
    /// the node only; every `inner_steps` steps the nodes average their parameter deltas (the
    /// only traffic between nodes) and apply an outer Nesterov-momentum SGD step.
    pub diloco: Option<Diloco>,
    /// The deadline of the collectives of a checkpoint save (ranks that wrote their part wait
    /// there for the slowest writer); the longer of this and the collective timeout applies.
    pub checkpoint_timeout: std::time::Duration,
}

/// DiLoCo's outer loop (Douillard et al. 2023): defaults outer lr 0.7, momentum 0.9.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Diloco {
    /// Inner (local) optimizer steps per outer step (H).
    pub inner_steps: usize,
    pub outer_lr: f32,
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

/// DiLoCo's state: the parameters at the start of the round and the outer momentum.
#[derive(Debug, Clone, Default)]
struct OuterState {
    anchor: Vec<f32>,
    momentum: Vec<f32>,
    inner_done: usize,
}

impl TrainerConfig {
    pub fn new(strategy: Strategy) -> Self {
        Self {
            strategy,
            optim: OptimConfig::default(),
            lr: 1e-3,
            bucket_bytes: 25 << 20,
            prefetch: 1,
            wire: WireDtype::F32,
            fused_optimizer: true,
            diloco: None,
            checkpoint_timeout: std::time::Duration::from_secs(600),
        }
    }
}

/// Bytes a rank holds for model states (host copies included), as the ZeRO paper counts them.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct MemoryReport {
    pub params_bytes: usize,
    /// Peak bytes of flattened gradients held by wiretrain during a step.
    pub grads_bytes: usize,
    pub optim_bytes: usize,
}

/// One step's figures.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// Mean loss over the global batch (all ranks).
    pub loss: f32,
    pub compute_ms: f64,
    /// Time spent waiting for communication (exposed, not overlapped).
    pub comm_ms: f64,
    pub optim_ms: f64,
    pub step_ms: f64,
    /// ZeRO-3: the part of `comm_ms` spent waiting for unit all-gathers (0 otherwise).
    pub gather_ms: f64,
    /// Bytes this rank sent to other nodes during the step (QUIC frames, headers included).
    pub sent_bytes: u64,
    /// Some rank asked to stop (see [`Trainer::set_stop_flag`]); every rank gets the same
    /// answer after the same step, so all of them can leave the loop together.
    pub stop: bool,
}

pub struct Trainer<M: Module> {
    model: Option<M>,
    layout: FlatLayout,
    pg: ProcessGroup,
    cfg: TrainerConfig,
    params: Vec<f32>,
    buckets: Vec<Range<usize>>,
    owned: Vec<Range<usize>>,
    /// ZeRO-1/2 and hybrid: the f32 master of the owned elements (concatenated). `params`
    /// holds what the model computes with, which a narrow wire dtype rounds.
    master: Vec<f32>,
    opt: ShardOptimizer,
    memory: MemoryReport,
    stop: Option<Arc<AtomicBool>>,
    /// `pg.bytes_sent()` when the current step began.
    sent_at_start: u64,
    /// ZeRO-3: time the current step waited for unit all-gathers.
    gather_wait: Duration,
    /// This rank's gradient and loss weight: share · world / global batch (1 with equal
    /// shares), so the mean over ranks is the global-batch mean (see `set_sample_weight`).
    sample_weight: f32,
    /// DiLoCo only.
    outer: Option<OuterState>,
    /// The run id written into checkpoint manifests (fresh per run, kept across resume).
    run_id: String,
}

impl<M: Module> Trainer<M> {
    /// Checks that every rank has the same model, starts every rank from rank 0's parameters
    /// and allocates this rank's optimizer state. For [`Strategy::Zero3`] use
    /// [`Trainer::with_units`].
    pub fn new(
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Self, TrainError> {
        if cfg.strategy.shards_params() {
            return Err(TrainError::Config(
                "zero3 and hsdp need a model cut into units: use Trainer::with_units".into(),
            ));
        }
        Self::build(model, device, cfg, pg, None)
    }

    fn build(
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        mut pg: ProcessGroup,
        units: Option<(Vec<Range<usize>>, FlatLayout)>,
    ) -> Result<Self, TrainError> {
        if cfg.bucket_bytes < 4 {
            return Err(TrainError::Config(format!(
                "bucket size {} bytes holds no element",
                cfg.bucket_bytes
            )));
        }
        let (unit_ranges, layout) = match units {
            Some((u, l)) => (Some(u), l),
            None => (None, FlatLayout::of(&model)),
        };
        check_agreement(&mut pg, &layout)?;
        let params = layout.flatten_params(&model);
        let params = pg.broadcast(params, 0).wait()?;
        let buckets = unit_ranges
            .clone()
            .unwrap_or_else(|| layout.buckets(cfg.bucket_bytes / 4));
        let owned: Vec<Range<usize>> = match cfg.strategy {
            Strategy::Ddp => std::iter::once(0..layout.total()).collect(),
            Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => buckets
                .iter()
                .map(|b| {
                    let s = pg.shard_range(b.len());
                    b.start + s.start..b.start + s.end
                })
                .collect(),
            // This rank's node pieces of every bucket, in bucket order.
            Strategy::Hybrid | Strategy::Hsdp => buckets
                .iter()
                .flat_map(|b| {
                    pg.node_pieces(b.len())
                        .into_iter()
                        .map(|r| b.start + r.start..b.start + r.end)
                })
                .collect(),
        };
        let owned_len: usize = owned.iter().map(|r| r.len()).sum();
        let (model, params) = match &unit_ranges {
            // At rest a ZeRO-3 rank holds its shard of every unit and a module of placeholders.
            Some(u) => {
                let shard: Vec<f32> = owned
                    .iter()
                    .flat_map(|r| params[r.clone()].to_vec())
                    .collect();
                (zero3::free_all(model, &layout, u), shard)
            }
            None => (layout.unflatten(model, &params), params),
        };
        let master = owned_master(cfg.strategy, &owned, &params);
        if cfg.diloco.is_some() && !matches!(cfg.strategy, Strategy::Ddp | Strategy::Hybrid) {
            return Err(TrainError::Config(
                "diloco runs on top of ddp or hybrid (inner steps replicate the model, or shard \
                 it, inside a node)"
                    .into(),
            ));
        }
        if cfg.diloco.is_some_and(|d| d.inner_steps == 0) {
            return Err(TrainError::Config(
                "diloco needs at least 1 inner step".into(),
            ));
        }
        let outer = cfg.diloco.map(|_| OuterState {
            anchor: params.clone(),
            momentum: vec![0.0; params.len()],
            inner_done: 0,
        });
        let kernels = cfg
            .fused_optimizer
            .then(|| crate::device::kernels_for(device))
            .flatten();
        let opt = ShardOptimizer::new(&cfg.optim, device.clone(), owned_len, kernels);
        let max_bucket = buckets.iter().map(|b| b.len()).max().unwrap_or(0);
        let memory = MemoryReport {
            params_bytes: 4 * match cfg.strategy {
                Strategy::Zero3 | Strategy::Hsdp => owned_len + (1 + cfg.prefetch) * max_bucket,
                _ => layout.total(),
            },
            grads_bytes: 4 * match cfg.strategy {
                Strategy::Ddp | Strategy::Zero1 => layout.total(),
                Strategy::Zero2 | Strategy::Zero3 | Strategy::Hybrid | Strategy::Hsdp => {
                    owned_len + max_bucket
                }
            },
            optim_bytes: opt.state_bytes(),
        };
        Ok(Self {
            model: Some(model),
            layout,
            pg,
            cfg,
            params,
            buckets,
            owned,
            master,
            opt,
            memory,
            stop: None,
            sent_at_start: 0,
            gather_wait: Duration::ZERO,
            sample_weight: 1.0,
            outer,
            run_id: format!("{:016x}", rand::random::<u64>()),
        })
    }

    pub fn model(&self) -> &M {
        self.model.as_ref().expect("model present between steps")
    }

    pub fn into_model(mut self) -> M {
        self.model.take().expect("model present between steps")
    }

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
    /// rank) for DDP, ZeRO-1 and ZeRO-2; this rank's shard of every unit for ZeRO-3.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The full flat parameter vector on every rank. A collective under ZeRO-3 (every rank
    /// must call it; it gathers the f32 masters exactly); a copy otherwise (what the model
    /// computes with: with a narrow wire dtype, ZeRO-1/2 and hybrid hold the decoded values).
    pub fn gather_params(&mut self) -> Result<Vec<f32>, TrainError> {
        if !self.cfg.strategy.shards_params() {
            return Ok(self.params.clone());
        }
        let device_master = self.opt.device_master().map_err(TrainError::Optimizer)?;
        let shard: &[f32] = device_master.as_deref().unwrap_or(&self.params);
        let hsdp = self.cfg.strategy == Strategy::Hsdp;
        let mut full = vec![0.0f32; self.layout.total()];
        let mut at = 0;
        let mut works = Vec::with_capacity(self.buckets.len());
        for b in &self.buckets {
            let n = zero3::unit_share(&self.pg, hsdp, b.len());
            let w = zero3::issue_gather(
                &mut self.pg,
                hsdp,
                WireDtype::F32,
                &shard[at..at + n],
                b.len(),
            );
            at += n;
            works.push((b.clone(), w));
        }
        for (b, w) in works {
            full[b].copy_from_slice(&w.wait()?);
        }
        Ok(full)
    }

    pub fn memory(&self) -> MemoryReport {
        self.memory
    }

    /// Elements of the largest communication unit: a bucket, or under ZeRO-3 a unit.
    pub fn largest_bucket(&self) -> usize {
        self.buckets.iter().map(|b| b.len()).max().unwrap_or(0)
    }

    pub fn process_group(&mut self) -> &mut ProcessGroup {
        &mut self.pg
    }

    /// A flag this rank raises to ask for a stop (e.g. on Ctrl-C). It travels with the step's
    /// loss reduction, so every rank sees [`StepReport::stop`] after the same step.
    /// Uneven batches: this rank trains on `share` of the `global` samples of each step (the
    /// shares of all ranks sum to `global`). Its gradient and loss are weighted by
    /// `share · world / global` before the mean over ranks, so the update equals the
    /// single-process update on the whole global batch. Every strategy supports it.
    pub fn set_sample_weight(&mut self, share: usize, global: usize) {
        self.sample_weight = (share * self.pg.world()) as f32 / global.max(1) as f32;
    }

    pub fn set_stop_flag(&mut self, flag: Arc<AtomicBool>) {
        self.stop = Some(flag);
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
            return Err(TrainError::Config(
                "accumulation needs at least one micro-batch".into(),
            ));
        }
        let (t0, model) = self.begin_whole_step()?;
        let mut local_loss = 0.0f32;
        let mut acc = GradientsAccumulator::<M>::new();
        let mut single = None;
        for i in 0..micro {
            // Reading the loss back makes the (lazy) forward pass run inside its span.
            let sp = span("forward", "compute").args(serde_json::json!({ "micro": i }));
            let loss = loss_fn(&model, i);
            local_loss += loss.clone().into_scalar::<f32>();
            drop(sp);
            let _s = span("backward", "compute").args(serde_json::json!({ "micro": i }));
            let g = GradientsParams::from_grads(loss.backward(), &model);
            if micro == 1 {
                single = Some(g);
            } else {
                acc.accumulate(&model, g);
            }
        }
        let local_loss = local_loss / micro as f32;
        let grads = single.unwrap_or_else(|| acc.grads());
        let grad_scale = 1.0 / micro as f32;
        self.apply_grads(model, grads, grad_scale, local_loss, t0)
    }

    /// One optimizer step from gradients computed elsewhere: `grads_fn(model)` runs the
    /// forward and backward passes on this rank's batch (e.g. Burn's `TrainStep::step`) and
    /// returns the gradients and the batch's mean loss; communication and the update follow
    /// as in [`Trainer::step`]. DDP, ZeRO-1/2 and hybrid.
    pub fn step_grads(
        &mut self,
        grads_fn: impl FnOnce(&M) -> (GradientsParams, f32),
    ) -> Result<StepReport, TrainError> {
        let (t0, model) = self.begin_whole_step()?;
        let sp = span("forward+backward", "compute");
        let (grads, local_loss) = grads_fn(&model);
        drop(sp);
        self.apply_grads(model, grads, 1.0, local_loss, t0)
    }

    /// The start of a whole-model step: refuses ZeRO-3/HSDP, resets the step's counters and
    /// takes the model out for the forward and backward passes.
    fn begin_whole_step(&mut self) -> Result<(Instant, M), TrainError> {
        if self.cfg.strategy.shards_params() {
            return Err(TrainError::Config(
                "zero3 and hsdp steps run unit by unit: use Trainer::step_units".into(),
            ));
        }
        self.sent_at_start = self.pg.bytes_sent();
        self.gather_wait = Duration::ZERO;
        let model = self.model.take().expect("model present between steps");
        Ok((Instant::now(), model))
    }

    /// Sets the learning rate of the following steps (e.g. from a scheduler).
    pub fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    /// Communicates `grads` (scaled by `grad_scale`) under the strategy and updates the shard.
    fn apply_grads(
        &mut self,
        model: M,
        mut grads: GradientsParams,
        grad_scale: f32,
        local_loss: f32,
        t0: Instant,
    ) -> Result<StepReport, TrainError> {
        let mut compute = t0.elapsed();
        let mut comm = Duration::ZERO;
        let total = self.layout.total();
        let t_opt;
        match self.cfg.strategy {
            Strategy::Ddp => {
                // Every bucket's all-reduce is in flight while the next bucket is flattened.
                let mut works: Vec<(Range<usize>, Work<Vec<f32>>)> = Vec::new();
                let tf = Instant::now();
                let sp = span("flatten+issue", "compute");
                for b in &self.buckets {
                    let mut flat = Vec::new();
                    self.layout.flatten_grads(&mut grads, b.clone(), &mut flat);
                    weigh(&mut flat, self.sample_weight);
                    let w = if self.outer.is_some() {
                        // DiLoCo's inner step: shared memory inside the node only.
                        self.pg.node_all_reduce(flat, ReduceOp::Mean)
                    } else {
                        let prev = self.pg.set_wire_dtype(self.cfg.wire);
                        let w = self.pg.all_reduce(flat, ReduceOp::Mean);
                        self.pg.set_wire_dtype(prev);
                        w
                    };
                    works.push((b.clone(), w));
                }
                drop(sp);
                compute += tf.elapsed();
                let mut full = vec![0.0f32; total];
                let tw = Instant::now();
                for (b, w) in works {
                    let id = w.id();
                    let _s = span(format!("wait {id}"), "comm");
                    full[b].copy_from_slice(&w.wait()?);
                }
                comm += tw.elapsed();
                t_opt = Instant::now();
                let _s = span("optimizer", "optim");
                // The micro-batch mean is taken in the step (on the device when fused).
                let opts = StepOpts {
                    grad_scale,
                    readback: WireDtype::F32,
                };
                self.opt
                    .step_with(self.cfg.lr, &mut self.params, &full, opts)
                    .map_err(TrainError::Optimizer)?;
                drop(_s);
                let to = Instant::now();
                if self.outer_step()? {
                    comm += to.elapsed();
                }
            }
            Strategy::Zero3 | Strategy::Hsdp => unreachable!("refused above"),
            Strategy::Zero1 | Strategy::Zero2 | Strategy::Hybrid => {
                // Hybrid is ZeRO-2 with both collectives narrowed to the node: the reduction
                // keeps the rank's node pieces, the gather stays inside the node.
                let node = self.cfg.strategy == Strategy::Hybrid;
                let owned_len: usize = self.owned.iter().map(|r| r.len()).sum();
                let mut gshard = vec![0.0f32; owned_len];
                let mut at = 0;
                let mut pending: Vec<(usize, Work<Vec<f32>>)> = Vec::new();
                for b in &self.buckets {
                    let tf = Instant::now();
                    let sp = span("flatten bucket", "compute");
                    let mut flat = Vec::new();
                    self.layout.flatten_grads(&mut grads, b.clone(), &mut flat);
                    weigh(&mut flat, self.sample_weight);
                    drop(sp);
                    compute += tf.elapsed();
                    let n = zero3::unit_share(&self.pg, node, b.len());
                    let sp = span("issue reduce", "comm");
                    let w = if self.outer.is_some() {
                        // DiLoCo's inner step sharded inside the node: shared memory only.
                        self.pg.node_reduce_scatter_in_place(flat, ReduceOp::Mean)
                    } else {
                        zero3::issue_reduce(&mut self.pg, node, self.cfg.wire, flat)
                    };
                    drop(sp);
                    if self.cfg.strategy == Strategy::Zero1 {
                        pending.push((at, w));
                    } else {
                        // ZeRO-2: the full bucket is reduced and dropped before the next exists.
                        let tw = Instant::now();
                        let sp = span(format!("wait {}", w.id()), "comm");
                        let buf = w.wait()?;
                        drop(sp);
                        comm += tw.elapsed();
                        zero3::take_share(&self.pg, node, &buf, &mut gshard[at..at + n]);
                    }
                    at += n;
                }
                let tw = Instant::now();
                for (off, w) in pending {
                    let _s = span(format!("wait {}", w.id()), "comm");
                    let buf = w.wait()?;
                    let n = zero3::unit_share(&self.pg, node, buf.len());
                    zero3::take_share(&self.pg, node, &buf, &mut gshard[off..off + n]);
                }
                comm += tw.elapsed();
                t_opt = Instant::now();
                let sp = span("optimizer", "optim");
                debug_assert_eq!(self.master.len(), owned_len);
                // Only the gathered (wire-rounded) values leave the optimizer: when fused, the
                // f32 master stays on the device and the cast kernel narrows the read-back.
                let opts = StepOpts {
                    grad_scale,
                    readback: self.cfg.wire,
                };
                self.opt
                    .step_with(self.cfg.lr, &mut self.master, &gshard, opts)
                    .map_err(TrainError::Optimizer)?;
                drop(sp);
                let opt_time = t_opt.elapsed();
                let tw = Instant::now();
                self.gather_shards()?;
                self.outer_step()?;
                comm += tw.elapsed();
                return self.finish(model, t0, local_loss, compute, comm, opt_time);
            }
        }
        let opt_time = t_opt.elapsed();
        self.finish(model, t0, local_loss, compute, comm, opt_time)
    }

    /// DiLoCo: after every `inner_steps` inner steps, averages the parameter deltas of all
    /// nodes (in the wire dtype; the only bytes between nodes) and applies the outer
    /// Nesterov-momentum SGD step: m = μ m + Δ, θ = θ₀ − lr (Δ + μ m). Returns whether it ran.
    fn outer_step(&mut self) -> Result<bool, TrainError> {
        let Some(d) = self.cfg.diloco else {
            return Ok(false);
        };
        let outer = self.outer.as_mut().expect("diloco state");
        outer.inner_done += 1;
        if !outer.inner_done.is_multiple_of(d.inner_steps) {
            return Ok(false);
        }
        let _s = span("outer step", "comm");
        let delta: Vec<f32> = outer
            .anchor
            .iter()
            .zip(&self.params)
            .map(|(a, p)| a - p)
            .collect();
        let prev = self.pg.set_wire_dtype(self.cfg.wire);
        let w = self.pg.all_reduce(delta, ReduceOp::Mean);
        self.pg.set_wire_dtype(prev);
        let delta = w.wait()?;
        let outer = self.outer.as_mut().expect("diloco state");
        let (lr, mu) = (d.outer_lr, d.outer_momentum);
        for (((a, m), p), g) in outer
            .anchor
            .iter_mut()
            .zip(outer.momentum.iter_mut())
            .zip(self.params.iter_mut())
            .zip(&delta)
        {
            *m = mu * *m + g;
            *a -= lr * (g + mu * *m);
            *p = *a;
        }
        // The optimizer's master (the whole vector under DDP, the owned pieces when sharded
        // inside the node) follows; the fused optimizer keeps its own copy on the device.
        self.master = owned_master(self.cfg.strategy, &self.owned, &self.params);
        let master = if self.cfg.strategy == Strategy::Ddp {
            &self.params
        } else {
            &self.master
        };
        self.opt.set_master(master).map_err(TrainError::Optimizer)?;
        Ok(true)
    }

    /// ZeRO-1/2, hybrid: gathers every rank's share of every bucket (its master, in the
    /// wire dtype) into the parameters the model computes with, all buckets in flight at once.
    fn gather_shards(&mut self) -> Result<(), TrainError> {
        let node = self.cfg.strategy == Strategy::Hybrid;
        let sp = span("issue gathers", "comm");
        let mut works = Vec::with_capacity(self.buckets.len());
        let mut at = 0;
        for b in &self.buckets {
            let n = zero3::unit_share(&self.pg, node, b.len());
            let w = zero3::issue_gather(
                &mut self.pg,
                node,
                self.cfg.wire,
                &self.master[at..at + n],
                b.len(),
            );
            at += n;
            works.push((b.clone(), w));
        }
        drop(sp);
        for (b, w) in works {
            let _s = span(format!("wait {}", w.id()), "comm");
            let full = w.wait()?;
            self.params[b].copy_from_slice(&full);
        }
        Ok(())
    }

    fn finish(
        &mut self,
        model: M,
        t0: Instant,
        local_loss: f32,
        compute: Duration,
        comm: Duration,
        opt_time: Duration,
    ) -> Result<StepReport, TrainError> {
        let tu = Instant::now();
        let sp = span("unflatten", "compute");
        let model = self.layout.unflatten(model, &self.params);
        drop(sp);
        let compute = compute + tu.elapsed();
        self.finish_sharded(model, t0, local_loss, compute, comm, opt_time)
    }

    /// Puts the model back and agrees on the loss and the stop flag.
    fn finish_sharded(
        &mut self,
        model: M,
        t0: Instant,
        local_loss: f32,
        compute: Duration,
        mut comm: Duration,
        opt_time: Duration,
    ) -> Result<StepReport, TrainError> {
        self.model = Some(model);
        let tl = Instant::now();
        let sp = span("loss all_reduce", "comm");
        let stop = self
            .stop
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed));
        let world = self.pg.world() as f32;
        let agreed = self
            .pg
            .all_reduce(
                vec![local_loss * self.sample_weight, f32::from(u8::from(stop))],
                ReduceOp::Sum,
            )
            .wait()?;
        drop(sp);
        let (loss, stop) = (agreed[0] / world, agreed[1] > 0.0);
        comm += tl.elapsed();
        Ok(StepReport {
            loss,
            compute_ms: compute.as_secs_f64() * 1e3,
            comm_ms: comm.as_secs_f64() * 1e3,
            optim_ms: opt_time.as_secs_f64() * 1e3,
            step_ms: t0.elapsed().as_secs_f64() * 1e3,
            gather_ms: self.gather_wait.as_secs_f64() * 1e3,
            sent_bytes: self.pg.bytes_sent() - self.sent_at_start,
            stop,
        })
    }
}

/// The f32 master copy ZeRO-1/2 and hybrid keep of their owned elements (empty for DDP, whose
/// `params` are the master, and for ZeRO-3/HSDP, whose `params` hold only the owned shard).
fn owned_master(strategy: Strategy, owned: &[Range<usize>], params: &[f32]) -> Vec<f32> {
    match strategy {
        Strategy::Zero1 | Strategy::Zero2 | Strategy::Hybrid => owned
            .iter()
            .flat_map(|r| params[r.clone()].iter().copied())
            .collect(),
        Strategy::Ddp | Strategy::Zero3 | Strategy::Hsdp => Vec::new(),
    }
}

/// Multiplies a rank's flattened gradient by its sample weight (no-op for 1).
pub(crate) fn weigh(v: &mut [f32], w: f32) {
    if w != 1.0 {
        v.iter_mut().for_each(|x| *x *= w);
    }
}

/// Compares rank 0's parameter list (paths and shapes) with every rank's; a mismatch names
/// the first differing parameter.
fn check_agreement(pg: &mut ProcessGroup, layout: &FlatLayout) -> Result<(), TrainError> {
    let sig = layout.signature();
    let n = sig.len();
    let counts = pg.all_gather_bytes(&(n as u64).to_le_bytes())?;
    let count = |b: &[u8]| b.try_into().map(u64::from_le_bytes).unwrap_or(u64::MAX) as usize;
    if let Some((r, c)) = counts.iter().enumerate().find(|(_, c)| count(c) != n) {
        return Err(TrainError::ModelMismatch(format!(
            "rank {} has {} float parameters, rank {r} has {}",
            pg.rank(),
            n,
            count(c)
        )));
    }
    let mine: Vec<u8> = sig.iter().flat_map(|h| h.to_le_bytes()).collect();
    let root = pg.broadcast_bytes(&mine, 0)?;
    if let Some(i) = (0..n).find(|&i| root.get(4 * i..4 * i + 4) != mine.get(4 * i..4 * i + 4)) {
        let e = &layout.entries()[i];
        return Err(TrainError::ModelMismatch(format!(
            "parameter #{i} differs between rank 0 and rank {}: here it is {:?} with shape {:?}",
            pg.rank(),
            e.path,
            e.shape
        )));
    }
    Ok(())
}
