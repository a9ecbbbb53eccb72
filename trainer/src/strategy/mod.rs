//! The data-parallel strategies: a [`Strategy`] names a point on two axes, the sharding
//! [`Stage`] (what is sharded: nothing, optimizer state, gradients, parameters) and the
//! [`Scope`] a shard spans (the world, or the node with replicas across nodes, as FSDP's
//! hybrid sharding and torchtitan's replicate × shard mesh).
//!
//! * `Ddp` (stage 0): mean all-reduce of the gradients bucket by bucket; every rank runs the
//!   same optimizer step on the whole flat vector ([`ddp`]).
//! * `Zero1` (stage 1): gradients are reduce-scattered bucket by bucket; each rank steps only
//!   its shard of every bucket, with optimizer state for that shard only; the updated shards
//!   are all-gathered ([`sharded`]).
//! * `Zero2` (stage 2): as ZeRO-1, but each full-gradient bucket is flattened,
//!   reduce-scattered and dropped before the next is read, so a rank holds its gradient shard
//!   plus one bucket ([`sharded`]).
//! * `Hybrid` (stage 2, node scope): FSDP's HYBRID_SHARD_ZERO2: gradients are reduced over
//!   all ranks but each rank keeps only its node shard; optimizer state is sharded among a
//!   node's ranks; updated parameters are gathered inside the node only, so the traffic
//!   between nodes is the gradient reduction alone ([`sharded`]).
//! * `Zero3` (stage 3): parameters sharded too; a unit's full parameters are all-gathered just
//!   before it runs (forward and backward, prefetched) and freed after (`engine::units`).
//! * `Hsdp` (stage 3, node scope): FSDP's HYBRID_SHARD: unit parameters are gathered inside
//!   the node only; between nodes travels the gradient reduction.
//!
//! DiLoCo ([`diloco`]) wraps DDP or hybrid: its inner steps reduce inside the node only.
//!
//! Each gradient sync is a [`GradSync`], one file per kind; the trainer holds one, chosen once
//! from the configuration ([`sync_for`]), and never branches on the strategy's name.

use serde::{Deserialize, Serialize};

/// A data-parallel strategy: a sharding [`Stage`] at a [`Scope`] (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Stage 0: gradients all-reduced, everything replicated.
    Ddp,
    /// Stage 1 over the world: optimizer state sharded.
    Zero1,
    /// Stage 2 over the world: optimizer state and gradients sharded.
    Zero2,
    /// Stage 3 over the world: parameters sharded too, gathered unit by unit.
    Zero3,
    /// Stage 2 inside the node, replicated across nodes (FSDP's HYBRID_SHARD_ZERO2).
    Hybrid,
    /// Stage 3 inside the node, replicated across nodes (FSDP's HYBRID_SHARD).
    Hsdp,
}

/// What a strategy shards across the ranks of its scope (the ZeRO paper's stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Stage 0: nothing; every rank holds and steps everything (DDP).
    Replicated,
    /// Stage 1: optimizer state.
    OptimizerState,
    /// Stage 2: optimizer state and gradients.
    Gradients,
    /// Stage 3: optimizer state, gradients and parameters.
    Parameters,
}

/// Which ranks a shard spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Shards span every rank of the job.
    World,
    /// Shards span the ranks of a node; the nodes hold replicas of each other's shards and
    /// only the gradient reduction crosses nodes.
    Node,
}

impl Strategy {
    /// Every strategy, in the order of the stages.
    pub const ALL: [Self; 6] = [
        Self::Ddp,
        Self::Zero1,
        Self::Zero2,
        Self::Zero3,
        Self::Hybrid,
        Self::Hsdp,
    ];

    /// What this strategy shards.
    pub fn stage(self) -> Stage {
        match self {
            Self::Ddp => Stage::Replicated,
            Self::Zero1 => Stage::OptimizerState,
            Self::Zero2 | Self::Hybrid => Stage::Gradients,
            Self::Zero3 | Self::Hsdp => Stage::Parameters,
        }
    }

    /// Which ranks a shard spans.
    pub fn scope(self) -> Scope {
        match self {
            Self::Hybrid | Self::Hsdp => Scope::Node,
            _ => Scope::World,
        }
    }

    /// The strategy at (`stage`, `scope`), if wiretrain has one there (stage 0 has no scope;
    /// stage 1 is not offered at node scope).
    pub fn at(stage: Stage, scope: Scope) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|s| s.stage() == stage && (s.scope() == scope || stage == Stage::Replicated))
    }

    /// Parameters are sharded at rest and gathered unit by unit (ZeRO-3, HSDP): such a
    /// strategy needs a model cut into units ([`crate::units::Units`]).
    pub fn shards_params(self) -> bool {
        self.stage() == Stage::Parameters
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ddp" => Ok(Self::Ddp),
            "zero1" => Ok(Self::Zero1),
            "zero2" => Ok(Self::Zero2),
            "zero3" | "fsdp" => Ok(Self::Zero3),
            "hybrid" => Ok(Self::Hybrid),
            "hsdp" => Ok(Self::Hsdp),
            other => Err(format!(
                "{other:?} is not a strategy (ddp, zero1, zero2, zero3, hybrid, hsdp)"
            )),
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ddp => "ddp",
            Self::Zero1 => "zero1",
            Self::Zero2 => "zero2",
            Self::Zero3 => "zero3",
            Self::Hybrid => "hybrid",
            Self::Hsdp => "hsdp",
        })
    }
}

mod ddp;
pub(crate) mod diloco;
mod holds;
mod reach;
mod sharded;
mod sync;

pub(crate) use holds::{Replicas, flat_ranges};
pub(crate) use reach::Reach;
pub(crate) use sync::{Grad, GradSync, Held, SyncCx, sync_for};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_strategy_is_the_one_at_its_axes_and_round_trips_by_name() {
        for s in Strategy::ALL {
            assert_eq!(Strategy::at(s.stage(), s.scope()), Some(s), "{s}");
            assert_eq!(s.to_string().parse::<Strategy>(), Ok(s));
        }
        assert_eq!(
            Strategy::at(Stage::Replicated, Scope::Node),
            Some(Strategy::Ddp)
        );
        assert_eq!(Strategy::at(Stage::OptimizerState, Scope::Node), None);
        assert!(Strategy::Hsdp.shards_params() && !Strategy::Hybrid.shards_params());
        assert_eq!("fsdp".parse::<Strategy>(), Ok(Strategy::Zero3));
    }
}
