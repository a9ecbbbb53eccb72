//! How to train ([`TrainerConfig`]): built through [`TrainerConfigBuilder`], which checks every
//! setting once, so a `TrainerConfig` is valid by construction and the trainer, the loop and
//! the CLI never check its invariants again.

use crate::error::ConfigError;
use crate::faults::Faults;
use crate::flat::BufferSync;
use crate::optim::OptimConfig;
use crate::strategy::Strategy;
use crate::strategy::diloco::Diloco;
use std::time::Duration;
use wiretrain_comm::WireDtype;

/// Unit all-gathers ZeRO-3 may keep in flight ahead of the unit computing.
pub(crate) const MAX_PREFETCH: usize = 16;

/// Whether a model cut into [`Units`](crate::units::Units) runs DDP, ZeRO-1/2 and hybrid steps
/// unit by unit, so that each unit's gradient reduction is in flight while the backward of
/// the units before it runs (as PyTorch DDP's buckets and FSDP's reduce-scatters overlap
/// backward). Nothing is recomputed: each unit keeps its own graph from the forward pass, and
/// the units become the communication buckets. What it costs is a backward cut into one call
/// per unit, and reductions the size of a unit rather than of a bucket. ZeRO-3 and HSDP
/// always step unit by unit; models without units, steps of several micro-batches, and
/// DiLoCo (whose inner reductions stay inside the node) never overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlap {
    /// On when the gradient reduction crosses nodes (the job spans more than one node and
    /// is not DiLoCo, whose inner steps stay inside the node); off otherwise.
    #[default]
    Auto,
    /// On, inside a node too; never under DiLoCo.
    On,
    /// Off: the reductions follow the whole backward pass (ZeRO-3 and HSDP still step unit
    /// by unit).
    Off,
}

impl std::str::FromStr for Overlap {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("{other:?} is not auto, on or off")),
        }
    }
}

impl std::fmt::Display for Overlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// How to train: [`TrainerConfig::new`] gives the defaults, [`TrainerConfig::builder`] (or
/// [`TrainerConfig::to_builder`]) changes them.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub(super) strategy: Strategy,
    pub(super) optim: OptimConfig,
    pub(super) lr: f64,
    pub(super) bucket_bytes: usize,
    pub(super) prefetch: usize,
    pub(super) wire: WireDtype,
    pub(super) fused_optimizer: bool,
    pub(super) device_resident: bool,
    pub(super) buffer_sync: BufferSync,
    pub(super) overlap: Overlap,
    pub(super) diloco: Option<Diloco>,
    pub(super) checkpoint_timeout: Duration,
    pub(super) trust_rank0_checkpoints: bool,
    pub(super) faults: Faults,
}

impl TrainerConfig {
    /// The defaults for `strategy`: AdamW at lr 1e-3, 25 MiB buckets, prefetch 1, f32 on the
    /// wire, device-resident DDP, the fused optimizer elsewhere, overlap `auto`, no DiLoCo, a 600 s
    /// checkpoint timeout.
    pub fn new(strategy: Strategy) -> Self {
        Self {
            strategy,
            optim: OptimConfig::default(),
            lr: 1e-3,
            bucket_bytes: 25 << 20,
            prefetch: 1,
            wire: WireDtype::F32,
            fused_optimizer: true,
            device_resident: true,
            buffer_sync: BufferSync::Broadcast,
            overlap: Overlap::Auto,
            diloco: None,
            checkpoint_timeout: Duration::from_secs(600),
            trust_rank0_checkpoints: false,
            faults: Faults::default(),
        }
    }

    /// A builder from the defaults for `strategy`.
    pub fn builder(strategy: Strategy) -> TrainerConfigBuilder {
        TrainerConfigBuilder(Self::new(strategy))
    }

    /// A builder from this configuration.
    pub fn to_builder(&self) -> TrainerConfigBuilder {
        TrainerConfigBuilder(self.clone())
    }

    /// The data-parallel strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The optimizer and its settings (the learning rate aside).
    pub fn optim(&self) -> &OptimConfig {
        &self.optim
    }

    /// The learning rate of the first step ([`super::Trainer::set_lr`] changes it later).
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Bucket size in bytes (f32 elements × 4).
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// ZeRO-3: unit all-gathers in flight ahead of the unit computing.
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }

    /// Element type between nodes for gradient reductions and parameter gathers.
    pub fn wire(&self) -> WireDtype {
        self.wire
    }

    /// Whether AdamW on a wgpu device runs as wiretrain's fused kernel (see the builder's
    /// method).
    pub fn fused_optimizer(&self) -> bool {
        self.fused_optimizer
    }

    /// Whether DDP keeps the parameters on the device (see the builder's method).
    pub fn device_resident(&self) -> bool {
        self.device_resident
    }

    /// Whether unit models overlap gradient reductions with backward ([`Overlap`]).
    pub fn overlap(&self) -> Overlap {
        self.overlap
    }

    /// DiLoCo's outer-loop settings, when DiLoCo wraps the strategy.
    pub fn diloco(&self) -> Option<Diloco> {
        self.diloco
    }

    /// How the ranks keep module state that is not trained in step (see the builder's
    /// method).
    pub fn buffer_sync(&self) -> BufferSync {
        self.buffer_sync
    }

    /// The deadline of a checkpoint save's collectives (see the builder's method).
    pub fn checkpoint_timeout(&self) -> Duration {
        self.checkpoint_timeout
    }

    /// The injected faults and slowdowns (none by default).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }
}

/// Builder methods that each set the field of their name: `name(arg: Type);` becomes
/// `pub fn name(mut self, arg: Type) -> Self`.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $ty:ty);)*) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $arg: $ty) -> Self {
            self.0.$name = $arg;
            self
        }
    )*};
}

/// Changes a [`TrainerConfig`]; [`TrainerConfigBuilder::build`] checks the result.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until build() is called"]
pub struct TrainerConfigBuilder(TrainerConfig);

impl TrainerConfigBuilder {
    setters! {
        /// The data-parallel strategy.
        strategy(strategy: Strategy);
        /// The optimizer and its settings (AdamW by default); the learning rate is `lr`.
        optim(optim: OptimConfig);
        /// A positive, finite learning rate.
        lr(lr: f64);
        /// Bucket size in bytes (f32 elements × 4); 25 MiB like PyTorch DDP; at least 4.
        bucket_bytes(bytes: usize);
        /// ZeRO-3: unit all-gathers in flight ahead of the unit computing (0 = no prefetch, at
        /// most [`MAX_PREFETCH`]).
        prefetch(units: usize);
        /// Element type between nodes for gradient reductions and parameter gathers (f32, f16,
        /// bf16, int8). Sums accumulate in f32; master weights and optimizer state stay f32 on
        /// their owner; every rank computes with the same (decoded) parameters.
        wire(wire: WireDtype);
        /// On a wgpu device, run AdamW as wiretrain's fused WGSL kernel (master, m and v on the
        /// device) instead of Burn's tensor ops. Same math; off for comparisons.
        fused_optimizer(on: bool);
        /// DDP (DiLoCo's inner DDP too) keeps the parameters and the optimizer state on the rank's
        /// device: each gradient bucket is read once, the reduced gradient is written once,
        /// Burn's optimizer steps on the device and no parameter is read back; at world 1
        /// only the loss leaves the device. The other strategies keep the f32 master of what
        /// the rank owns on the device between steps (Burn's optimizers, as the fused AdamW
        /// does; not on Burn's CPU backend, whose device is host memory): a step uploads the
        /// owned gradient, not the master besides. On by default;
        /// off gives the host path (the fused AdamW on a wgpu device), for comparisons.
        device_resident(on: bool);
        /// How the ranks keep module state that is not trained (Burn's `RunningState`:
        /// BatchNorm's running mean and variance) in step after every step: rank 0's values
        /// (the default, as PyTorch DDP's `broadcast_buffers`), the mean, or each its own.
        buffer_sync(policy: BufferSync);
        /// Unit models under DDP, ZeRO-1/2 and hybrid: reduce each unit's gradient while the
        /// backward of the units before it runs ([`Overlap`]; `auto` by default).
        overlap(overlap: Overlap);
        /// DiLoCo on top of DDP or hybrid (sharded inside the node): inner steps reduce inside
        /// the node only; every `inner_steps` steps the nodes average their parameter deltas (the
        /// only traffic between nodes) and apply an outer Nesterov-momentum SGD step.
        diloco(diloco: Option<Diloco>);
        /// The deadline of the collectives of a checkpoint save (ranks that wrote their part wait
        /// there for the slowest writer); the longer of this and the collective timeout applies.
        checkpoint_timeout(timeout: Duration);
        /// A resume takes the checkpoints rank 0 lists even where another rank's directory
        /// holds others (off: every rank lists its own and a difference fails the resume).
        trust_rank0_checkpoints(on: bool);
        /// Injected faults and slowdowns (none by default; see [`crate::faults`]).
        faults(faults: Faults);
    }

    /// The configuration, once every setting is checked.
    pub fn build(self) -> Result<TrainerConfig, ConfigError> {
        let c = self.0;
        if !(c.lr.is_finite() && c.lr > 0.0) {
            return Err(ConfigError::Lr(c.lr));
        }
        if c.bucket_bytes < 4 {
            return Err(ConfigError::BucketTooSmall(c.bucket_bytes));
        }
        if c.prefetch > MAX_PREFETCH {
            return Err(ConfigError::Prefetch(c.prefetch));
        }
        if let Some(d) = c.diloco {
            crate::strategy::diloco::check(c.strategy, d)?;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_refuses_each_invalid_setting_and_keeps_valid_ones() {
        let b = || TrainerConfig::builder(Strategy::Hybrid);
        let c = b().lr(0.5).bucket_bytes(8).prefetch(16).build().unwrap();
        assert_eq!((c.lr(), c.bucket_bytes(), c.prefetch()), (0.5, 8, 16));
        let err = |b: TrainerConfigBuilder| b.build().unwrap_err().to_string();
        assert_eq!(err(b().lr(0.0)), "lr 0 must be a positive number");
        assert!(err(b().lr(f64::NAN)).contains("positive"));
        assert_eq!(
            err(b().bucket_bytes(3)),
            "bucket size 3 bytes holds no element"
        );
        assert!(err(b().prefetch(17)).contains("more than 16"));
        let d = Diloco::default();
        assert!(b().diloco(Some(d)).build().is_ok());
        assert!(err(b().strategy(Strategy::Zero1).diloco(Some(d))).contains("ddp or hybrid"));
        let zero = Diloco {
            inner_steps: 0,
            ..d
        };
        assert!(err(b().diloco(Some(zero))).contains("at least 1 inner step"));
        let mu = Diloco {
            outer_momentum: 1.0,
            ..d
        };
        assert!(err(b().diloco(Some(mu))).contains("outside [0, 1)"));
        let lr = Diloco {
            outer_lr: -1.0,
            ..d
        };
        assert!(err(b().diloco(Some(lr))).contains("outer lr -1"));
    }
}
