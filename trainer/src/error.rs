//! What can go wrong while training ([`TrainError`]), each cause a type: below the trainer
//! and the strategies, which both return it.

use crate::strategy::Strategy;
use std::path::PathBuf;

/// What can go wrong while training.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The communication layer failed (rendezvous, transport or a collective).
    #[error(transparent)]
    Comm(#[from] wiretrain_comm::Error),
    /// At start-up, this rank's parameter list differs from rank 0's.
    #[error("ranks disagree on the model: {0}")]
    ModelMismatch(#[from] ModelMismatch),
    /// The configuration, or the arguments of a call, cannot run.
    #[error("invalid trainer configuration: {0}")]
    Config(#[from] ConfigError),
    /// Writing, reading or verifying a checkpoint failed on this rank.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// The optimizer could not step this rank's parameters.
    #[error("optimizer step: {0}")]
    Optimizer(#[from] crate::optim::OptimError),
    /// Another rank failed (it reported its own error); this rank stops with it.
    #[error(transparent)]
    OtherRank(#[from] OtherRank),
    /// Healing from live replicas failed (the state exchange of a new epoch).
    #[error("healing from live replicas: {0}")]
    Heal(String),
    /// A pipeline cannot run as configured, or a stage boundary failed.
    #[error(transparent)]
    Pipeline(#[from] crate::pipeline::PipelineError),
}

/// How rank 0's model and this rank's differ.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelMismatch {
    /// The ranks' models have different numbers of float parameters.
    #[error("rank {rank} has {count} float parameters, rank {other} has {other_count}")]
    Count {
        /// This rank.
        rank: usize,
        /// This rank's number of float parameters.
        count: usize,
        /// The first rank whose number differs from this rank's.
        other: usize,
        /// That rank's number of float parameters.
        other_count: usize,
    },
    /// A parameter's path or shape differs from rank 0's at the same position.
    #[error(
        "parameter #{index} differs between rank 0 and rank {rank}: here it is {path:?} with \
         shape {shape:?}"
    )]
    Parameter {
        /// Position of the first differing parameter in the parameter list.
        index: usize,
        /// This rank.
        rank: usize,
        /// The parameter's module path on this rank.
        path: String,
        /// The parameter's shape on this rank.
        shape: Vec<usize>,
    },
}

/// A trainer configuration (or a call) that cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The learning rate is not a finite number above 0.
    #[error("lr {0} must be a positive number")]
    Lr(f64),
    /// The gradient bucket size (bytes) is under 4, the size of one `f32` element.
    #[error("bucket size {0} bytes holds no element")]
    BucketTooSmall(usize),
    /// The number of units to prefetch ahead is above `MAX_PREFETCH` (16).
    #[error("prefetch {0} units ahead is more than 16")]
    Prefetch(usize),
    /// `step_accumulate` was called with 0 micro-batches.
    #[error("accumulation needs at least one micro-batch")]
    NoMicroBatch,
    /// The model state of the ranks this process holds (the planner's figure) is above the
    /// process's memory cap (its cgroup's limit).
    #[error(
        "{strategy} needs about {need} of model state in this process ({local} rank(s), the \
         planner's figure), above its memory cap of {cap} (cgroup memory limit): {instead}"
    )]
    MemoryCap {
        /// The strategy refused.
        strategy: Strategy,
        /// The model state it needs in this process, formatted in GB.
        need: String,
        /// The number of ranks this process holds.
        local: usize,
        /// The memory cap, formatted in GB.
        cap: String,
        /// The strategies that would fit, or what else to do.
        instead: String,
    },
    /// More than one micro-batch per step was asked for under a strategy that shards
    /// parameters.
    #[error(
        "{strategy} runs one micro-batch per step, not {micro} (accumulation with sharded \
         parameters is not built yet); use zero2 or hybrid to accumulate"
    )]
    AccumulateSharded {
        /// The micro-batches per step asked for.
        micro: usize,
        /// The strategy, which shards parameters.
        strategy: Strategy,
    },
    /// The strategy shards parameters (ZeRO-3, HSDP): it needs a model cut into units and
    /// its unit-by-unit step; `use_instead` names the call that provides them.
    #[error("{strategy} shards parameters, which needs a model cut into units: use {use_instead}")]
    NeedsUnits {
        /// The strategy, which shards parameters.
        strategy: Strategy,
        /// The call to use instead.
        use_instead: &'static str,
    },
    /// DiLoCo was set over an inner strategy other than DDP or hybrid; holds that strategy.
    #[error(
        "diloco runs on top of ddp or hybrid (inner steps replicate the model, or shard it, \
         inside a node)"
    )]
    DilocoStrategy(Strategy),
    /// DiLoCo was set with 0 inner steps per outer step.
    #[error("diloco needs at least 1 inner step")]
    DilocoInnerSteps,
    /// DiLoCo's outer learning rate is not a finite number above 0.
    #[error("diloco outer lr {0} must be a positive number")]
    OuterLr(f32),
    /// DiLoCo's outer momentum is outside `[0, 1)`.
    #[error("diloco outer momentum {0} is outside [0, 1)")]
    OuterMomentum(f32),
    /// A model cut into units reports 0 units.
    #[error("a model with no units")]
    NoUnits,
    /// `unit_of` put a parameter in a unit at or above the model's number of units.
    #[error("parameter {path:?} is put in unit {unit}, but the model has {units} units")]
    UnitOutOfRange {
        /// The parameter's module path.
        path: String,
        /// The unit `unit_of` gave it.
        unit: usize,
        /// The model's number of units.
        units: usize,
    },
    /// A unit split that does not follow module order (see `Units::unit_of`).
    #[error(
        "parameter {path:?} is in unit {unit} after a parameter of unit {previous}; units must \
         follow module order"
    )]
    UnitOrder {
        /// The parameter's module path.
        path: String,
        /// The unit `unit_of` gave it.
        unit: usize,
        /// The unit of an earlier parameter, above `unit`.
        previous: usize,
    },
    /// In the unit-by-unit backward pass, the unit's input got no gradient to pass down.
    #[error("unit {0} produced no input gradient")]
    NoInputGradient(usize),
    /// In the unit-by-unit backward pass, the unit's output has no float part matching the
    /// kind of the gradient coming back into it.
    #[error("unit {0} must output a float activation matching its gradient")]
    UnitOutput(usize),
}

/// Another rank failed; its own error is in its log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtherRank {
    /// While writing a checkpoint, a rank's report of its shard did not parse.
    #[error("a rank's checkpoint report is not readable: {0}")]
    UnreadableReport(serde_json::Error),
    /// While writing a checkpoint, other ranks failed to write their shards.
    #[error(
        "checkpoint of step {step} not written: rank(s) {ranks:?} could not write their shard \
         (older checkpoints are untouched)"
    )]
    ShardsNotWritten {
        /// The step of the checkpoint.
        step: usize,
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// While writing a checkpoint, rank 0 failed to write its manifest or commit it.
    #[error("checkpoint of step {step}: rank 0 could not write the manifest")]
    ManifestNotWritten {
        /// The step of the checkpoint.
        step: usize,
    },
    /// On resume, rank 0 could not list the valid checkpoints in the directory.
    #[error("rank 0 could not read the checkpoints in {}", .root.display())]
    ListUnreadable {
        /// The checkpoint directory.
        root: PathBuf,
    },
    /// Machine-local checkpoint directories that do not hold the same checkpoints.
    #[error(
        "the ranks see different checkpoints in {}: rank {rank} lists steps {theirs}, rank 0 \
         lists {rank0} (machine-local directories out of step?); make them hold the same \
         checkpoints, or resume from rank 0's with --trust-rank0-checkpoints",
        .root.display()
    )]
    ListingsDiffer {
        /// The checkpoint directory.
        root: PathBuf,
        /// The first rank whose listing differs from rank 0's.
        rank: usize,
        /// That rank's listed steps (or that its directory is unreadable).
        theirs: String,
        /// Rank 0's listed steps.
        rank0: String,
    },
    /// On resume, ranks found a checkpoint that does not fit this run (another model or
    /// optimizer).
    #[error(
        "{ranks} rank(s) found checkpoint {} unfit for this run (their errors are above)",
        .dir.display()
    )]
    CheckpointUnfit {
        /// How many ranks found it unfit.
        ranks: usize,
        /// The checkpoint's directory.
        dir: PathBuf,
    },
    /// On resume, each checkpoint tried was unreadable or failed verification on some other
    /// rank.
    #[error(
        "no checkpoint in {} could be loaded by every rank (their errors are above)",
        .root.display()
    )]
    NoneLoadable {
        /// The checkpoint directory.
        root: PathBuf,
    },
    /// Rank 0 could not claim or lock the checkpoint directory for other reasons than another
    /// run's lock (valid checkpoints already in it, an I/O error); rank 0 logs which.
    #[error("rank 0 refused checkpoint directory {} (its error is above)", .root.display())]
    DirRefused {
        /// The checkpoint directory.
        root: PathBuf,
    },
    /// The checkpoint directory is locked by another run.
    #[error(
        "checkpoint directory {} is in use by another run (rank 0's error above names it)",
        .root.display()
    )]
    DirLocked {
        /// The checkpoint directory.
        root: PathBuf,
    },
    /// Other ranks failed to load a checkpoint this rank loaded.
    #[error(
        "{ranks} rank(s) could not load checkpoint {} (their errors are above)",
        .dir.display()
    )]
    LoadFailed {
        /// How many ranks failed to load it.
        ranks: usize,
        /// The checkpoint's directory.
        dir: PathBuf,
    },
}
