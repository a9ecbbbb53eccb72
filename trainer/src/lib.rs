//! wiretrain: portable distributed training for Burn models.
//!
//! This crate holds the trainer and the `wiretrain` binary. The communication layer is the
//! `wiretrain-comm` crate, re-exported as [`comm`]: rendezvous, shared-buffer and QUIC
//! transports, and the collectives (all-reduce, reduce-scatter, all-gather, broadcast,
//! barrier) with non-blocking [`comm::Work`] handles.
//!
//! A [`Trainer`] runs one optimizer step of any Burn module under a [`Strategy`] (DDP, ZeRO-1,
//! ZeRO-2; ZeRO-3 for models cut into [`units::Units`]) across the ranks of a process group:
//!
//! ```
//! use wiretrain::comm::{Node, NodeConfig, tls::Token};
//! use wiretrain::models::mlp::{Dataset, Mlp};
//! use wiretrain::{Strategy, Trainer, TrainerConfig, data::DistributedSampler};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let data = Dataset::synthetic(512, 1);
//! // One node with one rank; `NodeConfig::new` joins a multi-node job instead.
//! let mut node = Node::join(NodeConfig::single_node(1, Token::generate()))?;
//! let pg = node.take_groups().pop().expect("one rank");
//! let device = burn::tensor::Device::flex().autodiff();
//! let mut sampler = DistributedSampler::new(data.len(), 32, pg.world(), pg.rank(), 1)?;
//! let cfg = TrainerConfig::builder(Strategy::Zero2).lr(1e-2).build()?;
//! let mut trainer = Trainer::new(Mlp::new(&device, 1), &device, cfg, pg)?;
//! let mut losses = Vec::new();
//! for step in 0..30 {
//!     let idx = sampler.indices(step);
//!     losses.push(trainer.step(|m| m.loss(&data, &idx, &device))?.loss);
//! }
//! assert!(losses[29] < losses[0]);
//! node.shutdown()?;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs, unreachable_pub)]

pub use wiretrain_comm as comm;

pub mod auto;
pub mod balance;
pub mod checkpoint;
mod clock;
pub mod data;
pub mod device;
pub mod elastic;
pub mod engine;
mod error;
pub mod faults;
pub mod fit;
pub mod flat;
pub mod heal;
pub mod heap;
pub mod job;
pub mod learner;
pub mod memcap;
pub mod models;
pub mod optim;
pub mod pipeline;
pub mod plan;
#[cfg(feature = "plot")]
pub mod plot;
pub mod rss;
pub mod run;
pub mod signal;
pub mod strategy;
pub mod trace;
pub mod transfer;
pub mod units;

pub use engine::{MemoryReport, StepReport, TrainError, Trainer, TrainerConfig};
pub use job::JobOptions;
pub use run::{RankContext, RunError, run};
pub use strategy::Strategy;
