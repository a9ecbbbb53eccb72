//! QUIC between nodes: one connection per node pair (quinn, mutual TLS 1.3 pinned to the job
//! certificate) for control, and per lane and channel one more, with one unidirectional stream
//! each way. A lane is the cross-node ring of one local rank, split over its channels; its
//! streams carry data frames (`wire`) that the receiver validates against the frame the
//! schedule expects next.
//!
//! This file builds the endpoint and describes connection errors; a lane and its channels are
//! `quic/lane.rs`, a channel's ring and chain executors `quic/chan.rs`.

use crate::config::{Congestion, QuicTuning};
use crate::error::TransportError;
use crate::tls::JobIdentity;
use quinn::{ConnectionError, Endpoint, VarInt};
use std::net::SocketAddr;
use std::sync::Arc;

/// Application error codes used when closing connections.
pub mod close_code {
    /// A clean close: shutdown after the goodbye.
    pub const DONE: u32 = 0;
    /// This node failed, or exited without shutdown; the close reason says why.
    pub const FAILED: u32 = 1;
    /// The peer broke the protocol (an unexpected frame, header or hello).
    pub const PROTOCOL: u32 = 2;
    /// The peer was refused admission (rendezvous refusal, unknown certificate).
    pub const REFUSED: u32 = 3;
}

/// Builds the QUIC endpoint of a node: a server (others connect to it) that can also dial.
pub fn endpoint(
    bind: SocketAddr,
    identity: &JobIdentity,
    tuning: &QuicTuning,
) -> Result<Endpoint, TransportError> {
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(identity.server_config()?));
    let accepted = match tuning.accepted_windows {
        Some((stream_window, conn_window)) => QuicTuning {
            stream_window,
            conn_window,
            ..tuning.clone()
        },
        None => tuning.clone(),
    };
    server.transport_config(Arc::new(transport_config(&accepted)));
    let socket = std::net::UdpSocket::bind(bind)
        .map_err(|source| TransportError::Bind { addr: bind, source })?;
    {
        // Larger socket buffers absorb bursts at high rates; the kernel caps them silently
        // (Linux: net.core.rmem_max/wmem_max; Windows and macOS take them as given). Segment
        // offload is quinn-udp's business per platform (GSO/GRO on Linux, USO/URO on Windows,
        // none on macOS), so no socket option here is platform-specific.
        let s = socket2::SockRef::from(&socket);
        let _ = s.set_recv_buffer_size(tuning.udp_buffer_bytes);
        let _ = s.set_send_buffer_size(tuning.udp_buffer_bytes);
    }
    let runtime = quinn::default_runtime().ok_or_else(|| TransportError::Bind {
        addr: bind,
        source: std::io::Error::other("no tokio runtime"),
    })?;
    let mut ep_cfg = quinn::EndpointConfig::default();
    // Let path-MTU discovery go as far as the tuning allows (the default caps it at 1472).
    ep_cfg
        .max_udp_payload_size(tuning.mtu_upper_bound.max(1472))
        .map_err(|e| TransportError::Tls(format!("max UDP payload: {e}")))?;
    let bind_err = |source| TransportError::Bind { addr: bind, source };
    let spare = socket.try_clone().map_err(bind_err)?;
    // quinn-udp sets ECN, packet-info and don't-fragment options up front; a stack that refuses
    // them (Wine's Winsock) gets a plain UDP socket instead of no QUIC at all.
    // WIRETRAIN_PLAIN_UDP=1 forces the plain socket (for tests and diagnosis).
    let force_plain = std::env::var("WIRETRAIN_PLAIN_UDP").is_ok_and(|v| v == "1");
    let wrapped = if force_plain {
        Err(std::io::Error::other("WIRETRAIN_PLAIN_UDP=1"))
    } else {
        runtime.wrap_udp_socket(socket)
    };
    let sock: Arc<dyn quinn::AsyncUdpSocket> = match wrapped {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(
                "UDP socket on {bind}: {e}; using a plain UDP socket (no ECN, no segment offload)"
            );
            Arc::new(super::plain_udp::PlainUdp::new(spare).map_err(bind_err)?)
        }
    };
    let payload = usize::from(tuning.mtu_upper_bound.max(1472));
    let sock: Arc<dyn quinn::AsyncUdpSocket> =
        Arc::new(super::segment_cap::SegmentCap::new(sock, payload));
    Endpoint::new_with_abstract_socket(ep_cfg, Some(server), sock, runtime).map_err(bind_err)
}

/// How long a lane whose stream the peer ended waits for the peer's connection close (and the
/// reason it carries) before it reports the stream error itself.
const CLOSE_REASON_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The transport parameters both sides use.
pub fn transport_config(t: &QuicTuning) -> quinn::TransportConfig {
    let mut c = quinn::TransportConfig::default();
    c.stream_receive_window(VarInt::from_u64(t.stream_window).unwrap_or(VarInt::MAX))
        .receive_window(VarInt::from_u64(t.conn_window).unwrap_or(VarInt::MAX))
        .send_window(t.send_window)
        .max_concurrent_uni_streams(VarInt::from_u32(1024))
        .max_concurrent_bidi_streams(VarInt::from_u32(16))
        .keep_alive_interval(Some(t.keep_alive))
        .max_idle_timeout(Some(
            t.idle_timeout
                .try_into()
                .expect("idle timeout validated by QuicTuning"),
        ));
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(t.mtu_upper_bound);
    c.mtu_discovery_config(Some(mtu));
    // quinn sizes cubic's and NewReno's initial window for 1200-byte datagrams (12 000
    // bytes). With jumbo datagrams, MTU probes in flight fill it, and quinn holds back a
    // connection close behind the window while stream data is pending: a protocol-violation
    // close sent in the connection's first round trips would never leave, and the peer would
    // learn of it only from the idle timeout. Room for four datagrams of the bound avoids
    // that. BBR starts far larger (240 000) and keeps its default.
    let iw = initial_window(t.mtu_upper_bound);
    match t.congestion {
        Congestion::Cubic => {
            let mut cc = quinn::congestion::CubicConfig::default();
            cc.initial_window(iw);
            c.congestion_controller_factory(Arc::new(cc));
        }
        Congestion::Bbr => {
            c.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
        }
        Congestion::NewReno => {
            let mut cc = quinn::congestion::NewRenoConfig::default();
            cc.initial_window(iw);
            c.congestion_controller_factory(Arc::new(cc));
        }
    }
    c
}

/// The initial congestion window of cubic and NewReno: quinn's 12 000 bytes, or four
/// datagrams of the MTU bound when that is more.
pub fn initial_window(mtu_upper_bound: u16) -> u64 {
    12_000u64.max(4 * u64::from(mtu_upper_bound))
}

/// Describes why a connection ended, in words a user can act on.
pub fn describe_conn_error(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ApplicationClosed(c) => format!(
            "peer closed the connection: {} (code {})",
            String::from_utf8_lossy(&c.reason),
            c.error_code
        ),
        ConnectionError::TimedOut => {
            "no packets within the idle timeout (peer process dead or unreachable)".into()
        }
        ConnectionError::LocallyClosed => "this node closed the connection".into(),
        ConnectionError::Reset => "peer reset the connection (it restarted?)".into(),
        other => other.to_string(),
    }
}

mod chan;
mod lane;

pub(crate) use lane::LaneLinks;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_window_holds_four_datagrams_of_the_bound() {
        assert_eq!(initial_window(1452), 12_000);
        assert_eq!(initial_window(8952), 35_808);
        // Two probes of the bound plus one full datagram fit, so a close is never held back.
        assert!(initial_window(8952) > 3 * 8952);
    }
}
