//! The elastic control plane, as a library (torch keeps the same as
//! `torch.distributed.elastic` under a thin torchrun; `wiretrain launch` is as thin):
//!
//! * [`policy`]: the decisions taken after each epoch (the next members, restart from a
//!   checkpoint, heal in place, grow or end, the restart budget), pure and unit-tested;
//! * [`launcher`]: the node processes of one machine (`launch --local`, a per-machine
//!   `launch`), their restarts ([`restart`]) and the local supervisor of a heal in place
//!   (`supervisor`);
//! * [`agent`]: the per-machine agent of a launch across machines, and the rendezvous host
//!   one agent runs (`host`, its settle rules in `watch`), speaking the messages of
//!   `protocol` over QUIC;
//! * `parent_death`: node processes die with whoever started them.

pub mod agent;
mod host;
pub mod launcher;
mod parent_death;
pub mod policy;
mod protocol;
pub mod restart;
mod supervisor;
mod watch;
