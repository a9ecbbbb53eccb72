//! wiretrain-comm: the communication layer of wiretrain.
//!
//! One OS process per node, one rank per device, each rank a thread. Ranks of one node exchange
//! data through shared host buffers ([`transport::local`]); nodes talk over QUIC with mutual
//! TLS 1.3 ([`transport::quic`]). Collectives (all-reduce, reduce-scatter, all-gather,
//! broadcast, barrier) are hierarchical: reduce inside the node, ring across nodes (one ring per
//! local rank, all in parallel), gather inside the node. The ring schedules themselves are pure
//! functions in [`algo`], tested without any I/O.
//!
//! ```no_run
//! use wiretrain_comm::{NodeConfig, Node, ReduceOp};
//! # fn main() -> Result<(), wiretrain_comm::Error> {
//! let cfg = NodeConfig::single_node(2, "job-token".into());
//! let mut node = Node::join(cfg)?;
//! let groups = node.take_groups();
//! let handles: Vec<_> = groups.into_iter().map(|mut pg| std::thread::spawn(move || {
//!     let grads = vec![pg.rank() as f32; 1000];
//!     pg.all_reduce(grads, ReduceOp::Mean).wait()
//! })).collect();
//! for h in handles { h.join().unwrap()?; }
//! node.shutdown()
//! # }
//! ```

#![warn(missing_docs, unreachable_pub)]

pub mod abort;
pub mod algo;
pub mod bench;
pub mod codec;
pub mod config;
pub mod error;
pub mod flight;
pub mod group;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod op;
pub(crate) mod p2p;
pub mod rendezvous;
pub mod tls;
pub mod topology;
pub mod transport;
pub mod untrusted;
pub mod wire;

pub use abort::Aborter;
pub use config::{NodeConfig, QuicTuning};
pub use error::{CollectiveError, ConfigError, Error, RendezvousError, TransportError, WireError};
pub use group::{
    Call, CallOpts, Group, MAX_BYTES, Node, OpId, OpKind, ProcessGroup, ReduceOp, Work,
};
pub use rendezvous::LinkStats;
pub use topology::{NodeInfo, RankTable};
pub use wire::WireDtype;
