//! What a node's connections to a peer have done ([`LinkStats`], quinn's path and UDP
//! counters), one connection or several taken together.

use quinn::Connection;

/// What a node's QUIC connections to a peer have done so far (quinn's path and UDP counters).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LinkStats {
    /// The peer node.
    pub node: usize,
    /// Smoothed round-trip time, µs (the largest of the connections).
    pub rtt_us: u64,
    /// Congestion window, bytes (summed over the connections).
    pub cwnd: u64,
    /// UDP payload bytes per datagram that path-MTU discovery has settled on (the smallest of
    /// the connections).
    pub mtu: u16,
    /// QUIC packets sent (summed over the connections).
    pub sent_packets: u64,
    /// QUIC packets declared lost (summed over the connections).
    pub lost_packets: u64,
    /// Times the congestion controller cut its window (summed over the connections).
    pub congestion_events: u64,
    /// Datagrams sent (summed over the connections).
    pub udp_tx_datagrams: u64,
    /// The system calls that sent [`Self::udp_tx_datagrams`] (more datagrams than calls:
    /// segment offload batched them).
    pub udp_tx_ios: u64,
    /// Datagrams received (summed over the connections).
    pub udp_rx_datagrams: u64,
    /// Receive "ios" as quinn counts them: one per datagram it processes, not per system
    /// call, so this matches [`Self::udp_rx_datagrams`] even when the kernel coalesced
    /// datagrams (GRO); the kernel's own count is `InDatagrams` in `/proc/net/snmp`.
    pub udp_rx_ios: u64,
}

impl LinkStats {
    /// The counters of the connections `conns` to `node`, taken together: packets and
    /// datagrams summed, congestion windows summed, the largest round-trip time and the
    /// smallest datagram size.
    pub fn of<'a>(node: usize, conns: impl IntoIterator<Item = &'a Connection>) -> LinkStats {
        let mut l = LinkStats {
            node,
            rtt_us: 0,
            cwnd: 0,
            mtu: u16::MAX,
            sent_packets: 0,
            lost_packets: 0,
            congestion_events: 0,
            udp_tx_datagrams: 0,
            udp_tx_ios: 0,
            udp_rx_datagrams: 0,
            udp_rx_ios: 0,
        };
        for c in conns {
            let st = c.stats();
            l.rtt_us = l.rtt_us.max(st.path.rtt.as_micros() as u64);
            l.cwnd += st.path.cwnd;
            l.mtu = l.mtu.min(st.path.current_mtu);
            l.sent_packets += st.path.sent_packets;
            l.lost_packets += st.path.lost_packets;
            l.congestion_events += st.path.congestion_events;
            l.udp_tx_datagrams += st.udp_tx.datagrams;
            l.udp_tx_ios += st.udp_tx.ios;
            l.udp_rx_datagrams += st.udp_rx.datagrams;
            l.udp_rx_ios += st.udp_rx.ios;
        }
        if l.mtu == u16::MAX {
            l.mtu = 0;
        }
        l
    }
}
