//! wiretrain: portable distributed training for Burn models.
//!
//! This crate holds the trainer and the `wiretrain` binary. The communication layer is the
//! `wiretrain-comm` crate, re-exported as [`comm`]: rendezvous, shared-buffer and QUIC
//! transports, and the collectives (all-reduce, reduce-scatter, all-gather, broadcast,
//! barrier) with non-blocking [`comm::Work`] handles.

pub use wiretrain_comm as comm;

pub mod data;
pub mod device;
pub mod flat;
pub mod launch;
pub mod models;
pub mod optim;
pub mod plot;
pub mod signal;
pub mod strategy;
pub mod trainer;
pub mod units;

pub use strategy::Strategy;
pub use trainer::{MemoryReport, StepReport, TrainError, Trainer, TrainerConfig};
