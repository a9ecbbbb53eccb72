//! A lane's streams and the executors that run on them. Which frames a pass sends and expects,
//! with their headers and dependencies, is the pure plan of `algo::frames`; the executors only
//! move them. Executing a ring step list runs a sender and a receiver concurrently on the
//! lane: the receiver checks each header, reduces or copies the frame into the buffer as it
//! arrives and publishes its progress; the sender forwards a frame as soon as the frame it
//! depends on has landed. Frames (1 MiB by default) pipeline the ring the way NCCL's slices
//! do.

use super::{CLOSE_REASON_WAIT, close_code, describe_conn_error};
use crate::algo::RingStep;
use crate::algo::frames::{FrameCall, RingFrames, chain_frames};
use crate::codec::{self, Apply};
use crate::error::{TransportError, WireError};
use crate::wire::{FRAME_HEADER_LEN, FrameHeader, WireDtype};
use quinn::{Connection, ConnectionError, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A raw view of a rank's buffer shared by a lane's sender and receiver.
#[derive(Clone, Copy)]
pub(crate) struct RawBuf {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the sender reads only ranges the receiver has finished writing (progress counter),
// and the receiver writes ranges the sender does not read in the same step.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// `ptr..ptr+len` must stay valid for as long as the `RawBuf` is used.
    pub unsafe fn from_raw(ptr: *mut f32, len: usize) -> Self {
        Self { ptr, len }
    }

    pub fn new(buf: &mut [f32]) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// # Safety
    /// Nobody writes `r` while the slice lives.
    unsafe fn read(&self, r: Range<usize>) -> &[f32] {
        assert!(r.end <= self.len);
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }

    /// # Safety
    /// Nobody else reads or writes `r` while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn write(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.end <= self.len);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// Where a lane stands, for error messages ("waiting for ...").
#[derive(Debug, Default)]
pub(crate) struct LaneProgress {
    recv_step: AtomicU64,
    recv_chunk: AtomicU64,
    recv_from: AtomicU64,
}

impl LaneProgress {
    fn set(&self, step: u32, chunk: u32, from: usize) {
        self.recv_step.store(step.into(), Ordering::Relaxed);
        self.recv_chunk.store(chunk.into(), Ordering::Relaxed);
        self.recv_from.store(from as u64, Ordering::Relaxed);
    }

    /// (step, chunk, node) of the frame the lane waits for.
    pub fn waiting(&self) -> (u64, u64, usize) {
        (
            self.recv_step.load(Ordering::Relaxed),
            self.recv_chunk.load(Ordering::Relaxed),
            self.recv_from.load(Ordering::Relaxed) as usize,
        )
    }
}

/// A lane failure: what went wrong (the error names the node).
#[derive(Debug)]
pub(crate) struct LaneError {
    pub error: TransportError,
}

/// The streams of one lane to and from every other node.
pub(crate) struct LaneLinks {
    pub lane: usize,
    send: HashMap<usize, SendStream>,
    recv: HashMap<usize, RecvStream>,
    peers: HashMap<usize, (Connection, String)>,
    frame_elems: usize,
    /// Encoded bytes of the frame being sent / received.
    enc: Vec<u8>,
    dec: Vec<u8>,
    pub progress: Arc<LaneProgress>,
    /// Bytes this lane has written to other nodes (frame headers included).
    pub sent: Arc<std::sync::atomic::AtomicU64>,
}

/// One ring pass to execute on a lane.
pub(crate) struct RingJob<'a> {
    pub buf: RawBuf,
    pub pieces: &'a [Range<usize>],
    pub steps: &'a [RingStep],
    pub next: usize,
    pub prev: usize,
    /// The call the frames belong to and what they carry; reductions accumulate in f32
    /// whatever travels.
    pub call: FrameCall,
    pub step_base: u32,
    /// The step whose sent piece this node also replaces by its decoded form (its own
    /// finished piece at the start of an all-gather), so all nodes end bit-identical.
    pub round_step: Option<usize>,
}

impl LaneLinks {
    pub fn new(lane: usize, frame_bytes: usize) -> Self {
        Self {
            lane,
            send: HashMap::new(),
            recv: HashMap::new(),
            peers: HashMap::new(),
            frame_elems: frame_bytes / 4,
            enc: Vec::new(),
            dec: Vec::new(),
            progress: Arc::default(),
            sent: Arc::default(),
        }
    }

    pub fn add_peer(&mut self, node: usize, conn: Connection, desc: String) {
        self.peers.insert(node, (conn, desc));
    }
    pub fn add_send(&mut self, node: usize, s: SendStream) {
        self.send.insert(node, s);
    }
    pub fn add_recv(&mut self, node: usize, r: RecvStream) {
        self.recv.insert(node, r);
    }

    /// The raw send stream of this lane to `node`, bypassing framing. Only for tests that play
    /// a misbehaving peer.
    #[doc(hidden)]
    pub fn raw_send(&mut self, node: usize) -> Option<&mut SendStream> {
        self.send.get_mut(&node)
    }

    /// Human description of a peer node.
    pub fn describe(&self, node: usize) -> String {
        self.peers
            .get(&node)
            .map(|p| p.1.clone())
            .unwrap_or_else(|| format!("node {node}"))
    }

    fn lost(&self, node: usize, e: &ConnectionError) -> LaneError {
        LaneError {
            error: TransportError::Lost {
                peer: self.describe(node),
                reason: describe_conn_error(e),
            },
        }
    }

    fn protocol(&self, node: usize, e: WireError) -> LaneError {
        if let Some((c, _)) = self.peers.get(&node) {
            let reason = format!("protocol violation: {e}");
            c.close(VarInt::from_u32(close_code::PROTOCOL), reason.as_bytes());
        }
        LaneError {
            error: TransportError::Protocol {
                peer: self.describe(node),
                source: e,
            },
        }
    }

    /// A failed write. A stream the peer stopped usually means the peer node is failing and
    /// its connection close, which carries the reason, is on its way: wait a moment for it.
    async fn write_err(&self, node: usize, e: quinn::WriteError) -> LaneError {
        if !matches!(e, quinn::WriteError::ConnectionLost(_))
            && let Some((c, _)) = self.peers.get(&node)
            && let Ok(closed) = tokio::time::timeout(CLOSE_REASON_WAIT, c.closed()).await
        {
            return self.lost(node, &closed);
        }
        match e {
            quinn::WriteError::ConnectionLost(c) => self.lost(node, &c),
            other => LaneError {
                error: TransportError::Lost {
                    peer: self.describe(node),
                    reason: format!("lane stream write failed: {other}"),
                },
            },
        }
    }

    /// A failed read. A stream that ended early (finished or reset) usually means the peer
    /// node is failing and its connection close, which carries the reason, is on its way:
    /// wait a moment for it and report that reason instead.
    async fn read_err(&self, node: usize, e: quinn::ReadExactError) -> LaneError {
        if !matches!(
            e,
            quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(_))
        ) && let Some((c, _)) = self.peers.get(&node)
            && let Ok(closed) = tokio::time::timeout(CLOSE_REASON_WAIT, c.closed()).await
        {
            return self.lost(node, &closed);
        }
        match e {
            quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => {
                self.lost(node, &c)
            }
            other => LaneError {
                error: TransportError::Lost {
                    peer: self.describe(node),
                    reason: format!("lane stream read failed: {other}"),
                },
            },
        }
    }

    fn missing(&self, node: usize) -> LaneError {
        LaneError {
            error: TransportError::Lost {
                peer: self.describe(node),
                reason: format!("no lane {} stream to this node", self.lane),
            },
        }
    }

    /// Executes a ring step list: sends to `next`, receives from `prev`, concurrently. What
    /// to send and expect, and when a send may go, is `algo::frames`; this only moves bytes.
    pub async fn ring(&mut self, job: RingJob<'_>) -> Result<(), LaneError> {
        let dtype = job.call.dtype;
        let plan = RingFrames::new(
            job.call,
            job.steps,
            job.pieces,
            self.frame_elems,
            job.step_base,
            job.round_step,
        );
        let (tx, rx) = tokio::sync::watch::channel(0usize);
        if !self.send.contains_key(&job.next) {
            return Err(self.missing(job.next));
        }
        if !self.recv.contains_key(&job.prev) {
            return Err(self.missing(job.prev));
        }
        // Split borrows: the sender owns the send stream, the receiver the recv stream.
        let LaneLinks {
            send,
            recv,
            enc,
            dec,
            progress,
            sent,
            ..
        } = self;
        let send = send.get_mut(&job.next).expect("checked above");
        let recv = recv.get_mut(&job.prev).expect("checked above");
        let buf = job.buf;

        let sender = send_frames(send, &plan, buf, dtype, enc, sent, rx);
        let receiver = recv_frames(recv, &plan, buf, dtype, dec, progress, job.prev, tx);
        match tokio::try_join!(sender, receiver) {
            Ok(_) => Ok(()),
            Err(Fail::Read(e)) => Err(self.read_err(job.prev, e).await),
            Err(Fail::Wire(w)) => Err(self.protocol(job.prev, w)),
            Err(Fail::Write(e)) => Err(self.write_err(job.next, e).await),
        }
    }

    /// A chain broadcast of `pieces` (in order, as one stream of frames, `algo::frames`):
    /// receive each frame from `from` (unless this node is the root), then forward it to `to`
    /// (unless last).
    pub async fn chain(
        &mut self,
        buf: RawBuf,
        pieces: &[Range<usize>],
        from: Option<usize>,
        to: Option<usize>,
        op: u8,
        seq: u64,
    ) -> Result<(), LaneError> {
        // Broadcast spans the world only.
        let group = crate::op::Group::World.code();
        let mut hb = [0u8; FRAME_HEADER_LEN];
        for (fr, want) in chain_frames(op, group, seq, pieces, self.frame_elems) {
            if let Some(p) = from {
                self.progress.set(0, want.chunk, p);
                if !self.recv.contains_key(&p) {
                    return Err(self.missing(p));
                }
                let recv = self.recv.get_mut(&p).expect("checked");
                if let Err(e) = recv.read_exact(&mut hb).await {
                    return Err(self.read_err(p, e).await);
                }
                let got = FrameHeader::decode(&hb, crate::op::OpKind::MAX_CODE)
                    .and_then(|g| g.expect(&want).map(|()| g));
                if let Err(w) = got {
                    return Err(self.protocol(p, w));
                }
                // SAFETY: the chain touches one frame at a time, sequentially.
                let dst = unsafe { buf.write(fr.clone()) };
                let recv = self.recv.get_mut(&p).expect("checked");
                if let Err(e) = recv.read_exact(bytemuck::cast_slice_mut(dst)).await {
                    return Err(self.read_err(p, e).await);
                }
            }
            if let Some(n) = to {
                // SAFETY: as above.
                let data = unsafe { buf.read(fr) };
                let send = match self.send.get_mut(&n) {
                    Some(s) => s,
                    None => return Err(self.missing(n)),
                };
                let r = match send.write_all(&want.encode()).await {
                    Ok(()) => send.write_all(bytemuck::cast_slice(data)).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    return Err(self.write_err(n, e).await);
                }
                tokio::task::yield_now().await;
                self.sent.fetch_add(
                    (crate::wire::FRAME_HEADER_LEN + data.len() * 4) as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
        }
        Ok(())
    }
}

/// A ring pass's sending half: each frame once the frames it forwards have landed (the
/// receiver counts them on `landed`), encoded in `dtype`.
#[allow(clippy::too_many_arguments)]
async fn send_frames(
    send: &mut SendStream,
    plan: &RingFrames,
    buf: RawBuf,
    dtype: WireDtype,
    enc: &mut Vec<u8>,
    sent: &AtomicU64,
    mut landed: tokio::sync::watch::Receiver<usize>,
) -> Result<(), Fail> {
    for f in &plan.sends {
        if f.after > 0 && landed.wait_for(|&c| c >= f.after).await.is_err() {
            // The receiver is gone; try_join reports its error.
            return Ok(());
        }
        // SAFETY: this frame's range is final (received or own) and the receiver writes only
        // the current step's recv piece, which differs from it.
        let data = unsafe { buf.read(f.range.clone()) };
        let payload: &[u8] = if dtype == WireDtype::F32 {
            bytemuck::cast_slice(data)
        } else {
            codec::encode(dtype, data, enc);
            if f.round {
                // SAFETY: as above; nothing else touches this piece meanwhile.
                let own = unsafe { buf.write(f.range.clone()) };
                codec::decode(dtype, enc, own, Apply::Set);
            }
            enc
        };
        send.write_all(&f.header.encode())
            .await
            .map_err(Fail::Write)?;
        send.write_all(payload).await.map_err(Fail::Write)?;
        // A write that fits quinn's send buffer completes without yielding; let the
        // connection driver on this worker packetize between frames.
        tokio::task::yield_now().await;
        sent.fetch_add(
            (crate::wire::FRAME_HEADER_LEN + payload.len()) as u64,
            Ordering::Relaxed,
        );
    }
    Ok(())
}

/// A ring pass's receiving half: each frame's header checked against the plan, its payload
/// copied or added into its range; the count of landed frames published on `landed`.
#[allow(clippy::too_many_arguments)]
async fn recv_frames(
    recv: &mut RecvStream,
    plan: &RingFrames,
    buf: RawBuf,
    dtype: WireDtype,
    dec: &mut Vec<u8>,
    progress: &LaneProgress,
    prev: usize,
    landed: tokio::sync::watch::Sender<usize>,
) -> Result<(), Fail> {
    let mut hb = [0u8; FRAME_HEADER_LEN];
    for (done, f) in plan.recvs.iter().enumerate() {
        progress.set(f.header.step, f.header.chunk, prev);
        recv.read_exact(&mut hb).await.map_err(Fail::Read)?;
        let got = FrameHeader::decode(&hb, crate::op::OpKind::MAX_CODE).map_err(Fail::Wire)?;
        f.check(&got).map_err(Fail::Wire)?;
        // SAFETY: only the receiver touches the current recv piece.
        let dst = unsafe { buf.write(f.range.clone()) };
        match (f.apply, dtype) {
            (Apply::Set, WireDtype::F32) => recv
                .read_exact(bytemuck::cast_slice_mut(dst))
                .await
                .map_err(Fail::Read)?,
            // int8's scales lead its codes: decoded from the whole frame.
            (_, WireDtype::Int8) => {
                dec.resize(f.header.len as usize, 0);
                recv.read_exact(dec).await.map_err(Fail::Read)?;
                codec::decode(dtype, dec, dst, f.apply);
            }
            _ => recv_elems(recv, dtype, dst, f.apply, f.header.len as usize).await?,
        }
        landed.send_replace(done + 1);
    }
    Ok(())
}

/// Reads `len` bytes of element-wise `dtype` values (f32, f16, bf16) from `recv` chunk by
/// chunk as quinn reassembled them, and applies each into `dst` as it arrives: no copy into a
/// staging buffer (an element split between two chunks is carried over).
async fn recv_elems(
    recv: &mut RecvStream,
    dtype: WireDtype,
    dst: &mut [f32],
    how: Apply,
    len: usize,
) -> Result<(), Fail> {
    let es = codec::encoded_len(dtype, 1);
    let (mut left, mut at) = (len, 0usize);
    let mut carry = [0u8; 4];
    let mut nc = 0usize;
    while left > 0 {
        let chunk = match recv.read_chunk(left, true).await {
            Ok(Some(c)) => c.bytes,
            Ok(None) => return Err(Fail::Read(quinn::ReadExactError::FinishedEarly(len - left))),
            Err(e) => return Err(Fail::Read(quinn::ReadExactError::ReadError(e))),
        };
        left -= chunk.len();
        let mut b = &chunk[..];
        if nc > 0 {
            let take = (es - nc).min(b.len());
            carry[nc..nc + take].copy_from_slice(&b[..take]);
            nc += take;
            b = &b[take..];
            if nc < es {
                continue;
            }
            codec::decode(dtype, &carry[..es], &mut dst[at..at + 1], how);
            at += 1;
        }
        let whole = b.len() / es;
        codec::decode(dtype, &b[..whole * es], &mut dst[at..at + whole], how);
        at += whole;
        let rest = &b[whole * es..];
        carry[..rest.len()].copy_from_slice(rest);
        nc = rest.len();
    }
    Ok(())
}

enum Fail {
    Read(quinn::ReadExactError),
    Wire(WireError),
    Write(quinn::WriteError),
}
