//! The host of an elastic launch across machines: the agent that binds `--master` runs this
//! beside its own agent. It gathers MIN..=MAX agents, numbers their nodes, starts each epoch
//! (node 0 first, which reports its address; the others then dial it) and watches it:
//!
//! * every node ends well: the job is done;
//! * a node fails or an agent falls silent: the others are stopped, and the agents still
//!   there start the next epoch from the newest checkpoint (one restart of `--max-restarts`),
//!   as long as MIN remain;
//! * an agent joins while the world is below MAX: every node is stopped after its step (and
//!   checkpoints), and the next epoch takes the newcomer in (not a restart: no node failed).
//!
//! When the job ends, every agent is told its exit code and the restarts so far.

use super::protocol::{self, Event, ToAgent, accept_loop};
use super::restart::{Restart, describe_restart, unix_ms_at};
use super::watch::Outcome;
use crate::elastic::policy::{Decision, EpochEnd, Limits, Recovery, decide, gathered};
use quinn::{Endpoint, SendStream};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

mod epoch;
mod tell;

/// How an elastic launch may go on.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub min: usize,
    pub max: usize,
    pub max_restarts: usize,
    /// After MIN agents are there, how long the first epoch waits for more (up to MAX).
    pub join_window: Duration,
    /// How long the first MIN agents may take to arrive.
    pub gather_timeout: Duration,
    /// How long a node gets to stop after it is told (its agent kills it then).
    pub grace: Duration,
    pub job_id: String,
    /// Raised by a signal to the hosting agent: the job stops after its step, everywhere.
    pub stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The hosting agent's settings: an agent that differs is refused.
    pub settings: Vec<protocol::Setting>,
}

struct Agent {
    name: String,
    send: SendStream,
    gone: Option<String>,
}

/// Runs the rendezvous on `ep` until the job ends; every agent is told how it ended.
pub(crate) async fn host(ep: Endpoint, policy: Policy) {
    let (tx, rx) = mpsc::unbounded_channel();
    let ours = std::sync::Arc::new(policy.settings.clone());
    let accept = tokio::spawn(accept_loop(ep.clone(), tx, ours));
    let mut h = Host {
        policy,
        rx,
        agents: BTreeMap::new(),
        history: Vec::new(),
        failures_restarted: 0,
        fresh: Vec::new(),
        in_place: false,
    };
    let (code, message) = h.run().await;
    // Agents that joined meanwhile are told too.
    h.drain();
    let done = ToAgent::Done { code, message };
    let tell: Vec<_> = std::mem::take(&mut h.agents)
        .into_values()
        .filter(|a| a.gone.is_none())
        .map(|mut a| {
            let done = done.clone();
            tokio::spawn(async move {
                let _ = protocol::send(&mut a.send, &done).await;
                let _ = a.send.finish();
                // The message leaves before the endpoint goes.
                let _ = timeout(Duration::from_secs(2), a.send.stopped()).await;
            })
        })
        .collect();
    for t in tell {
        let _ = t.await;
    }
    accept.abort();
    ep.close(0u32.into(), b"done");
}

struct Host {
    policy: Policy,
    rx: mpsc::UnboundedReceiver<Event>,
    agents: BTreeMap<u64, Agent>,
    history: Vec<Restart>,
    failures_restarted: usize,
    /// The next epoch's nodes that start fresh and receive the state (a growth in place).
    fresh: Vec<usize>,
    /// The next epoch goes on in place (a heal or a growth in place).
    in_place: bool,
}

impl Host {
    /// Agents that are still there, in the order they joined.
    fn alive(&self) -> Vec<u64> {
        self.agents
            .iter()
            .filter(|(_, a)| a.gone.is_none())
            .map(|(&id, _)| id)
            .collect()
    }

    /// Takes in every event already queued (agents gone or joined while an epoch ended).
    fn drain(&mut self) {
        while let Ok(ev) = self.rx.try_recv() {
            self.absorb(ev);
        }
    }

    /// The policy's limits (`--nnodes MIN:MAX --max-restarts R`).
    fn limits(&self) -> Limits {
        Limits {
            min: self.policy.min,
            max: self.policy.max,
            max_restarts: self.policy.max_restarts,
        }
    }

    /// Whether the hosting agent was stopped by a signal.
    fn stopped(&self) -> bool {
        self.policy.stop.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Takes in one event outside an epoch.
    fn absorb(&mut self, ev: Event) {
        match ev {
            Event::Joined {
                id,
                name,
                host,
                send,
            } => {
                tracing::info!("elastic rendezvous: agent {name} ({host}) joined");
                self.agents.insert(
                    id,
                    Agent {
                        name,
                        send,
                        gone: None,
                    },
                );
            }
            Event::Gone { id, why } => {
                if let Some(a) = self.agents.get_mut(&id) {
                    a.gone = Some(why);
                }
            }
            Event::Msg { .. } => {}
        }
    }

    /// The first epoch's members: MIN agents, then up to MAX within the join window. Agents
    /// that leave meanwhile are not counted: when fewer than MIN are left after the window,
    /// the gathering goes on (within the same timeout). Err: the job's end.
    async fn gather(&mut self) -> Result<Vec<u64>, (i32, String)> {
        let until = Instant::now() + self.policy.gather_timeout;
        loop {
            while self.alive().len() < self.policy.min {
                if self.stopped() {
                    return Err((
                        crate::signal::INTERRUPTED_EXIT,
                        "stopped by a signal on the rendezvous host".into(),
                    ));
                }
                let by = until.min(Instant::now() + Duration::from_millis(200));
                match tokio::time::timeout_at(by, self.rx.recv()).await {
                    Ok(Some(ev)) => self.absorb(ev),
                    Err(_) if Instant::now() < until => {}
                    _ => {
                        return Err((
                            1,
                            format!(
                                "only {} of the {} agents the job needs joined the rendezvous \
                                 within {:?}",
                                self.alive().len(),
                                self.policy.min,
                                self.policy.gather_timeout
                            ),
                        ));
                    }
                }
            }
            let window = Instant::now() + self.policy.join_window;
            while self.alive().len() < self.policy.max {
                match tokio::time::timeout_at(window, self.rx.recv()).await {
                    Ok(Some(ev)) => self.absorb(ev),
                    _ => break,
                }
            }
            // Agents gone in the window's last moments count as gone.
            self.drain();
            let alive = self.alive();
            let limits = self.limits();
            if let Some(members) = gathered(&alive, &limits) {
                return Ok(members);
            }
            tracing::warn!(
                "elastic rendezvous: agents left during the join window; {} of the {} needed \
                 remain, gathering again",
                alive.len(),
                self.policy.min
            );
        }
    }

    /// The job, epoch after epoch: `(exit code, message)` for every agent. What follows each
    /// epoch is the library's elastic policy ([`crate::elastic::policy::decide`]).
    async fn run(&mut self) -> (i32, String) {
        let mut members = match self.gather().await {
            Ok(m) => m,
            Err(end) => return end,
        };
        loop {
            let epoch = self.history.len();
            let outcome = self.epoch(epoch, &members).await;
            // What happened while the epoch ended counts before the next one is chosen.
            self.drain();
            let alive = self.alive();
            let (end, failures, code, detected) = match &outcome {
                Outcome::Finished => return (0, String::new()),
                Outcome::Grow { detected, in_place } => (
                    EpochEnd::Grow {
                        in_place: in_place.as_deref(),
                    },
                    Vec::new(),
                    1,
                    *detected,
                ),
                Outcome::Failed {
                    failures,
                    code,
                    last,
                    detected,
                } => (
                    EpochEnd::Failed { restartable: !last },
                    failures.clone(),
                    *code,
                    *detected,
                ),
                Outcome::Heal {
                    failures,
                    code,
                    detected,
                    healing,
                } => (
                    EpochEnd::Heal {
                        survivors: healing.as_slice(),
                    },
                    failures.clone(),
                    *code,
                    *detected,
                ),
            };
            let limits = self.limits();
            match decide(&limits, self.failures_restarted, &members, &alive, end) {
                Decision::Done => return (0, String::new()),
                Decision::End { why } => return (code, self.end_message(failures, why)),
                Decision::Next(next) => {
                    self.failures_restarted += usize::from(next.uses_restart);
                    let live = next.recovery == Recovery::Live;
                    // In place, the newcomers start fresh and receive the state.
                    self.fresh = if live {
                        next.joined.clone()
                    } else {
                        Vec::new()
                    };
                    self.in_place = live;
                    let reason = match &outcome {
                        Outcome::Grow { .. } => "agents joined".to_string(),
                        _ => failures.join("; "),
                    };
                    let before = std::mem::replace(&mut members, next.members);
                    self.record(
                        epoch + 1,
                        &before,
                        &members,
                        next.joined,
                        reason,
                        (detected, next.recovery.as_str()),
                    );
                }
            }
        }
    }

    /// The job's last word: the failures, the policy's reason, the restarts made.
    fn end_message(&self, mut msg: Vec<String>, why: Option<String>) -> String {
        msg.extend(why);
        if !self.history.is_empty() {
            let h: Vec<String> = self.history.iter().map(describe_restart).collect();
            msg.push(format!(
                "after {} restart(s) ({} after failures): {}",
                self.history.len(),
                self.failures_restarted,
                h.join("; ")
            ));
        }
        msg.join("; ")
    }

    fn record(
        &mut self,
        epoch: usize,
        before: &[u64],
        after: &[u64],
        joined: Vec<usize>,
        reason: String,
        (detected, recovery): (Instant, &'static str),
    ) {
        let left: Vec<usize> = (0..before.len())
            .filter(|&i| !after.contains(&before[i]))
            .collect();
        let r = Restart {
            epoch,
            left,
            joined,
            world: after.len(),
            reason,
            recovery,
            detected_unix_ms: unix_ms_at(detected.into_std()),
            restarted_unix_ms: unix_ms_at(std::time::Instant::now()),
        };
        let what = if recovery == "live" {
            "heal from live replicas"
        } else {
            "restart"
        };
        eprintln!(
            "wiretrain launch: elastic {what} (epoch {epoch}, {} of {} allowed after failures): {}",
            self.failures_restarted,
            self.policy.max_restarts,
            describe_restart(&r)
        );
        self.history.push(r);
    }
}
