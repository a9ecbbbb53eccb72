//! Point-to-point messages between two ranks ([`crate::ProcessGroup::send`] and
//! [`crate::ProcessGroup::recv`]), what a pipeline's stages exchange: tagged, in order per
//! pair of ranks, eager (a send completes when its message is on its way, never waiting for
//! the receive), each with the collective timeout as its deadline. Inside a node a message is
//! filed in the node's mailbox at once; between nodes it travels on a stream of the mesh
//! connection (`stream`). They bypass the ranks' communication threads, so a receive that
//! waits never holds up a collective, nor a send posted after it.

mod mailbox;
mod stream;

pub(crate) use mailbox::Mailbox;
pub(crate) use stream::{MAX_MESSAGE_BYTES, Outgoing, Sent, open};

use crate::rendezvous::Peer;
use crate::topology::RankTable;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

/// A node's messaging: its mailbox, a writer queue per peer node, and the runtime its tasks
/// run on (shared by the node's process groups).
pub(crate) struct P2p {
    pub(crate) mailbox: Arc<Mailbox>,
    pub(crate) out: HashMap<usize, UnboundedSender<Outgoing>>,
    pub(crate) rt: tokio::runtime::Handle,
}

impl P2p {
    /// Starts node `me`'s writer tasks on `rt` over the streams [`open`] gave, and a reader
    /// task per peer, which accepts that peer's stream.
    pub(crate) fn start(
        rt: tokio::runtime::Handle,
        mailbox: Arc<Mailbox>,
        table: Arc<RankTable>,
        me: usize,
        peers: &[Peer],
        sends: Vec<(usize, quinn::SendStream)>,
    ) -> Self {
        let mut out = HashMap::new();
        for (node, send) in sends {
            let (tx, rx) = unbounded_channel();
            rt.spawn(stream::writer(node, send, rx));
            out.insert(node, tx);
        }
        for p in peers {
            let cx = stream::ReaderCx {
                peer: p.node,
                me,
                table: table.clone(),
                mailbox: mailbox.clone(),
                conn: p.conn.clone(),
            };
            rt.spawn(stream::reader(cx));
        }
        Self { mailbox, out, rt }
    }
}
