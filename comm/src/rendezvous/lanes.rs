//! The lane links: per lane, channel and pair of nodes, a QUIC connection of its own (so each
//! gets its own connection task, on any core) with one unidirectional stream each way, opened
//! at start-up once the mesh stands. The higher node dials, pinned to the certificate the rank
//! table names, once the lower node has said on the control stream that its mesh stands (until
//! then its endpoint may still be accepting mesh peers, and would take a lane link for one),
//! and opens its stream with a header (link, own node); the lower node checks the header and
//! the certificate before it answers with its own stream. Opaque outside the crate ([`Lanes`]).

use super::{Control, Peer, recv_control, send_control_by};
use crate::config::NodeConfig;
use crate::error::RendezvousError;
use crate::tls::{JobIdentity, Mismatch, SERVER_NAME, peer_sha256, same_fingerprint};
use crate::topology::RankTable;
use crate::transport::quic::{LaneLinks, close_code, describe_conn_error, transport_config};
use crate::wire::{STREAM_HEADER_LEN, StreamHeader};
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout_at};

/// How long one incoming lane connection may take from its first packet to its header.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(10);

/// A node's lanes, opaque outside this crate: the collectives run over them, and tests that
/// play a misbehaving peer can write raw bytes on one ([`Lanes::raw_send`]).
pub struct Lanes(pub(crate) Vec<LaneLinks>);

impl Lanes {
    /// The raw send stream of lane `lane` (channel 0) to `node`, bypassing framing
    /// (misbehaving-peer tests only).
    #[doc(hidden)]
    pub fn raw_send(&mut self, lane: usize, node: usize) -> Option<&mut SendStream> {
        self.0.get_mut(lane)?.raw_send(node)
    }

    /// The connection of lane `lane` (channel 0) to `node` (misbehaving-peer tests only).
    #[doc(hidden)]
    pub fn raw_conn(&self, lane: usize, node: usize) -> Option<&Connection> {
        self.0.get(lane)?.raw_conn(node)
    }
}

/// Opens this node's lane links to every other node (see [`open_lanes_inner`]).
pub async fn open_lanes(
    ep: &Endpoint,
    identity: &JobIdentity,
    cfg: &NodeConfig,
    table: &RankTable,
    me: usize,
    peers: &mut [Peer],
) -> Result<Lanes, RendezvousError> {
    open_lanes_inner(ep, identity, cfg, table, me, peers)
        .await
        .map(Lanes)
}

/// One link as its set-up hands it back: peer node, link number (lane × channels + channel),
/// connection and streams.
type Link = (usize, usize, Connection, SendStream, RecvStream);

/// Opens every lane link of this node: dials those to lower nodes and accepts those from
/// higher ones, all at once, by the rendezvous deadline.
pub(crate) async fn open_lanes_inner(
    ep: &Endpoint,
    identity: &JobIdentity,
    cfg: &NodeConfig,
    table: &RankTable,
    me: usize,
    peers: &mut [Peer],
) -> Result<Vec<LaneLinks>, RendezvousError> {
    let (lanes, k) = (table.lanes(), cfg.quic.channels);
    let links = lanes * k;
    let mut out: Vec<LaneLinks> = (0..lanes)
        .map(|l| LaneLinks::new(l, cfg.quic.frame_bytes, k))
        .collect();
    for p in peers.iter() {
        for l in &mut out {
            l.add_peer(p.node, table.describe_node(p.node));
        }
    }
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    for p in peers.iter_mut().filter(|p| p.node > me) {
        send_control_by(deadline, &mut p.ctrl_send, &Control::LanesReady)
            .await
            .map_err(|reason| RendezvousError::Mesh {
                node: p.node,
                reason,
            })?;
    }
    let expect: HashSet<(usize, usize)> = peers
        .iter()
        .filter(|p| p.node > me)
        .flat_map(|p| (0..links).map(move |l| (p.node, l)))
        .collect();
    let dial_all = async {
        let mut dials = JoinSet::new();
        for p in peers.iter_mut().filter(|p| p.node < me) {
            match timeout_at(deadline, recv_control(&mut p.ctrl_recv)).await {
                Ok(Ok(Control::LanesReady)) => {}
                other => {
                    return Err(RendezvousError::Mesh {
                        node: p.node,
                        reason: format!("expected its lanes-ready message, got {other:?}"),
                    });
                }
            }
            let info = &table.nodes()[p.node];
            let mut cc = quinn::ClientConfig::new(Arc::new(identity.client_config(
                Arc::new(Mismatch::default()),
                Some(info.cert_sha256.clone()),
            )?));
            cc.transport_config(Arc::new(transport_config(&cfg.quic)));
            for link in 0..links {
                let (ep, cc, addr) = (ep.clone(), cc.clone(), info.addr);
                dials.spawn(dial_link(ep, cc, addr, me, p.node, link, deadline));
            }
        }
        join_dials(dials, deadline).await
    };
    let (dialled, accepted) = tokio::join!(
        dial_all,
        accept_links(ep, table, me, links, expect, deadline)
    );
    for (node, link, conn, send, recv) in dialled?.into_iter().chain(accepted?) {
        out[link / k].add_link(link % k, node, conn, send, recv);
    }
    Ok(out)
}

/// Waits for every dialled link.
async fn join_dials(
    mut dials: JoinSet<Result<Link, RendezvousError>>,
    deadline: Instant,
) -> Result<Vec<Link>, RendezvousError> {
    let mut got = Vec::new();
    // Each dial ends by the deadline; the timeout here is only a backstop.
    while let Some(r) = timeout_at(deadline + Duration::from_secs(1), dials.join_next())
        .await
        .ok()
        .flatten()
    {
        got.push(r.map_err(|e| RendezvousError::Mesh {
            node: 0,
            reason: format!("a lane set-up task failed: {e}"),
        })??);
    }
    Ok(got)
}

/// Dials `node`'s link `link`: connects, opens this node's stream with its header and waits
/// for the peer's.
async fn dial_link(
    ep: Endpoint,
    cc: quinn::ClientConfig,
    addr: SocketAddr,
    me: usize,
    node: usize,
    link: usize,
    deadline: Instant,
) -> Result<Link, RendezvousError> {
    let fail = |reason: String| RendezvousError::Mesh {
        node,
        reason: format!("lane link {link}: {reason}"),
    };
    let work = async {
        let connecting = ep
            .connect_with(cc, addr, SERVER_NAME)
            .map_err(|e| e.to_string())?;
        let conn = connecting.await.map_err(|e| describe_conn_error(&e))?;
        let send = open_with_header(&conn, link, me).await?;
        let (from, got, recv) = read_header(&conn).await?;
        if from != node || got != link {
            let why = format!("answered with the header of link {got} from node {from}");
            conn.close(VarInt::from_u32(close_code::PROTOCOL), why.as_bytes());
            return Err(why);
        }
        Ok((node, link, conn, send, recv))
    };
    match timeout_at(deadline, work).await {
        Ok(r) => r.map_err(fail),
        Err(_) => Err(fail("not opened by the rendezvous deadline".into())),
    }
}

/// Opens a unidirectional stream on `conn` and writes its header (link, this node).
async fn open_with_header(conn: &Connection, link: usize, me: usize) -> Result<SendStream, String> {
    let mut s = conn.open_uni().await.map_err(|e| describe_conn_error(&e))?;
    let h = StreamHeader {
        lane: link as u32,
        from_node: me as u32,
    };
    s.write_all(&h.encode()).await.map_err(|e| e.to_string())?;
    Ok(s)
}

/// Accepts the peer's stream on `conn` and reads its header: (node, link, stream).
async fn read_header(conn: &Connection) -> Result<(usize, usize, RecvStream), String> {
    let mut r = conn
        .accept_uni()
        .await
        .map_err(|e| describe_conn_error(&e))?;
    let mut hb = [0u8; STREAM_HEADER_LEN];
    r.read_exact(&mut hb).await.map_err(|e| e.to_string())?;
    let h = StreamHeader::decode(&hb).map_err(|e| e.to_string())?;
    Ok((h.from_node as usize, h.lane as usize, r))
}

/// Accepts every link in `expect` ((node, link) of higher nodes). Each incoming connection gets
/// its own task and handshake bound, so lone QUIC Initials cannot hold up the links behind
/// them; a header for a link not expected (or already open), from a node other than the one
/// whose certificate the connection shows, is refused as a protocol violation.
async fn accept_links(
    ep: &Endpoint,
    table: &RankTable,
    me: usize,
    links: usize,
    mut expect: HashSet<(usize, usize)>,
    deadline: Instant,
) -> Result<Vec<Link>, RendezvousError> {
    let mut got = Vec::new();
    let mut shakes = JoinSet::new();
    while !expect.is_empty() {
        tokio::select! {
            accepted = timeout_at(deadline, ep.accept()) => {
                let waiting = || {
                    let mut n: Vec<usize> = expect.iter().map(|e| e.0).collect();
                    n.sort_unstable();
                    n.dedup();
                    n
                };
                let incoming = match accepted {
                    Ok(Some(i)) => i,
                    Ok(None) => {
                        return Err(RendezvousError::Mesh {
                            node: waiting()[0],
                            reason: "the local endpoint closed while waiting for lane links".into(),
                        });
                    }
                    Err(_) => {
                        let w = waiting();
                        return Err(RendezvousError::Mesh {
                            node: w[0],
                            reason: format!(
                                "{} lane link(s) never connected (from nodes {w:?})",
                                expect.len()
                            ),
                        });
                    }
                };
                let bound = deadline.min(Instant::now() + HANDSHAKE_BOUND);
                shakes.spawn(timeout_at(bound, incoming_link(incoming)));
            }
            Some(done) = shakes.join_next(), if !shakes.is_empty() => {
                let Ok(Ok(Ok((conn, from, link, recv)))) = done else {
                    tracing::warn!("refused a lane connection: no valid header within the bound");
                    continue;
                };
                let pinned = table.nodes().get(from).is_some_and(|n| {
                    same_fingerprint(&peer_sha256(&conn).unwrap_or_default(), &n.cert_sha256)
                });
                if link >= links || !pinned || !expect.remove(&(from, link)) {
                    let why = format!("unexpected lane link {link} from node {from}");
                    tracing::warn!(remote = %conn.remote_address(), "refused a lane connection: {why}");
                    conn.close(VarInt::from_u32(close_code::PROTOCOL), why.as_bytes());
                    continue;
                }
                let send = match timeout_at(deadline, open_with_header(&conn, link, me)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(reason)) => return Err(RendezvousError::Mesh { node: from, reason }),
                    Err(_) => {
                        return Err(RendezvousError::Mesh {
                            node: from,
                            reason: format!("lane link {link}: no stream by the rendezvous deadline"),
                        });
                    }
                };
                got.push((from, link, conn, send, recv));
            }
        }
    }
    shakes.abort_all();
    Ok(got)
}

/// An incoming lane connection's handshake and stream header.
async fn incoming_link(
    incoming: quinn::Incoming,
) -> Result<(Connection, usize, usize, RecvStream), String> {
    let conn = incoming.await.map_err(|e| describe_conn_error(&e))?;
    let (from, link, recv) = read_header(&conn).await?;
    Ok((conn, from, link, recv))
}
