//! How a node finds its job: node count, node rank, the coordinator, ranks and devices per
//! node, the token, timeouts and transport tuning. [`JobOptions::from_env`] reads what
//! `wiretrain launch` sets (`WIRETRAIN_*`), and [`JobOptions::node_config`] falls back to
//! torchrun's (`MASTER_ADDR`, `NNODES`, `NODE_RANK`, ...) and Slurm's variables. The
//! `wiretrain` binary's node flags fill the same struct, so every program resolves a job one way.

use crate::device::DeviceSpec;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use wiretrain_comm::NodeConfig;
use wiretrain_comm::config::{EnvRendezvous, resolve};
use wiretrain_comm::tls::Token;

/// The variables `wiretrain launch` sets for the programs it starts (and `run` reads).
pub mod env {
    /// Node processes in the job ([`JobOptions::nnodes`](super::JobOptions::nnodes)).
    pub const NNODES: &str = "WIRETRAIN_NNODES";
    /// This node's rank; 0 hosts the coordinator.
    pub const NODE_RANK: &str = "WIRETRAIN_NODE_RANK";
    /// The coordinator's address, `host:port`.
    pub const MASTER: &str = "WIRETRAIN_MASTER";
    /// The local socket address to bind.
    pub const BIND: &str = "WIRETRAIN_BIND";
    /// Ranks on this node.
    pub const RANKS_PER_NODE: &str = "WIRETRAIN_RANKS_PER_NODE";
    /// Device specs, comma-separated: one for every local rank or one per local rank.
    pub const DEVICE: &str = "WIRETRAIN_DEVICE";
    /// `1`, `true` or `yes`: several local ranks may share one GPU adapter.
    pub const SHARE_DEVICE: &str = "WIRETRAIN_SHARE_DEVICE";
    /// File node 0 writes its bound address to (local launchers).
    pub const ADDR_FILE: &str = "WIRETRAIN_ADDR_FILE";
    /// The job's shared secret itself.
    pub const TOKEN: &str = "WIRETRAIN_TOKEN";
    /// A file holding the job's shared secret.
    pub const TOKEN_FILE: &str = "WIRETRAIN_TOKEN_FILE";
    /// A nonce of the job, the same on every node (`launch --local` makes one up; else
    /// Slurm's `SLURM_JOB_ID` or torchrun's `TORCHELASTIC_RUN_ID` is used).
    pub const JOB_ID: &str = "WIRETRAIN_JOB_ID";
    /// Node 0 writes its node certificate's SHA-256 here (set by `launch` for node 0).
    pub const FINGERPRINT_FILE: &str = "WIRETRAIN_FINGERPRINT_FILE";
    /// The coordinator's certificate SHA-256: joiners pin it (set by `launch` for the others).
    pub const MASTER_SHA256: &str = "WIRETRAIN_MASTER_SHA256";
    /// The job epoch: 0, then one more at each restart of an elastic launch.
    pub const EPOCH: &str = "WIRETRAIN_EPOCH";
    /// An elastic launch's restarts so far, as a JSON array (see `launch --max-restarts`).
    pub const RESTARTS: &str = "WIRETRAIN_RESTARTS";
    /// An elastic launch's heal directory: a node whose peer is lost asks its launcher there
    /// for its place in the next epoch and goes on from its live state ([`crate::heal`]).
    pub const HEAL_DIR: &str = "WIRETRAIN_HEAL_DIR";
    /// How long, in milliseconds, a node that lost its job waits for its launcher's answer
    /// in the heal directory (set by `launch` from its `--grace`; default 60 s).
    pub const HEAL_WAIT_MS: &str = "WIRETRAIN_HEAL_WAIT_MS";
    /// Set (to 1) for a node that joins a running job in a growth in place: it receives the
    /// state from the nodes already there instead of resuming from a checkpoint.
    pub const HEAL_JOIN: &str = "WIRETRAIN_HEAL_JOIN";
    /// How many node processes a local launch runs on this host (set by `launch --local` and
    /// `bench --local`): each node's network threads default to its share of the cores.
    pub const HOST_NODES: &str = "WIRETRAIN_HOST_NODES";
}

/// The network threads of a node whose `--net-threads` is not given: 2, or the host's cores
/// shared among the node processes of a local launch ([`env::HOST_NODES`]), at least 1. Node
/// processes on one host that each run two network threads on a machine with fewer cores
/// than threads lose more to switching between them than the second thread brings.
pub fn default_net_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let host_nodes = std::env::var(env::HOST_NODES)
        .ok()
        .and_then(|v| v.parse().ok());
    net_threads_for(cores, host_nodes)
}

/// [`default_net_threads`] for `cores` cores shared by `host_nodes` node processes.
fn net_threads_for(cores: usize, host_nodes: Option<usize>) -> usize {
    match host_nodes {
        Some(n) if n > 0 => (cores / n).clamp(1, 2),
        _ => 2,
    }
}

/// Where this process stands in an elastic launch (`wiretrain launch --max-restarts`): the
/// job epoch (0 before any restart) and the restarts so far, as the launcher recorded them
/// (a JSON array; each entry names the epoch it began, the nodes that left, the new world
/// and when the failure was detected, in ms since the Unix epoch).
#[derive(Debug, Clone, PartialEq)]
pub struct Elastic {
    /// The job epoch: 0, then one more at each restart.
    pub epoch: u64,
    /// The launcher's record of the restarts so far (a JSON array).
    pub restarts: serde_json::Value,
}

impl Elastic {
    /// From `WIRETRAIN_EPOCH` and `WIRETRAIN_RESTARTS`; `None` outside an elastic restart
    /// (epoch 0 or unset). A program that resumes on its own reads this to know it must.
    pub fn from_env() -> Result<Option<Self>, JobError> {
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let epoch: u64 = match get(env::EPOCH) {
            Some(v) => parse(env::EPOCH, &v)?,
            None => return Ok(None),
        };
        if epoch == 0 {
            return Ok(None);
        }
        let restarts = match get(env::RESTARTS) {
            Some(v) => serde_json::from_str(&v)
                .map_err(|e| JobError(format!("{}: not a JSON array: {e}", env::RESTARTS)))?,
            None => serde_json::json!([]),
        };
        Ok(Some(Self { epoch, restarts }))
    }
}

/// A job setting that cannot be used; the message names the setting and how to fix it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct JobError(pub String);

/// Everything a node needs to join its job. Unset fields take the defaults shown.
#[derive(Debug, Clone)]
pub struct JobOptions {
    /// Node processes in the job (default: torchrun/Slurm environment, else 1).
    pub nnodes: Option<usize>,
    /// This node's rank; 0 hosts the coordinator.
    pub node_rank: Option<usize>,
    /// Coordinator address host:port.
    pub master: Option<String>,
    /// Local address to bind.
    pub bind: Option<SocketAddr>,
    /// Ranks (threads, one device each) on this node (default 1).
    pub ranks_per_node: Option<usize>,
    /// Device spec(s): one for every local rank or one per local rank (default `auto`).
    pub devices: Vec<DeviceSpec>,
    /// Allow several ranks of a node on one GPU adapter.
    pub share_device: bool,
    /// File holding the job token (else WIRETRAIN_TOKEN; single-node jobs make one up).
    pub token_file: Option<PathBuf>,
    /// How long to wait for every node at rendezvous (default 60 s).
    pub rendezvous_timeout: Duration,
    /// How long any one collective may take before it fails (default 120 s).
    pub collective_timeout: Duration,
    /// Seconds of silence after which a peer node is declared dead.
    pub idle_timeout: Duration,
    /// Upper bound of QUIC path-MTU discovery, in bytes of UDP payload (default: the
    /// transport's).
    pub mtu: Option<u16>,
    /// Payload bytes per data frame, the pipelining unit (default: the transport's).
    pub frame_bytes: Option<usize>,
    /// Threads of the node's network runtime (default: [`default_net_threads`]).
    pub net_threads: Option<usize>,
    /// QUIC connections per lane and peer node (every node the same).
    pub channels: usize,
    /// cubic, bbr or newreno.
    pub congestion: String,
    /// Node 0 writes its bound address here (local launchers).
    pub addr_file: Option<PathBuf>,
    /// Node 0 writes its certificate's SHA-256 here (local launchers).
    pub fingerprint_file: Option<PathBuf>,
    /// The coordinator's certificate SHA-256, pinned by joiners when given.
    pub master_sha256: Option<String>,
    /// Announce this protocol version at rendezvous instead of the real one (tests of the
    /// version check only).
    pub protocol_version_override: Option<u32>,
    /// The job epoch (default: WIRETRAIN_EPOCH, else 0): nodes of other epochs are refused.
    pub epoch: Option<u64>,
    /// Where this node asks its elastic launcher for the next epoch after losing a peer
    /// (default: WIRETRAIN_HEAL_DIR; unset: a lost peer fails the node).
    pub heal_dir: Option<PathBuf>,
    /// How long a node that lost its job waits for its launcher's answer (default:
    /// WIRETRAIN_HEAL_WAIT_MS, else 60 s).
    pub heal_wait: Option<std::time::Duration>,
}

impl Default for JobOptions {
    fn default() -> Self {
        Self {
            nnodes: None,
            node_rank: None,
            master: None,
            bind: None,
            ranks_per_node: None,
            devices: vec![DeviceSpec::Auto],
            share_device: false,
            token_file: None,
            rendezvous_timeout: Duration::from_secs(60),
            collective_timeout: Duration::from_secs(120),
            idle_timeout: Duration::from_secs(10),
            mtu: None,
            frame_bytes: None,
            net_threads: None,
            channels: 1,
            congestion: "cubic".into(),
            addr_file: None,
            fingerprint_file: None,
            master_sha256: None,
            protocol_version_override: None,
            epoch: None,
            heal_dir: None,
            heal_wait: None,
        }
    }
}

fn parse<T: std::str::FromStr>(var: &str, v: &str) -> Result<T, JobError>
where
    T::Err: std::fmt::Display,
{
    v.trim()
        .parse()
        .map_err(|e| JobError(format!("{var}={v:?}: {e}")))
}

impl JobOptions {
    /// The defaults, overridden by the `WIRETRAIN_*` variables that are set.
    pub fn from_env() -> Result<Self, JobError> {
        Self::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// [`Self::from_env`] over any variable source (tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, JobError> {
        let mut o = Self::default();
        if let Some(v) = get(env::NNODES) {
            o.nnodes = Some(parse(env::NNODES, &v)?);
        }
        if let Some(v) = get(env::NODE_RANK) {
            o.node_rank = Some(parse(env::NODE_RANK, &v)?);
        }
        o.master = get(env::MASTER);
        if let Some(v) = get(env::BIND) {
            o.bind = Some(parse(env::BIND, &v)?);
        }
        if let Some(v) = get(env::RANKS_PER_NODE) {
            o.ranks_per_node = Some(parse(env::RANKS_PER_NODE, &v)?);
        }
        if let Some(v) = get(env::DEVICE) {
            o.devices = crate::device::parse_specs(&v)
                .map_err(|e| JobError(format!("{}: {e}", env::DEVICE)))?;
        }
        if let Some(v) = get(env::SHARE_DEVICE) {
            o.share_device = matches!(v.trim(), "1" | "true" | "yes");
        }
        o.addr_file = get(env::ADDR_FILE).map(PathBuf::from);
        o.fingerprint_file = get(env::FINGERPRINT_FILE).map(PathBuf::from);
        o.master_sha256 = get(env::MASTER_SHA256);
        o.token_file = get(env::TOKEN_FILE).map(PathBuf::from);
        if let Some(v) = get(env::EPOCH) {
            o.epoch = Some(parse(env::EPOCH, &v)?);
        }
        o.heal_dir = get(env::HEAL_DIR).map(PathBuf::from);
        if let Some(v) = get(env::HEAL_WAIT_MS) {
            let ms: u64 = parse(env::HEAL_WAIT_MS, &v)?;
            o.heal_wait = Some(std::time::Duration::from_millis(ms));
        }
        Ok(o)
    }

    /// Ranks on this node.
    pub fn ranks(&self) -> usize {
        self.ranks_per_node.unwrap_or(1)
    }

    /// The node configuration: these options, then torchrun's or Slurm's variables for what
    /// they leave open; the token from WIRETRAIN_TOKEN or the token file.
    pub fn node_config(&self) -> Result<NodeConfig, JobError> {
        let e = |what: &str, err: &dyn std::fmt::Display| JobError(format!("{what}: {err}"));
        let (nnodes, node_rank, master) = self.rendezvous()?;
        let token = self.token(nnodes)?;
        let mut cfg = NodeConfig::new(nnodes, node_rank, master, self.ranks(), token)
            .map_err(|err| e("node configuration", &err))?;
        if let Some(b) = self.bind {
            cfg.bind(b);
        }
        if let Some(j) = job_id_from_env() {
            cfg.job_id(j);
        }
        // An elastic launch's restart number: nodes of another epoch refuse each other.
        if let Some(e) = self.epoch {
            cfg.epoch(e);
        } else if let Some(v) = std::env::var(env::EPOCH).ok().filter(|v| !v.is_empty()) {
            cfg.epoch(parse(env::EPOCH, &v)?);
        }
        if let Some(p) = &self.addr_file {
            cfg.addr_file(p.clone());
        }
        if let Some(p) = &self.fingerprint_file {
            cfg.fingerprint_file(p.clone());
        }
        if let Some(h) = &self.master_sha256 {
            cfg.master_sha256(h)
                .map_err(|err| e("--master-sha256 (WIRETRAIN_MASTER_SHA256)", &err))?;
        }
        cfg.rendezvous_timeout(self.rendezvous_timeout)
            .collective_timeout(self.collective_timeout);
        self.tune(cfg.quic())?;
        if let Some(v) = self.protocol_version_override {
            cfg.protocol_version_override(v);
        }
        Ok(cfg)
    }

    /// Checks the transport flags (idle timeout, network threads, channels, congestion
    /// controller, MTU bound, frame size) without a job: a launcher refuses bad ones before it
    /// starts any node.
    pub fn check_tuning(&self) -> Result<(), JobError> {
        self.tune(&mut wiretrain_comm::QuicTuning::default())
    }

    /// Applies the transport flags to `q`.
    fn tune(&self, q: &mut wiretrain_comm::QuicTuning) -> Result<(), JobError> {
        let e = |what: &str, err: &dyn std::fmt::Display| JobError(format!("{what}: {err}"));
        q.idle_timeout(self.idle_timeout)
            .map_err(|err| e("--idle-timeout", &err))?;
        q.net_threads(self.net_threads.unwrap_or_else(default_net_threads))
            .map_err(|err| e("--net-threads", &err))?;
        q.channels(self.channels)
            .map_err(|err| e("--channels", &err))?;
        q.congestion(
            self.congestion
                .parse()
                .map_err(|err| e("--congestion", &err))?,
        );
        if let Some(m) = self.mtu {
            q.mtu_upper_bound(m).map_err(|err| e("--mtu", &err))?;
        }
        if let Some(f) = self.frame_bytes {
            q.frame_bytes(f).map_err(|err| e("--frame-bytes", &err))?;
        }
        Ok(())
    }

    /// (nodes, this node's rank if known, the coordinator's address): from the flags, else
    /// the environment a launcher set (torchrun, Slurm), else a one-node job.
    fn rendezvous(&self) -> Result<(usize, Option<usize>, SocketAddr), JobError> {
        let e = |what: &str, err: &dyn std::fmt::Display| JobError(format!("{what}: {err}"));
        Ok(match &self.master {
            Some(m) => {
                let nnodes = self.nnodes.ok_or_else(|| {
                    JobError("--nnodes is required with --master (or WIRETRAIN_NNODES)".into())
                })?;
                let addr = resolve(m).map_err(|err| e(&format!("--master {m}"), &err))?;
                (nnodes, self.node_rank, addr)
            }
            None => match EnvRendezvous::from_env(|k| std::env::var(k).ok())
                .map_err(|err| e("reading the rendezvous environment", &err))?
            {
                Some(env) => {
                    tracing::info!(source = env.source, "rendezvous from environment");
                    let addr = env
                        .master_addr()
                        .map_err(|err| e("the rendezvous environment", &err))?;
                    (
                        self.nnodes.unwrap_or(env.nnodes),
                        Some(self.node_rank.unwrap_or(env.node_rank)),
                        addr,
                    )
                }
                None => {
                    let n = self.nnodes.unwrap_or(1);
                    if n != 1 {
                        return Err(JobError(format!(
                            "--nnodes {n} needs --master host:port (or MASTER_ADDR / Slurm environment)"
                        )));
                    }
                    (1, Some(0), "127.0.0.1:0".parse().expect("static address"))
                }
            },
        })
    }

    /// The job's shared secret: WIRETRAIN_TOKEN or `--token-file` (the same one when both are
    /// given); a one-node job without either makes its own.
    fn token(&self, nnodes: usize) -> Result<Token, JobError> {
        let e = |what: &str, err: &dyn std::fmt::Display| JobError(format!("{what}: {err}"));
        let from_file = |p: &std::path::Path| -> Result<String, JobError> {
            let t = std::fs::read_to_string(p)
                .map_err(|err| e(&format!("--token-file {}", p.display()), &err))?;
            let t = t.trim();
            if t.is_empty() {
                return Err(JobError(format!(
                    "--token-file {}: the file is empty",
                    p.display()
                )));
            }
            warn_if_readable_by_others(p);
            Ok(t.to_string())
        };
        Ok(
            match (
                std::env::var(env::TOKEN).ok().filter(|t| !t.is_empty()),
                &self.token_file,
            ) {
                (Some(t), Some(p)) => {
                    // Neither silently wins: the same secret twice is fine, two secrets are refused.
                    if from_file(p)? != t {
                        return Err(JobError(format!(
                            "--token-file {}: both it and WIRETRAIN_TOKEN are set, to different \
                         tokens; give one (`wiretrain launch --local` sets WIRETRAIN_TOKEN \
                         itself: drop --token-file there)",
                            p.display()
                        )));
                    }
                    Token::from(t)
                }
                (Some(t), None) => Token::from(t),
                (None, Some(p)) => Token::from(from_file(p)?),
                (None, None) if nnodes == 1 => Token::generate(),
                (None, None) => {
                    return Err(JobError(
                    "a multi-node job needs a shared secret: set WIRETRAIN_TOKEN or pass --token-file on every node".into(),
                ));
                }
            },
        )
    }
}

/// The job's id from the environment: `WIRETRAIN_JOB_ID`, Slurm's `SLURM_JOB_ID` or torchrun's
/// `TORCHELASTIC_RUN_ID` (the first set; "none" counts as unset). It salts the job's TLS
/// identity, so processes of another job with the same token are not members.
pub fn job_id_from_env() -> Option<String> {
    [env::JOB_ID, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"]
        .iter()
        .find_map(|k| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty() && v != "none")
        })
}

/// A warning when the token file can be read by other users (it is the job's only secret).
fn warn_if_readable_by_others(p: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::metadata(p)
            && m.permissions().mode() & 0o077 != 0
        {
            tracing::warn!(
                "--token-file {}: readable by other users (mode {:o}); chmod 600 it",
                p.display(),
                m.permissions().mode() & 0o777
            );
        }
    }
    #[cfg(not(unix))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_variables_fill_the_options() {
        let vars = [
            (env::NNODES, "2"),
            (env::NODE_RANK, "1"),
            (env::MASTER, "127.0.0.1:29500"),
            (env::RANKS_PER_NODE, "3"),
            (env::DEVICE, "cpu,wgpu:1,wgpu"),
            (env::SHARE_DEVICE, "1"),
            (env::BIND, "127.0.0.2:0"),
        ];
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let o = JobOptions::from_vars(get).unwrap();
        assert_eq!((o.nnodes, o.node_rank, o.ranks()), (Some(2), Some(1), 3));
        assert_eq!(o.master.as_deref(), Some("127.0.0.1:29500"));
        assert_eq!(
            o.devices,
            vec![DeviceSpec::Cpu, DeviceSpec::WgpuIndex(1), DeviceSpec::Wgpu]
        );
        assert!(o.share_device);
        assert_eq!(o.bind, Some("127.0.0.2:0".parse().unwrap()));
    }

    #[test]
    fn bad_variables_name_themselves() {
        let e = JobOptions::from_vars(|k| (k == env::NNODES).then(|| "two".to_string()))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("WIRETRAIN_NNODES=\"two\""), "{e}");
        let e = JobOptions::from_vars(|k| (k == env::DEVICE).then(|| "gpu0".to_string()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("WIRETRAIN_DEVICE") && e.contains("not a device"),
            "{e}"
        );
    }

    #[test]
    fn the_coordinators_fingerprint_reaches_a_programs_node_config() {
        let dir = std::env::temp_dir().join(format!("wiretrain-job-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "0123456789abcdef0123456789abcdef").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let options = |sha: String| {
            let mut o = JobOptions::from_vars(|k| match k {
                env::NNODES => Some("2".to_string()),
                env::NODE_RANK => Some("1".to_string()),
                env::MASTER => Some("127.0.0.1:29500".to_string()),
                env::MASTER_SHA256 => Some(sha.clone()),
                _ => None,
            })
            .unwrap();
            o.token_file = Some(token.clone());
            o
        };
        let good = "ab".repeat(32);
        let o = options(good.clone());
        assert_eq!(o.master_sha256.as_deref(), Some(good.as_str()));
        o.node_config().unwrap();
        let e = options("not-hex".into())
            .node_config()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("WIRETRAIN_MASTER_SHA256") && e.contains("64 hex"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn network_threads_default_to_a_share_of_the_host_s_cores_under_a_local_launch() {
        assert_eq!(net_threads_for(2, None), 2);
        assert_eq!(net_threads_for(64, None), 2);
        assert_eq!(net_threads_for(2, Some(2)), 1);
        assert_eq!(net_threads_for(2, Some(4)), 1);
        assert_eq!(net_threads_for(16, Some(2)), 2);
        assert_eq!(net_threads_for(6, Some(3)), 2);
        assert_eq!(net_threads_for(8, Some(0)), 2);
    }
}
