//! A plain UDP socket for quinn, used only where the platform's UDP stack refuses the socket
//! options quinn-udp sets up front (ECN reporting, packet info, don't-fragment): Wine 8's
//! Winsock, for one, has no `IP_RECVECN`. One datagram per system call, no ECN marks, no
//! segment offload: slower, but QUIC and its TLS are unchanged.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

static MADE: AtomicUsize = AtomicUsize::new(0);

/// How many plain sockets this process has made (a diagnostic: zero unless the fallback ran).
pub fn sockets_made() -> usize {
    MADE.load(Ordering::Relaxed)
}

/// A tokio UDP socket without quinn-udp's per-platform extras.
#[derive(Debug)]
pub struct PlainUdp {
    io: tokio::net::UdpSocket,
}

impl PlainUdp {
    /// Wraps a bound socket (made non-blocking); needs a tokio runtime.
    pub fn new(socket: std::net::UdpSocket) -> io::Result<Self> {
        socket.set_nonblocking(true)?;
        MADE.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            io: tokio::net::UdpSocket::from_std(socket)?,
        })
    }
}

#[derive(Debug)]
struct Writable(Arc<PlainUdp>);

impl UdpPoller for Writable {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
        self.0.io.poll_send_ready(cx)
    }
}

/// Errors a UDP receive reports for an earlier send (Windows turns an ICMP "port
/// unreachable" into a reset on the next receive): not this socket's failure.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
    )
}

impl AsyncUdpSocket for PlainUdp {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(Writable(self))
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        // max_transmit_segments is 1, so quinn hands over single datagrams; split anyway.
        let seg = transmit
            .segment_size
            .unwrap_or(transmit.contents.len())
            .max(1);
        for d in transmit.contents.chunks(seg) {
            match self.io.try_send_to(d, transmit.destination) {
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let (Some(buf), Some(m)) = (bufs.first_mut(), meta.first_mut()) else {
            return Poll::Ready(Ok(0));
        };
        loop {
            ready!(self.io.poll_recv_ready(cx))?;
            match self.io.try_recv_from(buf) {
                Ok((len, addr)) => {
                    *m = RecvMeta {
                        addr,
                        len,
                        stride: len,
                        ecn: None,
                        dst_ip: None,
                    };
                    return Poll::Ready(Ok(1));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || transient(&e) => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }
}
