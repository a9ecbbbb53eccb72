//! What an elastic launch does when an epoch ends: pure decisions on member lists, shared by
//! the local launcher and the rendezvous host, unit-tested below.
//!
//! Members are opaque ids (agents of a launch across machines; node numbers in a local
//! launch); node i of an epoch is its i-th member. The rules:
//! - the next epoch's members are the members still there, in their order, then those
//!   waiting to join, in the order they came, up to MAX;
//! - a failure restarts from the newest checkpoint while restarts are left, the failure allows
//!   one (not a usage error or the job's last word), and MIN members remain; a heal from live
//!   replicas is a restart too, and needs MIN survivors;
//! - a growth (members joined while the world was below MAX) is not a failure: it uses no
//!   restart, in place (the newcomers receive the state) or from a checkpoint; it still needs
//!   MIN members, since others may have left meanwhile.

/// How far an elastic job may go on (`--nnodes MIN:MAX --max-restarts R`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The fewest members (nodes) the job runs with.
    pub min: usize,
    /// The most members (nodes) an epoch takes.
    pub max: usize,
    /// Restarts allowed after failures (growths use none).
    pub max_restarts: usize,
}

/// How an epoch ended, as far as the policy cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochEnd<'a> {
    /// Every node ended well: the job is done.
    Finished,
    /// Members joined while the world was below MAX. `Some(regrouped)`: the members whose
    /// nodes regroup in place (the newcomers then receive their state); `None`: every node
    /// stopped after its step and checkpointed.
    Grow {
        /// The members regrouping in place, or `None` after a checkpoint.
        in_place: Option<&'a [u64]>,
    },
    /// Nodes failed. `restartable`: false for a failure no restart can help (a usage error,
    /// or one the nodes marked as the job's end).
    Failed {
        /// Whether a restart can help.
        restartable: bool,
    },
    /// Nodes failed and `survivors` wait, alive, to heal from live replicas.
    Heal {
        /// The members alive and waiting, in the epoch's order.
        survivors: &'a [u64],
    },
}

/// How the next epoch recovers its state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// From the newest checkpoint.
    Checkpoint,
    /// From live replicas, in the same processes.
    Live,
}

impl Recovery {
    /// As the restart records name it ("checkpoint", "live").
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Checkpoint => "checkpoint",
            Self::Live => "live",
        }
    }
}

/// The next epoch, as decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextEpoch {
    /// Its members in node order (node i is the i-th).
    pub members: Vec<u64>,
    /// Nodes of the epoch before that are not in it (numbered as in the epoch before).
    pub left: Vec<usize>,
    /// Nodes that joined (numbered as in the new epoch).
    pub joined: Vec<usize>,
    /// How it recovers its state.
    pub recovery: Recovery,
    /// Whether it uses one of the restarts (a failure, not a growth).
    pub uses_restart: bool,
}

/// What follows an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The job is done.
    Done,
    /// The job ends in failure; the policy's own reason when it is not the failure itself
    /// (too few members, no restart left).
    End {
        /// The policy's reason, or `None` when the failure itself is the reason.
        why: Option<String>,
    },
    /// Another epoch runs.
    Next(NextEpoch),
}

/// The next epoch's members: those of `before` in `alive`, in their order, then the others of
/// `alive`, in theirs, up to `max`.
pub fn next_members(before: &[u64], alive: &[u64], max: usize) -> Vec<u64> {
    let mut next: Vec<u64> = before
        .iter()
        .copied()
        .filter(|id| alive.contains(id))
        .collect();
    next.extend(alive.iter().filter(|id| !before.contains(id)));
    next.truncate(max);
    next
}

/// The first epoch's members once the join window closed: the first `max` of `alive`, or
/// `None` when fewer than `min` are left (some left during the window: gather again).
pub fn gathered(alive: &[u64], limits: &Limits) -> Option<Vec<u64>> {
    let members: Vec<u64> = alive.iter().copied().take(limits.max).collect();
    (members.len() >= limits.min).then_some(members)
}

/// What follows an epoch of `before` that ended as `end`, with `alive` the members there now
/// (the epoch's and any waiting to join, in the order they came) and `restarts_used` restarts
/// already used.
pub fn decide(
    limits: &Limits,
    restarts_used: usize,
    before: &[u64],
    alive: &[u64],
    end: EpochEnd<'_>,
) -> Decision {
    let budget_left = restarts_used < limits.max_restarts;
    let too_few = |n: usize, what: &str| Decision::End {
        why: Some(format!(
            "{what}: {n} node(s) left, fewer than the {} the job needs",
            limits.min
        )),
    };
    match end {
        EpochEnd::Finished => Decision::Done,
        EpochEnd::Grow { in_place } => {
            let members = next_members(in_place.unwrap_or(before), alive, limits.max);
            if members.len() < limits.min {
                return too_few(members.len(), "members joined, but others left");
            }
            let recovery = match in_place {
                Some(_) => Recovery::Live,
                None => Recovery::Checkpoint,
            };
            Decision::Next(next_epoch(before, members, recovery, false))
        }
        EpochEnd::Failed { restartable } => {
            let members = next_members(before, alive, limits.max);
            if !restartable {
                return Decision::End { why: None };
            }
            if !budget_left {
                // A launch that allows no restart says nothing more than its failure.
                let why = (limits.max_restarts > 0)
                    .then(|| format!("no restart left ({restarts_used} made)"));
                return Decision::End { why };
            }
            if members.len() < limits.min {
                return too_few(members.len(), "no restart");
            }
            Decision::Next(next_epoch(before, members, Recovery::Checkpoint, true))
        }
        EpochEnd::Heal { survivors } => {
            if !budget_left {
                return Decision::End {
                    why: Some(format!(
                        "no heal: {restarts_used} restart(s) of {} made",
                        limits.max_restarts
                    )),
                };
            }
            if survivors.len() < limits.min {
                return too_few(survivors.len(), "no heal");
            }
            Decision::Next(next_epoch(before, survivors.to_vec(), Recovery::Live, true))
        }
    }
}

fn next_epoch(before: &[u64], members: Vec<u64>, recovery: Recovery, uses: bool) -> NextEpoch {
    let left = (0..before.len())
        .filter(|&i| !members.contains(&before[i]))
        .collect();
    let joined = (0..members.len())
        .filter(|&i| !before.contains(&members[i]))
        .collect();
    NextEpoch {
        members,
        left,
        joined,
        recovery,
        uses_restart: uses,
    }
}

#[cfg(test)]
mod tests;
