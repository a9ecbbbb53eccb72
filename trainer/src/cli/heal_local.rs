//! A local elastic launch that heals: when a node process is lost (ended by a signal) and
//! the survivors hold replicas of the whole state (DDP, hybrid), they keep running, report in
//! the heal directory that they lost their job ([`wiretrain::heal::Ready`]), and the launcher
//! answers each with its place in the next epoch ([`wiretrain::heal::Answer`]): node 0 first,
//! then the others pinned to its address and certificate. No process restarts and no
//! checkpoint is read. When a survivor exits instead (a strategy that does not heal, or
//! another failure), the ones waiting are told to stop and the launch restarts from the
//! newest checkpoint as before.

use super::elastic::{Elastic, Restart, describe_restart, killed, unix_ms_at};
use super::launcher::{Ended, LaunchError};
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};
use wiretrain::heal::{Answer, Assignment, Ready, answer_file, ready_file, write_json};

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
/// ended (its nodes' statuses, in its node order).
pub(super) fn wait_healing(
    mut slots: Vec<Slot>,
    grace: Duration,
    h: &mut Healing<'_>,
) -> Result<Ended, LaunchError> {
    let mut first_failure: Option<Instant> = None;
    loop {
        poll(&mut slots, &mut first_failure)?;
        if slots.iter().all(|s| s.status.is_some()) {
            break;
        }
        let Some(t) = first_failure else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        if may_heal(&slots, h) {
            match gather_ready(&mut slots, grace, h.dir, &mut first_failure)? {
                Some(ready) => {
                    if let Err(e) = heal(&mut slots, ready, t, h) {
                        for s in slots.iter_mut().filter(|s| s.status.is_none()) {
                            let _ = s.child.kill();
                            let _ = s.child.wait();
                        }
                        return Err(e);
                    }
                    first_failure = None;
                    continue;
                }
                None => stop_waiting(&slots, h.dir, "a survivor exited: the launch restarts"),
            }
        } else {
            stop_waiting(
                &slots,
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

/// Takes in the exits; the first failure's time.
fn poll(slots: &mut [Slot], first_failure: &mut Option<Instant>) -> Result<(), LaunchError> {
    for s in slots.iter_mut().filter(|s| s.status.is_none()) {
        if let Some(st) = s.child.try_wait()? {
            s.status = Some(st);
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

/// Waits (up to `grace` from now) until every running slot reported ready; `None` when one
/// exited first (or the time ran out).
fn gather_ready(
    slots: &mut [Slot],
    grace: Duration,
    dir: &Path,
    first_failure: &mut Option<Instant>,
) -> Result<Option<Vec<Option<Ready>>>, LaunchError> {
    let t0 = Instant::now();
    let mut ready: Vec<Option<Ready>> = slots.iter().map(|_| None).collect();
    loop {
        let before = slots.iter().filter(|s| s.status.is_some()).count();
        poll(slots, first_failure)?;
        let exited = slots.iter().filter(|s| s.status.is_some()).count();
        for (i, s) in slots.iter().enumerate() {
            if s.status.is_none() && ready[i].is_none() {
                let f = ready_file(dir, s.child.id());
                if let Ok(b) = std::fs::read(&f)
                    && let Ok(r) = serde_json::from_slice::<Ready>(&b)
                {
                    let _ = std::fs::remove_file(&f);
                    ready[i] = Some(r);
                }
            }
        }
        if exited > before || t0.elapsed() > grace {
            return Ok(None);
        }
        if slots
            .iter()
            .zip(&ready)
            .all(|(s, r)| s.status.is_some() || r.is_some())
        {
            return Ok(Some(ready));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Tells every running slot that may be waiting for an answer to stop (`why`).
fn stop_waiting(slots: &[Slot], dir: &Path, why: &str) {
    for s in slots.iter().filter(|s| s.status.is_none()) {
        let pid = s.child.id();
        if ready_file(dir, pid).exists() {
            let _ = std::fs::remove_file(ready_file(dir, pid));
            let _ = write_json(&answer_file(dir, pid), &Answer::Stop(why.into()));
        }
    }
}

/// Moves the survivors into the next epoch: node 0 first (its address and certificate
/// come back through files), then the others pinned to it.
fn heal(
    slots: &mut Vec<Slot>,
    ready: Vec<Option<Ready>>,
    detected: Instant,
    h: &mut Healing<'_>,
) -> Result<(), LaunchError> {
    let world_before = slots.len();
    let left: Vec<usize> = (0..world_before)
        .filter(|&i| slots[i].status.is_some())
        .collect();
    let step = ready.iter().flatten().map(|r| r.step).max().unwrap_or(0);
    let reason = left
        .iter()
        .map(|&i| format!("node {i} exited with {}", slots[i].status.expect("exited")))
        .collect::<Vec<_>>()
        .join("; ");
    slots.retain(|s| s.status.is_none());
    let survivors = slots;
    let epoch = h.history.len() + 1;
    let r = Restart {
        epoch,
        left,
        joined: Vec::new(),
        world: survivors.len(),
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
    let restarts = serde_json::to_value(&*h.history).unwrap_or_default();
    let nnodes = survivors.len();
    let addr_file = h.dir.join(format!("master-{epoch}.addr"));
    let fp_file = h.dir.join(format!("master-{epoch}.sha256"));
    let assign = |node: usize, master: String, bind: Option<String>, sha: Option<String>| {
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
        })
    };
    let io = |e: std::io::Error| LaunchError::Io(e);
    let first = &mut survivors[0];
    write_json(
        &answer_file(h.dir, first.child.id()),
        &assign(0, format!("{}:0", first.ip), None, None),
    )
    .map_err(io)?;
    let t0 = Instant::now();
    let master = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a.trim().to_string();
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
    };
    let sha = std::fs::read_to_string(&fp_file)
        .map(|f| f.trim().to_string())
        .ok();
    for (node, s) in survivors.iter().enumerate().skip(1) {
        let a = assign(
            node,
            master.clone(),
            Some(format!("{}:0", s.ip)),
            sha.clone(),
        );
        write_json(&answer_file(h.dir, s.child.id()), &a).map_err(io)?;
    }
    Ok(())
}
