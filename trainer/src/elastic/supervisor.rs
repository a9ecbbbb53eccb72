//! A local elastic launch that heals: when a node process is lost (ended by a signal) and
//! the survivors hold replicas of the whole state (DDP, hybrid), they keep running, report in
//! the heal directory that they lost their job ([`crate::heal::Ready`]), and the launcher
//! answers each with its place in the next epoch ([`crate::heal::Answer`]): node 0 first,
//! then the others pinned to its address and certificate. No process restarts and no
//! checkpoint is read. When a survivor exits instead (a strategy that does not heal, or
//! another failure), the ones waiting are told to stop and the launch restarts from the
//! newest checkpoint as before.

use super::launcher::{Ended, LaunchError};
use super::restart::{Elastic, Restart, describe_restart, killed, unix_ms_at};
use crate::heal::{Answer, Assignment, Ready, answer_file, forget, ready_file, write_json};
use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// A node process of the launch: its child, the loopback address it binds, its exit.
pub(super) struct Slot {
    pub child: Child,
    pub ip: String,
    pub status: Option<ExitStatus>,
}

/// What a launch that heals needs: its directory, its limits and the restarts so far (heals
/// count as restarts against `--max-restarts`).
pub(super) struct Healing<'a> {
    pub dir: &'a Path,
    pub elastic: Elastic,
    pub history: &'a mut Vec<Restart>,
    /// The epoch the slots run (they are numbered in order within it).
    pub epoch: usize,
}

/// Waits for the slots' epoch, healing lost nodes while it may; returns how the last epoch
/// ended (its nodes' statuses, in its node order). A heal that cannot be completed (node 0 of
/// the new epoch exits, or never listens) ends the epoch as failed, so the launch restarts
/// from the checkpoint if restarts remain.
pub(super) fn wait_healing(
    mut slots: Vec<Slot>,
    grace: Duration,
    h: &mut Healing<'_>,
) -> Result<Ended, LaunchError> {
    let mut first_failure: Option<Instant> = None;
    // The nodes that reported they wait to heal (their files are consumed): pid -> report.
    let mut ready: HashMap<u32, Ready> = HashMap::new();
    // When the first node lost its job while no node was lost.
    let mut unlost: Option<Instant> = None;
    loop {
        poll(&mut slots, h.dir, &mut first_failure)?;
        if slots.iter().all(|s| s.status.is_some()) {
            break;
        }
        take_ready(&slots, h.dir, &mut ready);
        let Some(t) = first_failure else {
            // Nodes lost their job while no node was lost (a cut link): when every node
            // reports it within the grace period, all of them heal in place together.
            if !ready.is_empty() && may_heal(&slots, h) {
                let since = *unlost.get_or_insert_with(Instant::now);
                if ready.len() == slots.iter().filter(|s| s.status.is_none()).count() {
                    unlost = None;
                    if let Err(e) = heal(&mut slots, &mut ready, since, h) {
                        heal_failed(&mut slots, &mut ready, h.dir, &e);
                        break;
                    }
                    continue;
                }
                if since.elapsed() <= grace {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
            // Not every node lost its job in time: those that did fail, and the launch
            // restarts.
            unlost = None;
            stop_waiting(&mut ready, h.dir, "no node of this launch was lost");
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        if may_heal(&slots, h) {
            if gather_ready(&mut slots, grace, h.dir, &mut first_failure, &mut ready)? {
                match heal(&mut slots, &mut ready, t, h) {
                    Ok(()) => {
                        first_failure = None;
                        continue;
                    }
                    Err(e) => {
                        heal_failed(&mut slots, &mut ready, h.dir, &e);
                        break;
                    }
                }
            }
            stop_waiting(&mut ready, h.dir, "a survivor exited: the launch restarts");
        } else {
            stop_waiting(
                &mut ready,
                h.dir,
                "this failure is not healed: the launch restarts",
            );
        }
        if t.elapsed() > grace {
            for s in slots.iter_mut().filter(|s| s.status.is_none()) {
                let _ = s.child.kill();
                let _ = s.child.wait();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Ended {
        status: slots.iter().map(|s| s.status).collect(),
        detected: first_failure,
    })
}

/// A heal the launcher could not complete: the waiting nodes are told to stop and every
/// running node is ended (the launch restarts from the checkpoint).
fn heal_failed(slots: &mut [Slot], ready: &mut HashMap<u32, Ready>, dir: &Path, e: &LaunchError) {
    eprintln!("wiretrain launch: the heal failed ({e}); the launch restarts");
    stop_waiting(ready, dir, "the heal failed");
    for s in slots.iter_mut().filter(|s| s.status.is_none()) {
        let _ = s.child.kill();
        let _ = s.child.wait();
    }
}

/// Reads (and removes) the ready files of the running slots into `ready`.
fn take_ready(slots: &[Slot], dir: &Path, ready: &mut HashMap<u32, Ready>) {
    for s in slots.iter().filter(|s| s.status.is_none()) {
        let pid = s.child.id();
        if ready.contains_key(&pid) {
            continue;
        }
        let f = ready_file(dir, pid);
        if std::fs::metadata(&f).is_ok_and(|m| m.len() <= 1 << 16)
            && let Ok(b) = std::fs::read(&f)
            && let Ok(r) = serde_json::from_slice::<Ready>(&b)
        {
            let _ = std::fs::remove_file(&f);
            ready.insert(pid, r);
        }
    }
}

/// Takes in the exits (forgetting the heal files of the processes gone); the first
/// failure's time.
fn poll(
    slots: &mut [Slot],
    dir: &Path,
    first_failure: &mut Option<Instant>,
) -> Result<(), LaunchError> {
    for s in slots.iter_mut().filter(|s| s.status.is_none()) {
        if let Some(st) = s.child.try_wait()? {
            s.status = Some(st);
            forget(dir, s.child.id());
            if !st.success() && first_failure.is_none() {
                *first_failure = Some(Instant::now());
            }
        }
    }
    Ok(())
}

/// Whether the failure may be healed: every failed node was lost (ended by a signal),
/// restarts are left and at least MIN nodes remain.
fn may_heal(slots: &[Slot], h: &Healing<'_>) -> bool {
    let failed: Vec<ExitStatus> = slots.iter().filter_map(|s| s.status).collect();
    let lost = failed.iter().all(|&st| killed(st));
    let left = slots.iter().filter(|s| s.status.is_none()).count();
    lost && h.history.len() < h.elastic.max_restarts && left >= h.elastic.min.max(1)
}

/// Waits (up to `grace` from now) until every running slot reported ready: `false` when one
/// exited first (or the time ran out).
fn gather_ready(
    slots: &mut [Slot],
    grace: Duration,
    dir: &Path,
    first_failure: &mut Option<Instant>,
    ready: &mut HashMap<u32, Ready>,
) -> Result<bool, LaunchError> {
    let t0 = Instant::now();
    loop {
        let before = slots.iter().filter(|s| s.status.is_some()).count();
        poll(slots, dir, first_failure)?;
        let exited = slots.iter().filter(|s| s.status.is_some()).count();
        take_ready(slots, dir, ready);
        if exited > before || t0.elapsed() > grace {
            return Ok(false);
        }
        if slots
            .iter()
            .all(|s| s.status.is_some() || ready.contains_key(&s.child.id()))
        {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Tells every node that reported it waits to heal to stop (`why`).
fn stop_waiting(ready: &mut HashMap<u32, Ready>, dir: &Path, why: &str) {
    for (pid, _) in ready.drain() {
        let _ = write_json(&answer_file(dir, pid), &Answer::Stop(why.into()));
    }
}

/// Moves the survivors into the next epoch: node 0 first (its address and certificate
/// come back through files), then the others pinned to it.
fn heal(
    slots: &mut Vec<Slot>,
    ready: &mut HashMap<u32, Ready>,
    detected: Instant,
    h: &mut Healing<'_>,
) -> Result<(), LaunchError> {
    let res = assign(slots, ready, detected, h);
    match &res {
        Ok(()) => {
            // The lost nodes are gone from the launch (and from the signal's forwarding).
            for s in slots.iter().filter(|s| s.status.is_some()) {
                super::launcher::forget_pid(s.child.id());
            }
            slots.retain(|s| s.status.is_none());
            ready.clear();
        }
        // The heal never took effect: it is not one of the restarts.
        Err(_) => {
            h.history.pop();
        }
    }
    res
}

/// Records the heal (one restart of the launch, "live") and returns its epoch.
fn record_heal(
    slots: &[Slot],
    ready: &HashMap<u32, Ready>,
    detected: Instant,
    h: &mut Healing<'_>,
) -> usize {
    let left: Vec<usize> = (0..slots.len())
        .filter(|&i| slots[i].status.is_some())
        .collect();
    let step = ready.values().map(|r| r.step).max().unwrap_or(0);
    let reason = if left.is_empty() {
        "every node lost its job and none was lost: a link failed".to_string()
    } else {
        left.iter()
            .map(|&i| format!("node {i} exited with {}", slots[i].status.expect("exited")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let epoch = h.history.len() + 1;
    let r = Restart {
        epoch,
        world: slots.len() - left.len(),
        left,
        joined: Vec::new(),
        reason,
        recovery: "live",
        detected_unix_ms: unix_ms_at(detected),
        restarted_unix_ms: unix_ms_at(Instant::now()),
    };
    eprintln!(
        "wiretrain launch: elastic heal {} of {} (from live replicas at step {step}): {}",
        h.history.len() + 1,
        h.elastic.max_restarts,
        describe_restart(&r)
    );
    h.history.push(r);
    h.epoch = epoch;
    epoch
}

/// The heal's record and the survivors' answers (node 0's first).
fn assign(
    slots: &mut [Slot],
    ready: &HashMap<u32, Ready>,
    detected: Instant,
    h: &mut Healing<'_>,
) -> Result<(), LaunchError> {
    let epoch = record_heal(slots, ready, detected, h);
    let mut survivors: Vec<&mut Slot> = slots.iter_mut().filter(|s| s.status.is_none()).collect();
    let restarts = serde_json::to_value(&*h.history).unwrap_or_default();
    let nnodes = survivors.len();
    let addr_file = h.dir.join(format!("master-{epoch}.addr"));
    let fp_file = h.dir.join(format!("master-{epoch}.sha256"));
    let answer = |node: usize, master: String, bind: Option<String>, sha: Option<String>| {
        Answer::Assign(Assignment {
            epoch: epoch as u64,
            nnodes,
            node_rank: node,
            master,
            bind: bind.and_then(|b| b.parse().ok()),
            addr_file: (node == 0).then(|| addr_file.clone()),
            fingerprint_file: (node == 0).then(|| fp_file.clone()),
            master_sha256: sha,
            restarts: restarts.clone(),
            joined: Vec::new(),
        })
    };
    let io = |e: std::io::Error| LaunchError::Io(e);
    let first = &mut survivors[0];
    write_json(
        &answer_file(h.dir, first.child.id()),
        &answer(0, format!("{}:0", first.ip), None, None),
    )
    .map_err(io)?;
    let master = await_address(first, &addr_file, epoch)?;
    let sha = std::fs::read_to_string(&fp_file)
        .map(|f| f.trim().to_string())
        .ok();
    for (node, s) in survivors.iter().enumerate().skip(1) {
        let a = answer(
            node,
            master.clone(),
            Some(format!("{}:0", s.ip)),
            sha.clone(),
        );
        write_json(&answer_file(h.dir, s.child.id()), &a).map_err(io)?;
    }
    Ok(())
}

/// Waits for the new node 0 to write its address (30 s at most); a node 0 that exits first
/// fails the heal.
fn await_address(first: &mut Slot, addr_file: &Path, epoch: usize) -> Result<String, LaunchError> {
    let t0 = Instant::now();
    loop {
        if let Ok(a) = std::fs::read_to_string(addr_file) {
            return Ok(a.trim().to_string());
        }
        if let Some(st) = first.child.try_wait()? {
            first.status = Some(st);
            return Err(LaunchError::Failed {
                failures: vec![format!(
                    "node 0 of epoch {epoch} exited before it listened ({st})"
                )],
                code: super::launcher::exit_code(st),
            });
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(LaunchError::NoAddress(Duration::from_secs(30)));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
