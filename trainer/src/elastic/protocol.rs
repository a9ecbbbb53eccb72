//! The elastic launch across machines: the messages between the `wiretrain launch` agents
//! (one per machine) and the agent that hosts the job's rendezvous, and the QUIC link they
//! travel on. The link is TLS 1.3 with certificates from the job token (its own CA, apart
//! from the node processes'), with QUIC keep-alives: a machine that dies or is cut off falls
//! silent and counts as gone after [`LINK_IDLE`].

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout, timeout_at};
use wiretrain_comm::QuicTuning;
use wiretrain_comm::tls::{JobIdentity, Mismatch, SERVER_NAME, Token};
use wiretrain_comm::transport::quic;
use wiretrain_comm::wire;

/// The version of these messages; agents of another version are refused.
pub(crate) const VERSION: u32 = 3;
/// A link silent this long is gone (its agent's machine died or was cut off).
pub(crate) const LINK_IDLE: Duration = Duration::from_secs(5);
/// The longest a message may take to leave.
const SEND_WITHIN: Duration = Duration::from_secs(5);

/// From an agent to the host.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum ToHost {
    /// The first message: who the agent is and the address its node binds.
    Join {
        version: u32,
        name: String,
        host: String,
        /// The job's settings as this agent was started with them ([`Setting`]): the host
        /// refuses an agent whose settings differ from its own, naming the first difference.
        #[serde(default)]
        settings: Vec<Setting>,
    },
    /// Node 0 of `epoch` listens at `addr` with the certificate `fingerprint`.
    Ready {
        epoch: usize,
        addr: String,
        fingerprint: Option<String>,
    },
    /// The agent's node process of `epoch` ended.
    Exited { epoch: usize, end: NodeEnd },
    /// The agent's node of `epoch` lost its job and waits, alive, to heal in the next epoch
    /// (its state holds `step` steps): a `Start` moves it there in place.
    Lost { epoch: usize, step: usize },
    /// Whether the agent's node of `epoch` can go on in place into a next epoch (its strategy
    /// keeps its state on other nodes too): then the world grows in place.
    Capable { epoch: usize, live: bool },
}

/// How a node process ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct NodeEnd {
    /// The exit status in words ("exit status: 1", "signal: 9 (SIGKILL)").
    pub status: String,
    /// The exit code (128 + the signal when killed by one).
    pub code: i32,
    pub success: bool,
}

/// From the host to an agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum ToAgent {
    /// Start this agent's node of a new epoch.
    Start(Start),
    /// Stop the node of `epoch` (SIGTERM: it finishes its step, checkpoints and exits).
    Stop { epoch: usize, reason: String },
    /// The job is over: exit with `code`.
    Done { code: i32, message: String },
    /// This agent may not join.
    Refused { reason: String },
    /// Agents joined: the node of `epoch` leaves it after its step, alive, to be moved into
    /// the next epoch in place (reporting `Lost`), where the newcomers receive its state.
    Regroup { epoch: usize },
}

/// One node of an epoch, as its agent starts it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Start {
    pub epoch: usize,
    /// Nodes in this epoch.
    pub world: usize,
    /// This agent's node number in it.
    pub node: usize,
    /// Node 0's address (`None`: this is node 0, which binds and reports its own).
    pub master: Option<String>,
    /// Node 0's certificate, which the others pin.
    pub fingerprint: Option<String>,
    /// The job's id (the same in every epoch; the epoch tells them apart).
    pub job_id: String,
    /// The restarts so far (JSON, as WIRETRAIN_RESTARTS).
    pub restarts: String,
    /// The nodes of this epoch that start fresh and receive the state from the others (a
    /// growth in place); empty when every node starts (or goes on) on its own.
    #[serde(default)]
    pub joined: Vec<usize>,
    /// The epoch goes on in place (a heal or a growth in place): a node waiting to heal is
    /// moved into it; otherwise every node starts afresh (a waiting one is stopped first).
    #[serde(default)]
    pub in_place: bool,
}

/// One setting every agent of a job must agree on: (name, value).
pub(crate) type Setting = (String, String);

/// The rendezvous link's identity: a CA of its own from the job token, so that the agents'
/// links and the node processes' never accept each other's certificates, salted with the job's
/// id when the environment names one (`WIRETRAIN_JOB_ID`, Slurm's, torchrun's), as the nodes'
/// is: an agent of another job with the same token (a leftover of an earlier launch) cannot
/// connect. The token must pass the nodes' strength rule (a weak one could be guessed offline
/// from the certificate the host shows every client).
pub(crate) fn identity(token: &Token, job: Option<&str>) -> Result<JobIdentity, String> {
    token.check_strength()?;
    let salt = match job {
        Some(j) => format!("wiretrain elastic launch rendezvous v2\0job:{j}"),
        None => "wiretrain elastic launch rendezvous v2".to_string(),
    };
    JobIdentity::for_job(token, Some(&salt)).map_err(|e| e.to_string())
}

/// The first setting in which an agent (`theirs`) differs from the host (`ours`), in words;
/// `None` when they agree. Settings are compared in order, so a missing argument is named
/// where it is missing.
pub(crate) fn first_difference(ours: &[Setting], theirs: &[Setting]) -> Option<String> {
    let shown = |s: Option<&Setting>| match s {
        Some((_, v)) => format!("`{}`", clip(v)),
        None => "nothing".to_string(),
    };
    (0..ours.len().max(theirs.len())).find_map(|i| {
        let (o, t) = (ours.get(i), theirs.get(i));
        if o == t {
            return None;
        }
        let name = o.or(t).map(|s| s.0.as_str()).unwrap_or_default();
        Some(format!(
            "{name} differs: {} on this agent, {} in the job (the agent hosting the \
             rendezvous); start every agent with the same settings and command",
            shown(t),
            shown(o)
        ))
    })
}

/// A value cut to 120 characters for a message.
fn clip(v: &str) -> String {
    match v.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &v[..i]),
        None => v.to_string(),
    }
}

fn tuning() -> QuicTuning {
    let mut t = QuicTuning::default();
    t.idle_timeout(LINK_IDLE).expect("a valid idle timeout");
    t
}

/// The host's endpoint, bound to the rendezvous address (fails when another process holds
/// it, or the address is not this machine's).
pub(crate) fn host_endpoint(bind: SocketAddr, id: &JobIdentity) -> Result<Endpoint, String> {
    quic::endpoint(bind, id, &tuning()).map_err(|e| e.to_string())
}

/// An agent's link to the host.
pub(crate) struct Link {
    pub conn: Connection,
    pub send: SendStream,
    pub recv: RecvStream,
}

/// Connects to the host at `addr`, retrying until `deadline` (it may not be up yet); a host
/// of another job token is final.
pub(crate) async fn dial(
    id: &JobIdentity,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<Link, String> {
    let bind: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0".parse().expect("an address")
    } else {
        "[::]:0".parse().expect("an address")
    };
    let ep = quic::endpoint(bind, id, &tuning()).map_err(|e| e.to_string())?;
    let mut last;
    loop {
        let mismatch = Arc::new(Mismatch::default());
        let client = id
            .client_config(mismatch.clone(), None)
            .map_err(|e| e.to_string())?;
        let mut cc = quinn::ClientConfig::new(Arc::new(client));
        cc.transport_config(Arc::new(quic::transport_config(&tuning())));
        match ep.connect_with(cc, addr, SERVER_NAME) {
            Ok(c) => match timeout_at(deadline, c).await {
                Ok(Ok(conn)) => {
                    let (send, recv) = timeout_at(deadline, conn.open_bi())
                        .await
                        .map_err(|_| "no stream by the deadline".to_string())?
                        .map_err(|e| quic::describe_conn_error(&e))?;
                    return Ok(Link { conn, send, recv });
                }
                Ok(Err(e)) if mismatch.job.load(Ordering::SeqCst) => {
                    return Err(format!(
                        "the rendezvous at {addr} is of another job: another WIRETRAIN_TOKEN, \
                         or another job id (WIRETRAIN_JOB_ID, SLURM_JOB_ID) ({})",
                        quic::describe_conn_error(&e)
                    ));
                }
                Ok(Err(e)) => last = quic::describe_conn_error(&e),
                Err(_) => last = "the handshake timed out".into(),
            },
            Err(e) => last = e.to_string(),
        }
        if Instant::now() + Duration::from_millis(250) >= deadline {
            return Err(format!("cannot reach the rendezvous at {addr}: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Sends one message, within [`SEND_WITHIN`].
pub(crate) async fn send<T: Serialize>(s: &mut SendStream, m: &T) -> Result<(), String> {
    match timeout(SEND_WITHIN, s.write_all(&wire::encode_control(m))).await {
        Ok(r) => r.map_err(|e| format!("send failed: {e}")),
        Err(_) => Err(format!("send stalled for {SEND_WITHIN:?}")),
    }
}

/// Reads one message (bounded in size; a dead peer ends it within [`LINK_IDLE`]).
pub(crate) async fn recv<T: DeserializeOwned>(r: &mut RecvStream) -> Result<T, String> {
    let mut p = [0u8; 4];
    r.read_exact(&mut p)
        .await
        .map_err(|e| format!("read failed: {e}"))?;
    let len = wire::control_len(p).map_err(|e| e.to_string())?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| format!("read failed: {e}"))?;
    wire::decode_control(&body).map_err(|e| e.to_string())
}

/// What an agent's connection reports to the host's loop.
pub(super) enum Event {
    Joined {
        id: u64,
        name: String,
        host: String,
        send: SendStream,
    },
    Msg {
        id: u64,
        msg: ToHost,
    },
    Gone {
        id: u64,
        why: String,
    },
}

/// Accepts agents: each connection's first message must be a `Join` of this version.
/// An agent whose settings differ from `ours` is refused, naming the first difference.
pub(super) async fn accept_loop(
    ep: Endpoint,
    tx: mpsc::UnboundedSender<Event>,
    ours: Arc<Vec<Setting>>,
) {
    let mut next = 0u64;
    while let Some(incoming) = ep.accept().await {
        next += 1;
        let (id, tx, ours) = (next, tx.clone(), ours.clone());
        tokio::spawn(async move {
            let Ok(Ok(conn)) = timeout(Duration::from_secs(10), incoming).await else {
                return;
            };
            let Ok(Ok((mut send, mut recv))) =
                timeout(Duration::from_secs(10), conn.accept_bi()).await
            else {
                return;
            };
            let join = timeout(Duration::from_secs(10), self::recv::<ToHost>(&mut recv)).await;
            let refused = match join {
                Ok(Ok(ToHost::Join {
                    version,
                    name,
                    host,
                    settings,
                })) if version == VERSION => match first_difference(&ours, &settings) {
                    None => Ok((name, host)),
                    Some(d) => Err(format!("agent {name}: {d}")),
                },
                Ok(Ok(ToHost::Join { version, .. })) => Err(format!(
                    "this agent speaks version {version} of the elastic rendezvous, the \
                     host {VERSION}: run the same wiretrain on every machine"
                )),
                _ => return,
            };
            let (name, host) = match refused {
                Ok(who) => who,
                Err(reason) => {
                    tracing::warn!("refused an agent: {reason}");
                    let _ = self::send(&mut send, &ToAgent::Refused { reason }).await;
                    let _ = send.finish();
                    let _ = timeout(Duration::from_secs(2), send.stopped()).await;
                    return;
                }
            };
            if tx
                .send(Event::Joined {
                    id,
                    name,
                    host,
                    send,
                })
                .is_err()
            {
                return;
            }
            loop {
                match self::recv::<ToHost>(&mut recv).await {
                    Ok(msg) => {
                        if tx.send(Event::Msg { id, msg }).is_err() {
                            return;
                        }
                    }
                    Err(why) => {
                        let why = conn.close_reason().map_or(why, |e| {
                            wiretrain_comm::transport::quic::describe_conn_error(&e)
                        });
                        let _ = tx.send(Event::Gone { id, why });
                        return;
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[(&str, &str)]) -> Vec<Setting> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_first_differing_setting_is_named_with_both_values() {
        let host = set(&[
            ("nnodes", "2:3"),
            ("argument 1", "train"),
            ("argument 2", "--lr"),
        ]);
        assert_eq!(first_difference(&host, &host), None);
        let mut lr = host.clone();
        lr.push(("argument 3".into(), "0.2".into()));
        let mut host_lr = host.clone();
        host_lr.push(("argument 3".into(), "0.1".into()));
        let d = first_difference(&host_lr, &lr).unwrap();
        assert!(d.starts_with("argument 3 differs: `0.2` on this agent, `0.1` in the job"));
        // A missing argument, on either side.
        let d = first_difference(&host, &lr).unwrap();
        assert!(d.starts_with("argument 3 differs: `0.2` on this agent, nothing in the job"));
        let d = first_difference(&lr, &host).unwrap();
        assert!(d.starts_with("argument 3 differs: nothing on this agent, `0.2` in the job"));
        // The first of several differences.
        let other = set(&[("nnodes", "1:3"), ("argument 1", "bench")]);
        assert!(
            first_difference(&host, &other)
                .unwrap()
                .starts_with("nnodes differs")
        );
        // An agent of an older wiretrain sends no settings: refused too.
        assert!(
            first_difference(&host, &[])
                .unwrap()
                .starts_with("nnodes differs")
        );
    }

    #[test]
    fn a_weak_token_is_refused_and_the_job_id_salts_the_ca() {
        let e = identity(&Token::from("hunter2-hunter2"), None).unwrap_err();
        assert!(e.contains("at least 128 bits"), "{e}");
        let t = Token::from("3f6c1a9e8b7d2c4f5a6e7d8c9b0a1f2e");
        let (a, a2) = (
            identity(&t, Some("7")).unwrap(),
            identity(&t, Some("7")).unwrap(),
        );
        let (b, none) = (
            identity(&t, Some("8")).unwrap(),
            identity(&t, None).unwrap(),
        );
        assert_eq!(a.fingerprint(), a2.fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), none.fingerprint());
    }
}
