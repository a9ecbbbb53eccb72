//! A lane: the cross-node ring of one local rank, over one or more channels (`chan.rs`), each
//! its own QUIC connection to every peer node. A pass is split between the channels as NCCL
//! splits it between its channels: channel c carries the c-th slice of every piece
//! (`algo::frames::channel_pieces`), so the channels need nothing from each other and run as
//! tasks of their own on the network runtime, on as many cores as it has.

use super::chan::Chan;
use crate::algo::frames::{RingFrames, chain_frames, channel_pieces};
use crate::error::TransportError;
use crate::transport::lane::{Lane, LaneError, LaneRun, OwnedLaneTask, RawBuf, RingJob};
use quinn::{Connection, RecvStream, SendStream};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::time::{Instant, timeout_at};

/// Where a lane stands, for error messages ("waiting for ...").
#[derive(Debug, Default)]
pub(crate) struct LaneProgress {
    recv_step: AtomicU64,
    recv_chunk: AtomicU64,
    recv_from: AtomicU64,
}

impl LaneProgress {
    pub(super) fn set(&self, step: u32, chunk: u32, from: usize) {
        self.recv_step.store(step.into(), Ordering::Relaxed);
        self.recv_chunk.store(chunk.into(), Ordering::Relaxed);
        self.recv_from.store(from as u64, Ordering::Relaxed);
    }

    /// (step, chunk, node) of the frame the lane waits for.
    pub(crate) fn waiting(&self) -> (u64, u64, usize) {
        (
            self.recv_step.load(Ordering::Relaxed),
            self.recv_chunk.load(Ordering::Relaxed),
            self.recv_from.load(Ordering::Relaxed) as usize,
        )
    }
}

/// What every channel of a lane shares: the lane's number, the peers' names for messages,
/// where the lane stands and the bytes it sent.
#[derive(Clone)]
pub(crate) struct LaneCtx {
    pub lane: usize,
    names: Arc<HashMap<usize, String>>,
    pub progress: Arc<LaneProgress>,
    pub sent: Arc<AtomicU64>,
}

impl LaneCtx {
    /// Human description of a peer node.
    pub(crate) fn describe(&self, node: usize) -> String {
        self.names
            .get(&node)
            .cloned()
            .unwrap_or_else(|| format!("node {node}"))
    }
}

/// The channels of one lane to and from every other node.
pub(crate) struct LaneLinks {
    pub lane: usize,
    chans: Vec<Chan>,
    /// Channels the lane was opened with (fewer in `chans` only after a channel's task died).
    channels: usize,
    frame_elems: usize,
    ctx: LaneCtx,
    pub progress: Arc<LaneProgress>,
    /// Bytes this lane has written to other nodes (frame headers included).
    pub sent: Arc<AtomicU64>,
}

impl LaneLinks {
    pub(crate) fn new(lane: usize, frame_bytes: usize, channels: usize) -> Self {
        let progress: Arc<LaneProgress> = Arc::default();
        let sent: Arc<AtomicU64> = Arc::default();
        let channels = channels.max(1);
        Self {
            lane,
            chans: (0..channels).map(|_| Chan::default()).collect(),
            channels,
            frame_elems: frame_bytes / 4,
            ctx: LaneCtx {
                lane,
                names: Arc::default(),
                progress: progress.clone(),
                sent: sent.clone(),
            },
            progress,
            sent,
        }
    }

    /// Names `node` for messages (at set-up).
    pub(crate) fn add_peer(&mut self, node: usize, desc: String) {
        Arc::make_mut(&mut self.ctx.names).insert(node, desc);
    }

    /// Channel `chan`'s connection and streams to and from `node` (at set-up).
    pub(crate) fn add_link(
        &mut self,
        chan: usize,
        node: usize,
        conn: Connection,
        send: SendStream,
        recv: RecvStream,
    ) {
        let c = &mut self.chans[chan];
        c.conns.insert(node, conn);
        c.send.insert(node, send);
        c.recv.insert(node, recv);
    }

    /// The raw send stream of channel 0 of this lane to `node`, bypassing framing. Only for
    /// tests that play a misbehaving peer.
    #[doc(hidden)]
    pub(crate) fn raw_send(&mut self, node: usize) -> Option<&mut SendStream> {
        self.chans.first_mut()?.send.get_mut(&node)
    }

    /// The connection of channel 0 of this lane to `node` (misbehaving-peer tests).
    #[doc(hidden)]
    pub(crate) fn raw_conn(&self, node: usize) -> Option<&Connection> {
        self.chans.first()?.conns.get(&node)
    }

    /// Every connection of this lane, with its peer node.
    pub(crate) fn conns(&self) -> impl Iterator<Item = (usize, &Connection)> {
        self.chans
            .iter()
            .flat_map(|c| c.conns.iter().map(|(n, c)| (*n, c)))
    }

    /// Executes a ring step list by `deadline`: sends to `next`, receives from `prev`, each
    /// channel its slice of every piece. What to send and expect, and when a send may go, is
    /// `algo::frames`; the channels only move bytes.
    pub(crate) async fn ring(
        &mut self,
        job: RingJob<'_>,
        deadline: Instant,
    ) -> Result<(), LaneError> {
        let k = self.channels;
        let per = self.frame_elems;
        let plan = |c: usize| {
            let pieces = channel_pieces(job.pieces, c, k);
            RingFrames::new(
                job.call,
                job.steps,
                &pieces,
                per,
                job.step_base,
                job.round_step,
            )
        };
        let (buf, dtype, next, prev) = (job.buf, job.call.dtype, job.next, job.prev);
        if k == 1 {
            let ctx = &self.ctx;
            let Some(ch) = self.chans.first_mut() else {
                return Err(self.broken());
            };
            let plan = plan(0);
            let run = ch.ring(ctx, &plan, buf, dtype, next, prev);
            return timeout_at(deadline, run)
                .await
                .unwrap_or(Err(LaneError::TimedOut));
        }
        let plans: Vec<RingFrames> = (0..k).map(plan).collect();
        self.on_channels(plans, move |mut ch, ctx, plan| async move {
            let run = ch.ring(&ctx, &plan, buf, dtype, next, prev);
            let r = timeout_at(deadline, run)
                .await
                .unwrap_or(Err(LaneError::TimedOut));
            (ch, r)
        })
        .await
    }

    /// A chain broadcast of `pieces` by `deadline` (in order, as one stream of frames per
    /// channel, `algo::frames`): receive each frame from `from` (unless this node is the
    /// root), then forward it to `to` (unless last).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn chain(
        &mut self,
        buf: RawBuf,
        pieces: &[Range<usize>],
        from: Option<usize>,
        to: Option<usize>,
        op: u8,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), LaneError> {
        // Broadcast spans the world only.
        let group = crate::op::Group::World.code();
        let k = self.channels;
        let per = self.frame_elems;
        let frames = |c| chain_frames(op, group, seq, &channel_pieces(pieces, c, k), per);
        if k == 1 {
            let ctx = &self.ctx;
            let Some(ch) = self.chans.first_mut() else {
                return Err(self.broken());
            };
            let frames = frames(0);
            let run = ch.chain(ctx, buf, &frames, from, to);
            return timeout_at(deadline, run)
                .await
                .unwrap_or(Err(LaneError::TimedOut));
        }
        let plans: Vec<_> = (0..k).map(frames).collect();
        self.on_channels(plans, move |mut ch, ctx, frames| async move {
            let run = ch.chain(&ctx, buf, &frames, from, to);
            let r = timeout_at(deadline, run)
                .await
                .unwrap_or(Err(LaneError::TimedOut));
            (ch, r)
        })
        .await
    }

    /// Runs `work` on every channel with its plan, each as a task of its own on the network
    /// runtime, and waits for all of them: a channel writes into the caller's buffer until
    /// its task ends, so this never returns before every task has (each ends by its own
    /// deadline). The first failure stops the other channels (their tasks drop their pass and
    /// end; the lane is failed from then on) and is the one reported.
    async fn on_channels<P, W, F>(&mut self, plans: Vec<P>, work: W) -> Result<(), LaneError>
    where
        P: Send + 'static,
        W: Fn(Chan, LaneCtx, P) -> F,
        F: std::future::Future<Output = (Chan, Result<(), LaneError>)> + Send + 'static,
    {
        if self.chans.len() != self.channels {
            return Err(self.broken());
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        for (i, (ch, p)) in std::mem::take(&mut self.chans)
            .into_iter()
            .zip(plans)
            .enumerate()
        {
            let run = work(ch, self.ctx.clone(), p);
            let mut stop = stop_rx.clone();
            tasks.spawn(async move {
                tokio::select! {
                    out = run => (i, Some(out)),
                    _ = stop.wait_for(|s| *s) => (i, None),
                }
            });
        }
        let mut back: Vec<Option<Chan>> = (0..self.channels).map(|_| None).collect();
        let mut failed: Option<LaneError> = None;
        while let Some(done) = tasks.join_next().await {
            let r = match done {
                Ok((i, Some((ch, r)))) => {
                    back[i] = Some(ch);
                    r
                }
                // Stopped after another channel failed: that failure is the one reported.
                Ok((_, None)) => Ok(()),
                Err(e) => Err(LaneError::Failed(TransportError::Lost {
                    peer: "every other node".into(),
                    reason: format!("a lane channel task ended abnormally: {e}"),
                })),
            };
            if let Err(e) = r {
                if failed.is_none() {
                    stop_tx.send_replace(true);
                }
                if matches!(failed, None | Some(LaneError::TimedOut)) {
                    failed = Some(e);
                }
            }
        }
        self.chans = back.into_iter().flatten().collect();
        failed.map_or(Ok(()), Err)
    }

    /// A lane that lost a channel (its task died) cannot run another pass.
    fn broken(&self) -> LaneError {
        LaneError::Failed(TransportError::Lost {
            peer: "every other node".into(),
            reason: format!("lane {} lost a channel in an earlier call", self.lane),
        })
    }
}

impl Lane for LaneLinks {
    fn run(
        mut self: Box<Self>,
        task: OwnedLaneTask,
        (code, seq): (u8, u64),
        deadline: Instant,
    ) -> LaneRun {
        Box::pin(async move {
            let res = match task {
                OwnedLaneTask::Ring { job, pieces, steps } => {
                    let job = RingJob {
                        pieces: &pieces,
                        steps: &steps,
                        ..job
                    };
                    self.ring(job, deadline).await
                }
                OwnedLaneTask::Chain {
                    buf,
                    pieces,
                    from,
                    to,
                } => {
                    self.chain(buf, &pieces, from, to, code, seq, deadline)
                        .await
                }
            };
            (self as Box<dyn Lane>, res)
        })
    }

    fn waiting(&self) -> (u64, u64, usize) {
        self.progress.waiting()
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn describe(&self, node: usize) -> String {
        self.ctx.describe(node)
    }
}
