//! One machine's agent of an elastic launch across machines (`wiretrain launch --nnodes
//! MIN:MAX --max-restarts R --master HOST:PORT -- ...` on every machine, as torchrun's
//! agents): it joins the job's rendezvous at `--master` (and hosts it when that address is
//! its own and free), then starts its node process for each epoch it is given, reports how
//! it ended, and stops it when told. Its node dies with it (a machine lost takes its node
//! along), and a node it cannot stop within the grace period is killed.

use super::launcher::{LaunchError, Place, Target, exit_code, temp_dir};
use super::rdzv::{self, NodeEnd, Start, ToAgent, ToHost};
use super::rdzv_host::{Policy, host};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use wiretrain::heal::{
    Answer, Assignment, Ready, answer_file, capable_file, ready_file, regroup_file, write_json,
};
use wiretrain::job::env;
use wiretrain_comm::tls::Token;

/// One agent's settings.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// The rendezvous, host:port.
    pub master: String,
    /// The address this machine's node binds (default: the one that routes to `master`).
    pub host: Option<IpAddr>,
    pub target: Target,
    pub grace: Duration,
    pub min: usize,
    pub max: usize,
    pub max_restarts: usize,
    pub join_window: Duration,
    /// Add `--resume` from epoch 1 on (this binary's `train`).
    pub resume_flag: bool,
}

impl AgentOptions {
    /// What every agent of the job must agree on, in order (the host refuses an agent that
    /// differs, naming the first difference): MIN:MAX, the restart budget, the grace period,
    /// the program and each argument of the node command. Not this machine's own settings
    /// (its address, its ranks per node: machines may differ).
    pub fn settings(&self) -> Vec<rdzv::Setting> {
        let mut s = vec![
            ("nnodes".to_string(), format!("{}:{}", self.min, self.max)),
            ("max-restarts".into(), self.max_restarts.to_string()),
            ("grace".into(), format!("{:?}", self.grace)),
        ];
        let program = self.target.program.as_ref();
        let program = program.map_or("this wiretrain".into(), |p| p.display().to_string());
        s.push(("the node program".into(), program));
        s.extend(self.target.args.iter().enumerate().map(|(i, a)| {
            (
                format!("argument {} of the node command", i + 1),
                a.to_string_lossy().into_owned(),
            )
        }));
        s
    }
}

/// The running node's pid, which a signal to the agent is passed on to.
static PID: Mutex<Option<u32>> = Mutex::new(None);

/// Runs the agent until the job ends; `Ok` when it ended well.
pub fn run_agent(o: &AgentOptions) -> Result<(), LaunchError> {
    let bad = |m: String| LaunchError::Rendezvous(m);
    let token = std::env::var(env::TOKEN)
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| {
            std::env::var_os(env::TOKEN_FILE)
                .and_then(|p| std::fs::read_to_string(p).ok())
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        })
        .ok_or_else(|| {
            bad(format!(
                "an elastic launch across machines needs the job's secret: set {} (or {}) to \
                 the same token on every machine",
                env::TOKEN,
                env::TOKEN_FILE
            ))
        })?;
    let job = wiretrain::job::job_id_from_env();
    let id = rdzv::identity(&Token::from(token), job.as_deref()).map_err(bad)?;
    let master = o
        .master
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| bad(format!("--master {}: not a reachable host:port", o.master)))?;
    let ip = match o.host {
        Some(ip) => ip,
        None => route_to(master).map_err(|e| {
            bad(format!(
                "no local address routes to {master} ({e}); give this machine's with --host"
            ))
        })?,
    };
    let forward = || {
        if let Some(pid) = *PID.lock().unwrap_or_else(|p| p.into_inner()) {
            wiretrain::signal::terminate(pid);
        }
    };
    let stop = wiretrain::signal::install(Some(Box::new(forward))).map_err(LaunchError::Signal)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        // The first agent to bind the rendezvous address hosts it.
        let hosted = match rdzv::host_endpoint(master, &id) {
            Ok(ep) => {
                eprintln!("wiretrain launch: this agent hosts the elastic rendezvous at {master}");
                let job_id = job
                    .clone()
                    .unwrap_or_else(|| format!("elastic-{:016x}", rand::random::<u64>()));
                Some(tokio::spawn(host(
                    ep,
                    Policy {
                        min: o.min,
                        max: o.max,
                        max_restarts: o.max_restarts,
                        join_window: o.join_window,
                        gather_timeout: Duration::from_secs(600),
                        grace: o.grace,
                        job_id,
                        stop: stop.clone(),
                        settings: o.settings(),
                    },
                )))
            }
            Err(e) => {
                // Another agent holds it (or it is not this machine's address): join that one.
                tracing::debug!("not hosting the rendezvous at {master}: {e}");
                if route_to(master).is_ok_and(|ip| ip == master.ip()) {
                    eprintln!(
                        "wiretrain launch: {master} is this machine's but taken ({e}); joining \
                         the agent that holds it"
                    );
                }
                None
            }
        };
        let res = agent(o, &id, master, ip, &stop).await;
        if let Some(h) = hosted {
            // The host tells every other agent how the job ended before this process goes.
            let _ = tokio::time::timeout(Duration::from_secs(15), h).await;
        }
        res
    })
}

/// The local address this machine uses to reach `to` (no packet is sent).
fn route_to(to: SocketAddr) -> std::io::Result<IpAddr> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().expect("an address")
    } else {
        "[::]:0".parse().expect("an address")
    };
    let s = std::net::UdpSocket::bind(any)?;
    s.connect(to)?;
    Ok(s.local_addr()?.ip())
}

/// This agent's node of one epoch.
struct Node {
    child: Child,
    epoch: usize,
    /// Node 0's files (address, certificate); `None` on the others or once reported.
    report: Option<(PathBuf, PathBuf)>,
    dir: Option<PathBuf>,
    stop_at: Option<Instant>,
    /// It lost its job and waits, alive, for its place in the next epoch (reported `Lost`).
    healing: bool,
    /// The epoch for which whether it can go on in place was reported (`Capable`).
    capable_for: Option<usize>,
}

async fn agent(
    o: &AgentOptions,
    id: &wiretrain_comm::tls::JobIdentity,
    master: SocketAddr,
    ip: IpAddr,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), LaunchError> {
    let lost = |why: String| {
        LaunchError::Rendezvous(format!("lost the elastic rendezvous at {master}: {why}"))
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let rdzv::Link {
        conn,
        mut send,
        mut recv,
    } = rdzv::dial(id, master, deadline)
        .await
        .map_err(LaunchError::Rendezvous)?;
    let name = format!("{ip}/pid {}", std::process::id());
    let join = ToHost::Join {
        version: rdzv::VERSION,
        name,
        host: ip.to_string(),
        settings: o.settings(),
    };
    rdzv::send(&mut send, &join).await.map_err(lost)?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        loop {
            let m = rdzv::recv::<ToAgent>(&mut recv).await;
            let end = m.is_err();
            if tx.send(m).is_err() || end {
                return;
            }
        }
    });
    // Where this agent's nodes ask for their place in the next epoch after losing a peer.
    let heal_dir = temp_dir()?;
    let mut node: Option<Node> = None;
    // Since when this agent, stopped by a signal with its node ended, waits for the host's
    // word (its last report must reach the host before the link closes).
    let mut leaving: Option<Instant> = None;
    let res = loop {
        let tick = tokio::time::sleep(Duration::from_millis(20));
        let msg = tokio::select! {
            m = rx.recv() => Some(m.unwrap_or_else(|| Err("the link closed".into()))),
            () = tick => None,
        };
        match msg {
            Some(Ok(ToAgent::Start(s))) => {
                // A node waiting to heal goes on in place when the epoch does: it is told
                // its place in it. In an epoch that starts afresh it is stopped first.
                let in_place = s.in_place && !s.joined.contains(&s.node);
                if let Some(n) = node.as_mut().filter(|n| n.healing) {
                    if in_place && !stop.load(Ordering::SeqCst) {
                        match heal_in_place(n, &s, ip, &heal_dir) {
                            Ok(()) => continue,
                            Err(e) => tracing::warn!("healing in place failed ({e})"),
                        }
                    } else {
                        let f = answer_file(&heal_dir, n.child.id());
                        let _ = write_json(&f, &Answer::Stop("the job restarts afresh".into()));
                    }
                }
                if in_place {
                    // The node this epoch goes on with is gone: the host restarts the job.
                    if let Some(mut n) = node.take() {
                        end_node(&mut n);
                    }
                    let m = ToHost::Exited {
                        epoch: s.epoch,
                        end: NodeEnd {
                            status: "no node to go on in place".into(),
                            code: 1,
                            success: false,
                        },
                    };
                    if let Err(e) = rdzv::send(&mut send, &m).await {
                        break Err(lost(e));
                    }
                    continue;
                }
                if let Some(mut n) = node.take() {
                    end_node(&mut n);
                }
                let started = if stop.load(Ordering::SeqCst) {
                    // Stopped between epochs: this node ends before it starts.
                    Err(NodeEnd {
                        status: "stopped by a signal before it started".into(),
                        code: wiretrain::signal::INTERRUPTED_EXIT,
                        success: false,
                    })
                } else {
                    start_node(o, &s, ip, &heal_dir).map_err(|e| NodeEnd {
                        status: format!("cannot start: {e}"),
                        code: 1,
                        success: false,
                    })
                };
                match started {
                    Ok(n) => {
                        if stop.load(Ordering::SeqCst) {
                            // The signal came while it started: pass it on.
                            wiretrain::signal::terminate(n.child.id());
                        }
                        node = Some(n);
                    }
                    Err(end) => {
                        let m = ToHost::Exited {
                            epoch: s.epoch,
                            end,
                        };
                        if let Err(e) = rdzv::send(&mut send, &m).await {
                            break Err(lost(e));
                        }
                    }
                }
            }
            Some(Ok(ToAgent::Stop { epoch, reason })) => {
                if let Some(n) = node
                    .as_mut()
                    .filter(|n| n.epoch == epoch && n.stop_at.is_none())
                {
                    if n.healing {
                        let f = answer_file(&heal_dir, n.child.id());
                        let _ = write_json(&f, &Answer::Stop(reason.clone()));
                    }
                    eprintln!("wiretrain launch: stopping node of epoch {epoch}: {reason}");
                    wiretrain::signal::terminate(n.child.id());
                    n.stop_at = Some(Instant::now());
                }
            }
            Some(Ok(ToAgent::Regroup { epoch })) => {
                if let Some(n) = node.as_ref().filter(|n| n.epoch == epoch && !n.healing) {
                    let _ = std::fs::write(regroup_file(&heal_dir, n.child.id()), b"");
                }
            }
            Some(Ok(ToAgent::Done { code, message })) => {
                break if code == 0 {
                    Ok(())
                } else {
                    Err(LaunchError::Failed {
                        failures: vec![message],
                        code,
                    })
                };
            }
            Some(Ok(ToAgent::Refused { reason })) => {
                break Err(LaunchError::Rendezvous(format!("refused: {reason}")));
            }
            Some(Err(why)) => {
                let why = conn.close_reason().map_or(why, |e| {
                    wiretrain_comm::transport::quic::describe_conn_error(&e)
                });
                break Err(lost(why));
            }
            None => {
                if let Some(n) = node.as_mut() {
                    let m = match watch(n, o.grace, &heal_dir) {
                        Ok(m) => m,
                        Err(e) => break Err(e),
                    };
                    if let Some(m) = m {
                        let ended = matches!(m, ToHost::Exited { .. });
                        if let Err(e) = rdzv::send(&mut send, &m).await {
                            break Err(lost(e));
                        }
                        if ended {
                            node = None;
                        }
                    }
                }
                if node.is_none() && stop.load(Ordering::SeqCst) {
                    let since = *leaving.get_or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(10) {
                        break Err(LaunchError::Interrupted);
                    }
                }
            }
        }
    };
    if let Some(mut n) = node.take() {
        end_node(&mut n);
    }
    let _ = std::fs::remove_dir_all(&heal_dir);
    reader.abort();
    // What was sent reaches the host before the link closes.
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    conn.close(0u32.into(), b"agent done");
    res
}

/// Checks on the node: node 0's address once written (`Ready`), its end (`Exited`), its
/// waiting to heal (`Lost`); kills it when a stop has taken longer than `grace`.
fn watch(n: &mut Node, grace: Duration, heal_dir: &Path) -> Result<Option<ToHost>, LaunchError> {
    if let Some(st) = n.child.try_wait()? {
        *PID.lock().unwrap_or_else(|p| p.into_inner()) = None;
        wiretrain::heal::forget(heal_dir, n.child.id());
        if let Some(d) = n.dir.take() {
            let _ = std::fs::remove_dir_all(d);
        }
        let end = NodeEnd {
            status: st.to_string(),
            code: exit_code(st),
            success: st.success(),
        };
        return Ok(Some(ToHost::Exited {
            epoch: n.epoch,
            end,
        }));
    }
    if let Some((addr, fp)) = &n.report
        && let Ok(a) = std::fs::read_to_string(addr)
    {
        let fingerprint = std::fs::read_to_string(fp)
            .ok()
            .map(|f| f.trim().to_string());
        let m = ToHost::Ready {
            epoch: n.epoch,
            addr: a.trim().to_string(),
            fingerprint,
        };
        n.report = None;
        return Ok(Some(m));
    }
    let capable = capable_file(heal_dir, n.child.id());
    if n.capable_for != Some(n.epoch)
        && n.stop_at.is_none()
        && let Ok(b) = std::fs::read(&capable)
        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b)
    {
        n.capable_for = Some(n.epoch);
        return Ok(Some(ToHost::Capable {
            epoch: n.epoch,
            live: v["live"] == true,
        }));
    }
    let ready = ready_file(heal_dir, n.child.id());
    if !n.healing
        && n.stop_at.is_none()
        && let Ok(b) = std::fs::read(&ready)
        && let Ok(r) = serde_json::from_slice::<Ready>(&b)
    {
        let _ = std::fs::remove_file(&ready);
        n.healing = true;
        return Ok(Some(ToHost::Lost {
            epoch: n.epoch,
            step: r.step,
        }));
    }
    if n.stop_at.is_some_and(|t| t.elapsed() > grace) {
        let _ = n.child.kill();
    }
    Ok(None)
}

/// Node 0 of `s` (no master given) reports its address and certificate through files in a
/// directory of its own: (the directory, (address file, certificate file)); none elsewhere.
#[allow(clippy::type_complexity)]
fn node0_files(s: &Start) -> Result<(Option<PathBuf>, Option<(PathBuf, PathBuf)>), LaunchError> {
    if s.master.is_some() {
        return Ok((None, None));
    }
    let d = temp_dir()?;
    let files = (d.join("master.addr"), d.join("master.sha256"));
    Ok((Some(d), Some(files)))
}

/// Moves a node waiting to heal into epoch `s` in place: its answer names its rank, the world
/// and node 0 (node 0 itself binds `ip` and writes its address and certificate to files of
/// its own, which `watch` reports as `Ready`).
fn heal_in_place(n: &mut Node, s: &Start, ip: IpAddr, heal_dir: &Path) -> Result<(), LaunchError> {
    let bind = SocketAddr::new(ip, 0);
    let (dir, files) = node0_files(s)?;
    let a = Assignment {
        epoch: s.epoch as u64,
        nnodes: s.world,
        node_rank: s.node,
        master: s.master.clone().unwrap_or_else(|| bind.to_string()),
        bind: s.master.is_some().then_some(bind),
        addr_file: files.as_ref().map(|f| f.0.clone()),
        fingerprint_file: files.as_ref().map(|f| f.1.clone()),
        master_sha256: s.fingerprint.clone(),
        restarts: serde_json::from_str(&s.restarts).unwrap_or_default(),
        joined: s.joined.clone(),
    };
    write_json(&answer_file(heal_dir, n.child.id()), &Answer::Assign(a))?;
    if let Some(old) = n.dir.take() {
        let _ = std::fs::remove_dir_all(old);
    }
    n.epoch = s.epoch;
    n.report = files;
    n.dir = dir;
    n.healing = false;
    n.stop_at = None;
    eprintln!(
        "wiretrain launch: epoch {}: node {} of {} goes on in place (healed from live replicas)",
        s.epoch, s.node, s.world
    );
    Ok(())
}

/// Kills the node and waits for it.
fn end_node(n: &mut Node) {
    let _ = n.child.kill();
    let _ = n.child.wait();
    *PID.lock().unwrap_or_else(|p| p.into_inner()) = None;
    if let Some(d) = n.dir.take() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Starts this agent's node of `s`: node 0 binds `ip` and writes its address and certificate
/// to files of its own; the others bind `ip` and pin node 0's certificate.
fn start_node(
    o: &AgentOptions,
    s: &Start,
    ip: IpAddr,
    heal_dir: &Path,
) -> Result<Node, LaunchError> {
    let exe = std::env::current_exe()?;
    // A node joining in place receives the state from the others: it does not resume.
    let joins_live = s.joined.contains(&s.node);
    let target = if joins_live {
        o.target.clone()
    } else {
        o.target.for_epoch(s.epoch, o.resume_flag)
    };
    let bind = SocketAddr::new(ip, 0).to_string();
    let (dir, files) = node0_files(s)?;
    let master = s.master.clone().unwrap_or_else(|| bind.clone());
    let place = match &files {
        Some((addr, _)) => Place::AddrFile(addr),
        None => Place::Bind(&bind),
    };
    let mut c = target.command(&exe, s.world, s.node, &master, place);
    c.env(env::JOB_ID, &s.job_id)
        .env(env::EPOCH, s.epoch.to_string())
        .env(env::RESTARTS, &s.restarts)
        .env(env::HEAL_DIR, heal_dir)
        .env(env::HEAL_WAIT_MS, wait_ms(o.grace));
    if joins_live {
        c.env(env::HEAL_JOIN, "1");
    }
    match (&files, &s.fingerprint) {
        (Some((_, fp)), _) => {
            c.env(env::FINGERPRINT_FILE, fp);
        }
        (None, Some(f)) => {
            c.env(env::MASTER_SHA256, f);
        }
        (None, None) => {}
    }
    // The command dies with this agent (see `Target::command`), as it would with its machine.
    let child = c.spawn().map_err(|source| LaunchError::Spawn {
        node: s.node,
        source,
    })?;
    *PID.lock().unwrap_or_else(|p| p.into_inner()) = Some(child.id());
    eprintln!(
        "wiretrain launch: epoch {}: node {} of {} started",
        s.epoch, s.node, s.world
    );
    Ok(Node {
        child,
        epoch: s.epoch,
        report: files,
        dir,
        stop_at: None,
        healing: false,
        capable_for: None,
    })
}

/// WIRETRAIN_HEAL_WAIT_MS for a node whose agent gives it `grace` to stop.
fn wait_ms(grace: Duration) -> String {
    wiretrain::heal::answer_wait(grace).as_millis().to_string()
}
