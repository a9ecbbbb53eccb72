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
    /// A joiner's first message to the coordinator.
    Hello {
        /// The protocol version the joiner speaks ([`PROTOCOL_VERSION`]).
        version: u32,
        /// The node rank the joiner asks for, or `None` to be assigned one.
        node_rank: Option<usize>,
        /// The node count the joiner was told.
        nnodes: usize,
        /// The IP its endpoint listens on; unspecified or `None`: the address it dialled from.
        listen_ip: Option<IpAddr>,
        /// The UDP port its endpoint listens on.
        listen_port: u16,
        /// One device description per rank it hosts.
        devices: Vec<String>,
        /// QUIC connections per lane and peer ([`crate::QuicTuning::channels`]); every node
        /// must use the coordinator's.
        #[serde(default = "one_channel")]
        channels: usize,
        /// The job epoch this node belongs to ([`NodeConfig::epoch`]).
        #[serde(default)]
        epoch: u64,
    },
    /// The coordinator's answer to an accepted hello, once every node has joined.
    Welcome {
        /// The node rank given to the joiner.
        node: usize,
        /// The job's rank table.
        table: RankTable,
    },
    /// The coordinator's answer to a hello it refuses (or to all, when the rendezvous fails).
    Refused {
        /// Why, for the joiner's error message.
        reason: String,
    },
    /// The first message on a mesh connection, from the dialling (higher) node.
    PeerHello {
        /// The protocol version the dialling node speaks ([`PROTOCOL_VERSION`]).
        version: u32,
        /// The dialling node's node rank.
        node: usize,
    },
    /// Sent to each higher node once this node's mesh stands (it accepts nothing else any
    /// more): that node may dial its lane links now.
    LanesReady,
    /// Exchanged with every peer at shutdown (the lower node rank first, the higher answers),
    /// so no data in flight is cut off when the connections close.
    Goodbye,
}

fn one_channel() -> usize {
    1
}

/// An established link to another node, with its control stream.
pub struct Peer {
    /// The other node's node rank.
    pub node: usize,
    /// The mesh connection to it.
    pub conn: Connection,
    /// The sending half of the connection's control stream.
    pub ctrl_send: SendStream,
    /// The receiving half of the connection's control stream.
    pub ctrl_recv: RecvStream,
}

impl Peer {
    /// This connection's counters now.
    pub fn stats(&self) -> LinkStats {
        LinkStats::of(self.node, [&self.conn])
    }
}

/// Writes control message `m` (length prefix and JSON) to `s`; the error says why the write
/// failed.
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

/// Reads one control message from `r`; fails when the stream fails, the length prefix is
/// above [`crate::wire::MAX_CONTROL_LEN`] or the body does not decode.
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
    let mut joined = Joined::default();
    let version = cfg.protocol_version_override.unwrap_or(PROTOCOL_VERSION);
    let mut refusals = tokio::task::JoinSet::new();
    while joined.count() < expected {
        tokio::select! {
            incoming = ep.accept() => {
                let Some(incoming) = incoming else { break };
                tokio::spawn(receive_hello(incoming, tx.clone()));
            }
            Some(a) = rx.recv() => {
                if let Err((a, reason)) = joined.admit(a, version, cfg) {
                    refusals.spawn(refuse_owned(a, reason));
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let err = joined.timeout(cfg);
                let reason = err.to_string();
                for (a, _) in joined.by_rank.into_values().chain(joined.unassigned) {
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
    let (table, by_rank) = joined.table(cfg, own_addr, own_sha256)?;
    let mut peers = Vec::new();
    let by = Instant::now() + cfg.rendezvous_timeout;
    for (r, mut a) in by_rank {
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

/// One incoming connection at rendezvous: its handshake, its control stream and its hello,
/// each within 10 s; the arrival goes to the coordinator's loop (dropped, never waited on
/// without a bound, when the queue is full: a flood).
async fn receive_hello(incoming: quinn::Incoming, tx: tokio::sync::mpsc::Sender<Arrival>) {
    let remote = incoming.remote_address();
    let conn = match tokio::time::timeout(Duration::from_secs(10), incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            tracing::warn!(
                %remote,
                "refused a connection at rendezvous: {} (wrong job token?)",
                describe_conn_error(&e)
            );
            return;
        }
        Err(_) => {
            tracing::warn!(%remote, "handshake timed out at rendezvous");
            return;
        }
    };
    let Ok(Ok((send, mut recv))) =
        tokio::time::timeout(Duration::from_secs(10), conn.accept_bi()).await
    else {
        tracing::warn!(%remote, "peer opened no control stream");
        return;
    };
    match tokio::time::timeout(Duration::from_secs(10), recv_control(&mut recv)).await {
        Ok(Ok(hello)) => {
            let a = Arrival {
                conn,
                send,
                recv,
                hello,
            };
            let _ = tx.send_timeout(a, Duration::from_secs(10)).await;
        }
        Ok(Err(e)) => {
            tracing::warn!(%remote, "bad hello: {e}");
            let reason = format!("bad hello: {e}");
            conn.close(VarInt::from_u32(close_code::PROTOCOL), reason.as_bytes());
        }
        Err(_) => tracing::warn!(%remote, "no hello within 10 s"),
    }
}

/// The nodes admitted so far: by the node rank they asked for, and those that asked for none.
#[derive(Default)]
struct Joined {
    by_rank: BTreeMap<usize, (Arrival, NodeInfo)>,
    unassigned: Vec<(Arrival, NodeInfo)>,
}

impl Joined {
    fn count(&self) -> usize {
        self.by_rank.len() + self.unassigned.len()
    }

    /// Admits an arrival whose hello checks out, or hands it back with the reason to refuse.
    #[allow(clippy::result_large_err)] // the arrival goes back to be refused
    fn admit(
        &mut self,
        a: Arrival,
        version: u32,
        cfg: &NodeConfig,
    ) -> Result<(), (Arrival, String)> {
        let (nnodes, channels, epoch) = (cfg.nnodes, cfg.quic.channels, cfg.epoch);
        let taken = |r: usize| self.by_rank.contains_key(&r);
        let mismatch = match &a.hello {
            Control::Hello { epoch: e, .. } if *e != epoch => Some(format!(
                "job epoch mismatch: this node is of epoch {e}, the job is at epoch {epoch} \
                 (a stale process of an earlier epoch, or one started ahead of the job's \
                 restart); stop it"
            )),
            Control::Hello { channels: c, .. } if *c != channels => Some(format!(
                "channel count mismatch: the coordinator runs {channels} QUIC connection(s) per \
                 lane, the joining node {c}; pass the same --channels to every node"
            )),
            _ => None,
        };
        if let Some(reason) = mismatch {
            tracing::warn!(remote = %a.conn.remote_address(), "refused a node: {reason}");
            return Err((a, reason));
        }
        let hello = match validate::check_hello(&a.hello, version, nnodes, taken) {
            Ok(h) => h,
            Err(reason) => {
                tracing::warn!(remote = %a.conn.remote_address(), "refused a node: {reason}");
                return Err((a, reason));
            }
        };
        let validate::AcceptedHello {
            node_rank,
            listen_ip,
            listen_port,
            devices,
        } = hello;
        let ip = listen_ip
            .filter(|ip| !ip.is_unspecified())
            .unwrap_or(a.conn.remote_address().ip());
        // The fingerprint is that of the certificate the joiner proved it holds in the
        // handshake, never a claim in its message.
        let Some(cert_sha256) = peer_sha256(&a.conn) else {
            return Err((a, "no client certificate".into()));
        };
        let info = NodeInfo {
            node: node_rank.unwrap_or(usize::MAX),
            addr: SocketAddr::new(ip, listen_port),
            devices,
            cert_sha256,
        };
        tracing::info!(node = ?node_rank, addr = %info.addr, ranks = info.devices.len(), "node joined");
        match node_rank {
            Some(r) => {
                self.by_rank.insert(r, (a, info));
            }
            None => self.unassigned.push((a, info)),
        }
        Ok(())
    }

    /// The rendezvous timed out: who joined and who is missing.
    fn timeout(&self, cfg: &NodeConfig) -> RendezvousError {
        let missing: Vec<usize> = (1..cfg.nnodes)
            .filter(|r| !self.by_rank.contains_key(r))
            .skip(self.unassigned.len())
            .collect();
        RendezvousError::Timeout {
            timeout: cfg.rendezvous_timeout,
            joined: self.count() + 1,
            expected: cfg.nnodes,
            missing,
        }
    }

    /// The rank table (node 0 is this node; nodes that asked for no rank get the free ones, in
    /// order of arrival), and every other node's arrival by node rank.
    #[allow(clippy::type_complexity)]
    fn table(
        mut self,
        cfg: &NodeConfig,
        own_addr: SocketAddr,
        own_sha256: &str,
    ) -> Result<(RankTable, BTreeMap<usize, Arrival>), RendezvousError> {
        let free: Vec<usize> = (1..cfg.nnodes)
            .filter(|r| !self.by_rank.contains_key(r))
            .collect();
        for (r, (a, info)) in free.into_iter().zip(self.unassigned) {
            self.by_rank.insert(r, (a, info));
        }
        let mut nodes = vec![NodeInfo {
            node: 0,
            addr: own_addr,
            devices: cfg.devices.clone(),
            cert_sha256: own_sha256.to_string(),
        }];
        let mut arrivals = BTreeMap::new();
        for (r, (a, info)) in self.by_rank {
            nodes.push(NodeInfo { node: r, ..info });
            arrivals.insert(r, a);
        }
        let table = RankTable::new(nodes).map_err(|reason| RendezvousError::Refused { reason })?;
        Ok((table, arrivals))
    }
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
    let by = start + cfg.rendezvous_timeout;
    let conn = dial(
        ep,
        identity,
        cfg,
        cfg.master,
        by,
        cfg.master_sha256.as_deref(),
    )
    .await?;
    let (mut send, mut recv) =
        open_bi_by(by, &conn)
            .await
            .map_err(|reason| TransportError::Connect {
                peer: format!("coordinator at {}", cfg.master),
                reason,
            })?;
    let hello = own_hello(ep, cfg)?;
    send_control_by(by, &mut send, &hello)
        .await
        .map_err(|reason| RendezvousError::Refused {
            reason: format!("sending the hello to the coordinator: {reason}"),
        })?;
    // The coordinator answers once every node is in, or when its own timeout passes.
    let wait = start + cfg.rendezvous_timeout * 2 + Duration::from_secs(5);
    match recv_reply_by(wait, &conn, &mut recv).await? {
        Control::Welcome { node, table } => {
            check_welcome(node, &table, &conn, identity, cfg)?;
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

/// This node's hello to the coordinator: its node rank (if it has one), the address it
/// listens on (that of `ep`) and its ranks' devices.
fn own_hello(ep: &Endpoint, cfg: &NodeConfig) -> Result<Control, RendezvousError> {
    let local = ep.local_addr().map_err(|e| TransportError::Connect {
        peer: "local endpoint".into(),
        reason: e.to_string(),
    })?;
    Ok(Control::Hello {
        version: cfg.protocol_version_override.unwrap_or(PROTOCOL_VERSION),
        node_rank: cfg.node_rank,
        nnodes: cfg.nnodes,
        listen_ip: Some(local.ip()),
        listen_port: local.port(),
        devices: cfg.devices.clone(),
        channels: cfg.quic.channels,
        epoch: cfg.epoch,
    })
}

/// The coordinator's reply on the control stream, by `wait`; when the stream fails, the
/// reason the coordinator closed the connection with, where it gave one.
async fn recv_reply_by(
    wait: Instant,
    conn: &Connection,
    recv: &mut RecvStream,
) -> Result<Control, RendezvousError> {
    match timeout_at(wait, recv_control(recv)).await {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => {
            let why = conn
                .close_reason()
                .map(|c| describe_conn_error(&c))
                .unwrap_or(e);
            Err(RendezvousError::Refused { reason: why })
        }
        Err(_) => Err(RendezvousError::Refused {
            reason: "the coordinator sent no rank table in time".into(),
        }),
    }
}

/// A joiner's checks of the coordinator's welcome: a consistent table for this job, node 0
/// holding the certificate the coordinator proved in the handshake, and this node listed with
/// its own.
fn check_welcome(
    node: usize,
    table: &RankTable,
    conn: &Connection,
    identity: &JobIdentity,
    cfg: &NodeConfig,
) -> Result<(), RendezvousError> {
    let coordinator_sha256 = peer_sha256(conn).unwrap_or_default();
    let own_sha256 = identity.node_fingerprint();
    let want = validate::Expect {
        nnodes: cfg.nnodes,
        ranks: cfg.devices.len(),
        coordinator_sha256: &coordinator_sha256,
        own_sha256: &own_sha256,
    };
    validate::check_welcome(node, table, &want).map_err(|bad| match bad {
        validate::BadWelcome::Inconsistent(reason) => RendezvousError::Refused { reason },
        validate::BadWelcome::CoordinatorCert { expected } => RendezvousError::UnknownCertificate {
            addr: cfg.master,
            expected,
        },
        validate::BadWelcome::OwnCert => RendezvousError::Refused {
            reason: "the rank table names another certificate for this node".into(),
        },
    })
}

mod lanes;
mod mesh;
mod stats;

pub(crate) use lanes::open_lanes_inner;
pub use lanes::{Lanes, open_lanes};
pub use mesh::{goodbye, mesh};
pub use stats::LinkStats;
