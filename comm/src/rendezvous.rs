//! Rendezvous: node 0 hosts a coordinator on its QUIC endpoint; the other nodes join it,
//! everyone receives the same rank table, then the nodes connect pairwise (a full mesh, the
//! higher node rank dials) and open one stream per lane and direction.
//!
//! Joining exchanges the protocol version, node rank (or none, to be assigned in order of
//! arrival), the node's listening port and one device description per rank. The job token is
//! proved by the TLS handshake itself (see `tls`). A node that never arrives makes the
//! coordinator fail with the list of missing node ranks after the rendezvous timeout, and the
//! nodes that did join are told why.

pub mod validate;

use crate::config::NodeConfig;
use crate::error::{RendezvousError, TransportError, WireError};
use crate::tls::{JobIdentity, Mismatch, SERVER_NAME, peer_sha256};
use crate::topology::{NodeInfo, RankTable};
use crate::transport::quic::{close_code, describe_conn_error};
use crate::wire::{PROTOCOL_VERSION, control_len, decode_control, encode_control};
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::{Instant, timeout_at};

/// Control messages on the control stream of each connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Control {
    Hello {
        version: u32,
        node_rank: Option<usize>,
        nnodes: usize,
        listen_ip: Option<IpAddr>,
        listen_port: u16,
        devices: Vec<String>,
    },
    Welcome {
        node: usize,
        table: RankTable,
    },
    Refused {
        reason: String,
    },
    PeerHello {
        version: u32,
        node: usize,
    },
    Goodbye,
}

/// An established link to another node, with its control stream.
pub struct Peer {
    pub node: usize,
    pub conn: Connection,
    pub ctrl_send: SendStream,
    pub ctrl_recv: RecvStream,
}

/// What a node's QUIC connection to a peer has done so far (quinn's path and UDP counters).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LinkStats {
    /// The peer node.
    pub node: usize,
    /// Smoothed round-trip time, µs.
    pub rtt_us: u64,
    /// Congestion window, bytes.
    pub cwnd: u64,
    /// UDP payload bytes per datagram that path-MTU discovery has settled on.
    pub mtu: u16,
    pub sent_packets: u64,
    pub lost_packets: u64,
    pub congestion_events: u64,
    /// Datagrams sent and the system calls that sent them (more datagrams than calls: segment
    /// offload batched them).
    pub udp_tx_datagrams: u64,
    pub udp_tx_ios: u64,
    /// Datagrams received. quinn counts a receive "io" per datagram it processes, not per
    /// system call, so the two receive counters match even when the kernel coalesced datagrams
    /// (GRO); the kernel's own count is `InDatagrams` in `/proc/net/snmp`.
    pub udp_rx_datagrams: u64,
    pub udp_rx_ios: u64,
}

impl Peer {
    /// This connection's counters now.
    pub fn stats(&self) -> LinkStats {
        let st = self.conn.stats();
        LinkStats {
            node: self.node,
            rtt_us: st.path.rtt.as_micros() as u64,
            cwnd: st.path.cwnd,
            mtu: st.path.current_mtu,
            sent_packets: st.path.sent_packets,
            lost_packets: st.path.lost_packets,
            congestion_events: st.path.congestion_events,
            udp_tx_datagrams: st.udp_tx.datagrams,
            udp_tx_ios: st.udp_tx.ios,
            udp_rx_datagrams: st.udp_rx.datagrams,
            udp_rx_ios: st.udp_rx.ios,
        }
    }
}

pub async fn send_control(s: &mut SendStream, m: &Control) -> Result<(), String> {
    s.write_all(&encode_control(m))
        .await
        .map_err(|e| format!("control write failed: {e}"))
}

/// [`send_control`] that gives up at `deadline`: a peer that does not read, or grants no
/// stream credit, cannot hold a phase of the job forever.
pub async fn send_control_by(
    deadline: Instant,
    s: &mut SendStream,
    m: &Control,
) -> Result<(), String> {
    timeout_at(deadline, send_control(s, m))
        .await
        .unwrap_or_else(|_| {
            Err("control write stalled until the deadline (the peer does not read it or grants no stream credit)".into())
        })
}

/// Opens the control stream of `conn` by `deadline` (a peer may grant no streams at all).
async fn open_bi_by(
    deadline: Instant,
    conn: &Connection,
) -> Result<(SendStream, RecvStream), String> {
    match timeout_at(deadline, conn.open_bi()).await {
        Ok(r) => r.map_err(|e| describe_conn_error(&e)),
        Err(_) => Err("could not open a stream by the deadline (the peer grants none)".into()),
    }
}

pub async fn recv_control(r: &mut RecvStream) -> Result<Control, String> {
    let mut p = [0u8; 4];
    r.read_exact(&mut p)
        .await
        .map_err(|e| format!("control read failed: {e}"))?;
    let len = control_len(p).map_err(|e| e.to_string())?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| format!("control read failed: {e}"))?;
    decode_control(&body).map_err(|e: WireError| e.to_string())
}

/// Connects to `addr`, retrying until `deadline`; a certificate mismatch is final.
pub async fn dial(
    ep: &Endpoint,
    identity: &JobIdentity,
    cfg: &NodeConfig,
    addr: SocketAddr,
    deadline: Instant,
    pin: Option<&str>,
) -> Result<Connection, RendezvousError> {
    let mut last: String;
    loop {
        let mismatch = Arc::new(Mismatch::default());
        let mut cc = quinn::ClientConfig::new(Arc::new(
            identity.client_config(mismatch.clone(), pin.map(str::to_string))?,
        ));
        cc.transport_config(Arc::new(crate::transport::quic::transport_config(
            &cfg.quic,
        )));
        match ep.connect_with(cc, addr, SERVER_NAME) {
            Ok(connecting) => match timeout_at(deadline, connecting).await {
                Ok(Ok(c)) => return Ok(c),
                Ok(Err(e)) => {
                    if mismatch.job.load(Ordering::SeqCst) {
                        return Err(RendezvousError::WrongToken { addr });
                    }
                    if mismatch.node.load(Ordering::SeqCst) {
                        return Err(RendezvousError::UnknownCertificate {
                            addr,
                            expected: pin.unwrap_or_default().to_string(),
                        });
                    }
                    last = describe_conn_error(&e);
                }
                Err(_) => last = "handshake timed out".into(),
            },
            Err(e) => last = e.to_string(),
        }
        if Instant::now() + Duration::from_millis(200) >= deadline {
            return Err(RendezvousError::Unreachable {
                addr,
                timeout: cfg.rendezvous_timeout,
                last_error: last,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A joiner that reached the coordinator and said hello.
struct Arrival {
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    hello: Control,
}

/// [`refuse`] as a task of its own, so one slow refusal never holds up the coordinator.
async fn refuse_owned(mut a: Arrival, reason: String) {
    refuse(&mut a.send, &a.conn, &reason).await;
}

async fn refuse(send: &mut SendStream, conn: &Connection, reason: &str) {
    let by = Instant::now() + Duration::from_secs(2);
    let _ = send_control_by(
        by,
        send,
        &Control::Refused {
            reason: reason.into(),
        },
    )
    .await;
    let _ = send.finish();
    // Give the message a moment to leave before the close overtakes it.
    let _ = tokio::time::timeout(Duration::from_millis(500), send.stopped()).await;
    conn.close(VarInt::from_u32(close_code::REFUSED), reason.as_bytes());
}

/// Runs the coordinator on node 0 until every node has joined or the timeout passes.
pub async fn coordinate(
    ep: &Endpoint,
    cfg: &NodeConfig,
    own_addr: SocketAddr,
    own_sha256: &str,
) -> Result<(RankTable, Vec<Peer>), RendezvousError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let expected = cfg.nnodes - 1;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Arrival>(64);
    let mut by_rank: BTreeMap<usize, (Arrival, NodeInfo)> = BTreeMap::new();
    let mut unassigned: Vec<(Arrival, NodeInfo)> = Vec::new();
    let version = cfg.protocol_version_override.unwrap_or(PROTOCOL_VERSION);
    let mut refusals = tokio::task::JoinSet::new();
    while by_rank.len() + unassigned.len() < expected {
        tokio::select! {
            incoming = ep.accept() => {
                let Some(incoming) = incoming else { break };
                let tx = tx.clone();
                tokio::spawn(async move {
                    let remote = incoming.remote_address();
                    let conn = match tokio::time::timeout(Duration::from_secs(10), incoming).await {
                        Ok(Ok(c)) => c,
                        Ok(Err(e)) => {
                            tracing::warn!(%remote, "refused a connection at rendezvous: {} (wrong job token?)", describe_conn_error(&e));
                            return;
                        }
                        Err(_) => { tracing::warn!(%remote, "handshake timed out at rendezvous"); return; }
                    };
                    let Ok(Ok((send, mut recv))) = tokio::time::timeout(Duration::from_secs(10), conn.accept_bi()).await else {
                        tracing::warn!(%remote, "peer opened no control stream");
                        return;
                    };
                    match tokio::time::timeout(Duration::from_secs(10), recv_control(&mut recv)).await {
                        // The coordinator's loop takes arrivals at once; a full queue (a
                        // flood) drops this one rather than waiting without a bound.
                        Ok(Ok(hello)) => { let _ = tx.send_timeout(Arrival { conn, send, recv, hello }, Duration::from_secs(10)).await; }
                        Ok(Err(e)) => {
                            tracing::warn!(%remote, "bad hello: {e}");
                            conn.close(VarInt::from_u32(close_code::PROTOCOL), format!("bad hello: {e}").as_bytes());
                        }
                        Err(_) => tracing::warn!(%remote, "no hello within 10 s"),
                    }
                });
            }
            Some(a) = rx.recv() => {
                let hello = match validate::check_hello(&a.hello, version, cfg.nnodes, |r| by_rank.contains_key(&r)) {
                    Ok(h) => h,
                    Err(reason) => {
                        tracing::warn!(remote = %a.conn.remote_address(), "refused a node: {reason}");
                        refusals.spawn(refuse_owned(a, reason));
                        continue;
                    }
                };
                let validate::AcceptedHello { node_rank, listen_ip, listen_port, devices } = hello;
                let ip = listen_ip.filter(|ip| !ip.is_unspecified()).unwrap_or(a.conn.remote_address().ip());
                // The fingerprint is that of the certificate the joiner proved it holds in the
                // handshake, never a claim in its message.
                let Some(cert_sha256) = peer_sha256(&a.conn) else {
                    refusals.spawn(refuse_owned(a, "no client certificate".into()));
                    continue;
                };
                let info = NodeInfo { node: node_rank.unwrap_or(usize::MAX), addr: SocketAddr::new(ip, listen_port), devices, cert_sha256 };
                tracing::info!(node = ?node_rank, addr = %info.addr, ranks = info.devices.len(), "node joined");
                match node_rank {
                    Some(r) => { by_rank.insert(r, (a, info)); }
                    None => unassigned.push((a, info)),
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let joined = by_rank.len() + unassigned.len();
                let missing: Vec<usize> = (1..cfg.nnodes).filter(|r| !by_rank.contains_key(r)).skip(unassigned.len()).collect();
                let err = RendezvousError::Timeout { timeout: cfg.rendezvous_timeout, joined: joined + 1, expected: cfg.nnodes, missing };
                let reason = err.to_string();
                for (a, _) in by_rank.into_values().chain(unassigned) {
                    refusals.spawn(refuse_owned(a, reason.clone()));
                }
                // Each refusal is bounded (2.5 s); they run side by side.
                while refusals.join_next().await.is_some() {}
                return Err(err);
            }
        }
    }
    // Refusals still under way finish on their own (each is bounded).
    refusals.detach_all();
    // Assign free node ranks to nodes that did not ask for one, in order of arrival.
    let free: Vec<usize> = (1..cfg.nnodes)
        .filter(|r| !by_rank.contains_key(r))
        .collect();
    for (r, (a, info)) in free.into_iter().zip(unassigned) {
        by_rank.insert(r, (a, info));
    }
    let mut nodes = vec![NodeInfo {
        node: 0,
        addr: own_addr,
        devices: cfg.devices.clone(),
        cert_sha256: own_sha256.to_string(),
    }];
    for (&r, (_, info)) in &by_rank {
        nodes.push(NodeInfo {
            node: r,
            ..info.clone()
        });
    }
    let table = RankTable::new(nodes).map_err(|reason| RendezvousError::Refused { reason })?;
    let mut peers = Vec::new();
    let by = Instant::now() + cfg.rendezvous_timeout;
    for (r, (mut a, _)) in by_rank {
        send_control_by(
            by,
            &mut a.send,
            &Control::Welcome {
                node: r,
                table: table.clone(),
            },
        )
        .await
        .map_err(|reason| RendezvousError::Mesh { node: r, reason })?;
        peers.push(Peer {
            node: r,
            conn: a.conn,
            ctrl_send: a.send,
            ctrl_recv: a.recv,
        });
    }
    Ok((table, peers))
}

/// Joins the coordinator at `cfg.master`; returns the table, this node's rank and its link
/// to node 0.
pub async fn join(
    ep: &Endpoint,
    identity: &JobIdentity,
    cfg: &NodeConfig,
) -> Result<(RankTable, usize, Peer), RendezvousError> {
    let start = Instant::now();
    // Pinned when the launcher told us the coordinator's certificate; else any of the job CA,
    // checked against the table's node 0 once the table arrives.
    tracing::debug!(
        master = %cfg.master,
        pinned = cfg.master_sha256.is_some(),
        "dialing the coordinator"
    );
    let conn = dial(
        ep,
        identity,
        cfg,
        cfg.master,
        start + cfg.rendezvous_timeout,
        cfg.master_sha256.as_deref(),
    )
    .await?;
    let by = start + cfg.rendezvous_timeout;
    let (mut send, mut recv) =
        open_bi_by(by, &conn)
            .await
            .map_err(|reason| TransportError::Connect {
                peer: format!("coordinator at {}", cfg.master),
                reason,
            })?;
    let local = ep.local_addr().map_err(|e| TransportError::Connect {
        peer: "local endpoint".into(),
        reason: e.to_string(),
    })?;
    let hello = Control::Hello {
        version: cfg.protocol_version_override.unwrap_or(PROTOCOL_VERSION),
        node_rank: cfg.node_rank,
        nnodes: cfg.nnodes,
        listen_ip: Some(local.ip()),
        listen_port: local.port(),
        devices: cfg.devices.clone(),
    };
    send_control_by(by, &mut send, &hello)
        .await
        .map_err(|reason| RendezvousError::Refused {
            reason: format!("sending the hello to the coordinator: {reason}"),
        })?;
    // The coordinator answers once every node is in, or when its own timeout passes.
    let wait = start + cfg.rendezvous_timeout * 2 + Duration::from_secs(5);
    let reply = match timeout_at(wait, recv_control(&mut recv)).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            let why = conn
                .close_reason()
                .map(|c| describe_conn_error(&c))
                .unwrap_or(e);
            return Err(RendezvousError::Refused { reason: why });
        }
        Err(_) => {
            return Err(RendezvousError::Refused {
                reason: "the coordinator sent no rank table in time".into(),
            });
        }
    };
    match reply {
        Control::Welcome { node, table } => {
            let coordinator_sha256 = peer_sha256(&conn).unwrap_or_default();
            let own_sha256 = identity.node_fingerprint();
            let want = validate::Expect {
                nnodes: cfg.nnodes,
                ranks: cfg.devices.len(),
                coordinator_sha256: &coordinator_sha256,
                own_sha256: &own_sha256,
            };
            match validate::check_welcome(node, &table, &want) {
                Ok(()) => {}
                Err(validate::BadWelcome::Inconsistent(reason)) => {
                    return Err(RendezvousError::Refused { reason });
                }
                Err(validate::BadWelcome::CoordinatorCert { expected }) => {
                    return Err(RendezvousError::UnknownCertificate {
                        addr: cfg.master,
                        expected,
                    });
                }
                Err(validate::BadWelcome::OwnCert) => {
                    return Err(RendezvousError::Refused {
                        reason: "the rank table names another certificate for this node".into(),
                    });
                }
            }
            Ok((
                table,
                node,
                Peer {
                    node: 0,
                    conn,
                    ctrl_send: send,
                    ctrl_recv: recv,
                },
            ))
        }
        Control::Refused { reason } => Err(RendezvousError::Refused { reason }),
        other => Err(RendezvousError::Refused {
            reason: format!("unexpected reply {other:?}"),
        }),
    }
}

mod lanes;
mod mesh;

pub(crate) use lanes::open_lanes_inner;
pub use lanes::{Lanes, open_lanes};
pub use mesh::{goodbye, mesh};
