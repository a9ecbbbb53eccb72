//! The agent's node process of one epoch: started for its epoch, watched (its address, its
//! end, its waiting to heal), moved into the next epoch in place, or ended.

use super::AgentOptions;
use crate::elastic::launcher::{LaunchError, Place, exit_code, temp_dir};
use crate::elastic::protocol::{NodeEnd, Start, ToHost};
use crate::heal::{Answer, Assignment, Ready, answer_file, capable_file, ready_file, write_json};
use crate::job::env;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// The running node's pid, which a signal to the agent is passed on to.
pub(super) static PID: Mutex<Option<u32>> = Mutex::new(None);

/// This agent's node of one epoch.
pub(super) struct Node {
    pub(super) child: Child,
    pub(super) epoch: usize,
    /// Node 0's files (address, certificate); `None` on the others or once reported.
    report: Option<(PathBuf, PathBuf)>,
    dir: Option<PathBuf>,
    pub(super) stop_at: Option<Instant>,
    /// It lost its job and waits, alive, for its place in the next epoch (reported `Lost`).
    pub(super) healing: bool,
    /// The epoch for which whether it can go on in place was reported (`Capable`).
    capable_for: Option<usize>,
}

/// Checks on the node: node 0's address once written (`Ready`), its end (`Exited`), its
/// waiting to heal (`Lost`); kills it when a stop has taken longer than `grace`.
pub(super) fn watch(
    n: &mut Node,
    grace: Duration,
    heal_dir: &Path,
) -> Result<Option<ToHost>, LaunchError> {
    if let Some(st) = n.child.try_wait()? {
        *PID.lock().unwrap_or_else(|p| p.into_inner()) = None;
        crate::heal::forget(heal_dir, n.child.id());
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
pub(super) fn heal_in_place(
    n: &mut Node,
    s: &Start,
    ip: IpAddr,
    heal_dir: &Path,
) -> Result<(), LaunchError> {
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
pub(super) fn end_node(n: &mut Node) {
    let _ = n.child.kill();
    let _ = n.child.wait();
    *PID.lock().unwrap_or_else(|p| p.into_inner()) = None;
    if let Some(d) = n.dir.take() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Starts this agent's node of `s`: node 0 binds `ip` and writes its address and certificate
/// to files of its own; the others bind `ip` and pin node 0's certificate.
pub(super) fn start_node(
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
    crate::heal::answer_wait(grace).as_millis().to_string()
}
