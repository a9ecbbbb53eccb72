//! Transports: shared host buffers between the rank threads of one node ([`local`]), and QUIC
//! lanes between nodes ([`quic`]). Both only execute what `algo` plans.

pub(crate) mod local;
pub mod plain_udp;
pub mod quic;
pub mod segment_cap;
