//! The lane streams: one unidirectional stream per lane and direction to every peer, opened
//! at start-up with a stream header, opaque outside the crate ([`Lanes`]).

use super::Peer;
use crate::config::NodeConfig;
use crate::error::RendezvousError;
use crate::topology::RankTable;
use crate::transport::quic::LaneLinks;
use crate::transport::quic::close_code;
use crate::transport::quic::describe_conn_error;
use crate::wire::STREAM_HEADER_LEN;
use crate::wire::StreamHeader;
use quinn::Connection;
use quinn::RecvStream;
use quinn::SendStream;
use quinn::VarInt;
use std::collections::HashMap;
use tokio::time::Instant;
use tokio::time::timeout_at;
/// A node's lane streams, opaque outside this crate: the collectives run over them, and
/// tests that play a misbehaving peer can write raw bytes on one ([`Lanes::raw_send`]).
pub struct Lanes(pub(crate) Vec<LaneLinks>);

impl Lanes {
    /// The raw send stream of lane `lane` to `node`, bypassing framing (misbehaving-peer
    /// tests only).
    #[doc(hidden)]
    pub fn raw_send(&mut self, lane: usize, node: usize) -> Option<&mut SendStream> {
        self.0.get_mut(lane)?.raw_send(node)
    }
}

/// Opens this node's lane streams to every other node (see [`open_lanes_inner`]).
pub async fn open_lanes(
    cfg: &NodeConfig,
    table: &RankTable,
    me: usize,
    peers: &[Peer],
) -> Result<Lanes, RendezvousError> {
    open_lanes_inner(cfg, table, me, peers).await.map(Lanes)
}

/// One peer's lane streams, as its set-up task hands them back: the peer's node, the send
/// streams by lane, and the receive streams by lane.
type PeerStreams = (usize, Vec<(usize, SendStream)>, HashMap<usize, RecvStream>);

/// Why a peer's lane streams could not be set up: the peer's node and the reason.
type PeerFailure = (usize, String);

/// Opens one unidirectional stream per lane to every peer and accepts theirs.
pub(crate) async fn open_lanes_inner(
    cfg: &NodeConfig,
    table: &RankTable,
    me: usize,
    peers: &[Peer],
) -> Result<Vec<LaneLinks>, RendezvousError> {
    let lanes = table.lanes();
    let mut links: Vec<LaneLinks> = (0..lanes)
        .map(|l| LaneLinks::new(l, cfg.quic.frame_bytes))
        .collect();
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut tasks = tokio::task::JoinSet::new();
    for p in peers {
        for l in &mut links {
            l.add_peer(p.node, p.conn.clone(), table.describe_node(p.node));
        }
        tasks.spawn(peer_streams(p.conn.clone(), p.node, me, lanes));
    }
    let mut pending: Vec<usize> = peers.iter().map(|p| p.node).collect();
    while let Some(res) = match timeout_at(deadline, tasks.join_next()).await {
        Ok(r) => r,
        Err(_) => {
            return Err(RendezvousError::Mesh {
                node: pending.first().copied().unwrap_or(me),
                reason: format!(
                    "lane streams not opened in time (still waiting for nodes {pending:?})"
                ),
            });
        }
    } {
        let (node, sends, recvs) = res
            .map_err(|e| RendezvousError::Mesh {
                node: pending.first().copied().unwrap_or(me),
                reason: format!("a lane set-up task failed: {e}"),
            })?
            .map_err(|(node, reason)| RendezvousError::Mesh { node, reason })?;
        pending.retain(|&n| n != node);
        for (lane, s) in sends {
            links[lane].add_send(node, s);
        }
        for (lane, r) in recvs {
            links[lane].add_recv(node, r);
        }
    }
    Ok(links)
}

/// The set-up task of one peer, `node` on `conn`: opens this node's `lanes` streams to it,
/// then accepts its streams to this node.
async fn peer_streams(
    conn: Connection,
    node: usize,
    me: usize,
    lanes: usize,
) -> Result<PeerStreams, PeerFailure> {
    let sends = open_sends(&conn, node, me, lanes).await?;
    let recvs = accept_recvs(&conn, node, lanes).await?;
    Ok((node, sends, recvs))
}

/// Opens one stream per lane to `node`, each starting with its header (lane, from `me`).
async fn open_sends(
    conn: &Connection,
    node: usize,
    me: usize,
    lanes: usize,
) -> Result<Vec<(usize, SendStream)>, PeerFailure> {
    let mut sends = Vec::new();
    for lane in 0..lanes {
        let mut s = conn
            .open_uni()
            .await
            .map_err(|e| (node, describe_conn_error(&e)))?;
        let h = StreamHeader {
            lane: lane as u32,
            from_node: me as u32,
        };
        s.write_all(&h.encode())
            .await
            .map_err(|e| (node, e.to_string()))?;
        sends.push((lane, s));
    }
    Ok(sends)
}

/// Accepts `node`'s stream of every lane; a header from another node, for a lane out of
/// range or for a lane already open closes the connection as a protocol violation.
async fn accept_recvs(
    conn: &Connection,
    node: usize,
    lanes: usize,
) -> Result<HashMap<usize, RecvStream>, PeerFailure> {
    let mut recvs: HashMap<usize, RecvStream> = HashMap::new();
    while recvs.len() < lanes {
        let mut r = conn
            .accept_uni()
            .await
            .map_err(|e| (node, describe_conn_error(&e)))?;
        let mut hb = [0u8; STREAM_HEADER_LEN];
        r.read_exact(&mut hb)
            .await
            .map_err(|e| (node, e.to_string()))?;
        let h = StreamHeader::decode(&hb).map_err(|e| (node, e.to_string()))?;
        let lane = h.lane as usize;
        if h.from_node as usize != node || lane >= lanes || recvs.contains_key(&lane) {
            let why = format!("bad lane stream header {h:?}");
            conn.close(VarInt::from_u32(close_code::PROTOCOL), why.as_bytes());
            return Err((node, why));
        }
        recvs.insert(lane, r);
    }
    Ok(recvs)
}
