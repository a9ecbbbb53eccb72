//! Flags every node-level subcommand shares: how to find the other nodes (flags, the
//! `WIRETRAIN_*` variables `wiretrain launch` sets, torchrun or Slurm environment), the job
//! token, and transport tuning. Turned into the library's [`JobOptions`].

use crate::cli::usage;
use anyhow::Result;
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use wiretrain::job::JobOptions;
use wiretrain_comm::NodeConfig;

#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// Number of node processes in the job (default: from torchrun/Slurm env, else 1).
    #[arg(long, env = "WIRETRAIN_NNODES")]
    pub nnodes: Option<usize>,
    /// This node's rank; 0 hosts the coordinator. Others may omit it to be assigned one.
    #[arg(long, env = "WIRETRAIN_NODE_RANK")]
    pub node_rank: Option<usize>,
    /// Coordinator address host:port (node 0 listens there).
    #[arg(long, env = "WIRETRAIN_MASTER")]
    pub master: Option<String>,
    /// Local address to bind (default: the master address on node 0, any port elsewhere).
    #[arg(long, env = "WIRETRAIN_BIND")]
    pub bind: Option<SocketAddr>,
    /// Ranks (devices) this node hosts, one thread each.
    #[arg(long, default_value_t = 1, env = "WIRETRAIN_RANKS_PER_NODE")]
    pub ranks_per_node: usize,
    /// File holding the job token (else WIRETRAIN_TOKEN; single-node jobs make one up).
    #[arg(long, env = "WIRETRAIN_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Seconds to wait for every node at rendezvous.
    #[arg(long, default_value_t = 60.0)]
    pub rendezvous_timeout: f64,
    /// Seconds any one collective may take before it fails naming what it waited for.
    #[arg(long, default_value_t = 120.0)]
    pub collective_timeout: f64,
    /// Seconds of silence after which a peer node is declared dead.
    #[arg(long, default_value_t = 10.0)]
    pub idle_timeout: f64,
    /// Upper bound of QUIC path-MTU discovery (UDP payload bytes; default 8952, jumbo frames:
    /// discovery settles on what the path carries, 1452+ on 1500-byte Ethernet).
    #[arg(long)]
    pub mtu: Option<u16>,
    /// Payload bytes per data frame.
    #[arg(long)]
    pub frame_bytes: Option<usize>,
    /// Threads for QUIC packet processing and crypto in this node process (at least one per
    /// local rank: each rank's inter-node transfers run there too). Default: 2, or under a
    /// local launch the host's cores shared among its node processes (at least 1).
    #[arg(long)]
    pub net_threads: Option<usize>,
    /// QUIC connections per lane and peer node: each rank's transfers to other nodes are split
    /// over this many connections (1..=16), so their packet work and crypto use more cores.
    /// Every node of a job must pass the same value.
    #[arg(long, default_value_t = 1)]
    pub channels: usize,
    /// QUIC congestion controller: cubic, bbr or newreno.
    #[arg(long, default_value = "cubic")]
    pub congestion: String,
    /// Node 0 writes its bound address here (used by local launchers).
    #[arg(long, hide = true, env = "WIRETRAIN_ADDR_FILE")]
    pub addr_file: Option<PathBuf>,
    /// Node 0 writes its certificate's SHA-256 here (used by local launchers).
    #[arg(long, hide = true, env = "WIRETRAIN_FINGERPRINT_FILE")]
    pub fingerprint_file: Option<PathBuf>,
    /// The coordinator's certificate SHA-256 (64 hex digits): this node pins it when it joins.
    #[arg(long, env = "WIRETRAIN_MASTER_SHA256")]
    pub master_sha256: Option<String>,
    /// Announce another protocol version (testing only).
    #[arg(long, hide = true)]
    pub protocol_version_override: Option<u32>,
}

fn secs(field: &str, v: f64) -> Result<Duration> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        usage!("--{field}: {v} is not a number of seconds in (0, 86400]");
    }
    Ok(Duration::from_secs_f64(v))
}

impl NodeArgs {
    /// The library's job options from these flags (devices are the subcommand's own flag).
    pub fn options(&self) -> Result<JobOptions> {
        Ok(JobOptions {
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master: self.master.clone(),
            bind: self.bind,
            ranks_per_node: Some(self.ranks_per_node),
            token_file: self.token_file.clone(),
            rendezvous_timeout: secs("rendezvous-timeout", self.rendezvous_timeout)?,
            collective_timeout: secs("collective-timeout", self.collective_timeout)?,
            idle_timeout: secs("idle-timeout", self.idle_timeout)?,
            mtu: self.mtu,
            frame_bytes: self.frame_bytes,
            net_threads: self.net_threads,
            channels: self.channels,
            congestion: self.congestion.clone(),
            addr_file: self.addr_file.clone(),
            fingerprint_file: self.fingerprint_file.clone(),
            master_sha256: self.master_sha256.clone(),
            protocol_version_override: self.protocol_version_override,
            ..JobOptions::default()
        })
    }

    /// Builds the node configuration from flags, then environment.
    pub fn config(&self) -> Result<NodeConfig> {
        Ok(self.options()?.node_config()?)
    }
}
