//! One channel of a lane: a QUIC connection to each peer node with one stream each way, and
//! the executors that move a pass's frames on it. Executing a ring step list runs a sender and
//! a receiver concurrently: the receiver checks each header, reduces or copies the frame into
//! the buffer as it arrives and publishes its progress; the sender forwards a frame as soon as
//! the frame it depends on has landed. Frames (1 MiB by default) pipeline the ring the way
//! NCCL's slices do. Which frames go where is the pure plan of `algo::frames`.

use super::lane::LaneCtx;
use super::{CLOSE_REASON_WAIT, describe_conn_error};
use crate::algo::frames::RingFrames;
use crate::codec::{self, Apply};
use crate::error::{TransportError, WireError};
use crate::transport::lane::{LaneError, RawBuf};
use crate::transport::quic::close_code;
use crate::wire::{FRAME_HEADER_LEN, FrameHeader, WireDtype};
use bytes::Bytes;
use quinn::{Connection, ConnectionError, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// A channel's connection and streams to and from every peer node.
#[derive(Default)]
pub(crate) struct Chan {
    pub(super) send: HashMap<usize, SendStream>,
    pub(super) recv: HashMap<usize, RecvStream>,
    pub(super) conns: HashMap<usize, Connection>,
    /// Received int8 frames are decoded whole from here.
    dec: Vec<u8>,
}

impl Chan {
    fn lost(&self, ctx: &LaneCtx, node: usize, e: &ConnectionError) -> LaneError {
        LaneError::Failed(TransportError::Lost {
            peer: ctx.describe(node),
            reason: describe_conn_error(e),
        })
    }

    fn protocol(&self, ctx: &LaneCtx, node: usize, e: WireError) -> LaneError {
        if let Some(c) = self.conns.get(&node) {
            let reason = format!("protocol violation: {e}");
            c.close(VarInt::from_u32(close_code::PROTOCOL), reason.as_bytes());
        }
        LaneError::Failed(TransportError::Protocol {
            peer: ctx.describe(node),
            source: e,
        })
    }

    /// A failed write. A stream the peer stopped usually means the peer node is failing and
    /// its connection close, which carries the reason, is on its way: wait a moment for it.
    async fn write_err(&self, ctx: &LaneCtx, node: usize, e: quinn::WriteError) -> LaneError {
        if !matches!(e, quinn::WriteError::ConnectionLost(_))
            && let Some(c) = self.conns.get(&node)
            && let Ok(closed) = tokio::time::timeout(CLOSE_REASON_WAIT, c.closed()).await
        {
            return self.lost(ctx, node, &closed);
        }
        match e {
            quinn::WriteError::ConnectionLost(c) => self.lost(ctx, node, &c),
            other => LaneError::Failed(TransportError::Lost {
                peer: ctx.describe(node),
                reason: format!("lane stream write failed: {other}"),
            }),
        }
    }

    /// A failed read. A stream that ended early (finished or reset) usually means the peer
    /// node is failing and its connection close, which carries the reason, is on its way:
    /// wait a moment for it and report that reason instead.
    async fn read_err(&self, ctx: &LaneCtx, node: usize, e: quinn::ReadExactError) -> LaneError {
        if !matches!(
            e,
            quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(_))
        ) && let Some(c) = self.conns.get(&node)
            && let Ok(closed) = tokio::time::timeout(CLOSE_REASON_WAIT, c.closed()).await
        {
            return self.lost(ctx, node, &closed);
        }
        match e {
            quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => {
                self.lost(ctx, node, &c)
            }
            other => LaneError::Failed(TransportError::Lost {
                peer: ctx.describe(node),
                reason: format!("lane stream read failed: {other}"),
            }),
        }
    }

    fn missing(ctx: &LaneCtx, node: usize) -> LaneError {
        LaneError::Failed(TransportError::Lost {
            peer: ctx.describe(node),
            reason: format!("no lane {} stream to this node", ctx.lane),
        })
    }

    /// Executes a ring pass's frames: sends to `next`, receives from `prev`, concurrently.
    pub(super) async fn ring(
        &mut self,
        ctx: &LaneCtx,
        plan: &RingFrames,
        buf: RawBuf,
        dtype: WireDtype,
        next: usize,
        prev: usize,
    ) -> Result<(), LaneError> {
        let (tx, rx) = tokio::sync::watch::channel(0usize);
        if !self.send.contains_key(&next) {
            return Err(Self::missing(ctx, next));
        }
        if !self.recv.contains_key(&prev) {
            return Err(Self::missing(ctx, prev));
        }
        // Split borrows: the sender owns the send stream, the receiver the recv stream.
        let Chan {
            send, recv, dec, ..
        } = self;
        let send = send.get_mut(&next).expect("checked above");
        let recv = recv.get_mut(&prev).expect("checked above");
        let sender = send_frames(send, plan, buf, dtype, &ctx.sent, rx);
        let receiver = recv_frames(recv, plan, buf, dtype, dec, ctx, prev, tx);
        match tokio::try_join!(sender, receiver) {
            Ok(_) => Ok(()),
            Err(Fail::Read(e)) => Err(self.read_err(ctx, prev, e).await),
            Err(Fail::Wire(w)) => Err(self.protocol(ctx, prev, w)),
            Err(Fail::Write(e)) => Err(self.write_err(ctx, next, e).await),
        }
    }

    /// A chain broadcast of `frames` (in order): receive each frame from `from` (unless this
    /// node is the root), then forward it to `to` (unless last).
    pub(super) async fn chain(
        &mut self,
        ctx: &LaneCtx,
        buf: RawBuf,
        frames: &[(Range<usize>, FrameHeader)],
        from: Option<usize>,
        to: Option<usize>,
    ) -> Result<(), LaneError> {
        let mut hb = [0u8; FRAME_HEADER_LEN];
        for (fr, want) in frames {
            if let Some(p) = from {
                ctx.progress.set(0, want.chunk, p);
                let Some(recv) = self.recv.get_mut(&p) else {
                    return Err(Self::missing(ctx, p));
                };
                if let Err(e) = recv.read_exact(&mut hb).await {
                    return Err(self.read_err(ctx, p, e).await);
                }
                let got = FrameHeader::decode(&hb, crate::op::OpKind::MAX_CODE)
                    .and_then(|g| g.expect(want).map(|()| g));
                if let Err(w) = got {
                    return Err(self.protocol(ctx, p, w));
                }
                // SAFETY: the chain touches one frame at a time, sequentially.
                let dst = unsafe { buf.write(fr.clone()) };
                let recv = self.recv.get_mut(&p).expect("checked");
                if let Err(e) = recv.read_exact(bytemuck::cast_slice_mut(dst)).await {
                    return Err(self.read_err(ctx, p, e).await);
                }
            }
            if let Some(n) = to {
                // SAFETY: as above.
                let data = unsafe { buf.read(fr.clone()) };
                let Some(send) = self.send.get_mut(&n) else {
                    return Err(Self::missing(ctx, n));
                };
                let r = match send.write_all(&want.encode()).await {
                    Ok(()) => send.write_all(bytemuck::cast_slice(data)).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    return Err(self.write_err(ctx, n, e).await);
                }
                tokio::task::yield_now().await;
                ctx.sent.fetch_add(
                    (FRAME_HEADER_LEN + data.len() * 4) as u64,
                    Ordering::Relaxed,
                );
            }
        }
        Ok(())
    }
}

/// A ring pass's sending half: each frame once the frames it forwards have landed (the
/// receiver counts them on `landed`), encoded in `dtype`. quinn keeps what a stream was given
/// until the peer acknowledges it, so it copies a borrowed slice (f32 frames straight from the
/// buffer); an encoded frame is built in a buffer of its own and handed over without a copy.
async fn send_frames(
    send: &mut SendStream,
    plan: &RingFrames,
    buf: RawBuf,
    dtype: WireDtype,
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
        let header = f.header.encode();
        let len = if dtype == WireDtype::F32 {
            send.write_all(&header).await.map_err(Fail::Write)?;
            let payload: &[u8] = bytemuck::cast_slice(data);
            send.write_all(payload).await.map_err(Fail::Write)?;
            payload.len()
        } else {
            let mut enc = Vec::new();
            codec::encode(dtype, data, &mut enc);
            if f.round {
                // SAFETY: as above; nothing else touches this piece meanwhile.
                let own = unsafe { buf.write(f.range.clone()) };
                codec::decode(dtype, &enc, own, Apply::Set);
            }
            let len = enc.len();
            let mut chunks = [Bytes::copy_from_slice(&header), Bytes::from(enc)];
            send.write_all_chunks(&mut chunks)
                .await
                .map_err(Fail::Write)?;
            len
        };
        // A write that fits quinn's send buffer completes without yielding; let the
        // connection driver on this worker packetize between frames.
        tokio::task::yield_now().await;
        sent.fetch_add((FRAME_HEADER_LEN + len) as u64, Ordering::Relaxed);
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
    ctx: &LaneCtx,
    prev: usize,
    landed: tokio::sync::watch::Sender<usize>,
) -> Result<(), Fail> {
    let mut hb = [0u8; FRAME_HEADER_LEN];
    for (done, f) in plan.recvs.iter().enumerate() {
        ctx.progress.set(f.header.step, f.header.chunk, prev);
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
