//! The launcher: starts node processes of a job, as torchrun does. [`run_local`] starts NODES
//! node processes on 127.0.0.x, so one command runs a real multi-node job (real QUIC between
//! real processes) on one machine; [`run_node`] starts this machine's one node process of a
//! job spread over machines. The program is this binary's subcommand (`train`, `bench`) or any
//! other program, which finds its job in the `WIRETRAIN_*` variables that
//! [`crate::job::JobOptions::from_env`] (and so [`crate::run`]) reads.
//!
//! Node 0 binds an ephemeral port on 127.0.0.1 and writes it to a file; the launcher then
//! starts nodes 1.. with the master pointing at it and binding 127.0.0.(i+1):0. All nodes get
//! the same fresh 256-bit job token through `WIRETRAIN_TOKEN` (unless one is already set): an
//! environment variable, never an argument, so it does not show in `ps`.
//! (macOS configures only 127.0.0.1 on its loopback interface, so there every node binds
//! 127.0.0.1 and they differ by port.)

use crate::elastic::policy::{Decision, EpochEnd, Limits, decide};
use crate::job::env;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use wiretrain_comm::tls::Token;

pub use super::restart::Elastic;
use super::restart::{Restart, describe_restart, killed, strip_switch, unix_ms_at};
use super::supervisor::{Healing, Slot, wait_healing};

mod ended;
pub(super) use ended::Ended;
use ended::{verdict, wait_all};
mod error;
pub use error::LaunchError;

/// Removes `--flag VALUE` and `--flag=VALUE` from an argument list.
pub fn strip_flag(args: &[OsString], flag: &str) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    let eq = format!("{flag}=");
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        let s = a.to_string_lossy();
        if s == flag {
            skip = true;
            continue;
        }
        if s.starts_with(&eq) {
            continue;
        }
        out.push(a.clone());
    }
    out
}

/// A fresh directory for a launch's files (node addresses, heal files): see the comment.
pub(super) fn temp_dir() -> std::io::Result<PathBuf> {
    // A fresh directory of this user's alone (0700 on Unix), never one that already exists
    // (another user could have made it to read or plant the files a launch writes there).
    for _ in 0..16 {
        let d = std::env::temp_dir().join(format!(
            "wiretrain-launch-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        match b.create(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(
        "no fresh directory could be made under the temporary directory",
    ))
}

/// The loopback address node `node` binds: its own 127.0.0.x where the whole 127/8 reaches
/// the loopback interface (Linux, Windows), so tools see one address per node.
fn node_ip(node: usize) -> String {
    // macOS answers only 127.0.0.1 unless more aliases are configured by hand.
    if cfg!(target_os = "macos") || node >= 254 {
        "127.0.0.1".into()
    } else {
        format!("127.0.0.{}", node + 1)
    }
}

/// What each node process runs.
#[derive(Debug, Clone)]
pub struct Target {
    /// The program; `None` runs this executable with `args` (a subcommand and its flags, to
    /// which the rendezvous flags are added).
    pub program: Option<PathBuf>,
    /// The arguments of every node's command.
    pub args: Vec<OsString>,
    /// Ranks each node process runs.
    pub ranks_per_node: usize,
}

impl Target {
    /// The command of one node: the program and its arguments, and the job's variables
    /// (`nnodes`, `node`, `master`; node 0 writes its address to `addr_file`, the others bind
    /// `bind`).
    pub(super) fn command(
        &self,
        exe: &std::path::Path,
        nnodes: usize,
        node: usize,
        master: &str,
        place: Place<'_>,
    ) -> Command {
        let mut c = Command::new(self.program.as_deref().unwrap_or(exe));
        // A node never outlives its launcher or agent (`kill -9` of it included).
        super::parent_death::die_with_parent(&mut c);
        c.args(&self.args)
            .env(env::NNODES, nnodes.to_string())
            .env(env::NODE_RANK, node.to_string())
            .env(env::MASTER, master)
            .env(env::RANKS_PER_NODE, self.ranks_per_node.to_string());
        match place {
            Place::AddrFile(f) => c.env(env::ADDR_FILE, f),
            Place::Bind(b) => c.env(env::BIND, b),
            Place::Given => &mut c,
        };
        if !matches!(place, Place::Given) {
            // Every node of a local job shares this host's cores.
            c.env(env::HOST_NODES, nnodes.to_string());
        }
        if self.program.is_none() {
            // This binary's subcommands take the same settings as flags, which tools (and
            // tests) can read from the command line.
            c.arg("--nnodes")
                .arg(nnodes.to_string())
                .arg("--node-rank")
                .arg(node.to_string())
                .arg("--master")
                .arg(master)
                .arg("--ranks-per-node")
                .arg(self.ranks_per_node.to_string());
            match place {
                Place::AddrFile(f) => c.arg("--addr-file").arg(f),
                Place::Bind(b) => c.arg("--bind").arg(b),
                Place::Given => &mut c,
            };
        }
        c
    }
}

impl Target {
    /// The target of epoch `epoch` of an elastic launch: from epoch 1 on, with `resume`,
    /// `train` resumes from the newest checkpoint (and no longer overwrites checkpoints).
    pub(super) fn for_epoch(&self, epoch: usize, resume: bool) -> Target {
        let mut t = self.clone();
        if epoch > 0 && resume && !t.args.iter().any(|a| a == "--resume") {
            t.args = strip_switch(&t.args, "--overwrite-checkpoints");
            t.args.push("--resume".into());
        }
        t
    }
}

/// Where a node listens.
#[derive(Clone, Copy)]
pub(super) enum Place<'a> {
    /// Node 0 of a local job: bind the master address, write the port here.
    AddrFile(&'a std::path::Path),
    /// Another node of a local job.
    Bind(&'a str),
    /// As the job's settings say (real machines).
    Given,
}

/// The exit code that stands for a status: its code, or 128 + the signal that ended it.
pub fn exit_code(st: ExitStatus) -> i32 {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = st.signal() {
            return 128 + sig;
        }
    }
    st.code().unwrap_or(1)
}

/// The job token: the caller's WIRETRAIN_TOKEN, else a fresh 256-bit one.
fn job_token() -> String {
    std::env::var(env::TOKEN)
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| String::from_utf8_lossy(Token::generate().expose()).into_owned())
}

/// Starts this machine's node of a job over several machines (`nnodes`, `node`, `master`
/// as the other nodes are told; `None` leaves them to the program's own environment, e.g.
/// Slurm's) and waits for it; signals are passed on. Returns its exit status.
pub fn run_node(
    target: &Target,
    job: Option<(usize, usize, String)>,
) -> Result<ExitStatus, LaunchError> {
    static PID: Mutex<Option<u32>> = Mutex::new(None);
    let forward = || {
        if let Some(pid) = *PID.lock().unwrap_or_else(|p| p.into_inner()) {
            crate::signal::terminate(pid);
        }
    };
    let _stop = crate::signal::install(Some(Box::new(forward))).map_err(LaunchError::Signal)?;
    let exe = std::env::current_exe()?;
    let mut c = match &job {
        Some((nnodes, node, master)) => target.command(&exe, *nnodes, *node, master, Place::Given),
        None => {
            let mut c = Command::new(target.program.as_deref().unwrap_or(&exe));
            super::parent_death::die_with_parent(&mut c);
            c.args(&target.args)
                .env(env::RANKS_PER_NODE, target.ranks_per_node.to_string());
            if target.program.is_none() {
                c.arg("--ranks-per-node")
                    .arg(target.ranks_per_node.to_string());
            }
            c
        }
    };
    let mut child = c
        .spawn()
        .map_err(|source| LaunchError::Spawn { node: 0, source })?;
    *PID.lock().unwrap_or_else(|p| p.into_inner()) = Some(child.id());
    let st = child.wait()?;
    *PID.lock().unwrap_or_else(|p| p.into_inner()) = None;
    Ok(st)
}

/// The node processes of the running local launch, whose pids Ctrl-C (or SIGTERM) is passed
/// on to.
static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// A node process of the running local launch that is gone (lost and healed around): its pid,
/// which the system may give to another process, no longer gets the launch's signals.
pub(super) fn forget_pid(pid: u32) {
    PIDS.lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|&p| p != pid);
}

/// Runs `nodes` node processes of `target` on this machine, each with its rendezvous settings,
/// and waits for all of them. When a node fails, the others get `grace` to notice and exit on
/// their own before they are killed. Ctrl-C (or SIGTERM) is passed on to every node, which
/// stop cleanly after their current step.
///
/// Elastic (`elastic.max_restarts` > 0): when an epoch fails, the nodes that were killed by a
/// signal (not by this launcher after the grace period) are lost, and the others start again as a job of their own count, under the next
/// epoch, as long as `elastic.min` remain and restarts are left; a usage error (exit 2) never
/// restarts. When the restarts run out, the error lists every restart.
pub fn run_local(
    nodes: usize,
    target: &Target,
    grace: Duration,
    elastic: Elastic,
) -> Result<(), LaunchError> {
    let forward = || {
        for &pid in PIDS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            crate::signal::terminate(pid);
        }
    };
    let stop = crate::signal::install(Some(Box::new(forward))).map_err(LaunchError::Signal)?;
    let mut history: Vec<Restart> = Vec::new();
    let mut world = nodes;
    // Where the nodes of an elastic launch ask for their place after losing a peer (heals
    // from live replicas, see heal_local); kept across the launch's epochs.
    let heal_dir = match elastic.max_restarts {
        0 => None,
        _ => Some(temp_dir()?),
    };
    let res = loop {
        let epoch = history.len();
        let target = target.for_epoch(epoch, elastic.resume_flag);
        let restarts = serde_json::to_string(&history).unwrap_or_else(|_| "[]".into());
        let mut launch = LocalLaunch::new(world, &target, epoch, restarts)?;
        let wait = crate::heal::answer_wait(grace);
        launch.heal_dir = heal_dir.clone().map(|d| (d, wait));
        let outcome = launch.run(grace, elastic, &mut history);
        PIDS.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let _ = std::fs::remove_dir_all(&launch.dir);
        if stop.load(Ordering::SeqCst) {
            break Err(LaunchError::Interrupted);
        }
        match outcome {
            Ok(ended) => match next_epoch(ended, &mut history, elastic) {
                Ok(Some(w)) => world = w,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            },
            Err(e) => break Err(e),
        }
    };
    if let Some(d) = heal_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    res
}

/// After an epoch of a local launch ended: `None` when the launch is done, else the world of
/// the restart (from the newest checkpoint) that follows; an error when it may not restart.
fn next_epoch(
    ended: Ended,
    history: &mut Vec<Restart>,
    elastic: Elastic,
) -> Result<Option<usize>, LaunchError> {
    let world = ended.status.len();
    let epoch = history.len();
    let Ended { status, detected } = ended;
    let res = verdict(&status);
    let Err(LaunchError::Failed { failures, code }) = res else {
        return res.map(|()| None);
    };
    // The nodes killed by a signal are lost; the others go on as a job of their own count,
    // as the library's elastic policy decides.
    let before: Vec<u64> = (0..world as u64).collect();
    let alive: Vec<u64> = before
        .iter()
        .copied()
        .filter(|&i| !status[i as usize].is_some_and(killed))
        .collect();
    let usage = status.iter().flatten().any(|s| s.code() == Some(2));
    let limits = Limits {
        min: elastic.min.max(1),
        max: world,
        max_restarts: elastic.max_restarts,
    };
    let end = EpochEnd::Failed {
        restartable: !usage,
    };
    let next = match decide(&limits, history.len(), &before, &alive, end) {
        Decision::Next(next) => next,
        Decision::Done => return Ok(None),
        Decision::End { why } => {
            let mut failures = failures;
            failures.extend(why);
            if !history.is_empty() {
                let h: Vec<String> = history.iter().map(describe_restart).collect();
                failures.push(format!(
                    "after {} restart(s): {}",
                    history.len(),
                    h.join("; ")
                ));
            }
            return Err(LaunchError::Failed { failures, code });
        }
    };
    let (lost, left) = (next.left, next.members.len());
    let r = Restart {
        epoch: epoch + 1,
        left: lost,
        joined: Vec::new(),
        world: left,
        reason: failures.join("; "),
        recovery: "checkpoint",
        detected_unix_ms: detected.map_or(0, unix_ms_at),
        restarted_unix_ms: unix_ms_at(Instant::now()),
    };
    eprintln!(
        "wiretrain launch: elastic restart {} of {}: {}",
        history.len() + 1,
        elastic.max_restarts,
        describe_restart(&r)
    );
    history.push(r);
    Ok(Some(left))
}

/// What every node process of one local launch is started with, and the files through which
/// node 0 reports its address and certificate (in a directory of the launch's own).
struct LocalLaunch<'a> {
    nodes: usize,
    target: &'a Target,
    epoch: usize,
    restarts: String,
    exe: PathBuf,
    dir: PathBuf,
    addr_file: PathBuf,
    fingerprint_file: PathBuf,
    token: String,
    job_id: String,
    /// Set: the nodes heal from live replicas where they can (an elastic launch), waiting
    /// this long for the launcher's answer.
    heal_dir: Option<(PathBuf, Duration)>,
}

impl<'a> LocalLaunch<'a> {
    fn new(
        nodes: usize,
        target: &'a Target,
        epoch: usize,
        restarts: String,
    ) -> Result<Self, LaunchError> {
        let exe = std::env::current_exe()?;
        let dir = temp_dir()?;
        let token = job_token();
        // This launch's nonce (mixed into the job CA): the caller's, else a fresh one.
        let job_id = std::env::var(env::JOB_ID)
            .ok()
            .filter(|j| !j.is_empty())
            .unwrap_or_else(|| format!("local-{:016x}", rand::random::<u64>()));
        Ok(Self {
            nodes,
            target,
            epoch,
            restarts,
            exe,
            addr_file: dir.join("master.addr"),
            fingerprint_file: dir.join("master.sha256"),
            dir,
            token,
            job_id,
            heal_dir: None,
        })
    }

    /// Starts node `node`, pointed at `master` (and, on nodes 1.., pinning node 0's
    /// certificate `fingerprint` when known).
    fn spawn(
        &self,
        node: usize,
        master: &str,
        fingerprint: Option<&str>,
    ) -> Result<Child, LaunchError> {
        let bind = format!("{}:0", node_ip(node));
        let place = if node == 0 {
            Place::AddrFile(&self.addr_file)
        } else {
            Place::Bind(&bind)
        };
        let mut c = self
            .target
            .command(&self.exe, self.nodes, node, master, place);
        c.env(env::TOKEN, &self.token)
            .env(env::JOB_ID, &self.job_id)
            .env(env::EPOCH, self.epoch.to_string())
            .env(env::RESTARTS, &self.restarts);
        if let Some((d, wait)) = &self.heal_dir {
            c.env(env::HEAL_DIR, d)
                .env(env::HEAL_WAIT_MS, wait.as_millis().to_string());
        }
        // Node 0 says which certificate it holds; the others pin exactly that one.
        if node == 0 {
            c.env(env::FINGERPRINT_FILE, &self.fingerprint_file);
        } else if let Some(f) = fingerprint {
            c.env(env::MASTER_SHA256, f);
        }
        let child = c
            .spawn()
            .map_err(|source| LaunchError::Spawn { node, source })?;
        PIDS.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(child.id());
        Ok(child)
    }

    /// Starts every node and waits for them all (healing lost nodes where it may: heals
    /// join `history`).
    fn run(
        &self,
        grace: Duration,
        elastic: Elastic,
        history: &mut Vec<Restart>,
    ) -> Result<Ended, LaunchError> {
        let mut children = vec![self.spawn(0, "127.0.0.1:0", None)?];
        let master = self.wait_for_master(&mut children[0])?;
        self.spawn_others(&mut children, &master)?;
        let Some((dir, _)) = &self.heal_dir else {
            return wait_all(children, grace);
        };
        let slots = children
            .into_iter()
            .enumerate()
            .map(|(i, child)| Slot {
                child,
                ip: node_ip(i),
                status: None,
            })
            .collect();
        let mut h = Healing {
            dir,
            elastic,
            history,
            epoch: self.epoch,
        };
        wait_healing(slots, grace, &mut h)
    }

    /// Node 0's address, once it has written it; fails (removing the launch's directory) when
    /// node 0 exits first or takes longer than 30 s, killing it then.
    fn wait_for_master(&self, node0: &mut Child) -> Result<String, LaunchError> {
        let limit = Duration::from_secs(30);
        let t0 = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(&self.addr_file) {
                return Ok(s.trim().to_string());
            }
            if let Some(st) = node0.try_wait()? {
                let _ = std::fs::remove_dir_all(&self.dir);
                return Err(LaunchError::EarlyExit(st));
            }
            if t0.elapsed() > limit {
                let _ = node0.kill();
                let _ = std::fs::remove_dir_all(&self.dir);
                return Err(LaunchError::NoAddress(limit));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts nodes 1.. against `master`; when one cannot start, kills those already running
    /// and removes the launch's directory.
    fn spawn_others(&self, children: &mut Vec<Child>, master: &str) -> Result<(), LaunchError> {
        // Node 0 writes its fingerprint before its address.
        let fingerprint = std::fs::read_to_string(&self.fingerprint_file)
            .map(|f| f.trim().to_string())
            .ok();
        for node in 1..self.nodes {
            match self.spawn(node, master, fingerprint.as_deref()) {
                Ok(c) => children.push(c),
                Err(e) => {
                    for c in children.iter_mut() {
                        let _ = c.kill();
                    }
                    let _ = std::fs::remove_dir_all(&self.dir);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_flags_in_both_forms() {
        let a: Vec<OsString> = [
            "bench",
            "--local",
            "2",
            "--op",
            "p2p",
            "--local=3",
            "--json",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let s = strip_flag(&a, "--local");
        assert_eq!(s, ["bench", "--op", "p2p", "--json"].map(OsString::from));
    }

    /// The launch's directories are this user's alone and never reused (issue 42, item 7).
    #[cfg(unix)]
    #[test]
    fn a_launch_directory_is_fresh_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let (a, b) = (temp_dir().unwrap(), temp_dir().unwrap());
        assert_ne!(a, b);
        for d in [&a, &b] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
            std::fs::remove_dir(d).unwrap();
        }
    }
}
