//! The data-parallel strategies.
//!
//! * `Ddp`: mean all-reduce of the gradients bucket by bucket; every rank runs the same
//!   optimizer step on the whole flat vector.
//! * `Zero1`: gradients are reduce-scattered bucket by bucket; each rank steps only its shard
//!   of every bucket, with optimizer state for that shard only; the updated shards are
//!   all-gathered.
//! * `Zero2`: as ZeRO-1, but each full-gradient bucket is flattened, reduce-scattered and
//!   dropped before the next is read, so a rank holds its gradient shard plus one bucket.
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
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ddp" => Ok(Self::Ddp),
            "zero1" => Ok(Self::Zero1),
            "zero2" => Ok(Self::Zero2),
            "zero3" | "fsdp" => Ok(Self::Zero3),
            other => Err(format!(
                "{other:?} is not a strategy (ddp, zero1, zero2, zero3)"
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
        })
    }
}
