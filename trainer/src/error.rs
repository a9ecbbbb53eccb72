//! What can go wrong while training ([`TrainError`]), each cause a type: below the trainer
//! and the strategies, which both return it.

use crate::strategy::Strategy;
use std::path::PathBuf;

/// What can go wrong while training.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error(transparent)]
    Comm(#[from] wiretrain_comm::Error),
    #[error("ranks disagree on the model: {0}")]
    ModelMismatch(#[from] ModelMismatch),
    #[error("invalid trainer configuration: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error("optimizer step: {0}")]
    Optimizer(#[from] crate::optim::OptimError),
    /// Another rank failed (it reported its own error); this rank stops with it.
    #[error(transparent)]
    OtherRank(#[from] OtherRank),
    /// Healing from live replicas failed (the state exchange of a new epoch).
    #[error("healing from live replicas: {0}")]
    Heal(String),
}

/// How rank 0's model and this rank's differ.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelMismatch {
    #[error("rank {rank} has {count} float parameters, rank {other} has {other_count}")]
    Count {
        rank: usize,
        count: usize,
        other: usize,
        other_count: usize,
    },
    #[error(
        "parameter #{index} differs between rank 0 and rank {rank}: here it is {path:?} with \
         shape {shape:?}"
    )]
    Parameter {
        index: usize,
        rank: usize,
        path: String,
        shape: Vec<usize>,
    },
}

/// A trainer configuration (or a call) that cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("lr {0} must be a positive number")]
    Lr(f64),
    #[error("bucket size {0} bytes holds no element")]
    BucketTooSmall(usize),
    #[error("prefetch {0} units ahead is more than 16")]
    Prefetch(usize),
    #[error("accumulation needs at least one micro-batch")]
    NoMicroBatch,
    /// The model state of the ranks this process holds (the planner's figure) is above the
    /// process's memory cap (its cgroup's limit).
    #[error(
        "{strategy} needs about {need} of model state in this process ({local} rank(s), the \
         planner's figure), above its memory cap of {cap} (cgroup memory limit): {instead}"
    )]
    MemoryCap {
        strategy: Strategy,
        need: String,
        local: usize,
        cap: String,
        instead: String,
    },
    #[error(
        "{strategy} runs one micro-batch per step, not {micro} (accumulation with sharded \
         parameters is not built yet); use zero2 or hybrid to accumulate"
    )]
    AccumulateSharded { micro: usize, strategy: Strategy },
    /// The strategy shards parameters (ZeRO-3, HSDP): it needs a model cut into units and
    /// its unit-by-unit step; `use_instead` names the call that provides them.
    #[error("{strategy} shards parameters, which needs a model cut into units: use {use_instead}")]
    NeedsUnits {
        strategy: Strategy,
        use_instead: &'static str,
    },
    #[error(
        "diloco runs on top of ddp or hybrid (inner steps replicate the model, or shard it, \
         inside a node)"
    )]
    DilocoStrategy(Strategy),
    #[error("diloco needs at least 1 inner step")]
    DilocoInnerSteps,
    #[error("diloco outer lr {0} must be a positive number")]
    OuterLr(f32),
    #[error("diloco outer momentum {0} is outside [0, 1)")]
    OuterMomentum(f32),
    #[error("a model with no units")]
    NoUnits,
    #[error("parameter {path:?} is put in unit {unit}, but the model has {units} units")]
    UnitOutOfRange {
        path: String,
        unit: usize,
        units: usize,
    },
    /// A unit split that does not follow module order (see `Units::unit_of`).
    #[error(
        "parameter {path:?} is in unit {unit} after a parameter of unit {previous}; units must \
         follow module order"
    )]
    UnitOrder {
        path: String,
        unit: usize,
        previous: usize,
    },
    #[error("unit {0} produced no input gradient")]
    NoInputGradient(usize),
    #[error("unit {0} must output a float activation matching its gradient")]
    UnitOutput(usize),
}

/// Another rank failed; its own error is in its log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtherRank {
    #[error("a rank's checkpoint report is not readable: {0}")]
    UnreadableReport(serde_json::Error),
    #[error(
        "checkpoint of step {step} not written: rank(s) {ranks:?} could not write their shard \
         (older checkpoints are untouched)"
    )]
    ShardsNotWritten { step: usize, ranks: Vec<usize> },
    #[error("checkpoint of step {step}: rank 0 could not write the manifest")]
    ManifestNotWritten { step: usize },
    #[error("rank 0 could not read the checkpoints in {}", .root.display())]
    ListUnreadable { root: PathBuf },
    /// Machine-local checkpoint directories that do not hold the same checkpoints.
    #[error(
        "the ranks see different checkpoints in {}: rank {rank} lists steps {theirs}, rank 0 \
         lists {rank0} (machine-local directories out of step?); make them hold the same \
         checkpoints, or resume from rank 0's with --trust-rank0-checkpoints",
        .root.display()
    )]
    ListingsDiffer {
        root: PathBuf,
        rank: usize,
        theirs: String,
        rank0: String,
    },
    #[error(
        "{ranks} rank(s) found checkpoint {} unfit for this run (their errors are above)",
        .dir.display()
    )]
    CheckpointUnfit { ranks: usize, dir: PathBuf },
    #[error(
        "no checkpoint in {} could be loaded by every rank (their errors are above)",
        .root.display()
    )]
    NoneLoadable { root: PathBuf },
    #[error("rank 0 refused checkpoint directory {} (its error is above)", .root.display())]
    DirRefused { root: PathBuf },
    #[error(
        "checkpoint directory {} is in use by another run (rank 0's error above names it)",
        .root.display()
    )]
    DirLocked { root: PathBuf },
    #[error(
        "{ranks} rank(s) could not load checkpoint {} (their errors are above)",
        .dir.display()
    )]
    LoadFailed { ranks: usize, dir: PathBuf },
}
