//! Transports: shared host buffers between the rank threads of one node (`local`), and lanes
//! between nodes (the `Lane` trait in `lane`; QUIC in [`quic`]). Both only execute what
//! `algo` plans.

pub(crate) mod lane;
pub(crate) mod local;
pub mod plain_udp;
pub mod quic;
pub mod segment_cap;
