//! The data-parallel strategies.
//!
//! * `Ddp`: mean all-reduce of the gradients bucket by bucket; every rank runs the same
//!   optimizer step on the whole flat vector.
//! * `Zero1`: gradients are reduce-scattered bucket by bucket; each rank steps only its shard
//!   of every bucket, with optimizer state for that shard only; the updated shards are
//!   all-gathered.
//! * `Zero2`: as ZeRO-1, but each full-gradient bucket is flattened, reduce-scattered and
//!   dropped before the next is read, so a rank holds its gradient shard plus one bucket.
//! * `Hybrid`: ZeRO-2 inside each node, replication across nodes (FSDP's HYBRID_SHARD_ZERO2):
//!   gradients are reduced over all ranks but each rank keeps only its node pieces; optimizer
//!   state is sharded among a node's ranks; updated parameters are gathered inside the node
//!   only, so the traffic between nodes is the gradient reduction alone.
//! * `Hsdp`: ZeRO-3 inside each node, replication across nodes (FSDP's HYBRID_SHARD): unit
//!   parameters are gathered inside the node only; between nodes travels the gradient reduction.
//! * `Zero3`: parameters sharded too; a unit's full parameters are all-gathered just before it
//!   runs (forward and backward, prefetched) and freed after (see `trainer::zero3`).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Ddp,
    Zero1,
    Zero2,
    Zero3,
    Hybrid,
    Hsdp,
}

impl Strategy {
    /// Parameters are sharded at rest and gathered unit by unit (ZeRO-3, HSDP).
    pub fn shards_params(self) -> bool {
        matches!(self, Self::Zero3 | Self::Hsdp)
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
