//! Caps the datagrams quinn packs into one segment-offload (GSO) send so the whole batch stays
//! within one UDP payload (65 507 bytes over IPv4). quinn batches up to 10 datagrams of the path MTU;
//! with jumbo frames (`--mtu 8952`) that is 89 520 bytes, which Linux refuses (EMSGSIZE) and
//! quinn-udp drops silently, so every batch is lost and the connection dies of its idle
//! timeout (quinn-rs/quinn#2199, #2201). With the cap, 8952-byte datagrams go 7 to a batch.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// The most payload bytes one UDP send may carry over IPv4 (65 535 less the IP and UDP
/// headers; IPv6 allows 65 527).
const MAX_BATCH_BYTES: usize = 65_507;

/// How many datagrams of `max_payload` bytes fit one batch (at least 1).
pub fn segments_for(max_payload: usize) -> usize {
    (MAX_BATCH_BYTES / max_payload.max(1)).max(1)
}

/// A socket that reports at most `segments_for(max_payload)` datagrams per transmit.
#[derive(Debug)]
pub struct SegmentCap {
    inner: Arc<dyn AsyncUdpSocket>,
    max_segments: usize,
}

impl SegmentCap {
    /// Wraps `inner` for datagrams of up to `max_payload` bytes.
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, max_payload: usize) -> Self {
        Self {
            inner,
            max_segments: segments_for(max_payload),
        }
    }
}

impl AsyncUdpSocket for SegmentCap {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_stay_within_one_udp_payload() {
        assert_eq!(segments_for(1452), 45);
        assert_eq!(segments_for(16_000), 4);
        assert_eq!(segments_for(8952), 7);
        assert!(segments_for(8952) * 8952 <= MAX_BATCH_BYTES);
        assert_eq!(segments_for(65_000), 1);
        assert_eq!(segments_for(0), 65_507);
    }
}
