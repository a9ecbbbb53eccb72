//! One epoch of the rendezvous host: node 0 starts first and reports its address, the
//! others then start and dial it, and the host watches every member to the epoch's end (an
//! [`Outcome`], decided by the rules of `watch`).

use super::Host;
use crate::elastic::protocol::Event;
use crate::elastic::protocol::{NodeEnd, Start, ToAgent, ToHost};
use crate::elastic::watch::{
    Member, Outcome, Watch, healed, may_heal, regrouped, regrouping, settle,
};
use std::time::Duration;
use tokio::time::Instant;

/// How long node 0 has to report its address.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// A running epoch as the host sees it.
struct Epoch<'m> {
    epoch: usize,
    /// Agent ids; node i is `members[i]`.
    members: &'m [u64],
    /// The history of restarts, as the nodes read it (`WIRETRAIN_RESTARTS`).
    restarts: String,
    job_id: String,
    /// The nodes that start fresh and receive the state (a growth in place).
    fresh: Vec<usize>,
    in_place: bool,
    state: Vec<Member>,
    /// Whether each node can go on in place (as its agent reports it).
    live: Vec<Option<bool>>,
    watch: Watch,
    /// Node 0's address and certificate fingerprint, once reported.
    ready: Option<(String, Option<String>)>,
    ready_by: Instant,
}

impl Host {
    /// Runs epoch `epoch` on `members` (agent ids; node i is `members[i]`) to its end.
    pub(super) async fn epoch(&mut self, epoch: usize, members: &[u64]) -> Outcome {
        let Some(&node0) = members.first() else {
            // The callers keep MIN >= 1 members; an empty epoch would be a bug, not a panic.
            return failed("no agent is left to run the epoch");
        };
        let mut e = Epoch {
            epoch,
            members,
            restarts: serde_json::to_string(&self.history).unwrap_or_else(|_| "[]".into()),
            job_id: self.policy.job_id.clone(),
            fresh: std::mem::take(&mut self.fresh),
            in_place: std::mem::take(&mut self.in_place),
            state: vec![Member::Idle; members.len()],
            live: vec![None; members.len()],
            watch: Watch::default(),
            ready: None,
            ready_by: Instant::now() + READY_WITHIN,
        };
        e.state[0] = Member::Running;
        // Node 0 first: it binds and reports its address.
        self.tell(node0, &e.start(0, None, None)).await;
        loop {
            if let Some(o) = self.check(&mut e).await {
                return o;
            }
            let tick = tokio::time::sleep(Duration::from_millis(200));
            let ev = tokio::select! {
                ev = self.rx.recv() => ev,
                () = tick => continue,
            };
            let Some(ev) = ev else {
                return failed("the rendezvous stopped accepting");
            };
            self.on_event(&mut e, ev).await;
        }
    }

    /// Whether the epoch has ended (and how); tells the members to stop once no heal or
    /// regrouping can follow.
    async fn check(&mut self, e: &mut Epoch<'_>) -> Option<Outcome> {
        let w = &mut e.watch;
        if self.stopped() && w.stopping.is_none() {
            w.fail("stopped by a signal on the rendezvous host".into());
            w.code = crate::signal::INTERRUPTED_EXIT;
            w.last = true;
        }
        if e.ready.is_none() && w.stopping.is_none() && Instant::now() > e.ready_by {
            w.fail("node 0 did not report its address within 60 s".into());
        }
        let (grace, members, state) = (self.policy.grace, e.members, &e.state);
        let ended = healed(members, state, w)
            .or_else(|| regrouped(members, state, w))
            .or_else(|| settle(grace, state, w));
        if ended.is_some() {
            return ended;
        }
        if w.stopping.is_some() && !w.told && !may_heal(grace, state, w) && !regrouping(grace, w) {
            w.told = true;
            let (epoch, reason) = (e.epoch, w.reason.clone());
            let stops: Vec<_> = members
                .iter()
                .zip(state)
                .filter(|(_, s)| matches!(s, Member::Running | Member::Healing))
                .map(|(&id, _)| {
                    let reason = reason.clone();
                    (id, ToAgent::Stop { epoch, reason })
                })
                .collect();
            self.tell_all(&stops).await;
        }
        None
    }

    /// Takes in one event of the running epoch.
    async fn on_event(&mut self, e: &mut Epoch<'_>, ev: Event) {
        let epoch = e.epoch;
        let node = |id: u64| e.members.iter().position(|&m| m == id);
        match ev {
            Event::Msg {
                id,
                msg:
                    ToHost::Ready {
                        epoch: at,
                        addr,
                        fingerprint,
                    },
            } if at == epoch && node(id) == Some(0) && e.ready.is_none() => {
                self.on_ready(e, addr, fingerprint).await;
            }
            Event::Msg {
                id,
                msg: ToHost::Exited { epoch: at, end },
            } if at == epoch => {
                if let Some(i) = node(id) {
                    self.on_exited(e, i, id, &end);
                }
            }
            Event::Gone { id, why } => {
                if let Some(i) = node(id) {
                    let name = self.agents[&id].name.clone();
                    if e.watch.stopping.is_none() || e.watch.grow {
                        e.watch
                            .fail(format!("node {i}'s agent {name} is gone ({why})"));
                    }
                    e.state[i] = Member::Gone;
                }
                self.absorb(Event::Gone { id, why });
            }
            ev @ Event::Joined { .. } => {
                self.absorb(ev);
                self.on_joined(e).await;
            }
            Event::Msg {
                id,
                msg: ToHost::Capable { epoch: at, live },
            } if at == epoch => {
                if let Some(i) = node(id) {
                    e.live[i] = Some(live);
                }
            }
            Event::Msg {
                id,
                msg: ToHost::Lost { epoch: at, .. },
            } if at == epoch => {
                if let Some(i) = node(id)
                    && matches!(e.state[i], Member::Running)
                {
                    e.state[i] = Member::Healing;
                }
            }
            Event::Msg { .. } => {}
        }
    }

    /// Node 0 reported its address: the others start and dial it.
    async fn on_ready(&mut self, e: &mut Epoch<'_>, addr: String, fingerprint: Option<String>) {
        e.ready = Some((addr.clone(), fingerprint.clone()));
        if e.watch.stopping.is_some() {
            return;
        }
        let mut starts = Vec::new();
        for (i, &m) in e.members.iter().enumerate().skip(1) {
            let s = e.start(i, Some(addr.clone()), fingerprint.clone());
            if matches!(e.state[i], Member::Idle) {
                e.state[i] = Member::Running;
            }
            starts.push((m, s));
        }
        self.tell_all(&starts).await;
    }

    /// Node `i` (agent `id`) ended with `end`.
    fn on_exited(&mut self, e: &mut Epoch<'_>, i: usize, id: u64, end: &NodeEnd) {
        let w = &mut e.watch;
        // Node 0 that ends before it reported its address leaves the others without a job;
        // in a stop for growth, an end other than the stop's is a failure all the same.
        let early = i == 0 && e.ready.is_none() && w.stopping.is_none();
        let failed = !end.success
            && (w.stopping.is_none() || (w.grow && end.code != crate::signal::INTERRUPTED_EXIT));
        if early && end.success {
            w.fail("node 0 ended before it reported its address".into());
        }
        // A node killed by a signal is lost; any other failure before the stop (a node that
        // could not heal, or an error of its own) is not healed.
        let killed = end.code > 128 && end.code != crate::signal::INTERRUPTED_EXIT;
        w.not_a_loss |= !end.success && !killed && !w.told;
        if failed {
            let name = &self.agents[&id].name;
            w.fail(format!("node {i} ({name}) exited with {}", end.status));
            if w.code == 0 {
                w.code = end.code;
            }
            // A usage error fails again; a signal's stop is the user's.
            w.last |= end.code == 2 || end.code == crate::signal::INTERRUPTED_EXIT;
        }
        e.state[i] = Member::Ended;
    }

    /// An agent joined during the epoch: below MAX, the world grows at the next restart
    /// point (in place when every node can go on in place).
    async fn on_joined(&mut self, e: &mut Epoch<'_>) {
        if e.members.len() >= self.policy.max || e.watch.stopping.is_some() {
            return;
        }
        let w = &mut e.watch;
        w.stopping = Some(Instant::now());
        w.grow = true;
        w.reason = "an agent joined: the world grows at this restart point".into();
        // Every node can go on in place: they regroup after their step, and the newcomers
        // receive the state from them.
        if e.live.iter().all(|l| *l == Some(true))
            && e.state.iter().all(|s| matches!(s, Member::Running))
        {
            w.regroup = true;
            let epoch = e.epoch;
            let all: Vec<_> = e
                .members
                .iter()
                .map(|&id| (id, ToAgent::Regroup { epoch }))
                .collect();
            self.tell_all(&all).await;
        }
    }
}

impl Epoch<'_> {
    /// The start message of node `node`, dialling `master` (node 0's address) unless it is
    /// node 0.
    fn start(&self, node: usize, master: Option<String>, fingerprint: Option<String>) -> ToAgent {
        ToAgent::Start(Start {
            epoch: self.epoch,
            world: self.members.len(),
            node,
            master,
            fingerprint,
            job_id: self.job_id.clone(),
            restarts: self.restarts.clone(),
            joined: self.fresh.clone(),
            in_place: self.in_place,
        })
    }
}

/// An epoch that could not run: its last failure.
fn failed(why: &str) -> Outcome {
    Outcome::Failed {
        failures: vec![why.into()],
        code: 1,
        last: true,
        detected: Instant::now(),
    }
}
