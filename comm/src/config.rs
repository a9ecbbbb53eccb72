//! Node configuration: where to rendezvous, what this node hosts, and transport tuning.
//! Builders in the quinn style (`&mut self -> &mut Self`), defaults from `Default`, and
//! rendezvous settings read from flags, torchrun-style or Slurm environment variables.

use crate::error::ConfigError;
use crate::tls::Token;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Congestion controller of the QUIC connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Congestion {
    /// quinn's default, like TCP's.
    #[default]
    Cubic,
    /// Model-based; keeps a shaped link fuller (quinn marks it experimental).
    Bbr,
    /// The classic loss-based controller of RFC 6582.
    NewReno,
}

impl std::str::FromStr for Congestion {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "cubic" => Ok(Self::Cubic),
            "bbr" => Ok(Self::Bbr),
            "newreno" => Ok(Self::NewReno),
            other => Err(ConfigError::Invalid {
                field: "congestion",
                reason: format!("{other:?} is not cubic, bbr or newreno"),
            }),
        }
    }
}

/// QUIC transport tuning. Defaults suit loopback up to 100 GbE with a few ms of RTT: the
/// windows cover the bandwidth-delay product of 10 Gbit/s at 50 ms.
#[derive(Debug, Clone)]
pub struct QuicTuning {
    pub(crate) stream_window: u64,
    pub(crate) conn_window: u64,
    /// Receive windows (stream, connection) of connections this node accepts, where they
    /// differ from those it dials.
    pub(crate) accepted_windows: Option<(u64, u64)>,
    pub(crate) send_window: u64,
    pub(crate) idle_timeout: Duration,
    pub(crate) keep_alive: Duration,
    pub(crate) mtu_upper_bound: u16,
    pub(crate) udp_buffer_bytes: usize,
    pub(crate) frame_bytes: usize,
    pub(crate) net_threads: usize,
    pub(crate) channels: usize,
    pub(crate) congestion: Congestion,
}

impl Default for QuicTuning {
    fn default() -> Self {
        Self {
            stream_window: 32 << 20,
            conn_window: 128 << 20,
            accepted_windows: None,
            send_window: 128 << 20,
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(1),
            // Jumbo frames (9000-byte IPv6 MTU) where the path has them; path-MTU discovery
            // probes up to this and stays at what gets through (1452+ on 1500-byte Ethernet).
            mtu_upper_bound: 8952,
            udp_buffer_bytes: 8 << 20,
            frame_bytes: 1 << 20,
            net_threads: 2,
            channels: 1,
            congestion: Congestion::Cubic,
        }
    }
}

impl QuicTuning {
    /// Per-stream receive window (bytes).
    pub fn stream_window(&mut self, v: u64) -> &mut Self {
        self.stream_window = v;
        self
    }
    /// Per-connection receive window (bytes).
    pub fn conn_window(&mut self, v: u64) -> &mut Self {
        self.conn_window = v;
        self
    }
    /// Receive windows (per stream, per connection) of the connections this node accepts, in
    /// place of [`Self::stream_window`] and [`Self::conn_window`] there (the fault tests use it
    /// to make a node that grants no credit to its mesh peers only).
    pub fn accepted_windows(&mut self, stream: u64, conn: u64) -> &mut Self {
        self.accepted_windows = Some((stream, conn));
        self
    }
    /// Per-connection send buffer (bytes).
    pub fn send_window(&mut self, v: u64) -> &mut Self {
        self.send_window = v;
        self
    }
    /// A peer silent for this long is declared dead (keep-alives keep healthy links busy).
    pub fn idle_timeout(&mut self, v: Duration) -> Result<&mut Self, ConfigError> {
        if v < Duration::from_millis(500) || v > Duration::from_secs(600) {
            return Err(ConfigError::Invalid {
                field: "idle_timeout",
                reason: format!("{v:?} is outside 0.5 s ..= 600 s"),
            });
        }
        self.idle_timeout = v;
        self.keep_alive = (v / 4).min(Duration::from_secs(2));
        Ok(self)
    }
    /// Upper bound for path MTU discovery (bytes of UDP payload).
    pub fn mtu_upper_bound(&mut self, v: u16) -> Result<&mut Self, ConfigError> {
        if v < 1200 {
            return Err(ConfigError::Invalid {
                field: "mtu_upper_bound",
                reason: format!("{v} is below QUIC's minimum of 1200"),
            });
        }
        if v > 65_507 {
            return Err(ConfigError::Invalid {
                field: "mtu_upper_bound",
                reason: format!("{v} is above the largest UDP payload (65 507 bytes)"),
            });
        }
        self.mtu_upper_bound = v;
        Ok(self)
    }
    /// Congestion controller.
    pub fn congestion(&mut self, v: Congestion) -> &mut Self {
        self.congestion = v;
        self
    }
    /// Threads of the node's network runtime (QUIC packet processing and crypto); the runtime
    /// gets at least one per local rank, whose inter-node lane runs there.
    pub fn net_threads(&mut self, v: usize) -> Result<&mut Self, ConfigError> {
        if !(1..=64).contains(&v) {
            return Err(ConfigError::Invalid {
                field: "net_threads",
                reason: format!("{v} is outside 1..=64"),
            });
        }
        self.net_threads = v;
        Ok(self)
    }
    /// QUIC connections per lane and peer node (1..=16). Each lane runs its passes split over
    /// this many channels, each on its own connection, so that the packet work and crypto of
    /// one lane (quinn drives each connection on one task) and its copies and reductions
    /// spread over more cores. Every node of a job must use the same count.
    pub fn channels(&mut self, v: usize) -> Result<&mut Self, ConfigError> {
        if !(1..=16).contains(&v) {
            return Err(ConfigError::Invalid {
                field: "channels",
                reason: format!("{v} is outside 1..=16"),
            });
        }
        self.channels = v;
        Ok(self)
    }
    /// Payload bytes per data frame (the pipelining unit).
    pub fn frame_bytes(&mut self, v: usize) -> Result<&mut Self, ConfigError> {
        if !(4096..=crate::wire::MAX_FRAME_PAYLOAD).contains(&v) || !v.is_multiple_of(4) {
            return Err(ConfigError::Invalid {
                field: "frame_bytes",
                reason: format!(
                    "{v} must be a multiple of 4 in 4096..={}",
                    crate::wire::MAX_FRAME_PAYLOAD
                ),
            });
        }
        self.frame_bytes = v;
        Ok(self)
    }
}

/// Everything a node needs to join a job.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub(crate) nnodes: usize,
    pub(crate) node_rank: Option<usize>,
    pub(crate) master: SocketAddr,
    pub(crate) bind: SocketAddr,
    pub(crate) devices: Vec<String>,
    pub(crate) token: Token,
    pub(crate) rendezvous_timeout: Duration,
    pub(crate) collective_timeout: Duration,
    pub(crate) addr_file: Option<PathBuf>,
    /// Node 0 writes its certificate's SHA-256 here (before the address file).
    pub(crate) fingerprint_file: Option<PathBuf>,
    /// The coordinator's certificate SHA-256, when known beforehand: the joiner pins it.
    pub(crate) master_sha256: Option<String>,
    pub(crate) quic: QuicTuning,
    pub(crate) protocol_version_override: Option<u32>,
    /// The job's nonce, mixed into the job CA with the token (see [`NodeConfig::job_id`]).
    pub(crate) job_id: Option<String>,
    /// The job's epoch: 0 at the start, one more at each elastic restart.
    pub(crate) epoch: u64,
    /// Unit tests: (rank, seq) of the collective whose communication thread panics.
    #[cfg(test)]
    pub(crate) test_panic_at: Option<(usize, u64)>,
}

impl NodeConfig {
    /// A node of a multi-node job. `node_rank` 0 hosts the coordinator at `master`; other nodes
    /// may leave it `None` and get one assigned in order of arrival.
    pub fn new(
        nnodes: usize,
        node_rank: Option<usize>,
        master: SocketAddr,
        ranks: usize,
        token: Token,
    ) -> Result<Self, ConfigError> {
        if nnodes == 0 {
            return Err(ConfigError::Invalid {
                field: "nnodes",
                reason: "must be at least 1".into(),
            });
        }
        if let Some(r) = node_rank
            && r >= nnodes
        {
            return Err(ConfigError::Invalid {
                field: "node_rank",
                reason: format!("{r} is not below nnodes = {nnodes}"),
            });
        }
        if ranks == 0 || ranks > 1024 {
            return Err(ConfigError::Invalid {
                field: "ranks_per_node",
                reason: format!("{ranks} is outside 1..=1024"),
            });
        }
        if token.expose().is_empty() {
            return Err(ConfigError::Missing {
                field: "job token",
                hint: "set WIRETRAIN_TOKEN or pass --token-file",
            });
        }
        token
            .check_strength()
            .map_err(|reason| ConfigError::Invalid {
                field: "job token",
                reason,
            })?;
        let bind = if node_rank == Some(0) {
            master
        } else {
            let ip: std::net::IpAddr = if master.is_ipv4() {
                std::net::Ipv4Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            };
            SocketAddr::new(ip, 0)
        };
        Ok(Self {
            nnodes,
            node_rank,
            master,
            bind,
            devices: (0..ranks).map(|i| format!("host:{i}")).collect(),
            token,
            rendezvous_timeout: Duration::from_secs(60),
            collective_timeout: Duration::from_secs(120),
            addr_file: None,
            fingerprint_file: None,
            master_sha256: None,
            quic: QuicTuning::default(),
            protocol_version_override: None,
            job_id: None,
            epoch: 0,
            #[cfg(test)]
            test_panic_at: None,
        })
    }

    /// A one-node job with `ranks` ranks on loopback. No other node is ever admitted, so the
    /// token is not checked for strength here; pass [`Token::generate`].
    pub fn single_node(ranks: usize, token: Token) -> Self {
        let strong = Token::generate();
        let mut c = Self::new(1, Some(0), "127.0.0.1:0".parse().unwrap(), ranks, strong)
            .expect("valid single-node config");
        c.token = token;
        c.rendezvous_timeout = Duration::from_secs(5);
        c
    }

    /// The local address to bind (default: the master address on node 0, any port elsewhere).
    pub fn bind(&mut self, addr: SocketAddr) -> &mut Self {
        self.bind = addr;
        self
    }
    /// One description per local rank (its device); sets the rank count.
    pub fn devices(&mut self, devices: Vec<String>) -> Result<&mut Self, ConfigError> {
        if devices.is_empty() {
            return Err(ConfigError::Invalid {
                field: "devices",
                reason: "a node hosts at least one rank".into(),
            });
        }
        self.devices = devices;
        Ok(self)
    }
    /// The deadline of each phase of joining the job: the coordinator's wait for every node, a
    /// joiner's attempts to reach it, the mesh and lane set-up (default 60 s; 5 s for
    /// [`Self::single_node`]).
    pub fn rendezvous_timeout(&mut self, v: Duration) -> &mut Self {
        self.rendezvous_timeout = v;
        self
    }
    /// The deadline of each collective, and of the goodbye at shutdown (default 120 s; a
    /// group can change its own with [`crate::ProcessGroup::set_timeout`]).
    pub fn collective_timeout(&mut self, v: Duration) -> &mut Self {
        self.collective_timeout = v;
        self
    }
    /// Node 0 writes its bound address to this file once it listens (for local launchers).
    pub fn addr_file(&mut self, p: PathBuf) -> &mut Self {
        self.addr_file = Some(p);
        self
    }
    /// Node 0 writes the SHA-256 of its node certificate to this file (hex, before it writes
    /// the address file), for a launcher to hand the other nodes as [`Self::master_sha256`].
    pub fn fingerprint_file(&mut self, p: PathBuf) -> &mut Self {
        self.fingerprint_file = Some(p);
        self
    }
    /// Pins the coordinator: a joiner then accepts only the node certificate with this SHA-256
    /// (64 hex digits, as node 0 writes to its [`Self::fingerprint_file`]) at the handshake,
    /// instead of any certificate of the job CA. `launch` passes it to every node it starts.
    pub fn master_sha256(&mut self, hex: &str) -> Result<&mut Self, ConfigError> {
        let hex = hex.trim();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ConfigError::Invalid {
                field: "master_sha256",
                reason: format!(
                    "{hex:?} is not a SHA-256 fingerprint (64 hex digits, as node 0 writes it)"
                ),
            });
        }
        self.master_sha256 = Some(hex.to_ascii_lowercase());
        Ok(self)
    }
    /// A nonce of this job (the launcher's, Slurm's job id), the same on every node: mixed into
    /// the job CA with the token, so a process of an earlier job that used the same token is
    /// not a member of this one. Nodes with different job ids refuse each other as they refuse
    /// another token.
    pub fn job_id(&mut self, id: impl Into<String>) -> &mut Self {
        self.job_id = Some(id.into());
        self
    }

    /// The job's epoch (0 at the start; an elastic launcher counts its restarts here). The
    /// coordinator refuses a node of another epoch, naming both: a stale process of an
    /// earlier epoch never joins the job that replaced it.
    pub fn epoch(&mut self, e: u64) -> &mut Self {
        self.epoch = e;
        self
    }

    /// Announce another protocol version at rendezvous (for testing version checks only).
    #[doc(hidden)]
    pub fn protocol_version_override(&mut self, v: u32) -> &mut Self {
        self.protocol_version_override = Some(v);
        self
    }
    /// The QUIC transport tuning, to change in place.
    pub fn quic(&mut self) -> &mut QuicTuning {
        &mut self.quic
    }
    /// Number of ranks this node hosts (one per device description).
    pub fn ranks(&self) -> usize {
        self.devices.len()
    }
    /// Number of nodes in the job.
    pub fn nnodes(&self) -> usize {
        self.nnodes
    }
    /// This node's node rank, or `None` when the coordinator assigns one at rendezvous.
    pub fn node_rank(&self) -> Option<usize> {
        self.node_rank
    }
    /// The coordinator's address (node 0's QUIC endpoint).
    pub fn master(&self) -> SocketAddr {
        self.master
    }
}

mod env;
pub use env::{EnvRendezvous, first_slurm_host, resolve};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        let m: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let t = || Token::generate();
        assert!(NodeConfig::new(0, None, m, 1, t()).is_err());
        assert!(NodeConfig::new(2, Some(2), m, 1, t()).is_err());
        assert!(NodeConfig::new(2, Some(1), m, 0, t()).is_err());
        assert!(NodeConfig::new(2, Some(1), m, 1, "".into()).is_err());
        let weak = NodeConfig::new(2, Some(1), m, 1, "t".into()).unwrap_err();
        assert!(weak.to_string().contains("openssl rand -hex 32"), "{weak}");
        let mut c = NodeConfig::new(2, Some(0), m, 2, t()).unwrap();
        assert_eq!(c.bind, m);
        assert!(c.quic().mtu_upper_bound(100).is_err());
        assert!(c.quic().mtu_upper_bound(65_508).is_err());
        assert!(c.quic().mtu_upper_bound(65_507).is_ok());
        assert!(c.quic().frame_bytes(3).is_err());
        assert!(c.quic().channels(0).is_err());
        assert!(c.quic().channels(17).is_err());
        assert!(c.quic().channels(4).is_ok());
        assert!(c.quic().idle_timeout(Duration::from_millis(1)).is_err());
    }
}
