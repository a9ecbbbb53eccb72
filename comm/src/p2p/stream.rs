//! Messages between nodes: on each mesh connection, one unidirectional stream each way,
//! opened at start-up (a hello names the stream and its node). A message is a 24-byte header
//! (source rank u32, destination rank u32, tag u64, elements u64; little-endian) and its f32
//! elements. One writer task per peer node sends the node's messages to it in the order they
//! were posted; one reader task per peer checks each header against the rank table before it
//! allocates anything and files the message in the mailbox.

use super::mailbox::Mailbox;
use crate::rendezvous::Peer;
use crate::topology::RankTable;
use crate::transport::quic::{close_code, describe_conn_error};
use quinn::{ConnectionError, ReadError, ReadExactError, RecvStream, SendStream, VarInt};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, timeout_at};

/// The first bytes of a p2p stream, before its node number.
const HELLO: [u8; 4] = *b"WTP2";
/// A message header's length in bytes.
const HEADER: usize = 24;
/// The most bytes one message may carry.
pub(crate) const MAX_MESSAGE_BYTES: usize = 1 << 30;

/// How a send ended.
pub(crate) enum Sent {
    /// The message is on the stream.
    Done,
    /// The deadline passed first.
    TimedOut,
    /// The link failed (the reason, naming the node).
    Failed(String),
}

/// A message for a writer task; `done` hears how it went.
pub(crate) struct Outgoing {
    pub(crate) src: usize,
    pub(crate) dst: usize,
    pub(crate) tag: u64,
    pub(crate) data: Vec<f32>,
    pub(crate) deadline: Instant,
    pub(crate) done: tokio::sync::oneshot::Sender<Sent>,
}

/// Opens this node's (`me`) stream to every peer by `deadline` (its hello names it); each
/// peer's stream to this node is accepted by that peer's reader ([`reader`]), so joining does
/// not wait on it.
pub(crate) async fn open(
    peers: &[Peer],
    me: usize,
    deadline: Instant,
) -> Result<Vec<(usize, SendStream)>, (usize, String)> {
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&(me as u32).to_le_bytes());
    let mut sends = Vec::with_capacity(peers.len());
    for p in peers {
        let opened = async {
            let mut s = p
                .conn
                .open_uni()
                .await
                .map_err(|e| describe_conn_error(&e))?;
            s.write_all(&hello).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(s)
        };
        let s = timeout_at(deadline, opened)
            .await
            .unwrap_or_else(|_| Err("timed out".into()))
            .map_err(|e| (p.node, format!("opening its message stream: {e}")))?;
        sends.push((p.node, s));
    }
    Ok(sends)
}

/// Accepts `cx.peer`'s message stream on the mesh connection and checks its hello; `None`
/// when the connection ends first (as a job ends, or failed: the mailbox then knows why).
async fn accept(cx: &ReaderCx) -> Option<RecvStream> {
    let mut r = match cx.conn.accept_uni().await {
        Ok(r) => r,
        Err(e) => {
            if let Some(why) = conn_lost(cx.peer, &e) {
                cx.mailbox.fail(&why);
            }
            return None;
        }
    };
    let mut h = [0u8; 8];
    let node = match r.read_exact(&mut h).await {
        Ok(()) => u32::from_le_bytes(h[4..].try_into().expect("4 bytes")) as usize,
        Err(e) => {
            if let Some(why) = lost(cx.peer, &e) {
                cx.mailbox.fail(&why);
            }
            return None;
        }
    };
    if h[..4] != HELLO || node != cx.peer {
        let why = format!(
            "node {} opened a stream that is not its message stream",
            cx.peer
        );
        protocol(cx, &why);
        return None;
    }
    Some(r)
}

/// Sends the messages of `rx` to `node` in order, each by its deadline. After a failure the
/// stream is broken: every later message fails with the same reason.
pub(crate) async fn writer(node: usize, mut send: SendStream, mut rx: UnboundedReceiver<Outgoing>) {
    let mut broken: Option<String> = None;
    while let Some(m) = rx.recv().await {
        let sent = match &broken {
            Some(why) => Sent::Failed(why.clone()),
            // Its deadline passed while it waited behind others: nothing of it was written,
            // so the stream stays whole.
            None if Instant::now() >= m.deadline => {
                let _ = m.done.send(Sent::TimedOut);
                continue;
            }
            None => match timeout_at(m.deadline, write(&mut send, &m)).await {
                Ok(Ok(())) => Sent::Done,
                Ok(Err(e)) => Sent::Failed(format!("the link to node {node} failed: {e}")),
                Err(_) => Sent::TimedOut,
            },
        };
        match &sent {
            Sent::Failed(why) => broken = Some(why.clone()),
            // Part of the message may be on the stream: nothing after it can be framed.
            Sent::TimedOut => broken = Some(format!("an earlier send to node {node} timed out")),
            Sent::Done => {}
        }
        let _ = m.done.send(sent);
    }
    let _ = send.finish();
}

async fn write(send: &mut SendStream, m: &Outgoing) -> Result<(), quinn::WriteError> {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&(m.src as u32).to_le_bytes());
    h[4..8].copy_from_slice(&(m.dst as u32).to_le_bytes());
    h[8..16].copy_from_slice(&m.tag.to_le_bytes());
    h[16..].copy_from_slice(&(m.data.len() as u64).to_le_bytes());
    send.write_all(&h).await?;
    if cfg!(target_endian = "little") {
        send.write_all(bytemuck::cast_slice(&m.data)).await
    } else {
        let bytes: Vec<u8> = m.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        send.write_all(&bytes).await
    }
}

/// What a reader needs: the node it reads from, this node, the table and the mailbox.
pub(crate) struct ReaderCx {
    pub(crate) peer: usize,
    pub(crate) me: usize,
    pub(crate) table: Arc<RankTable>,
    pub(crate) mailbox: Arc<Mailbox>,
    /// The connection to the peer, closed with a protocol error when it breaks the protocol.
    pub(crate) conn: quinn::Connection,
}

/// Accepts `cx.peer`'s message stream, then files every message from it in the mailbox until
/// the stream ends. A clean end (the goodbye's close, this node's own shutdown) ends it
/// quietly; a lost link fails the mailbox naming the node; a header that no correct node
/// sends fails it and closes the connection.
pub(crate) async fn reader(cx: ReaderCx) {
    let Some(mut recv) = accept(&cx).await else {
        return;
    };
    loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = recv.read_exact(&mut h).await {
            if let ReadExactError::FinishedEarly(n) = e
                && n > 0
            {
                let why = format!("node {} ended its message stream within a header", cx.peer);
                return protocol(&cx, &why);
            }
            if let Some(why) = lost(cx.peer, &e) {
                cx.mailbox.fail(&why);
            }
            return;
        }
        let (src, dst, tag, n) = match check(&cx, &h) {
            Ok(x) => x,
            Err(why) => return protocol(&cx, &why),
        };
        let mut data = vec![0f32; n];
        if let Err(e) = recv.read_exact(bytemuck::cast_slice_mut(&mut data)).await {
            let why = lost(cx.peer, &e).unwrap_or_else(|| {
                format!(
                    "node {} closed its message stream within a message",
                    cx.peer
                )
            });
            return cx.mailbox.fail(&why);
        }
        if cfg!(target_endian = "big") {
            data.iter_mut()
                .for_each(|x| *x = f32::from_le_bytes(x.to_ne_bytes()));
        }
        if let Err(why) = cx.mailbox.deliver((src, dst, tag), data) {
            return protocol(&cx, &why);
        }
    }
}

/// The header's (source, destination, tag, elements), if a correct node can send it.
fn check(cx: &ReaderCx, h: &[u8; HEADER]) -> Result<(usize, usize, u64, usize), String> {
    let word = |r: std::ops::Range<usize>| u64::from_le_bytes(pad(&h[r]));
    let (src, dst, tag, n) = (word(0..4), word(4..8), word(8..16), word(16..24));
    let (from, to) = (cx.table.ranks_of(cx.peer), cx.table.ranks_of(cx.me));
    if !from.contains(&(src as usize)) || !to.contains(&(dst as usize)) {
        return Err(format!(
            "node {} sent a message from rank {src} to rank {dst}: it hosts ranks {from:?} and \
             this node {to:?}",
            cx.peer
        ));
    }
    if n.saturating_mul(4) > MAX_MESSAGE_BYTES as u64 {
        return Err(format!(
            "node {} sent a message of {n} elements (at most {} bytes)",
            cx.peer, MAX_MESSAGE_BYTES
        ));
    }
    Ok((src as usize, dst as usize, tag, n as usize))
}

fn pad(b: &[u8]) -> [u8; 8] {
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    w
}

/// A peer broke the protocol: the mailbox fails and the connection closes saying why.
fn protocol(cx: &ReaderCx, why: &str) {
    cx.mailbox.fail(why);
    let mut reason = why.as_bytes().to_vec();
    reason.truncate(900);
    cx.conn
        .close(VarInt::from_u32(close_code::PROTOCOL), &reason);
}

/// Why a read from `peer` failed, or `None` when the stream ended as a job ends: the peer
/// finished it, closed the connection after its goodbye, or this node closed it itself (a
/// failure here already failed the mailbox).
fn lost(peer: usize, e: &ReadExactError) -> Option<String> {
    let conn = match e {
        ReadExactError::FinishedEarly(_) => return None,
        ReadExactError::ReadError(ReadError::ConnectionLost(c)) => c,
        ReadExactError::ReadError(other) => {
            return Some(format!(
                "the message stream from node {peer} failed: {other}"
            ));
        }
    };
    conn_lost(peer, conn)
}

/// Why the connection to `peer` ended, or `None` when it ended as a job ends (closed after
/// the goodbye, or by this node itself).
fn conn_lost(peer: usize, conn: &ConnectionError) -> Option<String> {
    match conn {
        ConnectionError::LocallyClosed => None,
        ConnectionError::ApplicationClosed(c)
            if c.error_code == VarInt::from_u32(close_code::DONE) =>
        {
            None
        }
        c => Some(format!(
            "the link to node {peer} failed: {}",
            describe_conn_error(c)
        )),
    }
}
