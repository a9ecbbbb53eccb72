//! [`ProcessGroup::send`] and [`ProcessGroup::recv`]: the handle's side of point-to-point
//! messages (`crate::p2p`): checks, numbering, and the [`Work`] that reports how each ended.
//! Any failure of a message fails the node, as a collective's does.

use super::{OpId, ProcessGroup, Work};
use crate::error::{CollectiveError, Error};
use crate::op::{Group, OpKind};
use crate::p2p::{MAX_MESSAGE_BYTES, Outgoing, Sent};
use std::sync::mpsc;

impl ProcessGroup {
    /// Sends `buf` to rank `dst` with `tag`. Messages from one rank to another arrive in the
    /// order sent, and a receive takes the oldest with its source and tag. The send is eager:
    /// it completes once the message is filed (inside the node) or on the link (between
    /// nodes), without waiting for the receive; it fails (and fails the node) when the link
    /// does, or when the message is not on its way within the collective timeout.
    pub fn send(&mut self, buf: Vec<f32>, dst: usize, tag: u64) -> Work<()> {
        let id = self.next_message(OpKind::Send);
        if let Err(why) = self.check_peer(dst, buf.len()) {
            return self.answered(id, Err(CollectiveError::InvalidCall(why).into()));
        }
        let p2p = self.p2p.clone();
        let (dnode, _) = self.table.locate(dst);
        if dnode == self.node {
            let r = p2p.mailbox.deliver((self.rank, dst, tag), buf);
            let r = r.map_err(|reason| self.message_failed(id, dst, tag, reason));
            return self.answered(id, r);
        }
        let (done, heard) = tokio::sync::oneshot::channel();
        let m = Outgoing {
            src: self.rank,
            dst,
            tag,
            data: buf,
            deadline: tokio::time::Instant::now() + self.timeout,
            done,
        };
        if p2p.out[&dnode].send(m).is_err() {
            let why = format!("node {dnode}'s writer has stopped");
            let e = self.message_failed(id, dst, tag, why);
            return self.answered(id, Err(e));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let (me, timeout, aborter) = (self.rank, self.timeout, self.aborter.clone());
        p2p.rt.spawn(async move {
            let e = match heard.await {
                Ok(Sent::Done) => return drop(tx.send(Ok(()))),
                Ok(Sent::TimedOut) => CollectiveError::P2pTimeout {
                    op: "send",
                    rank: me,
                    peer: dst,
                    tag,
                    timeout,
                    waiting_for: format!("the link to node {dnode} took no more data"),
                },
                Ok(Sent::Failed(reason)) => failed("send", me, dst, tag, reason),
                Err(_) => failed("send", me, dst, tag, "the writer stopped".into()),
            };
            aborter.abort(&crate::error::report(&e));
            let _ = tx.send(Err(e.into()));
        });
        self.work(id, rx)
    }

    /// Receives the oldest message that rank `src` sent this rank with `tag`, which must hold
    /// `len` elements. Waits at most the collective timeout; a timeout, a message of another
    /// length, or a failure of the link or of a node fails this rank's node.
    pub fn recv(&mut self, len: usize, src: usize, tag: u64) -> Work<Vec<f32>> {
        let id = self.next_message(OpKind::Recv);
        if let Err(why) = self.check_peer(src, len) {
            return self.answered(id, Err(CollectiveError::InvalidCall(why).into()));
        }
        let mut taken = self.p2p.mailbox.take((src, self.rank, tag));
        let (me, timeout, aborter) = (self.rank, self.timeout, self.aborter.clone());
        let judge = move |got: Result<Vec<f32>, String>| -> Result<Vec<f32>, CollectiveError> {
            match got {
                Ok(v) if v.len() == len => Ok(v),
                Ok(v) => Err(CollectiveError::P2pLength {
                    rank: me,
                    peer: src,
                    tag,
                    got: v.len(),
                    want: len,
                }),
                Err(reason) => Err(failed("recv", me, src, tag, reason)),
            }
        };
        let finish = move |r: Result<Vec<f32>, CollectiveError>| {
            r.map_err(|e| {
                aborter.abort(&crate::error::report(&e));
                Error::from(e)
            })
        };
        if let Ok(got) = taken.try_recv() {
            return self.answered(id, finish(judge(got)));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let deadline = tokio::time::Instant::now() + timeout;
        self.p2p.rt.spawn(async move {
            let r = match tokio::time::timeout_at(deadline, taken).await {
                Ok(Ok(got)) => judge(got),
                Ok(Err(_)) => Err(failed("recv", me, src, tag, "the mailbox is gone".into())),
                Err(_) => Err(CollectiveError::P2pTimeout {
                    op: "recv",
                    rank: me,
                    peer: src,
                    tag,
                    timeout,
                    waiting_for: format!("no message from rank {src} with this tag"),
                }),
            };
            let _ = tx.send(finish(r));
        });
        self.work(id, rx)
    }

    /// The next message call's identity (numbered apart from the collectives, whose numbers
    /// every rank must agree on).
    fn next_message(&mut self, kind: OpKind) -> OpId {
        self.messages += 1;
        OpId {
            kind,
            group: Group::World,
            seq: self.messages,
        }
    }

    /// Why `peer` cannot be sent `len` elements (or receive them), if it cannot.
    fn check_peer(&self, peer: usize, len: usize) -> Result<(), String> {
        let world = self.table.world();
        if peer >= world || peer == self.rank {
            return Err(format!(
                "rank {} cannot exchange a message with rank {peer}: the peer must be another \
                 rank of the job's {world}",
                self.rank
            ));
        }
        if len.saturating_mul(4) > MAX_MESSAGE_BYTES {
            return Err(format!(
                "a message of {len} elements is more than {MAX_MESSAGE_BYTES} bytes: send it \
                 in parts"
            ));
        }
        Ok(())
    }

    /// A message that failed: the node fails with it.
    fn message_failed(&self, id: OpId, peer: usize, tag: u64, reason: String) -> Error {
        let e = failed(id.kind.name(), self.rank, peer, tag, reason);
        self.aborter.abort(&crate::error::report(&e));
        e.into()
    }

    fn answered<T: Send + 'static>(&self, id: OpId, r: Result<T, Error>) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let _ = tx.send(r);
        self.work(id, rx)
    }

    fn work<T>(&self, id: OpId, rx: mpsc::Receiver<Result<T, Error>>) -> Work<T> {
        Work {
            id,
            rank: self.rank,
            rx,
            gone: self.gone.clone(),
        }
    }
}

fn failed(op: &'static str, rank: usize, peer: usize, tag: u64, reason: String) -> CollectiveError {
    CollectiveError::P2pFailed {
        op,
        rank,
        peer,
        tag,
        reason,
    }
}
