//! A process's membership in a job ([`Node`]): start-up (rendezvous, mesh, lanes, one
//! [`ProcessGroup`] per local rank with its executor thread), shutdown and teardown.

use super::{Executor, Gone, Job, ProcessGroup};
use crate::abort::{Aborter, FailHook};
use crate::config::NodeConfig;
use crate::error::{Error, RendezvousError, TransportError};
use crate::p2p::{self, Mailbox, P2p};
use crate::rendezvous::{self, Peer};
use crate::tls::JobIdentity;
use crate::topology::RankTable;
use crate::transport::lane::Lane;
use crate::transport::local::NodeShared;
use crate::transport::quic::{self, LaneLinks, close_code};
use crate::wire::WireDtype;
use quinn::{Endpoint, VarInt};
use std::fmt;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

/// This process's membership in a job: the links to the other nodes and one
/// [`ProcessGroup`] per local rank.
pub struct Node {
    pub(super) table: Arc<RankTable>,
    pub(super) node: usize,
    pub(super) endpoint: Endpoint,
    pub(super) peers: Vec<Peer>,
    /// The lanes' connections (peer node, connection): closed after the goodbye, so no data
    /// in flight on them is cut off.
    pub(super) links: Vec<(usize, quinn::Connection)>,
    pub(super) groups: Vec<ProcessGroup>,
    pub(super) runtime: Option<tokio::runtime::Runtime>,
    pub(super) shutdown_timeout: Duration,
    pub(super) fingerprint: String,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("node", &self.node)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Joins the job (or hosts the coordinator on node 0), connects to every other node and
    /// starts one communication thread per local rank.
    pub fn join(cfg: NodeConfig) -> Result<Node, Error> {
        crate::abort::note_panics();
        let runtime = network_runtime(&cfg)?;
        let identity = JobIdentity::for_job(&cfg.token, cfg.job_id.as_deref())?;
        let fingerprint = identity.fingerprint();
        let (endpoint, node, table, peers, lanes) =
            runtime.block_on(connect(&cfg, &identity, &fingerprint))?;
        let table = Arc::new(table);
        let k = table.ranks_on(node);
        let shared = Arc::new(NodeShared::new(k));
        let mailbox: Arc<Mailbox> = Arc::default();
        let on_fail = fail_hook(endpoint.clone(), mailbox.clone());
        let links: Vec<(usize, quinn::Connection)> = lanes
            .iter()
            .flat_map(|l| l.conns().map(|(n, c)| (n, c.clone())))
            .collect();
        let deadline = tokio::time::Instant::now() + cfg.rendezvous_timeout;
        let streams = runtime
            .block_on(p2p::open(&peers, node, deadline))
            .map_err(|(node, reason)| RendezvousError::Mesh { node, reason })?;
        let (rt, t) = (runtime.handle().clone(), table.clone());
        let p2p = Arc::new(P2p::start(rt, mailbox, t, node, &peers, streams));
        let mut lanes: Vec<Option<LaneLinks>> = lanes.into_iter().map(Some).collect();
        let mut groups = Vec::with_capacity(k);
        for local in 0..k {
            let rank = table.global_rank(node, local);
            let lane = lanes.get_mut(local).and_then(Option::take);
            let sent = lane.as_ref().map(|l| l.sent.clone());
            let ex = Executor {
                rank,
                local,
                node,
                table: table.clone(),
                scopes: Arc::new(crate::algo::Scopes::of(&table, node, local)),
                shared: shared.clone(),
                lane: lane.map(|l| Box::new(l) as Box<dyn Lane>),
                rt: runtime.handle().clone(),
                timeout: cfg.collective_timeout,
                failed: None,
                on_fail: on_fail.clone(),
                inter: None,
                wire: WireDtype::F32,
                #[cfg(test)]
                panic_at: cfg.test_panic_at,
            };
            let aborter = Aborter {
                shared: shared.clone(),
                on_fail: on_fail.clone(),
                local,
                rank,
            };
            groups.push(start_rank(
                ex,
                aborter,
                sent,
                cfg.collective_timeout,
                p2p.clone(),
            )?);
        }
        Ok(Node {
            table,
            node,
            endpoint,
            peers,
            links,
            groups,
            runtime: Some(runtime),
            shutdown_timeout: cfg.collective_timeout,
            fingerprint,
        })
    }

    /// This node's node rank (0 hosts the coordinator).
    pub fn node(&self) -> usize {
        self.node
    }
    /// The job's rank table, as agreed at rendezvous.
    pub fn table(&self) -> &RankTable {
        &self.table
    }
    /// Fingerprint of the job certificate (derived from the token; safe to print).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The counters of this node's connections to every other node (path MTU, RTT, losses,
    /// datagrams per system call; control and lane connections together), in node order.
    pub fn link_stats(&self) -> Vec<crate::rendezvous::LinkStats> {
        self.peers
            .iter()
            .map(|p| {
                let lanes = self.links.iter().filter(|l| l.0 == p.node).map(|l| &l.1);
                crate::rendezvous::LinkStats::of(p.node, std::iter::once(&p.conn).chain(lanes))
            })
            .collect()
    }

    /// The counters of each connection of this node apart: every peer's control connection,
    /// in node order, then every lane connection (lane by lane, channel by channel).
    pub fn connection_stats(&self) -> Vec<crate::rendezvous::LinkStats> {
        let control = self.peers.iter().map(rendezvous::Peer::stats);
        let lanes = self
            .links
            .iter()
            .map(|(n, c)| crate::rendezvous::LinkStats::of(*n, [c]));
        control.chain(lanes).collect()
    }

    /// The process groups of this node's ranks, in local-rank order (once).
    pub fn take_groups(&mut self) -> Vec<ProcessGroup> {
        std::mem::take(&mut self.groups)
    }

    /// Clean shutdown: exchanges goodbyes with every node (so nothing in flight is cut off),
    /// closes the connections and waits for the endpoint to drain. Drop the process groups
    /// first.
    pub fn shutdown(mut self) -> Result<(), Error> {
        self.groups.clear();
        let rt = self.runtime.take().expect("runtime present until shutdown");
        let within = self.shutdown_timeout;
        for stats in self.link_stats() {
            tracing::info!(?stats, "connection statistics (control and lanes)");
        }
        let res = rt.block_on(async {
            let r = rendezvous::goodbye(self.node, &mut self.peers, within).await;
            // Both sides of every pair have said goodbye, so each has received all the lane
            // data it expected: the lane connections can go.
            for (_, c) in &self.links {
                c.close(VarInt::from_u32(close_code::DONE), b"done");
            }
            let _ = tokio::time::timeout(Duration::from_secs(3), self.endpoint.wait_idle()).await;
            r
        });
        rt.shutdown_timeout(Duration::from_secs(1));
        res.map_err(|reason| {
            Error::Rendezvous(RendezvousError::Transport(TransportError::Lost {
                peer: "peers at shutdown".into(),
                reason,
            }))
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.groups.clear();
        if let Some(rt) = self.runtime.take() {
            // Dropped without shutdown (an error path): tell peers at once.
            self.endpoint.close(
                VarInt::from_u32(close_code::FAILED),
                b"node exited without shutdown",
            );
            // Let the close packets leave before the runtime stops (connections closed
            // earlier with a reason keep that reason).
            let ep = self.endpoint.clone();
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_millis(500), ep.wait_idle()).await;
            });
            rt.shutdown_timeout(Duration::from_millis(200));
        }
    }
}

/// The node's network runtime. Each local rank's inter-node lane (its frame copies, decoding
/// and reductions) runs as a task on it: at least one worker per rank keeps the lanes as
/// parallel as the ranks.
fn network_runtime(cfg: &NodeConfig) -> Result<tokio::runtime::Runtime, Error> {
    let threads = cfg.quic.net_threads.max(cfg.ranks());
    tracing::info!("network runtime: {threads} threads");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("wiretrain-net")
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            context: "starting the network runtime",
            source,
        })
}

/// What a failing rank does to its node: every waiting message receive fails with the
/// reason, and the endpoint closes with it (so every other node learns at once).
fn fail_hook(endpoint: Endpoint, mailbox: Arc<Mailbox>) -> FailHook {
    Arc::new(move |why: String| {
        mailbox.fail(&why);
        let mut why = why.into_bytes();
        why.truncate(900); // a CONNECTION_CLOSE reason must fit in a packet
        endpoint.close(VarInt::from_u32(close_code::FAILED), &why);
    })
}

/// Brings up this node's endpoint, then rendezvous, the full mesh and the lane streams:
/// (endpoint, this node's rank, the rank table, the peers, this node's lanes).
async fn connect(
    cfg: &NodeConfig,
    identity: &JobIdentity,
    fingerprint: &str,
) -> Result<(Endpoint, usize, RankTable, Vec<Peer>, Vec<LaneLinks>), Error> {
    let ep = quic::endpoint(cfg.bind, identity, &cfg.quic)?;
    let local = ep.local_addr().map_err(|source| Error::Io {
        context: "reading the bound address",
        source,
    })?;
    if let Some(p) = cfg
        .fingerprint_file
        .as_ref()
        .filter(|_| cfg.node_rank == Some(0))
    {
        write_atomically(p, &identity.node_fingerprint()).map_err(|source| Error::Io {
            context: "writing the fingerprint file",
            source,
        })?;
    }
    if let Some(p) = &cfg.addr_file {
        write_atomically(p, &local.to_string()).map_err(|source| Error::Io {
            context: "writing the address file",
            source,
        })?;
    }
    tracing::info!(%local, nnodes = cfg.nnodes, "node endpoint up");
    // The CA fingerprint identifies the job token's CA: debug only.
    tracing::debug!(ca_fingerprint = %fingerprint, "job CA");
    let (table, me, peers) = if cfg.node_rank == Some(0) {
        let (t, p) = rendezvous::coordinate(&ep, cfg, local, &identity.node_fingerprint()).await?;
        (t, 0, p)
    } else {
        let (t, me, p0) = rendezvous::join(&ep, identity, cfg).await?;
        (t, me, vec![p0])
    };
    let mut peers = rendezvous::mesh(&ep, identity, cfg, &table, me, peers).await?;
    let lanes = rendezvous::open_lanes_inner(&ep, identity, cfg, &table, me, &mut peers).await?;
    Ok((ep, me, table, peers, lanes))
}

/// Starts the communication thread of `ex`'s rank, which runs its collectives in order, and
/// hands back the rank's process group.
fn start_rank(
    mut ex: Executor,
    aborter: Aborter,
    sent: Option<Arc<std::sync::atomic::AtomicU64>>,
    timeout: Duration,
    p2p: Arc<P2p>,
) -> Result<ProcessGroup, Error> {
    let (rank, local, node) = (ex.rank, ex.local, ex.node);
    let (table, scopes) = (ex.table.clone(), ex.scopes.clone());
    let on_panic = aborter.clone();
    let gone: Gone = Arc::default();
    let gone_w = gone.clone();
    let (tx, rx) = mpsc::channel::<Job>();
    let worker = std::thread::Builder::new()
        .name(format!("wiretrain-comm-{rank}"))
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                // A panic here may come between barriers, with other local ranks using this
                // rank's buffer: the collective leaked it (it was held in a ManuallyDrop), and
                // the node fails at once with the message.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    job(&mut ex);
                }));
                if let Err(p) = r {
                    let why = format!(
                        "local rank {local} panicked in its communication thread: {}",
                        crate::abort::panic_message(&*p)
                    );
                    *gone_w.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
                    on_panic.abort(&why);
                    break;
                }
            }
        })
        .map_err(|source| Error::Io {
            context: "spawning a communication thread",
            source,
        })?;
    Ok(ProcessGroup {
        rank,
        local_rank: local,
        node,
        table,
        scopes,
        seqs: [0; 3],
        tx: Some(tx),
        worker: Some(worker),
        sent,
        flight: Arc::new(std::sync::Mutex::new(crate::flight::FlightRecorder::new(
            rank,
        ))),
        wire: WireDtype::F32,
        timeout,
        gone,
        aborter,
        p2p,
        messages: 0,
    })
}

pub(super) fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}
