//! Optimizer state for a flat shard (ZeRO) or the whole flat vector (DDP).
//!
//! The step is Burn's own per-tensor optimizer (AdamW, or SGD with momentum) applied to one
//! 1-D tensor on the rank's device, so every strategy runs the same element-wise math and the
//! state (m and v for AdamW) exists only for the elements this rank owns.
//!
//! On a wgpu device, AdamW runs as wiretrain's fused WGSL kernel instead (same math, one
//! dispatch): the f32 master of the shard, m and v then live on the device; the gradient is
//! scaled there by the reduce kernel, and when the caller only needs the parameters rounded to
//! a 16-bit wire dtype the cast kernel narrows them before the read-back (half the bytes).
//! Checkpoints see the same state names as Burn's AdamW, so a run can resume on either path.

use crate::checkpoint::ScalarValue;
use crate::transfer;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, Optimizer, RecordState, Sgd, SgdConfig, SgdState, StateSink,
    StateSource,
};
use burn::store::burn_pack::Scalar;
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use wiretrain_comm::WireDtype;
use wiretrain_shaders::{AdamWHyper, AdamWShard, GpuBuf, Kernels};

mod fused;

/// What can go wrong in the optimizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// wiretrain's kernels failed on the device (the fused step, or moving its master or
    /// state between host and device).
    #[error("fused AdamW on the device: {0}")]
    Device(#[from] wiretrain_shaders::ShaderError),
    /// Burn could not hand back a tensor's values.
    #[error("reading {what} back: {reason}")]
    ReadBack {
        /// What was being read (the step's output, a state tensor).
        what: String,
        /// Burn's error.
        reason: burn::tensor::TensorReadError,
    },
    /// A state tensor does not have one element per owned element.
    #[error("optimizer state {name} has {len} elements, this rank owns {owned}")]
    StateLength {
        /// The state tensor's name.
        name: String,
        /// Its number of elements.
        len: usize,
        /// The number of elements this rank owns.
        owned: usize,
    },
    /// A state import lacks tensors or scalars of the optimizer's state.
    #[error("the checkpoint lacks part of the {kind} state")]
    StateMissing {
        /// The optimizer ("adamw", "sgd").
        kind: &'static str,
    },
    /// The step count does not fit the fused kernel's counter.
    #[error("optimizer step count {0} is out of range")]
    StepCount(usize),
    /// The fused kernel steps wiretrain's own buffers, not a device tensor (build the
    /// optimizer without kernels for the device-resident path).
    #[error("the fused AdamW cannot step a device tensor; build the optimizer without kernels")]
    FusedOnDevice,
}

/// The optimizer a run uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimConfig {
    /// AdamW (the default: betas 0.9 and 0.999, eps 1e-8, weight decay 0.01).
    AdamW {
        /// Decay rate of the first moment's running average.
        beta1: f32,
        /// Decay rate of the second moment's running average.
        beta2: f32,
        /// Added to the denominator for numerical stability.
        eps: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
    /// SGD, with momentum when `momentum` is above 0 (no dampening).
    Sgd {
        /// Momentum factor; 0 for plain SGD.
        momentum: f64,
        /// Weight decay added to the gradient (L2 penalty); 0 for none.
        weight_decay: f32,
    },
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl From<Scalar> for ScalarValue {
    fn from(v: Scalar) -> Self {
        match v {
            Scalar::Int(i) => Self::Int(i),
            Scalar::UInt(u) => Self::UInt(u),
            Scalar::Float(f) => Self::Float(f),
            Scalar::Bool(b) => Self::Bool(b),
        }
    }
}

impl From<ScalarValue> for Scalar {
    fn from(v: ScalarValue) -> Self {
        match v {
            ScalarValue::Int(i) => Self::Int(i),
            ScalarValue::UInt(u) => Self::UInt(u),
            ScalarValue::Float(f) => Self::Float(f),
            ScalarValue::Bool(b) => Self::Bool(b),
        }
    }
}

/// Optimizer state in a form that can be written, cut and joined: per-element tensors and
/// scalars (step counts).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExportedState {
    /// Per-element state tensors by name, each one value per owned element.
    pub tensors: Vec<(String, Vec<f32>)>,
    /// Scalar state (step counts) by name.
    pub scalars: BTreeMap<String, ScalarValue>,
}

enum Kind {
    AdamW(Box<(AdamW, Option<AdamWState<1>>)>),
    Sgd(Box<(Sgd, Option<SgdState<1>>)>),
    Fused(Box<Fused>),
}

/// AdamW through wiretrain's kernels; the device holds master, m and v after the first step.
struct Fused {
    kernels: Arc<Kernels>,
    hyper: AdamWHyper,
    shard: Option<AdamWShard>,
    /// Moments and step count from a checkpoint, applied when the shard is next created.
    pending: Option<(Vec<f32>, Vec<f32>, u32)>,
    /// Raw gradient upload and the scaled gradient the step reads.
    grad_raw: Option<GpuBuf>,
    grad: Option<GpuBuf>,
}

/// How one step treats its inputs and output.
#[derive(Debug, Clone, Copy)]
pub struct StepOpts {
    /// Multiplies the gradient first (1 / micro-batches for accumulation).
    pub grad_scale: f32,
    /// The caller only needs the updated parameters as this wire dtype will carry them; the
    /// fused path then reads back f16/bf16 instead of f32 (the master stays f32 on the
    /// device). F32 (or any dtype on the other paths) gives the exact f32 master.
    pub readback: WireDtype,
}

impl Default for StepOpts {
    fn default() -> Self {
        Self {
            grad_scale: 1.0,
            readback: WireDtype::F32,
        }
    }
}

/// Optimizer and its state for `len` owned elements.
pub struct ShardOptimizer {
    kind: Kind,
    device: Device,
    len: usize,
    /// Burn's optimizers with [`ShardOptimizer::keep_master`]: the f32 master on the device
    /// after a step (the step's result), stepped again at the next one instead of uploading
    /// the caller's copy, which the read-back keeps equal to it.
    master: Option<Tensor<1>>,
    keep_master: bool,
}

impl ShardOptimizer {
    /// `kernels`: wiretrain's kernels on `device`; with them AdamW runs fused on the device.
    pub fn new(
        cfg: &OptimConfig,
        device: Device,
        len: usize,
        kernels: Option<Arc<Kernels>>,
    ) -> Self {
        let kind = match (cfg, kernels) {
            (
                OptimConfig::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                },
                Some(kernels),
            ) => Kind::Fused(Box::new(Fused {
                kernels,
                hyper: AdamWHyper {
                    lr: 0.0,
                    beta1: *beta1,
                    beta2: *beta2,
                    eps: *eps,
                    weight_decay: *weight_decay,
                },
                shard: None,
                pending: None,
                grad_raw: None,
                grad: None,
            })),
            (cfg, _) => Self::burn_kind(cfg),
        };
        Self {
            kind,
            device: device.inner(),
            len,
            master: None,
            keep_master: false,
        }
    }

    /// Burn's optimizers keep the f32 master on the device between steps, as the fused
    /// path does: a step uploads only the gradient and reads the result back once (the
    /// caller's parameters are read at the first step, after [`Self::set_master`],
    /// [`Self::import_state`] or [`Self::forget_master`]). Off: every step uploads the
    /// caller's parameters too (`--host-path`, the path this replaces).
    pub fn keep_master(mut self, on: bool) -> Self {
        self.keep_master = on;
        self
    }

    /// The caller changed its parameters (a load, a test fault): the next step reads them.
    pub fn forget_master(&mut self) {
        self.master = None;
    }

    fn burn_kind(cfg: &OptimConfig) -> Kind {
        match cfg {
            OptimConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => Kind::AdamW(Box::new((
                AdamWConfig::new()
                    .with_beta_1(*beta1)
                    .with_beta_2(*beta2)
                    .with_epsilon(*eps)
                    .with_weight_decay(*weight_decay)
                    .build(),
                None,
            ))),
            OptimConfig::Sgd {
                momentum,
                weight_decay,
            } => {
                let mut c = SgdConfig::new();
                if *momentum > 0.0 {
                    c = c.with_momentum(Some(
                        MomentumConfig::new()
                            .with_momentum(*momentum)
                            .with_dampening(0.0),
                    ));
                }
                if *weight_decay > 0.0 {
                    c = c.with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(
                        *weight_decay,
                    )));
                }
                Kind::Sgd(Box::new((c.build(), None)))
            }
        }
    }

    /// Whether AdamW runs as wiretrain's fused kernel on the device.
    pub fn is_fused(&self) -> bool {
        matches!(self.kind, Kind::Fused(..))
    }

    /// Calls of wiretrain's kernels on this optimizer's device (fused path only).
    pub fn kernel_counters(&self) -> Option<wiretrain_shaders::Counters> {
        match &self.kind {
            Kind::Fused(f) => Some(f.kernels.counters()),
            _ => None,
        }
    }

    /// Updates `params` in place from `grads` (both `len` long).
    pub fn step(&mut self, lr: f64, params: &mut [f32], grads: &[f32]) -> Result<(), OptimError> {
        self.step_with(lr, params, grads, StepOpts::default())
    }

    /// Like [`Self::step`], with a gradient scale and a read-back dtype (see [`StepOpts`]).
    /// On the fused path `params` is read only at the first step (or after a state import):
    /// from then on the device holds the f32 master.
    pub fn step_with(
        &mut self,
        lr: f64,
        params: &mut [f32],
        grads: &[f32],
        opts: StepOpts,
    ) -> Result<(), OptimError> {
        assert_eq!(params.len(), self.len);
        assert_eq!(grads.len(), self.len);
        if self.len == 0 {
            return Ok(());
        }
        if let Kind::Fused(f) = &mut self.kind {
            return Ok(f.step(lr, params, grads, opts)?);
        }
        let g = if opts.grad_scale == 1.0 {
            grads.to_vec()
        } else {
            grads.iter().map(|x| x * opts.grad_scale).collect()
        };
        let p = match self.master.take() {
            Some(m) => m,
            None => transfer::upload(params.to_vec(), &self.device),
        };
        let g = transfer::upload(g, &self.device);
        let out = self.burn_step(lr, p, g)?;
        let v = transfer::read_f32(out.clone()).map_err(|reason| OptimError::ReadBack {
            what: "the optimizer output".into(),
            reason,
        })?;
        params.copy_from_slice(&v);
        if self.keep_master {
            self.master = Some(out);
        }
        Ok(())
    }

    /// The device-resident step: `params` and `grad` (scaled by `scale` first) are flat
    /// tensors of `len` elements on this optimizer's device; returns the updated parameters
    /// there. Burn's AdamW or SGD: nothing crosses to the host.
    pub fn step_device(
        &mut self,
        lr: f64,
        params: Tensor<1>,
        grad: Tensor<1>,
        scale: f32,
    ) -> Result<Tensor<1>, OptimError> {
        assert_eq!(params.dims()[0], self.len);
        assert_eq!(grad.dims()[0], self.len);
        let g = if scale == 1.0 { grad } else { grad * scale };
        self.burn_step(lr, params, g)
    }

    /// One step of Burn's optimizer on device tensors.
    fn burn_step(&mut self, lr: f64, p: Tensor<1>, g: Tensor<1>) -> Result<Tensor<1>, OptimError> {
        Ok(match &mut self.kind {
            Kind::AdamW(b) => {
                let (opt, state) = &mut **b;
                let (t, s) = opt.step(lr, p, g, state.take());
                *state = s;
                t
            }
            Kind::Sgd(b) => {
                let (opt, state) = &mut **b;
                let (t, s) = opt.step(lr, p, g, state.take());
                *state = s;
                t
            }
            Kind::Fused(..) => return Err(OptimError::FusedOnDevice),
        })
    }

    /// The device this optimizer steps on (without autodiff).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Replaces the master (after an outer step changed the parameters): the fused path
    /// uploads it to the device; Burn's optimizers read the caller's parameters at the next
    /// step.
    pub fn set_master(&mut self, params: &[f32]) -> Result<(), OptimError> {
        self.master = None;
        if let Kind::Fused(f) = &mut self.kind
            && let Some(s) = &f.shard
        {
            f.kernels.write(s.param(), params)?;
        }
        Ok(())
    }

    /// The f32 master when the device holds it (fused path after its first step); `None`
    /// means the caller's parameters are the master.
    pub fn device_master(&self) -> Result<Option<Vec<f32>>, OptimError> {
        match &self.kind {
            Kind::Fused(f) => match &f.shard {
                Some(s) => Ok(Some(f.kernels.read(s.param(), s.len())?)),
                None => Ok(None),
            },
            _ => Ok(None),
        }
    }

    /// "adamw" or "sgd".
    pub fn kind(&self) -> &'static str {
        match &self.kind {
            Kind::AdamW(..) | Kind::Fused(..) => "adamw",
            Kind::Sgd(..) => "sgd",
        }
    }

    /// The optimizer state as named per-element tensors (each `len` long) and scalars, through
    /// Burn's own `RecordState` decomposition; empty before the first step.
    pub fn export_state(&self) -> Result<ExportedState, OptimError> {
        let mut sink = StateSink::default();
        match &self.kind {
            Kind::AdamW(b) => {
                if let Some(s) = &b.1 {
                    s.state_flatten("", &mut sink)
                }
            }
            Kind::Sgd(b) => {
                if let Some(s) = &b.1 {
                    s.state_flatten("", &mut sink)
                }
            }
            Kind::Fused(f) => {
                if let Some(s) = f.burn_state(&self.device)? {
                    s.state_flatten("", &mut sink)
                }
            }
        }
        let mut tensors = Vec::with_capacity(sink.tensors.len());
        for (name, data) in sink.tensors {
            let v = data.try_to_vec::<f32>().map_err(|e| OptimError::ReadBack {
                what: format!("optimizer state {name}"),
                reason: e.into(),
            })?;
            if v.len() != self.len {
                return Err(OptimError::StateLength {
                    name,
                    len: v.len(),
                    owned: self.len,
                });
            }
            tensors.push((name, v));
        }
        let scalars = sink
            .scalars
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect();
        Ok(ExportedState { tensors, scalars })
    }

    /// Replaces the state with `state` (tensors `len` long, as [`Self::export_state`] gives).
    /// An empty state means "no step taken yet".
    pub fn import_state(&mut self, state: ExportedState) -> Result<(), OptimError> {
        // The caller's parameters are the master again at the next step.
        self.master = None;
        if state.tensors.is_empty() && state.scalars.is_empty() {
            match &mut self.kind {
                Kind::AdamW(b) => b.1 = None,
                Kind::Sgd(b) => b.1 = None,
                Kind::Fused(f) => {
                    f.shard = None;
                    f.pending = None;
                }
            }
            return Ok(());
        }
        let scalars = state
            .scalars
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect();
        let mut src = StateSource::new(scalars);
        for (name, v) in state.tensors {
            if v.len() != self.len {
                return Err(OptimError::StateLength {
                    name,
                    len: v.len(),
                    owned: self.len,
                });
            }
            src.insert_tensor(name, TensorData::new(v, [self.len]));
        }
        let kind = self.kind();
        let missing = || OptimError::StateMissing { kind };
        match &mut self.kind {
            Kind::AdamW(b) => {
                b.1 = Some(
                    AdamWState::<1>::state_unflatten("", &mut src, &self.device)
                        .ok_or_else(missing)?,
                )
            }
            Kind::Sgd(b) => {
                b.1 = Some(
                    SgdState::<1>::state_unflatten("", &mut src, &self.device)
                        .ok_or_else(missing)?,
                )
            }
            Kind::Fused(f) => {
                let st = AdamWState::<1>::state_unflatten("", &mut src, &self.device)
                    .ok_or_else(missing)?;
                let read = |t: Tensor<1>| {
                    t.try_into_vec_as::<f32>()
                        .map_err(|reason| OptimError::ReadBack {
                            what: "optimizer state".into(),
                            reason,
                        })
                };
                let mo = st.momentum;
                let steps = u32::try_from(mo.time).map_err(|_| OptimError::StepCount(mo.time))?;
                // The host parameters become the master again at the next step.
                f.shard = None;
                f.pending = Some((read(mo.moment_1)?, read(mo.moment_2)?, steps));
            }
        }
        Ok(())
    }

    /// Bytes of optimizer state this rank holds (m and v for AdamW, velocity for SGD).
    pub fn state_bytes(&self) -> usize {
        match &self.kind {
            Kind::AdamW(..) | Kind::Fused(..) => 2 * 4 * self.len,
            Kind::Sgd(..) => 4 * self.len,
        }
    }
}
