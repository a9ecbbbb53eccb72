//! One machine's agent of an elastic launch across machines (`wiretrain launch --nnodes
//! MIN:MAX --max-restarts R --master HOST:PORT -- ...` on every machine, as torchrun's
//! agents): it joins the job's rendezvous at `--master` (and hosts it when that address is
//! its own and free), then starts its node process for each epoch it is given, reports how
//! it ended, and stops it when told. Its node dies with it (a machine lost takes its node
//! along), and a node it cannot stop within the grace period is killed.

use super::host::{Policy, host};
use super::launcher::{LaunchError, Target};
use super::protocol;
use crate::job::env;
use node::PID;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;
use wiretrain_comm::tls::Token;

mod node;
mod session;
use session::agent;

/// One agent's settings.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// The rendezvous, host:port.
    pub master: String,
    /// The address this machine's node binds (default: the one that routes to `master`).
    pub host: Option<IpAddr>,
    /// What this machine's node process runs.
    pub target: Target,
    /// How long a node gets to stop after it is told, before its agent kills it.
    pub grace: Duration,
    /// The fewest machines (nodes) the job runs with (MIN of `--nnodes MIN:MAX`).
    pub min: usize,
    /// The most machines (nodes) an epoch takes (MAX of `--nnodes MIN:MAX`).
    pub max: usize,
    /// Restarts allowed after failures (`--max-restarts`).
    pub max_restarts: usize,
    /// After MIN agents are there, how long the first epoch waits for more (up to MAX).
    pub join_window: Duration,
    /// Add `--resume` from epoch 1 on (this binary's `train`).
    pub resume_flag: bool,
}

impl AgentOptions {
    /// What every agent of the job must agree on, in order (the host refuses an agent that
    /// differs, naming the first difference): MIN:MAX, the restart budget, the grace period,
    /// the program and each argument of the node command. Not this machine's own settings
    /// (its address, its ranks per node: machines may differ).
    pub fn settings(&self) -> Vec<protocol::Setting> {
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

/// Runs the agent until the job ends; `Ok` when it ended well.
pub fn run_agent(o: &AgentOptions) -> Result<(), LaunchError> {
    let bad = |m: String| LaunchError::Rendezvous(m);
    let token = job_token()?;
    let job = crate::job::job_id_from_env();
    let id = protocol::identity(&Token::from(token), job.as_deref()).map_err(bad)?;
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
            crate::signal::terminate(pid);
        }
    };
    let stop = crate::signal::install(Some(Box::new(forward))).map_err(LaunchError::Signal)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        // The first agent to bind the rendezvous address hosts it.
        let hosted = match protocol::host_endpoint(master, &id) {
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

/// The job's secret, from the environment (the token, or a file holding it).
fn job_token() -> Result<String, LaunchError> {
    std::env::var(env::TOKEN)
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| {
            std::env::var_os(env::TOKEN_FILE)
                .and_then(|p| std::fs::read_to_string(p).ok())
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        })
        .ok_or_else(|| {
            LaunchError::Rendezvous(format!(
                "an elastic launch across machines needs the job's secret: set {} (or {}) to \
                 the same token on every machine",
                env::TOKEN,
                env::TOKEN_FILE
            ))
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
