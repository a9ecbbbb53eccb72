//! Optimizer state for a flat shard (ZeRO) or the whole flat vector (DDP).
//!
//! The step is Burn's own per-tensor optimizer (AdamW, or SGD with momentum) applied to one
//! 1-D tensor on the rank's device, so every strategy runs the same element-wise math and the
//! state (m and v for AdamW) exists only for the elements this rank owns.

use crate::checkpoint::ScalarValue;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, Optimizer, RecordState, Sgd, SgdConfig, SgdState, StateSink,
    StateSource,
};
use burn::store::burn_pack::Scalar;
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The optimizer a run uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimConfig {
    AdamW {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
    Sgd {
        momentum: f64,
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
    pub tensors: Vec<(String, Vec<f32>)>,
    pub scalars: BTreeMap<String, ScalarValue>,
}

enum Kind {
    AdamW(Box<(AdamW, Option<AdamWState<1>>)>),
    Sgd(Box<(Sgd, Option<SgdState<1>>)>),
}

/// Optimizer and its state for `len` owned elements.
pub struct ShardOptimizer {
    kind: Kind,
    device: Device,
    len: usize,
}

impl ShardOptimizer {
    pub fn new(cfg: &OptimConfig, device: Device, len: usize) -> Self {
        let kind = match cfg {
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
        };
        Self {
            kind,
            device: device.inner(),
            len,
        }
    }

    /// Updates `params` in place from `grads` (both `len` long).
    pub fn step(&mut self, lr: f64, params: &mut [f32], grads: &[f32]) {
        assert_eq!(params.len(), self.len);
        assert_eq!(grads.len(), self.len);
        if self.len == 0 {
            return;
        }
        let p = Tensor::<1>::from_data(TensorData::new(params.to_vec(), [self.len]), &self.device);
        let g = Tensor::<1>::from_data(TensorData::new(grads.to_vec(), [self.len]), &self.device);
        let out = match &mut self.kind {
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
        };
        let v = out
            .try_into_vec_as::<f32>()
            .expect("optimizer output reads back as f32");
        params.copy_from_slice(&v);
    }

    /// "adamw" or "sgd".
    pub fn kind(&self) -> &'static str {
        match &self.kind {
            Kind::AdamW(..) => "adamw",
            Kind::Sgd(..) => "sgd",
        }
    }

    /// The optimizer state as named per-element tensors (each `len` long) and scalars, through
    /// Burn's own `RecordState` decomposition; empty before the first step.
    pub fn export_state(&self) -> Result<ExportedState, String> {
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
        }
        let mut tensors = Vec::with_capacity(sink.tensors.len());
        for (name, data) in sink.tensors {
            let v = data
                .try_to_vec::<f32>()
                .map_err(|e| format!("optimizer state {name}: {e:?}"))?;
            if v.len() != self.len {
                return Err(format!(
                    "optimizer state {name} has {} elements, not one per owned element ({})",
                    v.len(),
                    self.len
                ));
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
    pub fn import_state(&mut self, state: ExportedState) -> Result<(), String> {
        if state.tensors.is_empty() && state.scalars.is_empty() {
            match &mut self.kind {
                Kind::AdamW(b) => b.1 = None,
                Kind::Sgd(b) => b.1 = None,
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
                return Err(format!(
                    "optimizer state {name} has {} elements, this rank owns {}",
                    v.len(),
                    self.len
                ));
            }
            src.insert_tensor(name, TensorData::new(v, [self.len]));
        }
        let kind = self.kind();
        let missing = || format!("the checkpoint lacks part of the {kind} state");
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
        }
        Ok(())
    }

    /// Bytes of optimizer state this rank holds (m and v for AdamW, velocity for SGD).
    pub fn state_bytes(&self) -> usize {
        match &self.kind {
            Kind::AdamW(..) => 2 * 4 * self.len,
            Kind::Sgd(..) => 4 * self.len,
        }
    }
}
