//! An epoch of the elastic rendezvous as its host watches it: where each member stands
//! ([`Member`]), the stop in progress ([`Watch`]) and how the epoch ends ([`Outcome`]: done, a
//! restart after failures, a growth, or a heal from live replicas), decided by [`settle`],
//! [`may_heal`] and [`healed`].

use super::protocol;
use std::time::Duration;
use tokio::time::Instant;

/// Where a member of the running epoch stands.
#[derive(Clone)]
pub(super) enum Member {
    /// Not started yet (the others wait for node 0's address).
    Idle,
    Running,
    /// Its node lost its job and waits, alive, to heal.
    Healing,
    Ended,
    Gone,
}

/// How an epoch ended.
pub(super) enum Outcome {
    Finished,
    /// Nodes failed; `detected` is when it was first seen. `last`: no restart may follow
    /// (a usage error, or a node stopped by a signal, e.g. Ctrl-C on its machine).
    Failed {
        failures: Vec<String>,
        code: i32,
        last: bool,
        detected: Instant,
    },
    /// Agents joined; the epoch was stopped to take them in.
    Grow {
        detected: Instant,
        /// The nodes that regrouped and wait, alive, to go on in place with the newcomers
        /// (in node order); `None`: they stopped and checkpointed.
        in_place: Option<Vec<u64>>,
    },
    /// Nodes were lost and every other node waits, alive, to heal: `healing` (in node order)
    /// go on in the next epoch from their live state.
    Heal {
        failures: Vec<String>,
        code: i32,
        detected: Instant,
        healing: Vec<u64>,
    },
}

/// Whether the epoch may still end in a heal: nodes were lost (killed or their agents
/// gone) and nothing else failed, no stop for growth or a signal, within the grace period,
/// and some node has not yet said whether it waits to heal.
pub(super) fn may_heal(grace: Duration, state: &[Member], w: &Watch) -> bool {
    w.stopping.is_some_and(|t| t.elapsed() <= grace)
        && !w.grow
        && !w.last
        && !w.not_a_loss
        && state.iter().any(|s| matches!(s, Member::Running))
}

/// A growth in place is under way: asked to regroup, every node leaves its epoch after its
/// step, alive; the host waits for them (within the grace period) instead of stopping them.
pub(super) fn regrouping(grace: Duration, w: &Watch) -> bool {
    w.regroup && w.failures.is_empty() && w.stopping.is_some_and(|t| t.elapsed() <= grace)
}

/// The growth in place is ready: every node (none failed) waits, alive, to go on.
pub(super) fn regrouped(members: &[u64], state: &[Member], w: &Watch) -> Option<Outcome> {
    let detected = w.stopping?;
    if !w.regroup || w.told || !w.failures.is_empty() {
        return None;
    }
    if state
        .iter()
        .any(|s| !matches!(s, Member::Healing | Member::Gone))
    {
        return None;
    }
    let waiting: Vec<u64> = (0..members.len())
        .filter(|&i| matches!(state[i], Member::Healing))
        .map(|i| members[i])
        .collect();
    (!waiting.is_empty()).then_some(Outcome::Grow {
        detected,
        in_place: Some(waiting),
    })
}

/// The epoch ends in a heal: nodes were lost, nothing else failed, and every node left
/// waits, alive, to heal.
pub(super) fn healed(members: &[u64], state: &[Member], w: &Watch) -> Option<Outcome> {
    let detected = w.stopping?;
    if w.told || w.grow || w.last || w.not_a_loss {
        return None;
    }
    if state
        .iter()
        .any(|s| matches!(s, Member::Running | Member::Idle))
    {
        return None;
    }
    let healing: Vec<u64> = (0..members.len())
        .filter(|&i| matches!(state[i], Member::Healing))
        .map(|i| members[i])
        .collect();
    (!healing.is_empty()).then(|| Outcome::Heal {
        failures: w.failures.clone(),
        code: if w.code == 0 { 1 } else { w.code },
        detected,
        healing,
    })
}

/// The epoch's outcome once every member has ended or is gone (or the stop has taken
/// longer than any agent may: those still silent count as lost).
pub(super) fn settle(grace: Duration, state: &[Member], w: &Watch) -> Option<Outcome> {
    let running = state
        .iter()
        .any(|s| matches!(s, Member::Running | Member::Healing));
    let overdue = w
        .stopping
        .is_some_and(|t| t.elapsed() > grace + protocol::LINK_IDLE * 2 + Duration::from_secs(5));
    if running && !overdue {
        return None;
    }
    let Some(detected) = w.stopping else {
        // Everyone ended on their own, well (a failure would have set `stopping`).
        return Some(Outcome::Finished);
    };
    if w.grow && w.failures.is_empty() {
        return Some(Outcome::Grow {
            detected,
            in_place: None,
        });
    }
    Some(Outcome::Failed {
        failures: w.failures.clone(),
        code: if w.code == 0 { 1 } else { w.code },
        last: w.last,
        detected,
    })
}

/// The epoch's stop in progress: when and why it began, and what failed.
#[derive(Default)]
pub(super) struct Watch {
    pub(super) stopping: Option<Instant>,
    pub(super) told: bool,
    pub(super) grow: bool,
    pub(super) reason: String,
    pub(super) failures: Vec<String>,
    pub(super) code: i32,
    pub(super) last: bool,
    /// A failure other than a lost node (killed by a signal, or its agent gone): no heal.
    pub(super) not_a_loss: bool,
    /// The growth is in place: the nodes were asked to regroup, not stopped.
    pub(super) regroup: bool,
}

impl Watch {
    pub(super) fn fail(&mut self, what: String) {
        if self.stopping.is_none() {
            self.stopping = Some(Instant::now());
        }
        self.reason = format!("a node failed: {what}");
        self.failures.push(what);
    }
}
