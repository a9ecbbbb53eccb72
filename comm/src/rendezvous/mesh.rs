//! The full mesh (every node connected to every other, the higher node rank dialling, each
//! incoming handshake bounded) and the goodbye that closes it without cutting off data.

use super::dial;
use super::open_bi_by;
use super::{Control, Peer, recv_control, send_control_by};
use crate::config::NodeConfig;
use crate::error::RendezvousError;
use crate::tls::JobIdentity;
use crate::tls::peer_sha256;
use crate::tls::same_fingerprint;
use crate::topology::RankTable;
use crate::transport::quic::close_code;
use crate::transport::quic::describe_conn_error;
use crate::wire::PROTOCOL_VERSION;
use quinn::Connection;
use quinn::Endpoint;
use quinn::RecvStream;
use quinn::SendStream;
use quinn::VarInt;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;
use tokio::time::timeout_at;
/// How long one incoming connection may take from its first packet to its hello.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(10);

/// An incoming mesh connection's handshake, control stream and hello, within `bound`.
async fn mesh_handshake(
    incoming: quinn::Incoming,
    bound: Instant,
) -> (
    SocketAddr,
    Result<(Connection, SendStream, RecvStream, Control), String>,
) {
    let remote = incoming.remote_address();
    let shake = async {
        let conn = incoming.await.map_err(|e| describe_conn_error(&e))?;
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| describe_conn_error(&e))?;
        let hello = recv_control(&mut recv).await?;
        Ok((conn, send, recv, hello))
    };
    let r = timeout_at(bound, shake)
        .await
        .unwrap_or_else(|_| Err("no hello within the handshake bound".into()));
    (remote, r)
}

/// Connects this node to every other node (beyond node 0, which rendezvous already linked).
pub async fn mesh(
    ep: &Endpoint,
    identity: &JobIdentity,
    cfg: &NodeConfig,
    table: &RankTable,
    me: usize,
    mut peers: Vec<Peer>,
) -> Result<Vec<Peer>, RendezvousError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    // Dial every lower node except 0.
    for m in 1..me {
        peers.push(dial_peer(ep, identity, cfg, table, me, m, deadline).await?);
    }
    // Accept every higher node (node 0 got them all at rendezvous).
    if me != 0 {
        accept_peers(ep, table, me, deadline, &mut peers).await?;
    }
    peers.sort_by_key(|p| p.node);
    Ok(peers)
}

/// Dials node `m` (pinned to the certificate the table names) and says who this node is.
async fn dial_peer(
    ep: &Endpoint,
    identity: &JobIdentity,
    cfg: &NodeConfig,
    table: &RankTable,
    me: usize,
    m: usize,
    deadline: Instant,
) -> Result<Peer, RendezvousError> {
    let addr = table.nodes()[m].addr;
    let pin = table.nodes()[m].cert_sha256.as_str();
    let conn = dial(ep, identity, cfg, addr, deadline, Some(pin))
        .await
        .map_err(|e| RendezvousError::Mesh {
            node: m,
            reason: e.to_string(),
        })?;
    let (mut send, recv) = open_bi_by(deadline, &conn)
        .await
        .map_err(|reason| RendezvousError::Mesh { node: m, reason })?;
    send_control_by(
        deadline,
        &mut send,
        &Control::PeerHello {
            version: PROTOCOL_VERSION,
            node: me,
        },
    )
    .await
    .map_err(|reason| RendezvousError::Mesh { node: m, reason })?;
    Ok(Peer {
        node: m,
        conn,
        ctrl_send: send,
        ctrl_recv: recv,
    })
}

/// Accepts every node above `me`. Each incoming connection gets its own task and handshake
/// bound, so lone QUIC Initials from anyone (no token needed to send one) cannot hold up the
/// peers behind them; a connection whose certificate is not the one the table names for the
/// node it claims to be is refused.
async fn accept_peers(
    ep: &Endpoint,
    table: &RankTable,
    me: usize,
    deadline: Instant,
    peers: &mut Vec<Peer>,
) -> Result<(), RendezvousError> {
    let mut waiting: Vec<usize> = (me + 1..table.num_nodes()).collect();
    let mut handshakes = tokio::task::JoinSet::new();
    while !waiting.is_empty() {
        tokio::select! {
            accepted = timeout_at(deadline, ep.accept()) => {
                let incoming = match accepted {
                    Ok(Some(i)) => i,
                    Ok(None) => {
                        return Err(RendezvousError::Mesh {
                            node: waiting[0],
                            reason: "the local endpoint closed while waiting for peers".into(),
                        });
                    }
                    Err(_) => {
                        return Err(RendezvousError::Mesh {
                            node: waiting[0],
                            reason: format!("never connected (still waiting for nodes {waiting:?})"),
                        });
                    }
                };
                let bound = deadline.min(Instant::now() + HANDSHAKE_BOUND);
                handshakes.spawn(mesh_handshake(incoming, bound));
            }
            Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                let Ok((remote, shake)) = done else { continue };
                let (conn, send, recv, hello) = match shake {
                    Ok(x) => x,
                    Err(why) => {
                        tracing::warn!(%remote, "refused a mesh connection: {why}");
                        continue;
                    }
                };
                match hello {
                    Control::PeerHello { version, node }
                        if version == PROTOCOL_VERSION
                            && waiting.contains(&node)
                            && !same_fingerprint(
                                &peer_sha256(&conn).unwrap_or_default(),
                                &table.nodes()[node].cert_sha256,
                            ) =>
                    {
                        tracing::warn!(%remote, "refused a mesh connection claiming to be node {node}: its certificate is not the one the rank table names");
                        conn.close(VarInt::from_u32(close_code::REFUSED), b"unknown certificate");
                    }
                    Control::PeerHello { version, node }
                        if version == PROTOCOL_VERSION && waiting.contains(&node) =>
                    {
                        waiting.retain(|&w| w != node);
                        peers.push(Peer { node, conn, ctrl_send: send, ctrl_recv: recv });
                    }
                    other => {
                        tracing::warn!(%remote, "unexpected mesh hello: {other:?}");
                        conn.close(VarInt::from_u32(close_code::PROTOCOL), b"unexpected mesh hello");
                    }
                }
            }
        }
    }
    handshakes.abort_all();
    Ok(())
}

/// Says goodbye to every peer so no data in flight is cut off, then closes the connections.
///
/// For each pair the lower node rank says goodbye first; the higher answers only after it has
/// read that goodbye; the lower closes only after it has read the answer (so both goodbyes were
/// delivered), and the higher waits for that close. Every wait is bounded by `within`.
pub async fn goodbye(me: usize, peers: &mut [Peer], within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    let mut errors = Vec::new();
    let expect_goodbye = |r: Result<Result<Control, String>, tokio::time::error::Elapsed>| match r {
        Ok(Ok(Control::Goodbye)) => Ok(()),
        Ok(Ok(other)) => Err(format!("expected goodbye, got {other:?}")),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("no goodbye within {within:?}")),
    };
    for p in peers.iter_mut().filter(|p| me < p.node) {
        if let Err(e) = send_control_by(deadline, &mut p.ctrl_send, &Control::Goodbye).await {
            errors.push(format!("node {}: {e}", p.node));
        }
    }
    for p in peers.iter_mut().filter(|p| me > p.node) {
        let r = expect_goodbye(timeout_at(deadline, recv_control(&mut p.ctrl_recv)).await);
        let r = match r {
            Ok(()) => send_control_by(deadline, &mut p.ctrl_send, &Control::Goodbye).await,
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            errors.push(format!("node {}: {e}", p.node));
        }
    }
    for p in peers.iter_mut().filter(|p| me < p.node) {
        if let Err(e) = expect_goodbye(timeout_at(deadline, recv_control(&mut p.ctrl_recv)).await) {
            errors.push(format!("node {}: {e}", p.node));
        }
        p.conn.close(VarInt::from_u32(close_code::DONE), b"done");
    }
    for p in peers.iter_mut().filter(|p| me > p.node) {
        let _ = timeout_at(deadline, p.conn.closed()).await;
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}
