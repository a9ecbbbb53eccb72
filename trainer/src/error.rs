//! What can go wrong while training ([`TrainError`]); below the trainer and the strategies,
//! which both return it.

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
    /// The strategy shards parameters (ZeRO-3, HSDP): it needs a model cut into units and
    /// its unit-by-unit step; `use_instead` names the call that provides them.
    #[error(
        "invalid trainer configuration: {strategy} shards parameters, which needs a model cut \
         into units: use {use_instead}"
    )]
    NeedsUnits {
        strategy: crate::strategy::Strategy,
        use_instead: &'static str,
    },
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error("optimizer step: {0}")]
    Optimizer(String),
    /// Another rank failed (it reported its own error); this rank stops with it.
    #[error("{0}")]
    OtherRank(String),
}
